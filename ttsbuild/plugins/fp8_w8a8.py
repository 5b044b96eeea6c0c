"""FP8 activations x FP8 weights on the tensor cores (W8A8) for linears with many rows.

y = (xq * sx) @ (w_fp8 * sw[:, None]).T, where each row of x gets its own scale
sx = amax(|x_row|) / 448 at run time (dynamic per-token scaling: nothing to calibrate, and a
row of large activations does not cost the other rows their precision), and w keeps the
per-output-channel scales of `quantize_weight_fp8`. On CUDA it is one Triton launch that
quantises the rows (`_tl/fp8_w8a8.py`) and one cuBLASLt FP8 GEMM with row-wise scales
(`torch._scaled_mm`, fp32 accumulation, bf16 out) with `TTSBUILD_W8A8_GEMM=cublas`, or by
default our own FP8 x FP8 tiles (`_tl/fp8_linear.py`, A8: swap-AB, split-K to fill the SMs at
few rows, any row count). It pays where the weight-only kernel runs
out of steam: the talker's prefill (32-512 rows) and large decode buckets; at a few rows the
GEMV of `fp8_linear` stays faster (`EnginePlan.w8a8_min_rows` picks, by measurement).

Error: e4m3 keeps 3 mantissa bits, so each activation is rounded to within 2^-4 of its value
(relative); a dot product of K such terms averages the errors out (tests: ~1-2 % relative
against the weight-only product on random inputs).
"""

from __future__ import annotations

import os

import torch

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, FP8_MAX

# Which FP8 GEMM runs W8A8 on CUDA: the Triton A8 tiles (default: 1.3-2x faster than
# cuBLASLt at 16-128 rows of the talker's shapes on the H200,
# benchmarks/kernels/2026-12-04-h200-a8) or cuBLASLt (`torch._scaled_mm`, rows a multiple of
# 16; TTSBUILD_W8A8_GEMM=cublas). Read at import.
W8A8_GEMM = os.environ.get("TTSBUILD_W8A8_GEMM", "triton")
if W8A8_GEMM not in ("cublas", "triton"):
    raise ValueError(f"TTSBUILD_W8A8_GEMM must be cublas or triton, got {W8A8_GEMM!r}")


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3fn, scale [M, 1] fp32): x ~= xq * scale, each row's
    largest magnitude mapped to 448 (an all-zero row gets a tiny scale and zeros)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def quantize_rows(x: torch.Tensor, *, use_triton: bool | None = None):
    """`quantize_rows_reference` in one launch on the GPU."""
    if x.dim() != 2:
        raise ValueError(f"expected x [M, K], got {tuple(x.shape)}")
    if not want_triton(x, use_triton):
        return quantize_rows_reference(x)
    from ttsbuild.plugins._tl.fp8_w8a8 import quantize_rows_triton

    return quantize_rows_triton(x)


def w8a8_supported(rows: int, w_fp8: torch.Tensor) -> bool:
    """Shapes the FP8 GEMM takes: for cuBLASLt every dimension a multiple of 16; the Triton
    tiles mask rows and columns (K a multiple of 16: 16-byte rows)."""
    n, k = w_fp8.shape
    if W8A8_GEMM == "triton":
        return rows > 0 and k % 16 == 0
    return rows > 0 and rows % 16 == 0 and n % 16 == 0 and k % 16 == 0


def fp8_linear_w8a8_reference(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same quantisation (or x's rows as quantised already), the product in fp32 of the
    dequantised operands."""
    lead = x.shape[:-1]
    if quantized is None:
        quantized = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    xq, sx = quantized
    out = (xq.float() * sx) @ (w_fp8.float() * w_scale.float()[:, None]).t()
    return out.to(x.dtype).reshape(*lead, w_fp8.shape[0])


def fp8_linear_w8a8(
    x: torch.Tensor,  # [..., K] bf16
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] fp32
    *,
    use_triton: bool | None = None,
    gate_up: bool = False,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[..., N] bf16: rows quantised to FP8, one FP8 tensor-core GEMM (CUDA); the reference
    elsewhere. gate_up: w is a packed [2N, K] gate/up matrix and the result is
    silu(gate) * up [..., N], in the GEMM's epilogue on the Triton tiles (rounded as
    `silu_mul` after the plain product rounds). quantized: x's rows already quantised, (q
    [R, K] e4m3, scale [R, 1]) as `quantize_rows(x)` gives (a norm that wrote them, e.g.
    `add_rms_norm(quantize=True)`); then x gives only the output's leading shape."""
    if gate_up and (W8A8_GEMM != "triton" or not want_triton(x, use_triton) or not x.is_cuda):
        from ttsbuild.plugins.norm_act import silu_mul

        return silu_mul(fp8_linear_w8a8(x, w_fp8, w_scale, use_triton=use_triton,
                                         quantized=quantized))  # fmt: skip
    if w_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {w_fp8.dtype}")
    if not want_triton(x, use_triton) or not x.is_cuda:
        return fp8_linear_w8a8_reference(x, w_fp8, w_scale, quantized=quantized)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the FP8 GEMM writes bf16: x must be bf16, got {x.dtype}")
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if not w8a8_supported(x2.shape[0], w_fp8):
        raise ValueError(f"W8A8 ({W8A8_GEMM}) does not take {x2.shape[0]} rows x "
                         f"{tuple(w_fp8.shape)}")  # fmt: skip
    xq, sx = quantize_rows(x2, use_triton=True) if quantized is None else quantized
    if W8A8_GEMM == "triton":
        from ttsbuild.plugins._tl.fp8_linear import fp8_linear_a8_triton

        out = fp8_linear_a8_triton(xq, sx, w_fp8, w_scale, gate_up=gate_up)
        return out.reshape(*lead, out.shape[-1])
    out = torch._scaled_mm(
        xq, w_fp8.t(), scale_a=sx, scale_b=w_scale.float().reshape(1, -1),
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    return out.reshape(*lead, w_fp8.shape[0])
