"""The harness measures its own pauses and keeps the cyclic collector from causing them.

A stopped harness loop timestamps every chunk it reads afterwards late, which looks like a
server's underrun (see runner.HarnessWatch); these tests stop it on purpose and check that the
run's summary says when, and by how much.
"""

import asyncio
import gc
import time
from dataclasses import replace

from ttsbuild.bench.fakeserver import FakeSpeechServer, Reply, tone
from ttsbuild.bench.runner import HARNESS_STALL_S, HarnessWatch, run_benchmark
from ttsbuild.bench.schedule import ArrivalProcess

from .helpers import settings_for


def _watch_through(blocks: list[tuple[float, float]]) -> HarnessWatch:
    """Run the probe on a fresh loop while coroutines block the loop at the given times
    (seconds after the origin) for the given durations."""
    watch = HarnessWatch()

    async def main() -> None:
        watch.origin_perf = time.perf_counter()
        probe = asyncio.create_task(watch.probe())
        for at, seconds in blocks:
            await asyncio.sleep(max(0.0, at - watch.at(time.perf_counter())))
            time.sleep(seconds)  # the loop is stopped: nothing else runs
        await asyncio.sleep(0.05)
        probe.cancel()

    with watch.collector_held_back():
        asyncio.run(main())
    return watch


def test_a_stopped_loop_is_reported_with_its_time_and_length():
    watch = _watch_through([(0.1, 0.06), (0.3, 0.035)])
    stalls = [s for s in watch.summary()["stalls"] if s[0] == "event loop"]
    assert len(stalls) >= 2, stalls
    (_, at1, lag1), (_, at2, lag2) = sorted(stalls, key=lambda s: -s[2])[:2]
    # the longest is the 60 ms block, reported when the probe woke after it (~0.16 s)
    assert 0.055 <= lag1 <= 0.2 and 0.14 <= at1 <= 0.4
    assert 0.03 <= lag2 <= 0.2 and at2 >= 0.3
    assert watch.summary()["loop_lag_s"]["max"] >= 0.055


def test_a_quiet_loop_lists_no_stall_and_nothing_stays_frozen():
    frozen_before = gc.get_freeze_count()
    watch = _watch_through([])
    summary = watch.summary()
    assert summary["loop_lag_s"]["count"] >= 5
    # a 2-core CI machine may wake the loop late now and then, but not by 10 ms every time
    assert summary["loop_lag_s"]["p50"] < HARNESS_STALL_S
    assert gc.get_freeze_count() == frozen_before


def test_collector_pauses_are_timed_and_the_run_freezes_what_was_alive():
    watch = HarnessWatch()
    garbage = []
    with watch.collector_held_back():
        assert gc.get_freeze_count() > 0  # the heap alive at the start is out of the scans
        for _ in range(1000):  # cyclic garbage made during the run is still collected
            a: list = []
            a.append(a)
            garbage.append(a)
        del a
        garbage.clear()
        assert gc.collect() >= 1000
    assert any(gen == 2 and seconds > 0 for _, gen, seconds in watch.gc_pauses)


def _speech(_request):
    return Reply(chunks=[(0.0, tone(0.1)), (0.02, tone(0.1))])


def test_a_run_reports_the_harness_section():
    with FakeSpeechServer(_speech) as server:
        settings = settings_for(
            server.http_url, rate=20.0, duration_s=0.5, arrival=ArrivalProcess.constant
        )
        result = run_benchmark(settings, ["one", "two", "three"])
    assert [r.index for r in result.records] == list(range(len(result.records)))
    assert result.summary["requests"]["completed"] == len(result.records) == 10
    harness = result.summary["harness"]
    assert harness["loop_lag_s"]["count"] >= 50  # 0.5 s of 5 ms probes, and the tail
    assert harness["stalls_over_s"] == HARNESS_STALL_S
    for what, at, seconds in harness["stalls"]:
        assert seconds >= HARNESS_STALL_S and at > -1.0 and what
    # and the run's table shows it
    from rich.console import Console

    from ttsbuild.bench.report import run_table

    console = Console(record=True, width=200)
    console.print(run_table(result.summary, "run"))
    row = next(line for line in console.export_text().splitlines() if "harness loop lag" in line)
    assert f"{len(harness['stalls'])} over 10 ms" in row


def test_two_worker_processes_send_the_schedule_on_one_origin():
    """The schedule split over two processes: every request once, in schedule order, each sent
    at its own time (so the workers share the origin), the counters summed, and the harness
    section from both workers."""
    from ttsbuild.bench.fakeserver import serve_in_subprocess
    from ttsbuild.bench.runner import RunProgress

    with serve_in_subprocess() as (http_url, _ws_url):
        settings = replace(
            settings_for(http_url, rate=40.0, duration_s=1.0, arrival=ArrivalProcess.poisson),
            workers=2,
        )
        progress = RunProgress(planned=0)
        result = run_benchmark(settings, ["one two", "three four five"], progress)
    records = result.records
    assert [r.index for r in records] == list(range(len(records)))
    assert len(records) == result.summary["requests"]["sent"] > 20
    assert all(r.outcome == "ok" for r in records), {r.outcome for r in records}
    assert progress.sent == progress.finished == len(records) and progress.not_ok == 0
    # sent on time by either worker: a worker on its own origin would be ~0.5 s early or late
    lags = sorted(r.dispatch_lag_s for r in records)
    assert lags[0] > -0.002 and lags[len(lags) // 2] < 0.02, lags[:3] + lags[-3:]
    assert {r.index % 2 for r in records} == {0, 1}
    harness = result.summary["harness"]
    assert harness["workers"] == 2 and harness["loop_lag_s"]["count"] >= 2 * 150


def test_a_worker_that_fails_is_reported_not_waited_for():
    """A request the server refuses is a failed request, not a failed worker; a worker that
    cannot run its share (here: settings without a target) ends the run with its error."""
    import pytest

    from ttsbuild.bench.fakeserver import serve_in_subprocess

    with serve_in_subprocess() as (http_url, _ws_url):
        settings = replace(settings_for(http_url, rate=5.0, duration_s=0.5), workers=2)
        settings = replace(settings, target=replace(settings.target, url="http://127.0.0.1:1/"))
        started = time.perf_counter()
        result = run_benchmark(settings, ["one"])
    # a refused connection is a failed request, not a failed worker: the run completes
    assert result.summary["requests"]["failed"] == len(result.records) > 0
    assert time.perf_counter() - started < 30
    with pytest.raises(RuntimeError, match="bench worker . failed: AttributeError"):
        run_benchmark(replace(settings, target=None), ["one"])


def _record(index: int, scheduled_s: float, underrun_at: float | None, stall_s: float = 0.005):
    from ttsbuild.bench.metrics import RequestRecord

    return RequestRecord(
        index=index, warmup=False, scheduled_s=scheduled_s, voice="a", chars=10, outcome="ok",
        http_status=200, error=None, dispatch_lag_s=0.0, headers_s=0.005, ttfb_s=0.01,
        first_playable_s=0.03, ttfa_s=0.03, leading_silence_s=0.0, e2e_s=1.0, audio_s=1.0,
        rtf=1.0, underruns=int(underrun_at is not None), stall_s=stall_s if underrun_at else 0.0,
        underrun_at_s=[underrun_at] if underrun_at is not None else [], audio_arrival_s=None,
        text_done_to_audio_s=None, sample_rate=24000, body_bytes=48000, text="x" * 10,
    )  # fmt: skip


def test_underruns_beside_a_harness_stall_are_named():
    from ttsbuild.bench.runner import underruns_beside_stalls

    watch = HarnessWatch(lags=[(0.5, 0.001), (2.15, 0.04), (5.0, 0.012)])  # stopped 2.11-2.15 s
    records = [
        # ran dry at 2.0 + 0.03 + 0.08 = 2.11 s, its chunk 5 ms late: inside the stop
        _record(0, 2.0, 0.08),
        # ran dry at 1.11 s: the harness was running then
        _record(1, 1.0, 0.08),
        # no underrun at all, though it played through the stop
        _record(2, 2.05, None),
        # ran dry at 4.99 s, 20 ms late: the 12 ms stop at 4.988-5.0 s overlaps
        _record(3, 4.88, 0.08, stall_s=0.02),
        # ran dry at 5.2 s: after the stop ended
        _record(4, 5.09, 0.08),
    ]
    assert underruns_beside_stalls(records, [watch]) == 2
    assert underruns_beside_stalls(records, [HarnessWatch(lags=[(2.15, 0.004)])]) == 0


def test_every_stall_is_counted_though_only_the_first_hundred_are_listed():
    from ttsbuild.bench.runner import harness_summary

    watch = HarnessWatch(lags=[(0.01 * i, 0.011 + 1e-5 * i) for i in range(150)] + [(2.0, 0.002)])
    summary = harness_summary([watch])
    assert summary["stall_count"] == 150
    assert len(summary["stalls"]) == 100
    assert summary["stalls"][0] == ["event loop", 0.0, 0.011]  # earliest first
