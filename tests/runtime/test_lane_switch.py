"""The admission lane switched on and off between steps (serve --lane-max-active does it by
load) keeps every code and sample of every request: benchmarks/runtime/graph_vs_eager.py's
check on the CPU path of the graph backend (the lane's own bodies, caches and bookkeeping run
eagerly there; on a GPU the same script checks its streams too)."""

from __future__ import annotations

import torch
from helpers_scripts import script_fixture

gve = script_fixture("benchmarks/runtime/graph_vs_eager.py")


def test_switching_the_lane_between_steps_keeps_every_code(gve, monkeypatch):
    from ttsbuild.runtime.graph_engine import GraphBackend

    fresh_on_lane, fresh_regular, first_codec_regular = [], [], []
    lane_frames, regular_frames = GraphBackend._lane_frames, GraphBackend._regular_frames

    def spy_lane(self, slots, second=False):
        fresh_on_lane.extend(slots)
        return lane_frames(self, slots, second)

    def spy_regular(self, slots):
        fresh_regular.extend(s for s in slots if s in self.fresh)  # prefilled on the lane
        return regular_frames(self, slots)

    regular_codec = GraphBackend._regular_codec

    def spy_codec(self, slots, n):  # rows whose first frame ran on the lane, decoded regularly
        first_codec_regular.extend(s for s in slots if self.codec_fresh.get(s))
        return regular_codec(self, slots, n)

    monkeypatch.setattr(GraphBackend, "_regular_codec", spy_codec)
    monkeypatch.setattr(GraphBackend, "_lane_frames", spy_lane)
    monkeypatch.setattr(GraphBackend, "_regular_frames", spy_regular)
    assert gve.check("tiny", torch.float32, greedy=False, device="cpu", lane=(1, 2), switch=True)
    # every way ran: first frames on the lane, rows prefilled there stepped regularly, rows
    # whose first frame ran there decoded regularly
    assert fresh_on_lane and fresh_regular and first_codec_regular
