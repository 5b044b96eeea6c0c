"""Per-request metrics from a trace, and the run summary.

Every latency is measured from the request's *scheduled* send time, not from when the harness
got round to sending it: an open-loop benchmark must not hide its own lateness (or a server's
back-pressure) by restarting the clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ttsbuild.bench.audio import (
    AudioFormat,
    BodyFormat,
    audible_onset,
    chunk_end_frames,
    decode_mono,
    detect_format,
    frame_arrival_time,
    simulate_playback,
)
from ttsbuild.bench.client import Outcome, Trace
from ttsbuild.bench.schedule import PlannedRequest

PERCENTILES = (50, 95, 99)
# RequestRecord.audio_arrival_s: the first 8 blocks of 80 ms (one codec frame each)
EARLY_BLOCK_S, EARLY_BLOCKS = 0.08, 8
# Timings summarised as p50/p95/p99 (all seconds, except rtf which is a ratio).
TIMING_FIELDS = (
    "dispatch_lag_s",
    "headers_s",
    "ttfb_s",
    "first_playable_s",
    "ttfa_s",
    "leading_silence_s",
    "e2e_s",
    "rtf",
    "stall_s",
    "text_done_to_audio_s",
)


@dataclass
class RequestRecord:
    """One line of requests.jsonl. Times in seconds; None where it does not apply (e.g. a
    rejected request has no TTFA, HTTP requests have no text_done_to_audio_s)."""

    index: int
    warmup: bool
    scheduled_s: float  # send time relative to the run start
    voice: str
    chars: int
    outcome: str
    http_status: int | None
    error: str | None
    dispatch_lag_s: float  # actual send - scheduled send: the harness's own lateness
    # HTTP: response headers arrived (ttsbuild serve sends them once the request holds an
    # engine slot, so headers_s -> ttfa_s is the first chunk's own making and delivery)
    headers_s: float | None
    ttfb_s: float | None  # first body byte (WAV header included)
    first_playable_s: float | None  # first complete audio sample
    ttfa_s: float | None  # audible onset: arrival of the bytes holding its first sample
    leading_silence_s: float | None  # audio before the audible onset
    e2e_s: float | None  # last byte (HTTP) or done event (WS)
    audio_s: float  # seconds of audio received
    rtf: float | None  # e2e_s / audio_s; < 1 means faster than real time
    underruns: int | None  # zero-buffer playback: times the player ran dry
    stall_s: float | None  # zero-buffer playback: total waiting after playback began
    underrun_at_s: list[float] | None  # zero-buffer playback: audio played before each underrun
    # arrival (since the scheduled send) of the bytes completing each of the first
    # EARLY_BLOCKS 80 ms blocks of audio: where a stream's early chunks lost their time
    audio_arrival_s: list[float] | None
    text_done_to_audio_s: float | None  # WS: audible onset - time the last word was sent
    sample_rate: int | None
    body_bytes: int
    text: str
    server_stats: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def analyse(
    planned: PlannedRequest,
    scheduled_at: float,
    trace: Trace,
    body_format: BodyFormat,
    default_sample_rate: int,
) -> RequestRecord:
    """Turn a finished trace into its metrics. `scheduled_at` is the scheduled send time on the
    trace's clock (perf_counter)."""
    record = RequestRecord(
        index=planned.index,
        warmup=planned.warmup,
        scheduled_s=planned.send_at_s,
        voice=planned.voice,
        chars=len(planned.text),
        outcome=str(trace.outcome),
        http_status=trace.http_status,
        error=trace.error,
        dispatch_lag_s=trace.sent_at - scheduled_at,
        headers_s=_since(trace.headers_at, scheduled_at),
        ttfb_s=_since(trace.chunk_times[0], scheduled_at) if trace.chunk_times else None,
        first_playable_s=None,
        ttfa_s=None,
        leading_silence_s=None,
        e2e_s=_since(trace.finished_at, scheduled_at),
        audio_s=0.0,
        rtf=None,
        underruns=None,
        stall_s=None,
        underrun_at_s=None,
        audio_arrival_s=None,
        text_done_to_audio_s=None,
        sample_rate=None,
        body_bytes=len(trace.body),
        text=planned.text,
        server_stats=trace.server_stats,
    )
    if not trace.body:
        return record
    try:
        fmt = detect_format(
            bytes(trace.body[:4096]), body_format, trace.sample_rate_header or default_sample_rate
        )
    except ValueError as err:  # includes IncompleteHeader: a body cut short in its header
        if trace.outcome is Outcome.ok:
            record.outcome, record.error = str(Outcome.failed), f"bad audio body: {err}"
        return record
    _add_audio_metrics(record, trace, fmt, scheduled_at)
    return record


def _add_audio_metrics(
    record: RequestRecord, trace: Trace, fmt: AudioFormat, scheduled_at: float
) -> None:
    times = np.asarray(trace.chunk_times, dtype=np.float64)
    end_frames = chunk_end_frames(np.asarray(trace.chunk_end_bytes), fmt)
    total_frames = int(end_frames[-1])
    record.sample_rate = fmt.sample_rate
    record.audio_s = total_frames / fmt.sample_rate
    if total_frames == 0:
        return
    playback = simulate_playback(times, end_frames, fmt.sample_rate)
    if playback is not None:
        record.first_playable_s = playback.start_s - scheduled_at
        record.underruns = playback.underruns
        record.stall_s = playback.stall_s
        record.underrun_at_s = [round(t, 4) for t in playback.underrun_at_s]
    block = round(EARLY_BLOCK_S * fmt.sample_rate)
    record.audio_arrival_s = [
        round(frame_arrival_time(k * block - 1, times, end_frames) - scheduled_at, 5)
        for k in range(1, EARLY_BLOCKS + 1) if k * block <= total_frames
    ]  # fmt: skip
    if record.e2e_s is not None:
        record.rtf = record.e2e_s / record.audio_s
    onset = audible_onset(decode_mono(bytes(trace.body), fmt), fmt.sample_rate)
    if onset is None:
        return
    heard_at = frame_arrival_time(onset, times, end_frames)
    record.ttfa_s = heard_at - scheduled_at
    record.leading_silence_s = onset / fmt.sample_rate
    if trace.text_done_at is not None:
        record.text_done_to_audio_s = heard_at - trace.text_done_at


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else t - origin


def nearest_rank(values: Sequence[float], percentile: float) -> float | None:
    """Nearest-rank percentile: the smallest value such that at least `percentile`% of the
    values are <= it, i.e. sorted[ceil(p/100 * n) - 1]. Always an observed value (no
    interpolation), so p99 of 10 requests is the slowest one. None for no values."""
    if not 0 < percentile <= 100:
        raise ValueError("percentile must be in (0, 100]")
    if len(values) == 0:
        return None
    ordered = sorted(values)
    rank = math.ceil(percentile / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50/p95/p99 (nearest rank) and max."""
    stats: dict[str, float | int | None] = {"count": len(values)}
    stats["mean"] = float(np.mean(values)) if values else None
    for p in PERCENTILES:
        stats[f"p{p}"] = nearest_rank(values, p)
    stats["max"] = max(values) if values else None
    return stats


def early_blocks(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """Per early block k (1-based): p50 / p95 / max of its arrival after the request's first
    playable sample, over the requests that have the block."""
    out: dict[str, dict[str, float | None]] = {}
    for k in range(1, EARLY_BLOCKS + 1):
        late = [r.audio_arrival_s[k - 1] - r.first_playable_s for r in records
                if r.audio_arrival_s and len(r.audio_arrival_s) >= k
                and r.first_playable_s is not None]  # fmt: skip
        if late:
            out[str(k)] = {"p50": nearest_rank(late, 50), "p95": nearest_rank(late, 95),
                           "max": max(late)}  # fmt: skip
    return out


def summarise(
    records: Sequence[RequestRecord],
    measured_s: float,
    gpu_hour_usd: float | None,
    gpus: int,
) -> dict[str, Any]:
    """Summary of the measured (non-warmup) requests. Throughputs divide by the measured window
    length `measured_s`; cost assumes `gpus` GPUs are rented for the window at `gpu_hour_usd`
    each, so it is the cost at this offered load (a sweep shows where it is cheapest)."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.outcome == Outcome.ok]
    counts = {str(o): sum(r.outcome == o for r in measured) for o in Outcome}
    with_playback = [r for r in ok if r.underruns is not None]
    chars = sum(r.chars for r in ok)
    audio = sum(r.audio_s for r in ok)
    chars_per_s = chars / measured_s
    summary: dict[str, Any] = {
        "requests": {
            "sent": len(measured),
            "completed": counts[Outcome.ok],
            "failed": counts[Outcome.failed],
            "rejected": counts[Outcome.rejected],
            "timed_out": counts[Outcome.timeout],
            "warmup_excluded": len(records) - len(measured),
        },
        "timings": {
            name: distribution(
                [
                    getattr(r, name)
                    for r in (measured if name == "dispatch_lag_s" else ok)
                    if getattr(r, name) is not None
                ]
            )
            for name in TIMING_FIELDS
        }
        | {
            # send -> the refusal's response headers (429/503): "refused at once" under overload
            "rejected_s": distribution([r.headers_s for r in measured
                                        if r.outcome == Outcome.rejected
                                        and r.headers_s is not None])  # fmt: skip
        },
        "underruns": {
            "total": sum(r.underruns for r in with_playback),
            "requests_with_underrun": sum(r.underruns > 0 for r in with_playback),
            "rate": (
                sum(r.underruns > 0 for r in with_playback) / len(with_playback)
                if with_playback
                else None
            ),
            # seconds of audio played before each underrun, earliest first (at most 100):
            # the ramp's early chunks, or later ones
            "at_s": sorted(t for r in with_playback for t in r.underrun_at_s or ())[:100],
        },
        # seconds from the first playable sample to the arrival of each early 80 ms block's
        # last byte: block k plays out at (k) * 0.08 s, so a p95 near or past it is where
        # streams run dry (p50 / p95 / max per block)
        "early_blocks": early_blocks(with_playback),
        "no_audible_onset": sum(r.ttfa_s is None for r in ok),
        "throughput": {
            "measured_s": measured_s,
            "chars_per_s": chars_per_s,
            "audio_s_per_s": audio / measured_s,
            "completed_per_s": counts[Outcome.ok] / measured_s,
        },
        "cost": None,
    }
    if gpu_hour_usd is not None:
        usd_per_s = gpu_hour_usd * gpus / 3600.0
        summary["cost"] = {
            "gpu_hour_usd": gpu_hour_usd,
            "gpus": gpus,
            "usd_per_1m_chars": usd_per_s / chars_per_s * 1e6 if chars_per_s > 0 else None,
        }
    return summary
