"""Triton single-query GQA attention (flash-decoding).

Grid (B, Hkv, SPLITS): a program takes the GROUP = Hq / Hkv query heads that share one KV
head (padded to 16 rows for tl.dot) and one chunk of the row's positions, streams
[BLOCK_S, D] K/V tiles with an online softmax. SPLITS == 1 writes the output; otherwise
each split writes (m, l, unnormalised acc) and a combine kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, po_ptr, pml_ptr,
    stride_qb, stride_qh, stride_cslot, stride_ch, stride_cs, stride_ob, stride_oh,
    qk_scale, chunk,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    base = slot * stride_cslot + kvh.to(tl.int64) * stride_ch
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < end
        kv_offs = base + offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=s_mask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=s_mask[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_S], log2 units
        qk = tl.where(s_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # partials: po [B, Hq, SPLITS, D], pml [B, Hq, SPLITS, 2]
        row = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * SPLITS + sp
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(pml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _attn_combine_kernel(
    po_ptr, pml_ptr, out_ptr, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SP: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_sp = tl.arange(0, BLOCK_SP)
    offs_d = tl.arange(0, D)
    sp_mask = offs_sp < SPLITS
    row = (b * HQ + h).to(tl.int64) * SPLITS + offs_sp
    m = tl.load(pml_ptr + row * 2, mask=sp_mask, other=float("-inf"))
    lsum = tl.load(pml_ptr + row * 2 + 1, mask=sp_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    o = tl.load(po_ptr + row[:, None] * D + offs_d[None, :], mask=sp_mask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], axis=0)
    den = tl.sum(lsum * w, axis=0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, (num / den).to(out_ptr.dtype.element_ty))


def plan_splits(batch: int, kv_heads: int, max_len: int, block_s: int, sms: int = 132):
    """(splits, chunk): enough programs to cover ~2 waves, chunks of whole blocks."""
    blocks = triton.cdiv(max_len, block_s)
    want = max(1, triton.cdiv(2 * sms, batch * kv_heads))
    splits = min(blocks, want, 64)
    chunk = triton.cdiv(blocks, splits) * block_s
    return triton.cdiv(max_len, chunk), chunk


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int | None = None,
    scale: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    max_len = S if max_len is None else min(max_len, S)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous head_dim; k/v the same layout")
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    block_s = 16 if max_len <= 16 else 64
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits, chunk = plan_splits(B, Hkv, max_len, block_s, sms)
    else:
        chunk = triton.cdiv(triton.cdiv(max_len, splits), block_s) * block_s
        splits = triton.cdiv(max_len, chunk)
    out = torch.empty_like(q)
    if splits > 1:
        po = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
        pml = torch.empty((B, Hq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        po = pml = out
    pdl = pdl_enabled(q)
    _attn_split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, slots, lengths, out, po, pml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), scale * _LOG2E, chunk,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=D, BLOCK_S=block_s,
        SPLITS=splits, DOT_F32=interpret_mode(), **pdl_args(pdl), num_warps=4,
        num_stages=3,
    )  # fmt: skip
    if splits > 1:
        _attn_combine_kernel[(B, Hq)](
            po, pml, out, out.stride(0), out.stride(1),
            HQ=Hq, D=D, SPLITS=splits, BLOCK_SP=triton.next_power_of_2(splits),
            **pdl_args(pdl), num_warps=4,
        )  # fmt: skip
    return out
