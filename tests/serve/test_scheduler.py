"""The scheduling policy on a fake clock with fake stage timings (no torch, no threads)."""

from __future__ import annotations

import random

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
    RowCost,
    Scheduler,
    Stage,
    Status,
    ramp_speed,
)

from .fakes import FakeClock, FakeEngine, FakeRequest, FakeRequestError


class Harness:
    """Capacity admission is off unless asked for: a few steps at one batch size are too
    little evidence for it to admit several streams at once (see the admission tests)."""

    def __init__(self, num_slots=4, admit_by_capacity=False, **cfg):
        self.clock = FakeClock()
        self.engine = FakeEngine(self.clock, num_slots=num_slots)
        config = SchedulerConfig(num_slots=num_slots, admit_by_capacity=admit_by_capacity, **cfg)
        self.sched = Scheduler(config, self.clock, initial_cost_s=0.02)
        self.runner = Runner(self.engine, FakeRequestError)
        self.events: dict[int, list] = {}
        self.plans = []

    def submit(self, frames=10, schedule=None, refuse=None, follows=None):
        events = []
        stream = self.sched.submit(
            FakeRequest(frames, refuse), events.append, schedule, follows=follows
        )
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
            plan = self.step()
            if plan.is_empty:  # idle until the next paced frame step is due, 5 ms at most
                due = plan.frames_due_in
                self.clock.advance(0.005 if due is None else max(1e-4, min(0.005, due)))
        raise AssertionError("condition never met")

    def chunks(self, stream):
        return [e for e in self.events[stream.id] if isinstance(e, Chunk)]

    def arrive_every(self, interval, until, frames):
        """A request of `frames` every `interval` s until the clock reaches `until`, the
        engine stepping in between: (the streams queued, [(time, Rejected) refused at once])."""
        streams, refused, next_arrival = [], [], self.clock.t
        while self.clock.t < until:
            if self.clock.t >= next_arrival:
                next_arrival += interval
                try:
                    streams.append(self.submit(frames=frames))
                except Rejected as err:
                    refused.append((self.clock.t, err))
            if self.step().is_empty:
                self.clock.advance(0.005)
        return streams, refused


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


def test_new_request_is_admitted_prefilled_and_framed_in_one_turn():
    h = Harness()
    old = h.submit(frames=200)
    h.run_until(lambda: len(h.chunks(old)) >= 3)  # about 0.6 s of audio buffered ahead
    new = h.submit(frames=5)
    plan = h.step()
    assert plan.admit == [new] and plan.prefill == []  # [] + the slot admitted this turn
    assert plan.stage is Stage.FRAMES and plan.frames_take_new and plan.reason == "first-audio"
    assert h.engine.calls[-2:] == [("prefill", [new.slot]), ("frames", [old.slot, new.slot])]
    plan = h.step()
    assert plan.stage is Stage.AUDIO and plan.slots[0] == new.slot
    # first audio after one prefill, one frame step and one codec step: nothing else waited
    cost = h.engine.cost_s
    assert new.first_audio_at - new.arrived_at == pytest.approx(
        cost["prefill"] + cost["frames"] + cost["audio"]
    )


def test_arrivals_between_two_turns_share_one_prefill_and_one_frame_step():
    h = Harness(num_slots=8)
    established = [h.submit(frames=300) for _ in range(3)]
    h.run_until(lambda: all(len(h.chunks(s)) >= 4 for s in established))
    arrivals = [h.submit(frames=20) for _ in range(4)]
    h.run_until(lambda: all(h.chunks(s) for s in arrivals))
    prefills = [c for c in h.engine.calls if c[0] == "prefill"]
    assert len(prefills) == 2 and sorted(prefills[-1][1]) == sorted(s.slot for s in arrivals)
    cost = h.engine.cost_s
    for s in arrivals:
        ttfa = s.first_audio_at - s.arrived_at
        assert ttfa == pytest.approx(cost["prefill"] + cost["frames"] + cost["audio"])


def test_first_audio_waits_behind_at_most_one_frame_and_one_codec_step():
    """Arrivals at random moments while streams ramp up on an engine with GPU-like costs: each
    first chunk comes after its own prefill, frame and codec steps, plus at most one frame
    step and one codec step of streams whose buffers were about to run dry."""
    rng = random.Random(5)
    h = Harness(num_slots=16, admit_by_capacity=True, max_buffered_s=1e6, stream_buffer_s=1e6)
    h.engine.cost_s = cost = {"prefill": 0.004, "frames": 0.008, "audio": 0.004}
    own_path = cost["prefill"] + cost["frames"] + cost["audio"]
    arrivals, next_at = [], 0.0
    while h.clock.t < 10.0:
        if h.clock.t >= next_at and len(h.sched.by_slot) < 12:
            arrivals.append(h.submit(frames=rng.randint(10, 60)))
            next_at = h.clock.t + rng.uniform(0.0, 0.3)
        if h.step().is_empty:
            h.clock.advance(0.005)
    waits = sorted(s.first_audio_at - s.arrived_at - own_path for s in arrivals)
    assert len(waits) >= 40 and waits[0] == pytest.approx(0)
    assert waits[len(waits) // 2] == pytest.approx(0)  # most wait for nobody
    assert waits[-1] <= cost["frames"] + cost["audio"] + 1e-9


def test_stream_near_its_deadline_goes_before_a_new_request_and_its_prompt():
    h = Harness()
    old = h.submit(frames=200, schedule=(1,))
    h.run_until(lambda: h.chunks(old))
    h.clock.advance(0.08)  # its one frame (80 ms) of audio has nearly played out
    new = h.submit(frames=5)
    plan = h.step()
    assert plan.reason == "deadline" and plan.slots == [old.slot]
    assert plan.admit == [new] and plan.prefill is None  # admitted; its prompt waits a turn
    assert not plan.frames_take_new and new.status is Status.PREFILL
    h.run_until(lambda: h.chunks(new))
    assert ("prefill", [new.slot]) in h.engine.calls


def test_batch_fills_with_every_stream_ready_for_the_anchor_stage():
    h = Harness()
    streams = [h.submit(frames=50) for _ in range(3)]
    h.run_until(lambda: all(h.chunks(s) for s in streams))
    slots = [s.slot for s in streams]
    assert h.engine.calls[:3] == [("prefill", slots), ("frames", slots), ("audio", slots)]
    frame_plans = [p for p in h.plans if p.stage is Stage.FRAMES]
    assert frame_plans[0].frames_take_new and frame_plans[0].slots == []


class LatenessRecorder(NullObserver):
    def __init__(self):
        self.lateness = []

    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None:
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


def test_paced_frame_steps_carry_more_rows_and_keep_every_deadline():
    """pace_slack_s: a frame step runs only when a stream needs one (its slack below the
    pace, or its first audio still to come) and every ready stream rides along. Streams that
    arrive one after another then share steps instead of each running ahead at the engine's
    full speed: far fewer frame steps for the same frames, more rows in each, none late."""
    runs = {}
    for pace in (0.0, 0.3):
        h = Harness(num_slots=8, max_batch=8, pace_slack_s=pace)
        # a GPU's costs (the H200's, 1.7B FP8): a frame step ~flat in its rows
        h.engine.cost_s = {"prefill": 0.002, "frames": 0.0032, "audio": 0.001}
        h.engine.per_row_s = {"frames": 0.00004, "audio": 0.0006}
        h.sched.observer = recorder = LatenessRecorder()
        streams = []
        for _ in range(6):
            streams.append(h.submit(frames=120))
            start = h.clock.t
            h.run_until(lambda h=h, start=start: h.clock.t > start + 0.25)
        h.run_until(lambda ss=streams: all(s.status is Status.FINISHED for s in ss))
        steps = [slots for stage, slots in h.engine.calls if stage == "frames"]
        assert sum(map(len, steps)) == 6 * 120  # every frame made, once
        assert max(recorder.lateness) <= 0, pace  # no chunk after its playback ran dry
        waits = [p.frames_due_in for p in h.plans if p.frames_due_in is not None]
        runs[pace] = (len(steps), sum(map(len, steps)) / len(steps), waits)
    (plain, plain_rows, plain_waits), (paced, paced_rows, paced_waits) = runs[0.0], runs[0.3]
    assert paced <= 0.6 * plain and paced_rows >= 1.6 * plain_rows, runs
    assert not plain_waits and paced_waits and min(paced_waits) > 0


def test_queue_full_is_429_at_once():
    h = Harness(num_slots=1, max_queue=2, refuse_long_waits=False)  # they queue
    h.submit(), h.submit()
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.status == 429 and err.value.reason == "queue_full"


def test_no_slot_within_the_bound_is_429():
    h = Harness(num_slots=1, queue_timeout_s=0.5, refuse_long_waits=False)
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
    streams, refused = h.arrive_every(0.1, 6.0, frames=60)
    refused_at_once = [err for _, err in refused]
    refused_later = [
        e for s in streams for e in h.events[s.id] if isinstance(e, Failed) and e.status == 429
    ]
    return recorder.lateness, refused_at_once, refused_later, streams


def test_at_capacity_new_requests_are_refused_at_once_and_admitted_streams_keep_up():
    lateness, refused_at_once, refused_later, streams = _overload(admit_by_capacity=True)
    assert len(refused_at_once) > 10 and not refused_later  # excess load is turned away...
    assert max(lateness) <= 0  # ...and the admitted streams stay on time
    err = refused_at_once[0]
    assert err.status == 429 and err.reason == "capacity"
    assert "real-time streams' worth of generation" in err.message and "sustains" in err.message
    admitted = [s for s in streams if s.first_audio_at is not None]
    assert len(admitted) >= 5
    # an admitted request takes a slot in the next turn (no waiting for one to free) and
    # starts playing soon, one engine row at a time
    assert max(s.admitted_at - s.arrived_at for s in admitted) <= 0.03 + 1e-9
    assert max(s.first_audio_at - s.arrived_at for s in admitted) <= 0.15


def test_without_capacity_admission_every_stream_falls_behind():
    lateness, _, _, _ = _overload(admit_by_capacity=False)
    assert max(lateness) > 0.3  # the same load, admitted by free slots alone, underruns
    assert sum(late > 0 for late in lateness) > 0.2 * len(lateness)


def test_an_idle_server_admits_with_fresh_evidence_of_a_slow_engine():
    """Back-to-back requests on an engine too slow for even one real-time stream (100 ms per
    80 ms frame): each is served in turn, none refused (capacity counts at least one)."""
    h = Harness(num_slots=8, admit_by_capacity=True)
    h.engine.cost_s = {"prefill": 0.05, "frames": 0.1, "audio": 0.03}
    for _ in range(10):
        s = h.submit(frames=15)  # raises Rejected if refused
        h.run_until(lambda s=s: s.status is Status.FINISHED)
    assert h.sched.capacity(h.clock.t) < 1  # measured: not even one real-time stream
    assert not any(isinstance(e, Failed) for events in h.events.values() for e in events)


def test_a_slow_engine_serves_one_stream_and_refuses_the_next_truthfully():
    h = Harness(num_slots=8, admit_by_capacity=True)
    h.engine.cost_s = {"prefill": 0.05, "frames": 0.1, "audio": 0.03}
    first = h.submit(frames=40)
    h.run_until(lambda: len(h.chunks(first)) >= 3)  # evidence: ~0.6 s of audio per second
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.reason == "capacity"
    assert "1 admitted streams are behind their playback" in err.value.message
    h.run_until(lambda: first.status is Status.FINISHED)
    h.submit()  # the stream finished: room again


@pytest.mark.parametrize("admit_slack_s", [0.0, 0.01])
def test_a_chunk_with_little_time_to_spare_stops_admission_only_with_admit_slack(admit_slack_s):
    """SchedulerConfig.admit_slack_s: a stream whose latest chunk came 5 ms before its
    playback ran dry counts as behind for admission when the slack asked for is 10 ms (and
    not with 0, where only late chunks count); its next chunk with time to spare clears it."""
    h = Harness(num_slots=4, admit_by_capacity=True, admit_slack_s=admit_slack_s,
                overload_slack_s=0.0)  # (the margin under overload: the next test)
    s = h.submit(frames=40, schedule=(1,))
    h.run_until(lambda: len(h.chunks(s)) >= 1)
    due = s.playback_end()
    h.sched._commit_audio(s, [0.0] * FRAME_SAMPLES, due - 0.005)  # 5 ms to spare
    if admit_slack_s:
        with pytest.raises(Rejected) as err:
            h.submit()
        assert err.value.reason == "capacity"
        assert "less than 10 ms from it" in err.value.message
    else:
        h.submit()
    h.sched._commit_audio(s, [0.0] * FRAME_SAMPLES, s.playback_end() - 0.05)  # 50 ms early
    assert s.spare_s == pytest.approx(0.05) and h.sched.behind() == 0
    h.submit()


def test_the_overload_slack_holds_only_while_requests_are_being_refused():
    """SchedulerConfig.overload_slack_s: a stream whose latest chunk came 30 ms before its
    playback ran dry does not stop admission while nothing is refused; within
    standing_queue_s of a refusal (here: a full queue) it does, saying with what margin;
    once nothing but that slack refused anything for that long, admission is as before."""
    h = Harness(num_slots=4, admit_by_capacity=True, overload_slack_s=0.06, max_queue=1,
                standing_queue_s=0.5)  # fmt: skip
    s = h.submit(frames=400, schedule=(1,))
    h.run_until(lambda: len(h.chunks(s)) >= 1)
    h.sched._commit_audio(s, [0.0] * FRAME_SAMPLES, s.playback_end() - 0.03)  # 30 ms to spare
    assert h.sched.admit_slack(h.clock.t) == 0.0 and h.sched.behind() == 0
    queued = h.submit()  # nothing refused lately: admitted (to the queue)
    with pytest.raises(Rejected) as full:
        h.submit()
    assert full.value.reason == "queue_full"
    h.sched.close(queued.id)
    assert h.sched.admit_slack(h.clock.t) == 0.06 and h.sched.behind() == 1
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.reason == "capacity" and "less than 60 ms from it" in err.value.message
    h.clock.advance(0.3)
    with pytest.raises(Rejected):  # refused by the slack alone: that does not prolong it,
        h.submit()  # or one stray refusal at moderate load could keep it on for good
    h.clock.advance(0.21)  # 0.51 s after the full queue
    assert h.sched.admit_slack(h.clock.t) == 0.0
    h.submit()


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_under_overload_new_streams_come_no_faster_than_slots_are_freed(rate):
    """SchedulerConfig.overload_admit_rate: while requests are being refused (here: a full
    queue), a request is refused when the streams accepted over release_window_s already
    exceed rate x the slots freed in it (plus one), saying so; its own refusals do not
    prolong the overload, and once nothing else was refused for standing_queue_s admission
    is as before. Off (0): the same request is accepted."""
    h = Harness(num_slots=4, admit_by_capacity=True, overload_admit_rate=rate,
                overload_slack_s=0.0, max_queue=2, standing_queue_s=0.5)  # fmt: skip
    short = [h.submit(frames=3, schedule=(1,)) for _ in range(2)]
    h.run_until(lambda: all(s.status is Status.FINISHED for s in short))  # 2 slots freed
    long = h.submit(frames=400, schedule=(1,))  # nothing refused yet: accepted (3 accepted)
    h.run_until(lambda: long.status is Status.DECODING)
    queued = [h.submit(), h.submit()]  # 5 accepted, queued
    with pytest.raises(Rejected) as full:
        h.submit()
    assert full.value.reason == "queue_full"  # a refusal: the server is overloaded
    for q in queued:
        h.sched.close(q.id)
    if not rate:
        h.submit()
        assert not h.sched._admits  # nothing kept while it is off
        return
    assert len(h.sched._admits) == 5
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.reason == "capacity"
    assert "5 streams were admitted in the last 2 s and 2 slots freed" in err.value.message
    h.clock.advance(0.3)
    with pytest.raises(Rejected):  # still within 0.5 s of the full queue
        h.submit()
    h.clock.advance(0.21)  # 0.51 s after it: its own refusals did not prolong the overload
    h.submit()


def test_waiting_for_a_slot_ends_in_429_naming_the_slot_not_capacity():
    h = Harness(num_slots=1, queue_timeout_s=0.5, admit_by_capacity=False,
                refuse_long_waits=False)  # fmt: skip
    h.submit(frames=1000)
    waiting = h.submit()
    h.run_until(lambda: h.events[waiting.id])
    failed = h.events[waiting.id][0]
    assert failed.reason == "no_slot" and "no engine slot freed in the 0.5" in failed.message


def test_a_request_behind_others_for_the_last_free_slots_is_refused_for_no_slot():
    """With one slot free and three requests queued past their wait, the first would take the
    slot at the next turn and stays; the two behind it are refused as no_slot, saying how
    many were before them (not "capacity": a slot is what they lacked)."""
    h = Harness(num_slots=2, queue_timeout_s=0.05, refuse_long_waits=False)
    long = h.submit(frames=1000)
    h.run_until(lambda: long.status is Status.DECODING)
    queued = [h.submit() for _ in range(3)]
    h.clock.advance(0.1)
    h.sched._expire_queue(h.clock.t)
    for sink, event in h.sched.events():
        sink(event)
    assert queued[0].status is Status.QUEUED
    for i, s in enumerate(queued[1:], start=1):
        failed = h.events[s.id][0]
        assert failed.reason == "no_slot", failed.message
        assert f"1 free, {i} requests queued before it" in failed.message


def test_a_request_that_no_slot_would_take_soon_is_refused_at_once():
    """Every slot held by long streams and none freed lately: a new request is answered 429
    no_slot at submit (not after its wait), saying why; a free slot takes the next one."""
    h = Harness(num_slots=2, admit_by_capacity=True)
    long = [h.submit(frames=1000) for _ in range(2)]
    h.run_until(lambda: all(h.chunks(s) for s in long))
    assert h.sched.slot_wait(h.clock.t) == float("inf")
    with pytest.raises(Rejected) as err:
        h.submit()
    assert err.value.status == 429 and err.value.reason == "no_slot"
    assert "all 2 engine slots held, 0 requests queued" in err.value.message
    assert "no slot freed in the last 2 s" in err.value.message
    assert not h.sched.queue
    h.sched.close(long[0].id)  # a slot frees: the next request queues and gets it
    assert h.sched.slot_wait(h.clock.t) == 0
    s = h.submit(frames=3)
    h.run_until(lambda: s.status is Status.FINISHED)


def _slots_freed_at_a_steady_rate(num_slots=2, **cfg):
    """Both slots kept busy by short streams, a new one whenever one finishes, for 3 s
    (capacity admission off: the slots alone decide)."""
    h = Harness(num_slots=num_slots, max_queue=1000, **cfg)
    live = []
    while h.clock.t < 3.0:
        live = [s for s in live if s.status is not Status.FINISHED]
        while len(live) < num_slots:
            live.append(h.submit(frames=3))
        if h.step().is_empty:
            h.clock.advance(0.005)
    h.run_until(lambda: all(s.status is Status.DECODING for s in live))  # both slots held
    return h


@pytest.mark.parametrize("wait_s", [0.1, 0.3])
def test_requests_queue_while_the_slots_freed_lately_would_take_them_in_time(wait_s):
    """With slots freed at a measured rate r, a request queues while the requests ahead of it
    (and itself) would get slots within its wait (queue_wait), i.e. floor(r * wait) of them;
    the next is refused at once with the expected wait; the queued ones all get their slots."""
    h = _slots_freed_at_a_steady_rate(queue_timeout_s=wait_s)
    window = h.sched.config.release_window_s
    freed = len([t for t in h.sched._releases if t >= h.clock.t - window])
    rate = freed / window
    assert rate > 10  # evidence: short streams through two slots
    queued = []
    with pytest.raises(Rejected) as err:
        while True:
            queued.append(h.submit(frames=3))
    assert len(queued) == int(rate * wait_s)
    assert err.value.reason == "no_slot" and f"{1e3 * wait_s:g} ms a request waits" in \
        err.value.message  # fmt: skip
    h.run_until(lambda: all(s.status is Status.FINISHED for s in queued))
    assert not any(isinstance(e, Failed) for s in queued for e in h.events[s.id])


def test_long_waits_queue_when_asked_and_time_out_naming_the_slot():
    """refuse_long_waits False (serve --queue-long-waits): the request no slot would take
    soon queues; once it was seen waiting over the overload wait throughout standing_queue_s
    the queue stands, its wait is the profile's
    overload wait, long past, and it is answered 429 no_slot saying so."""
    h = Harness(num_slots=1, admit_by_capacity=True, refuse_long_waits=False)
    long = h.submit(frames=1000)
    h.run_until(lambda: h.chunks(long))
    waiting = h.submit()
    h.run_until(lambda: h.events[waiting.id])
    failed = h.events[waiting.id][0]
    wait = PROFILES[ProfileName.low_latency].overload_wait_s
    assert failed.reason == "no_slot" and "no engine slot freed in the 0.5" in failed.message
    assert f"a request waits at most {wait:g} s" in failed.message
    assert waiting.status is Status.FAILED
    assert h.clock.t - waiting.arrived_at < SchedulerConfig.standing_queue_s + 0.05


def test_a_request_that_waited_only_for_the_engines_turn_is_admitted_not_refused():
    """A request that arrives during a long step, a slot free, is still queued when the step
    is read back, past its wait (queue_wait): it was waiting for the turn, not for a slot, and the
    next turn admits it."""
    h = Harness(num_slots=2, queue_timeout_s=0.02)
    h.engine.cost_s = {"prefill": 0.01, "frames": 0.1, "audio": 0.01}
    first = h.submit(frames=40)
    h.run_until(lambda: h.chunks(first))
    plan = h.sched.plan()
    result = h.runner.execute(plan, clock=h.clock)
    late = h.submit(frames=3)  # arrives while the step runs; the step takes 50 ms more
    h.clock.advance(0.05)
    for sink, event in h.sched.commit(plan, result):
        sink(event)
    assert late.status is Status.QUEUED and not h.events[late.id]
    h.step()
    assert late.status is not Status.QUEUED and late.slot is not None
    h.run_until(lambda: late.status is Status.FINISHED)
    assert not any(isinstance(e, Failed) for e in h.events[late.id])


def test_the_overload_wait_is_the_profiles_unless_set():
    for name, profile in PROFILES.items():
        assert SchedulerConfig(profile=profile).overload_wait == profile.overload_wait_s, name
    assert SchedulerConfig(overload_wait_s=0.3).overload_wait == 0.3
    low = PROFILES[ProfileName.low_latency].overload_wait_s
    assert low < PROFILES[ProfileName.balanced].overload_wait_s < \
        PROFILES[ProfileName.throughput].overload_wait_s  # fmt: skip


def test_a_standing_queue_cuts_the_wait_for_a_slot_to_the_overload_wait():
    """Arrivals at several times the rate two slots free up: at first requests queue (a burst
    may pass), then, its head seen waiting over the overload wait throughout standing_queue_s,
    the queue stands and requests wait at most the overload wait (the rest 429 no_slot, most
    at once); when arrivals stop and nobody is refused for standing_queue_s, queue_timeout_s
    applies again."""
    h = Harness(num_slots=2, max_queue=1000, overload_wait_s=0.02, standing_queue_s=0.3)
    transitions = []

    class Recorder(NullObserver):
        def on_queue_standing(self, standing, wait_s):
            transitions.append((standing, wait_s))

    h.sched.observer = Recorder()
    streams, refused = h.arrive_every(0.02, 3.0, frames=10)
    standing = h.sched._standing_since
    assert standing is not None and 0.3 < standing < 1.0
    assert h.sched.admit_slack(h.clock.t) == h.sched.config.overload_slack_s  # overloaded
    waits = [(s.arrived_at, s.admitted_at - s.arrived_at) for s in streams if s.admitted_at]
    assert max(w for t, w in waits if t < standing) > 0.25  # the queue took the burst
    after = [w for t, w in waits if t > standing]
    assert len(after) > 10 and max(after) <= 0.02 + 0.03  # + one turn
    at_once = [t for t, err in refused if err.reason == "no_slot"]
    assert len(at_once) > len(after)  # (before the first slot freed too: no evidence yet)
    late = [e for s in streams for e in h.events[s.id] if isinstance(e, Failed)]
    assert all(e.reason == "no_slot" for e in late)
    h.run_until(lambda: not h.sched.queue and not h.sched.by_slot)
    h.clock.advance(0.31)
    assert h.sched.queue_wait(h.clock.t) == h.sched.config.queue_timeout_s
    assert h.sched._standing_since is None and h.sched.admit_slack(h.clock.t) == 0.0
    assert transitions == [(True, 0.02), (False, 2.0)]  # (serve: tts_queue_standing, a log)


def test_a_following_stream_is_due_by_the_playback_of_the_one_before():
    """Segment B plays after A: its chunks are due when A's audio has played out, not by
    when they were made, so B never takes first-audio priority and is never late."""
    h = Harness(num_slots=4, max_batch=1, admit_by_capacity=False)  # one row per step
    h.sched.observer = recorder = TtfaAndLateness()
    a = h.submit(frames=30)
    b = h.submit(frames=20, follows=a.id)
    h.run_until(lambda: len(h.chunks(a)) >= 2)
    assert not h.chunks(b)  # A's first chunks went first: B cannot play before A anyway
    c = h.submit(frames=10)  # a new request goes before B: B has slack, C has nothing yet
    h.run_until(lambda: h.chunks(c))
    assert not h.chunks(b)
    h.run_until(lambda: b.status is Status.FINISHED and a.status is Status.FINISHED)
    assert len(recorder.ttfa) == 2  # A and C: B's first chunk had a due time
    assert max(recorder.lateness) <= 0
    assert b.playback_start() == pytest.approx(a.playback_end())


class TtfaAndLateness(LatenessRecorder):
    def __init__(self):
        super().__init__()
        self.ttfa = []

    def on_first_audio(self, ttfa_s: float, phases=None) -> None:
        self.ttfa.append(ttfa_s)


def test_ramp_speed_is_the_generation_speed_growing_chunks_need():
    assert ramp_speed((1, 2, 4, 8, 12)) == 2.0  # each chunk twice the audio played before it
    assert ramp_speed((1, 1, 2, 4, 8, 12)) == 1.875  # low-latency's: chunk 5 (8) after 8 frames
    assert ramp_speed((4, 4, 8, 16, 25)) == pytest.approx(28 / 16)
    assert ramp_speed((25,)) == 1.0


def test_row_cost_fit_recovers_the_per_row_cost_and_is_cautious_on_one_size():
    rng = random.Random(11)
    a, b = rng.uniform(0.002, 0.01), rng.uniform(0.0001, 0.002)
    cost = RowCost()
    for _ in range(20):
        cost.observe(4, a + b * 4)
    assert cost.speedup(4, 32) == 1.0  # one batch size: no batching gain assumed
    for _ in range(200):
        rows = rng.randint(1, 64)
        cost.observe(rows, (a + b * rows) * rng.uniform(0.99, 1.01))
    expected = (32 / (a + b * 32)) / (4 / (a + b * 4))
    assert cost.speedup(4, 32) == pytest.approx(expected, rel=0.05)


def per_row_engine(clock, **kw):
    """Frame and codec steps that cost more per row, like a CPU (the base costs are per call)."""
    engine = FakeEngine(clock, **kw)
    engine.cost_s = {"prefill": 0.01, "frames": 0.0, "audio": 0.0}
    engine.per_row_s = {"frames": 0.02, "audio": 0.01}
    return engine


@pytest.mark.parametrize("per_row", [False, True])
def test_capacity_counts_batching_only_where_the_engine_shows_it(per_row):
    """Four streams started together give steps of several sizes: where a step costs the same
    at any size (a GPU) capacity grows with the streams, where it grows with rows it does not."""
    h = Harness(num_slots=16, admit_by_capacity=True, max_buffered_s=1e6, stream_buffer_s=1e6)
    if per_row:
        h.engine = h.runner.engine = per_row_engine(h.clock, num_slots=16)
    streams = [h.submit(frames=40 + 7 * i) for i in range(4)]  # ends staggered: sizes 1-4
    h.run_until(lambda: all(s.status is Status.FINISHED for s in streams))
    now = h.clock.t  # the last steps are still in the window
    at_one, at_eight = h.sched.capacity(now, 1), h.sched.capacity(now, 8)
    if per_row:
        assert at_eight == pytest.approx(at_one, rel=0.1)
    else:
        assert at_eight > 4 * at_one


def test_at_twice_capacity_excess_is_refused_at_once_and_admitted_streams_start_soon():
    rng = random.Random(3)
    h = Harness(num_slots=256, max_batch=256, admit_by_capacity=True, max_buffered_s=1e6,
                stream_buffer_s=1e6)  # fmt: skip
    costs = {"prefill": 0.003, "frames": 0.006, "audio": 0.003}
    # Steps with a fixed cost and a small one per row, like a GPU: capacity ~40 req/s of
    # 20-130 frame requests at 256 slots.
    h.engine = h.runner.engine = FakeEngine(h.clock, num_slots=256, cost_s=costs,
                                            per_row_s={"frames": 0.0002, "audio": 0.0001})
    h.sched.observer = recorder = LatenessRecorder()
    streams, refused, next_at = [], [], rng.expovariate(80)
    while h.clock.t < 10.0:  # Poisson arrivals at 80 req/s
        while h.clock.t >= next_at:
            try:
                streams.append(h.submit(frames=rng.randint(20, 130)))
            except Rejected as err:
                refused.append(err)
            next_at += rng.expovariate(80)
        if h.step().is_empty:
            h.clock.advance(0.001)
    assert len(refused) > 0.3 * (len(refused) + len(streams))
    assert all(e.reason == "capacity" for e in refused)
    assert not [e for s in streams for e in h.events[s.id] if isinstance(e, Failed)]
    settled = [s for s in streams if 2.0 < s.arrived_at < 9.5]  # past the start, not at the end
    assert all(s.first_audio_at is not None for s in settled)
    ttfa = sorted(s.first_audio_at - s.arrived_at for s in settled)
    assert ttfa[int(0.95 * len(ttfa))] <= 0.1
    # Admitted streams keep their playback: a handful of chunks late by under a millisecond
    # (stage-time estimates are running means), never more.
    late = [x for x in recorder.lateness if x > 0]
    assert len(late) <= 0.01 * len(recorder.lateness) and max(recorder.lateness) < 0.002


def test_a_session_admitted_once_keeps_its_segments_at_capacity():
    """A slow engine refuses a second stream at capacity, but a continuation (the next segment
    of an admitted WebSocket session) is never refused: it waits for its slot, ahead of new
    requests, and runs."""
    h = Harness(num_slots=8, admit_by_capacity=True)
    h.engine.cost_s = {"prefill": 0.05, "frames": 0.1, "audio": 0.03}
    first = h.submit(frames=40)
    h.run_until(lambda: len(h.chunks(first)) >= 3)
    with pytest.raises(Rejected):
        h.submit()
    events = []
    nxt = h.sched.submit(FakeRequest(5), events.append, None, None, continuation=True)
    h.run_until(lambda: any(isinstance(e, Done) for e in events))
    assert isinstance(events[0], Admitted)
    assert nxt.status is Status.FINISHED


def _codec_steps(budget, arrivals=6, gap_s=0.12):
    """Streams arriving one after another on an engine whose codec steps cost per frame
    decoded (a GPU's codec); every codec step's frames per row, and the lateness of chunks."""
    h = Harness(num_slots=8, max_batch=8, codec_step_frames=budget)
    h.engine.cost_s = {"prefill": 0.002, "frames": 0.004, "audio": 0.001}
    h.engine.audio_frame_s = 0.0008
    h.sched.observer = recorder = LatenessRecorder()
    steps = []
    launch_audio = h.engine.launch_audio

    def recording(slots, max_frames=None):
        ticket = launch_audio(slots, max_frames)
        steps.append({s: len(pcm) // FRAME_SAMPLES for s, pcm in ticket.outputs.items()})
        return ticket

    h.engine.launch_audio = recording
    streams = []
    for _ in range(arrivals):
        streams.append(h.submit(frames=90))
        start = h.clock.t
        h.run_until(lambda start=start: h.clock.t > start + gap_s)
    h.run_until(lambda: all(s.status is Status.FINISHED for s in streams))
    for s in streams:  # every frame decoded once, in the stream's own chunks
        assert sum(len(c.pcm) for c in h.chunks(s)) == 90 * FRAME_SAMPLES
    return steps, recorder.lateness


def test_codec_steps_stay_within_their_frame_budget_most_urgent_rows_first():
    """codec_step_frames: a codec step's rows join in urgency order while their frames fit,
    the first always; without it a step decodes every ready row's frames (up to 8 rows)."""
    free, free_late = _codec_steps(0)
    bounded, bounded_late = _codec_steps(10)
    assert max(sum(step.values()) for step in free) > 10  # the bound has work to do
    for step in bounded:
        assert sum(step.values()) <= 10 or len(step) == 1, step
    assert len(bounded) > len(free)  # the same frames in more, smaller steps
    assert max(bounded_late) <= 0 and max(free_late) <= 0


def test_codec_budget_takes_the_anchor_and_passes_over_rows_too_large():
    h = Harness(num_slots=4, codec_step_frames=5)
    sched = h.sched
    pending = {0: 8, 1: 4, 2: 3, 3: 1}  # most urgent first

    class S:
        def __init__(self, n):
            self.n, self.generation_done = n, False

        def pending(self):
            return self.n

        def next_chunk_frames(self):
            return 2

    rows = [type("R", (), {"stream": S(n), "slot": slot})() for slot, n in pending.items()]
    picked = sched._within_codec_budget(rows)
    assert [r.slot for r in picked] == [0]  # the anchor alone is over the budget already
    picked = sched._within_codec_budget(rows[1:])
    assert [r.slot for r in picked] == [1, 3]  # 4 + 1; the 3-frame row passed over
    sched.config = SchedulerConfig(num_slots=4, codec_step_frames=5, exact_chunks=True)
    picked = sched._within_codec_budget(rows)  # exact chunks: 2 frames each at most
    assert [r.slot for r in picked] == [0, 1, 3]  # 2 + 2 + 1: the third row's 2 passed over
    sched.config = SchedulerConfig(num_slots=4, codec_step_frames=50, max_batch=3)
    assert len(sched._within_codec_budget(rows)) == 3
