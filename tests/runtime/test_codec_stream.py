"""The codec on its own stream, on CPU: the driver's lanes, the events a step is ordered
after (exactly where data flows through the code ring), and the two-lane engine giving the
same codes and audio as the one-lane engine."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import Models
from ttsbuild.runtime.graph_engine import GraphEngine, _RingOrder
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest

PLAN = EnginePlan(num_slots=4, max_len=256, max_text=64, batch_buckets=(1, 2, 4),
                  prefill_buckets=(32, 64), codec_chunks=(1, 2, 4), codec_ring=4)  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


# -- the driver's lanes --------------------------------------------------------------------


def test_driver_lanes_run_steps_and_check_their_arguments():
    from ttsbuild import _driver

    drv = _driver.StepDriver(False)
    assert drv.lanes == 1
    lm, codec = drv.add_lane(True, True), drv.add_lane(False, False)
    assert (lm, codec, drv.lanes) == (1, 2, 3)
    assert drv.lane_stream(codec) == 0  # no CUDA: no stream
    x, out = torch.randn(4), torch.zeros(4)
    first = drv.launch(lambda: x.mul_(2.0), [], [], [x], [out], lane=lm)
    second = drv.launch(lambda: x.add_(1.0), [], [], [x], [out], lane=codec, after=[first])
    drv.wait(second)
    torch.testing.assert_close(out, x)
    drv.device_wait([first, second])  # nothing to wait for on CPU, but the tickets are checked
    with pytest.raises(RuntimeError, match="unknown lane"):
        drv.launch(lambda: None, [], [], [], [], lane=3)
    with pytest.raises(RuntimeError, match="unknown ticket"):
        drv.launch(lambda: None, [], [], [], [], lane=codec, after=[second + 5])
    with pytest.raises(RuntimeError, match="unknown ticket"):
        drv.device_wait([-1])
    with pytest.raises(RuntimeError, match="needs CUDA"):
        drv.step_times(first)


# -- which steps a step follows -------------------------------------------------------------


def latest_per_lane(tickets: list[int], lane_of: dict[int, int]) -> list[int]:
    latest: dict[int, int] = {}
    for t in tickets:
        latest[lane_of[t]] = max(t, latest.get(lane_of[t], t))
    return sorted(latest.values())


@pytest.mark.parametrize("lanes", [1, 2])
def test_ring_order_names_the_steps_that_wrote_and_read_each_entry(lanes):
    """A random schedule of frame and codec steps over slots that come and go, each kind on
    one lane or on two (the admission lane), against a brute-force record of which step
    wrote and read every frame: a step follows the latest such step of each lane."""
    rng = random.Random(3 + lanes)
    slots, ring = 4, 5
    order = _RingOrder(slots, ring)
    wrote: dict[int, list[int]] = {s: [] for s in range(slots)}  # frame index -> ticket
    read: dict[int, list[int]] = {s: [] for s in range(slots)}
    last_read: dict[int, int | None] = dict.fromkeys(range(slots))
    last_written: dict[int, int | None] = dict.fromkeys(range(slots))
    lane_of: dict[int, int] = {}
    ticket = 0
    for _ in range(3000):
        s_list = rng.sample(range(slots), rng.randint(1, slots))
        kind = rng.random()
        if kind < 0.03:  # a new occupant for one slot
            s = s_list[0]
            # the previous occupant's last codec step and last frame step
            last = [t for t in (last_read[s], last_written[s]) if t is not None]
            assert order.admit(s) == sorted(last)
            wrote[s], read[s], last_read[s], last_written[s] = [], [], None, None
        elif kind < 0.55:  # a frame step (the core allows at most `ring` frames undecoded)
            s_list = [s for s in s_list if len(wrote[s]) - len(read[s]) < ring]
            if not s_list:
                continue
            overwritten = [read[s][len(wrote[s]) - ring] for s in s_list if len(wrote[s]) >= ring]
            assert order.before_frames(s_list) == latest_per_lane(overwritten, lane_of)
            lane_of[ticket] = rng.choice([1, 3][:lanes])
            order.frames_launched(s_list, ticket, lane_of[ticket])
            for s in s_list:
                wrote[s].append(ticket)
                last_written[s] = ticket
            ticket += 1
        else:  # a codec step of n frames for slots with n frames written and not decoded
            n = rng.choice([1, 2, 4])
            s_list = [s for s in s_list if len(wrote[s]) - len(read[s]) >= n]
            if not s_list:
                continue
            last_frames = [wrote[s][len(read[s]) + n - 1] for s in s_list]
            assert order.before_codec(s_list, n) == latest_per_lane(last_frames, lane_of)
            lane_of[ticket] = rng.choice([2, 3][:lanes])
            order.codec_launched(s_list, n, ticket, lane_of[ticket])
            for s in s_list:
                read[s] += [ticket] * n
                last_read[s] = ticket
            ticket += 1
    assert len(set(lane_of.values())) == lanes + 1  # lane 3 (two lanes) takes both kinds


# -- the engine on two lanes ------------------------------------------------------------------


class RecordingDriver:
    """The step driver, with every launch (ticket, lane, after, staged slot ids) and every
    device wait kept, in order."""

    def __init__(self, driver):
        self.driver = driver
        self.launches: list[tuple[int, int, list[int], list[int]]] = []
        self.kinds: dict[int, str] = {}  # ticket -> "frame" or "codec" (by its output width)
        self.log: list[tuple] = []

    def launch(self, step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane=0, after=()):
        ticket = self.driver.launch(step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane, list(after))
        self.launches.append((ticket, lane, list(after), h2d_src[0].tolist()))
        self.kinds[ticket] = "codec" if d2h_dst[0].shape[-1] % 1920 == 0 else "frame"
        self.log.append(("launch", self.launches[-1]))
        return ticket

    def device_wait(self, tickets):
        self.log.append(("wait", list(tickets)))
        self.driver.device_wait(tickets)

    def __getattr__(self, name):
        return getattr(self.driver, name)


def requests(seed: int) -> list[SynthesisRequest]:
    texts = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue.",
             "It's easy to tell the depth of a well."]  # fmt: skip
    return [SynthesisRequest(text=t, voice="ryan", seed=seed + i, max_frames=11 + i)
            for i, t in enumerate(texts)]  # fmt: skip


def one_step(engine, slots, pending, codes, pcm, audio_frames=2, audio_min=1):
    """Launch a frame step for the slots that can take one, read the step before it (codes),
    decode up to `audio_frames` frames per slot with at least `audio_min` pending (PCM);
    returns the new step (None: nothing launched)."""
    active = [s for s in slots if engine.table[s].can_launch]
    ticket = engine.launch_frames(active) if active else None
    if pending is not None:
        for out in engine.collect(pending):
            if out.codes is not None:
                codes[out.slot].append(out.codes)
    due = [s for s in slots if engine.pending_frames(s) >= audio_min]
    launched = engine.launch_audio(due, max_frames=audio_frames)
    for s, p in engine.collect_audio(launched).items():
        pcm[s].append(p)
    return ticket


def run(engine, reqs):
    """Frames launched one step ahead of reading, the codec two frames behind, so the ring
    (4 entries) wraps; then a slot is released and taken by a new request."""
    slots = [engine.admit(r) for r in reqs]
    engine.prefill(slots)
    codes = {s: [] for s in slots}
    pcm = {s: [] for s in slots}
    pending = None
    while (pending := one_step(engine, slots, pending, codes, pcm)) is not None:
        pass
    for s, p in engine.audio(slots).items():
        pcm[s].append(p)
    out = [(torch.stack(codes[s]), np.concatenate(pcm[s])) for s in slots]
    engine.release(slots[1])
    again = engine.admit(SynthesisRequest(text="A new one.", voice="eric", seed=9, max_frames=3))
    engine.prefill([again])
    engine.frames([again])
    out.append((torch.zeros(0), engine.audio([again])[again]))
    return out, slots


def test_two_lanes_give_the_one_lane_engine_codes_and_audio_in_data_order(models):
    one = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    two = GraphEngine(models, PLAN, use_graphs=False, codec_stream=True)
    assert (one.backend.lm_lane, one.backend.codec_lane) == (0, 0)
    assert two.backend.lm_lane != two.backend.codec_lane
    two.backend.driver = rec = RecordingDriver(two.backend.driver)
    expected, _ = run(one, requests(20))
    got, slots = run(two, requests(20))
    for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
        assert torch.equal(c1, c2)
        np.testing.assert_array_equal(p1, p2)
    assert all(len(p) > 0 for _, p in got)

    lanes = {t: lane for t, lane, _, _ in rec.launches}
    frame_lane, codec_lane = two.backend.lm_lane, two.backend.codec_lane
    assert set(lanes.values()) == {frame_lane, codec_lane}
    # Every codec step follows a frame step, and frame steps that wrapped the ring follow a
    # codec step; each names one step of the other lane, launched before it.
    codec_after = [(t, a) for t, lane, a, _ in rec.launches if lane == codec_lane]
    frame_after = [(t, a) for t, lane, a, _ in rec.launches if lane == frame_lane and a]
    assert codec_after and all(len(a) == 1 and lanes[a[0]] == frame_lane and a[0] < t
                               for t, a in codec_after)  # fmt: skip
    assert frame_after and all(len(a) == 1 and lanes[a[0]] == codec_lane and a[0] < t
                               for t, a in frame_after)  # fmt: skip
    # The slot's next occupant was prefilled after its previous occupant's last codec step
    # and last frame step.
    waits = [i for i, (kind, what) in enumerate(rec.log) if kind == "wait" and what]
    assert len(waits) == 1  # only the slot that had an occupant before
    before = [what for kind, what in rec.log[: waits[0]] if kind == "launch"]
    last = [max(t for t, lane, _, rows in before if lane == which and slots[1] in rows)
            for which in (frame_lane, codec_lane)]  # fmt: skip
    assert rec.log[waits[0]][1] == sorted(last)


# -- the admission lane -----------------------------------------------------------------------


def assert_same_audio(want: np.ndarray, got: np.ndarray) -> None:
    """The same PCM up to fp32 rounding: a first codec step on the admission lane decodes its
    rows in a batch of their own, and a CPU GEMM's rounding depends on its row count."""
    assert want.shape == got.shape and np.abs(want).max() > 0.01
    assert np.abs(want - got).max() <= 1e-5 * np.abs(want).max()


def run_joining(engine, reqs, late, audio_frames=2, audio_min=1, join_at=2):
    """Two requests from the start, a third joining after `join_at` steps (its first frame
    beside their next), frames read one step late, audio up to `audio_frames` frames a step
    of rows with at least `audio_min` pending (2: a first chunk of two frames, as a real
    CustomVoice checkpoint's, the bootstrap frame dropped); codes and PCM per request."""
    slots = [engine.admit(r) for r in reqs]
    engine.prefill(slots)
    codes = {s: [] for s in slots}
    pcm = {s: [] for s in slots}
    pending, step = None, 0
    while True:
        if step == join_at:
            slots.append(engine.admit(late))
            engine.prefill(slots[-1:])
            codes[slots[-1]], pcm[slots[-1]] = [], []
        ticket = one_step(engine, slots, pending, codes, pcm, audio_frames, audio_min)
        if ticket is None:
            break
        pending, step = ticket, step + 1
    for s, p in engine.audio(slots).items():
        pcm[s].append(p)
    return [(torch.stack(codes[s]), np.concatenate(pcm[s])) for s in slots]


@pytest.mark.parametrize("buckets", [(1, 2), (1,)])
def test_the_admission_lane_gives_the_same_codes_and_audio(models, buckets):
    """New rows' first frames on the admission lane (its own rows, outputs and code-predictor
    cache), the others on the regular lane: the codes and PCM of the one-lane engine. With
    one lane bucket, two new rows at once do not fit and join the regular step."""
    one = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    plan = PLAN.model_copy(update={"admission_lane": buckets})
    three = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
    lane = three.backend.admit_lane
    assert lane not in (0, three.backend.lm_lane, three.backend.codec_lane)
    three.backend.driver = rec = RecordingDriver(three.backend.driver)
    reqs, late = requests(40)[:2], SynthesisRequest(text="Late again.", voice="eric", seed=7)
    expected = run_joining(one, reqs, late)
    got = run_joining(three, reqs, late)
    for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
        assert c1.shape[0] > 3 and torch.equal(c1, c2)
        assert_same_audio(p1, p2)

    on_lane = [(t, rec.kinds[t], rows) for t, ln, _, rows in rec.launches if ln == lane]
    regular = [(t, a, rows) for t, ln, a, rows in rec.launches if ln == three.backend.lm_lane]
    codecs = [(t, a, rows) for t, ln, a, rows in rec.launches if ln == three.backend.codec_lane]
    firsts = [rows for _, kind, rows in on_lane if kind == "frame"]
    # the two first requests took the lane together only where a bucket holds them; the
    # late one always did, its first frame beside the others' third step; each such row's
    # first one-frame codec step ran there too, right after its frame
    assert firsts == ([[0, 1], [2]] if 2 in buckets else [[2]])
    assert [k for _, k, _ in on_lane] == ["frame", "codec"] * len(firsts)
    assert [rows for _, k, rows in on_lane if k == "codec"] == firsts
    assert not any(2 in rows for _, _, rows in regular[:2])
    # each row's next regular frame step follows its first frame on the lane, and its next
    # regular codec step its first codec step there
    for t, kind, rows in on_lane:
        later = regular if kind == "frame" else codecs
        nxt = next((a for u, a, r in later if u > t and set(rows) & set(r)), None)
        assert nxt is not None and t in nxt


def test_the_lane_takes_a_rows_first_one_frame_codec_steps_and_the_regular_lane_follows(models):
    """lane_codec_steps = 2 (serve --lane-chunks 2): a row whose first frame ran on the lane
    also has its second one-frame codec step there (the ramp's second chunk, made from a frame
    of the regular lane), then its codec steps go to the regular codec lane, each ordered after
    the one before it: the codes and PCM of the one-lane engine."""
    one = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    plan = PLAN.model_copy(update={"admission_lane": (1, 2)})
    three = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
    three.backend.lane_codec_steps = 2
    three.backend.driver = rec = RecordingDriver(three.backend.driver)
    reqs, late = requests(60)[:2], SynthesisRequest(text="Late again.", voice="eric", seed=3)
    expected = run_joining(one, reqs, late, audio_frames=1)
    got = run_joining(three, reqs, late, audio_frames=1)
    for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
        assert c1.shape[0] > 3 and torch.equal(c1, c2)
        assert_same_audio(p1, p2)

    lane, lm = three.backend.admit_lane, three.backend.lm_lane
    codec_lane = three.backend.codec_lane
    launches = [(t, ln, a, rows, rec.kinds[t]) for t, ln, a, rows in rec.launches]
    for row in (0, 1, 2):  # the first two, together, then the late one
        mine = [(t, ln, a, k) for t, ln, a, rows, k in launches if row in rows]
        codecs = [(t, ln, a) for t, ln, a, k in mine if k == "codec"]
        assert [ln for _, ln, _ in codecs[:2]] == [lane, lane]
        assert codecs[2:] and all(ln == codec_lane for _, ln, _ in codecs[2:])
        # the second lane step waits for the regular frame step that made its frame; the
        # first regular codec step waits for the second lane step (the codec state)
        assert any(lanes == lm for lanes in
                   [next(ln for t, ln, _, _ in mine if t == u) for u in codecs[1][2]])
        assert codecs[1][0] in codecs[2][2]


def test_two_lane_frames_give_a_first_chunk_of_two_frames_there_and_the_same_audio(models):
    """plan.lane_frames 2: a new row's first two frames (the second with the talker) and its
    first two-frame codec step run on the admission lane; its next regular frame step follows
    the second lane frame, its next regular codec step the lane's codec step: the codes and PCM
    of the one-lane engine."""
    one = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    plan = PLAN.model_copy(update={"admission_lane": (1, 2), "lane_frames": 2})
    three = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
    three.backend.driver = rec = RecordingDriver(three.backend.driver)
    reqs, late = requests(70)[:2], SynthesisRequest(text="Late again.", voice="eric", seed=5)
    expected = run_joining(one, reqs, late, audio_frames=2, audio_min=2)
    got = run_joining(three, reqs, late, audio_frames=2, audio_min=2)
    for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
        assert c1.shape[0] > 3 and torch.equal(c1, c2)
        assert_same_audio(p1, p2)

    lane, lm, codec = three.backend.admit_lane, three.backend.lm_lane, three.backend.codec_lane
    for row in (0, 1, 2):  # the first two, together, then the late one
        mine = [(t, ln, a, rec.kinds[t]) for t, ln, a, rows in rec.launches if row in rows]
        frames = [(t, ln, a) for t, ln, a, k in mine if k == "frame"]
        codecs = [(t, ln, a) for t, ln, a, k in mine if k == "codec"]
        assert [ln for _, ln, _ in frames[:3]] == [lane, lane, lm]
        assert frames[1][0] in frames[2][2]  # the regular step follows the second lane frame
        assert codecs[0][1] == lane and all(ln == codec for _, ln, _ in codecs[1:])
        assert codecs[1:] and codecs[0][0] in codecs[1][2]


def test_the_admission_lane_switched_off_runs_in_order_with_the_same_codes(models):
    """lane_on = False between steps: new rows prefill and take their first frame in order
    with the regular steps (no step on the lane), and switching it back on mid-run (the late
    request takes the lane again) changes no code and no sample."""
    one = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    reqs, late = requests(50)[:2], SynthesisRequest(text="Late again.", voice="eric", seed=8)
    expected = run_joining(one, reqs, late)
    plan = PLAN.model_copy(update={"admission_lane": (1, 2)})
    for switch_back in (False, True):
        three = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
        three.backend.driver = rec = RecordingDriver(three.backend.driver)
        three.backend.lane_on = False
        if switch_back:  # on again once the first two were prefilled in order
            admit = three.admit

            def admit_then_switch(req, admit=admit, backend=three.backend):
                slot = admit(req)
                backend.lane_on = req is late
                return slot

            three.admit = admit_then_switch
        got = run_joining(three, reqs, late)
        for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
            assert c1.shape[0] > 3 and torch.equal(c1, c2)
            assert_same_audio(p1, p2)
        on_lane = [(rec.kinds[t], rows) for t, ln, _, rows in rec.launches
                   if ln == three.backend.admit_lane]  # fmt: skip
        assert on_lane == ([("frame", [2]), ("codec", [2])] if switch_back else [])


@pytest.mark.parametrize(("buckets", "first_frames"), [((), 1), ((1, 2), 1), ((), 2), ((1, 2), 2)])
def test_first_chunk_under_load_measures_a_first_chunk_beside_stepping_rows(
    models, buckets, first_frames
):
    """The engine benchmark's under-load measurement on CPU: a new request's first chunk (one
    frame, or two as a real checkpoint's, the lane then making both: plan.lane_frames) while
    other rows step, with and without the admission lane; every slot is free after."""
    from ttsbuild.bench.engine_bench import first_chunk_under_load

    update = {"admission_lane": buckets, "lane_frames": first_frames if buckets else 1}
    engine = GraphEngine(models, PLAN.model_copy(update=update), use_graphs=False,
                         codec_stream=True)  # fmt: skip
    engine.backend.driver = rec = RecordingDriver(engine.backend.driver)
    load_req = SynthesisRequest(text="A long sentence that keeps the load busy for a while.",
                                voice="ryan", seed=3, max_frames=40)  # fmt: skip
    new_req = SynthesisRequest(text="Hello there.", voice="eric", seed=0)
    walls = first_chunk_under_load(engine, load_req, new_req, load=2, n=3, steps_between=2,
                                   first_frames=first_frames)  # fmt: skip
    assert len(walls) == 3 and all(w > 0 for w in walls)
    assert engine.free_slots() == PLAN.num_slots
    if buckets:  # each new request's first frames ran on the lane
        assert not engine.backend.fresh and engine.backend.lane_frames == {}
        new_slot = 2  # the load holds slots 0 and 1; each new request takes the next
        lane = [rec.kinds[t] for t, ln, _, rows in rec.launches
                if ln == engine.backend.admit_lane and rows == [new_slot]]  # fmt: skip
        assert lane.count("frame") == 3 * first_frames and lane.count("codec") == 3


def test_sms_reserved_for_the_lane_are_a_cuda_matter(models):
    """lane_reserved_sms moves the regular steps into green contexts on CUDA only: on the CPU
    the engine runs as without it, and asking for a reserve without a lane is refused."""
    from ttsbuild.runtime.loader import open_engine

    plan = PLAN.model_copy(update={"admission_lane": (1, 2), "lane_reserved_sms": 16})
    engine = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
    backend = engine.backend
    assert backend._green == [] and backend.admit_lane not in (0, backend.codec_lane)
    with pytest.raises(ValueError, match="needs an admission lane"):
        open_engine(None, "cpu", num_slots=2, max_len=256, random_variant="tiny",
                    admission_lane=(), lane_reserved_sms=8)  # fmt: skip
    eager = open_engine(None, "cpu", num_slots=2, max_len=256, random_variant="tiny",
                        admission_lane=(1,), lane_reserved_sms=8)  # fmt: skip
    assert eager.plan.lane_reserved_sms == 8


def test_a_reserve_the_gpu_cannot_give_is_skipped_not_fatal(models, monkeypatch):
    """The plans' default reserve (16 SMs) on a GPU too small for it, or a torch or CUDA
    driver without green contexts: the engine runs without the reserve (the caller logs it)
    instead of failing to load."""
    from types import SimpleNamespace

    from ttsbuild.runtime import graph_engine

    backend = GraphEngine(models, PLAN, use_graphs=False).backend
    small = SimpleNamespace(multi_processor_count=20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: small)
    with pytest.raises(graph_engine.GreenContextsUnavailable, match="at most 10 can be kept"):
        backend._green_streams(torch.device("cuda:0"), 16)
    monkeypatch.setitem(sys.modules, "torch.cuda.green_contexts", None)  # an older torch
    with pytest.raises(graph_engine.GreenContextsUnavailable, match="no CUDA green contexts"):
        backend._green_streams(torch.device("cuda:0"), 4)


def rows_of_3_and_2_frames(models):
    """An engine with two rows holding 3 and 2 frames not yet decoded."""
    engine = GraphEngine(models, PLAN, use_graphs=False, codec_stream=False)
    reqs = [SynthesisRequest(text=t, voice="ryan", seed=i, max_frames=40) for i, t in
            enumerate(["The birch canoe slid on the smooth planks.", "Glue the sheet."])]
    a, b = (engine.admit(r) for r in reqs)
    engine.prefill([a, b])
    engine.frames([a, b])
    engine.audio([b])  # b's first frame decoded on its own
    for _ in range(2):
        engine.frames([a, b])
    assert (engine.pending_frames(a), engine.pending_frames(b)) == (3, 2)
    return engine, a, b


def test_a_codec_step_launches_once_per_chunk_size_its_rows_decode(models):
    """launch_audio splits each row's frames into the plan's codec chunk sizes (1, 2, 4 here)
    and launches each size once for the rows that need it: rows of 3 and 2 frames make 2 + 1
    and 2, two launches (what serve's tts_codec_launches_per_step counts)."""
    engine, a, b = rows_of_3_and_2_frames(models)
    ticket = engine.launch_audio([a, b])
    assert sorted(group for group, _ in ticket.launched) == [[a], [a, b]]  # 2 for both, 1 for a
    pcm = engine.collect_audio(ticket)
    assert (len(pcm[a]), len(pcm[b])) == (3 * 1920, 2 * 1920)


def test_per_row_frame_caps_decode_each_row_up_to_its_own(models):
    """launch_audio(max_frames=[...]): one cap per slot (serve --exact-chunks: each row its
    chunk), None for no cap; rows of 3 and 2 frames capped at 2 and none make one 2-frame
    launch for both, and leave the first row's third frame for later."""
    engine, a, b = rows_of_3_and_2_frames(models)
    ticket = engine.launch_audio([a, b], max_frames=[2, None])
    assert [group for group, _ in ticket.launched] == [[a, b]]  # one launch, not 2 + 1
    pcm = engine.collect_audio(ticket)
    assert (len(pcm[a]), len(pcm[b])) == (2 * 1920, 2 * 1920)
    assert engine.pending_frames(a) == 1
    with pytest.raises(ValueError, match="1 frame caps for 2 slots"):
        engine.launch_audio([a, b], max_frames=[1])


def test_lane_frames_need_a_lane_and_a_codec_chunk_of_their_size():
    from ttsbuild.runtime.loader import open_engine

    def engine(**kw):
        return open_engine(None, "cpu", num_slots=2, max_len=256, random_variant="tiny", **kw)

    with pytest.raises(ValueError, match="needs an admission lane"):
        engine(admission_lane=(), lane_frames=2)
    with pytest.raises(ValueError, match="must be 1 or 2"):
        engine(admission_lane=(1,), lane_frames=3)
    assert engine(admission_lane=(1,), lane_frames=2).plan.lane_frames == 2
    with pytest.raises(ValueError, match="lane_frames needs an admission_lane"):
        EnginePlan(**{**PLAN.model_dump(), "lane_frames": 2})
    with pytest.raises(ValueError, match="one of the codec_chunks"):
        EnginePlan(**{**PLAN.model_dump(), "admission_lane": (1,), "lane_frames": 2,
                      "codec_chunks": (1, 4)})  # fmt: skip


def test_the_one_kernel_code_predictor_asked_at_load():
    """open_engine(megaframe_code_predictor=True) over random weights: on an FP8 code
    predictor, with the lane's SM reserve off (the kernel needs every SM); refused without
    one, beside a reserve asked for, and, where the kernel has no shapes for the model (the
    tiny one), when the graph backend builds it."""
    from ttsbuild.runtime.loader import open_engine

    kw = dict(num_slots=2, max_len=256, random_variant="tiny", precision="fp8")
    eager = open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                        megaframe_code_predictor=True, **kw)  # fmt: skip
    plan = eager.plan
    assert plan.megaframe_code_predictor and plan.code_predictor_fp8
    assert plan.admission_lane and plan.lane_reserved_sms == 0
    with pytest.raises(ValueError, match="needs an FP8 code predictor"):
        open_engine(None, "cpu", kind="eager", megaframe_code_predictor=True, **kw)
    with pytest.raises(ValueError, match="needs every SM"):
        open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                    megaframe_code_predictor=True, lane_reserved_sms=8, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="needs an FP8 engine"):
        open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                    **{**kw, "precision": "bf16"})  # fmt: skip
    with pytest.raises(ValueError, match="code predictor's shapes"):
        open_engine(None, "cpu", kind="graph", code_predictor_fp8=True,
                    megaframe_code_predictor=True, **kw)  # fmt: skip
    # on the admission lane only: taken, and refused without the kernel or without the lane
    lane_only = open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                            megaframe_code_predictor=True, megaframe_regular=False, **kw).plan
    assert lane_only.megaframe_code_predictor and not lane_only.megaframe_regular
    assert 1 in lane_only.admission_lane
    with pytest.raises(ValueError, match="it needs the kernel"):
        open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                    megaframe_regular=False, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="needs the lane on batch bucket 1"):
        open_engine(None, "cpu", kind="eager", code_predictor_fp8=True,
                    megaframe_code_predictor=True, megaframe_regular=False, admission_lane=(),
                    **kw)  # fmt: skip


def test_megaframe_free_waits_only_for_the_other_paths_kernel():
    """A bucket-1 step may start the one-kernel code predictor unless the other path's last
    step that ran it is still in flight; its own path's never matters."""
    from ttsbuild.runtime.graph_engine import megaframe_free

    done = {3}
    for lane in (False, True):
        assert megaframe_free(lane, {False: None, True: None}, done.__contains__)
        assert not megaframe_free(lane, {lane: None, not lane: 5}, done.__contains__)
        assert megaframe_free(lane, {lane: None, not lane: 3}, done.__contains__)
        assert megaframe_free(lane, {lane: 5, not lane: 3}, done.__contains__)


class SlowKernelDriver(RecordingDriver):
    """A launch stays in flight until `hold` launches later (the step driver's ready() is
    otherwise true at once on the CPU): as if every step were a long kernel."""

    hold = 3

    def ready(self, ticket):
        return self.driver.ready(ticket) and len(self.launches) - self._index(ticket) > self.hold

    def _index(self, ticket):
        return next(i for i, (t, *_) in enumerate(self.launches) if t == ticket)


def test_with_the_kernel_on_both_paths_a_step_takes_the_fused_path_beside_the_others(models):
    """plan.megaframe_code_predictor with the regular step and the admission lane both on it
    (two kernel instances, each needing every SM): a bucket-1 step whose other path's kernel
    step may still run takes the fused path (its alternate graph), else the kernel, and the
    choice changes no code and no sample. The kernel itself needs a Hopper GPU: here the
    engine's switch is set as such a plan sets it and the code predictor calls are recorded."""
    plan = PLAN.model_copy(update={"admission_lane": (1, 2)})
    reqs, late = requests(70)[:1], SynthesisRequest(text="Late again.", voice="eric", seed=9)
    expected = run_joining(GraphEngine(models, plan, use_graphs=False, codec_stream=True),
                           reqs, late, join_at=5)
    engine = GraphEngine(models, plan, use_graphs=False, codec_stream=True)
    backend = engine.backend
    assert not backend.mega_alternates and not backend.cp_mega  # off without the plan's switch
    backend.mega_alternates = True
    backend.driver = rec = SlowKernelDriver(backend.driver)
    calls, original = [], backend._code_predictor

    def recorded(hidden, c0, sampling, seeds, frames, lane=False, mega=True):
        calls.append((hidden.shape[0], lane, mega, len(rec.launches)))
        return original(hidden, c0, sampling, seeds, frames, lane, mega)

    backend._code_predictor = recorded
    got = run_joining(engine, reqs, late, join_at=5)
    for (c1, p1), (c2, p2) in zip(expected, got, strict=True):
        assert c1.shape[0] > 3 and torch.equal(c1, c2)
        assert_same_audio(p1, p2)
    ones = [(lane, mega) for rows, lane, mega, _ in calls if rows == 1]
    # the first request's first frame on the lane (the kernel: nothing else ran it yet), its
    # next regular step beside it (fused); its later regular steps use the kernel once the
    # lane's has finished, and the late request's first frame on the lane, beside a regular
    # step that ran it, is fused
    assert ones[:2] == [(True, True), (False, False)]
    assert (False, True) in ones and (True, False) in ones
    # every kernel step started only when the other path's last kernel step was done
    last = {False: None, True: None}
    for rows, lane, mega, launched in calls:
        if rows != 1:
            continue
        other = last[not lane]
        if mega:
            assert other is None or launched - other > SlowKernelDriver.hold
            last[lane] = launched
        else:
            assert other is not None and launched - other <= SlowKernelDriver.hold
