"""Triton: per-row dynamic FP8 quantisation, one program per row (see plugins/fp8_w8a8.py).

`store_fp8_row` and `fp8_row_buffers` are shared with the kernels that quantise the rows they
write (the norms and silu_mul in `_tl/norm_act.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, FP8_MAX


@triton.jit
def store_fp8_row(v, q_ptr, s_ptr, row, stride_q, offs, mask, FMAX: tl.constexpr):
    """One row v (fp32, zero where masked) quantised to FP8 with its own scale
    amax(|v|) / FMAX: q_ptr[row * stride_q + offs] and s_ptr[row]."""
    scale = tl.maximum(tl.max(tl.abs(v), axis=0) / FMAX, 1e-12)
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def fp8_row_buffers(R: int, N: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, N], scales [R, 1] fp32) for `store_fp8_row`; pass q through `as_fp8`. The
    interpreter's fp32 -> e4m3 cast rounds values just under a power of two down a binade
    (124.3 -> 64): there q is fp32 and torch casts."""
    q = torch.empty((R, N), dtype=torch.float32 if interpret_mode() else FP8_DTYPE,
                    device=device)  # fmt: skip
    return q, torch.empty((R, 1), dtype=torch.float32, device=device)


def as_fp8(q: torch.Tensor) -> torch.Tensor:
    return q.to(FP8_DTYPE)


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
    store_fp8_row(x, q_ptr, s_ptr, row, stride_q, offs, mask, FMAX)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q, s = fp8_row_buffers(M, K, x.device)
    if M:
        block = triton.next_power_of_2(K)
        pdl = pdl_enabled(x)
        _quantize_rows_kernel[(M,)](
            x, q, s, x.stride(0), q.stride(0), K, FMAX=FP8_MAX, BLOCK=block,
            **pdl_args(pdl), num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return as_fp8(q), s
