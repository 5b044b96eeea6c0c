"""W8A8 (plugins.fp8_w8a8): per-row FP8 activation quantisation and the FP8 GEMM, against
float32 references on fresh random inputs. The CUDA GEMM (torch._scaled_mm) is checked here
through its CPU implementation: the scale convention the reference assumes (x ~= xq * sx per
row, w ~= wq * sw per output channel) is torch's."""

import os

import pytest
import torch
from kernel_device import KDEV, needs_kernel, record_fp8_launches

from ttsbuild.plugins import fp8_w8a8
from ttsbuild.plugins.fp8_linear import FP8_MAX, fp8_linear, quantize_weight_fp8
from ttsbuild.plugins.fp8_w8a8 import (
    fp8_linear_w8a8,
    fp8_linear_w8a8_reference,
    quantize_rows,
    quantize_rows_reference,
    w8a8_supported,
)
from ttsbuild.runtime.fast_model import Dense


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rows(seed, M, K, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device)
    # rows of very different magnitudes (one 50x larger) and a few outliers inside rows
    x[0] *= 50.0
    x[1, :3] *= 30.0
    return x


@pytest.mark.parametrize("M,K", [(16, 256), (48, 1000)])
def test_quantize_rows_reference_bounds(M, K):
    x = _rows(M + K, M, K)
    xq, s = quantize_rows_reference(x)
    assert xq.dtype == torch.float8_e4m3fn and s.shape == (M, 1)
    # each row's largest magnitude lands on 448, and the row decodes to within e4m3's rounding
    assert torch.equal(xq.float().abs().amax(dim=1), torch.full((M,), FP8_MAX))
    err = (xq.float() * s - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-9)  # normals; e4m3's subnormal step
    assert bool((err <= bound * 1.0001).all())
    # the big row does not cost the others their precision: per-row scales
    assert _rel(xq[2:].float() * s[2:], x[2:]) < 0.03
    zq, zs = quantize_rows_reference(torch.zeros(2, 32))
    assert bool((zq.float() == 0).all()) and bool((zs > 0).all())


def test_reference_matches_torch_scaled_mm_convention():
    M, K, N = 32, 256, 96
    x = _rows(5, M, K).bfloat16()
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(6)) * K**-0.5
    wq, ws = quantize_weight_fp8(w)
    xq, sx = quantize_rows_reference(x)
    # torch's GEMM where it runs in production (CUDA); on CPU only where the build takes
    # per-row scales (torch 2.13 does, 2.11's CPU path takes per-tensor scales only)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_mm = torch._scaled_mm(
            xq.to(dev),
            wq.t().to(dev),
            scale_a=sx.to(dev),
            scale_b=ws.reshape(1, -1).to(dev),
            out_dtype=torch.bfloat16,
        ).cpu()
    except RuntimeError as e:
        if dev == "cuda" or "per-tensor" not in str(e):
            raise
        pytest.skip(f"this torch's CPU _scaled_mm takes no per-row scales: {e}")
    ref = fp8_linear_w8a8_reference(x, wq, ws)
    assert _rel(torch_mm.float(), ref.float()) < 1e-2  # bf16 outputs of the same product
    # and a wrong convention (scales divided instead of multiplied) is far off
    wrong = (xq.float() / sx) @ (wq.float() / ws[:, None]).t()
    assert _rel(wrong, ref.float()) > 0.5


@pytest.mark.parametrize("M,K,N", [(16, 256, 64), (64, 512, 160)])
def test_w8a8_against_weight_only(M, K, N):
    x = _rows(M * 7 + N, M, K).bfloat16()
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * K**-0.5
    wq, ws = quantize_weight_fp8(w)
    out = fp8_linear_w8a8(x, wq, ws)
    exact = x.float() @ (wq.float() * ws[:, None]).t()  # the weight-only product in fp32
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert _rel(out.float(), exact) < 0.03  # e4m3 activations: ~1-2 % here
    assert _rel(out.float(), exact) > 1e-4  # it did quantise the activations


def test_dense_routes_by_rows(monkeypatch):
    K, N = 256, 64
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(9)) * K**-0.5
    d = Dense.make(w, fp8=True)
    big, small = _rows(1, 32, K).bfloat16(), _rows(2, 8, K).bfloat16()
    weight_only = fp8_linear(big, d.weight, d.scale)
    w8a8 = fp8_linear_w8a8(big, d.weight, d.scale)
    assert not torch.equal(weight_only, w8a8)  # the two paths are told apart below
    assert torch.equal(d(big), weight_only)  # off by default
    d.w8a8_min_rows = 16
    assert torch.equal(d(big), w8a8)
    assert torch.equal(d(small), fp8_linear(small, d.weight, d.scale))  # < 16 rows
    odd = _rows(3, 24, K).bfloat16()  # >= 16 rows, not a multiple of 16: the Triton tiles
    assert w8a8_supported(24, d.weight)  # take them (the default GEMM), cuBLASLt does not
    assert torch.equal(d(odd), fp8_linear_w8a8(odd, d.weight, d.scale))
    monkeypatch.setattr(fp8_w8a8, "W8A8_GEMM", "cublas")
    assert not w8a8_supported(24, d.weight)
    assert torch.equal(d(odd), fp8_linear(odd, d.weight, d.scale))


def test_gate_up_silu_routes_to_w8a8(monkeypatch):
    """With TTSBUILD_A8_GATE_UP_SILU a packed gate/up Dense at >= w8a8_min_rows rows takes the
    W8A8 product followed by silu(gate) * up (fused on CUDA; the reference product and
    `silu_mul` elsewhere); below, the weight-only product."""
    from ttsbuild.plugins.norm_act import silu_mul
    from ttsbuild.runtime import fast_model

    K, N = 256, 48
    w = torch.randn(2 * N, K, generator=torch.Generator().manual_seed(4)) * K**-0.5
    d = Dense.make(w, fp8=True)
    d.w8a8_min_rows = 16
    monkeypatch.setattr(fast_model, "A8_GATE_UP_SILU", True)
    big, small = _rows(5, 32, K).bfloat16(), _rows(6, 8, K).bfloat16()
    w8a8 = silu_mul(fp8_linear_w8a8_reference(big, d.weight, d.scale))
    weight_only = silu_mul(fp8_linear(big, d.weight, d.scale))
    assert not torch.equal(w8a8, weight_only)  # the two paths are told apart
    got = d.gate_up_silu(big)
    assert got.shape == (32, N) and torch.equal(got, w8a8)
    full = fp8_linear_w8a8_reference(big, d.weight, d.scale).double()
    assert _rel(got, torch.nn.functional.silu(full[:, :N]) * full[:, N:]) < 2e-2
    assert torch.equal(d.gate_up_silu(small), silu_mul(fp8_linear(small, d.weight, d.scale)))


def test_dense_bf16_copy_from_min_rows():
    K, N = 256, 64
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(10)) * K**-0.5
    d = Dense.make(w, fp8=True)
    held = d.nbytes()
    big, small = _rows(4, 16, K).bfloat16(), _rows(5, 15, K).bfloat16()
    before = d(big)
    d.keep_bf16(16)
    copy = (d.weight.float() * d.scale[:, None]).bfloat16()
    assert torch.equal(d.bf16_weight, copy)
    assert torch.equal(d(big), torch.nn.functional.linear(big, copy))  # >= 16 rows: the copy
    assert torch.equal(d(small), fp8_linear(small, d.weight, d.scale))  # fewer: FP8
    assert not torch.equal(d(big), before)  # the paths are told apart
    assert _rel(d(big).float(), before.float()) < 1e-2  # the same product, rounded otherwise
    assert d.nbytes() == held + N * K * 2 and d.read_bytes() == held
    d.keep_bf16(0)
    assert d.bf16_weight is None and torch.equal(d(big), before) and d.nbytes() == held
    plain = Dense.make(w.bfloat16(), fp8=False)
    plain.keep_bf16(16)  # a bf16 weight needs no copy
    assert plain.bf16_weight is None and plain.bf16_min_rows == 0


@needs_kernel
@pytest.mark.parametrize("M,K", [(3, 256), (16, 2048), (5, 1000)])
def test_quantize_rows_kernel(M, K):
    x = _rows(M + K, M, K, device=KDEV).bfloat16()
    q, s = quantize_rows(x, use_triton=True)
    rq, rs = quantize_rows_reference(x)
    assert torch.equal(s, rs)
    same = (q.float() == rq.float()).float().mean().item()
    assert same == 1.0
    assert _rel(q.float() * s, rq.float() * rs) < 1e-3


@pytest.mark.skipif(KDEV != "cuda", reason="needs a CUDA GPU (the FP8 GEMM)")
@pytest.mark.parametrize("M,K,N", [(32, 2048, 4096), (256, 6144, 2048), (64, 2048, 12288)])
def test_w8a8_gemm_on_gpu(M, K, N):
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    x = (torch.randn(M, K, device="cuda", generator=g) * 2).bfloat16()
    wq, ws = quantize_weight_fp8(torch.randn(N, K, device="cuda", generator=g) * K**-0.5)
    q, s = quantize_rows(x, use_triton=True)
    rq, rs = quantize_rows_reference(x)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
    out = fp8_linear_w8a8(x, wq, ws)
    assert _rel(out.float(), fp8_linear_w8a8_reference(x, wq, ws).float()) < 1e-2


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(5, 256, 192), (32, 512, 256), (100, 384, 128), (300, 256, 128)])
@pytest.mark.parametrize("split", [1, 2, None])  # None: the rule's config (a8_config)
@pytest.mark.parametrize("gate_up", [False, True])
def test_a8_tiles_against_float64(M, K, N, split, gate_up):
    """The Triton FP8 x FP8 tiles (A8) on quantised rows: the float64 product of the same
    FP8 operands and scales, rounded to bf16 once (and silu(gate) * up for gate_up)."""
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_a8_triton

    g = torch.Generator(device=KDEV).manual_seed(M * 7 + K + N + (split or 3))
    x = _rows(M + N, M, K, device=KDEV).bfloat16()
    rows = 2 * N if gate_up else N
    wq, ws = quantize_weight_fp8(torch.randn(rows, K, device=KDEV, generator=g) * K**-0.5)
    xq, sx = quantize_rows(x, use_triton=True)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split} if split else None
    out = fp8_linear_a8_triton(xq, sx, wq, ws, config=cfg, gate_up=gate_up)
    full = (xq.double() * sx.double()) @ (wq.double() * ws.double()[:, None]).t()
    if gate_up:  # gate, up and silu(gate) each rounded to bf16, as the unfused kernels round
        gate, up = (full[:, :N].bfloat16().double(), full[:, N:].bfloat16().double())
        full = torch.nn.functional.silu(gate).bfloat16().double() * up
    # gate_up rounds four times to bf16 (gate, up, silu, product): 2^-9 each, relative
    tol = 2e-2 if gate_up else 1e-2
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert _rel(out.float(), full) < tol
    # each row carries its own scale: the 50x row is not swamped, nor are the small ones
    for m in (0, 2, M - 1):
        assert _rel(out[m].float(), full[m]) < tol
    if gate_up:  # and the same as the unfused A8 product followed by silu_mul's rounding
        plain = fp8_linear_a8_triton(xq, sx, wq, ws, config=cfg).double()
        silu = torch.nn.functional.silu(plain[:, :N]).bfloat16().double()
        assert _rel(out.float(), silu * plain[:, N:]) < 6e-3


@needs_kernel
@pytest.mark.parametrize(
    ("M", "N", "block_m"), [(300, 128, 128), (300, 128, 256), (1030, 4096, None)]
)
def test_a8_tiles_take_a_wider_row_tile(M, N, block_m):
    """A config's BLOCK_M (the sweep's 256-row tiles): 300 rows over two or three row tiles;
    None: the rule's own config at 1030 rows of a wide N (BLOCK_M 256 over five row tiles).
    The last tile partial, against the float64 product of the same FP8 operands."""
    from ttsbuild.plugins._tl.fp8_linear import a8_config, fp8_linear_a8_triton

    K = 256
    if block_m is None:
        cfg = a8_config(M, N, K)
        assert cfg["BLOCK_M"] == 256
    else:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "BLOCK_M": block_m}
    g = torch.Generator(device=KDEV).manual_seed(M + N + (block_m or 0))
    x = _rows(N + (block_m or 3), M, K, device=KDEV).bfloat16()
    wq, ws = quantize_weight_fp8(torch.randn(N, K, device=KDEV, generator=g) * K**-0.5)
    xq, sx = quantize_rows(x, use_triton=True)
    out = fp8_linear_a8_triton(xq, sx, wq, ws, config=cfg)
    full = (xq.double() * sx.double()) @ (wq.double() * ws.double()[:, None]).t()
    assert out.shape == (M, N) and _rel(out.float(), full) < 1e-2
    assert _rel(out[-6:].float(), full[-6:]) < 1e-2  # the partial last tile's rows


def test_a8_rule_from_eight_row_tiles():
    """a8_config from 1024 rows (eight 128-row tiles): 128 x 128 weight tiles, K blocks of
    128, 8 warps, no split, and 256-row activation tiles (BLOCK_M) for N >= 4096 only, not for
    gate_up's two weight tiles; below, no BLOCK_M."""
    from ttsbuild.plugins._tl.fp8_linear import _A8_SMEM, a8_config

    qkv = a8_config(1024, 4096, 2048)
    assert qkv == {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8,
                   "num_stages": 4, "BLOCK_M": 256}  # fmt: skip
    down = a8_config(2048, 2048, 6144)
    assert "BLOCK_M" not in down and (down["BLOCK_N"], down["SPLIT_K"]) == (128, 1)
    # gate_up's two weight tiles keep the many-row rule (the branch's two 128 x 256
    # accumulators doubled the engine's 1024-row prefill on the H200)
    gate_up = a8_config(1024, 6144, 2048, gate_up=True)
    assert gate_up == a8_config(512, 6144, 2048, gate_up=True) and "BLOCK_M" not in gate_up
    assert gate_up["BLOCK_N"] == 64
    assert (
        gate_up["num_stages"] * (2 * 64 * gate_up["BLOCK_K"] + gate_up["BLOCK_K"] * 128) <= _A8_SMEM
    )
    for m in (16, 128, 256, 896):  # up to seven row tiles
        assert "BLOCK_M" not in a8_config(m, 4096, 2048)
    assert a8_config(896, 4096, 2048)["BLOCK_N"] == 64 and "BLOCK_M" in a8_config(897, 4096, 2048)


def test_a8_row_tile_is_refused_on_the_weight_only_kernel():
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton

    wq, ws = quantize_weight_fp8(torch.randn(64, 128))
    with pytest.raises(ValueError, match="BLOCK_M 256 is for the A8 tiles"):
        fp8_linear_triton(
            torch.randn(4, 128).bfloat16(),
            wq,
            ws,
            config={"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "BLOCK_M": 256},
        )


def test_a8_rejects_mismatched_operands():
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_a8_triton

    wq, ws = quantize_weight_fp8(torch.randn(64, 128))
    x = torch.randn(4, 128)
    with pytest.raises(TypeError, match="FP8 rows"):
        fp8_linear_a8_triton(x.bfloat16(), torch.ones(4), wq, ws)
    xq, sx = quantize_rows_reference(x)
    with pytest.raises(ValueError, match="3 row scales for 4 rows"):
        fp8_linear_a8_triton(xq, sx[:3], wq, ws)


def test_dense_takes_rows_quantised_by_the_norm_only_for_that_tensor():
    """`Dense.hand_quantized(x, (q, s))`: the next call with x itself multiplies those FP8 rows
    (here deliberately a different quantisation, to see it used), a call with any other tensor
    quantises its own, and either call drops what was handed."""
    K, N = 256, 64
    d = Dense.make(torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * K**-0.5,
                   fp8=True)  # fmt: skip
    d.w8a8_min_rows = 16
    x = _rows(7, 32, K).bfloat16()
    own = fp8_linear_w8a8_reference(x, d.weight, d.scale)
    q, s = quantize_rows_reference(x.float() * 0.7)
    s = s / 0.7  # represents x again, rounded on another grid
    handed = fp8_linear_w8a8_reference(x, d.weight, d.scale, quantized=(q, s))
    assert not torch.equal(handed, own) and _rel(handed, own) < 3e-2
    d.hand_quantized(x, (q, s))
    assert torch.equal(d(x), handed)
    assert torch.equal(d(x), own)  # taken once
    d.hand_quantized(x, (q, s))
    assert torch.equal(d(x.clone()), own)  # another tensor: its own rows
    assert d._quantized is None
    assert d.takes_w8a8(32) and not d.takes_w8a8(8)


def test_weight_only_row_tiles_and_tuning_key_follow_their_switches(monkeypatch):
    """The weight-only tiles' widest activation tile is 64 rows unless
    TTSBUILD_FP8_WO_MAX_BLOCK_M=128 (the A8 tiles' is 128 either way); the autotuner keys on
    the row count only with TTSBUILD_FP8_TUNE_BY_ROWS=1; a bad width is refused at import."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8

    # (as this process's environment set them: 64 and off unless a run asks otherwise)
    want = int(os.environ.get("TTSBUILD_FP8_WO_MAX_BLOCK_M", "64"))
    by_rows = os.environ.get("TTSBUILD_FP8_TUNE_BY_ROWS", "0") == "1"
    assert tl_fp8.WO_MAX_BLOCK_M == want and tl_fp8.TUNE_BY_ROWS == by_rows
    assert ("M" in tl_fp8._KEY) == by_rows
    monkeypatch.setattr(tl_fp8, "WO_MAX_BLOCK_M", 64)
    assert [tl_fp8.m_bucket(m) for m in (1, 2, 16, 33, 64, 128, 256)] == [1, 16, 16, 64, 64, 64, 64]
    assert tl_fp8.m_bucket(256, a8=True) == 128
    monkeypatch.setattr(tl_fp8, "WO_MAX_BLOCK_M", 128)
    assert [tl_fp8.m_bucket(m) for m in (64, 100, 256)] == [64, 128, 128]
    # the 8-warp configs without split-K are tried for 128-row tiles only
    args = {"N": 4096, "K": 1024, "M": 256, "out_ptr": torch.empty(1)}
    wide = [c for c in tl_fp8._prune(tl_fp8.GEMM_CONFIGS, args, BLOCK_M=128)
            if c in tl_fp8.WIDE_M_CONFIGS]  # fmt: skip
    assert len(wide) == len(tl_fp8.WIDE_M_CONFIGS) > 0
    narrow = tl_fp8._prune(tl_fp8.GEMM_CONFIGS, args, BLOCK_M=64)
    assert narrow and not any(c in tl_fp8.WIDE_M_CONFIGS for c in narrow)
    code = "import ttsbuild.plugins._tl.fp8_linear as f; print(f.WO_MAX_BLOCK_M, f._KEY[-1])"
    env = {**os.environ, "TTSBUILD_FP8_WO_MAX_BLOCK_M": "128", "TTSBUILD_FP8_TUNE_BY_ROWS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["128", "M"], out.stderr
    env["TTSBUILD_FP8_WO_MAX_BLOCK_M"] = "96"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "must be 64 or 128" in bad.stderr


def test_weight_only_128_row_tiles_match_the_reference_in_the_interpreter():
    """TTSBUILD_FP8_WO_MAX_BLOCK_M=128: the weight-only tiles with 128-row activation tiles
    (two row tiles, the second partly masked; N and K not multiples of the tiles) equal the
    product of the dequantised weight (rounded as the unfused kernels round), plain and as
    gate/up + SiLU, and the served 64-row tiles' result. Run in the Triton interpreter in a
    process of its own (the switch is read at import)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = """
import torch
from ttsbuild.plugins._tl import fp8_linear as tl_fp8
from ttsbuild.plugins.fp8_linear import fp8_linear_reference, quantize_weight_fp8
from ttsbuild.plugins.norm_act import silu_mul_reference
assert tl_fp8.m_bucket(200) == 128
g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
x = torch.randn(200, 160, generator=g).to(torch.bfloat16)
for gate_up in (False, True):
    w, s = quantize_weight_fp8(torch.randn(2 * 72 if gate_up else 136, 160, generator=g))
    # the product in fp32 rounded to bf16 as the unfused kernels round it, then the SiLU
    ref = fp8_linear_reference(x, w, s)
    ref = (silu_mul_reference(ref) if gate_up else ref).float()
    tl_fp8.WO_MAX_BLOCK_M = 128
    out = tl_fp8.fp8_linear_triton(x, w, s, gate_up=gate_up).float()
    tl_fp8.WO_MAX_BLOCK_M = 64  # the served 64-row tiles, same sums in another tiling
    out64 = tl_fp8.fp8_linear_triton(x, w, s, gate_up=gate_up).float()
    err = ((out - ref).norm() / ref.norm()).item()
    same = ((out - out64).norm() / out64.norm()).item()
    # (2e-2: the interpreter rounds fp32 -> bf16 by truncation, torch does not)
    assert out.shape == ref.shape and err < 2e-2 and same < 1e-3, (gate_up, err, same)
    print("ok", gate_up, err, same)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TTSBUILD_FP8_WO_MAX_BLOCK_M": "128"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split().count("ok") == 2


# the talker's and the code predictor's linears (K, N) of the 1.7B CustomVoice model
_WO_SHAPES = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288),
              "down": (6144, 2048), "cp.qkv": (1024, 4096), "cp.o": (2048, 1024),
              "cp.gate_up": (1024, 6144), "cp.down": (3072, 1024)}  # fmt: skip


def test_weight_only_rule_fits_every_shape_and_splits_to_half_a_wave():
    """wo_config (TTSBUILD_FP8_WO_RULE): for the 1.7B's linears at 2-16 rows as below, and at
    17-64 rows the config tiles K and N whole, splits K until the grid holds half the SMs'
    worth of programs (or K allows no more), keeps gate_up's two weight tiles under
    `_prune`'s bound, and matches the configs the H200 sweeps timed best at the talker's
    shapes (64 rows: qkv 64 x 256 split 2, o and down 64 x 256 split 4, gate_up 64 x 128
    unsplit, 4 warps, 3 stages; one row, the GEMV: 8 rows x 1024-wide K blocks, 256 for
    gate_up)."""
    pytest.importorskip("triton")
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8

    for name, (K, N) in _WO_SHAPES.items():
        for M in (17, 32, 40, 64):
            for gate_up in (False, True):
                n = N // 2 if gate_up else N
                c = tl_fp8.wo_config(M, n, K, 132, gate_up)
                bn, bk, split = c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
                assert n % bn == 0 and K % (bk * split) == 0 and bk <= K, (name, M, c)
                programs = (n // bn) * split
                more = split < tl_fp8._MAX_SPLIT and K % (bk * split * 2) == 0
                assert programs >= 66 or not more, (name, M, c)
                assert split == 1 or (n // bn) * split // 2 < 66, (name, M, c)  # the smallest
                assert not gate_up or bn * bk <= 8192
    # 2-16 rows: split to 1.5 waves while each split keeps 512 of K, 32-column tiles where
    # the grid stays short; the talker's shapes get the H100 sweep's winners at every row count
    # (benchmarks/runtime/2026-12-07-h100-rules/call3)
    few = {"qkv": (64, 128, 4), "o": (32, 128, 4), "gate_up": (64, 128, 2), "down": (64, 128, 8)}
    for name, (K, N) in _WO_SHAPES.items():
        for gate_up in (False, True):
            n = N // 2 if gate_up else N
            for M in (2, 5, 8, 16):
                c = tl_fp8.wo_config(M, n, K, 132, gate_up)
                bn, bk, split = c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
                assert bk == 128 and K % (bk * split) == 0 and K // split >= 512, (name, c)
                assert n % bn == 0 and (c["num_warps"], c["num_stages"]) == (4, 3)
                assert not gate_up or bn * bk <= 8192
                if name in few and not gate_up:  # (the engine's: gate/up as one linear)
                    assert (bn, bk, split) == few[name], (name, M, c)
    want = {"qkv": (64, 256, 2), "o": (64, 256, 4), "gate_up": (64, 128, 1),
            "down": (64, 256, 4)}  # fmt: skip
    # one row (the GEMV): the sweeps' winners, or within 2 % of them (qkv: stages 3, 4.32 us
    # against 4.24 with 1)
    gemv = {"qkv": (8, 1024), "o": (8, 1024), "gate_up": (8, 256), "down": (8, 1024)}
    for name, tiles in want.items():
        K, N = _WO_SHAPES[name]
        c = tl_fp8.wo_config(64, N, K)
        assert (c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]) == tiles, (name, c)
        assert (c["num_warps"], c["num_stages"]) == (4, 3)
        one = tl_fp8.wo_config(1, N, K)
        assert (one["BLOCK_N"], one["BLOCK_K"], one["SPLIT_K"]) == (*gemv[name], 1), (name, one)
        assert (one["num_warps"], one["num_stages"]) == (4, 3)
        fused = tl_fp8.wo_config(1, N // 2, K, gate_up=True)  # two tiles: <= 8192 weights
        assert fused["BLOCK_N"] * fused["BLOCK_K"] <= 8192 and K % fused["BLOCK_K"] == 0


@needs_kernel
@pytest.mark.parametrize("M", [5, 16, 40])
def test_weight_only_rule_config_matches_the_reference(M):
    """The weight-only kernel with the rule's config (split-K included) against the fp32
    product, fresh random rows and weights (on CUDA, or under TRITON_INTERPRET=1)."""
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton, wo_config
    from ttsbuild.plugins.fp8_linear import fp8_linear_reference

    g = torch.Generator().manual_seed(M)
    K, N = 1024, 128
    w, s = quantize_weight_fp8(torch.randn(N, K, generator=g) * K**-0.5)
    x = torch.randn(M, K, generator=g).bfloat16()
    c = wo_config(M, N, K, sms=8)  # a small GPU's worth (8 SMs): split-K 2
    assert c["SPLIT_K"] == 2
    w, s, x = w.to(KDEV), s.to(KDEV), x.to(KDEV)
    for _ in range(2):  # twice: split-K's counters reset
        out = fp8_linear_triton(x, w, s, config=c)
        assert out.shape == (M, N) and _rel(out.float().cpu(), fp8_linear_reference(
            x.cpu(), w.cpu(), s.cpu()).float()) < 2e-2  # fmt: skip


def test_weight_only_rule_switch_is_read_at_import_and_routes_its_rows(monkeypatch):
    """TTSBUILD_FP8_WO_RULE=1 at import turns the rule on (off by default until timed in the
    engine). On, a launch of 1-64 rows takes the rule's config and no autotuner; 65+ rows (and
    every launch with it off) go to the autotuner; best_config reports the
    rule's config where it covers the rows. (The launches are recorded, not run: the GPU path
    without a GPU.)"""
    import subprocess
    import sys

    pytest.importorskip("triton")
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8

    assert tl_fp8.WO_RULE == (os.environ.get("TTSBUILD_FP8_WO_RULE", "0") == "1")
    assert [M for M in range(1, 130) if tl_fp8.wo_rule_rows(M)] == list(range(1, 65))
    launched = record_fp8_launches(monkeypatch)
    w, s = quantize_weight_fp8(torch.randn(256, 512))
    for rule in (True, False):
        monkeypatch.setattr(tl_fp8, "WO_RULE", rule)
        for M in (1, 4, 16, 17, 40, 64, 128):
            launched.clear()
            tl_fp8.fp8_linear_triton(torch.randn(M, 512).bfloat16(), w, s)
            (name, kw), = launched
            if rule and tl_fp8.wo_rule_rows(M):
                want = tl_fp8.wo_config(M, 256, 512)
                assert name == "_heur" and {k: kw[k] for k in want} == want, (M, kw)
                assert tl_fp8.best_config(M, 256, 512) == want
            else:
                assert name == ("_gemv" if M == 1 else "_gemm"), (rule, M, name)
    code = "import ttsbuild.plugins._tl.fp8_linear as f; print(f.WO_RULE, f.WO_RULE_MAX_ROWS)"
    env = {**os.environ, "TTSBUILD_FP8_WO_RULE": "1"}
    env.pop("TTSBUILD_FP8_WO_RULE_MAX_ROWS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "64"], out.stderr
    env["TTSBUILD_FP8_WO_RULE_MAX_ROWS"] = "16"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "16"], out.stderr
    for bad in ("0", "65", "sixteen"):
        env["TTSBUILD_FP8_WO_RULE_MAX_ROWS"] = bad
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode != 0 and "TTSBUILD_FP8_WO_RULE_MAX_ROWS" in out.stderr, bad
    # the narrowed rule leaves 17-64 rows to the autotuner
    monkeypatch.setattr(tl_fp8, "WO_RULE", True)
    monkeypatch.setattr(tl_fp8, "WO_RULE_MAX_ROWS", 16)
    assert [M for M in range(1, 130) if tl_fp8.wo_rule_rows(M)] == list(range(1, 17))
    for M, rule in ((16, True), (17, False), (32, False)):
        launched.clear()
        tl_fp8.fp8_linear_triton(torch.randn(M, 512).bfloat16(), w, s)
        (name, _), = launched
        assert (name == "_heur") == rule, (M, name)
