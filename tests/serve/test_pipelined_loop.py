"""The pipelined engine loop on a fake device with a fake clock: the next frame step is
launched before the last is read, codec steps run beside frame steps without holding them,
results reach streams in order, and a new request's first audio waits behind at most one
frame step."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from ttsbuild.serve.config import FRAME_SAMPLES, SchedulerConfig
from ttsbuild.serve.loop import EngineLoop, Runner
from ttsbuild.serve.scheduler import Chunk, Done, NullObserver, Scheduler, Stage, Status

from .fakes import FakeClock, FakeEngine, FakeRequest, FakeRequestError, RealClock

COST = {"prefill": 0.004, "frames": 0.008, "audio": 0.004}  # GPU-like steps


class Harness:
    def __init__(self, num_slots=8, codec_lane=True, pipelined=True, express=False,
                 admission_lane=False, **cfg):  # fmt: skip
        self.clock = FakeClock()
        # A GPU-like engine: a prefill is a graph replay that does not hold the host.
        self.engine = FakeEngine(self.clock, num_slots=num_slots, cost_s=dict(COST),
                                 codec_lane=codec_lane, async_prefill=pipelined,
                                 instant=False, admission_lane=admission_lane)  # fmt: skip
        config = SchedulerConfig(num_slots=num_slots, admit_by_capacity=False,
                                 max_buffered_s=1e6, stream_buffer_s=1e6, **cfg)  # fmt: skip
        self.sched = Scheduler(config, self.clock, initial_cost_s=0.01)
        self.runner = Runner(self.engine, FakeRequestError)
        self.loop = EngineLoop(self.sched, self.runner, clock=self.clock,
                               sleep=self.clock.advance, express=express)  # fmt: skip
        self.pipelined = pipelined
        self.events: dict[int, list] = {}

    def submit(self, frames=30, schedule=(1, 2, 4, 8)):
        events = []
        stream = self.sched.submit(FakeRequest(frames), events.append, schedule)
        self.events[stream.id] = events
        return stream

    def step(self) -> bool:
        if self.pipelined:
            return self.loop.step()
        plan = self.sched.plan()
        if plan.is_empty:
            return False
        for sink, event in self.sched.commit(plan, self.runner.execute(plan, self.clock)):
            sink(event)
        return True

    def run_until(self, predicate, max_steps=100_000):
        for _ in range(max_steps):
            if predicate():
                return
            if not self.step():
                self.clock.advance(0.001)
        raise AssertionError("condition never met")

    def chunks(self, stream):
        return [e for e in self.events[stream.id] if isinstance(e, Chunk)]


def check_stream_events(h, stream, frames, schedule=(1, 2, 4, 8)):
    """Chunks in order, of the schedule's sizes, all the frames' audio, then Done."""
    events = h.events[stream.id]
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    sizes = [len(c.pcm) // FRAME_SAMPLES for c in chunks]
    expected, left, k = [], frames, 0
    while left:
        expected.append(min(left, schedule[min(k, len(schedule) - 1)]))
        left -= expected[-1]
        k += 1
    assert sizes == expected
    assert isinstance(events[-1], Done) and events[-1].stats["frames"] == frames
    assert sum(isinstance(e, Done) for e in events) == 1


def test_next_frame_step_is_launched_before_the_last_is_read():
    h = Harness()
    streams = [h.submit(frames=40 + 5 * i) for i in range(3)]
    h.run_until(lambda: all(s.status is Status.FINISHED for s in streams))
    frame_reads = [i for i, e in enumerate(h.engine.log) if e[:2] == ("read", "frames")]
    launched_ahead = 0
    for i in frame_reads:
        ticket = h.engine.log[i][2]
        later = [e for e in h.engine.log[:i] if e[:2] == ("launch", "frames") and e[2] > ticket]
        launched_ahead += bool(later)
    # Every frame step but those at the very end had its successor on the device first.
    assert launched_ahead >= len(frame_reads) - 3
    for i, s in enumerate(streams):
        check_stream_events(h, s, 40 + 5 * i)


def test_codec_steps_run_beside_frame_steps_without_holding_them():
    """Four streams of 60 frames: on a device with its own codec lane the pipelined loop is
    paced by frame steps alone (the codec is hidden); serially each codec step adds up."""
    def total_time(pipelined, codec_lane):
        h = Harness(pipelined=pipelined, codec_lane=codec_lane)
        streams = [h.submit(frames=60) for _ in range(4)]
        h.run_until(lambda: all(s.status is Status.FINISHED for s in streams))
        for s in streams:
            check_stream_events(h, s, 60)
        return h.clock.t

    serial = total_time(pipelined=False, codec_lane=False)
    pipelined = total_time(pipelined=True, codec_lane=True)
    frame_steps_only = COST["prefill"] + 60 * COST["frames"]
    assert pipelined <= frame_steps_only + 2 * COST["frames"] + 2 * COST["audio"]
    assert serial >= frame_steps_only + 8 * COST["audio"]  # one codec step per chunk at least


def _first_audio_waits(h, seed=7, seconds=6.0, min_done=40, min_gap=None):
    """Arrivals at random moments beside running streams, at least `min_gap` apart (default
    one first chunk's own path: the admission lane runs one arrival's work at a time): each
    first chunk's wait beyond its own prefill, frame and codec steps."""
    rng = random.Random(seed)
    own_path = COST["prefill"] + COST["frames"] + COST["audio"]
    min_gap = own_path if min_gap is None else min_gap
    arrivals, next_at = [], 0.0
    while h.clock.t < seconds:
        if h.clock.t >= next_at and len(h.sched.by_slot) < 12:
            arrivals.append(h.submit(frames=rng.randint(10, 60)))
            next_at = h.clock.t + rng.uniform(min_gap, 0.2)
        if not h.step():
            h.clock.advance(0.003)
    done = [s for s in arrivals if s.first_audio_at is not None]
    assert len(done) >= min_done
    for s in done:  # every stream's audio whole and in order, express turns or not
        if s.status is Status.FINISHED:
            check_stream_events(h, s, s.request.frames)
    return sorted(s.first_audio_at - s.arrived_at - own_path for s in done)


def test_first_audio_waits_behind_at_most_one_frame_step():
    """Arrivals at random moments while other streams run: a first chunk comes after its own
    prefill, frame and codec steps, behind at most the one frame step in flight when it came
    (the pipelined loop polls codec steps every 0.2 ms of fake time)."""
    h = Harness(num_slots=16)
    waits = _first_audio_waits(h, min_gap=0.0)
    assert waits[-1] <= COST["frames"] + h.loop.poll_s + 1e-9
    assert waits[0] >= -1e-9


def test_express_admission_runs_a_first_chunk_beside_the_steps_in_flight():
    """With an admission lane, an arrival is admitted while the loop waits for a frame step,
    and its first codec step is launched right behind its first frame: its first chunk
    waits for no step of other streams (only the loop's poll); without express admission
    the same arrivals wait behind the frame step in flight, and a turn for the codec step."""
    express = _first_audio_waits(Harness(num_slots=16, express=True, admission_lane=True))
    assert express[0] >= -1e-9
    poll = 0.0002
    assert express[-1] <= 2 * poll + 1e-9, express[-5:]
    plain = _first_audio_waits(Harness(num_slots=16, admission_lane=True))
    # one arrival in ten or more waits behind a prefill's or codec step's worth of loop turn
    assert plain[int(0.9 * (len(plain) - 1))] > express[-1] + 0.75 * COST["prefill"]


def test_first_audio_phases_add_up_to_the_time_to_first_audio():
    """The metrics' phases of a first chunk (admit, frame, codec, read) partition its time."""
    seen = []

    class Recorder(NullObserver):
        def on_first_audio(self, ttfa_s, phases=None):
            seen.append((ttfa_s, phases))

    h = Harness(num_slots=16, express=True, admission_lane=True)
    h.sched.observer = Recorder()
    waits = _first_audio_waits(h, seconds=2.0, min_done=10)
    assert len(seen) == len(waits)
    for ttfa, phases in seen:
        assert set(phases) == {"admit", "frame", "codec", "read"}
        assert min(phases.values()) >= 0 and sum(phases.values()) == pytest.approx(ttfa)
        assert phases["read"] >= COST["audio"] - 1e-9  # the codec step runs in that phase


def test_second_chunk_phases_add_up_to_the_gap_after_the_first():
    """The metrics' phases of a second chunk (frames, codec, read) partition the time from the
    first chunk's hand-over to the second's, where every underrun under load on the H200 was."""
    seen, chunk_at = [], {}

    class Recorder(NullObserver):
        def on_second_chunk(self, gap_s, phases):
            seen.append((gap_s, phases))

    h = Harness(num_slots=16, express=True, admission_lane=True)
    h.sched.observer = Recorder()
    streams = []
    for _ in range(6):
        timed = []
        streams.append(h.sched.submit(FakeRequest(20), lambda e, t=timed: t.append(
            (h.clock(), e)), (1, 2, 4, 8)))  # fmt: skip
        h.events[streams[-1].id] = timed
        h.run_until(lambda t=timed: len(t) >= 2)  # admitted, and its first chunk maybe
    h.run_until(lambda: all(s.status is Status.FINISHED for s in streams))
    for s in streams:
        times = [t for t, e in h.events[s.id] if isinstance(e, Chunk)]
        chunk_at[s.id] = times[1] - times[0]
    assert len(seen) == len(streams)
    assert sorted(g for g, _ in seen) == pytest.approx(sorted(chunk_at.values()))
    for gap, phases in seen:
        assert set(phases) == {"frames", "codec", "read"}
        assert min(phases.values()) >= 0 and sum(phases.values()) == pytest.approx(gap)
        # its two frames take at least one frame step past the first chunk, its audio a codec
        # step after they are made (the fake launches it when they are read back)
        assert phases["frames"] >= COST["frames"] - 1e-9
        assert phases["read"] == pytest.approx(COST["audio"])


def test_a_slot_taken_over_while_its_steps_are_in_flight_gets_none_of_their_results():
    h = Harness(num_slots=1)
    old = h.submit(frames=200)
    h.run_until(lambda: len(h.chunks(old)) >= 2)
    assert h.loop.in_flight  # a frame step (and maybe a codec step) of `old` on the device
    h.sched.close(old.id)
    new = h.submit(frames=12)
    h.run_until(lambda: new.status is Status.FINISHED)
    assert new.slot == old.slot
    check_stream_events(h, new, 12)
    assert old.status is Status.CANCELLED and not any(
        isinstance(e, Done) for e in h.events[old.id]
    )


@pytest.mark.parametrize("frames_ahead", [1, 2])
def test_at_most_frames_ahead_frame_steps_stay_in_flight(frames_ahead):
    h = Harness()
    h.loop.frames_ahead = frames_ahead
    streams = [h.submit(frames=30) for _ in range(2)]
    most = 0
    while not all(s.status is Status.FINISHED for s in streams):
        if not h.step():
            h.clock.advance(0.001)
        most = max(most, sum(f.stage == "frames" for f in h.loop.in_flight))
    assert most == frames_ahead


def test_capacity_counts_the_time_of_steps_in_flight_together_once():
    """A codec step runs beside each frame step (one-frame chunks, a codec lane): the engine
    was busy for the wall time they covered, not for the sum of their times. Counting each
    step's own time made the measured capacity about half of what the device produced, and
    admission queued requests at 40 req/s on the H200 (frame and codec stage time added up
    to 1.7 times the wall time there)."""
    h = Harness(num_slots=8)
    h.engine.cost_s["audio"] = COST["frames"]
    h.sched.config = dataclasses.replace(h.sched.config, admit_by_capacity=True,
                                         capacity_window_s=10.0)  # fmt: skip
    streams = [h.submit(frames=150, schedule=(1,)) for _ in range(4)]
    h.run_until(lambda: sum(s.frames for s in streams) >= 400)
    now = h.clock.t
    produced = sum(s.frames for s in streams) * FRAME_SAMPLES / 24000  # audio seconds
    audio_steps = [c for c in h.engine.calls if c[0] == "audio"]
    assert len(audio_steps) >= 90  # they did run beside the frame steps
    measured = h.sched.capacity(now) * (1 + h.sched.config.capacity_margin)
    assert measured == pytest.approx(produced / now, rel=0.1)


def codec_calls_of_a_new_stream(lane_chunks: int) -> list[list[int]]:
    """The rows of each codec step that decoded a new stream's first two chunks (one frame
    each), beside four running streams that keep a slow codec lane busy."""
    h = Harness(num_slots=8, express=True, admission_lane=True, max_audio_in_flight=1,
                lane_chunks=lane_chunks)  # fmt: skip
    h.engine.lane_codec_steps = lane_chunks
    h.engine.cost_s["audio"] = 3 * COST["frames"]
    running = [h.submit(frames=2000, schedule=(1,)) for _ in range(4)]
    h.run_until(lambda: all(len(h.chunks(s)) >= 5 for s in running))
    before = len(h.engine.calls)
    new = h.submit(frames=20, schedule=(1, 1, 2, 4, 8))
    h.run_until(lambda: new.status is Status.FINISHED)
    check_stream_events(h, new, 20, schedule=(1, 1, 2, 4, 8))
    steps = [rows for kind, rows in h.engine.calls[before:] if kind == "audio" and new.slot in rows]
    return steps[:2]


def test_the_ramps_second_one_frame_chunk_is_decoded_alone_when_the_lane_takes_it():
    """lane_chunks = 2 (serve --lane-chunks 2): a stream's second chunk, one frame, gets a
    codec step of its own in the loop's first-audio turn, past the codec steps in flight, which
    the engine runs on its admission lane; with 1 it waits for a regular codec step shared with
    the running streams (read back with them). At 40 req/s on the H200 every late chunk was a
    second one."""
    new_slot = 4  # the four running streams hold slots 0-3
    assert codec_calls_of_a_new_stream(2) == [[new_slot], [new_slot]]
    first, second = codec_calls_of_a_new_stream(1)
    assert first == [new_slot] and len(second) > 1


def frame_calls_of_a_new_stream(lane_frames: int) -> list[tuple[str, list[int]]]:
    """The engine calls that carried a new stream's first two frames and first codec step
    (a first chunk of two frames, as a real checkpoint's with its bootstrap frame dropped),
    beside four running streams that are mostly waiting for frames (chunks of eight)."""
    h = Harness(num_slots=8, express=True, admission_lane=True, lane_frames=lane_frames)
    schedule = (2, 1, 2, 4)
    running = [h.submit(frames=400, schedule=(8,)) for _ in range(4)]
    h.run_until(lambda: all(len(h.chunks(s)) >= 3 for s in running))
    before = len(h.engine.calls)
    new = h.submit(frames=20, schedule=schedule)
    h.run_until(lambda: new.status is Status.FINISHED)
    check_stream_events(h, new, 20, schedule=schedule)
    mine = [(kind, rows) for kind, rows in h.engine.calls[before:]
            if new.slot in rows and kind != "prefill"]  # fmt: skip
    return mine[:3]


def test_a_first_chunk_of_two_frames_gets_both_in_express_turns_when_the_lane_makes_them():
    """lane_frames 2 (serve --lane-frames 2): right after a new stream's first frame, an
    express turn gives it its second, alone (the engine's admission lane makes it), then its
    first codec step, alone; with 1 the second frame rides along in the running streams' next
    regular step."""
    new_slot = 4  # the four running streams hold slots 0-3
    first, second, codec = frame_calls_of_a_new_stream(2)
    assert first[0] == "frames" and second == ("frames", [new_slot])
    assert codec == ("audio", [new_slot])
    first, second, _ = frame_calls_of_a_new_stream(1)
    assert second[0] == "frames" and len(second[1]) == 5  # with the four running streams


@pytest.mark.parametrize("limit", [1, 2])
def test_codec_steps_in_flight_stay_bounded_when_the_codec_falls_behind(limit):
    """A codec step three times as long as a frame step: without a bound the loop queued a
    codec step on the codec stream every turn (on the H200 at 40 req/s, more than the eight
    its staging ring held); with one, a stream's next chunk waits for a turn after the oldest
    codec step is read and joins a larger batch. Every stream's audio still comes whole."""
    h = Harness(num_slots=8, max_audio_in_flight=limit)
    h.engine.cost_s["audio"] = 3 * COST["frames"]
    streams = [h.submit(frames=90, schedule=(1, 2)) for _ in range(6)]
    most, batches = 0, []
    while not all(s.status is Status.FINISHED for s in streams):
        if not h.step():
            h.clock.advance(0.001)
        audio = [step for step in h.loop.in_flight if step.stage is Stage.AUDIO]
        most = max(most, len(audio))
        batches += [len(step.result.stage_slots) for step in audio]
    for s in streams:
        check_stream_events(h, s, 90, schedule=(1, 2))
    assert most <= limit + 1  # + a first chunk's codec step, which never waits
    assert max(batches) >= 4  # later chunks gathered into shared codec steps


def test_a_paced_loop_waits_for_the_next_due_frame_step_and_keeps_deadlines():
    """pace_slack_s in the pipelined loop: while no frame step is due the loop launches none
    (codec work still runs) and its idle wait ends when the next one is due; streams stay
    ahead of their playback."""
    h = Harness(pace_slack_s=0.3)
    h.sched.observer = observer = type("Late", (NullObserver,), {
        "lateness": [], "on_chunk": lambda self, s, *_: self.lateness.append(s)})()  # fmt: skip
    streams = [h.submit(frames=150, schedule=(1, 2, 4, 8, 12))]
    h.run_until(lambda: h.clock.t > 0.3)
    streams.append(h.submit(frames=150, schedule=(1, 2, 4, 8, 12)))
    waits = []
    for _ in range(100_000):
        if all(s.status is Status.FINISHED for s in streams):
            break
        if not h.step():
            waits.append(h.loop.idle_s)
            h.clock.advance(min(0.001, h.loop.idle_s))
    assert all(s.status is Status.FINISHED for s in streams)
    assert observer.lateness and max(observer.lateness) <= 0
    # the loop idled between paced steps, each wait ending at the next due step (< 20 ms)
    assert waits and min(waits) < h.loop.idle_wait_s
    frame_steps = [c for c in h.engine.calls if c[0] == "frames"]
    assert len(frame_steps) < 2 * 150 * 0.8  # rows shared steps: fewer steps than frames


def test_exact_chunks_cap_each_codec_step_at_the_streams_chunk():
    """SchedulerConfig.exact_chunks (serve --exact-chunks): each codec step asks the engine for
    the stream's next chunk exactly; the last chunk (generation ended) takes what is left."""
    h = Harness(exact_chunks=True)
    caps = []
    launch = h.engine.launch_audio

    def recording(slots, max_frames=None):
        caps.append(max_frames)
        return launch(slots, max_frames)

    h.engine.launch_audio = recording
    stream = h.submit(frames=20, schedule=(1, 2, 4))
    h.run_until(lambda: stream.status is Status.FINISHED)
    check_stream_events(h, stream, 20, schedule=(1, 2, 4))
    assert caps[:5] == [[1], [2], [4], [4], [4]] and caps[-1] in ([None], None)


def test_wait_idle_waits_for_the_engine_to_release_the_slots():
    """A turn takes the slots to release from the scheduler under the lock and releases them
    on the engine after it: wait_idle (what tests and shutdown wait on) returns only once the
    engine has them back, however slow the release (here 0.3 s, on a real-time loop)."""
    import threading
    import time

    from ttsbuild.serve.loop import EngineLoop as Loop

    class SlowRelease(FakeEngine):
        def release(self, slot):
            time.sleep(0.3)
            super().release(slot)

    clock = FakeClock()
    engine = SlowRelease(clock, num_slots=2)  # instant steps: the loop runs in real time
    sched = Scheduler(SchedulerConfig(num_slots=2, admit_by_capacity=False), clock,
                      initial_cost_s=0.01)  # fmt: skip
    loop = Loop(sched, Runner(engine, FakeRequestError), idle_wait_s=0.01)
    done = threading.Event()
    with loop.lock:
        sched.submit(FakeRequest(3), lambda e: done.set() if isinstance(e, Done) else None,
                     (1, 2))  # fmt: skip
    loop.start()
    try:
        assert done.wait(10)  # finished: its slot goes back to the engine in the next turn
        assert loop.wait_idle(10)
        assert engine.free_slots() == 2
    finally:
        loop.stop()


def test_the_admission_lane_goes_off_under_load_and_back_on_when_it_eases():
    """lane_max_active: new streams take the admission lane (and express admission) only while
    fewer streams than the limit hold slots; from the limit on the lane is off (new rows' first
    frame and codec step run in the regular steps), until fewer than 3/4 of the limit hold
    slots. Every stream's audio stays whole and in order across the switches."""
    h = Harness(num_slots=16, express=True, admission_lane=True, lane_max_active=4)
    switches = []

    def switch(on: bool) -> None:
        switches.append((on, len(h.sched.by_slot)))
        h.engine.admission_lane = on

    h.loop.lane_switch = switch
    lane_at_first_frame = {}  # stream id -> the lane's state when its first frame launched

    def run_until_framed(streams):
        while not all(s.first_frame_at is not None for s in streams):
            if not h.step():
                h.clock.advance(0.001)
            lane = h.engine.admission_lane  # as switched at the start of that turn
            for s in streams:
                if s.first_frame_at is not None:
                    lane_at_first_frame.setdefault(s.id, lane)

    first = [h.submit(frames=60) for _ in range(4)]  # one turn admits all four: lane on
    run_until_framed(first)
    assert all(lane_at_first_frame[s.id] for s in first)
    more = [h.submit(frames=20) for _ in range(4)]  # 4 streams hold slots: lane off
    run_until_framed(more)
    assert switches[0] == (False, 4)
    assert not any(lane_at_first_frame[s.id] for s in more)
    assert not h.loop.express
    h.run_until(lambda: all(s.status is Status.FINISHED for s in first + more))
    for s in first + more:
        check_stream_events(h, s, s.request.frames)
    late = h.submit(frames=8)  # fewer than 3 in slots: the lane again, express admission too
    h.run_until(lambda: late.status is Status.FINISHED)
    check_stream_events(h, late, 8)
    assert len(switches) == 2 and switches[1][0] is True and switches[1][1] < 3
    assert h.engine.admission_lane and h.loop.express


def test_lane_wanted_switches_with_hysteresis():
    """Off at the limit, on again only below three quarters of it; 0: always on."""
    sched = Scheduler(SchedulerConfig(num_slots=16, lane_max_active=8), FakeClock())
    seen = []
    for n in [0, 7, 8, 7, 6, 5, 8, 3, 0]:
        sched.by_slot = dict.fromkeys(range(n))
        seen.append(sched.lane_wanted())
    assert seen == [True, True, False, False, False, True, False, True, True]
    sched = Scheduler(SchedulerConfig(num_slots=16, lane_max_active=0), FakeClock())
    sched.by_slot = dict.fromkeys(range(16))
    assert sched.lane_wanted()


def test_a_submit_ends_the_loops_poll_at_once():
    """In real time, with a frame step of another stream in flight for over a second and a
    poll of 1 s: a new request is admitted (express, beside the step) within a fraction of
    the poll, since submit wakes the poll's wait. A sleeping poll noticed it only at the
    poll's end."""
    clock = RealClock()
    engine = FakeEngine(clock, num_slots=4, cost_s={"prefill": 0.01, "frames": 1.5,
                                                     "audio": 0.01},
                        codec_lane=True, async_prefill=True, instant=False,
                        admission_lane=True)  # fmt: skip
    config = SchedulerConfig(num_slots=4, admit_by_capacity=False, max_buffered_s=1e6,
                             stream_buffer_s=1e6)  # fmt: skip
    sched = Scheduler(config, clock, initial_cost_s=0.01)
    loop = EngineLoop(sched, Runner(engine, FakeRequestError), clock=clock, poll_s=1.0,
                      express=True, frames_ahead=0)  # fmt: skip
    loop.start()
    try:
        loop.submit(FakeRequest(frames=3), lambda e: None, [1, 2])
        deadline = time.perf_counter() + 5
        while not any(stage == "frames" for stage, _ in engine.calls):  # its step runs
            assert time.perf_counter() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # the loop is in its poll now (the step takes 1.5 s)
        admitted = []
        submitted = time.perf_counter()
        loop.submit(FakeRequest(frames=1), lambda e: admitted.append(time.perf_counter()), [1])
        while not admitted:
            assert time.perf_counter() < submitted + 5
            time.sleep(0.002)
        assert admitted[0] - submitted < 0.3, admitted[0] - submitted
    finally:
        loop.stop()
