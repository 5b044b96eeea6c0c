"""The engine thread: plan, execute, commit; and the bridge that hands events to asyncio.

One thread owns the engine (the engine is not thread-safe and a GPU stream is serial anyway).
The scheduler is shared with the asyncio side under one lock, held only while planning and
committing (microseconds), never while a stage runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ttsbuild.serve.scheduler import Failed, Plan, Rejected, Scheduler, Stage, StepResult

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The slot-based engine API (ttsbuild.runtime.engine); EagerEngine and the GPU engine."""

    models: Any

    def admit(self, req: Any) -> int: ...
    def prefill(self, slots: list[int]) -> None: ...
    def frames(self, slots: list[int]) -> list[Any]: ...  # FrameOutput(slot, codes, finished)
    def audio(self, slots: list[int], max_frames: int | None = None) -> dict[int, Any]: ...
    def release(self, slot: int) -> None: ...
    def free_slots(self) -> int: ...
    def seed_of(self, slot: int) -> int: ...
    def stopped_by(self, slot: int) -> str | None: ...  # why generation ended (guards.StopReason)


class Runner:
    """Executes a plan on the engine; knows nothing of policy."""

    def __init__(self, engine: Engine, request_error: type[Exception] = ValueError):
        self.engine = engine
        self.request_error = request_error

    def execute(self, plan: Plan, clock: Callable[[], float] = time.perf_counter) -> StepResult:
        engine, result = self.engine, StepResult()
        for slot in plan.release:
            engine.release(slot)
        new_slots = []
        for stream in plan.admit:
            try:
                slot = engine.admit(stream.request)
            except self.request_error as exc:
                result.admitted[stream.id] = str(exc)
                continue
            result.admitted[stream.id] = slot
            new_slots.append(slot)
            result.seeds[stream.id] = engine.seed_of(slot)
        if plan.prefill is not None:
            result.prefilled = plan.prefill + new_slots
        if result.prefilled:
            start = clock()
            engine.prefill(result.prefilled)
            result.prefill_s = clock() - start
        result.stage_slots = list(plan.slots)
        if plan.stage is Stage.FRAMES and plan.frames_take_new:
            result.stage_slots += result.prefilled
        if not result.stage_slots:
            return result
        start = clock()
        if plan.stage is Stage.FRAMES:
            for out in engine.frames(result.stage_slots):
                result.frames[out.slot] = (out.codes is not None, out.finished)
                if out.finished:
                    result.stopped_by[out.slot] = str(engine.stopped_by(out.slot))
        elif plan.stage is Stage.AUDIO:
            result.pcm = engine.audio(result.stage_slots)
        result.stage_s = clock() - start
        return result


class EngineLoop:
    """Runs `scheduler` against `runner` in a daemon thread until stop()."""

    def __init__(self, scheduler: Scheduler, runner: Runner, idle_wait_s: float = 0.02):
        self.scheduler = scheduler
        self.runner = runner
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.idle_wait_s = idle_wait_s
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> bool:
        """One scheduling step; False when there was nothing to do."""
        with self.lock:
            plan = self.scheduler.plan()
            if plan.is_empty:
                events = self.scheduler.commit(plan, StepResult())
        if plan.is_empty:
            _deliver(events)
            return False
        result = self.runner.execute(plan)
        with self.lock:
            events = self.scheduler.commit(plan, result)
        _deliver(events)
        self.steps += 1
        return True

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self.wake.wait(self.idle_wait_s)
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
        """True once no slot is held and nothing is queued or waiting for release."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                s = self.scheduler
                if not (s.by_slot or s.queue or s.to_release):
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
