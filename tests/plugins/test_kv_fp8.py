"""The talker's FP8 KV cache (EnginePlan.talker_kv_fp8): e4m3 entries with a k and a v scale
per layer. The references quantise and dequantise as `quantize_kv` / `dequantize_kv`; the
Triton kernels (cache write, decode attention, the fused decode attention) against them on
fresh random inputs (on CUDA, or on CPU under TRITON_INTERPRET=1)."""

import os
import subprocess
import sys

import pytest
import torch
from kernel_device import KDEV, kernel_cases, needs_kernel

from ttsbuild.plugins.decode_attention import (
    decode_attention,
    decode_attention_reference,
)
from ttsbuild.plugins.qk_norm_rope import (
    KV_FP8_DTYPE,
    KV_FP8_MAX,
    dequantize_kv,
    kv_cache_scales,
    qk_norm_rope,
    qk_norm_rope_reference,
    quantize_kv,
)

HQ, HKV, D = 4, 2, 32
ATTN = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-6, theta=1e6)
# The interpreter rounds fp32 -> bf16 by truncation: a few biased roundings per output.
BF16_TOL = 1e-2 if KDEV == "cuda" else 4e-2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(seed: int, R: int, S: int, device, dtype=torch.bfloat16):
    """qkv, norm weights, positions, slots and a filled FP8 cache pair with its scales."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_slots = R + 2
    qkv = (torch.randn(R, (HQ + 2 * HKV) * D, device=device, generator=g) * 2).to(dtype)
    qw = (1 + 0.2 * torch.randn(D, device=device, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, device=device, generator=g)).to(dtype)
    pos = torch.randint(0, S, (R,), device=device, generator=g)
    pos[0] = S - 1
    slots = torch.randperm(n_slots, device=device, generator=g)[:R]
    # scales as calibration sets them: the cache's amax / 448 (k after its norm: ~|w| * 4)
    k_scale, v_scale = 6.0 / KV_FP8_MAX, 8.0 / KV_FP8_MAX
    k = torch.randn(n_slots, HKV, S, D, device=device, generator=g)
    v = torch.randn(n_slots, HKV, S, D, device=device, generator=g) * 2
    kc, vc = quantize_kv(k, k_scale, KV_FP8_DTYPE), quantize_kv(v, v_scale, KV_FP8_DTYPE)
    return qkv, qw, kw, pos, slots, kc, vc, k_scale, v_scale


def test_scales_are_checked():
    kc = torch.zeros(2, 1, 4, 8, dtype=KV_FP8_DTYPE)
    bf = torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16)
    assert kv_cache_scales(kc, kc, 0.5, 2.0) == (0.5, 2.0)
    assert kv_cache_scales(bf, bf, None, None) == (1.0, 1.0)
    for k_scale, v_scale in ((None, 1.0), (1.0, None), (0.0, 1.0), (1.0, float("inf")),
                             (-1.0, 1.0), (1.0, float("nan"))):  # fmt: skip
        with pytest.raises(ValueError, match="FP8 KV cache needs"):
            kv_cache_scales(kc, kc, k_scale, v_scale)
    with pytest.raises(ValueError, match="this cache is torch.bfloat16"):
        kv_cache_scales(bf, bf, 1.0, 1.0)
    with pytest.raises(ValueError, match="differ in dtype"):
        kv_cache_scales(kc, bf, 1.0, 1.0)
    # the ops refuse an FP8 cache without its scales before computing anything
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="FP8 KV cache needs"):
        decode_attention(q, kc, kc, torch.tensor([0]), torch.tensor([3]), use_triton=False)


def test_quantize_dequantize():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4096, generator=g) * 3
    scale = float(x.abs().max()) / KV_FP8_MAX
    q = quantize_kv(x, scale, KV_FP8_DTYPE)
    assert q.dtype == KV_FP8_DTYPE
    back = dequantize_kv(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: every normal value within 2^-4 relative
    normal = x.abs() > 2**-6 * scale
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2**-4 + 1e-12).all()
    assert 1e-3 < _rel(back, x) < 4e-2
    # past the range: clamped to +-448 (no NaN); a floating cache is a plain cast
    big = dequantize_kv(quantize_kv(torch.tensor([1e6, -1e6]), 1.0, KV_FP8_DTYPE), 1.0,
                        torch.float32)  # fmt: skip
    assert big.tolist() == [KV_FP8_MAX, -KV_FP8_MAX]
    assert torch.equal(quantize_kv(x, 1.0, torch.bfloat16), x.to(torch.bfloat16))


def test_reference_attention_tracks_the_exact_cache():
    """The FP8 cache read back through its scales stays close to the exact cache; a scale
    far too small (everything clamped) does not: the comparison can fail."""
    g = torch.Generator().manual_seed(5)
    R, S = 3, 50
    q = torch.randn(R, HQ, D, generator=g)
    k = torch.randn(R, HKV, S, D, generator=g)
    v = torch.randn(R, HKV, S, D, generator=g)
    slots, lengths = torch.arange(R), torch.tensor([S, 7, 30])
    exact = decode_attention_reference(q, k, v, slots, lengths)
    for ks, vs, ok in ((k.abs().max() / KV_FP8_MAX, v.abs().max() / KV_FP8_MAX, True),
                       (1e-3, 1e-3, False)):  # fmt: skip
        ks, vs = float(ks), float(vs)
        kc, vc = quantize_kv(k, ks, KV_FP8_DTYPE), quantize_kv(v, vs, KV_FP8_DTYPE)
        out = decode_attention_reference(q, kc, vc, slots, lengths, k_scale=ks, v_scale=vs)
        assert (_rel(out, exact) < 0.05) == ok, (ks, _rel(out, exact))


def test_reference_write_quantises_the_models_rounding():
    qkv, qw, kw, pos, slots, kc, vc, ks, vs = _inputs(3, 3, 20, "cpu")
    kb = torch.zeros(kc.shape, dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    q8 = qk_norm_rope_reference(qkv, qw, kw, pos, slots, kc, vc, **ATTN, k_scale=ks, v_scale=vs)
    qb = qk_norm_rope_reference(qkv, qw, kw, pos, slots, kb, vb, **ATTN)
    assert torch.equal(q8, qb)  # q does not touch the cache
    for c8, cb, s in ((kc, kb, ks), (vc, vb, vs)):
        written = c8[slots, :, pos]
        assert torch.equal(written.view(torch.uint8),
                           quantize_kv(cb[slots, :, pos], s, KV_FP8_DTYPE).view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize("R,S", kernel_cases([(1, 16), (3, 40), (8, 70)], [(1, 16), (3, 40)]))
def test_cache_write_kernel(R, S):
    qkv, qw, kw, pos, slots, kc, vc, ks, vs = _inputs(R + S, R, S, KDEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = qk_norm_rope(qkv, qw, kw, pos, slots, kc, vc, **ATTN, k_scale=ks, v_scale=vs,
                     use_triton=True)  # fmt: skip
    # reference from fp32 inputs: the kernel computes k in fp32 and rounds once, to e4m3
    q_ref = qk_norm_rope_reference(qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref,
                                   vc_ref, **ATTN, k_scale=ks, v_scale=vs)  # fmt: skip
    assert _rel(q, q_ref) < BF16_TOL
    for c, c_ref, s in ((kc, kc_ref, ks), (vc, vc_ref, vs)):
        got, want = c[slots, :, pos], c_ref[slots, :, pos]
        same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
        assert same > 0.97, same  # (a tie or an fp32 ulp may round the other way)
        f32 = torch.float32
        assert _rel(dequantize_kv(got, s, f32), dequantize_kv(want, s, f32)) < 1e-2
        untouched = torch.ones(R + 2, S, dtype=torch.bool, device=KDEV)
        untouched[slots, pos] = False
        assert torch.equal(c.view(torch.uint8).transpose(1, 2)[untouched],
                           c_ref.view(torch.uint8).transpose(1, 2)[untouched])


def test_dynamic_splits_and_f16_choices():
    """dynamic_chunk: True / False as given, "auto" only where a launch has several splits
    (one split holds the row's whole length either way), None the module's default; anything
    else is refused. f16_dot likewise, for bf16 / fp16 activations only."""
    from ttsbuild.plugins._tl import decode_attention as da

    assert da.dynamic_for(True, 1) and not da.dynamic_for(False, 8)
    assert da.dynamic_for("auto", 3) and not da.dynamic_for("auto", 1)
    assert da.dynamic_for(None, 3) == da.dynamic_for(da.DYNAMIC_CHUNK, 3)
    with pytest.raises(ValueError, match="dynamic_chunk"):
        da.dynamic_for("yes", 3)
    # the default (no TTSBUILD_ATTN_DYNAMIC_CHUNK) is "auto"; a bad value fails the import
    code = "import ttsbuild.plugins._tl.decode_attention as d; print(d.DYNAMIC_CHUNK)"
    env = {k: v for k, v in os.environ.items() if k != "TTSBUILD_ATTN_DYNAMIC_CHUNK"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["auto"], out.stderr
    env["TTSBUILD_ATTN_DYNAMIC_CHUNK"] = "yes"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TTSBUILD_ATTN_DYNAMIC_CHUNK" in out.stderr
    # fp16 dots as asked, for 16-bit activations only (an fp32 engine keeps fp32 dots)
    assert da.f16_for(True, torch.bfloat16) and not da.f16_for(False, torch.bfloat16)
    assert not da.f16_for(True, torch.float32)
    assert da.f16_for(None, torch.bfloat16) == da.FP8_F16_DOT


@needs_kernel
@pytest.mark.parametrize("tiles", kernel_cases(
    [(128, 4, 2), (128, 8, 3), (32, 4, 4)], [(128, 4, 2), (32, 4, 4)]))
@pytest.mark.parametrize("fp8", [True, False])
def test_decode_attention_kernel_tiles(tiles, fp8):
    """The split kernel's other long-cache tiles (kv_fp8_attention.py --tiles sweeps them)
    against the reference, on an FP8 and a bf16 cache, split and not, the splits dividing
    the capacity or each row's length (dynamic_chunk; rows of 300, 97 and a block + 1)."""
    from ttsbuild.plugins._tl.decode_attention import decode_attention_triton

    R, S = 3, 300
    _, _, _, _, slots, kc, vc, ks, vs = _inputs(7 + tiles[0], R, S, KDEV)
    kv = dict(k_scale=ks, v_scale=vs)
    if not fp8:
        bf16 = torch.bfloat16
        kc, vc, kv = dequantize_kv(kc, ks, bf16), dequantize_kv(vc, vs, bf16), {}
    g = torch.Generator(device=KDEV).manual_seed(tiles[0])
    q = torch.randn(R, HQ, D, device=KDEV, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([S, 97, 1 + tiles[0]], device=KDEV)
    ref = decode_attention_reference(q.float(), kc, vc, slots, lengths, S, **kv)
    for splits, dynamic in ((1, False), (3, False), (3, True), (7, True)):
        out = decode_attention_triton(q, kc, vc, slots, lengths, S, splits=splits, tiles=tiles,
                                      dynamic_chunk=dynamic, **kv)  # fmt: skip
        assert _rel(out, ref) < BF16_TOL, (splits, dynamic, _rel(out, ref))


@needs_kernel
@pytest.mark.parametrize("R,S,splits", kernel_cases(
    [(1, 16, None), (2, 100, 1), (3, 150, 3), (8, 300, None)], [(2, 100, 1), (3, 150, 3)]))
def test_decode_attention_kernel(R, S, splits):
    from ttsbuild.plugins._tl.decode_attention import decode_attention_triton

    _, _, _, _, slots, kc, vc, ks, vs = _inputs(R * 3 + S, R, S, KDEV)
    g = torch.Generator(device=KDEV).manual_seed(S)
    q = torch.randn(R, HQ, D, device=KDEV, generator=g).to(torch.bfloat16)
    lengths = torch.randint(1, S + 1, (R,), device=KDEV, generator=g)
    lengths[0] = S
    ref = decode_attention_reference(q.float(), kc, vc, slots, lengths, S, k_scale=ks, v_scale=vs)
    for f16 in (True, False):  # the dots in fp16 (FP8_F16_DOT) or bf16
        out = decode_attention_triton(q, kc, vc, slots, lengths, S, splits=splits, k_scale=ks,
                                      v_scale=vs, f16_dot=f16)  # fmt: skip
        assert out.dtype == torch.bfloat16
        assert _rel(out, ref) < BF16_TOL, f16
    # the same cache read without its v scale is far off (the scale is applied)
    wrong = decode_attention_reference(q.float(), kc, vc, slots, lengths, S, k_scale=ks,
                                       v_scale=vs * 2)  # fmt: skip
    assert _rel(out, wrong) > 0.3


@needs_kernel
@pytest.mark.parametrize("R,S,splits", kernel_cases(
    [(1, 16, None), (3, 100, 1), (5, 300, 3), (2, 120, 3), (2, 300, 7)],
    [(3, 100, 1), (2, 120, 3)]))
def test_fused_decode_attention_kernel(R, S, splits):
    from ttsbuild.plugins._tl.decode_attention import qk_norm_rope_decode_attention_triton
    from ttsbuild.plugins.qk_norm_rope import inv_freq

    qkv, qw, kw, pos, slots, kc, vc, ks, vs = _inputs(R * 5 + S, R, S, KDEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    a = {k: v for k, v in ATTN.items() if k != "theta"}
    q = qk_norm_rope_reference(qkv.float(), qw.float(), kw.float(), pos, slots, kc_ref, vc_ref,
                               **ATTN, k_scale=ks, v_scale=vs)  # fmt: skip
    ref = decode_attention_reference(q, kc_ref, vc_ref, slots, pos + 1, S, k_scale=ks,
                                     v_scale=vs).reshape(R, -1)  # fmt: skip
    kc0, vc0 = kc.clone(), vc.clone()
    for f16 in (True, False):  # the dots in fp16 (FP8_F16_DOT) or bf16, on the same caches
        kc.copy_(kc0)
        vc.copy_(vc0)
        out = qk_norm_rope_decode_attention_triton(
            qkv, qw, kw, inv_freq(D, ATTN["theta"], qkv.device), pos, slots, kc, vc, S,
            scale=D**-0.5, splits=splits, k_scale=ks, v_scale=vs, f16_dot=f16, **a,
        )  # fmt: skip
        assert _rel(out, ref) < BF16_TOL, f16
    for c, c_ref in ((kc, kc_ref), (vc, vc_ref)):
        same = (c.view(torch.uint8) == c_ref.view(torch.uint8)).float().mean().item()
        assert same > 0.99, same
