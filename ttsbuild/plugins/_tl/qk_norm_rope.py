"""Triton: per-head RMSNorm(q), RMSNorm(k), rotate-half RoPE, K/V cache write.

Grid (rows, 3): part 0 handles the q heads, 1 the k heads, 2 copies v. Each program loads
its heads as two [H, D/2] halves, so rotate-half is register arithmetic:
out1 = y1 cos - y2 sin, out2 = y2 cos + y1 sin, angle = pos * inv_freq (fp32, as PyTorch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl._math import cos_f32, e4m3_value, pdl_prologue, sin_f32
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, kv_cache_scales


@triton.jit
def _norm_rope_heads(
    src, w_ptr, dst, dst_head_stride, pos_f, f_ptr, eps, scale,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr = False,
):  # fmt: skip
    """QUANT: dst is an FP8 cache, stored divided by `scale` (`e4m3_value`)."""
    HALF: tl.constexpr = D // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    h_mask = offs_h[:, None] < H
    p1 = src + offs_h[:, None] * D + offs_d[None, :]
    x1 = tl.load(p1, mask=h_mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=h_mask, other=0.0).to(tl.float32)
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    r = 1.0 / tl.sqrt_rn(ms + eps)
    w1 = tl.load(w_ptr + offs_d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)
    y1 = x1 * r[:, None] * w1[None, :]
    y2 = x2 * r[:, None] * w2[None, :]
    ang = pos_f * tl.load(f_ptr + offs_d)
    c = cos_f32(ang)[None, :]
    s = sin_f32(ang)[None, :]
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if QUANT:
        o1 = e4m3_value(o1, scale)
        o2 = e4m3_value(o2, scale)
    q1 = dst + offs_h[:, None] * dst_head_stride + offs_d[None, :]
    tl.store(q1, o1.to(dst.dtype.element_ty), mask=h_mask)
    tl.store(q1 + HALF, o2.to(dst.dtype.element_ty), mask=h_mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, pos_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr,
    stride_row, stride_qrow, stride_qh, stride_cslot, stride_ch, stride_cs, eps,
    k_scale, v_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, KV_FP8: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    src = qkv_ptr + row.to(tl.int64) * stride_row
    cache_off = slot * stride_cslot + pos * stride_cs
    if part == 0:
        _norm_rope_heads(
            src, qw_ptr, q_out_ptr + row.to(tl.int64) * stride_qrow, stride_qh,
            pos.to(tl.float32), f_ptr, eps, 1.0, HQ, BLOCK_HQ, D,
        )  # fmt: skip
    elif part == 1:
        _norm_rope_heads(
            src + HQ * D, kw_ptr, kc_ptr + cache_off, stride_ch,
            pos.to(tl.float32), f_ptr, eps, k_scale, HKV, BLOCK_HKV, D, KV_FP8,
        )  # fmt: skip
    else:
        offs_h = tl.arange(0, BLOCK_HKV)
        offs_d = tl.arange(0, D)
        h_mask = offs_h[:, None] < HKV
        v = tl.load(src + (HQ + HKV) * D + offs_h[:, None] * D + offs_d[None, :], mask=h_mask)
        if KV_FP8:
            v = e4m3_value(v.to(tl.float32), v_scale)
        dst = vc_ptr + cache_off + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(dst, v.to(vc_ptr.dtype.element_ty), mask=h_mask)


def qk_norm_rope_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    del theta  # folded into freqs
    R = qkv.shape[0]
    D = k_cache.shape[-1]
    check_qkv_caches(qkv, k_cache, v_cache, num_heads, num_kv_heads)
    ks, vs = kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    q = torch.empty((R, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_kernel[(R, 3)](
        qkv, q_weight, k_weight, freqs, positions.reshape(-1), slots.reshape(-1), q,
        k_cache, v_cache, qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, ks, vs,
        HQ=num_heads, HKV=num_kv_heads, D=D,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        KV_FP8=k_cache.dtype == KV_FP8_DTYPE,
        **pdl_args(pdl_enabled(qkv)), num_warps=4,
    )  # fmt: skip
    return q
