"""The open-loop run: one asyncio event loop sends every planned request at its scheduled
absolute time, whatever the server is doing, and collects per-request records.

Why open loop: a closed-loop client (N workers, each waiting for its previous reply) slows
down with the server and so under-reports latency exactly when the server is overloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ttsbuild import __version__
from ttsbuild.bench.client import (
    HttpClient,
    Outcome,
    Timeouts,
    Trace,
    http_speech,
    http_speech_aiohttp,
    open_session,
    split_words,
    ws_speech,
)
from ttsbuild.bench.metrics import RequestRecord, analyse, distribution, summarise
from ttsbuild.bench.schedule import ArrivalProcess, PlannedRequest, plan_requests
from ttsbuild.bench.target import Mode, Target

# The first arrival is scheduled this long after the loop starts, so client set-up never
# counts as dispatch lag.
_START_LEAD_S = 0.05
# How long before each send the scheduler stops sleeping and yields in a loop instead.
_SPIN_S = 0.001
# A timed wait on Linux may end this share of its length late (poll/epoll timer slack, 0.1 %),
# counted twice for margin.
_TIMER_SLACK = 0.002
# The harness's own pauses are timestamped as the server's: while its event loop is stopped
# (its cyclic collector, or a busy loop) chunks wait unread in the socket, and are read late
# all at once, which looks exactly like a server's late chunks. On the H200 at 100 req/s the
# only underruns of two 60 s runs were five streams each in their first 80 ms of playback
# while, by the server's own clock, every chunk had >= 20 ms to spare; on a 2-core CPU the
# same schedule stops this harness for 25-31 ms in a full collection ~7 s in. So during a run
# the objects alive are frozen out of the collector's scans every _FREEZE_EVERY_S (a full
# collection then scans only the last half second's survivors; young cycles are still
# collected), and the loop's own lateness is measured every _PROBE_S and reported
# (summary["harness"]): a run whose harness stalled says so.
_PROBE_S = 0.005
_FREEZE_EVERY_S = 0.5
HARNESS_STALL_S = 0.01  # harness pauses at least this long are listed with their times
_MAX_STALLS_LISTED = 100


@dataclass(frozen=True)
class RunSettings:
    target: Target
    rate: float  # offered load, requests/second
    duration_s: float  # measured window, after warmup
    warmup_s: float  # sent, excluded from summaries
    seed: int
    arrival: ArrivalProcess
    voices: tuple[str, ...]
    word_interval_s: float  # WS mode: cadence of input.append messages
    timeouts: Timeouts
    max_connections: int  # HTTP connection pool size: must exceed peak concurrency
    gpu_hour_usd: float | None
    gpus: int
    dataset: str  # path of the prompt file, for the record
    http_client: str = HttpClient.aiohttp  # the library HTTP requests go through
    # Processes sending the schedule, each with its own event loop (request i from worker
    # i % workers): one loop reading ~100 concurrent PCM streams at 100 req/s ran 3.8-7 ms late
    # at p99 on the H200 host (summary["harness"]), and a chunk read late looks like the
    # server's.
    workers: int = 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target"] = self.target.to_json()
        return data


@dataclass
class RunProgress:
    """Counters a UI may poll while the run is going; only ever incremented by the loop."""

    planned: int
    sent: int = 0
    finished: int = 0
    not_ok: int = 0


@dataclass
class RunResult:
    settings: RunSettings
    records: list[RequestRecord]
    summary: dict[str, Any]
    started_unix: float
    prompts_used: int = field(default=0)


def plan(settings: RunSettings, prompts: list[str]) -> list[PlannedRequest]:
    return plan_requests(
        prompts,
        list(settings.voices),
        settings.rate,
        settings.duration_s,
        settings.warmup_s,
        settings.seed,
        settings.arrival,
    )


def run_benchmark(
    settings: RunSettings, prompts: list[str], progress: RunProgress | None = None
) -> RunResult:
    """Run the whole schedule (blocking) and summarise the measured window."""
    planned = plan(settings, prompts)
    progress = progress or RunProgress(planned=len(planned))
    started_unix = time.time()
    if settings.workers > 1:
        records, watches = _run_in_workers(settings, planned, progress)
    else:
        watch = HarnessWatch()
        with watch.collector_held_back():
            records = asyncio.run(_run(settings, planned, progress, watch))
        watches = [watch]
    summary = summarise(records, settings.duration_s, settings.gpu_hour_usd, settings.gpus)
    summary["harness"] = harness_summary(watches)
    # counted all the same (the capacity rule does not excuse them), but named
    summary["underruns"]["beside_harness_stall"] = underruns_beside_stalls(records, watches)
    return RunResult(settings, records, summary, started_unix, len(planned))


def underruns_beside_stalls(records: list[RequestRecord], watches: list[HarnessWatch]) -> int:
    """Measured requests whose first underrun came while the harness itself was stopped: one of
    its loop's pauses of HARNESS_STALL_S or more overlaps the span from 20 ms before the player
    ran dry to the late chunk's arrival (the request's stall). Such an underrun may be the
    harness's own (it read the chunk late), not the server's."""
    stopped = [(at - lag, at) for w in watches for at, lag in w.lags if lag >= HARNESS_STALL_S]
    count = 0
    for r in records:
        if r.warmup or not r.underruns or r.first_playable_s is None or not r.underrun_at_s:
            continue
        dry = r.scheduled_s + r.first_playable_s + r.underrun_at_s[0]
        late_by = r.stall_s if r.underruns == 1 and r.stall_s else 0.001
        count += any(a < dry + late_by and b > dry - 0.02 for a, b in stopped)
    return count


@dataclass
class HarnessWatch:
    """The harness's own pauses during a run, on the schedule's clock (seconds since the run's
    origin, comparable with RequestRecord.scheduled_s): the event loop's lateness at each
    probe, and the cyclic collector's pauses."""

    lags: list[tuple[float, float]] = field(default_factory=list)  # (at, seconds late)
    gc_pauses: list[tuple[float, int, float]] = field(default_factory=list)  # (at, gen, s)
    origin_perf: float | None = None  # perf_counter of the schedule's origin

    def at(self, perf: float) -> float:
        return perf - (self.origin_perf if self.origin_perf is not None else perf)

    @contextlib.contextmanager
    def collector_held_back(self):
        """Freeze what is alive now out of the collector's scans and time its pauses; on exit,
        unfreeze (unless something froze objects before: theirs stay frozen)."""
        frozen_before = gc.get_freeze_count()
        started: list[float] = []

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                end = time.perf_counter()
                self.gc_pauses.append((self.at(started[0]), info["generation"], end - started[0]))
                started.clear()

        gc.collect()
        gc.freeze()
        gc.callbacks.append(on_gc)
        try:
            yield self
        finally:
            gc.callbacks.remove(on_gc)
            if frozen_before == 0:
                gc.unfreeze()

    async def probe(self) -> None:
        """Wake every _PROBE_S, recording how late; freeze survivors every _FREEZE_EVERY_S."""
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        while True:
            asked = loop.time()
            await asyncio.sleep(_PROBE_S)
            now = loop.time()
            self.lags.append((self.at(time.perf_counter()), max(0.0, now - asked - _PROBE_S)))
            if now - frozen_at >= _FREEZE_EVERY_S:
                gc.freeze()
                frozen_at = now

    def summary(self) -> dict[str, Any]:
        return harness_summary([self])


def harness_summary(watches: list[HarnessWatch]) -> dict[str, Any]:
    """The run's harness section: every worker's loop lag and collector pauses together, and
    each pause of HARNESS_STALL_S or more (named by worker where there are several)."""
    lags = [lag for w in watches for _, lag in w.lags]
    pauses = [s for w in watches for _, _, s in w.gc_pauses]
    stalls = []
    for k, w in enumerate(watches):
        who = f"worker {k}: " if len(watches) > 1 else ""
        stalls += [(at, f"{who}event loop", lag) for at, lag in w.lags if lag >= HARNESS_STALL_S]
        stalls += [(at, f"{who}collector gen {g}", s) for at, g, s in w.gc_pauses
                   if s >= HARNESS_STALL_S]  # fmt: skip
    stalls.sort()
    return {
        "workers": len(watches),
        "loop_lag_s": distribution(lags),
        "gc_pause_s": distribution(pauses),
        # (what, seconds since the origin, seconds): match them with requests' scheduled_s
        "stalls": [[what, round(at, 4), round(s, 4)] for at, what, s in stalls][
            :_MAX_STALLS_LISTED
        ],
        "stall_count": len(stalls),  # all of them: the list holds the first _MAX_STALLS_LISTED
        "stalls_over_s": HARNESS_STALL_S,
    }


class _SharedProgress:
    """A worker's RunProgress counters in shared memory (its own three slots of `counts`),
    summed by the parent for the UI."""

    def __init__(self, counts: Any, worker: int):
        self._counts, self._base = counts, 3 * worker

    def _get(self, i: int) -> int:
        return self._counts[self._base + i]

    def _set(self, i: int, value: int) -> None:
        self._counts[self._base + i] = value

    sent = property(lambda self: self._get(0), lambda self, v: self._set(0, v))
    finished = property(lambda self: self._get(1), lambda self, v: self._set(1, v))
    not_ok = property(lambda self: self._get(2), lambda self, v: self._set(2, v))


# A worker process's start (spawn, imports, its HTTP session) before the first send: the
# parent fixes the schedule's origin this long after every worker said it is ready.
_WORKER_LEAD_S = 0.5


def _worker_main(
    settings: RunSettings, planned: list[PlannedRequest], conn: Any, counts: Any, worker: int
) -> None:
    """One worker process: its share of the schedule on its own event loop, from the origin
    the parent sends (a perf_counter time: CLOCK_MONOTONIC, the same in every process)."""
    try:
        conn.send("ready")
        origin_perf = conn.recv()
        watch = HarnessWatch()
        progress = _SharedProgress(counts, worker)
        with watch.collector_held_back():
            records = asyncio.run(_run(settings, planned, progress, watch, origin_perf))
        conn.send(("ok", records, watch.lags, watch.gc_pauses))
    except Exception as err:  # the parent reports it rather than waiting for the results
        conn.send(("error", f"{type(err).__name__}: {err}", None, None))


def _run_in_workers(
    settings: RunSettings, planned: list[PlannedRequest], progress: RunProgress
) -> tuple[list[RequestRecord], list[HarnessWatch]]:
    """The schedule split over settings.workers processes (request i to worker i % workers),
    all sending on one origin; their records merged in schedule order."""
    import multiprocessing
    import threading

    n = settings.workers
    context = multiprocessing.get_context("spawn")  # no inherited event loop or threads
    counts = context.Array("q", 3 * n, lock=False)
    pipes = [context.Pipe() for _ in range(n)]
    procs = [
        context.Process(
            target=_worker_main, args=(settings, planned[k::n], theirs, counts, k), daemon=True
        )
        for k, (_, theirs) in enumerate(pipes)
    ]
    stop = threading.Event()

    def pull() -> None:  # the parent's counters: the workers' summed
        progress.sent, progress.finished, progress.not_ok = (sum(counts[i::3]) for i in range(3))

    def mirror() -> None:  # ...kept current for a UI polling them
        while not stop.wait(0.1):
            pull()

    for proc in procs:
        proc.start()
    watcher = threading.Thread(target=mirror, name="bench-progress", daemon=True)
    watcher.start()
    try:
        for (ours, _), proc in zip(pipes, procs, strict=True):
            if not ours.poll(60) or ours.recv() != "ready":
                raise RuntimeError(f"bench worker {proc.name} did not start")
        origin_perf = time.perf_counter() + _WORKER_LEAD_S
        for ours, _ in pipes:
            ours.send(origin_perf)
        # every request ends by its total timeout, after the last send
        wait_s = _WORKER_LEAD_S + settings.warmup_s + settings.duration_s
        wait_s += settings.timeouts.total_s + 60.0
        records: list[RequestRecord] = []
        watches = []
        for k, ((ours, _), proc) in enumerate(zip(pipes, procs, strict=True)):
            while not ours.poll(0.2):  # a worker that died says nothing: do not wait it out
                dead = not proc.is_alive() and not ours.poll(0)  # (it may have sent, then ended)
                if dead or time.perf_counter() - origin_perf > wait_s:
                    raise RuntimeError(f"bench worker {k} sent no results (exit {proc.exitcode})")
            status, got, lags, pauses = ours.recv()
            if status != "ok":
                raise RuntimeError(f"bench worker {k} failed: {got}")
            records += got
            watches.append(HarnessWatch(lags=lags, gc_pauses=pauses))
    finally:
        stop.set()
        watcher.join(timeout=1)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    pull()
    records.sort(key=lambda r: r.index)
    return records, watches


async def _run(
    settings: RunSettings,
    planned: list[PlannedRequest],
    progress: RunProgress | _SharedProgress,
    watch: HarnessWatch | None = None,
    origin_perf: float | None = None,
) -> list[RequestRecord]:
    """Send `planned` at their times after the origin (default: _START_LEAD_S from now; a
    worker gets its parent's, on the perf_counter clock) and collect their records."""
    watch = watch or HarnessWatch()
    async with _http_client(settings) as client:
        loop = asyncio.get_running_loop()
        # One origin on both clocks: the loop clock schedules, perf_counter timestamps.
        if origin_perf is None:
            origin_loop = loop.time() + _START_LEAD_S
            origin_perf = time.perf_counter() + (origin_loop - loop.time())
        else:
            origin_loop = loop.time() + (origin_perf - time.perf_counter())
        watch.origin_perf = origin_perf
        probe = asyncio.create_task(watch.probe())
        # Each request stores its record and the last one to finish says so: no gather() over
        # every task at the end of the schedule, which registers a callback on each (~15 ms of
        # stopped loop for 6,000 requests on a 2-core CPU, while the last arrivals still play).
        records: list[RequestRecord | None] = [None] * len(planned)
        remaining = [len(planned)]
        all_done = asyncio.Event()

        async def one(i: int, request: PlannedRequest, scheduled_at: float) -> None:
            try:
                records[i] = await _one(client, settings, request, scheduled_at, progress)
            finally:
                remaining[0] -= 1
                if not remaining[0]:
                    all_done.set()

        try:
            tasks = []  # strong references: the loop holds tasks weakly
            for i, request in enumerate(planned):
                await _sleep_until(loop, origin_loop + request.send_at_s)
                tasks.append(asyncio.create_task(one(i, request, origin_perf + request.send_at_s)))
            if tasks:
                await all_done.wait()
            for task in tasks:  # a harness bug surfaces here rather than as a missing record
                task.result()
            return [r for r in records if r is not None]
        finally:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe


@contextlib.asynccontextmanager
async def _http_client(settings: RunSettings):
    """The HTTP client of a run (settings.http_client), closed at its end."""
    if settings.http_client == HttpClient.aiohttp:
        session = open_session(settings.max_connections, settings.timeouts)
        try:
            yield session
        finally:
            await session.close()
        return
    import httpx

    pool = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_connections,
    )
    timeout = httpx.Timeout(settings.timeouts.stall_s)
    async with httpx.AsyncClient(limits=pool, timeout=timeout) as client:
        yield client


async def _sleep_until(
    loop: asyncio.AbstractEventLoop, deadline: float, sleep=asyncio.sleep
) -> None:
    """Sleep to `deadline` (loop clock) without the usual lateness, then yield with sleep(0)
    through the last _SPIN_S (epoll sleeps in whole milliseconds, rounded up). Linux also lets
    a timed wait run late by 0.1 % of its length (timer slack: 1 ms on a 1 s gap between
    arrivals, which at 1 req/s made the harness ~1-2 ms late to send), so long waits are cut
    short by twice that and finished with another, shorter one. Other requests keep being
    served meanwhile."""
    while (left := deadline - _SPIN_S - loop.time()) > 0:
        await sleep(left - _TIMER_SLACK * left if left > _SPIN_S else left)
    while loop.time() < deadline:
        await sleep(0)


async def _one(
    client: Any,
    settings: RunSettings,
    request: PlannedRequest,
    scheduled_at: float,
    progress: RunProgress | _SharedProgress,
) -> RequestRecord:
    progress.sent += 1
    target = settings.target
    try:
        if target.mode is Mode.ws:
            trace = await ws_speech(
                target.url,
                target.ws_session_config(request.voice),
                split_words(request.text),
                settings.word_interval_s,
                target.headers,
                settings.timeouts,
            )
        else:
            speech = (http_speech_aiohttp if settings.http_client == HttpClient.aiohttp
                      else http_speech)  # fmt: skip
            trace = await speech(
                client,
                target.url,
                target.http_body(request.text, request.voice),
                target.headers,
                settings.timeouts,
            )
    except Exception as err:  # a harness bug must cost one request, not the whole run
        trace = Trace(sent_at=time.perf_counter(), outcome=Outcome.failed, error=repr(err))
    record = analyse(request, scheduled_at, trace, target.body_format, target.sample_rate)
    progress.finished += 1
    progress.not_ok += record.outcome != Outcome.ok
    return record


def write_outputs(out_dir: Path, result: RunResult) -> dict[str, Path]:
    """config.json (everything needed to replay the run), requests.jsonl (one record per
    request, warmup included and flagged), summary.json (measured window only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "config": out_dir / "config.json",
        "requests": out_dir / "requests.jsonl",
        "summary": out_dir / "summary.json",
    }
    config = {
        "settings": result.settings.to_json(),
        "requests_planned": result.prompts_used,
        "started_unix": result.started_unix,
        "ttsbuild_version": __version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    paths["config"].write_text(json.dumps(config, indent=2) + "\n")
    with paths["requests"].open("w") as f:
        for record in result.records:
            f.write(json.dumps(record.to_json()) + "\n")
    summary = {
        "rate": result.settings.rate,
        "mode": str(result.settings.target.mode),
        **result.summary,
    }
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    return paths
