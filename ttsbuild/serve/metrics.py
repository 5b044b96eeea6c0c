"""Prometheus metrics on a per-app registry (tests build many apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ttsbuild.serve.scheduler import Plan, Stage

_LATENCY_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)
_LATENESS_BUCKETS = (-1, -0.5, -0.2, -0.1, -0.05, -0.02, 0, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# guards.StopReason values, listed so every series exists (at 0) from the start.
STOP_REASONS = ("eos", "text_budget", "repetition", "silence", "max_frames", "length_rule",
                "cancel")  # fmt: skip


class ServeMetrics:
    """Implements the scheduler's Observer; the app adds HTTP/WS-level counts."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.ttfa = Histogram(
            "tts_time_to_first_audio_seconds", "Arrival to first audio chunk handed to the client",
            buckets=_LATENCY_BUCKETS, registry=r,
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
        self.batch = Histogram("tts_batch_size", "Rows per stage call", ["stage"],
                               buckets=_BATCH_BUCKETS, registry=r)  # fmt: skip
        self.stage_seconds = Histogram(
            "tts_stage_seconds", "Engine time per stage call", ["stage"],
            buckets=_LATENCY_BUCKETS, registry=r,
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
        for stage in Stage:
            self.batch.labels(stage.value)
            self.stage_seconds.labels(stage.value)

    # -- scheduler Observer ------------------------------------------------------------------
    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None:
        self.queue_depth.set(queue_depth)
        self.active.set(active)
        if plan.stage is not None:
            self.decisions.labels(plan.reason).inc()

    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None:
        self.batch.labels(stage.value).observe(batch)
        self.stage_seconds.labels(stage.value).observe(elapsed_s)
        if frames:
            self.frames.inc(frames)

    def on_first_audio(self, ttfa_s: float) -> None:
        self.ttfa.observe(ttfa_s)

    def on_chunk(self, lateness_s: float) -> None:
        self.lateness.observe(lateness_s)
        if lateness_s > 0:
            self.underruns.inc()

    def on_reject(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def on_stop(self, reason: str) -> None:
        self.stops.labels(reason).inc()
