"""Prometheus metrics on a per-app registry (tests build many apps in one process)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ttsbuild.serve.scheduler import FIRST_AUDIO_PHASES, SECOND_CHUNK_PHASES, Plan, Stage

_LATENCY_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)
# time to first audio and its phases: millisecond steps where the targets are (15-40 ms)
_TTFA_BUCKETS = tuple(  # 1-6 ms by 1 ms, then 2 ms steps to 20, then coarser
    [i / 1000 for i in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 25, 30, 40, 50, 75)]
    + [0.1, 0.2, 0.5, 1, 2, 5, 10]
)
_LATENESS_BUCKETS = (-1, -0.5, -0.2, -0.1, -0.05, -0.02, 0, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# host time of engine-thread calls and event-loop lag: from tens of microseconds up
_HOST_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
ENGINE_HOST_PARTS = ("plan", "admit", "prefill", "launch_frames", "launch_audio",
                     "collect_frames", "collect_audio", "commit", "poll_lag")  # fmt: skip
# The HTTP side of time to first audio (the event loop's share, around the engine thread's):
# receive (the handler runs -> the request body read, parsed and validated), resolve
# (tokenize and lay out the prompt before the scheduler sees the request), admitted (-> the
# handler has the engine's admission and can send the response headers: the engine thread's
# admission and its handoff), handoff (the engine thread hands the first chunk over -> the
# stream's handler has it), send (-> its bytes are written to the connection, encoding
# included).
HTTP_PHASES = ("receive", "resolve", "admitted", "handoff", "send")
# guards.StopReason values, listed so every series exists (at 0) from the start.
STOP_REASONS = ("eos", "text_budget", "repetition", "silence", "max_frames", "length_rule",
                "cancel")  # fmt: skip


log = logging.getLogger(__name__)


class _OncePerSecond:
    """A warning that may be logged at most once a second: `due()` says whether this one is
    (None: not, it is counted) and gives the suffix telling how many were left out since."""

    def __init__(self):
        self.logged_at = float("-inf")
        self.unlogged = 0

    def due(self) -> str | None:
        now = time.monotonic()
        if now - self.logged_at < 1.0:
            self.unlogged += 1
            return None
        more = f"; {self.unlogged} more since the last one" if self.unlogged else ""
        self.logged_at, self.unlogged = now, 0
        return more


class ServeMetrics:
    """Implements the scheduler's Observer; the app adds HTTP/WS-level counts. A first chunk
    slower than `slow_first_audio_s` is logged (a warning, at most one a second, with the
    count of those not logged since) with its phases and the slots in use: the tail's
    outliers, one by one, for a server log next to a sweep's histograms."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 slow_first_audio_s: float = 0.025, stall_s: float = 0.02):  # fmt: skip
        self.registry = r = registry or CollectorRegistry()
        self.slow_first_audio_s = slow_first_audio_s
        # A stall that holds every stream at once, logged with the time (at most once a second
        # per kind) to line up with the underruns a load run found: the event loop waking this
        # late, the engine thread back this late from a poll, a frame or codec step this long
        # (they came in groups at 70 req/s on the H200 with no collector pause behind them,
        # benchmarks/serve/2026-12-03-h200-lane-frames-ab).
        self.stall_s = stall_s
        self._slow_log = _OncePerSecond()
        self._late_log = _OncePerSecond()
        self._stall_logs: defaultdict[str, _OncePerSecond] = defaultdict(_OncePerSecond)
        self._active = 0  # slots in use at the last plan (the gauge's value, for the log)
        self.ttfa = Histogram(
            "tts_time_to_first_audio_seconds", "Arrival to first audio chunk handed to the client",
            buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfa_phases = Histogram(
            "tts_first_audio_phase_seconds", "Where time to first audio goes, as the engine "
            "thread sees it: admit (arrival -> admission launched), frame (-> first frame step "
            "launched), codec (-> first codec step launched), read (-> audio handed over)",
            ["phase"], buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self.second_chunk = Histogram(
            "tts_second_chunk_gap_seconds", "A stream's second chunk handed over minus its first "
            "(the first's playback, 80 ms at the low-latency ramp, is what it has to beat)",
            buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self.second_chunk_phases = Histogram(
            "tts_second_chunk_phase_seconds", "Where that gap goes, as the engine thread sees "
            "it: frames (first chunk handed over -> the second's frames read back), codec (-> "
            "its codec step launched), read (-> its audio handed over); 0 where already done",
            ["phase"], buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self.http_phases = Histogram(
            "tts_http_phase_seconds", "The event loop's share of time to first audio: receive "
            "(handler entry -> body read and validated), resolve (tokenize before the "
            "scheduler sees the request), admitted (-> the handler has the admission: headers "
            "can go), handoff (first chunk handed over by the engine thread -> its handler has "
            "it), send (-> its bytes written to the connection)", ["phase"],
            buckets=_TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self.lateness = Histogram(
            "tts_chunk_lateness_seconds",
            "Chunk ready time minus when the client's buffer runs dry (> 0: an underrun)",
            buckets=_LATENESS_BUCKETS, registry=r,
        )  # fmt: skip
        self.underruns = Counter("tts_underruns", "Chunks that arrived after their deadline",
                                 registry=r)  # fmt: skip
        self.queue_depth = Gauge("tts_queue_depth", "Requests waiting for a slot", registry=r)
        self.active = Gauge("tts_active_slots", "Requests holding an engine slot", registry=r)
        self.streams = Gauge("tts_active_streams", "Open HTTP/WS audio streams", registry=r)
        self.lane = Gauge("tts_admission_lane", "1 while new streams take the engine's "
                          "admission lane (--lane-max-active)", registry=r)  # fmt: skip
        self.queue_standing = Gauge("tts_queue_standing", "1 while a queue for slots stands "
                                    "(overload: requests wait at most --overload-wait)",
                                    registry=r)  # fmt: skip
        self.lane_switches = Counter("tts_admission_lane_switches", "Admission lane switched "
                                     "on or off", ["to"], registry=r)  # fmt: skip
        self.batch = Histogram("tts_batch_size", "Rows per stage call", ["stage"],
                               buckets=_BATCH_BUCKETS, registry=r)  # fmt: skip
        self.stage_seconds = Histogram(
            "tts_stage_seconds", "Engine time per stage call", ["stage"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.codec_launches = Histogram(
            "tts_codec_launches_per_step", "Codec launches per codec step: one per chunk size "
            "its rows decode (a row of 12 frames is 8 + 4; rows of 4 and 5 frames make 4 and "
            "1), each a whole codec pass", buckets=(1, 2, 3, 4, 6, 8), registry=r,
        )  # fmt: skip
        self.decisions = Counter("tts_schedule_decisions", "Plans by anchor reason", ["reason"],
                                 registry=r)  # fmt: skip
        self.frames = Counter("tts_frames", "Codec frames generated (rate() = frames/s)",
                              registry=r)  # fmt: skip
        self.rejections = Counter("tts_rejections", "Requests refused, by reason", ["reason"],
                                  registry=r)  # fmt: skip
        self.requests = Counter("tts_requests", "Requests by API and outcome",
                                ["api", "outcome"], registry=r)  # fmt: skip
        self.stops = Counter(
            "tts_stop_reasons", "Engine requests (WebSocket: segments) by why generation "
            "ended: eos, text_budget, repetition, silence, max_frames, length_rule, cancel",
            ["reason"], registry=r,
        )  # fmt: skip
        for reason in STOP_REASONS:
            self.stops.labels(reason)
        self.engine_host = Histogram(
            "tts_engine_host_seconds", "Host time of the engine thread's calls: plan (the "
            "scheduler, its lock's wait included), admit, prefill and the stage launches "
            "(staging and graph launches), collect (reading a finished step back), commit "
            "(accounting and handing chunks over), poll_lag (how late the thread is back from a "
            "0.2 ms poll: the OS and the GIL)", ["part"], buckets=_HOST_BUCKETS, registry=r,
        )  # fmt: skip
        self.event_loop_lag = Histogram(
            "tts_event_loop_lag_seconds", "How late a 10 ms timer of the HTTP event loop fires "
            "(a busy event loop, or its thread waiting for the GIL)", buckets=_HOST_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.gc_pause = Histogram(
            "tts_gc_pause_seconds", "Pauses of Python's cyclic garbage collector, by "
            "generation (every thread stops)", ["generation"], buckets=_HOST_BUCKETS,
            registry=r,
        )  # fmt: skip
        for generation in "012":
            self.gc_pause.labels(generation)
        for part in ENGINE_HOST_PARTS:
            self.engine_host.labels(part)
        for phase in FIRST_AUDIO_PHASES:
            self.ttfa_phases.labels(phase)
        for phase in SECOND_CHUNK_PHASES:
            self.second_chunk_phases.labels(phase)
        for phase in HTTP_PHASES:
            self.http_phases.labels(phase)
        for stage in Stage:
            self.batch.labels(stage.value)
            self.stage_seconds.labels(stage.value)

    # -- scheduler Observer ------------------------------------------------------------------
    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None:
        self.queue_depth.set(queue_depth)
        self.active.set(active)
        self._active = active
        if plan.stage is not None:
            self.decisions.labels(plan.reason).inc()

    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None:
        self.batch.labels(stage.value).observe(batch)
        self.stage_seconds.labels(stage.value).observe(elapsed_s)
        if frames:
            self.frames.inc(frames)
        if stage is not Stage.PREFILL and elapsed_s > 2 * self.stall_s:  # ~4x their load time
            self._log_stall(f"{stage.value} step", elapsed_s, f" with {batch} rows")

    def on_host(self, part: str, seconds: float) -> None:
        """serve.loop's HostTimer."""
        self.engine_host.labels(part).observe(seconds)
        if part == "poll_lag" and seconds > self.stall_s:
            self._log_stall("engine thread back from a poll", seconds, " late")

    def on_event_loop_lag(self, seconds: float) -> None:
        """How late the event loop's periodic timer fired (serve.service's probe)."""
        self.event_loop_lag.observe(seconds)
        if seconds > self.stall_s:
            self._log_stall("event loop woke", seconds, " late")

    def _log_stall(self, what: str, seconds: float, detail: str) -> None:
        if (more := self._stall_logs[what].due()) is None:  # once a second per kind
            return
        log.warning("stall: %s %.1f ms%s with %d slots in use%s", what, seconds * 1e3, detail,
                    self._active, more)  # fmt: skip

    def on_lane(self, on: bool) -> None:
        """The admission lane switched (serve.loop.EngineLoop's lane_switch)."""
        self.lane.set(int(on))
        self.lane_switches.labels("on" if on else "off").inc()

    def on_codec_launches(self, launches: int) -> None:
        """serve.loop.Runner's: how many codec launches a codec step made."""
        self.codec_launches.observe(launches)

    def on_first_audio(self, ttfa_s: float, phases: dict[str, float] | None = None) -> None:
        self.ttfa.observe(ttfa_s)
        for phase, seconds in (phases or {}).items():
            self.ttfa_phases.labels(phase).observe(seconds)
        if ttfa_s > self.slow_first_audio_s:
            self._log_slow(ttfa_s, phases)

    def _log_slow(self, ttfa_s: float, phases: dict[str, float] | None) -> None:
        if (more := self._slow_log.due()) is None:
            return
        split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in (phases or {}).items())
        log.warning("slow first audio: %.1f ms (%s ms) with %d slots in use%s", ttfa_s * 1e3,
                    split or "no phases", self._active, more)  # fmt: skip

    def on_second_chunk(self, gap_s: float, phases: dict[str, float]) -> None:
        self.second_chunk.observe(gap_s)
        for phase, seconds in phases.items():
            self.second_chunk_phases.labels(phase).observe(seconds)

    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None:
        """A chunk handed over: lateness against its client's playback (> 0: the buffer ran
        dry); `chunk` its index in the stream, `played_s` the audio sent before it."""
        self.lateness.observe(lateness_s)
        if lateness_s > 0:
            self.underruns.inc()
            self._log_late(lateness_s, chunk, played_s)

    def _log_late(self, lateness_s: float, chunk: int, played_s: float) -> None:
        """A chunk ready after its client's buffer ran dry, logged (at most once a second)
        with the time, so late chunks can be matched with what else happened then (collector
        pauses, refusals): at 40 req/s on the H200 they came in clusters ~17 s apart."""
        if (more := self._late_log.due()) is None:
            return
        log.warning("chunk %d (after %.2f s of audio) late for its playback by %.1f ms with %d "
                    "slots in use%s", chunk, played_s, lateness_s * 1e3, self._active, more)

    def on_gc_pause(self, generation: int, seconds: float, collected: int) -> None:
        """A cyclic-collector pause (every thread stopped); pauses over 5 ms are logged."""
        self.gc_pause.labels(str(generation)).observe(seconds)
        if seconds > 0.005:
            log.warning("collector pause: generation %d, %.1f ms, %d objects collected",
                        generation, seconds * 1e3, collected)  # fmt: skip

    def on_reject(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def on_queue_standing(self, standing: bool, wait_s: float) -> None:
        self.queue_standing.set(int(standing))
        if standing:
            log.warning("a queue for slots stands (overload): requests wait at most %.0f ms "
                        "for one, with %d slots in use", wait_s * 1e3, self._active)
        else:
            log.info("the queue for slots cleared: requests wait up to %g s for one", wait_s)

    def on_stop(self, reason: str) -> None:
        self.stops.labels(reason).inc()
