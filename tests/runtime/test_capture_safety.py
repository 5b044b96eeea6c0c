"""Every body the graph backend captures is safe to capture: no host sync and no host-to-
device copy of fresh host data, for every kernel choice the plan offers.

CUDA-graph capture refuses (or silently bakes in) a tensor made from Python data
(`torch.tensor(...)`, or `t[idx] = 0`, which lifts the 0 into a CPU tensor and copies it),
and a read of a device value on the host (`.item()`, `bool(t)`, data-dependent shapes). The
graph bodies (`GraphBackend.graph_bodies`, the list `capture` captures) run here eagerly on
CPU under a dispatch mode that records those ops. A test that the check can fail: the
pre-fix `GuardState.reset` (`t[rows] = 0`) is caught.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest

aten = torch.ops.aten
# A Python scalar assigned through basic indexing (`t[:, -1] = False`) is lifted and then
# fill_-ed from the host: safe. Lifted data used any other way (an index_put_ of
# `t[rows] = 0`, a torch.tensor(...) moved to the device) is not.
LIFT, VIEWS, FILL = aten.lift_fresh.default, {aten.select.int, aten.slice.Tensor}, aten.fill_.Tensor
UNSAFE = {
    LIFT: "a tensor from Python data (torch.tensor, or t[idx] = scalar)",
    aten._local_scalar_dense.default: "a host read of a device value (.item(), bool(t))",
    aten.nonzero.default: "a data-dependent shape (host sync)",
    aten.masked_select.default: "a data-dependent shape (host sync)",
}


class CaptureSafety(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.lifted = False  # a lift_fresh not yet consumed by a basic-index fill_

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.lifted and func not in VIEWS:
            if func is not FILL:
                self.found.append(f"{LIFT}: {UNSAFE[LIFT]}, then {func}")
            self.lifted = False
        if func is LIFT:
            self.lifted = True
        elif func in UNSAFE:
            self.found.append(f"{func}: {UNSAFE[func]}")
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        if self.lifted:
            self.found.append(f"{LIFT}: {UNSAFE[LIFT]}")
        return super().__exit__(*exc)


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


RC = dict(num_slots=3, max_len=128, max_text=64, batch_buckets=(1, 2), prefill_buckets=(64,),
          codec_chunks=(1, 2), codec_ring=8)  # fmt: skip
CHOICES = {
    "unfused": {},
    "fused": {"fused_code_predictor": (1, 2), "fused_talker": (1, 2)},
    "persistent": {"persistent_code_predictor": (1, 2)},
    "speculative": {"speculative": {1: ("self", 2), 2: ("self", 3)}},
    "no prefix cache": {"prefix_pool": 0},
    "codec kernels": {"codec_precision": "fp16", "codec_conv": "triton", "codec_fused": True,
                      "codec_channels_last": True, "codec_fused_output": True,
                      "codec_fused_attention": True, "codec_state_channels_last": True},
    "codec fused layers": {"codec_precision": "fp16", "codec_conv": "triton", "codec_fused": True,
                           "codec_fused_attention": True, "codec_fused_layers_max_rows": 2},
    "batched prefill": {"prefill_batches": (1, 2)},
    "admission lane": {"admission_lane": (1, 2), "fused_code_predictor": (2,)},
    "two lane frames": {"admission_lane": (1, 2), "lane_frames": 2},
}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_graph_bodies_are_capture_safe(models, choice):
    engine = GraphEngine(models, EnginePlan(**CHOICES[choice], **RC), use_graphs=False)
    backend = engine.backend
    if backend.cp_spec is not None:
        backend.cp_spec.early_exit_on_cpu = False  # the CPU-only shortcut reads a device value
    req = SynthesisRequest(text="The birch canoe slid on the smooth planks.", voice="ryan",
                           seed=1, max_frames=6)  # fmt: skip
    slots = [engine.admit(req) for _ in range(2)]
    engine.prefill(slots)  # host-side admission work happens here, outside any graph
    backend.rows_in[:2] = torch.tensor(slots)
    backend.codec_rows_in[:2] = torch.tensor(slots)
    if backend.lane_buckets:  # the lane's first frame and first codec step, on its own rows
        backend.lane_rows_in[:2] = torch.tensor(slots)
        backend.lane_codec_rows_in[:2] = torch.tensor(slots)
    # the memory report counts what the choice holds
    assert (backend.memory_report()["speculation"] > 0) == (choice == "speculative")
    bodies = backend.graph_bodies()
    assert {key[0] for key, _, _ in bodies} >= {"frame", "codec", "prefill"}
    prefill_batches = {key[1] for key, _, _ in bodies if key[0] == "prefill"}
    assert prefill_batches == set(backend.plan.prefill_batches)
    lane = {key for key, _, where in bodies if where == "admit" and key[0] in ("first",
                                                                                 "first_codec")}
    assert lane == {(k, b) for k in ("first", "first_codec") for b in backend.lane_buckets} | {
        ("first_codec", b, 2) for b in backend.lane_buckets if backend.plan.lane_frames == 2}
    second = {key for key, _, where in bodies if where == "admit" and key[0] == "second"}
    assert second == {("second", b) for b in backend.lane_buckets
                      if backend.plan.lane_frames == 2}  # fmt: skip
    for key, body, _ in bodies:
        with CaptureSafety() as mode:
            body()
        assert not mode.found, f"{key} is not capture-safe: {mode.found}"


def test_the_check_catches_a_scalar_setitem(models):
    """The pre-fix GuardState.reset (t[rows] = 0 on a device tensor) is caught."""
    t = torch.zeros(4, dtype=torch.int64)
    rows = torch.tensor([1])
    with CaptureSafety() as mode:
        t[rows] = 0
    assert mode.found and "Python data" in mode.found[0]
    with CaptureSafety() as mode:
        t.index_fill_(0, rows, 0)
        t[1:] = 0  # basic indexing: filled from the host, safe
    assert not mode.found
    with CaptureSafety() as mode:
        t.add_(torch.tensor([1, 2, 3, 4]))
    assert mode.found


def test_the_megaframe_alternates_are_captured_and_capture_safe(models):
    """With the one-kernel code predictor on both paths (GraphBackend.mega_alternates, set as
    plan.megaframe_code_predictor sets it on a Hopper GPU), bucket 1's frame steps on both
    paths also have a fused graph ("fused" keys, each on its path's stream) for when the
    other path's kernel may still run; no other bucket does, and they are capture-safe."""
    plan = EnginePlan(**RC, admission_lane=(1, 2), lane_frames=2)
    engine = GraphEngine(models, plan, use_graphs=False)
    backend = engine.backend
    plain = {key for key, _, _ in backend.graph_bodies()}
    backend.mega_alternates = True
    alternates = {key: (body, where) for key, body, where in backend.graph_bodies()
                  if key not in plain}  # fmt: skip
    assert {key: where for key, (_, where) in alternates.items()} == {
        ("frame", 1, "fused"): "lm", ("first", 1, "fused"): "admit",
        ("second", 1, "fused"): "admit"}
    req = SynthesisRequest(text="Glue the sheet to the dark blue.", voice="ryan", seed=2,
                           max_frames=6)  # fmt: skip
    slot = engine.admit(req)
    engine.prefill([slot])
    backend.rows_in[:1] = slot
    backend.lane_rows_in[:1] = slot
    for key, (body, _) in alternates.items():
        with CaptureSafety() as mode:
            body()
        assert not mode.found, f"{key} is not capture-safe: {mode.found}"
