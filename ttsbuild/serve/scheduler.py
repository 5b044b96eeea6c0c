"""Deadline-aware scheduling of synthesis streams over the engine's three stages.

One loop turn: release finished slots, admit queued requests into free slots, run every prompt
not yet run (this turn's admissions included: one batched prefill), then one stage, FRAMES or
AUDIO, for a batch of streams. A new request is therefore admitted, prefilled and, when it
anchors the turn, given its first frame in the turn after it arrives; its first audio follows
one turn later: it waits behind the step that was running when it arrived and, at most, a
frame step and a codec step of streams whose playback would otherwise run dry.

Pipelined engines (serve.loop.EngineLoop): a stage is accounted when it is launched
(commit_launch: frames in flight, frames handed to the codec) and when it is read back
(commit_collect), so the next turn is planned while the last stage still runs. Frames the
engine knows are real at launch (no EOS possible yet) count as made: their chunk's codec step
can be launched at once, ordered after the frame step on the device. A codec batch never
includes a row whose frames come from a later frame step than its anchor's.

Every admitted stream has one next stage: FRAMES until its next chunk's frames exist, AUDIO
once they do (or once generation ended with frames left). The most urgent ready stream (the
anchor) picks the stage; the batch is the max_batch most urgent streams ready for it (batched
rows are nearly free on a GPU). This turn's new rows join a FRAMES batch only all together:
their slots exist only once the runner admitted them.

Priority, most urgent first; the class name is the plan's reason:
  deadline     slack <= profile.urgent_slack_s: the client's buffer runs dry unless this goes now
  first-audio  nothing sent yet, oldest first: time to first audio is what a listener notices
  soon         slack <= profile.soon_slack_s, least slack first
  round-robin  the rest, least recently served first
slack = deadline - now - (estimated time to finish the next chunk), with the deadline the
moment the client's playback reaches the end of the audio sent so far, less
profile.safety_margin_s. Playback starts with the first chunk, or, for a stream that plays
after another (the next segment of a WebSocket session), when that one's audio ends, so a
later segment's chunks are due by playback time, not by when they were made. The estimate
comes from running averages of measured stage times. The one exception to "prompts run every
turn": when a stream's playback would run dry during the prefill (its slack, safety margin
included, is shorter), the prompts wait a turn (the new requests keep their slots).

Paced frame steps (SchedulerConfig.pace_slack_s > 0): a frame step is launched only when one
is due, i.e. a stream waits for its first audio (new ones included) or some stream's slack for
FRAMES is below the pace; until then codec work goes first, and the loop waits until the next
is due (Plan.frames_due_in). Every ready stream rides along in the step. A GPU frame step costs
about the same for one row as for sixty-four, so instead of every stream running at the
engine's full speed (~10x real time, few streams at once, small steps), streams run about as
fast as their deadlines need, more of them generate at once and each step carries more rows.

Admission (submit, at once): a full queue answers 429 (queue_full); audio produced but unsent
(slow or stalled clients) above max_buffered_s answers 503; an engine at capacity answers 429
(capacity) with the numbers behind the decision. At capacity means: an admitted stream's latest
chunk came late for its playback, or less than admit_slack_s before it (the engine is behind,
or its latency about to make it so: under load the steps a chunk waits for grow slower long
before the throughput runs out), or the demand would
exceed the supply. Supply: audio seconds generated per second of engine work over the last
capacity_window_s, i.e. real-time streams the engine sustains at the batch it ran, scaled to
the batch the new stream makes by the frame step's measured cost per row (flat on a GPU,
proportional on a CPU; proportional until steps of two sizes were seen), less
capacity_margin. Demand: the streams generating, queued and new, a stream whose chunks still
grow counting its ramp speed (1.875x real time for [1, 1, 2, 4, 8, 12]). An engine with no demand
always takes a stream, so an idle server never refuses and a device too slow for even one
real-time stream serves one at a time; without evidence in the window only slots limit. A
request that finds every slot held waits for one (queue_wait): up to queue_timeout_s while
queues come and go (a burst), up to the profile's overload wait (low-latency: 20 ms) once a
queue stands, i.e. the request at its head was seen waiting longer than that throughout
standing_queue_s, and until no request was refused, for any reason, for as long; then 429
no_slot. Under overload a wait for a slot is what a listener hears as
first-audio latency. A request that would wait longer than it may is answered 429 no_slot at
once: the requests queued before it, less the free slots, over the rate slots were freed in the
last release_window_s (none freed: it would). One that waited only for the engine's turn, a slot
free for it, is never refused. A stream whose own unsent audio exceeds stream_buffer_s pauses
(backpressure).

Pure Python: no torch, no threads. The engine thread calls plan() and commit() under a lock;
the asyncio side calls submit(), ack() and close(). PCM is opaque here (only len() is used).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ttsbuild.serve.config import FRAME_SAMPLES, SAMPLE_RATE, SchedulerConfig

# Paced frame steps: one due within this counts as due now (a wait that short is noise, and
# clock arithmetic would otherwise approach the due time without reaching it)
PACE_RESOLUTION_S = 1e-4


class Stage(StrEnum):
    PREFILL = "prefill"  # run the prompt of each newly admitted slot
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
    ramp_speed: float  # see ramp_speed()
    trimmer: Trimmer | None
    arrived_at: float
    follows: Stream | None = None  # plays after this stream's audio (cleared once it finished)
    plays_from: float | None = None  # ...that is, not before this time (set when it finished)
    continuation: bool = False  # a later segment of an admitted session: never refused
    status: Status = Status.QUEUED
    slot: int | None = None
    seed: int | None = None
    frames: int = 0  # generated and read back
    inflight: int = 0  # frames launched, not yet read back (a pipelined engine)
    certain: int = 0  # ...of which the engine knew at launch that they are real (no EOS yet)
    decoded: int = 0  # handed to the codec
    audio_inflight: int = 0  # codec steps launched, their audio not yet read back
    frame_step: int = 0  # the scheduler's count of frame steps when its last one launched
    generation_done: bool = False
    stopped_by: str | None = None  # the engine's reason generation ended (guards.StopReason)
    audio_steps: int = 0  # codec calls so far: indexes the chunk schedule
    chunks_sent: int = 0
    samples_sent: int = 0
    samples_unsent: int = 0  # handed to the sink, not yet acked as written to the client
    admitted_at: float | None = None
    first_frame_at: float | None = None  # its first frame step launched
    first_codec_at: float | None = None  # its first codec step launched
    first_audio_at: float | None = None
    first_decoded: int = 0  # frames its first codec step took
    second_frames_at: float | None = None  # the second chunk's frames all read back
    second_codec_at: float | None = None  # its second codec step launched
    spare_s: float = math.inf  # its latest chunk's time to spare before its playback (< 0: late)
    last_served_at: float = 0.0

    def next_chunk_frames(self) -> int:
        return self.chunk_schedule[min(self.audio_steps, len(self.chunk_schedule) - 1)]

    def demand(self) -> float:
        """Real-time multiples of generation this stream needs: its ramp speed until its chunk
        sizes stop growing, then real time."""
        return self.ramp_speed if self.audio_steps < len(self.chunk_schedule) else 1.0

    def pending(self) -> int:
        """Frames known to be real and not yet handed to the codec (in flight ones included:
        the engine orders the codec step after the frame step on the device)."""
        return self.frames + self.certain - self.decoded

    def codec_waits_for(self) -> int:
        """The frame step (by launch count) a codec step of this stream waits for on the
        device: the one writing its last certain frame; 0: none (all frames read back)."""
        return self.frame_step if self.certain else 0

    def next_stage(self) -> Stage | None:
        if self.status is Status.PREFILL:
            return Stage.PREFILL
        if self.status is not Status.DECODING:
            return None
        pending = self.pending()
        if pending >= self.next_chunk_frames() or (self.generation_done and pending > 0):
            return Stage.AUDIO
        return None if self.generation_done else Stage.FRAMES

    def playback_start(self) -> float | None:
        """When the client starts playing this stream (None: not known yet): its first chunk,
        but not before the audio it follows has played out."""
        after = self.plays_from
        if self.follows is not None:
            after = self.follows.playback_end()
            if after is None:  # the stream it follows has not started playing either
                return None
        if self.first_audio_at is None:
            return after
        return self.first_audio_at if after is None else max(self.first_audio_at, after)

    def playback_end(self) -> float | None:
        """When the client's playback reaches the end of the audio sent so far."""
        start = self.playback_start()
        return None if start is None else start + self.samples_sent / SAMPLE_RATE


def ramp_speed(schedule: Sequence[int]) -> float:
    """How many times real time a stream must be generated while its chunks grow: chunk k+1
    has to be ready when chunks 1..k have played, i.e. the frames of chunks 2..k+1 made in
    the playing time of chunks 1..k. [1, 2, 4, 8, 12]: 2.0; a flat schedule: 1.0."""
    sizes = [*schedule, schedule[-1]]  # the last entry repeats
    return max(1.0, *(sum(sizes[1 : k + 1]) / sum(sizes[:k]) for k in range(1, len(sizes))))


# -- what the scheduler and the runner exchange ----------------------------------------------
@dataclass
class Plan:
    release: list[int]  # slots to free before anything else (finished or cancelled)
    admit: list[Stream]  # queued streams to place in free slots, FIFO
    # Prompts to run after admission, in one call: these held slots plus every slot admitted
    # this turn. None: no prefill this turn (a deadline stream cannot wait for it).
    prefill: list[int] | None
    stage: Stage | None  # FRAMES or AUDIO
    slots: list[int]  # the stage's batch of held slots, anchor first
    frames_take_new: bool = False  # the FRAMES batch also takes every slot prefilled this turn
    # AUDIO with SchedulerConfig.exact_chunks: the most frames each row decodes (its next
    # chunk's size; a row missing here decodes all it has, as every row does without it)
    audio_frames: dict[int, int] = field(default_factory=dict)
    reason: str = "idle"  # why the anchor went first: its priority class
    # Paced frame steps (SchedulerConfig.pace_slack_s): seconds until a frame step is due when
    # none is now (None: one is due, or pacing is off, or no stream waits for frames)
    frames_due_in: float | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.release or self.admit or self.prefill or self.stage)


@dataclass
class Launched:
    """A plan's stage as launched: its rows' streams at that moment (a slot may change hands
    before the stage is read back) and which frame rows were launched, certain to be real."""

    stage: Stage | None
    rows: dict[int, Stream]  # slot -> stream
    launched: set[int] = field(default_factory=set)  # FRAMES rows launched
    certain: set[int] = field(default_factory=set)


@dataclass
class StepResult:
    admitted: dict[int, int | str] = field(default_factory=dict)  # stream id -> slot | error
    seeds: dict[int, int] = field(default_factory=dict)  # stream id -> seed drawn at admission
    prefilled: list[int] = field(default_factory=list)  # slots whose prompt ran this turn
    stage_slots: list[int] = field(default_factory=list)  # the stage's rows as run
    launched: list[int] = field(default_factory=list)  # FRAMES rows launched (under limits)
    certain: list[int] = field(default_factory=list)  # ...whose frame is real (no EOS possible)
    decoded: dict[int, int] = field(default_factory=dict)  # AUDIO: slot -> frames decoded
    frames: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # slot -> (new, finished)
    stopped_by: dict[int, str] = field(default_factory=dict)  # finished slot -> stop reason
    pcm: dict[int, Sequence[float]] = field(default_factory=dict)  # slot -> audio
    prefill_s: float = 0.0  # the prefill call alone
    stage_s: float = 0.0  # the stage call alone


class Observer(Protocol):
    """Metrics and tracing hooks, called after each decision."""

    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None: ...
    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None: ...
    def on_first_audio(self, ttfa_s: float, phases: dict[str, float] | None = None) -> None: ...
    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None: ...
    def on_second_chunk(self, gap_s: float, phases: dict[str, float]) -> None: ...
    def on_reject(self, reason: str) -> None: ...
    def on_stop(self, reason: str) -> None: ...
    def on_queue_standing(self, standing: bool, wait_s: float) -> None: ...


class NullObserver:
    def on_plan(self, plan: Plan, queue_depth: int, active: int) -> None: ...
    def on_step(self, stage: Stage, batch: int, elapsed_s: float, frames: int) -> None: ...
    def on_first_audio(self, ttfa_s: float, phases: dict[str, float] | None = None) -> None: ...
    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None: ...
    def on_second_chunk(self, gap_s: float, phases: dict[str, float]) -> None: ...
    def on_reject(self, reason: str) -> None: ...
    def on_stop(self, reason: str) -> None: ...
    def on_queue_standing(self, standing: bool, wait_s: float) -> None: ...


@dataclass(slots=True)
class Ready:
    """A stream that can use a stage this turn, and how urgently (made once per stream per
    turn: slotted and not frozen, whose __init__ took 0.18 us against 0.76 on this CPU)."""

    klass: str  # priority class (CLASS_ORDER)
    order: tuple  # sorts within and across classes
    slack: float | None  # seconds to spare (None: waiting for its first audio)
    stream: Stream
    stage: Stage
    new: bool  # prefilled this turn: its slot may be known only after admission


class RowCost:
    """Seconds per frame step as a + b * rows, fitted over recent steps (exponentially
    weighted least squares), to tell how throughput changes with the batch: flat on a GPU
    (rows nearly free), proportional on a CPU. Until steps of different sizes were seen the
    cost is taken as proportional to rows (a = 0): the cautious guess, that batching saves
    nothing."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, rows, s, rows^2, rows * s

    def observe(self, rows: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * self.decay for v in self.sums)
        self.sums = (w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds)

    def speedup(self, rows_from: float, rows_to: float) -> float:
        """Rows per second of frame step at rows_to over that at rows_from."""
        w, x, y, xx, xy = self.sums
        if w == 0 or y <= 0:
            return 1.0
        mean_x, mean_y = x / w, y / w
        variance = xx / w - mean_x**2
        if variance < 0.05:  # one batch size so far (rows are whole numbers)
            return 1.0
        b = max(0.0, (xy / w - mean_x * mean_y) / variance)
        a = max(0.0, mean_y - b * mean_x)
        return (rows_to / (a + b * rows_to)) / (rows_from / (a + b * rows_from))


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
        # (end time, busy s, samples generated, rows in the frame step or 0)
        self._steps: deque[tuple[float, float, int, int]] = deque()
        self.frame_cost = RowCost()
        self._last_commit: float | None = None  # None: the loop idled since
        self._in_flight = 0  # stages launched (commit_launch) and not yet read back
        self._audio_in_flight = 0  # of which codec steps (SchedulerConfig.max_audio_in_flight)
        self._lane = True  # lane_wanted()'s state
        self._frame_steps = 0  # frame steps launched (Stream.frame_step)
        self._releases: deque[float] = deque()  # when slots were freed (slot_wait)
        self._admits: deque[float] = deque()  # when new streams were accepted (ditto)
        self._standing_since: float | None = None  # a queue stands (queue_wait)
        self._above_since: float | None = None  # a queued request waited over the target
        self._refused_at = -math.inf  # the latest refusal (429 or 503)
        self._overload_at = -math.inf  # ...of those not by the overload slack alone

    # -- asyncio side ------------------------------------------------------------------------
    def submit(
        self,
        request: Any,
        sink: Sink,
        chunk_schedule: Sequence[int] | None = None,
        trimmer: Trimmer | None = None,
        follows: int | None = None,
        continuation: bool = False,
    ) -> Stream:
        """Queue a request, or raise Rejected at once. `follows`: the id of a stream whose
        audio the client plays before this one's (the previous segment of a session).
        `continuation`: a later segment of an admitted session, never refused (see above)."""
        cfg = self.config
        if continuation:
            pass  # the session was admitted once for its whole text
        elif len(self.queue) >= cfg.max_queue:
            self._reject("queue_full")
            raise Rejected(429, "queue_full", f"server busy: {len(self.queue)} requests queued")
        elif self.unsent_samples() > cfg.max_buffered_s * SAMPLE_RATE:
            self._reject("buffered_audio")
            raise Rejected(503, "buffered_audio", "server overloaded: too much audio unsent")
        now = self.clock()
        schedule = tuple(chunk_schedule or self.profile.chunk_schedule)
        stream = Stream(
            id=next(self._ids),
            request=request,
            sink=sink,
            chunk_schedule=schedule,
            ramp_speed=ramp_speed(schedule),
            trimmer=trimmer,
            arrived_at=now,
            follows=self.streams.get(follows) if follows is not None else None,
            continuation=continuation,
        )
        refusal = None if continuation else self._capacity_refusal(stream, now)
        if refusal is not None:
            why, overloaded = refusal
            self._reject("capacity", overloaded)
            raise Rejected(429, "capacity", f"server at capacity: {why}; try again shortly")
        if not continuation and (wait := self._slot_wait_refusal(now)) is not None:
            self._reject("no_slot")
            raise Rejected(429, "no_slot", f"server busy: {wait}; try again shortly")
        self.streams[stream.id] = stream
        self.queue.append(stream)
        if not continuation and cfg.overload_admit_rate > 0:  # (none kept when it is off)
            self._admits.append(now)
            self._forget(self._admits, now)
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

    # -- admission ---------------------------------------------------------------------------
    def capacity(self, now: float, streams: int | None = None) -> float | None:
        """Real-time streams the engine sustains with `streams` generating (default: as
        now), less the margin (None: no evidence in the window).

        Audio seconds generated per second of engine work over the last window is the number
        of real-time streams the engine sustains at the batch it ran; at another number of
        streams the frame step's fitted cost per row scales it (see RowCost)."""
        cfg = self.config
        if not cfg.admit_by_capacity:
            return None
        while self._steps and self._steps[0][0] < now - cfg.capacity_window_s:
            self._steps.popleft()
        busy = sum(step[1] for step in self._steps)
        produced = sum(step[2] for step in self._steps) / SAMPLE_RATE
        frame_steps = [step[3] for step in self._steps if step[3]]
        if busy < 0.05 * cfg.capacity_window_s or produced <= 0 or not frame_steps:
            return None
        measured = produced / busy / (1 + cfg.capacity_margin)
        if streams is None:
            return measured
        rows_then = sum(frame_steps) / len(frame_steps)
        rows_at = min(max(streams, 1), cfg.max_batch)
        return measured * self.frame_cost.speedup(rows_then, rows_at)

    def demand(self) -> float:
        """Real-time streams' worth of generation the admitted streams need now: each one
        still generating and not paused, a ramping one at its ramp speed (see ramp_speed)."""
        live = [s for s in self.by_slot.values() if not s.generation_done and not self._paused(s)]
        return sum(s.demand() for s in live)

    @staticmethod
    def _fits(demand: float, extra: float, capacity: float | None) -> bool:
        """`extra` more fits beside `demand`. An engine with no demand always takes a stream:
        a device too slow for even one real-time stream serves one at a time."""
        return capacity is None or demand == 0 or demand + extra <= capacity

    def admit_slack(self, now: float) -> float:
        """The time to spare an admitted stream's latest chunk must have come with for new
        streams to be admitted: SchedulerConfig.admit_slack_s, at least overload_slack_s while
        the server is overloaded: a queue for slots stands (queue_wait), or a request was
        refused in the last standing_queue_s other than by this slack alone (its own
        refusals do not keep it on, or one stray refusal at moderate load would)."""
        cfg = self.config
        if self._standing_since is not None or self._refusing(now):
            return max(cfg.admit_slack_s, cfg.overload_slack_s)
        return cfg.admit_slack_s

    def behind(self, now: float | None = None, slack: float | None = None) -> int:
        """Streams still generating whose latest chunk came late for their playback, or with
        less than `slack` (default admit_slack(now)) to spare: the engine is not keeping up
        (or about to stop), whatever the capacity estimate says (a stream whose next chunk
        comes with time to spare no longer counts)."""
        if slack is None:
            slack = self.admit_slack(self.clock() if now is None else now)
        return sum(1 for s in self.by_slot.values()
                   if s.spare_s < slack and not s.generation_done)  # fmt: skip

    def _capacity_refusal(self, stream: Stream, now: float) -> tuple[str, bool] | None:
        """Why admitting `stream` would make admitted streams late (None: it would not), and
        whether the server is overloaded without the overload slack (False: that slack alone
        refuses it)."""
        if not self.config.admit_by_capacity:
            return None
        if (rate := self.config.overload_admit_rate) > 0 and self._refusing(now):
            self._forget(self._releases, now)
            self._forget(self._admits, now)
            if len(self._admits) >= rate * len(self._releases) + 1:
                return (f"{len(self._admits)} streams were admitted in the last "
                        f"{self.config.release_window_s:g} s and {len(self._releases)} slots "
                        "freed"), False
        streams = len(self.by_slot) + len(self.queue) + 1
        capacity = self.capacity(now, streams)
        demand = self.demand() + sum(q.demand() for q in self.queue)
        fits = self._fits(demand, stream.demand(), capacity)
        if late := self.behind(now):
            overloaded = not fits or self.behind(now, self.config.admit_slack_s) > 0
            if not (slack := self.admit_slack(now)):
                return f"{late} admitted streams are behind their playback", overloaded
            return (f"{late} admitted streams are behind their playback or less than "
                    f"{1e3 * slack:g} ms from it"), overloaded  # fmt: skip
        if fits:
            return None
        return (
            f"the streams generating or queued need {demand:.1f} real-time streams' worth of "
            f"generation and this one {stream.demand():.1f} more; the engine sustains "
            f"{capacity:.1f} with {streams} streams (measured over the last "
            f"{self.config.capacity_window_s:g} s, {self.config.capacity_margin:.0%} margin kept)"
        ), True

    def slot_wait(self, now: float) -> float:
        """Seconds a request queued now would wait for a slot, expected from the slots freed
        over the last release_window_s: 0 while a slot is free for it and every request
        queued before it, inf when none was freed."""
        needed = len(self.queue) + 1 - (self.config.num_slots - len(self.by_slot))
        if needed <= 0:
            return 0.0
        self._forget(self._releases, now)
        n, window = len(self._releases), self.config.release_window_s
        return needed * window / n if n else math.inf

    def _forget(self, times: deque[float], now: float) -> None:
        """Drop the times (slot releases, acceptances) older than release_window_s."""
        while times and times[0] < now - self.config.release_window_s:
            times.popleft()

    def _refusing(self, now: float) -> bool:
        """A request was refused in the last standing_queue_s, other than by the overload
        slack alone (the overload slack and overload_admit_rate hold while it is)."""
        return now - self._overload_at <= self.config.standing_queue_s

    def queue_wait(self, now: float) -> float:
        """The longest a request may wait for a slot now: the overload wait while a queue
        stands, queue_timeout_s otherwise. A queue stands once the request at its head was
        seen waiting longer than the overload wait throughout standing_queue_s, and until no
        request was refused, for any reason, for that long."""
        cfg = self.config
        target = min(cfg.overload_wait, cfg.queue_timeout_s)
        if self._standing_since is None:
            oldest = next((s for s in self.queue if not s.continuation), None)
            if oldest is None or now - oldest.arrived_at <= target:
                self._above_since = None
            elif self._above_since is None:
                self._above_since = now
            elif now - self._above_since > cfg.standing_queue_s:
                self._standing_since = self._refused_at = now
                self._above_since = None
                self.observer.on_queue_standing(True, target)
        elif now - self._refused_at > cfg.standing_queue_s:
            self._standing_since = None
            self.observer.on_queue_standing(False, cfg.queue_timeout_s)
        return cfg.queue_timeout_s if self._standing_since is None else target

    def _slot_wait_refusal(self, now: float) -> str | None:
        """Why a request submitted now would get no slot within queue_wait, as far as the
        slots' recent releases tell (None: it may, or refuse_long_waits is off)."""
        cfg = self.config
        if not cfg.refuse_long_waits:
            return None
        wait, limit = self.slot_wait(now), self.queue_wait(now)
        if wait <= limit:
            return None
        held = f"all {cfg.num_slots} engine slots held, {len(self.queue)} requests queued"
        if math.isinf(wait):
            return f"{held} and no slot freed in the last {cfg.release_window_s:g} s"
        standing = "" if self._standing_since is None else (
            f" (requests have waited for slots for {now - self._standing_since:.1f} s)")
        return (f"{held}; at the {len(self._releases) / cfg.release_window_s:.0f} slots a "
                f"second freed lately a slot would take ~{1e3 * wait:.0f} ms, more than the "
                f"{1e3 * limit:g} ms a request waits{standing}")

    # -- engine thread -----------------------------------------------------------------------
    def plan(self, only: str | None = None) -> Plan:
        """The next turn's work. `only` narrows it for a turn the loop inserts while steps
        are in flight (serve.loop.EngineLoop): "new" admits and prefills queued streams and
        gives their first frame, nothing else (an arrival need not wait for the frame step
        in flight: with the engine's admission lane its work runs beside it); "first-frames"
        gives streams waiting for their first audio whose first chunk needs more frames their
        next frame, nothing else (a first chunk of two frames: the engine's lane runs it with
        plan.lane_frames 2); "first-audio" launches the first codec step of streams whose
        first chunk's frames were just launched, nothing else (admissions and prompts wait for
        the next turn)."""
        now = self.clock()
        release, self.to_release = self.to_release, []
        held = [s for s in self.by_slot.values() if s.status is Status.PREFILL]
        admit = [] if only in ("first-audio", "first-frames") else self._admissions(
            now, len(held))
        ready = self._ready(now)
        if self._audio_in_flight >= self.config.max_audio_in_flight:
            ready = [r for r in ready if r.stage is not Stage.AUDIO or self._lane_chunk(r.stream)]
        run_prefill = only not in ("first-audio", "first-frames") and self._prefill_now(ready)
        if only == "new":
            ready = []
        elif only == "first-frames":
            ready = [r for r in ready if _first_frames_due(r.stream) and r.stage is Stage.FRAMES]
        elif only == "first-audio":  # their first codec steps, alone on the engine's lane
            ready = [r for r in ready if r.stage is Stage.AUDIO and self._lane_chunk(r.stream)]
        if run_prefill:
            ready += [self._rank(s, Stage.FRAMES, now, new=True) for s in held + admit]
        ready.sort(key=lambda r: r.order)
        prefill = [s.slot for s in held] if run_prefill else None
        plan = Plan(release=release, admit=admit, prefill=prefill, stage=None, slots=[])
        if ready:
            self._choose_stage(plan, ready)
        if plan.is_empty and not self._in_flight:
            self._last_commit = None  # idle: the next step's cost starts fresh
        self.observer.on_plan(plan, len(self.queue) - len(admit), len(self.by_slot))
        return plan

    def lane_wanted(self) -> bool:
        """Whether the engine's admission lane should take new streams now
        (SchedulerConfig.lane_max_active): off once that many streams hold slots, on again
        when fewer than three quarters of it do (no flapping at the threshold)."""
        limit = self.config.lane_max_active
        if limit <= 0:
            return True
        active = len(self.by_slot)
        if self._lane and active >= limit:
            self._lane = False
        elif not self._lane and active < (3 * limit) // 4:
            self._lane = True
        return self._lane

    def arrival_admissible(self) -> bool:
        """A queued stream would be admitted by a turn planned now (a free slot, capacity)."""
        if not self.queue:
            return False
        held = sum(1 for s in self.by_slot.values() if s.status is Status.PREFILL)
        return bool(self._admissions(self.clock(), held))

    def first_audio_due(self) -> bool:
        """A stream has the frames of a chunk the engine's lane decodes (`_lane_chunk`: its
        first, waiting for first audio; with lane_chunks > 1 its next one-frame ones), certain
        ones in flight included, and no codec step launched for it."""
        return self._any_ready(self._lane_chunk, Stage.AUDIO)

    def first_frames_due(self) -> bool:
        """A stream waiting for its first audio has its first frame launched and its first
        chunk needs more (a first chunk of two frames), and the engine's lane makes them
        (lane_frames > 1; elsewhere the frame rides along in the next regular step)."""
        return self.config.lane_frames > 1 and self._any_ready(_first_frames_due, Stage.FRAMES)

    def _any_ready(self, which: Callable[[Stream], bool], stage: Stage) -> bool:
        """Some stream `which` picks is ready for `stage` and not paused."""
        return any(which(s) and s.next_stage() is stage and not self._paused(s)
                   for s in self.by_slot.values())  # fmt: skip

    def _lane_chunk(self, s: Stream) -> bool:
        """A chunk whose codec step the engine's admission lane runs: the stream's first, and
        with lane_chunks > 1 its next one-frame chunks up to that many (excepted from
        max_audio_in_flight, launched in the loop's first-audio turns)."""
        return _first_chunk_due(s) or (
            s.audio_steps < self.config.lane_chunks and s.next_chunk_frames() == 1)

    def commit(self, plan: Plan, result: StepResult) -> list[tuple[Sink, Event]]:
        """Account a plan whose work was launched and read back at once."""
        return self.commit_collect(self.commit_launch(plan, result), result)

    def commit_launch(self, plan: Plan, result: StepResult) -> Launched:
        """What is known once a plan's work is launched: admissions, prompts run, the stage's
        frames in flight or frames handed to the codec (so the next plan can be made before
        this stage is read back). Events wait in the outbox (`events`)."""
        now = self.clock()
        self._in_flight += 1
        for stream in plan.admit:
            self._commit_admission(stream, result.admitted[stream.id], result, now)
        self._commit_prefill(result, now)
        launched = Launched(plan.stage, {}, set(result.launched), set(result.certain))
        self._frame_steps += bool(plan.stage is Stage.FRAMES and result.launched)
        for slot in result.stage_slots if plan.stage is not None else ():
            s = self.by_slot.get(slot)
            if s is None or s.status is Status.CANCELLED:
                continue
            if plan.stage is Stage.FRAMES:
                if slot in launched.launched:
                    s.inflight += 1
                    s.certain += slot in launched.certain
                    s.frame_step = self._frame_steps
                    if s.first_frame_at is None:
                        s.first_frame_at = now
            elif result.decoded.get(slot, 0) > 0:
                if s.first_codec_at is None:
                    s.first_codec_at = now
                s.decoded += result.decoded[slot]
                s.audio_steps += 1
                s.audio_inflight += 1
                if s.audio_steps == 1:
                    s.first_decoded = s.decoded
                    _mark_second_frames(s, now)  # made before the first chunk was decoded
                elif s.audio_steps == 2:
                    s.second_codec_at = now
            else:
                continue  # nothing to decode after all: no audio step for it
            launched.rows[slot] = s
        if launched.stage is Stage.AUDIO and launched.rows:
            self._audio_in_flight += 1
        return launched

    def commit_collect(self, launched: Launched, result: StepResult) -> list[tuple[Sink, Event]]:
        """Account a launched stage read back (`result` as filled by the runner)."""
        now = self.clock()
        self._in_flight -= 1
        self._audio_in_flight -= bool(launched.stage is Stage.AUDIO and launched.rows)
        if launched.stage is not None:
            self._commit_stage(launched, result, now)
        if result.prefilled or result.stage_slots:
            self._record_busy(result, now)
        self._expire_queue(now)
        return self.events()

    def events(self) -> list[tuple[Sink, Event]]:
        """Events emitted since the last call, to hand to their sinks outside the lock."""
        out, self._outbox = self._outbox, []
        return out

    # -- planning phases ---------------------------------------------------------------------
    def _admissions(self, now: float, held_prefills: int) -> list[Stream]:
        """Queued streams, FIFO, that get a slot this turn: while slots are free, the measured
        capacity holds them, and one batch holds this turn's new rows."""
        if not self.queue:
            return []  # (demand() below walks every stream in a slot)
        cfg = self.config
        limit = min(cfg.num_slots - len(self.by_slot), cfg.max_batch - held_prefills)
        # Continuations first, whatever the capacity: their session was admitted already.
        admit = [s for s in self.queue if s.continuation][: max(0, limit)]
        demand = self.demand() + sum(s.demand() for s in admit)
        fresh = (s for s in self.queue if not s.continuation)
        for s in itertools.islice(fresh, max(0, limit - len(admit))):
            capacity = self.capacity(now, len(self.by_slot) + len(admit) + 1)
            if not self._fits(demand, s.demand(), capacity):
                break
            admit.append(s)
            demand += s.demand()
        return admit

    def _ready(self, now: float) -> list[Ready]:
        """`_rank(s, s.next_stage(), now)` of every stream ready for frames or audio and not
        paused, with those calls inlined: it runs over every stream in a slot each turn
        (0.9 ms per plan at 80 req/s on the H200 host, benchmarks/serve/plan_cost.py).
        tests/serve/test_scheduler_ready.py holds it to the methods it inlines."""
        audio_s, frames_s = self.cost_s[Stage.AUDIO], self.cost_s[Stage.FRAMES]
        margin = self.profile.safety_margin_s
        urgent, soon = self.profile.urgent_slack_s, self.profile.soon_slack_s
        paused_above = self.config.stream_buffer_s * SAMPLE_RATE
        deadline, first = CLASS_ORDER["deadline"], CLASS_ORDER["first-audio"]
        soon_order, rr = CLASS_ORDER["soon"], CLASS_ORDER["round-robin"]
        decoding, frames, audio, inf = Status.DECODING, Stage.FRAMES, Stage.AUDIO, math.inf
        out = []
        for s in self.by_slot.values():
            if s.status is not decoding or s.samples_unsent > paused_above:
                continue  # prefilling (or done): no stage of these two; paused
            pending = s.frames + s.certain - s.decoded
            schedule = s.chunk_schedule
            steps = s.audio_steps
            want = schedule[steps] if steps < len(schedule) else schedule[-1]
            if pending >= want or (s.generation_done and pending > 0):
                stage, need = audio, audio_s
            elif s.generation_done:
                continue
            else:  # frames missing: want - pending >= 1 here (_slack's max(1, ...))
                stage, need = frames, audio_s + (want - pending) * frames_s
            # playback_end(), inlined where the stream follows no other
            if s.follows is None:
                start = s.first_audio_at
                if s.plays_from is not None:
                    start = s.plays_from if start is None else max(start, s.plays_from)
                end = None if start is None else start + s.samples_sent / SAMPLE_RATE
            else:
                end = s.playback_end()
            if end is None:
                if s.follows is None:
                    out.append(Ready("first-audio", (first, s.arrived_at, s.id), None, s,
                                     stage, False))  # fmt: skip
                    continue
                slack = inf
            else:
                slack = end - margin - now - need  # the same sum as _slack's, in its order
            if slack <= urgent:
                out.append(Ready("deadline", (deadline, slack), slack, s, stage, False))
            elif slack <= soon:
                out.append(Ready("soon", (soon_order, slack), slack, s, stage, False))
            else:
                out.append(Ready("round-robin", (rr, s.last_served_at, s.id), slack, s, stage,
                                 False))  # fmt: skip
        return out

    def _prefill_now(self, ready: list[Ready]) -> bool:
        """Prompts run this turn unless waiting for them would make a stream's playback run
        dry (its slack spends the safety margin, not only the prefill): new requests hold
        capacity they were admitted for, so their prompts yield only to a real underrun."""
        margin = self.profile.safety_margin_s
        deadlines = [r.slack + margin for r in ready if r.klass == "deadline"]
        return not deadlines or min(deadlines) >= self.cost_s[Stage.PREFILL]

    def _frames_due_in(self, ready: list[Ready]) -> float | None:
        """Paced frame steps: seconds until a frame step is due (<= 0: now); None when no
        stream waits for frames or pacing is off (a step is then due whenever rows are ready).
        Due: a new stream or one waiting for its first audio, or a stream whose slack is below
        pace_slack_s."""
        pace = self.config.pace_slack_s
        frames = [r for r in ready if r.stage is Stage.FRAMES]
        if pace <= 0 or not frames:
            return None
        if any(r.new or r.slack is None for r in frames):
            return 0.0
        return min(r.slack for r in frames) - pace

    def _choose_stage(self, plan: Plan, ready: list[Ready]) -> None:
        """The anchor's stage; its batch: the max_batch most urgent rows ready for it, this
        turn's new rows all together or not at all. Paced (pace_slack_s): no frame step before
        one is due; the codec's work goes first meanwhile."""
        due_in = self._frames_due_in(ready)
        if due_in is not None and due_in > PACE_RESOLUTION_S:
            plan.frames_due_in = due_in
            ready = [r for r in ready if r.stage is not Stage.FRAMES]
            if not ready:
                return
        anchor, reason = ready[0], ready[0].klass
        if anchor.stage is Stage.FRAMES and self._chunk_runs_dry_during_frames(ready):
            anchor, reason = next(r for r in ready if r.stage is Stage.AUDIO), "codec-first"
        candidates = [r for r in ready if r.stage is anchor.stage]
        if anchor.stage is Stage.AUDIO:  # no row makes the codec step wait for a later frame
            waits = anchor.stream.codec_waits_for()
            candidates = [r for r in candidates if r.stream.codec_waits_for() <= waits]
        rows = candidates[: self.config.max_batch]
        if anchor.stage is Stage.AUDIO and self.config.codec_step_frames:
            rows = candidates = self._within_codec_budget(candidates)
        new_ready = sum(r.new for r in ready)
        plan.stage, plan.reason = anchor.stage, reason
        plan.frames_take_new = new_ready > 0 and sum(r.new for r in rows) == new_ready
        if not plan.frames_take_new:
            rows = [r for r in candidates if not r.new][: self.config.max_batch]
        plan.slots = [r.stream.slot for r in rows if not r.new]
        if anchor.stage is Stage.AUDIO and self.config.exact_chunks:
            plan.audio_frames = {r.stream.slot: r.stream.next_chunk_frames() for r in rows
                                 if not r.stream.generation_done}  # fmt: skip
        if not (plan.slots or plan.frames_take_new):
            plan.stage = None  # only new rows were ready, and they did not fit

    def _within_codec_budget(self, candidates: list[Ready]) -> list[Ready]:
        """The codec step's rows, most urgent first, whose frames fit in codec_step_frames
        (the first row always; a row too large is passed over for smaller ones behind it:
        it is less urgent, and becomes more urgent turn by turn), at most max_batch."""
        budget, exact = self.config.codec_step_frames, self.config.exact_chunks
        rows, total = [], 0
        for r in candidates:
            s = r.stream
            frames = s.pending()
            if exact and not s.generation_done:
                frames = min(frames, s.next_chunk_frames())
            if rows and total + frames > budget:
                continue
            rows.append(r)
            total += frames
            if len(rows) == self.config.max_batch:
                break
        return rows

    def _chunk_runs_dry_during_frames(self, ready: list[Ready]) -> bool:
        """A chunk whose frames are all made, due before a frame step would end: a codec step
        is short, so it goes first (on a serial engine; a pipelined one would overlap them)."""
        frame_step = self.cost_s[Stage.FRAMES]
        return any(
            r.stage is Stage.AUDIO and r.slack is not None and r.slack < frame_step for r in ready
        )

    def _rank(self, s: Stream, stage: Stage, now: float, new: bool = False) -> Ready:
        slack = self._slack(s, stage, now)
        if slack is not None and slack <= self.profile.urgent_slack_s:
            klass, order = "deadline", (slack,)
        elif slack is None:
            klass, order = "first-audio", (s.arrived_at, s.id)
        elif slack <= self.profile.soon_slack_s:
            klass, order = "soon", (slack,)
        else:
            klass, order = "round-robin", (s.last_served_at, s.id)
        return Ready(klass, (CLASS_ORDER[klass], *order), slack, s, stage, new)

    def _slack(self, s: Stream, stage: Stage, now: float) -> float | None:
        """Seconds to spare before the client's buffer runs dry. None: a request waiting for its
        first audio; inf: one that plays after audio that has not started playing either."""
        end = s.playback_end()
        if end is None:
            return None if s.follows is None else math.inf
        need = self.cost_s[Stage.AUDIO]
        if stage is Stage.FRAMES:
            missing = s.next_chunk_frames() - s.pending()
            need += max(1, missing) * self.cost_s[Stage.FRAMES]
        if s.status is not Status.DECODING:
            need += self.cost_s[Stage.PREFILL]
        return end - self.profile.safety_margin_s - now - need

    def _paused(self, s: Stream) -> bool:
        return s.samples_unsent > self.config.stream_buffer_s * SAMPLE_RATE

    # -- commit phases -----------------------------------------------------------------------
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

    def _commit_prefill(self, result: StepResult, now: float) -> None:
        if not result.prefilled:
            return
        a = self.config.cost_ema
        self.cost_s[Stage.PREFILL] = (1 - a) * self.cost_s[Stage.PREFILL] + a * result.prefill_s
        for slot in result.prefilled:
            s = self.by_slot.get(slot)
            if s is not None and s.status is Status.PREFILL:
                s.status, s.last_served_at = Status.DECODING, now
        self.observer.on_step(Stage.PREFILL, len(result.prefilled), result.prefill_s, 0)

    def _commit_stage(self, launched: Launched, result: StepResult, now: float) -> None:
        stage = launched.stage
        if not result.stage_slots:
            return
        if stage is Stage.AUDIO or launched.launched:  # a step ran: its time is evidence
            a = self.config.cost_ema
            self.cost_s[stage] = (1 - a) * self.cost_s[stage] + a * result.stage_s
        new_frames = 0
        for slot, s in launched.rows.items():
            if self.by_slot.get(slot) is not s or s.status is Status.CANCELLED:
                continue  # cancelled meanwhile (its slot may hold another stream by now)
            s.last_served_at = now
            if stage is Stage.FRAMES:
                if slot in launched.launched:
                    s.inflight -= 1
                    s.certain -= slot in launched.certain
                new, finished = result.frames.get(slot, (False, False))
                s.frames += new
                _mark_second_frames(s, now)
                if finished:
                    s.generation_done = True
                    s.stopped_by = result.stopped_by.get(slot)
                new_frames += new
            else:
                s.audio_inflight -= 1
                self._commit_audio(s, result.pcm[slot], now)
            if s.generation_done and not (s.inflight or s.audio_inflight) and s.pending() == 0:
                self._finish(s, now)
        self.observer.on_step(stage, len(result.stage_slots), result.stage_s, new_frames)

    def _record_busy(self, result: StepResult, now: float) -> None:
        # Capacity is measured in frames generated (each is 80 ms of audio) per second of
        # engine work, whatever the stage: every stage's time is part of the cost of a frame,
        # and so is the loop's own time between back-to-back steps (planning, committing,
        # handing chunks over), which the stage timing alone does not see.
        # Steps in flight together (a codec step beside a frame step, the admission lane's
        # steps beside both) share that time: from one read back to the next, the engine was
        # busy once, not once per step. While the loop did not idle since the last read, all
        # of that time counts (planning and handing chunks over included); after an idle
        # spell, the step's own time.
        busy = result.prefill_s + result.stage_s
        if self._last_commit is not None:
            busy = now - self._last_commit
        self._last_commit = now
        new_frames = sum(new for new, _ in result.frames.values())
        frame_rows = len(result.stage_slots) if result.frames else 0
        self._steps.append((now, busy, new_frames * FRAME_SAMPLES, frame_rows))
        if frame_rows:
            self.frame_cost.observe(frame_rows, result.stage_s)

    def _commit_audio(self, s: Stream, pcm: Sequence[float], now: float) -> None:
        if s.trimmer is not None:
            pcm = s.trimmer(pcm)
        if not len(pcm):
            return
        due = s.playback_end()  # None: a first chunk that nothing plays before
        if s.first_audio_at is None:
            s.first_audio_at = now
            if due is None:
                self.observer.on_first_audio(now - s.arrived_at, _first_audio_phases(s, now))
        if due is not None:
            self.observer.on_chunk(now - due, s.chunks_sent, s.samples_sent / SAMPLE_RATE)
            s.spare_s = due - now
        if s.chunks_sent == 1 and (phases := _second_chunk_phases(s, now)) is not None:
            self.observer.on_second_chunk(now - s.first_audio_at, phases)
        self._emit(s, Chunk(s.chunks_sent, pcm))
        s.chunks_sent += 1
        s.samples_sent += len(pcm)
        s.samples_unsent += len(pcm)

    def _finish(self, s: Stream, now: float) -> None:
        s.status = Status.FINISHED
        self._free_slot(s)
        for other in self.by_slot.values():  # its followers keep the time, not the stream
            if other.follows is s:
                other.plays_from, other.follows = s.playback_end(), None
        for other in self.queue:
            if other.follows is s:
                other.plays_from, other.follows = s.playback_end(), None
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
        """Answer 429 to queued requests past queue_wait that the next turn would not admit
        either (one that only waited for the engine's turn, a slot free, is not refused)."""
        timeout = self.queue_wait(now)
        expired = [s for s in self.queue if not s.continuation and now - s.arrived_at > timeout]
        if expired:
            held = sum(1 for s in self.by_slot.values() if s.status is Status.PREFILL)
            admissible = {s.id for s in self._admissions(now, held)}
            expired = [s for s in expired if s.id not in admissible]
        if not expired:
            return
        free = self.config.num_slots - len(self.by_slot)
        ahead = {s.id: i for i, s in enumerate(self.queue)}  # requests queued before each
        for s in expired:
            self.queue.remove(s)
            s.status = Status.FAILED
            waited = f"the {now - s.arrived_at:.2f} s it waited"
            if free <= 0:
                reason, why = "no_slot", f"no engine slot freed in {waited}"
            elif ahead[s.id] >= free:  # the free slots go to the requests before it
                reason, why = "no_slot", (f"no engine slot for it in {waited}: {free} free, "
                                          f"{ahead[s.id]} requests queued before it")
            else:
                reason, why = "capacity", f"the engine stayed at capacity for {waited}"
            if self._standing_since is not None:
                why += (f" (requests have waited for slots for {now - self._standing_since:.1f}"
                        f" s: a request waits at most {timeout:g} s)")
            self._reject(reason)
            self._emit(s, Failed(429, why, reason))

    def _free_slot(self, s: Stream) -> None:
        if s.slot is not None and self.by_slot.get(s.slot) is s:
            del self.by_slot[s.slot]
            self.to_release.append(s.slot)
            now = self.clock()
            self._releases.append(now)
            self._forget(self._releases, now)

    def _emit(self, s: Stream, event: Event) -> None:
        self._outbox.append((s.sink, event))

    def _reject(self, reason: str, overloaded: bool = True) -> None:
        """Count a refusal; `overloaded` False: the overload slack alone refused it."""
        self._refused_at = self.clock()
        if overloaded:
            self._overload_at = self._refused_at
        self.observer.on_reject(reason)


CANCEL = "cancel"  # guards.StopReason.CANCEL (this module stays free of torch imports)


def _first_audio_phases(s: Stream, now: float) -> dict[str, float] | None:
    """Where a first chunk's time went, as the engine thread saw it: arrival -> admitted
    (its admission turn launched), -> first frame step launched, -> first codec step
    launched, -> its audio read back and handed over."""
    marks = (s.arrived_at, s.admitted_at, s.first_frame_at, s.first_codec_at, now)
    if any(m is None for m in marks):
        return None
    spans = zip(FIRST_AUDIO_PHASES, marks[:-1], marks[1:], strict=True)
    return {name: b - a for name, a, b in spans}


FIRST_AUDIO_PHASES = ("admit", "frame", "codec", "read")


def _mark_second_frames(s: Stream, now: float) -> None:
    """Once its first codec step is launched: when the frames of its second chunk (the
    schedule's second size past what the first took) are all read back."""
    if s.second_frames_at is None and s.audio_steps >= 1:
        size = s.chunk_schedule[min(1, len(s.chunk_schedule) - 1)]
        if s.frames >= s.first_decoded + size:
            s.second_frames_at = now


def _second_chunk_phases(s: Stream, now: float) -> dict[str, float] | None:
    """Where the time from a stream's first chunk (handed over) to its second went, as the
    engine thread saw it: -> the second chunk's frames read back (0 if they were before),
    -> its codec step launched (0 if that was before), -> its audio read back and handed
    over. They add up to the gap, the first chunk's 80 ms of playback being what the second
    must beat (the underruns under load are this chunk: benchmarks/serve/RESULTS.md)."""
    t1, tf, tc = s.first_audio_at, s.second_frames_at, s.second_codec_at
    if t1 is None or tf is None or tc is None:
        return None  # e.g. generation ended short of a full second chunk
    made = max(tf, t1)
    return {"frames": made - t1, "codec": max(0.0, tc - made), "read": now - max(tc, made)}


SECOND_CHUNK_PHASES = ("frames", "codec", "read")


def _first_frames_due(s: Stream) -> bool:
    """Waiting for its first audio, first frame launched, no codec step yet."""
    return _first_chunk_due(s) and s.status is Status.DECODING and s.frames + s.inflight > 0


def _first_chunk_due(s: Stream) -> bool:
    """No codec step of this stream launched yet."""
    return s.first_audio_at is None and s.audio_steps == 0 and s.audio_inflight == 0


CLASS_ORDER = {"deadline": 0, "first-audio": 1, "soon": 2, "round-robin": 3}
# A plan's reason is its anchor's class, or "codec-first" (see _chunk_runs_dry_during_frames).
