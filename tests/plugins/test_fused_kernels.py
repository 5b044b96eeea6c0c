"""fused_linear / qk_norm_rope_attend / norm_linear_attend: the references on CPU, the Triton
kernels against a float32 reference on fresh random inputs (on CUDA, or on CPU under
TRITON_INTERPRET=1; the last test here runs the kernel tests of this file, of
tests/runtime/test_cp_fused.py, of tests/plugins/test_slot_writes.py, test_kv_copy.py,
test_kv_fp8.py, test_qk_decode_attention.py, test_spec_accept.py, test_spec_round.py,
test_convnext.py, test_prompt_embed.py and tests/runtime/test_graph_engine.py in a
subprocess under the interpreter, so CPU CI checks the kernels too when triton is
installed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers_scripts import communicate_all
from kernel_device import HAS_TRITON, KDEV, kernel_cases, needs_kernel

from ttsbuild.plugins._dispatch import interpret_mode
from ttsbuild.plugins.attend_o import attend_o_residual
from ttsbuild.plugins.decode_attention import decode_attention_reference
from ttsbuild.plugins.fp8_linear import fp8_linear_reference, quantize_weight_fp8
from ttsbuild.plugins.fused_linear import (
    fused_linear,
    fused_linear_reference,
    gather_linear,
    linear_residual,
    norm_gate_up_silu,
    norm_linear,
    norm_linear_attend,
    scaled_half_weight,
)
from ttsbuild.plugins.norm_act import rms_norm_reference, silu_mul_reference
from ttsbuild.plugins.qk_norm_rope import qk_norm_rope_reference
from ttsbuild.plugins.qk_norm_rope_attend import (
    qk_norm_rope_attend,
    qk_norm_rope_attend_reference,
)

# The interpreter rounds fp32 -> bf16 by truncation: a few biased roundings per output.
BF16_TOL = 1e-2 if KDEV == "cuda" else 4e-2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- references (CPU)


def test_fused_linear_reference_is_the_unfused_ops():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    nw = (1 + 0.2 * torch.randn(64, generator=g)).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    res = torch.randn(5, 48, generator=g).bfloat16()
    h = rms_norm_reference(x, nw, 1e-6)
    assert torch.equal(norm_linear(x, nw, w, eps=1e-6, use_triton=False), F.linear(h, w))
    assert torch.equal(
        norm_gate_up_silu(x, nw, w, eps=1e-6, use_triton=False), silu_mul_reference(F.linear(h, w))
    )
    assert torch.equal(
        linear_residual(x, w[:48], None, res, use_triton=False), res + F.linear(x, w[:48])
    )
    table = torch.randn(30, 64, generator=g).bfloat16()
    idx = torch.randint(0, 30, (5,), generator=g)
    bias = torch.randn(96, generator=g).bfloat16()
    assert torch.equal(
        gather_linear(table, idx, w, bias, use_triton=False), F.linear(table[idx], w, bias)
    )
    q, s = quantize_weight_fp8(w.float())
    assert torch.equal(fused_linear(x, q, s, use_triton=False), fp8_linear_reference(x, q, s))
    with pytest.raises(TypeError):
        fused_linear(x, q)  # FP8 weight without its scale


def test_scaled_half_weight_rounds_each_row_to_fp16_bits_whatever_its_magnitude():
    # rows of very different magnitudes: one of ~1e-7 (a small layer scale folded in), whose
    # plain fp16 rounding lies among the subnormals and keeps few bits
    g = torch.Generator().manual_seed(17)
    mags = torch.tensor([1e-7, 3e-3, 1.0, 700.0, 4e4])
    w = torch.randn(5, 300, generator=g) * mags[:, None]
    w16, scale = scaled_half_weight(w)
    assert w16.dtype == torch.float16 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert w16.float().abs().amax(dim=1).le(1).all() and w16.float().abs().amax(dim=1).gt(0.5).all()
    back = w16.double() * scale.double()[:, None]
    # round to nearest with 11 significant bits (entries within 2^14 of their row's largest)
    big = w.abs() >= w.abs().amax(dim=1, keepdim=True) * 2.0**-14
    rel_big = torch.where(big, (back - w.double()).abs() / w.double().abs(), 0.0).amax(dim=1)
    assert rel_big.le(2.0**-11).all(), rel_big
    plain = w.half().double()  # no scale: the tiny row loses its bits, the largest overflows
    assert ((plain[0] - w[0].double()).abs() / w[0].double().abs()).amax() > 0.1
    assert torch.isinf(plain[4]).any()
    # the linear with them: the dequantised weight's product, from fp32 activations
    x = torch.randn(3, 300, generator=g)
    y = fused_linear(x, w16, scale, use_triton=False)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), x.double() @ back.t(), rtol=1e-5, atol=1e-5 * y.abs().max())
    with pytest.raises(TypeError, match="per-channel scale"):
        fused_linear(x, w, scale, use_triton=False)  # fp32 weights take no scale


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_runs_few_fp32_rows_as_gemvs_only_when_asked():
    from ttsbuild.plugins._tl.fused_linear import plan

    # the codec pre-transformer's qkv (N 3072, K 512) on the H200's 132 SMs
    tiled = plan(4, 3072, 512, False, 132, fp32=True, gemv_rows_f32=0)
    assert tiled["BLOCK_M"] == 16
    assert plan(4, 3072, 512, False, 132, fp32=False, gemv_rows_f32=8)["BLOCK_M"] == 16
    rows = plan(4, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8)
    one = plan(1, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8)
    assert rows["BLOCK_M"] == one["BLOCK_M"] == 1 and rows["BLOCK_K"] == one["BLOCK_K"]
    assert rows["BLOCK_N"] == 16  # the 8-column form is for one row only
    assert plan(9, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8)["BLOCK_M"] == 16


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_takes_the_fp32_gemv_k_block_when_set(monkeypatch):
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    # the codec pre-transformer's o projection (N 512, K 1024) and gate/up (2 x 1024, K 512)
    plan = tl_fused_linear.plan
    o, gu, half = (plan(1, 512, 1024, False, 132, fp32=True, gemv_rows_f32=8),
                   plan(1, 1024, 512, True, 132, fp32=True, gemv_rows_f32=8),
                   plan(1, 512, 1024, False, 132))  # fmt: skip
    assert (o["BLOCK_K"], o["SPLIT_K"], gu["BLOCK_K"], gu["SPLIT_K"]) == (512, 2, 256, 2)
    monkeypatch.setattr(tl_fused_linear, "GEMV_F32_BLOCK_K", 128)
    o2 = plan(1, 512, 1024, False, 132, fp32=True, gemv_rows_f32=8)
    gu2 = plan(1, 1024, 512, True, 132, fp32=True, gemv_rows_f32=8)
    assert (o2["BLOCK_K"], o2["SPLIT_K"], gu2["BLOCK_K"], gu2["SPLIT_K"]) == (128, 8, 64, 4)
    assert plan(1, 512, 1024, False, 132) == half  # half-precision activations: unchanged


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_tf32_tiles_take_32_wide_k_blocks_and_tensor_cores(monkeypatch):
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    plan = tl_fused_linear.plan
    ieee = plan(64, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8)
    tf32 = plan(64, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8, tf32=True)
    assert (ieee["BLOCK_M"], ieee["BLOCK_K"], tf32["BLOCK_M"], tf32["BLOCK_K"]) == (64, 128, 64, 32)
    # GEMV rows and half-precision activations: tf32 changes nothing
    assert plan(4, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8, tf32=True) == plan(
        4, 3072, 512, False, 132, fp32=True, gemv_rows_f32=8)
    assert plan(64, 3072, 512, False, 132, tf32=True) == plan(64, 3072, 512, False, 132)
    monkeypatch.setattr(tl_fused_linear, "interpret_mode", lambda: False)
    x32, x16 = torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.float16)
    assert [tl_fused_linear._dot_f32(x, t) for x in (x32, x16) for t in (False, True)] == [
        True, False, False, False]
    monkeypatch.setattr(tl_fused_linear, "interpret_mode", lambda: True)  # IEEE there
    assert tl_fused_linear._dot_f32(x32, True) and tl_fused_linear._dot_f32(x16, True)


@needs_kernel
@pytest.mark.parametrize("half", [False, True])
def test_tf32_tile_kernel(half):
    # the codec pre-transformer's larger steps (TR_TF32_MAX_ROWS): fp32 activations in 64-row
    # tiles on TF32 tensor cores (IEEE under the interpreter), fp32 or scaled fp16 weights,
    # norm + gate/up + SiLU and linear + bias + residual; TF32 keeps 10 mantissa bits
    M, K, N = 40, 96, 48
    g = _gen(M + 7 + half)
    x = torch.randn(M, K, device=KDEV, generator=g) * 2
    w = torch.randn(2 * N, K, device=KDEV, generator=g) * K**-0.5
    w, s = scaled_half_weight(w) if half else (w, None)
    w_ref = w.float() * s[:, None] if half else w
    nw = 1 + 0.3 * torch.randn(K, device=KDEV, generator=g)
    out = fused_linear(x, w, s, norm_weight=nw, eps=1e-6, gate_up=True, use_triton=True,
                       gemv_rows_f32=8, tf32=True)  # fmt: skip
    ref = fused_linear_reference(x, w_ref, None, norm_weight=nw, eps=1e-6, gate_up=True)
    assert out.dtype == torch.float32 and _rel(out, ref) < 3e-3
    if KDEV == "cuda":  # TF32's rounding shows: the tensor cores ran, not IEEE FMAs
        assert _rel(out, ref) > 1e-5
    bias = torch.randn(2 * N, device=KDEV, generator=g)
    res = torch.randn(M, 2 * N, device=KDEV, generator=g)
    out = fused_linear(x, w, s, bias=bias, residual=res, use_triton=True, gemv_rows_f32=8,
                       tf32=True)  # fmt: skip
    ref = fused_linear_reference(x, w_ref, None, bias=bias, residual=res)
    assert _rel(out - res, ref - res) < 3e-3


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_runs_few_half_rows_as_gemvs_only_when_switched(monkeypatch):
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    # the code predictor's qkv (N 4096, K 1024): 2-4 rows (a verify pass of a row) as GEMVs
    plan = tl_fused_linear.plan
    monkeypatch.setattr(tl_fused_linear, "GEMV_FEW_ROWS", False)
    assert [plan(M, 4096, 1024, False, 132)["BLOCK_M"] for M in (1, 2, 4)] == [1, 16, 16]
    monkeypatch.setattr(tl_fused_linear, "GEMV_FEW_ROWS", True)
    rows = [plan(M, 4096, 1024, False, 132) for M in (2, 3, 4, 5)]
    assert [c["BLOCK_M"] for c in rows] == [1, 1, 1, 16]
    assert rows[0]["BLOCK_K"] == plan(1, 4096, 1024, False, 132)["BLOCK_K"]
    # fp32 rows keep their own rule (gemv_rows_f32)
    assert plan(4, 3072, 512, False, 132, fp32=True, gemv_rows_f32=0)["BLOCK_M"] == 16


def test_qk_norm_rope_attend_reference_is_the_two_ops():
    g = torch.Generator().manual_seed(4)
    R, Hq, Hkv, D, S = 3, 4, 2, 16, 8
    qkv = torch.randn(R, (Hq + 2 * Hkv) * D, generator=g)
    qw, kw = 1 + 0.2 * torch.randn(D, generator=g), 1 + 0.2 * torch.randn(D, generator=g)
    pos = torch.tensor([0, 5, 7])
    slots = torch.tensor([2, 0, 3])
    kc, vc = torch.randn(4, Hkv, S, D, generator=g), torch.randn(4, Hkv, S, D, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    a = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    out = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc, vc, use_triton=False, **a)
    q = qk_norm_rope_reference(qkv, qw, kw, pos, slots, kc2, vc2, **a)
    ref = decode_attention_reference(q, kc2, vc2, slots, pos + 1).reshape(R, -1)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_qk_norm_rope_attend_reference_of_two_tokens_is_two_calls():
    """tokens=2: qkv rows [token 0 of B rows, token 1 of them], token 1 at position + 1
    attends over token 0's new entry: the same as two one-token calls in turn."""
    g = torch.Generator().manual_seed(6)
    B, Hq, Hkv, D, S = 3, 4, 2, 16, 8
    qkv = torch.randn(2 * B, (Hq + 2 * Hkv) * D, generator=g)
    qw, kw = 1 + 0.2 * torch.randn(D, generator=g), 1 + 0.2 * torch.randn(D, generator=g)
    pos, slots = torch.tensor([0, 3, 6]), torch.tensor([2, 0, 3])
    kc, vc = torch.randn(4, Hkv, S, D, generator=g), torch.randn(4, Hkv, S, D, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    a = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    out = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc, vc, use_triton=False, tokens=2, **a)
    first = qk_norm_rope_attend(qkv[:B], qw, kw, pos, slots, kc2, vc2, use_triton=False, **a)
    second = qk_norm_rope_attend(qkv[B:], qw, kw, pos + 1, slots, kc2, vc2, use_triton=False,
                                 **a)  # fmt: skip
    # the same math on 2B rows instead of B: the CPU's kernels may block the sums otherwise
    # (an AMD EPYC host, torch 2.13: 1 ulp apart in 3 of the 768 outputs)
    both = torch.cat([first, second])
    assert ((out - both).norm() / both.norm()).item() < 1e-6
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="2 tokens per row"):
        qk_norm_rope_attend(qkv[:5], qw, kw, pos, slots, kc, vc, use_triton=False, tokens=2, **a)


def test_norm_linear_attend_reference_is_the_two_ops():
    g = torch.Generator().manual_seed(5)
    R, K, Hq, Hkv, D, S = 3, 64, 4, 2, 16, 8
    x = torch.randn(R, K, generator=g)
    nw = 1 + 0.2 * torch.randn(K, generator=g)
    w = torch.randn((Hq + 2 * Hkv) * D, K, generator=g) * K**-0.5
    qw, kw = 1 + 0.2 * torch.randn(D, generator=g), 1 + 0.2 * torch.randn(D, generator=g)
    pos, slots = torch.tensor([0, 5, 7]), torch.tensor([2, 0, 3])
    kc, vc = torch.randn(4, Hkv, S, D, generator=g), torch.randn(4, Hkv, S, D, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    a = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    out = norm_linear_attend(x, nw, w, None, qw, kw, pos, slots, kc, vc, use_triton=False, **a)
    qkv = norm_linear(x, nw, w, eps=1e-6, use_triton=False)
    ref = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc2, vc2, use_triton=False, **a)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    q, s = quantize_weight_fp8(w)
    with pytest.raises(TypeError):
        norm_linear_attend(x, nw, q, None, qw, kw, pos, slots, kc, vc, use_triton=False, **a)


# ---------------------------------------------------------------- kernels vs fp32 reference


def _gen(seed):
    return torch.Generator(device=KDEV).manual_seed(seed)


def _linear_case(seed, M, K, N, dtype, fp8, gate_up=False):
    g = _gen(seed)
    rows = 2 * N if gate_up else N
    x = (torch.randn(M, K, device=KDEV, generator=g) * 2).to(dtype)
    w = torch.randn(rows, K, device=KDEV, generator=g) * K**-0.5
    w, s = quantize_weight_fp8(w) if fp8 else (w.to(dtype), None)
    w_ref = w if fp8 else w.float()  # the reference dequantises FP8 itself, in fp32
    return g, x, w, s, w_ref


_SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4}
_SPLIT2 = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2}
# (M, K, N, config): one row (GEMV), a few rows with K not a multiple of the tile, more than
# one 64-row tile; the per-shape plan, and a forced split-K (4 partials, last one reduces).
# The GEMV with _SPLIT2 and K = 200: a split of 4 K blocks, the last one partly past K, so
# the blocks loaded before the PDL wait (2) and the loop after them both run.
# _NARROW: a GEMV of 8-column tiles without split-K (plan's TTSBUILD_GEMV_NARROW form).
_NARROW = {"BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 128, "SPLIT_K": 1}
# _ROWS: several rows as GEMVs, a program per row (plan's TTSBUILD_GEMV_ROWS_F32 form), split-K
_ROWS = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}
CASES = [(1, 256, 64, None), (1, 256, 64, _SPLIT), (1, 200, 40, _SPLIT2), (5, 200, 40, _SPLIT),
         (70, 128, 32, None), (1, 256, 40, _NARROW), (3, 200, 40, _ROWS)]  # fmt: skip
PRECISIONS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]


def _tol(dtype):
    return BF16_TOL if dtype == torch.bfloat16 else 1e-5


def _config(split, M):
    return None if split is None else {**split, "BLOCK_M": 1 if M == 1 else split["BLOCK_M"]}


@needs_kernel
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
@pytest.mark.parametrize("M,K,N,split", CASES)
def test_norm_linear_kernel(M, K, N, dtype, fp8, split):
    g, x, w, s, w_ref = _linear_case(M + K + N, M, K, N, dtype, fp8)
    nw = (1 + 0.3 * torch.randn(K, device=KDEV, generator=g)).to(dtype)
    for out_dtype in (None, torch.float32):  # float32: the head's logits
        out = fused_linear(
            x, w, s, norm_weight=nw, eps=1e-6, out_dtype=out_dtype, use_triton=True,
            config=_config(split, M),
        )  # fmt: skip
        ref = fused_linear_reference(x.float(), w_ref, s, norm_weight=nw.float(), eps=1e-6)
        assert out.shape == (M, N) and out.dtype == (out_dtype or dtype)
        assert _rel(out, ref) < _tol(dtype)


@needs_kernel
@pytest.mark.parametrize("mode,K,N", [("norm", 2048, 64), ("residual", 768, 48),
                                      ("gate_up", 512, 32)])  # fmt: skip
def test_tile16_rule_kernel(mode, K, N, monkeypatch):
    """TTSBUILD_FUSED_TILE16's tiles (plan's split, then 256-wide K blocks where each split's K
    holds whole ones, else 32-column weight tiles) for a few rows of FP8 weights: the kernel
    on them against the fp32 reference, each epilogue; the plan takes the rule's K block
    where the split allows (2048 over 8 splits) and narrows the tile where not."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    monkeypatch.setattr(tl_fused_linear, "FUSED_TILE16", True)
    gate_up = mode == "gate_up"
    c = tl_fused_linear.plan(5, N, K, gate_up, 132)
    assert c["BLOCK_M"] == 16
    assert (c["BLOCK_K"], c["BLOCK_N"]) == ((256, 64) if mode == "norm" else (128, 32)), c
    g, x, w, s, w_ref = _linear_case(K + N, 5, K, N, torch.bfloat16, True, gate_up=gate_up)
    kw, ref_kw = {}, {}
    if mode == "residual":
        kw["residual"] = ref_kw["residual"] = torch.randn(5, N, device=KDEV, generator=g).to(
            torch.bfloat16)  # fmt: skip
        ref_kw["residual"] = ref_kw["residual"].float()
    else:
        nw = (1 + 0.3 * torch.randn(K, device=KDEV, generator=g)).bfloat16()
        kw.update(norm_weight=nw, eps=1e-6, gate_up=gate_up)
        ref_kw.update(norm_weight=nw.float(), eps=1e-6, gate_up=gate_up)
    out = fused_linear(x, w, s, use_triton=True, **kw)  # config None: plan's, under the rule
    ref = fused_linear_reference(x.float(), w_ref, s, **ref_kw)
    assert out.shape == (5, N) and _rel(out, ref) < _tol(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("mode,K,N", [("norm", 1024, 48), ("residual", 2048, 40),
                                      ("gate_up", 1024, 32)])  # fmt: skip
def test_gemv_rule_kernel(mode, K, N, monkeypatch):
    """TTSBUILD_FUSED_GEMV_RULE's one-row tiles (8 weight rows a program, whole 1024-wide K
    blocks, gate/up's at most 512, no split) on FP8 weights: the kernel on the config the plan
    gives (on a device of few SMs, so these small N fill its wave) against the fp32 reference,
    each epilogue."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    monkeypatch.setattr(tl_fused_linear, "FUSED_GEMV_RULE", True)
    gate_up = mode == "gate_up"
    c = tl_fused_linear.plan(1, N, K, gate_up, 4)
    assert (c["BLOCK_M"], c["BLOCK_N"], c["SPLIT_K"]) == (1, 8, 1)
    assert c["BLOCK_K"] == (512 if gate_up else 1024), c
    g, x, w, s, w_ref = _linear_case(K + N + 7, 1, K, N, torch.bfloat16, True, gate_up=gate_up)
    kw, ref_kw = {}, {}
    if mode == "residual":
        r = torch.randn(1, N, device=KDEV, generator=g).to(torch.bfloat16)
        kw["residual"], ref_kw["residual"] = r, r.float()
    else:
        nw = (1 + 0.3 * torch.randn(K, device=KDEV, generator=g)).bfloat16()
        kw.update(norm_weight=nw, eps=1e-6, gate_up=gate_up)
        ref_kw.update(norm_weight=nw.float(), eps=1e-6, gate_up=gate_up)
    out = fused_linear(x, w, s, use_triton=True, config=c, **kw)
    ref = fused_linear_reference(x.float(), w_ref, s, **ref_kw)
    assert out.shape == (1, N) and _rel(out, ref) < _tol(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("M,split", [(1, None), (1, _SPLIT2), (3, _ROWS)])
def test_scaled_half_weight_gemv_kernel(M, split):
    # the codec pre-transformer's fused layers with TR_HALF_WEIGHTS: fp32 activations, fp16
    # weights with per-row scales, as GEMVs (a program per row), norm + gate/up + SiLU and
    # linear + bias + residual; against the fp32 product with the dequantised weights
    K, N = 200, 40
    g = _gen(M + 101)
    x = torch.randn(M, K, device=KDEV, generator=g) * 2
    w = torch.randn(2 * N, K, device=KDEV, generator=g) * K**-0.5
    w[3] *= 1e-5  # a row a small folded scale shrank
    w16, s = scaled_half_weight(w)
    w_ref = w16.float() * s[:, None]
    nw = 1 + 0.3 * torch.randn(K, device=KDEV, generator=g)
    cfg = None if split is None else {**split, "BLOCK_M": 1}
    out = fused_linear(x, w16, s, norm_weight=nw, eps=1e-6, gate_up=True, use_triton=True,
                       config=cfg, gemv_rows_f32=M)  # fmt: skip
    ref = fused_linear_reference(x, w_ref, None, norm_weight=nw, eps=1e-6, gate_up=True)
    assert out.dtype == torch.float32 and _rel(out, ref) < 1e-5
    bias = torch.randn(2 * N, device=KDEV, generator=g)
    res = torch.randn(M, 2 * N, device=KDEV, generator=g) * 3
    out = fused_linear(x, w16, s, bias=bias, residual=res, use_triton=True, config=cfg,
                       gemv_rows_f32=M)  # fmt: skip
    ref = fused_linear_reference(x, w_ref, None, bias=bias, residual=res)
    assert _rel(out - res, ref - res) < 1e-5
    assert _rel(out[:, 3] - res[:, 3], ref[:, 3] - res[:, 3]) < 1e-5  # the small row kept


@needs_kernel
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
@pytest.mark.parametrize("M,K,N,split", CASES)
def test_norm_gate_up_silu_kernel(M, K, N, dtype, fp8, split):
    g, x, w, s, w_ref = _linear_case(7 + M + K + N, M, K, N, dtype, fp8, gate_up=True)
    nw = (1 + 0.3 * torch.randn(K, device=KDEV, generator=g)).to(dtype)
    out = fused_linear(
        x, w, s, norm_weight=nw, eps=1e-6, gate_up=True, use_triton=True,
        config=_config(split, M),
    )  # fmt: skip
    ref = fused_linear_reference(
        x.float(), w_ref, s, norm_weight=nw.float(), eps=1e-6, gate_up=True
    )
    assert out.shape == (M, N)
    assert _rel(out, ref) < _tol(dtype)
    # split-K leaves its counters reset: a second call gives the same bits
    again = fused_linear(
        x, w, s, norm_weight=nw, eps=1e-6, gate_up=True, use_triton=True,
        config=_config(split, M),
    )  # fmt: skip
    assert torch.equal(again, out)


@needs_kernel
@pytest.mark.parametrize("ready", [False, True])
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
@pytest.mark.parametrize("M,K,N,split", CASES)
def test_linear_residual_kernel(M, K, N, dtype, fp8, split, ready):
    # ready: the residual is read with the weights, before the PDL wait (the interpreter
    # always takes that path when asked; a GPU takes it under PDL)
    g, x, w, s, w_ref = _linear_case(11 + M + K + N, M, K, N, dtype, fp8)
    res = (torch.randn(M, N, device=KDEV, generator=g) * 3).to(dtype)
    out = fused_linear(x, w, s, residual=res, use_triton=True, config=_config(split, M),
                       residual_ready=ready)  # fmt: skip
    ref = fused_linear_reference(x.float(), w_ref, s, residual=res.float())
    assert _rel(out, ref) < _tol(dtype)
    # the delta alone (what the kernel adds to the residual) is accurate too
    assert _rel(out.float() - res.float(), ref - res.float()) < 3 * _tol(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype,fp8", PRECISIONS)
@pytest.mark.parametrize("M", [1, 6, 64])
def test_gather_linear_kernel(M, dtype, fp8):
    K, N, V = 128, 80, 50
    g, _, w, s, w_ref = _linear_case(13 + M, 1, K, N, dtype, fp8)
    table = torch.randn(V, K, device=KDEV, generator=g).to(dtype)
    idx = torch.randint(0, V, (M,), device=KDEV, generator=g)
    bias = (0.5 * torch.randn(N, device=KDEV, generator=g)).to(dtype)
    out = fused_linear(table, w, s, index=idx, bias=bias, use_triton=True)
    ref = fused_linear_reference(table.float(), w_ref, s, index=idx, bias=bias.float())
    assert _rel(out, ref) < _tol(dtype)
    # a strided index (a column of a [M, 2] code tensor) picks the same rows
    codes = torch.stack([idx, torch.randint(0, V, (M,), device=KDEV, generator=g)], dim=1)
    strided = fused_linear(table, w, s, index=codes[:, 0], bias=bias, use_triton=True)
    assert codes[:, 0].stride(0) == 2 and torch.equal(strided, out)


def _attend_case(g, R, S, dtype, tokens=1):
    """Fresh random inputs of qk_norm_rope_attend: qkv [tokens * R, ...], its q/k norm
    weights, R distinct slots of R + 3, K/V caches of random values (every entry: a stale
    read shows), the head counts."""
    Hq, Hkv, D, n_slots = 4, 2, 32, R + 3
    qkv = torch.randn(tokens * R, (Hq + 2 * Hkv) * D, device=KDEV, generator=g).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=KDEV, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=KDEV, generator=g)).to(dtype)
    slots = torch.randperm(n_slots, device=KDEV, generator=g)[:R]
    kc = torch.randn(n_slots, Hkv, S, D, device=KDEV, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, device=KDEV, generator=g).to(dtype)
    return qkv, qw, kw, slots, kc, vc, dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,S", [(1, 16), (6, 16), (5, 17)])
@pytest.mark.parametrize("ready", [False, True])  # True: positions, slots, cache read early
def test_qk_norm_rope_attend_kernel(R, S, dtype, ready):
    g = _gen(R * 31 + S)
    qkv, qw, kw, slots, kc, vc, a = _attend_case(g, R, S, dtype)
    n_slots, Hq, D = kc.shape[0], a["num_heads"], kc.shape[-1]
    pos = torch.randint(0, S, (R,), device=KDEV, generator=g)
    pos[0] = S - 1  # the last position, and (below) the first: attends to itself only
    if R > 1:
        pos[1] = 0
    kc_ref, vc_ref = kc.float(), vc.float()
    out = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc, vc, use_triton=True,
                              inputs_ready=ready, **a)  # fmt: skip
    ref = qk_norm_rope_attend_reference(
        qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref, vc_ref, **a
    )
    tol = _tol(dtype)
    assert out.shape == (R, Hq * D) and out.dtype == dtype
    assert _rel(out, ref) < tol
    assert _rel(kc[slots, :, pos], kc_ref[slots, :, pos]) < tol
    assert torch.equal(vc[slots, :, pos].float(), vc_ref[slots, :, pos])
    untouched = torch.ones(n_slots, S, dtype=torch.bool, device=KDEV)
    untouched[slots, pos] = False
    assert torch.equal(kc.float().transpose(1, 2)[untouched], kc_ref.transpose(1, 2)[untouched])
    assert torch.equal(vc.float().transpose(1, 2)[untouched], vc_ref.transpose(1, 2)[untouched])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S", [(1, 16), (5, 17)])
@pytest.mark.parametrize("ready", [False, True])
@pytest.mark.parametrize("tokens,parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_qk_norm_rope_attend_tokens_kernel(B, S, dtype, ready, tokens, parallel, monkeypatch):
    """tokens > 1 (the code predictor's two-token first pass, the speculative verify's
    k + 1): token t of each row attends over the entries tokens 0..t-1 wrote in the same
    launch, not the stale ones the cache held (random here, as every other entry); in turn
    in one program per row, or (parallel) one program per token."""
    from ttsbuild.plugins._tl import qk_norm_rope_attend as tl_attend

    monkeypatch.setattr(tl_attend, "TOKENS_PARALLEL", parallel)
    g = _gen(B * 37 + S + tokens)
    qkv, qw, kw, slots, kc, vc, a = _attend_case(g, B, S, dtype, tokens=tokens)
    Hq, D = a["num_heads"], kc.shape[-1]
    pos = torch.randint(0, S - tokens + 1, (B,), device=KDEV, generator=g)
    pos[0] = 0  # the frame's first pass: positions 0, 1, ...
    if B > 1:
        pos[1] = S - tokens  # the cache's last positions
    kc_ref, vc_ref = kc.float(), vc.float()
    out = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc, vc, use_triton=True,
                              inputs_ready=ready, tokens=tokens, **a)  # fmt: skip
    ref = qk_norm_rope_attend(qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref, vc_ref,
                              use_triton=False, tokens=tokens, **a)  # fmt: skip
    tol = _tol(dtype)
    assert out.shape == (tokens * B, Hq * D) and _rel(out, ref) < tol
    for t in range(1, tokens):  # each later token on its own (token 0's error cannot hide it)
        assert _rel(out[t * B : (t + 1) * B], ref[t * B : (t + 1) * B]) < tol
    assert _rel(kc.float(), kc_ref) < tol and _rel(vc.float(), vc_ref) < tol


# The qkv GEMV's tiles: the per-shape plan; split-K (the last split of a tile counts it toward
# its KV group); tiles wider than a head (narrowed to the head, so each counts toward one
# group). A GEMV (one row) takes BLOCK_M 1 (_config).
ATTEND_CONFIGS = [None, _SPLIT, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1}]
# one row, and the most rows the switch takes; under the interpreter each (tiles, rows) pair
# once and each (rows, precision) pair once
_F32, _BF16, _FP8 = PRECISIONS
_ATTEND_CASES = kernel_cases(
    [(R, *p, c) for c in ATTEND_CONFIGS for R in (1, 8) for p in PRECISIONS]
    + [(3, *p, _ROWS) for p in PRECISIONS],
    [(R, *p, ATTEND_CONFIGS[c]) for c, R, p in [(0, 1, _F32), (0, 8, _FP8), (1, 1, _BF16),
                                                (1, 8, _F32), (2, 1, _FP8), (2, 8, _BF16)]]
    + [(3, *_BF16, _ROWS)],  # several rows as GEMVs (fused_linear's GEMV_FEW_ROWS form)
)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("R,dtype,fp8,config", _ATTEND_CASES)
def test_norm_linear_attend_kernel(R, dtype, fp8, config):
    Hq, Hkv, D, S, K, n_slots = 4, 2, 32, 17, 128, R + 3
    g, x, w, s, w_ref = _linear_case(R * 37 + 3, R, K, (Hq + 2 * Hkv) * D, dtype, fp8)
    nw = (1 + 0.3 * torch.randn(K, device=KDEV, generator=g)).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=KDEV, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=KDEV, generator=g)).to(dtype)
    # per row: the last position, the first (attends to itself only), the middle, random
    pos = torch.randint(0, S, (R,), device=KDEV, generator=g)
    pos[: min(R, 3)] = torch.tensor([S - 1, 0, S // 2], device=KDEV)[: min(R, 3)]
    slots = torch.randperm(n_slots, device=KDEV, generator=g)[:R]  # slot != row
    kc = torch.randn(n_slots, Hkv, S, D, device=KDEV, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, device=KDEV, generator=g).to(dtype)
    kc_two, vc_two = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.float().cpu().clone(), vc.float().cpu().clone()  # never aliases kc
    a = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    cfg = _config(config, R)
    out = norm_linear_attend(x, nw, w, s, qw, kw, pos, slots, kc, vc, use_triton=True,
                             config=cfg, **a)  # fmt: skip
    qkv_ref = fused_linear_reference(x.float(), w_ref, s, norm_weight=nw.float(), eps=1e-6)
    ref = qk_norm_rope_attend_reference(
        qkv_ref.cpu(), qw.float().cpu(), kw.float().cpu(), pos.cpu(), slots.cpu(), kc_ref,
        vc_ref, **a,
    )  # fmt: skip
    tol = _tol(dtype)
    assert out.shape == (R, Hq * D) and out.dtype == dtype
    assert _rel(out.cpu(), ref) < tol
    assert _rel(kc.cpu(), kc_ref) < tol and _rel(vc.cpu(), vc_ref) < tol
    # the two kernels it fuses (their GEMV on the same tiles, narrowed to a head as the fused
    # one narrows them): the same bits, the same cache entries
    if cfg is not None:
        cfg = {**cfg, "BLOCK_N": min(cfg["BLOCK_N"], D)}
    qkv = fused_linear(x, w, s, norm_weight=nw, eps=1e-6, use_triton=True, config=cfg)
    two = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc_two, vc_two, use_triton=True, **a)
    assert torch.equal(out, two) and torch.equal(kc, kc_two) and torch.equal(vc, vc_two)
    # the arrival counters were reset: a second call gives the same bits (it rewrites the
    # same cache entries and reads the same older ones)
    again = norm_linear_attend(x, nw, w, s, qw, kw, pos, slots, kc, vc, use_triton=True,
                               config=_config(config, R), **a)  # fmt: skip
    assert torch.equal(again, out) and torch.equal(kc, kc_two) and torch.equal(vc, vc_two)


@needs_kernel
@pytest.mark.parametrize("dtype,fp8", kernel_cases(PRECISIONS, PRECISIONS[1:]))
@pytest.mark.parametrize("B,S,block_n", kernel_cases([(1, 16, None), (1, 17, 16), (5, 17, 16)],
                                                     [(1, 17, 16), (5, 17, 16)]))
@pytest.mark.parametrize("ready", [False, True])  # True: positions, slots, cache, residual early
def test_attend_o_residual_kernel(B, S, block_n, dtype, fp8, ready):
    """The attention and the o projection + residual in one launch (split-K over the KV
    groups, N tiles past N masked) against the fp32 reference; the caches as the attention
    kernel alone writes them (bits); a second call the same bits (counters reset)."""
    g = _gen(B * 41 + S)
    qkv, qw, kw, slots, kc, vc, a = _attend_case(g, B, S, dtype)
    Hq, D, N = a["num_heads"], kc.shape[-1], 40
    w = torch.randn(N, Hq * D, device=KDEV, generator=g) * (Hq * D) ** -0.5
    w, s = quantize_weight_fp8(w) if fp8 else (w.to(dtype), None)
    w_ref = w if fp8 else w.float()
    res = torch.randn(B, N, device=KDEV, generator=g).to(dtype)
    pos = torch.randint(0, S, (B,), device=KDEV, generator=g)
    pos[0] = S - 1
    if B > 1:
        pos[1] = 0  # attends to itself only
    kc_two, vc_two = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.float().cpu().clone(), vc.float().cpu().clone()
    out = attend_o_residual(qkv, qw, kw, pos, slots, kc, vc, w, s, res, use_triton=True,
                            inputs_ready=ready, residual_ready=ready, block_n=block_n, **a)
    attn_ref = qk_norm_rope_attend_reference(qkv.float().cpu(), qw.float().cpu(),
                                             kw.float().cpu(), pos.cpu(), slots.cpu(), kc_ref,
                                             vc_ref, **a)  # fmt: skip
    ref = fused_linear_reference(attn_ref.to(dtype).float(), w_ref.cpu(), None if s is None
                                 else s.cpu(), residual=res.float().cpu())  # fmt: skip
    assert out.shape == (B, N) and out.dtype == dtype
    assert _rel(out.cpu(), ref) < _tol(dtype)
    attn = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc_two, vc_two, use_triton=True, **a)
    assert torch.equal(kc, kc_two) and torch.equal(vc, vc_two)
    two = linear_residual(attn, w, s, res, use_triton=True)
    assert _rel(out, two) < _tol(dtype)
    again = attend_o_residual(qkv, qw, kw, pos, slots, kc, vc, w, s, res, use_triton=True,
                              inputs_ready=ready, residual_ready=ready, block_n=block_n, **a)
    assert torch.equal(again, out) and torch.equal(kc, kc_two)


def test_attend_o_residual_reference_is_the_two_ops():
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, 8 * 32, generator=g)
    qw, kw = 1 + 0.2 * torch.randn(32, generator=g), 1 + 0.2 * torch.randn(32, generator=g)
    kc, vc = torch.randn(5, 2, 16, 32, generator=g), torch.randn(5, 2, 16, 32, generator=g)
    w, res = torch.randn(24, 4 * 32, generator=g), torch.randn(3, 24, generator=g)
    pos, slots = torch.tensor([3, 0, 15]), torch.tensor([4, 1, 2])
    a = dict(num_heads=4, num_kv_heads=2, eps=1e-6, theta=1e6)
    kc2, vc2 = kc.clone(), vc.clone()
    out = attend_o_residual(qkv, qw, kw, pos, slots, kc, vc, w, None, res, use_triton=False,
                            **a)  # fmt: skip
    attn = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc2, vc2, use_triton=False, **a)
    assert torch.equal(out, res + F.linear(attn, w))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="one token per row"):
        attend_o_residual(qkv[:2], qw, kw, pos, slots, kc, vc, w, None, res[:2], **a)
    with pytest.raises(TypeError, match="FP8"):
        attend_o_residual(qkv, qw, kw, pos, slots, kc, vc, w, torch.ones(24), res, **a)


SHARDS = 2


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON or torch.cuda.is_available() or interpret_mode(),
    reason="runs the kernel tests under the interpreter on CPU-only machines with triton",
)
def test_kernels_under_the_interpreter():
    # two shards at once (TTSBUILD_TEST_SHARD, tests/conftest.py): this process only waits,
    # so a 2-core CI machine runs them side by side
    tests = Path(__file__).parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
           str(tests / "runtime" / "test_cp_fused.py"),
           str(tests / "plugins" / "test_slot_writes.py"),
           str(tests / "plugins" / "test_kv_copy.py"),
           str(tests / "plugins" / "test_kv_fp8.py"),
           str(tests / "plugins" / "test_qk_decode_attention.py"),
           str(tests / "plugins" / "test_spec_accept.py"),
           str(tests / "plugins" / "test_spec_round.py"),
           str(tests / "plugins" / "test_convnext.py"),
           str(tests / "plugins" / "test_prompt_embed.py"),
           str(tests / "runtime" / "test_graph_engine.py"),
           "-k", "kernel and not interpreter"]  # fmt: skip
    shards = [
        subprocess.Popen(cmd, env={**os.environ, "TRITON_INTERPRET": "1",
                                   "TTSBUILD_TEST_SHARD": f"{i}/{SHARDS}"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(SHARDS)
    ]  # fmt: skip
    for returncode, out, err in communicate_all(shards, timeout=900):
        assert returncode == 0, out[-4000:] + err[-2000:]
        last = out.splitlines()[-1]
        assert " passed" in last and "skipped" not in last and "deselected" in last, last


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_takes_the_weight_only_rule_for_17_to_64_half_rows_when_switched(monkeypatch):
    """TTSBUILD_FUSED_WO_RULE: half-precision tiles of 17-64 rows take `wo_config`'s tiles,
    warps and stages (the row tile stays plan's); 16 rows or fewer (split to a full wave, as
    the sweeps' winners there), fp32 activations and the default keep plan's own."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear
    from ttsbuild.plugins._tl.fp8_linear import wo_config

    plan = tl_fused_linear.plan
    base = {M: plan(M, 4096, 1024, False, 132) for M in (8, 16, 64)}
    assert all("num_warps" not in c for c in base.values())  # (default: _launch's 4 / 3)
    monkeypatch.setattr(tl_fused_linear, "FUSED_WO_RULE", True)
    for M, bm in ((17, 32), (40, 64), (64, 64)):
        for gate_up in (False, True):
            got = plan(M, 3072 if gate_up else 4096, 1024, gate_up, 132)
            assert got == {**wo_config(M, 3072 if gate_up else 4096, 1024, 132, gate_up),
                           "BLOCK_M": bm}  # fmt: skip
    assert plan(8, 4096, 1024, False, 132) == base[8]
    assert plan(16, 4096, 1024, False, 132) == base[16]
    # two-byte weights keep plan's tiles: the rule's 64 x 256 tiles of them outgrow shared
    # memory at 64 rows (the code predictor's bf16 input projection, 2048 -> 1024, crashed
    # the engine's capture on the H100); the launch decides by the weight's dtype
    bf16 = plan(64, 1024, 2048, False, 132, fp8_weight=False)
    assert "num_warps" not in bf16 and bf16["BLOCK_K"] == 128
    x = torch.randn(64, 2048).bfloat16()
    out = torch.empty(64, 1024).bfloat16()
    # (the GPU's launch: the interpreter's narrows the tiles it runs)
    monkeypatch.setattr(tl_fused_linear, "interpret_mode", lambda: False)
    for w, fp8 in ((torch.randn(1024, 2048).bfloat16(), False),
                   (torch.randn(1024, 2048).to(torch.float8_e4m3fn), True)):  # fmt: skip
        c = tl_fused_linear._launch(x, w, 64, 1024, 2048, False, None, out)[0]
        want = plan(64, 1024, 2048, False, tl_fused_linear._num_sms(x.device), fp8_weight=fp8)
        assert {k: c[k] for k in want} == want and (c["BLOCK_K"] == 256) == fp8, (fp8, c)
    fp32 = plan(32, 3072, 512, False, 132, fp32=True)  # the rule's K block would be 256
    assert "num_warps" not in fp32 and fp32["BLOCK_K"] == 128


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_takes_the_gemv_rule_for_one_row_when_switched(monkeypatch):
    """TTSBUILD_FUSED_GEMV_RULE: one half-precision row of FP8 weights takes the weight-only
    GEMV rule's tiles where its 8-row programs fill the SMs (the 1.7B talker's four linears
    and the code predictor's qkv, gate/up and head); narrower outputs (the code predictor's o
    and down), two rows, two-byte weights, fp32 activations and the default keep plan's own."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear
    from ttsbuild.plugins._tl.fp8_linear import wo_config

    plan = tl_fused_linear.plan
    talker = {"qkv": (2048, 4096, False), "o": (2048, 2048, False),
              "gate_up": (2048, 6144, True), "down": (6144, 2048, False)}  # fmt: skip
    cp = {"qkv": (1024, 4096, False), "o": (2048, 1024, False), "gate_up": (1024, 3072, True),
          "down": (3072, 1024, False), "head": (1024, 2048, False)}  # fmt: skip
    shapes = [*talker.values(), *cp.values()]
    base = {(K, N, gu, M): plan(M, N, K, gu, 132) for K, N, gu in shapes for M in (1, 2)}
    monkeypatch.setattr(tl_fused_linear, "FUSED_GEMV_RULE", True)
    for K, N, gate_up in shapes:
        c = plan(1, N, K, gate_up, 132)
        if N // 8 >= 132:
            want = wo_config(1, 2 * N if gate_up else N, K, 132)
            want["BLOCK_K"] = min(want["BLOCK_K"], 512) if gate_up else want["BLOCK_K"]
            assert c == {**want, "BLOCK_M": 1}, (K, N, c)
            assert c["BLOCK_N"] == 8 and c["SPLIT_K"] == 1 and c["num_warps"] == 4
        else:
            assert c == base[(K, N, gate_up, 1)], (K, N, c)
        assert plan(2, N, K, gate_up, 132) == base[(K, N, gate_up, 2)]
        assert plan(1, N, K, gate_up, 132, fp8_weight=False) == base[(K, N, gate_up, 1)]
        assert "num_warps" not in plan(1, N, K, gate_up, 132, fp32=True)
    ruled = [name for name, (K, N, gu) in cp.items()
             if plan(1, N, K, gu, 132) != base[(K, N, gu, 1)]]  # fmt: skip
    assert ruled == ["qkv", "gate_up", "head"]
    assert plan(1, 6144, 2048, True, 132)["BLOCK_K"] == 256  # the talker's gate/up: 12288 rows


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the plan imports it)")
def test_plan_takes_the_16_row_tile_rule_when_switched(monkeypatch):
    """TTSBUILD_FUSED_TILE16: the 1.7B code predictor's four fused linears in 16-row tiles (2-16
    rows) take the configs the H100 sweep timed best or within 4 % of it (qkv 64 x 256 split
    4, o 64 x 256 split 8, gate/up 32 x 128 split 4, down 32 x 128 split 8); one row (the
    GEMV), 17 rows and more, two-byte weights and the default keep plan's own."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused_linear

    plan = tl_fused_linear.plan
    shapes = {"qkv": (1024, 4096, False), "o": (2048, 1024, False),
              "gate_up": (1024, 3072, True), "down": (3072, 1024, False)}  # fmt: skip
    base = {(n, M): plan(M, N, K, gu, 132) for n, (K, N, gu) in shapes.items()
            for M in (1, 2, 16, 17)}  # fmt: skip
    monkeypatch.setattr(tl_fused_linear, "FUSED_TILE16", True)
    want = {"qkv": (64, 256, 4), "o": (64, 256, 8), "gate_up": (32, 128, 4), "down": (32, 128, 8)}
    for name, (K, N, gate_up) in shapes.items():
        for M in (2, 9, 16):
            c = plan(M, N, K, gate_up, 132)
            assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]) == (16, *want[name])
            assert plan(M, N, K, gate_up, 132, fp8_weight=False) == base[(name, 2)]
        assert plan(1, N, K, gate_up, 132) == base[(name, 1)]
        assert plan(17, N, K, gate_up, 132) == base[(name, 17)]
        assert base[(name, 16)] == base[(name, 2)] != plan(16, N, K, gate_up, 132)
