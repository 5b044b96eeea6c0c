"""The scheduling policy on a fake clock with fake stage timings (no torch, no threads)."""

from __future__ import annotations

import pytest

from ttsbuild.serve.config import FRAME_SAMPLES, PROFILES, ProfileName, SchedulerConfig
from ttsbuild.serve.loop import Runner
from ttsbuild.serve.scheduler import (
    Admitted,
    Chunk,
    Done,
    Failed,
    NullObserver,
    Rejected,
    Scheduler,
    Stage,
    Status,
)

from .fakes import FakeClock, FakeEngine, FakeRequest, FakeRequestError


class Harness:
    def __init__(self, num_slots=4, **cfg):
        self.clock = FakeClock()
        self.engine = FakeEngine(self.clock, num_slots=num_slots)
        config = SchedulerConfig(num_slots=num_slots, **cfg)
        self.sched = Scheduler(config, self.clock, initial_cost_s=0.02)
        self.runner = Runner(self.engine, FakeRequestError)
        self.events: dict[int, list] = {}
        self.plans = []

    def submit(self, frames=10, schedule=None, refuse=None):
        events = []
        stream = self.sched.submit(FakeRequest(frames, refuse), events.append, schedule)
        self.events[stream.id] = events
        return stream

    def step(self):
        plan = self.sched.plan()
        self.plans.append(plan)
        result = self.runner.execute(plan, clock=self.clock)
        for sink, event in self.sched.commit(plan, result):
            sink(event)
        return plan

    def run_until(self, predicate, max_steps=10_000):
        for _ in range(max_steps):
            if predicate():
                return
            if self.step().is_empty:
                self.clock.advance(0.005)
        raise AssertionError("condition never met")

    def chunks(self, stream):
        return [e for e in self.events[stream.id] if isinstance(e, Chunk)]


def test_stream_runs_to_done_with_the_ramped_chunk_schedule():
    h = Harness()
    s = h.submit(frames=20, schedule=(1, 2, 4, 8))
    h.run_until(lambda: s.status is Status.FINISHED)
    events = h.events[s.id]
    assert isinstance(events[0], Admitted) and events[0].seed == 1000
    sizes = [len(c.pcm) // FRAME_SAMPLES for c in h.chunks(s)]
    assert sizes == [1, 2, 4, 8, 5]  # the last entry repeats; the tail is what is left
    assert isinstance(events[-1], Done) and events[-1].stats["frames"] == 20
    assert events[-1].stats["stopped_by"] == "length_rule"  # the engine's reason, passed on
    h.step()  # the release happens in the next plan
    assert h.engine.free_slots() == 4 and not h.sched.by_slot


def test_new_request_goes_before_established_streams_with_slack():
    h = Harness()
    old = h.submit(frames=200)
    h.run_until(lambda: len(h.chunks(old)) >= 3)  # about 0.6 s of audio buffered ahead
    new = h.submit(frames=5)
    h.step()  # admission
    plan = h.step()
    assert plan.stage is Stage.PREFILL and plan.reason == "first-audio"
    assert plan.slots == [new.slot]
    h.run_until(lambda: h.chunks(new))
    # the old stream only rode along in batches the new one anchored
    anchors = [p for p in h.plans if p.stage is not None][-3:]
    assert all(p.slots[0] == new.slot for p in anchors)


def test_stream_near_its_deadline_goes_before_a_new_request():
    h = Harness()
    old = h.submit(frames=200, schedule=(1,))
    h.run_until(lambda: h.chunks(old))
    h.clock.advance(0.08)  # its one frame (80 ms) of audio has nearly played out
    new = h.submit(frames=5)
    h.step()  # admits new; the old stream's next frame was anchoring already
    plan = h.step()
    assert plan.reason == "deadline" and plan.slots[0] == old.slot
    assert new.slot not in plan.slots  # new needs PREFILL, a different stage


def test_batch_fills_with_every_stream_ready_for_the_anchor_stage():
    h = Harness()
    streams = [h.submit(frames=50) for _ in range(3)]
    h.run_until(lambda: all(h.chunks(s) for s in streams))
    frame_plans = [p for p in h.plans if p.stage is Stage.FRAMES]
    assert max(len(p.slots) for p in frame_plans) == 3
    prefill_plans = [p for p in h.plans if p.stage is Stage.PREFILL]
    assert len(prefill_plans) == 1 and len(prefill_plans[0].slots) == 3
    audio_plans = [p for p in h.plans if p.stage is Stage.AUDIO]
    assert max(len(p.slots) for p in audio_plans) == 3  # their first chunks are due together


class LatenessRecorder(NullObserver):
    def __init__(self):
        self.lateness = []

    def on_chunk(self, lateness_s: float) -> None:
        self.lateness.append(lateness_s)


def test_streams_sharing_a_one_row_engine_never_underrun():
    h = Harness(num_slots=2, max_batch=1)  # no batching: every row costs a whole step
    h.sched.observer = recorder = LatenessRecorder()
    streams = []
    for _ in range(2):  # staggered arrivals: ramp-ups overlap established streams
        streams.append(h.submit(frames=1000))
        start = h.clock.t
        h.run_until(lambda start=start: h.clock.t > start + 0.7)
    h.run_until(lambda: h.clock.t > 5.0)
    assert len(recorder.lateness) > 15 and max(recorder.lateness) <= 0
    leads = [s.samples_sent / 24000 - (h.clock.t - s.first_audio_at) for s in streams]
    assert all(lead > 0 for lead in leads)


def test_queue_full_is_429_at_once():
    h = Harness(num_slots=1, max_queue=2)
    h.submit(), h.submit()
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.status == 429 and err.value.reason == "queue_full"


def test_no_slot_within_the_bound_is_429():
    h = Harness(num_slots=1, queue_timeout_s=0.5)
    first = h.submit(frames=1000)
    waiting = h.submit()
    h.run_until(lambda: h.events[waiting.id])
    failed = h.events[waiting.id][0]
    assert isinstance(failed, Failed) and failed.status == 429 and failed.reason == "no_slot"
    assert waiting.status is Status.FAILED and first.status is Status.DECODING
    assert h.clock.t >= 0.5


def test_too_much_unsent_audio_is_503_and_pauses_the_stream():
    h = Harness(max_buffered_s=1.0, stream_buffer_s=0.5)
    s = h.submit(frames=100)
    h.run_until(lambda: s.samples_unsent > 0.5 * 24000)
    frames_then = s.frames
    for _ in range(20):  # nobody acks: the stream is paused, not generating
        h.step()
    assert s.frames == frames_then
    h.run_until(lambda: True)
    s.samples_unsent = 2 * 24000
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.status == 503 and err.value.reason == "buffered_audio"
    h.sched.ack(s.id, 2 * 24000)
    h.submit()  # accepted again once the client caught up


def test_refused_request_fails_with_400_and_holds_no_slot():
    h = Harness()
    s = h.submit(refuse="unknown voice")
    h.step()
    assert isinstance(h.events[s.id][0], Failed) and h.events[s.id][0].status == 400
    assert s.status is Status.FAILED and h.engine.free_slots() == 4


def test_close_frees_the_slot_at_the_next_plan_in_any_state():
    h = Harness(num_slots=2)
    queued_during_admit = h.submit()
    plan = h.sched.plan()  # about to admit it...
    h.sched.close(queued_during_admit.id)  # ...when the client goes away
    for sink, event in h.sched.commit(plan, h.runner.execute(plan, clock=h.clock)):
        sink(event)
    decoding = h.submit(frames=100)
    h.run_until(lambda: h.chunks(decoding))
    h.sched.close(decoding.id)
    queued = h.submit()
    h.sched.close(queued.id)
    h.run_until(lambda: not h.sched.to_release and h.step().is_empty)
    assert h.engine.free_slots() == 2
    assert not (h.sched.streams or h.sched.queue or h.sched.by_slot or h.sched.to_release)


def test_profiles_declare_ramps():
    low = PROFILES[ProfileName.low_latency].chunk_schedule
    assert low[0] == 1 and list(low) == sorted(low)
    assert PROFILES[ProfileName.throughput].chunk_schedule == (25,)


def _overload(admit_by_capacity: bool):
    """Requests arriving every 0.1 s at an engine that can keep ~3 streams in real time
    (one row per 20 ms frame step, 10 ms codec steps)."""
    h = Harness(num_slots=16, max_batch=1, admit_by_capacity=admit_by_capacity,
                queue_timeout_s=0.5, max_queue=64)  # fmt: skip
    h.sched.observer = recorder = LatenessRecorder()
    rejected, streams = 0, []
    next_arrival = 0.0
    while h.clock.t < 6.0:
        if h.clock.t >= next_arrival:
            next_arrival += 0.1
            try:
                streams.append(h.submit(frames=60))
            except Rejected as err:
                assert err.status == 429 and err.reason == "capacity"
                rejected += 1
        if h.step().is_empty:
            h.clock.advance(0.005)
    timed_out = sum(
        1 for s in streams if any(isinstance(e, Failed) and e.status == 429 for e in h.events[s.id])
    )
    return recorder.lateness, rejected + timed_out, streams


def test_at_capacity_new_requests_are_refused_and_admitted_streams_keep_up():
    lateness, refused, streams = _overload(admit_by_capacity=True)
    assert refused > 10  # excess load is turned away...
    assert max(lateness) <= 0  # ...and the admitted streams stay on time
    admitted = [s for s in streams if s.first_audio_at is not None]
    assert len(admitted) >= 5
    # Nobody waits long for a slot that only frees as streams finish: 429 instead.
    assert max(s.first_audio_at - s.arrived_at for s in admitted) <= 0.4


def test_without_capacity_admission_every_stream_falls_behind():
    lateness, _, _ = _overload(admit_by_capacity=False)
    assert max(lateness) > 0.5  # the same load, admitted by free slots alone, underruns


def test_an_idle_engine_is_never_saturated():
    h = Harness(num_slots=4)
    s = h.submit(frames=20)
    h.run_until(lambda: s.status is Status.FINISHED)
    h.clock.advance(2.0)
    assert not h.sched.saturated(h.clock.t)
