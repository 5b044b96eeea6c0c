"""Deadline-aware scheduling of synthesis streams over the engine's three stages.

Every admitted stream has exactly one next stage: PREFILL once it holds a slot, FRAMES until
its next chunk's frames exist, AUDIO once they do (or once generation ended with frames left).
A plan picks one anchor stream by priority; the anchor's stage is the step's stage and every
other stream ready for that stage fills the batch (batched rows are nearly free on a GPU).

Priority, most urgent first; the class name is the plan's reason:
  deadline     slack <= profile.urgent_slack_s: the client's buffer runs dry unless this goes now
  first-audio  nothing sent yet, oldest first: time to first audio is what a listener notices
  soon         slack <= profile.soon_slack_s, least slack first
  round-robin  the rest, least recently served first
slack = deadline - now - (estimated time to finish the next chunk), with
deadline = playback start (first chunk sent) + audio sent so far - profile.safety_margin_s,
and the estimate built from running averages of measured stage times.

Admission: a full queue answers 429 at once, so does a request that gets no slot within
queue_timeout_s; audio produced but unsent (slow or stalled clients) above max_buffered_s
answers 503. A stream whose own unsent audio exceeds stream_buffer_s pauses (backpressure).
Capacity: a free slot is not enough. Over the last capacity_window_s the engine's busy time
and the audio it produced give the number of streams it keeps in real time; a queued request
gets a slot only while that number, less a margin, exceeds the streams that need audio now
(still generating, not paused, not already ahead_s ahead of playback). When it does not, the
engine is saturated: requests beyond saturated_queue in the queue get 429 at once and queued
ones wait at most saturated_wait_s, so the admitted streams keep up and start soon instead of
every stream falling behind.

Pure Python: no torch, no threads. The engine thread calls plan() and commit() under a lock;
the asyncio side calls submit(), ack() and close(). PCM is opaque here (only len() is used).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ttsbuild.serve.config import FRAME_SAMPLES, SAMPLE_RATE, SchedulerConfig


class Stage(StrEnum):
    PREFILL = "prefill"
    FRAMES = "frames"  # talker + code predictor: one frame per row
    AUDIO = "audio"  # codec over every frame not yet decoded


class Status(StrEnum):
    """A stream's life: QUEUED -> PREFILL -> DECODING -> FINISHED, or FAILED from QUEUED
    (refused or timed out), or CANCELLED from any live status (the client went away)."""

    QUEUED = "queued"  # waiting for an engine slot
    PREFILL = "prefill"  # holds a slot, prompt not yet run
    DECODING = "decoding"  # generating frames and audio
    FINISHED = "finished"  # all audio handed to the sink
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE = frozenset({Status.QUEUED, Status.PREFILL, Status.DECODING})


# -- events handed to a stream's sink (from the engine thread) --------------------------------
@dataclass(frozen=True)
class Admitted:
    seed: int


@dataclass(frozen=True)
class Chunk:
    seq: int
    pcm: Any  # float32 samples at 24 kHz, [n]


@dataclass(frozen=True)
class Done:
    stats: dict


@dataclass(frozen=True)
class Failed:
    status: int  # HTTP status: 400 refused by the engine, 429 no slot in time
    message: str
    reason: str


Event = Admitted | Chunk | Done | Failed
Sink = Callable[[Event], None]
Trimmer = Callable[[Any], Any]  # pcm -> pcm (the bootstrap frame / onset trim)


class Rejected(Exception):
    """submit() refused the request outright: answer `status` with `message`."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass(eq=False)
class Stream:
    id: int
    request: Any  # handed to engine.admit unchanged
    sink: Sink
    chunk_schedule: tuple[int, ...]
    trimmer: Trimmer | None
    arrived_at: float
    status: Status = Status.QUEUED
    slot: int | None = None
    seed: int | None = None
    frames: int = 0  # generated
    decoded: int = 0  # turned into audio
    generation_done: bool = False
    stopped_by: str | None = None  # the engine's reason generation ended (guards.StopReason)
    audio_steps: int = 0  # codec calls so far: indexes the chunk schedule
    chunks_sent: int = 0
    samples_sent: int = 0
    samples_unsent: int = 0  # handed to the sink, not yet acked as written to the client
    admitted_at: float | None = None
    first_audio_at: float | None = None
    last_served_at: float = 0.0

    def next_chunk_frames(self) -> int:
        return self.chunk_schedule[min(self.audio_steps, len(self.chunk_schedule) - 1)]

    def next_stage(self) -> Stage | None:
        if self.status is Status.PREFILL:
            return Stage.PREFILL
        if self.status is not Status.DECODING:
            return None
        pending = self.frames - self.decoded
        if pending >= self.next_chunk_frames() or (self.generation_done and pending > 0):
            return Stage.AUDIO
        return None if self.generation_done else Stage.FRAMES


# -- what the scheduler and the runner exchange ----------------------------------------------
@dataclass
class Plan:
    release: list[int]  # slots to free before anything else (finished or cancelled)
    admit: list[Stream]  # queued streams to place in free slots, FIFO
    stage: Stage | None
    slots: list[int]  # the stage's batch, anchor first
    reason: str = "idle"  # why the anchor went first: its priority class

    @property
    def is_empty(self) -> bool:
        return not (self.release or self.admit or self.stage)


@dataclass
class StepResult:
    admitted: dict[int, int | str] = field(default_factory=dict)  # stream id -> slot | error
    seeds: dict[int, int] = field(default_factory=dict)  # stream id -> seed drawn at admission
    frames: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # slot -> (new, finished)
    stopped_by: dict[int, str] = field(default_factory=dict)  # finished slot -> stop reason
    pcm: dict[int, Sequence[float]] = field(default_factory=dict)  # slot -> audio
    elapsed_s: float = 0.0  # the stage call alone


class Observer(Protocol):
    """Metrics and tracing hooks, called after each decision."""

    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None: ...
    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None: ...
    def on_first_audio(self, ttfa_s: float) -> None: ...
    def on_chunk(self, lateness_s: float) -> None: ...
    def on_reject(self, reason: str) -> None: ...
    def on_stop(self, reason: str) -> None: ...


class NullObserver:
    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None: ...
    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None: ...
    def on_first_audio(self, ttfa_s: float) -> None: ...
    def on_chunk(self, lateness_s: float) -> None: ...
    def on_reject(self, reason: str) -> None: ...
    def on_stop(self, reason: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float],
        observer: Observer | None = None,
        initial_cost_s: float = 0.05,
    ):
        self.config = config
        self.profile = config.profile
        self.clock = clock
        self.observer = observer or NullObserver()
        self.streams: dict[int, Stream] = {}  # every stream until its consumer closes it
        self.queue: deque[Stream] = deque()
        self.by_slot: dict[int, Stream] = {}
        self.to_release: list[int] = []
        self.cost_s = dict.fromkeys(Stage, initial_cost_s)  # running mean of each stage call
        self._ids = itertools.count()
        self._outbox: list[tuple[Sink, Event]] = []
        self._steps: deque[tuple[float, float, int]] = deque()  # (end time, busy s, samples)
        self._last_stage_commit: float | None = None  # None: the loop idled since

    # -- asyncio side ------------------------------------------------------------------------
    def submit(
        self,
        request: Any,
        sink: Sink,
        chunk_schedule: Sequence[int] | None = None,
        trimmer: Trimmer | None = None,
    ) -> Stream:
        cfg = self.config
        if len(self.queue) >= cfg.max_queue:
            self._reject("queue_full")
            raise Rejected(429, "queue_full", f"server busy: {len(self.queue)} requests queued")
        if self.unsent_samples() > cfg.max_buffered_s * SAMPLE_RATE:
            self._reject("buffered_audio")
            raise Rejected(503, "buffered_audio", "server overloaded: too much audio unsent")
        room = self.admissible(self.clock()) if len(self.queue) >= cfg.saturated_queue else None
        if room is not None and room <= len(self.queue):  # the queue already fills the room
            self._reject("capacity")
            raise Rejected(429, "capacity", "server at capacity: try again shortly")
        stream = Stream(
            id=next(self._ids),
            request=request,
            sink=sink,
            chunk_schedule=tuple(chunk_schedule or self.profile.chunk_schedule),
            trimmer=trimmer,
            arrived_at=self.clock(),
        )
        self.streams[stream.id] = stream
        self.queue.append(stream)
        return stream

    def ack(self, stream_id: int, samples: int) -> None:
        """The consumer wrote `samples` to its client."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.samples_unsent = max(0, stream.samples_unsent - samples)

    def close(self, stream_id: int) -> None:
        """The consumer is done (finished, failed or disconnected): forget the stream; a live
        one is cancelled and its slot freed by the next plan."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return
        if stream.status is Status.QUEUED:
            self.queue.remove(stream)
        if stream.status in LIVE:
            if stream.status is not Status.QUEUED:  # it was generating: a stop reason
                self.observer.on_stop(CANCEL)
            stream.status = Status.CANCELLED
            self._free_slot(stream)

    def unsent_samples(self) -> int:
        return sum(s.samples_unsent for s in self.streams.values())

    def admissible(self, now: float) -> int | None:
        """How many more streams the engine can keep in real time (None: no evidence yet).

        rate = audio seconds generated per second of engine work over the last window: the
        number of real-time streams the engine sustains at its current batching (more
        streams batch better, so this errs on the safe side). Streams needing audio now: those
        still generating, not paused, not already ahead_s ahead of playback."""
        cfg = self.config
        if not cfg.admit_by_capacity:
            return None
        while self._steps and self._steps[0][0] < now - cfg.capacity_window_s:
            self._steps.popleft()
        busy = sum(b for _, b, _ in self._steps)
        produced = sum(n for _, _, n in self._steps) / SAMPLE_RATE
        if busy < 0.05 * cfg.capacity_window_s or produced <= 0:
            return None
        need = sum(
            1
            for s in self.by_slot.values()
            if not s.generation_done and not self._paused(s) and self._lead(s, now) < cfg.ahead_s
        )
        return max(0, int(produced / busy / (1 + cfg.capacity_margin)) - need)

    def saturated(self, now: float) -> bool:
        """No room for one more real-time stream (see the module docstring)."""
        return self.admissible(now) == 0

    @staticmethod
    def _lead(s: Stream, now: float) -> float:
        """Seconds of audio produced beyond the playback position (0 before first audio)."""
        if s.first_audio_at is None:
            return 0.0
        return s.first_audio_at + s.samples_sent / SAMPLE_RATE - now

    # -- engine thread -----------------------------------------------------------------------
    def plan(self) -> Plan:
        now = self.clock()
        release, self.to_release = self.to_release, []
        free = self.config.num_slots - len(self.by_slot)
        room = self.admissible(now) if self.queue else None
        if room is not None:
            free = min(free, room)  # more streams now would make every stream late
        admit = list(itertools.islice(self.queue, max(0, free)))
        ready = [
            (self._priority(s, stage, now), s, stage)
            for s in self.by_slot.values()
            if (stage := s.next_stage()) is not None and not self._paused(s)
        ]
        plan = Plan(release, admit, None, [])
        if not ready and not admit:
            self._last_stage_commit = None  # idle: the next step's cost starts fresh
        if ready:
            ready.sort(key=lambda r: r[0])
            (klass, _), anchor, stage = ready[0]
            batch = [s for _, s, st in ready if st is stage][: self.config.max_batch]
            plan = Plan(release, admit, stage, [s.slot for s in batch], klass)
        self.observer.on_plan(plan, len(self.queue) - len(admit), len(self.by_slot))
        return plan

    def commit(self, plan: Plan, result: StepResult) -> list[tuple[Sink, Event]]:
        now = self.clock()
        for stream in plan.admit:
            self._commit_admission(stream, result.admitted[stream.id], result, now)
        if plan.stage is not None:
            self._commit_stage(plan, result, now)
        self._expire_queue(now)
        out, self._outbox = self._outbox, []
        return out

    # -- phases ------------------------------------------------------------------------------
    def _priority(self, s: Stream, stage: Stage, now: float) -> tuple[str, tuple]:
        """(class, order within the class); classes sort by their position in CLASS_ORDER."""
        slack = self._slack(s, stage, now)
        if slack is not None and slack <= self.profile.urgent_slack_s:
            klass, order = "deadline", (slack,)
        elif s.first_audio_at is None:
            klass, order = "first-audio", (s.arrived_at, s.id)
        elif slack <= self.profile.soon_slack_s:
            klass, order = "soon", (slack,)
        else:
            klass, order = "round-robin", (s.last_served_at, s.id)
        return klass, (CLASS_ORDER[klass], *order)

    def _slack(self, s: Stream, stage: Stage, now: float) -> float | None:
        if s.first_audio_at is None:
            return None
        deadline = s.first_audio_at + s.samples_sent / SAMPLE_RATE - self.profile.safety_margin_s
        need = self.cost_s[Stage.AUDIO]
        if stage is Stage.FRAMES:
            missing = s.next_chunk_frames() - (s.frames - s.decoded)
            need += max(1, missing) * self.cost_s[Stage.FRAMES]
        return deadline - now - need

    def _paused(self, s: Stream) -> bool:
        return s.samples_unsent > self.config.stream_buffer_s * SAMPLE_RATE

    def _commit_admission(self, s: Stream, outcome: int | str, result: StepResult, now: float):
        if s.status is Status.CANCELLED:  # closed while the engine admitted it
            if isinstance(outcome, int):
                self.to_release.append(outcome)
            return
        self.queue.remove(s)
        if isinstance(outcome, str):
            s.status = Status.FAILED
            self._emit(s, Failed(400, outcome, "invalid_request"))
            return
        s.status, s.slot, s.admitted_at = Status.PREFILL, outcome, now
        s.seed = result.seeds.get(s.id)
        self.by_slot[outcome] = s
        self._emit(s, Admitted(s.seed))

    def _commit_stage(self, plan: Plan, result: StepResult, now: float) -> None:
        stage = plan.stage
        a = self.config.cost_ema
        self.cost_s[stage] = (1 - a) * self.cost_s[stage] + a * result.elapsed_s
        new_frames = 0
        for slot in plan.slots:
            s = self.by_slot.get(slot)
            if s is None or s.status is Status.CANCELLED:
                continue
            s.last_served_at = now
            if stage is Stage.PREFILL:
                s.status = Status.DECODING
            elif stage is Stage.FRAMES:
                new, finished = result.frames[slot]
                s.frames += new
                s.generation_done = finished
                if finished:
                    s.stopped_by = result.stopped_by.get(slot)
                new_frames += new
            else:
                self._commit_audio(s, result.pcm[slot], now)
            if s.generation_done and s.frames == s.decoded:
                self._finish(s, now)
        # Capacity is measured in frames generated (each is 80 ms of audio) per second of
        # engine work, whatever the stage: every stage's time is part of the cost of a frame,
        # and so is the loop's own time between back-to-back steps (planning, committing,
        # handing chunks over), which the stage timing alone does not see.
        busy = result.elapsed_s
        if self._last_stage_commit is not None:
            busy = max(busy, now - self._last_stage_commit)
        self._last_stage_commit = now
        self._steps.append((now, busy, new_frames * FRAME_SAMPLES))
        self.observer.on_step(stage, len(plan.slots), result.elapsed_s, new_frames)

    def _commit_audio(self, s: Stream, pcm: Sequence[float], now: float) -> None:
        s.decoded = s.frames
        s.audio_steps += 1
        if s.trimmer is not None:
            pcm = s.trimmer(pcm)
        if not len(pcm):
            return
        if s.first_audio_at is None:
            s.first_audio_at = now
            self.observer.on_first_audio(now - s.arrived_at)
        else:
            deadline = s.first_audio_at + s.samples_sent / SAMPLE_RATE
            self.observer.on_chunk(now - deadline)
        self._emit(s, Chunk(s.chunks_sent, pcm))
        s.chunks_sent += 1
        s.samples_sent += len(pcm)
        s.samples_unsent += len(pcm)

    def _finish(self, s: Stream, now: float) -> None:
        s.status = Status.FINISHED
        self._free_slot(s)
        if s.stopped_by is not None:
            self.observer.on_stop(s.stopped_by)
        ttfa = None if s.first_audio_at is None else s.first_audio_at - s.arrived_at
        stats = {
            "frames": s.frames,
            "chunks": s.chunks_sent,
            "samples": s.samples_sent,
            "audio_seconds": s.samples_sent / SAMPLE_RATE,
            "seed": s.seed,
            "stopped_by": s.stopped_by,
            "queue_ms": 1000 * ((s.admitted_at or now) - s.arrived_at),
            "ttfa_ms": None if ttfa is None else 1000 * ttfa,
            "total_ms": 1000 * (now - s.arrived_at),
        }
        self._emit(s, Done(stats))

    def _expire_queue(self, now: float) -> None:
        # A saturated engine frees room only as streams finish: waiting long for it would only
        # turn into a late first chunk, so the wait is cut short and the answer is 429.
        timeout = self.config.queue_timeout_s
        if self.queue and self.saturated(now):
            timeout = min(timeout, self.config.saturated_wait_s)
        while self.queue and now - self.queue[0].arrived_at > timeout:
            s = self.queue.popleft()
            s.status = Status.FAILED
            self._reject("no_slot")
            self._emit(s, Failed(429, f"no free slot within {timeout:g} s", "no_slot"))

    def _free_slot(self, s: Stream) -> None:
        if s.slot is not None and self.by_slot.get(s.slot) is s:
            del self.by_slot[s.slot]
            self.to_release.append(s.slot)

    def _emit(self, s: Stream, event: Event) -> None:
        self._outbox.append((s.sink, event))

    def _reject(self, reason: str) -> None:
        self.observer.on_reject(reason)


CANCEL = "cancel"  # guards.StopReason.CANCEL (this module stays free of torch imports)
CLASS_ORDER = {"deadline": 0, "first-audio": 1, "soon": 2, "round-robin": 3}
