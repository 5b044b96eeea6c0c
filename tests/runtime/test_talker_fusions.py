"""PackedStack.decode with the talker's launch fusions switched on: the decode attention as
one launch (`fast_model.TALKER_ATTEND_FUSED`, plugins.decode_attention
.qk_norm_rope_decode_attention) and the FP8 gate/up GEMV with silu(gate) * up in its epilogue
(`fast_model.GATE_UP_SILU`, plugins.fp8_linear.fp8_gate_up_silu), and, over a short cache
(the code predictor's unfused path), q/k norm + RoPE + cache write + attention as one launch
(`fast_model.SHORT_ATTEND_FUSED`, plugins.qk_norm_rope_attend): the same hidden states and
caches as the unfused kernels, and as the fp32 reference."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel
from test_cp_fused import PRECISIONS, G, _f32_cpu, _inputs, _rel, _stack

from ttsbuild.runtime import fast_model

SWITCHES = ["TALKER_ATTEND_FUSED", "GATE_UP_SILU", "SHORT_ATTEND_FUSED"]


def _positions(switch):
    """Cache positions: the code predictor's for the short-cache switch, the talker's else."""
    return G if switch == "SHORT_ATTEND_FUSED" else 80


def _count_short(monkeypatch):
    """Count the fused short-cache launches PackedStack.decode makes."""
    calls = []
    real = fast_model.qk_norm_rope_attend

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_model, "qk_norm_rope_attend", spy)
    return calls


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
def test_references_equal_with_the_switch(dtype, fp8, switch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors: both paths on the references
    stack = _stack(dtype, fp8)
    x, k, v, slots, positions = _inputs(dtype, "cpu", _positions(switch))
    k2, v2 = k.clone(), v.clone()
    calls = _count_short(monkeypatch)
    ref = stack.decode(x, k, v, slots, positions)
    monkeypatch.setattr(fast_model, switch, True)
    out = stack.decode(x, k2, v2, slots, positions)
    assert torch.equal(out, ref) and torch.equal(k, k2) and torch.equal(v, v2)
    # the short-cache switch takes the fused call in every layer, and only when it is on
    assert calls == ([x.shape[0]] * len(stack.layers) if switch == "SHORT_ATTEND_FUSED" else [])


def test_short_attend_leaves_long_caches_alone(monkeypatch):
    """A cache longer than the fused kernel's tile (the talker's) keeps the two kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    stack = _stack(torch.bfloat16, False)
    x, k, v, slots, positions = _inputs(torch.bfloat16, "cpu", 80)
    calls = _count_short(monkeypatch)
    monkeypatch.setattr(fast_model, "SHORT_ATTEND_FUSED", True)
    stack.decode(x, k, v, slots, positions)
    assert calls == []


@needs_kernel
@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
def test_kernel_path_matches_reference(dtype, fp8, switch, monkeypatch):
    stack = _stack(dtype, fp8, KDEV)
    x, k, v, slots, positions = _inputs(dtype, KDEV, _positions(switch))
    k_ref, v_ref = k.cpu().float(), v.cpu().float()
    k3, v3 = k.clone(), v.clone()
    calls = _count_short(monkeypatch)
    monkeypatch.setattr(fast_model, switch, True)
    out = stack.decode(x, k, v, slots, positions)
    assert len(calls) == (len(stack.layers) if switch == "SHORT_ATTEND_FUSED" else 0)
    monkeypatch.setattr(fast_model, switch, False)
    unfused = stack.decode(x, k3, v3, slots, positions)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference: unfused, CPU, fp32
    ref = _f32_cpu(stack).decode(x.cpu().float(), k_ref, v_ref, slots.cpu(), positions.cpu())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and _rel(out.cpu(), ref) < tol
    assert _rel(k.cpu(), k_ref) < tol and _rel(v.cpu(), v_ref) < tol
    # later layers see the rounding of earlier ones: close, not equal
    assert _rel(out.float(), unfused.float()) < tol and _rel(v.float(), v3.float()) < tol


def _a8_switches(monkeypatch, norm=False, silu=False, gate_up=False):
    """The A8 switches as given (the served defaults turn NORM_QUANT and GATE_UP_SILU on)."""
    monkeypatch.setattr(fast_model, "A8_NORM_QUANT", norm)
    monkeypatch.setattr(fast_model, "A8_SILU_QUANT", silu)
    monkeypatch.setattr(fast_model, "A8_GATE_UP_SILU", gate_up)


def _a8_stack(device, monkeypatch, handed):
    """The FP8 stack with every linear W8A8 (from 1 row), counting the norms' hand-offs."""
    stack = _stack(torch.bfloat16, True, device)
    stack.set_w8a8_min_rows(1)
    real = fast_model.Dense.hand_quantized

    def spy(self, x, quantized):
        handed.append(quantized[0].shape)
        real(self, x, quantized)

    monkeypatch.setattr(fast_model.Dense, "hand_quantized", spy)
    return stack


@pytest.mark.parametrize(
    "switches,down_handed",
    [({"norm": True, "silu": True}, True),  # down's input quantised by silu_mul
     ({"norm": True, "gate_up": True}, False)],  # as served: down's input from gate/up's epilogue
)  # fmt: skip
def test_a8_switches_change_nothing_on_the_references(monkeypatch, switches, down_handed):
    """`A8_NORM_QUANT` (+ `A8_SILU_QUANT`, or + `A8_GATE_UP_SILU` as served): the norm before
    each W8A8 qkv and gate/up linear, and silu_mul before down where it runs, hand their rows
    quantised, and the stack's output and caches are the bits of all three off."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    handed = []
    stack = _a8_stack("cpu", monkeypatch, handed)
    x, k, v, slots, positions = _inputs(torch.bfloat16, "cpu", 80)
    k2, v2 = k.clone(), v.clone()
    _a8_switches(monkeypatch)
    ref = stack.decode(x, k, v, slots, positions)
    assert handed == []
    _a8_switches(monkeypatch, **switches)
    out = stack.decode(x, k2, v2, slots, positions)
    # qkv's and gate/up's inputs from the norms (and down's from silu_mul), every layer
    assert len(handed) == (3 if down_handed else 2) * len(stack.layers)
    inter = stack.layers[0].down.weight.shape[1]
    widths = {x.shape[-1], inter} if down_handed else {x.shape[-1]}
    assert {s[1] for s in handed} == widths and all(s[0] == 4 for s in handed)
    assert all(d._quantized is None for p in stack.layers for d in (p.qkv, p.gate_up, p.down))
    assert torch.equal(out, ref) and torch.equal(k, k2) and torch.equal(v, v2)


@needs_kernel
def test_norms_quantising_for_w8a8_on_the_kernels(monkeypatch):
    """The same on the kernels: the norm kernel's quantised rows are the row quantisation
    kernel's bits, so the stack's output and caches do not change."""
    handed = []
    stack = _a8_stack(KDEV, monkeypatch, handed)
    x, k, v, slots, positions = _inputs(torch.bfloat16, KDEV, 80)
    k2, v2 = k.clone(), v.clone()
    _a8_switches(monkeypatch)
    ref = stack.decode(x, k, v, slots, positions)
    _a8_switches(monkeypatch, norm=True, silu=True)
    out = stack.decode(x, k2, v2, slots, positions)
    assert len(handed) == 3 * len(stack.layers)
    assert torch.equal(out, ref) and torch.equal(k, k2) and torch.equal(v, v2)
