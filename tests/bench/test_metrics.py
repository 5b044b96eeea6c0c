"""Nearest-rank percentiles, per-request metrics from hand-made traces, and the summary."""

import pytest

from ttsbuild.bench.audio import BodyFormat
from ttsbuild.bench.client import Outcome, Trace
from ttsbuild.bench.fakeserver import silence, tone
from ttsbuild.bench.metrics import analyse, early_blocks, nearest_rank, summarise
from ttsbuild.bench.schedule import PlannedRequest


def test_nearest_rank_percentile():
    values = [15, 20, 35, 40, 50]
    assert nearest_rank(values, 5) == 15
    assert nearest_rank(values, 30) == 20  # ceil(1.5) = 2nd
    assert nearest_rank(values, 40) == 20  # ceil(2.0) = 2nd exactly
    assert nearest_rank(values, 50) == 35
    assert nearest_rank(values, 100) == 50
    assert nearest_rank(list(range(1, 101)), 99) == 99
    assert nearest_rank(list(range(1, 11)), 99) == 10  # p99 of 10 values: the largest
    assert nearest_rank([3.0], 50) == 3.0
    assert nearest_rank([], 50) is None
    with pytest.raises(ValueError):
        nearest_rank(values, 0)


def planned(index=0, text="hello there", warmup=False):
    return PlannedRequest(index=index, send_at_s=1.0, text=text, voice="v", warmup=warmup)


def test_analyse_trace_with_silence_then_speech_and_one_late_chunk():
    # Scheduled at t=100.0, sent 1 ms late. Chunks: 0.3 s silence at 100.2, 0.2 s tone at
    # 100.4 (due 100.5: on time), 0.2 s tone at 100.9 (due 100.7: 0.2 s stall).
    trace = Trace(sent_at=100.001)
    trace.add_chunk(100.2, silence(0.3))
    trace.add_chunk(100.4, tone(0.2))
    trace.add_chunk(100.9, tone(0.2))
    trace.finished_at = 101.0
    r = analyse(planned(), 100.0, trace, BodyFormat.pcm, 24_000)
    assert r.outcome == "ok"
    assert r.dispatch_lag_s == pytest.approx(0.001)
    assert r.ttfb_s == pytest.approx(0.2)
    assert r.first_playable_s == pytest.approx(0.2)
    assert r.ttfa_s == pytest.approx(0.4)
    assert r.leading_silence_s == pytest.approx(0.3)
    assert r.e2e_s == pytest.approx(1.0)
    assert r.audio_s == pytest.approx(0.7)
    assert r.rtf == pytest.approx(1.0 / 0.7)
    assert r.underruns == 1
    assert r.stall_s == pytest.approx(0.2)
    # 80 ms blocks: 1-3 end in the silence (0.3 s, at 0.2), 4-6 in the first tone (0.3-0.5 s,
    # at 0.4), 7-8 in the second (0.5-0.7 s, at 0.9)
    assert r.audio_arrival_s == pytest.approx([0.2, 0.2, 0.2, 0.4, 0.4, 0.4, 0.9, 0.9])


def test_analyse_rejected_and_corrupt_bodies():
    rejected = Trace(sent_at=5.0, outcome=Outcome.rejected, http_status=429, error="HTTP 429")
    r = analyse(planned(), 5.0, rejected, BodyFormat.auto, 24_000)
    assert r.outcome == "rejected" and r.ttfa_s is None and r.audio_s == 0.0
    truncated_wav = Trace(sent_at=5.0)
    truncated_wav.add_chunk(5.1, b"RIFF\xff\xff\xff\xffWAVEfmt ")
    truncated_wav.finished_at = 5.1
    r = analyse(planned(), 5.0, truncated_wav, BodyFormat.auto, 24_000)
    assert r.outcome == "failed" and "bad audio body" in r.error


def record(index, outcome="ok", warmup=False, ttfa=0.1, underruns=0, chars=10, audio=1.0):
    trace = Trace(sent_at=0.0, outcome=Outcome(outcome))
    r = analyse(planned(index, "x" * chars, warmup), 0.0, trace, BodyFormat.pcm, 24_000)
    r.ttfa_s, r.underruns, r.stall_s, r.audio_s = ttfa, underruns, 0.0, audio
    r.underrun_at_s = [0.08 * index * (k + 1) for k in range(underruns)]
    return r


def test_summary_counts_percentiles_underrun_rate_and_cost():
    records = [record(0, warmup=True, ttfa=9.0, underruns=5)]  # warmup: ignored everywhere
    records += [record(i, ttfa=0.01 * i, underruns=int(i % 4 == 0)) for i in range(1, 9)]
    records += [record(9, "rejected"), record(10, "rejected"), record(11, "failed")]
    records += [record(12, "timeout")]
    s = summarise(records, measured_s=2.0, gpu_hour_usd=3.6, gpus=2)
    assert s["requests"] == {
        "sent": 12, "completed": 8, "failed": 1, "rejected": 2, "timed_out": 1,
        "warmup_excluded": 1,
    }  # fmt: skip
    ttfa = s["timings"]["ttfa_s"]
    assert ttfa["count"] == 8
    assert (ttfa["p50"], ttfa["p95"], ttfa["p99"]) == pytest.approx((0.04, 0.08, 0.08))
    assert s["underruns"] == {"total": 2, "requests_with_underrun": 2, "rate": 0.25,
                              "at_s": pytest.approx([0.32, 0.64])}  # requests 4 and 8
    assert s["throughput"]["chars_per_s"] == pytest.approx(8 * 10 / 2.0)
    assert s["throughput"]["audio_s_per_s"] == pytest.approx(8 * 1.0 / 2.0)
    # 2 GPUs at $3.60/h = $0.002/s; 40 chars/s -> $50 per 1M chars
    assert s["cost"]["usd_per_1m_chars"] == pytest.approx(50.0)
    assert summarise(records, 2.0, None, 1)["cost"] is None


def test_refusals_are_timed_apart_and_reach_the_sweep_row():
    """The time to a 429/503 (send -> its response headers) is its own distribution, over the
    measured refusals only: "refused at once" under overload is a number in the summary and
    in the sweep's row, and no refusal's time enters the served requests' timings."""
    from ttsbuild.bench.report import sweep_row

    records = [record(0, "rejected", warmup=True)]
    records += [record(i) for i in range(1, 5)]
    records += [record(i, "rejected") for i in range(5, 25)]
    records[0].headers_s = 9.0  # a warm-up refusal: not counted
    for i, r in enumerate(records[5:]):
        r.headers_s = 0.001 * (i + 1)  # 1..20 ms
    for r in records[1:5]:
        r.headers_s = 0.5
    s = summarise(records, measured_s=1.0, gpu_hour_usd=None, gpus=1)
    refused = s["timings"]["rejected_s"]
    assert refused["count"] == 20 and refused["max"] == pytest.approx(0.020)
    assert (refused["p50"], refused["p95"]) == pytest.approx((0.010, 0.019))
    assert s["timings"]["headers_s"]["count"] == 4  # the served requests' headers only
    assert sweep_row(5.0, s)["rejected_p95_s"] == pytest.approx(0.019)
    none_refused = summarise(records[1:5], 1.0, None, 1)
    assert none_refused["timings"]["rejected_s"]["count"] == 0
    assert sweep_row(5.0, none_refused)["rejected_p95_s"] is None


def test_early_blocks_are_timed_from_the_first_playable_sample():
    """Block k of 80 ms plays out at k * 0.08 s after playback starts: the summary gives each
    block's arrival after the first playable sample (p50 / p95 / max over the requests that
    have it), so a block whose p95 nears that is where streams run dry."""
    records = []
    for i in range(20):
        r = record(i + 1)
        r.first_playable_s = 0.02 + 0.001 * i
        second = 0.05 if i < 19 else 0.2  # one request's second block comes late
        r.audio_arrival_s = [r.first_playable_s, r.first_playable_s + second]
        if i < 10:  # half the requests are longer: a third block
            r.audio_arrival_s.append(r.first_playable_s + 0.1)
        records.append(r)
    blocks = early_blocks(records)
    assert set(blocks) == {"1", "2", "3"}
    assert blocks["1"] == pytest.approx({"p50": 0.0, "p95": 0.0, "max": 0.0})
    assert blocks["2"] == pytest.approx({"p50": 0.05, "p95": 0.05, "max": 0.2})
    assert blocks["3"]["p95"] == pytest.approx(0.1)
    assert summarise(records, 1.0, None, 1)["early_blocks"] == blocks
