"""GPU tests (sm_90) of `talker_megastep.TalkerStep`, the talker's decode step at batch 1 as
one kernel: on a talker of the 1.7B CustomVoice shapes (4 layers, to keep it quick) with
random FP8 weights and a random bf16 cache, its output and cache writes against the float32
reference at positions in the first chunk, at a chunk's edge and deep in the cache, for each
prefetch distance, eagerly and replayed in a CUDA graph with a new position. Skipped without
such a GPU: the CPU checks are in test_talker_megastep.py."""

import pytest
import torch
from test_talker_megastep import random_stack

from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.runtime import talker_megastep as tm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (compute capability 9.0: the kernel is built for sm_90a)",
)
S = 512


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def stack():
    s = tm.SHAPE
    cfg = DecoderStackConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                             num_layers=4, num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                             head_dim=s["head_dim"], rms_norm_eps=1e-6, rope_theta=1e6)
    return random_stack(cfg, 31, device="cuda", dtype=torch.bfloat16)


def _inputs(stack, seed):
    c = stack.cfg
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (c.num_layers, 3, c.num_kv_heads, S, c.head_dim)
    k = torch.randn(shape, device="cuda", generator=g).bfloat16()
    v = torch.randn(shape, device="cuda", generator=g).bfloat16()
    x = torch.randn(1, c.hidden_size, device="cuda", generator=g).bfloat16()
    return x, k, v


def _check(out, k, v, ref, kr, vr, pos, slot=2):
    assert rel(out[0], ref) < 2e-3
    for a, b in ((k, kr), (v, vr)):
        assert rel(a[:, slot, :, pos], b[:, slot, :, pos]) < 1e-2  # bf16 rounding of k, v
        a[:, slot, :, pos] = b[:, slot, :, pos]
        assert torch.equal(a, b)  # nothing else written


@pytest.mark.parametrize("dist", [0, 2])
@pytest.mark.parametrize("pos", [0, 31, 32, 300, S - 1])
def test_step_is_the_reference(stack, dist, pos):
    x, k, v = _inputs(stack, seed=pos + 100 * dist)
    kr, vr = k.clone(), v.clone()
    ref = tm.reference(stack, x[0], kr, vr, 2, pos)
    step = tm.TalkerStep(stack, S, dist=dist)
    slot, p = torch.tensor([2], device="cuda"), torch.tensor([pos], device="cuda")
    for _ in range(2):  # twice: the barrier's count is back to 0 after a launch
        out = step(x, k, v, slot, p).clone()
    _check(out, k, v, ref, kr, vr, pos)
    # the check can fail: the reference at another slot is far from the kernel's output (not
    # at position 0, where attention sees only the token's own k, v: the slot's cache writes
    # are what _check holds there)
    if pos > 0:
        assert rel(out[0], tm.reference(stack, x[0], kr.clone(), vr.clone(), 0, pos)) > 1e-2


def test_graph_replay_takes_the_new_position(stack):
    x, k, v = _inputs(stack, seed=7)
    step = tm.TalkerStep(stack, S, dist=1)
    slot, p = torch.tensor([2], device="cuda"), torch.tensor([10], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(x, k.clone(), v.clone(), slot, p)  # warm-up (build, attributes) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step(x, k, v, slot, p)
    for pos in (200, 77):
        kr, vr = k.clone(), v.clone()
        ref = tm.reference(stack, x[0], kr, vr, 2, pos)
        p.fill_(pos)
        graph.replay()
        torch.cuda.synchronize()
        _check(out.clone(), k, v, ref, kr, vr, pos)
