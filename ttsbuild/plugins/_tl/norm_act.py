"""Triton: RMSNorm (optionally fused with the residual add), silu * up, SnakeBeta.

RMSNorm: one program per row, the whole row in registers (hidden <= 8192 here). The sum
x + residual is rounded to the residual dtype first (as the eager add), the statistics are
fp32, x * rstd is rounded to the input dtype before the weight multiply (as the model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import exp_f32, pdl_prologue, sin_f32
from ttsbuild.plugins._tl.fp8_w8a8 import as_fp8, fp8_row_buffers, store_fp8_row
from ttsbuild.plugins.fp8_linear import FP8_MAX


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, qs_ptr,
    stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        xf = s.to(tl.float32)
        y = (xf * (1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / N + eps))).to(s.dtype)
    else:
        xf = x.to(tl.float32)
        y = (xf * (1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / N + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if QUANT:  # the normed row (as stored) quantised to FP8 with its own scale, for W8A8
        store_fp8_row(out.to(tl.float32), q_ptr, qs_ptr, row, N, offs, mask, FMAX)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    quantize: bool = False,
):  # fmt: skip
    """(residual + x or None, normed); shapes as x. quantize: also the normed rows quantised
    to FP8 with a scale per row, as `fp8_w8a8.quantize_rows` would from the normed output:
    (residual or None, normed, (q [R, N] e4m3, scale [R, 1] fp32))."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}], got {tuple(weight.shape)}")
    x2 = _rows(x, N)
    R = x2.shape[0]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = _rows(residual, N)
        res_dtype = torch.promote_types(residual.dtype, x.dtype)
        res_out = torch.empty((R, N), dtype=res_dtype, device=x.device)
    else:
        r2, res_out, res_dtype = x2, x2, x.dtype
    out = torch.empty((R, N), dtype=torch.promote_types(weight.dtype, res_dtype), device=x.device)
    q, qs = fp8_row_buffers(R, N, x.device) if quantize else (out, out)
    if R > 0:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(R,)](
            x2, r2, weight, out, res_out, q, qs,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), N, eps,
            HAS_RES=residual is not None, BLOCK=block, QUANT=quantize, FMAX=FP8_MAX,
            **pdl_args(pdl_enabled(x)),
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    out = out.reshape(x.shape)
    res = res_out.reshape(x.shape) if residual is not None else None
    if quantize:
        return res, out, (as_fp8(q), qs)
    return res, out


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_o, I,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    src = gu_ptr + row * stride_gu + offs
    g = tl.load(src, mask=mask, other=0.0)
    u = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = tl.math.div_rn(gf, 1.0 + exp_f32(-gf)).to(g.dtype)  # F.silu, rounded as eager
    out = s.to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    gu_ptr, out_ptr, q_ptr, qs_ptr, stride_gu, stride_o, I,
    BLOCK: tl.constexpr, FMAX: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One program per row (the row's amax needs all of it): silu(gate) * up as
    `_silu_mul_kernel` rounds it, stored, then quantised to FP8 with the row's scale."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    src = gu_ptr + row * stride_gu + offs
    g = tl.load(src, mask=mask, other=0.0)
    u = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = tl.math.div_rn(gf, 1.0 + exp_f32(-gf)).to(g.dtype)
    out = (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    store_fp8_row(out.to(tl.float32), q_ptr, qs_ptr, row, I, offs, mask, FMAX)


def _gate_up_rows(gate_up: torch.Tensor):
    """(I, the [R, 2I] rows, R, an [R, I] output) of a packed gate/up tensor."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up last dim must be even, got {two_i}")
    gu = _rows(gate_up, two_i)
    R = gu.shape[0]
    return two_i // 2, gu, R, torch.empty((R, two_i // 2), dtype=gate_up.dtype,
                                          device=gate_up.device)  # fmt: skip


def silu_mul_quant_triton(gate_up: torch.Tensor):
    """(silu(gate) * up [..., I], (its rows quantised to FP8 [R, I], scales [R, 1])) in one
    launch, one program per row."""
    I, gu, R, out = _gate_up_rows(gate_up)
    q, qs = fp8_row_buffers(R, I, gate_up.device)
    if R > 0:
        block = triton.next_power_of_2(I)
        _silu_mul_quant_kernel[(R,)](
            gu, out, q, qs, gu.stride(0), out.stride(0), I, BLOCK=block, FMAX=FP8_MAX,
            **pdl_args(pdl_enabled(gu)), num_warps=4 if block <= 2048 else 8 if block <= 4096
            else 16,
        )  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], I), (as_fp8(q), qs)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    I, gu, R, out = _gate_up_rows(gate_up)
    if R > 0:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(R, triton.cdiv(I, block))](
            gu, out, gu.stride(0), out.stride(0), I, BLOCK=block,
            **pdl_args(pdl_enabled(gu)), num_warps=4,
        )
    return out.reshape(*gate_up.shape[:-1], I)


@triton.jit
def _snake_beta_kernel(
    x_ptr, la_ptr, lb_ptr, out_ptr, C, T,
    stride_xb, stride_xc, stride_xt, eps,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    c_mask = offs_c < C
    mask = c_mask[:, None] & (offs_t[None, :] < T)
    alpha = exp_f32(tl.load(la_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32))
    lb = tl.load(lb_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    inv_beta = tl.math.div_rn(tl.full((BLOCK_C,), 1.0, tl.float32), exp_f32(lb) + eps)
    src = x_ptr + b * stride_xb + offs_c[:, None] * stride_xc + offs_t[None, :] * stride_xt
    xf = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    s = sin_f32(xf * alpha[:, None])
    out = xf + inv_beta[:, None] * (s * s)
    dst = out_ptr + (b * C + offs_c[:, None]) * T + offs_t[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def snake_beta_triton(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor
) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, C, T], got {tuple(x.shape)}")
    B, C, T = x.shape
    if log_alpha.shape != (C,) or log_beta.shape != (C,):
        raise ValueError(f"log_alpha/log_beta must be [{C}]")
    dtype = torch.promote_types(x.dtype, log_alpha.dtype)
    out = torch.empty((B, C, T), dtype=dtype, device=x.device)
    if B * C * T > 0:
        block_t = min(256, triton.next_power_of_2(T))
        block_c = min(triton.next_power_of_2(C), max(1, 2048 // block_t))
        grid = (B, triton.cdiv(C, block_c), triton.cdiv(T, block_t))
        _snake_beta_kernel[grid](
            x, log_alpha, log_beta, out, C, T, x.stride(0), x.stride(1), x.stride(2), 1e-9,
            BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4,
        )  # fmt: skip
    return out
