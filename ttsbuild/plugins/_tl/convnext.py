"""Triton: a codec ConvNeXt block for few rows in two launches (plugins.convnext).

A (grid: tiles of the 4C hidden units): the depthwise causal conv (k taps over the context-
extended input), its LayerNorm and pwconv1 + GELU for all R = B * n rows at once. Each
program recomputes the conv and the LayerNorm statistics of every row (R x C x k MACs, cheap
beside its [BLOCK_N, C] tile of pwconv1), so no launch sits between them, and reads its tile
of pwconv1 once for all rows (the rows padded to 16 for the tensor cores).
B (grid: tiles of the C outputs): pwconv2 over the 4C hidden units, gamma (unless folded into
pwconv2), the residual, stored [B, C, n].
Roundings follow the module's ops in the stage dtype (fp16/bf16): the conv's output, the
normed rows, the pwconv1 output, the GELU, the pwconv2 output, gamma's product and the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import codec_pdl_args, interpret_mode
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _dot_nt(a, b, HALF_DOTS: tl.constexpr):
    """a @ b.T with fp32 sums: 16-bit operands on the tensor cores, else IEEE fp32 dots."""
    if HALF_DOTS:
        return tl.dot(a, tl.trans(b))
    return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")


@triton.jit
def _dwconv(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, b, t, r_mask, offs_c, c_mask,
            K: tl.constexpr):  # fmt: skip
    """The depthwise conv's output [BLOCK_R, BLOCK_C] for rows (b, t) and channels offs_c,
    rounded to the input dtype, as fp32."""
    m = r_mask[:, None] & c_mask[None, :]
    base = xe_ptr + b[:, None].to(tl.int64) * sxb + offs_c[None, :].to(tl.int64) * sxc
    acc = tl.zeros(m.shape, tl.float32) + tl.load(dw_b_ptr + offs_c, mask=c_mask,
                                                  other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        w = tl.load(dw_w_ptr + offs_c * K + j, mask=c_mask, other=0.0).to(tl.float32)
        x = tl.load(base + (t[:, None] + j).to(tl.int64) * sxt, mask=m, other=0.0)
        acc += x.to(tl.float32) * w[None, :]
    return tl.where(m, acc.to(xe_ptr.dtype.element_ty).to(tl.float32), 0.0)


@triton.jit
def _convnext_in_kernel(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, ln_w_ptr, ln_b_ptr, eps,
                        w1_ptr, b1_ptr, h_ptr, R, n, C, N1,
                        K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, HALF_DOTS: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    dt = xe_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    b = offs_r // n
    t = offs_r % n
    # the LayerNorm statistics of every row (fp32, over C channels)
    s1 = tl.zeros((BLOCK_R,), tl.float32)
    s2 = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, C, BLOCK_K):
        offs_c = c0 + tl.arange(0, BLOCK_K)
        dw = _dwconv(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, b, t, r_mask, offs_c,
                     offs_c < C, K)  # fmt: skip
        s1 += tl.sum(dw, axis=1)
        s2 += tl.sum(dw * dw, axis=1)
    mean = s1 / C
    rstd = 1.0 / tl.sqrt_rn(tl.maximum(s2 / C - mean * mean, 0.0) + eps)
    # pwconv1 for this program's hidden units: the normed rows chunk by chunk
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N1
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for c0 in range(0, C, BLOCK_K):
        offs_c = c0 + tl.arange(0, BLOCK_K)
        c_mask = offs_c < C
        dw = _dwconv(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, b, t, r_mask, offs_c, c_mask, K)
        lw = tl.load(ln_w_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        lb = tl.load(ln_b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        hn = (dw - mean[:, None]) * rstd[:, None] * lw[None, :] + lb[None, :]
        hn = tl.where(r_mask[:, None] & c_mask[None, :], hn, 0.0).to(dt)
        w = tl.load(w1_ptr + offs_n[:, None].to(tl.int64) * C + offs_c[None, :],
                    mask=n_mask[:, None] & c_mask[None, :], other=0.0)  # fmt: skip
        acc += _dot_nt(hn, w, HALF_DOTS)
    y = acc + tl.load(b1_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y.to(dt).to(tl.float32)
    g = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))  # exact GELU (F.gelu)
    tl.store(h_ptr + offs_r[:, None].to(tl.int64) * N1 + offs_n[None, :], g.to(dt),
             mask=r_mask[:, None] & n_mask[None, :])  # fmt: skip


@triton.jit
def _convnext_out_kernel(h_ptr, w2_ptr, b2_ptr, gamma_ptr, x_ptr, sxb, sxc, sxt, out_ptr,
                         R, n, C, N1, HAS_GAMMA: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HALF_DOTS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    dt = h_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < C
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for k0 in range(0, N1, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < N1
        h = tl.load(h_ptr + offs_r[:, None].to(tl.int64) * N1 + offs_k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w2_ptr + offs_n[:, None].to(tl.int64) * N1 + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        acc += _dot_nt(h, w, HALF_DOTS)
    y = (acc + tl.load(b2_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :])
    y = y.to(dt).to(tl.float32)
    if HAS_GAMMA:
        gamma = tl.load(gamma_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = (y * gamma[None, :]).to(dt).to(tl.float32)
    b = offs_r // n
    t = offs_r % n
    m = r_mask[:, None] & n_mask[None, :]
    at = b[:, None].to(tl.int64) * sxb + offs_n[None, :].to(tl.int64) * sxc \
        + t[:, None].to(tl.int64) * sxt
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    o_at = b[:, None].to(tl.int64) * (C * n) + offs_n[None, :].to(tl.int64) * n + t[:, None]
    tl.store(out_ptr + o_at, (x + y).to(dt), mask=m)


def convnext_triton(x: torch.Tensor, xe: torch.Tensor, dw_weight: torch.Tensor,
                    dw_bias: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                    eps: float, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                    b2: torch.Tensor, gamma: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x [B, C, n] (the residual), xe [B, C, ctx + n] (x after its left context) -> [B, C, n]."""
    B, C, n = x.shape
    K = dw_weight.shape[-1]
    N1 = w1.shape[0]
    R = B * n
    block_r = max(16, triton.next_power_of_2(R))
    half = x.dtype != torch.float32 and not interpret_mode()  # (the interpreter's 16-bit dots
    h = torch.empty((R, N1), dtype=x.dtype, device=x.device)  # are wrong: fp32 there)
    out = torch.empty((B, C, n), dtype=x.dtype, device=x.device)
    pdl = codec_pdl_args(x)
    block_n1 = 64
    _convnext_in_kernel[(triton.cdiv(N1, block_n1),)](
        xe, xe.stride(0), xe.stride(1), xe.stride(2), dw_weight.reshape(C, K).contiguous(),
        dw_bias, ln_weight, ln_bias, eps, w1.contiguous(), b1, h, R, n, C, N1,
        K=K, BLOCK_R=block_r, BLOCK_N=block_n1, BLOCK_K=64, HALF_DOTS=half, num_warps=4, **pdl,
    )  # fmt: skip
    _convnext_out_kernel[(triton.cdiv(C, 16),)](
        h, w2.contiguous(), b2, gamma if gamma is not None else b2, x, x.stride(0), x.stride(1),
        x.stride(2), out, R, n, C, N1, HAS_GAMMA=gamma is not None, BLOCK_R=block_r,
        BLOCK_N=16, BLOCK_K=128, HALF_DOTS=half, num_warps=4, **pdl,
    )  # fmt: skip
    return out


@triton.jit
def _dwconv_norm_kernel(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, ln_w_ptr, ln_b_ptr, eps,
                        out_ptr, R, n, C, K: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """BLOCK_R rows (b, t) of the depthwise conv over every channel (BLOCK_C >= C), rounded to
    the input dtype, then their LayerNorm in fp32, stored [R, C] in the input dtype."""
    pdl_prologue(PDL)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    dw = _dwconv(xe_ptr, sxb, sxc, sxt, dw_w_ptr, dw_b_ptr, offs_r // n, offs_r % n, r_mask,
                 offs_c, c_mask, K)  # [BLOCK_R, BLOCK_C], 0 where masked
    mean = tl.sum(dw, axis=1) / C
    dev = tl.where(c_mask[None, :], dw - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(dev * dev, axis=1) / C + eps)
    lw = tl.load(ln_w_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    lb = tl.load(ln_b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    y = dev * rstd[:, None] * lw[None, :] + lb[None, :]
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * C + offs_c[None, :],
             y.to(xe_ptr.dtype.element_ty), mask=r_mask[:, None] & c_mask[None, :])


def dwconv_norm_triton(xe: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                       n: int) -> torch.Tensor:  # fmt: skip
    """xe [B, C, ctx + n] -> LayerNorm(depthwise conv) [B, n, C] (contiguous)."""
    B, C, _ = xe.shape
    K = dw_weight.shape[-1]
    R = B * n
    out = torch.empty((B, n, C), dtype=xe.dtype, device=xe.device)
    block_c = triton.next_power_of_2(C)
    block_r = max(1, min(4, 4096 // block_c))  # [4, 1024]: 32 fp32 values a thread of 4 warps
    _dwconv_norm_kernel[(triton.cdiv(R, block_r),)](
        xe, xe.stride(0), xe.stride(1), xe.stride(2), dw_weight.reshape(C, K).contiguous(),
        dw_bias, ln_weight, ln_bias, eps, out, R, n, C, K=K, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4, **codec_pdl_args(xe),
    )  # fmt: skip
    return out
