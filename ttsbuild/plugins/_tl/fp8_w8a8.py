"""Triton: per-row dynamic FP8 quantisation, one program per row (see plugins/fp8_w8a8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, FP8_MAX


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, FMAX: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, 1e-12)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    # The interpreter's fp32 -> e4m3 cast rounds values just under a power of two down a
    # binade (124.3 -> 64): there the kernel writes fp32 and torch casts.
    q = torch.empty((M, K), dtype=torch.float32 if interpret_mode() else FP8_DTYPE,
                    device=x.device)  # fmt: skip
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(K)
        pdl = pdl_enabled(x)
        _quantize_rows_kernel[(M,)](
            x, q, s, x.stride(0), q.stride(0), K, FMAX=FP8_MAX, BLOCK=block,
            **pdl_args(pdl), num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return q.to(FP8_DTYPE), s
