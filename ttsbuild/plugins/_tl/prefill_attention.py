"""Triton: a prefill layer's attention in one launch: q/k RMSNorm + RoPE, the new tokens' K/V
into the cache, causal attention over the cached prefix and the new tokens.

Grid (row x KV head, block of BLOCK_T tokens). A program owns BLOCK_T tokens of one row and
one KV head with its GROUP query heads ([BLOCK_T * GROUP, D] queries, held as D/2 halves so
rotate-half is register arithmetic). It writes its own tokens' k (normed, rotated, rounded
to the cache dtype) and v into the cache, then attends with an online softmax over
  1. the row's cached positions [0, start) (a prefix copied in before the layer), and
  2. the row's new tokens up to its block's last, whose k it normalises and rotates again
     from qkv (and v read from qkv): no program reads another's cache stores, so the launch
     needs no grid-wide order.
The unfused path (qk_norm_rope, then decode attention's split and combine: three launches a
layer) rounds q to qkv's dtype and k/v to the cache's; so does this. Positions past the
cache's end (padding rows) are clamped to its last position as the unfused path clamps them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl._math import cos_f32, pdl_prologue, sin_f32
from ttsbuild.plugins._tl.qk_norm_rope_attend import _norm_rope

_LOG2E = 1.4426950408889634


@triton.jit
def _keys(qkv_ptr, kw_ptr, f_ptr, row0, tok, start, S, stride_row, kvh, eps, cdt,
          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """The new tokens `tok` [N] of the row whose qkv rows start at row0: k normed, rotated
    at their positions and rounded to the cache dtype, and v, as [N, D/2] halves."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    pos = tl.minimum(start + tok, S - 1)
    ang = pos.to(tl.float32)[:, None] * tl.load(f_ptr + offs_d)[None, :]
    c = cos_f32(ang)
    s = sin_f32(ang)
    src = qkv_ptr + (row0 + tok.to(tl.int64))[:, None] * stride_row + offs_d[None, :]
    k1, k2 = _norm_rope(
        tl.load(src + (HQ + kvh) * D).to(tl.float32),
        tl.load(src + (HQ + kvh) * D + HALF).to(tl.float32),
        kw_ptr, offs_d, c, s, eps, D,
    )  # fmt: skip
    v1 = tl.load(src + (HQ + HKV + kvh) * D)
    v2 = tl.load(src + (HQ + HKV + kvh) * D + HALF)
    return k1.to(cdt), k2.to(cdt), v1.to(cdt), v2.to(cdt), pos


@triton.jit
def _update(q1, q2, k1, k2, v1, v2, visible, m_i, l_i, acc1, acc2, qk_scale,
            HALF_DOTS: tl.constexpr):  # fmt: skip
    """One block of keys into the online softmax (scores in log2 units). q and k hold values
    of the cache dtype: with a 16-bit cache (HALF_DOTS) their products are exact in the
    tensor cores' fp32 sums, and the probabilities are rounded to v's dtype for theirs; an
    fp32 cache takes IEEE fp32 dots."""
    if HALF_DOTS:
        scores = tl.dot(q1.to(k1.dtype), tl.trans(k1)) + tl.dot(q2.to(k2.dtype), tl.trans(k2))
    else:
        scores = tl.dot(q1, tl.trans(k1.to(tl.float32)), input_precision="ieee") + tl.dot(
            q2, tl.trans(k2.to(tl.float32)), input_precision="ieee")  # fmt: skip
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if HALF_DOTS:  # the probabilities rounded to v's dtype, as flash attention does
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(v1.dtype), v1)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2)
    else:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1.to(tl.float32), input_precision="ieee")
        acc2 = acc2 * alpha[:, None] + tl.dot(p, v2.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc1, acc2


@triton.jit
def _prefill_attention_kernel(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, start_ptr, slot_ptr, kc_ptr, vc_ptr, out_ptr,
    stride_row, stride_orow, stride_cslot, stride_ch, stride_cs, T, S, eps, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_START: tl.constexpr,
    HALF_DOTS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP
    b = tl.program_id(0) // HKV
    kvh = tl.program_id(0) % HKV
    t0 = tl.program_id(1) * BLOCK_T
    pdl_prologue(PDL)
    start = tl.zeros((), tl.int64)
    if HAS_START:
        start = tl.load(start_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    row0 = b.to(tl.int64) * T
    cdt = kc_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF)
    head_k = kc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch
    head_v = vc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch

    # this block's new k and v into the cache
    offs_t = t0 + tl.arange(0, BLOCK_T)
    tok_t = tl.minimum(offs_t, T - 1)  # rows past T repeat the last (their stores masked)
    k1, k2, v1, v2, pos_t = _keys(qkv_ptr, kw_ptr, f_ptr, row0, tok_t, start, S, stride_row,
                                  kvh, eps, cdt, HQ, HKV, D)  # fmt: skip
    at_t = pos_t[:, None] * stride_cs + offs_d[None, :]
    t_mask = (offs_t < T)[:, None]
    tl.store(head_k + at_t, k1, mask=t_mask)
    tl.store(head_k + at_t + HALF, k2, mask=t_mask)
    tl.store(head_v + at_t, v1, mask=t_mask)
    tl.store(head_v + at_t + HALF, v2, mask=t_mask)

    # the queries: BLOCK_T tokens x GROUP heads, normed, rotated, rounded to qkv's dtype
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // GROUP
    m_mask = tok < T
    tok_c = tl.minimum(tok, T - 1)
    head_q = kvh * GROUP + offs_m % GROUP
    pos_m = tl.minimum(start + tok_c, S - 1)
    ang = pos_m.to(tl.float32)[:, None] * tl.load(f_ptr + offs_d)[None, :]
    q_src = qkv_ptr + (row0 + tok_c.to(tl.int64))[:, None] * stride_row \
        + head_q[:, None] * D + offs_d[None, :]
    q1, q2 = _norm_rope(
        tl.load(q_src).to(tl.float32), tl.load(q_src + HALF).to(tl.float32),
        qw_ptr, offs_d, cos_f32(ang), sin_f32(ang), eps, D,
    )  # fmt: skip
    q1 = q1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    q2 = q2.to(qkv_ptr.dtype.element_ty).to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc1 = tl.zeros((BLOCK_M, HALF), tl.float32)
    acc2 = tl.zeros((BLOCK_M, HALF), tl.float32)
    # 1. the cached prefix: positions [0, start)
    for n0 in range(0, start, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < start
        at_n = offs_n.to(tl.int64)[:, None] * stride_cs + offs_d[None, :]
        ld = n_mask[:, None]
        m_i, l_i, acc1, acc2 = _update(
            q1, q2,
            tl.load(head_k + at_n, mask=ld, other=0.0),
            tl.load(head_k + at_n + HALF, mask=ld, other=0.0),
            tl.load(head_v + at_n, mask=ld, other=0.0),
            tl.load(head_v + at_n + HALF, mask=ld, other=0.0),
            n_mask[None, :], m_i, l_i, acc1, acc2, qk_scale, HALF_DOTS,
        )  # fmt: skip
    # 2. the new tokens up to this block's last (causal)
    for n0 in range(0, t0 + BLOCK_T, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nk1, nk2, nv1, nv2, _ = _keys(qkv_ptr, kw_ptr, f_ptr, row0, tl.minimum(offs_n, T - 1),
                                      start, S, stride_row, kvh, eps, cdt, HQ, HKV, D)  # fmt: skip
        visible = (offs_n[None, :] <= tok[:, None]) & (offs_n[None, :] < T)
        m_i, l_i, acc1, acc2 = _update(q1, q2, nk1, nk2, nv1, nv2, visible, m_i, l_i, acc1,
                                       acc2, qk_scale, HALF_DOTS)  # fmt: skip

    o1 = acc1 / l_i[:, None]
    o2 = acc2 / l_i[:, None]
    dst = out_ptr + (row0 + tok_c.to(tl.int64))[:, None] * stride_orow + head_q[:, None] * D \
        + offs_d[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_attention_triton(
    qkv: torch.Tensor,  # [B * T, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    freqs: torch.Tensor,
    start: torch.Tensor | None,  # [B] or None (every row from position 0)
    slots: torch.Tensor,  # [B]
    k_cache: torch.Tensor,  # [slots, Hkv, S, D]
    v_cache: torch.Tensor,
    T: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    R = qkv.shape[0]
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    check_qkv_caches(qkv, k_cache, v_cache, num_heads, num_kv_heads)
    B = R // T
    group = num_heads // num_kv_heads
    if group & (group - 1) or group > 32:
        raise ValueError(f"prefill_attention: query heads per KV head must be a power of two "
                         f"up to 32, got {group}")  # fmt: skip
    out = torch.empty((R, num_heads * D), dtype=qkv.dtype, device=qkv.device)
    block_t = max(1, 32 // group)  # 32 query rows a program (tl.dot needs >= 16)
    _prefill_attention_kernel[(B * num_kv_heads, triton.cdiv(T, block_t))](
        qkv, q_weight, k_weight, freqs, slots if start is None else start, slots, k_cache,
        v_cache, out, qkv.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), T, S, eps, scale * _LOG2E,
        HQ=num_heads, HKV=num_kv_heads, D=D, GROUP=group, BLOCK_T=block_t, BLOCK_N=32,
        HAS_START=start is not None,
        # Triton's interpreter (3.9) computes 16-bit dots wrongly (errors of 1e10 on unit
        # inputs): fp32 dots there, the same values
        HALF_DOTS=k_cache.element_size() == 2 and not interpret_mode(),
        **pdl_args(pdl_enabled(qkv)), num_warps=4,
    )  # fmt: skip
    return out
