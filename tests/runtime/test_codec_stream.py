"""The codec on its own stream, on CPU: the driver's lanes, the events a step is ordered
after (exactly where data flows through the code ring), and the two-lane engine giving the
same codes and audio as the one-lane engine."""

from __future__ import annotations

import random

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


def test_ring_order_names_the_steps_that_wrote_and_read_each_entry():
    """A random schedule of frame and codec steps over slots that come and go, against a
    brute-force record of which step wrote and read every frame."""
    rng = random.Random(3)
    slots, ring = 4, 5
    order = _RingOrder(slots, ring)
    wrote: dict[int, list[int]] = {s: [] for s in range(slots)}  # frame index -> ticket
    read: dict[int, list[int]] = {s: [] for s in range(slots)}
    last_read: dict[int, int | None] = dict.fromkeys(range(slots))
    ticket = 0
    for _ in range(3000):
        s_list = rng.sample(range(slots), rng.randint(1, slots))
        kind = rng.random()
        if kind < 0.03:  # a new occupant for one slot
            s = s_list[0]
            assert order.admit(s) == ([] if last_read[s] is None else [last_read[s]])
            wrote[s], read[s], last_read[s] = [], [], None
        elif kind < 0.55:  # a frame step (the core allows at most `ring` frames undecoded)
            s_list = [s for s in s_list if len(wrote[s]) - len(read[s]) < ring]
            if not s_list:
                continue
            overwritten = [read[s][len(wrote[s]) - ring] for s in s_list if len(wrote[s]) >= ring]
            assert order.before_frames(s_list) == ([max(overwritten)] if overwritten else [])
            order.frames_launched(s_list, ticket)
            for s in s_list:
                wrote[s].append(ticket)
            ticket += 1
        else:  # a codec step of n frames for slots with n frames written and not decoded
            n = rng.choice([1, 2, 4])
            s_list = [s for s in s_list if len(wrote[s]) - len(read[s]) >= n]
            if not s_list:
                continue
            last_frames = [wrote[s][len(read[s]) + n - 1] for s in s_list]
            assert order.before_codec(s_list, n) == [max(last_frames)]
            order.codec_launched(s_list, n, ticket)
            for s in s_list:
                read[s] += [ticket] * n
                last_read[s] = ticket
            ticket += 1


# -- the engine on two lanes ------------------------------------------------------------------


class RecordingDriver:
    """The step driver, with every launch (ticket, lane, after, staged slot ids) and every
    device wait kept, in order."""

    def __init__(self, driver):
        self.driver = driver
        self.launches: list[tuple[int, int, list[int], list[int]]] = []
        self.log: list[tuple] = []

    def launch(self, step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane=0, after=()):
        ticket = self.driver.launch(step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane, list(after))
        self.launches.append((ticket, lane, list(after), h2d_src[0].tolist()))
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


def run(engine, reqs):
    """Frames launched one step ahead of reading, the codec two frames behind, so the ring
    (4 entries) wraps; then a slot is released and taken by a new request."""
    slots = [engine.admit(r) for r in reqs]
    engine.prefill(slots)
    codes = {s: [] for s in slots}
    pcm = {s: [] for s in slots}
    pending = None
    while True:
        active = [s for s in slots if engine.table[s].can_launch]
        ticket = engine.launch_frames(active) if active else None
        if pending is not None:
            for out in engine.collect(pending):
                if out.codes is not None:
                    codes[out.slot].append(out.codes)
        audio = engine.launch_audio(slots, max_frames=2)
        for s, p in engine.collect_audio(audio).items():
            pcm[s].append(p)
        if ticket is None:
            break
        pending = ticket
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
    # The slot's next occupant was prefilled after its previous occupant's last codec step.
    waits = [i for i, (kind, what) in enumerate(rec.log) if kind == "wait" and what]
    assert len(waits) == 1  # only the slot that had an occupant before
    before = [what for kind, what in rec.log[: waits[0]] if kind == "launch"]
    last_codec = max(t for t, lane, _, rows in before if lane == codec_lane and slots[1] in rows)
    assert rec.log[waits[0]][1] == [last_codec]
