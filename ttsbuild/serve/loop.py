"""The engine thread: plan, execute, commit; and the bridge that hands events to asyncio.

One thread owns the engine (the engine is not thread-safe). The loop is pipelined over the
engine's split API: a turn launches its stage, then reads back earlier ones (see EngineLoop).
The scheduler is shared with the asyncio side under one lock, held only while planning and
committing (microseconds), never while a stage runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ttsbuild.serve.scheduler import (
    Failed,
    Launched,
    Plan,
    Rejected,
    Scheduler,
    Stage,
    StepResult,
)

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The slot-based engine API (ttsbuild.runtime.core.EngineCore): EagerEngine and the GPU
    engine. Stages are launched and read back separately (see runtime.core)."""

    models: Any

    def admit(self, req: Any) -> int: ...
    def prefill(self, slots: list[int]) -> None: ...
    def launch_frames(self, slots: list[int]) -> Any: ...
    def collect(self, ticket: Any) -> list[Any]: ...  # FrameOutput: slot, made, finished
    def launch_audio(
        self, slots: list[int], max_frames: int | Sequence[int | None] | None = None
    ) -> Any: ...
    def collect_audio(self, ticket: Any) -> dict[int, Any]: ...
    def ready(self, ticket: Any) -> bool: ...  # a launched step can be read without waiting
    def can_launch(self, slot: int) -> bool: ...  # not finished, under its frame limit
    def pending_frames(self, slot: int) -> int: ...  # known real, not yet decoded
    def release(self, slot: int) -> None: ...
    def free_slots(self) -> int: ...
    def seed_of(self, slot: int) -> int: ...
    def stopped_by(self, slot: int) -> str | None: ...  # why generation ended (guards.StopReason)


@dataclass
class InFlight:
    """A plan's stage launched on the engine and not yet read back."""

    stage: Stage | None
    result: StepResult  # admissions and prefill filled in; the stage's part at collect
    ticket: Any  # the engine's (None: nothing was launched)
    started: float  # clock at launch
    launched: Launched | None = None  # the scheduler's record (set by the loop)


HostTimer = Callable[[str, float], None]  # (part, seconds) of the engine thread's own time


def _no_timer(part: str, seconds: float) -> None:
    pass


class Runner:
    """Executes a plan on the engine; knows nothing of policy. `timer` hears the host time of
    each engine call (admit, prefill, launch_frames, launch_audio, collect_frames,
    collect_audio): where the engine thread's time goes, e.g. a launch that blocks.
    `codec_launches` hears how many codec launches each codec step made (engines whose
    ticket lists them, `launched`: one per chunk size its rows decode)."""

    def __init__(self, engine: Engine, request_error: type[Exception] = ValueError,
                 timer: HostTimer | None = None,
                 codec_launches: Callable[[int], None] | None = None):  # fmt: skip
        self.engine = engine
        self.request_error = request_error
        self.timer = timer or _no_timer
        self.codec_launches = codec_launches
        self._last_read = dict.fromkeys(Stage, float("-inf"))  # per stage: clock at last read

    def execute(self, plan: Plan, clock: Callable[[], float] = time.perf_counter) -> StepResult:
        """Launch the plan's work and read it back at once (a serial loop)."""
        return self.collect(self.launch(plan, clock), clock)

    def launch(self, plan: Plan, clock: Callable[[], float] = time.perf_counter) -> InFlight:
        """Release, admit and prefill, then launch the stage without waiting for it."""
        engine, result, timer = self.engine, StepResult(), self.timer
        for slot in plan.release:
            engine.release(slot)
        new_slots = []
        for stream in plan.admit:
            start = time.perf_counter()
            try:
                slot = engine.admit(stream.request)
            except self.request_error as exc:
                result.admitted[stream.id] = str(exc)
                continue
            finally:
                timer("admit", time.perf_counter() - start)
            result.admitted[stream.id] = slot
            new_slots.append(slot)
            result.seeds[stream.id] = engine.seed_of(slot)
        if plan.prefill is not None:
            result.prefilled = plan.prefill + new_slots
        if result.prefilled:
            start = clock()
            host = time.perf_counter()
            engine.prefill(result.prefilled)
            timer("prefill", time.perf_counter() - host)
            result.prefill_s = clock() - start
        result.stage_slots = list(plan.slots)
        if plan.stage is Stage.FRAMES and plan.frames_take_new:
            result.stage_slots += result.prefilled
        start, ticket = clock(), None
        if not result.stage_slots:
            return InFlight(plan.stage, result, None, start)
        host = time.perf_counter()
        if plan.stage is Stage.FRAMES:
            # A row whose last frame is still in flight cannot be launched again.
            rows = [s for s in result.stage_slots if engine.can_launch(s)]
            known = {s: engine.pending_frames(s) for s in rows}
            ticket = engine.launch_frames(rows) if rows else None
            result.launched = rows
            result.certain = [s for s in rows if engine.pending_frames(s) > known[s]]
            timer("launch_frames", time.perf_counter() - host)
        elif plan.stage is Stage.AUDIO:
            caps = [plan.audio_frames.get(s) for s in result.stage_slots]
            result.decoded = {s: engine.pending_frames(s) if cap is None else
                              min(engine.pending_frames(s), cap)
                              for s, cap in zip(result.stage_slots, caps, strict=True)}  # fmt: skip
            ticket = engine.launch_audio(result.stage_slots,
                                         caps if plan.audio_frames else None)  # fmt: skip
            timer("launch_audio", time.perf_counter() - host)
            if self.codec_launches is not None and hasattr(ticket, "launched"):
                self.codec_launches(len(ticket.launched))
        return InFlight(plan.stage, result, ticket, start)

    def ready(self, step: InFlight) -> bool:
        return step.ticket is None or self.engine.ready(step.ticket)

    def collect(self, step: InFlight, clock: Callable[[], float] = time.perf_counter) -> StepResult:
        """Read a launched stage back (waits for it) into its StepResult."""
        engine, result = self.engine, step.result
        host = time.perf_counter()
        if step.ticket is not None and step.stage is Stage.FRAMES:
            for out in engine.collect(step.ticket):
                result.frames[out.slot] = (out.made, out.finished)
                if out.finished:
                    result.stopped_by[out.slot] = str(engine.stopped_by(out.slot))
            self.timer("collect_frames", time.perf_counter() - host)
        elif step.ticket is not None and step.stage is Stage.AUDIO:
            result.pcm = engine.collect_audio(step.ticket)
            self.timer("collect_audio", time.perf_counter() - host)
        # A stage's cost: from its launch, or from when the previous step of its kind was read
        # (launched ahead, it queued behind that one): back to back, steps cost their spacing.
        now = clock()
        if step.stage is not None:
            result.stage_s = now - max(step.started, self._last_read[step.stage])
            self._last_read[step.stage] = now
        return result


class EngineLoop:
    """Runs `scheduler` against `runner` in a daemon thread until stop().

    Pipelined: a turn plans and launches its stage, then reads back earlier stages, so the
    next frame step is on the device before the last one is read, and a codec step (on its
    own stream on a GPU) never holds the frame loop: its audio is read once it is done
    (polled), at the latest when nothing else is left to do. At most `frames_ahead` frame
    steps stay in flight after a turn; audio reaches its streams in launch order.

    `express` (an engine with an admission lane, whose new rows' prefill, first frame and
    first codec step run beside the steps in flight): a request that arrives while the loop
    waits for a frame step is admitted at once, in a turn of its own (Scheduler.plan
    "new"), instead of after that step; and right after a turn launched new rows' first
    frame, their first codec step is launched behind it (plan "first-audio"), not a turn
    later. Without a lane both would only queue work behind the steps in flight."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        idle_wait_s: float = 0.02,
        frames_ahead: int = 1,
        poll_s: float = 0.0002,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] | None = None,
        express: bool = False,
        lane_switch: Callable[[bool], None] | None = None,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.express = express
        # Turns the engine's admission lane on or off (Scheduler.lane_wanted, checked at the
        # start of each turn); express admission follows it (it pays only beside a lane).
        self.lane_switch = lane_switch
        self._express_with_lane = express
        self.lane = True
        self._express_turn = False  # the next turn admits the arrival that cut a wait short
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.idle_wait_s = idle_wait_s
        self.frames_ahead = frames_ahead
        self.poll_s = poll_s
        self.idle_s = idle_wait_s  # this idle wait (shorter when a paced frame step is near)
        # The poll's wait: by default on `wake`, so a submit (or close) ends it at once
        # instead of after poll_s; a fake clock passes its own (advance by poll_s).
        self.clock, self.sleep = clock, sleep or self._wait_for_wake
        self.in_flight: list[InFlight] = []  # launch order
        self._releasing = 0  # slots planned for release, not yet released on the engine
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> bool:
        """One turn; False when there was nothing to do."""
        only, self._express_turn = ("new" if self._express_turn else None), False
        start = time.perf_counter()
        with self.lock:  # the lock's wait counts: the asyncio side holds it to submit
            if self.lane_switch is not None and self.scheduler.lane_wanted() != self.lane:
                self._switch_lane(not self.lane)
            plan = self._plan(only)
            if plan.is_empty and not self.in_flight:
                events = self.scheduler.commit(plan, StepResult())
        self.runner.timer("plan", time.perf_counter() - start)
        # paced frame steps: when the next one is due (the loop waits no longer than that)
        due_at = None if plan.frames_due_in is None else self.clock() + plan.frames_due_in
        self.idle_s = self.idle_wait_s if due_at is None else min(self.idle_wait_s,
                                                                  plan.frames_due_in)  # fmt: skip
        if plan.is_empty and not self.in_flight:
            _deliver(events)
            return False
        if not plan.is_empty:
            step = self._launch(plan)
            if self.express and plan.stage is Stage.FRAMES and step.result.launched:
                with self.lock:  # a first chunk of more frames: the next one at once
                    more = self._plan("first-frames") if (
                        self.scheduler.first_frames_due()) else None  # fmt: skip
                if more is not None and not more.is_empty:
                    self._launch(more)
                with self.lock:  # new rows' first frame is on the device: their codec step next
                    first = self._plan("first-audio") if (
                        self.scheduler.first_audio_due()) else None  # fmt: skip
                if first is not None and not first.is_empty:
                    self._launch(first)
        self._read_back(must=plan.is_empty, due_at=due_at)
        self.steps += 1
        return True

    def _switch_lane(self, on: bool) -> None:
        """The admission lane on or off for the turns from this one (the engine orders a
        stream's work across the switch: runtime.graph_engine's fresh rows and ring order)."""
        self.lane_switch(on)
        self.lane = on
        self.express = self._express_with_lane and on
        log.info("admission lane %s with %d streams in slots", "on" if on else "off",
                 len(self.scheduler.by_slot))  # fmt: skip

    def _plan(self, only: str | None) -> Plan:
        """The scheduler's plan (the caller holds the lock); its slots to release count as
        not yet released until the runner has released them (wait_idle)."""
        plan = self.scheduler.plan(only)
        self._releasing += len(plan.release)
        return plan

    def _launch(self, plan) -> InFlight:
        try:
            step = self.runner.launch(plan, self.clock)  # releases the plan's slots first
        finally:
            if plan.release:
                with self.lock:
                    self._releasing -= len(plan.release)
        start = time.perf_counter()
        with self.lock:
            step.launched = self.scheduler.commit_launch(plan, step.result)
            events = self.scheduler.events()
        _deliver(events)
        self.runner.timer("commit", time.perf_counter() - start)
        self.in_flight.append(step)
        return step

    def _arrival(self) -> bool:
        """express: a queued request would be admitted now (the caller stops waiting)."""
        if not (self.express and self.scheduler.queue):  # the queue's length: no lock needed
            return False
        with self.lock:
            self._express_turn = self.scheduler.arrival_admissible()
        return self._express_turn

    def _read_back(self, must: bool, due_at: float | None = None) -> None:
        """Read back every stage that is done, oldest first within its kind (frame steps,
        codec steps); wait while more than `frames_ahead` frame steps are in flight, or, with
        `must` (nothing was launched this turn), until one stage was read or, paced, until a
        frame step is due (`due_at`, clock time)."""
        while self.in_flight:
            heads = {}
            for step in self.in_flight:
                heads.setdefault(step.stage, step)
            done = [step for step in heads.values() if self.runner.ready(step)]
            if done:
                self._commit(min(done, key=self.in_flight.index))
                must = False
                continue
            frames = [step for step in self.in_flight if step.stage is Stage.FRAMES]
            if len(frames) > self.frames_ahead:
                due = frames[0]
            elif must:
                due = self.in_flight[0]
                if due_at is not None and self.clock() >= due_at:
                    return  # a paced frame step is due: plan it now
            else:
                return
            self.wake.clear()  # before looking at the queue: a submit after it ends the wait
            if self._arrival():
                return  # admit it now; the step waited for is read in a later turn
            audio_in_flight = any(step.stage is Stage.AUDIO for step in self.in_flight)
            paced = must and due_at is not None
            if (audio_in_flight or self.express or paced) and self.poll_s > 0:
                start = time.perf_counter()
                self.sleep(self.poll_s)  # a codec step or an arrival may come first: poll
                # how late the thread is back: the OS, and the GIL held by the event loop
                self.runner.timer("poll_lag", max(0.0, time.perf_counter() - start - self.poll_s))
            else:
                self._commit(due)  # waits for it
                must = False

    def _wait_for_wake(self, seconds: float) -> None:
        """The real-time poll: up to `seconds`, ended at once by a submit or close (their
        `wake`). A plain sleep noticed an arrival only at its end (on a 2-core CPU with
        stepping streams, the express turn started 0.02-0.03 ms later at the median and the
        admission was launched 0.03-0.06 ms later; over HTTP the difference is inside the
        noise: benchmarks/serve/host_sim.py)."""
        self.wake.wait(seconds)

    def _commit(self, step: InFlight) -> None:
        self.in_flight.remove(step)
        result = self.runner.collect(step, self.clock)
        start = time.perf_counter()
        with self.lock:
            events = self.scheduler.commit_collect(step.launched, result)
        _deliver(events)
        self.runner.timer("commit", time.perf_counter() - start)

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
        except Exception as exc:  # fail every stream and report unhealthy, never hang
            self.error = exc
            log.exception("engine loop crashed")
            with self.lock:
                streams = list(self.scheduler.streams.values())
            _deliver([(s.sink, Failed(500, "the engine failed", "engine_error")) for s in streams])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- asyncio side (any thread) -----------------------------------------------------------
    def submit(
        self,
        request: Any,
        sink,
        chunk_schedule: Sequence[int] | None = None,
        trimmer=None,
        follows: int | None = None,
        continuation: bool = False,
    ):
        if self.error is not None:
            raise Rejected(503, "engine_error", "the engine failed; see the server log")
        with self.lock:
            stream = self.scheduler.submit(
                request, sink, chunk_schedule, trimmer, follows, continuation
            )
        self.wake.set()
        return stream

    def ack(self, stream_id: int, samples: int) -> None:
        with self.lock:
            self.scheduler.ack(stream_id, samples)

    def close(self, stream_id: int) -> None:
        with self.lock:
            self.scheduler.close(stream_id)
        self.wake.set()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """True once no slot is held and nothing is queued or waiting for release (on the
        engine too: a turn takes the slots to release under the lock and releases them after
        it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                s = self.scheduler
                if not (s.by_slot or s.queue or s.to_release or self._releasing):
                    return True
            self.wake.set()
            time.sleep(0.005)
        return False


def _deliver(events) -> None:
    for sink, event in events:
        try:
            sink(event)
        except Exception:  # one consumer's bug must not stop every stream
            log.exception("sink failed")
