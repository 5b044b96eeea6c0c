"""The fused decode kernels at the 1.7B code predictor's and talker's shapes, with the
per-shape plans (split-K up to 8) they run with (GPU only; the same kernels are checked on
small shapes under the interpreter in test_fused_kernels.py)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
triton = pytest.importorskip("triton")

from ttsbuild.plugins.fp8_linear import quantize_weight_fp8  # noqa: E402
from ttsbuild.plugins.fused_linear import fused_linear, fused_linear_reference  # noqa: E402
from ttsbuild.plugins.qk_norm_rope_attend import (  # noqa: E402
    qk_norm_rope_attend,
    qk_norm_rope_attend_reference,
)

DEV = "cuda"

# name: (K, N, mode); gate_up N is the intermediate size (the weight has 2N rows)
SHAPES = {
    "cp.qkv": (1024, 4096, "norm"),
    "cp.o": (2048, 1024, "residual"),
    "cp.gate_up": (1024, 3072, "gate_up"),
    "cp.down": (3072, 1024, "residual"),
    "cp.head": (1024, 2048, "head"),
    "cp.proj": (2048, 1024, "gather"),
    "talker.qkv": (2048, 4096, "norm"),
    "talker.gate_up": (2048, 6144, "gate_up"),
    "talker.down": (6144, 2048, "residual"),
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("M", [1, 3, 8, 32, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_linear_at_model_shapes(name, M, fp8):
    K, N, mode = SHAPES[name]
    g = torch.Generator(device=DEV).manual_seed(M * 7919 + N + K)
    rows = 2 * N if mode == "gate_up" else N
    w = torch.randn(rows, K, device=DEV, generator=g) * K**-0.5
    w, s = quantize_weight_fp8(w) if fp8 else (w.bfloat16(), None)
    w_ref = w if fp8 else w.float()
    x = (torch.randn(M, K, device=DEV, generator=g) * 2).bfloat16()
    kw, ref_kw = {}, {}
    if mode in ("norm", "gate_up", "head"):
        nw = (1 + 0.2 * torch.randn(K, device=DEV, generator=g)).bfloat16()
        kw = dict(norm_weight=nw, eps=1e-6, gate_up=mode == "gate_up")
        ref_kw = {**kw, "norm_weight": nw.float()}
    if mode == "head":
        kw["out_dtype"] = torch.float32
    if mode == "residual":
        res = (torch.randn(M, N, device=DEV, generator=g) * 3).bfloat16()
        kw, ref_kw = dict(residual=res), dict(residual=res.float())
    if mode == "gather":
        x = torch.randn(100, K, device=DEV, generator=g).bfloat16()
        idx = torch.randint(0, 100, (M,), device=DEV, generator=g)
        bias = (0.3 * torch.randn(N, device=DEV, generator=g)).bfloat16()
        kw = dict(index=idx, bias=bias)
        ref_kw = dict(index=idx, bias=bias.float())
    out = torch.full((M, N), float("nan"), device=DEV, dtype=kw.get("out_dtype", x.dtype))
    out.copy_(fused_linear(x, w, s, use_triton=True, **kw))
    ref = fused_linear_reference(x.float(), w_ref, s, **ref_kw)
    assert torch.isfinite(out).all()
    # within 1 % of fp32, or no worse than the unfused bf16 ops (gate_up rounds 5 times)
    eager = fused_linear_reference(x, w, s, **kw)
    assert _rel(out, ref) < max(1e-2, 1.5 * _rel(eager, ref))
    # twice: split-K counters reset, same bits (deterministic)
    assert torch.equal(fused_linear(x, w, s, use_triton=True, **kw), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_qk_norm_rope_attend_at_code_predictor_shapes(B, dtype):
    g = torch.Generator(device=DEV).manual_seed(B)
    Hq, Hkv, D, S, n_slots = 16, 8, 128, 16, B + 2
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=DEV, generator=g).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=DEV, generator=g)).to(dtype)
    pos = torch.randint(0, S, (B,), device=DEV, generator=g)
    pos[0] = 0
    slots = torch.randperm(n_slots, device=DEV, generator=g)[:B]
    kc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).to(dtype)
    vc = torch.randn(n_slots, Hkv, S, D, device=DEV, generator=g).to(dtype)
    kc_ref, vc_ref = kc.float(), vc.float()
    a = dict(num_heads=Hq, num_kv_heads=Hkv, eps=1e-6, theta=1e6)
    out = qk_norm_rope_attend(qkv, qw, kw, pos, slots, kc, vc, use_triton=True, **a)
    ref = qk_norm_rope_attend_reference(
        qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref, vc_ref, **a
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out, ref) < tol
    assert _rel(kc[slots, :, pos], kc_ref[slots, :, pos]) < tol
    assert torch.equal(vc.float(), vc_ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("name", ["cp.qkv", "cp.gate_up", "cp.down", "talker.down"])
def test_l2_ahead_changes_no_bit(name, fp8, monkeypatch):
    """TTSBUILD_PDL_L2_AHEAD: a program's weight tile brought into L2 before its PDL wait
    changes where the weights come from, never a value: the same bits as without, and the
    launch does take the path (a tile without split-K at one row)."""
    from ttsbuild.plugins._tl import fused_linear as tl_fused
    from ttsbuild.plugins._tl.fp8_linear import _num_sms

    K, N, mode = SHAPES[name]
    g = torch.Generator(device=DEV).manual_seed(N + K)
    rows = 2 * N if mode == "gate_up" else N
    w = torch.randn(rows, K, device=DEV, generator=g) * K**-0.5
    w, s = quantize_weight_fp8(w) if fp8 else (w.bfloat16(), None)
    x = (torch.randn(1, K, device=DEV, generator=g) * 2).bfloat16()
    kw = {}
    if mode in ("norm", "gate_up"):
        nw = (1 + 0.2 * torch.randn(K, device=DEV, generator=g)).bfloat16()
        kw = dict(norm_weight=nw, eps=1e-6, gate_up=mode == "gate_up")
    if mode == "residual":
        kw = dict(residual=(torch.randn(1, N, device=DEV, generator=g) * 3).bfloat16())
    config = tl_fused.plan(1, N, K, mode == "gate_up", _num_sms(x.device))
    config["SPLIT_K"] = 1  # (L2_AHEAD takes tiles without split-K)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(tl_fused, "L2_AHEAD", on)
        taken = tl_fused._l2_ahead(w, config, tl_fused.pdl_enabled(x))
        assert taken == on or not tl_fused.pdl_enabled(x)
        outs.append(fused_linear(x, w, s, config=config, **kw))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("gate_up", [False, True])
def test_fp8_linear_l2_ahead_changes_no_bit(rows, gate_up, monkeypatch):
    """The same switch for the FP8 tiles (`_tl.fp8_linear.L2_AHEAD`): the weight-only GEMV at
    one row and the W8A8 tiles at 32 rows, without split-K, give the same bits with it on."""
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8
    from ttsbuild.plugins.fp8_w8a8 import quantize_rows

    K, N = 2048, 2048
    g = torch.Generator(device=DEV).manual_seed(rows + 2 * gate_up)
    w, s = quantize_weight_fp8(torch.randn((2 if gate_up else 1) * N, K, device=DEV,
                                           generator=g) * K**-0.5)  # fmt: skip
    x = (torch.randn(rows, K, device=DEV, generator=g) * 2).bfloat16()
    config = {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    outs = []
    for on in (False, True):
        monkeypatch.setattr(tl_fp8, "L2_AHEAD", on)
        if rows == 1:
            outs.append(tl_fp8.fp8_linear_triton(x, w, s, config=config, gate_up=gate_up))
        else:
            xq, sx = quantize_rows(x)
            outs.append(tl_fp8.fp8_linear_a8_triton(xq, sx, w, s, config=config,
                                                    gate_up=gate_up))  # fmt: skip
    torch.cuda.synchronize()
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])
