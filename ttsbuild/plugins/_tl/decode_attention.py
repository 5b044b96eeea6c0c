"""Triton single-query GQA attention (flash-decoding).

Grid (B, Hkv, SPLITS): a program takes the GROUP = Hq / Hkv query heads that share one KV
head (padded to 16 rows for tl.dot) and one chunk of the row's positions, streams
[BLOCK_S, D] K/V tiles with an online softmax. SPLITS == 1 writes the output; otherwise
each split writes (m, l, unnormalised acc) and a combine kernel merges them.

`_qk_attend_split_kernel` is the talker's whole decode attention in one launch: q/k norm,
RoPE and the K/V cache write (`qk_norm_rope`) in each split's prologue, the combine by the
last split to arrive.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl._math import cos_f32, e4m3_value, pdl_prologue, sin_f32
from ttsbuild.plugins._tl.fp8_linear import _MAX_TILES, _counters
from ttsbuild.plugins._tl.qk_norm_rope_attend import _norm_rope
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, kv_cache_scales

_LOG2E = 1.4426950408889634
# Each row's positions split by its own length (DYNAMIC: chunk = its length / SPLITS, whole
# blocks) instead of by the cache's capacity. The splits are planned over the capacity (a
# captured graph's grid is fixed), so a row 200 positions into a 2048-position cache had its
# whole length in split 0 of 3 (16 rows): one program streamed all of it while the others
# exited. Per row, no split gets more positions than before and the same positions are
# covered. By default ("auto") only where a launch has more than one split (the talker's
# 1-32 rows; at one split a row's whole length is its split's anyway);
# TTSBUILD_ATTN_DYNAMIC_CHUNK=0 turns it off, =1 on for every launch (kv_fp8_attention.py
# times them).
# H200 2026-12-07 (benchmarks/runtime/2026-12-07-h200-bf16-heads-f16): 1.1-1.7x faster where
# the plan has several splits (16 rows: FP8 cache 23.8 -> 14.3 us at 600 positions), 0.8x
# where it has one (64 rows: the constexpr path alone costs that), level at 256; the engine
# at 1 / 64 / 256 rows level (talker 1.15 / 1.77 / 3.26 ms against 1.13 / 1.75 / 3.23).
# "auto", H100 2026-12-07 (benchmarks/runtime/2026-12-07-h100-rules, two processes a side):
# talker 1.43-1.46 against 1.49-1.50 ms at 16 rows, 1.62-1.64 against 1.74-1.75 at 32; level
# at 1 and 64 (1.09-1.10, 1.83-1.84 against 1.09-1.10, 1.82).
DYNAMIC_CHOICES = {"0": False, "1": True, "auto": "auto"}
_dynamic_env = os.environ.get("TTSBUILD_ATTN_DYNAMIC_CHUNK", "auto").strip().lower()
if _dynamic_env not in DYNAMIC_CHOICES:
    raise ValueError(f"TTSBUILD_ATTN_DYNAMIC_CHUNK: one of {sorted(DYNAMIC_CHOICES)}, not "
                     f"{_dynamic_env!r}")
DYNAMIC_CHUNK: bool | str = DYNAMIC_CHOICES[_dynamic_env]


def dynamic_for(choice: bool | str | None, splits: int) -> bool:
    """Whether a launch of `splits` splits divides each row's length (the DYNAMIC constexpr):
    choice True / False, "auto" (only with more than one split: with one, the row's whole
    length is its split's anyway, and the dynamic path measured 0.8x there), None:
    DYNAMIC_CHUNK's."""
    choice = DYNAMIC_CHUNK if choice is None else choice
    if choice not in (True, False, "auto"):
        raise ValueError(f"dynamic_chunk: True, False or 'auto', not {choice!r}")
    return bool(choice is True or (choice == "auto" and splits > 1))


# An FP8 cache's tiles widened to fp16 for the dot products (q and the softmax weights too)
# instead of bf16: e4m3 -> fp16 is one conversion instruction a pair of values on Hopper
# (cvt.rn.f16x2.e4m3x2), -> bf16 goes through fp16 and fp32 (two more a value). Exact for the
# cache (e4m3 fits fp16) and q (normed, rounded to bf16 first); the weights p round to 11
# bits instead of 8. Measured on an H200 (2026-12-07, benchmarks/runtime/2026-12-07-h200-bf16-
# heads-f16): the split kernel on an FP8 cache 135.4 -> 101.4 us at 256 rows x 600 positions,
# 58.8 -> 46.7 at 256 x 200, 39.0 -> 28.8 at 64 x 600 (2.0 -> 2.7 TB/s), 26.4 -> 19.0 at 16 x
# 600; the engine's talker step 3.23 -> 2.99 ms at 256 rows, 1.75 -> 1.66 at 64, 1.13 -> 1.07
# at 1. On by default for bf16 / fp16 activations (an fp32 engine's q keeps fp32 dots);
# TTSBUILD_ATTN_FP8_F16=0 keeps bf16 dots.
FP8_F16_DOT = os.environ.get("TTSBUILD_ATTN_FP8_F16", "1") == "1"


def f16_for(choice: bool | None, q_dtype: torch.dtype) -> bool:
    """Whether an FP8 cache's launch takes fp16 dots (the F16 constexpr): choice (None:
    FP8_F16_DOT) and q no wider than 16 bits (fp32 activations keep fp32 dots)."""
    return bool((FP8_F16_DOT if choice is None else choice) and q_dtype != torch.float32)


@triton.jit
def _online_step(qk, s_mask, v, m_i, l_i, acc):
    """One [BLOCK_S] tile of the online softmax: scores qk [BLOCK_G, BLOCK_S] (log2 units,
    masked by s_mask), values v [BLOCK_S, D] -> the running max, sum and accumulator."""
    qk = tl.where(s_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, po_ptr, pml_ptr,
    stride_qb, stride_qh, stride_cslot, stride_ch, stride_cs, stride_ob, stride_oh,
    qk_scale, v_scale, chunk,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr = False,
    PDL: tl.constexpr = False, DYNAMIC: tl.constexpr = False, F16: tl.constexpr = False,
):  # fmt: skip
    """KV_FP8: the caches hold e4m3 values: k's scale is folded into qk_scale, v's
    (v_scale) multiplies the accumulator once at the end. DYNAMIC: the splits divide the
    row's length, not the capacity (`chunk` ignored; DYNAMIC_CHUNK). F16 (with KV_FP8):
    the dots in fp16 (FP8_F16_DOT)."""
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
    if F16 and KV_FP8:  # (first: the interpreter runs this path too)
        q = q.to(tl.float16)
    elif DOT_F32:
        q = q.to(tl.float32)
    base = slot * stride_cslot + kvh.to(tl.int64) * stride_ch
    if DYNAMIC:
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_S) * BLOCK_S
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
        if DOT_F32 or KV_FP8:  # (e4m3 -> bf16 / fp16 is exact)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_S], log2 units
        m_i, l_i, acc = _online_step(qk, s_mask, v, m_i, l_i, acc)
    if KV_FP8:
        acc = acc * v_scale
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


# The split kernel's (BLOCK_S, num_warps, num_stages) for long caches (the talker's), by
# whether the cache is FP8. 2026-12-07 on an H100 (benchmarks/kernels/kv_fp8_attention.py):
# with these the FP8 cache read 1.8-2.4 TB/s where the bf16 one read 2.6-3.1 (256 rows), so
# the FP8 kernel is not yet bandwidth-bound; `--tiles` there sweeps others.
LONG_TILES = {False: (64, 4, 3), True: (64, 4, 3)}


def _tiles(batch: int, kv_heads: int, max_len: int, device: torch.device,
           splits: int | None, block_s: int | None = None) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_S, splits, chunk) of a launch: planned (`plan_splits`) or the given splits;
    BLOCK_S 16 for a short cache (the code predictor's), else block_s (default 64)."""
    block_s = 16 if max_len <= 16 else (block_s or 64)
    if splits is None:
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        splits, chunk = plan_splits(batch, kv_heads, max_len, block_s, sms)
    else:
        chunk = triton.cdiv(triton.cdiv(max_len, splits), block_s) * block_s
        splits = triton.cdiv(max_len, chunk)
    return block_s, splits, chunk


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int | None = None,
    scale: float | None = None,
    splits: int | None = None,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    tiles: tuple[int, int, int] | None = None,
    dynamic_chunk: bool | str | None = None,
    f16_dot: bool | None = None,
) -> torch.Tensor:
    """tiles: (BLOCK_S, num_warps, num_stages) for a long cache; None: LONG_TILES's (a
    short cache keeps BLOCK_S 16). dynamic_chunk: splits by each row's length (True, False,
    "auto": where there are several; None: DYNAMIC_CHUNK, `dynamic_for`). f16_dot: an FP8
    cache's dots in fp16 (None: FP8_F16_DOT; `f16_for`)."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    ks, vs = kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    max_len = S if max_len is None else min(max_len, S)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous head_dim; k/v the same layout")
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    kv_fp8 = k_cache.dtype == KV_FP8_DTYPE
    block_s, warps, stages = tiles or LONG_TILES[kv_fp8]
    block_s, splits, chunk = _tiles(B, Hkv, max_len, q.device, splits, block_s)
    if block_s == 16:  # a short cache: the tiles it was measured with
        warps, stages = 4, 3
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
        out.stride(0), out.stride(1), scale * ks * _LOG2E, vs, chunk,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=D, BLOCK_S=block_s,
        SPLITS=splits, DOT_F32=interpret_mode(), KV_FP8=kv_fp8,
        DYNAMIC=dynamic_for(dynamic_chunk, splits), F16=f16_for(f16_dot, q.dtype),
        **pdl_args(pdl), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _attn_combine_kernel[(B, Hq)](
            po, pml, out, out.stride(0), out.stride(1),
            HQ=Hq, D=D, SPLITS=splits, BLOCK_SP=triton.next_power_of_2(splits),
            **pdl_args(pdl), num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _qk_attend_split_kernel(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, out_ptr, po_ptr,
    pml_ptr, cnt_ptr, stride_row, stride_ob, stride_cslot, stride_ch, stride_cs, eps,
    qk_scale, k_scale, v_scale, chunk,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_SP: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr = False,
    PDL: tl.constexpr = False, DYNAMIC: tl.constexpr = False, F16: tl.constexpr = False,
):  # fmt: skip
    """qk_norm_rope + the split kernel + the combine kernel above in one launch: program
    (row, KV head, split) normalises and rotates its GROUP query heads and its KV head's new
    key from the row's packed qkv; the split holding the row's position writes the new k/v
    into the cache; every split attends its chunk of the positions below the position from
    the cache (written by earlier steps), the one holding the position adds the new token
    from registers (no store-to-load ordering needed); the last split of a (row, KV head)
    to arrive (atomic counter, reset by it) merges the splits in split order. KV_FP8: e4m3
    caches, the new k and v stored divided by k_scale / v_scale (`e4m3_value`); k_scale is
    folded into qk_scale, v_scale multiplies the accumulator at the end. DYNAMIC: the
    splits divide the row's pos + 1 positions, not the capacity (DYNAMIC_CHUNK). F16 (with
    KV_FP8): the dots in fp16 (FP8_F16_DOT)."""
    pdl_prologue(PDL)
    HALF: tl.constexpr = D // 2
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    src = qkv_ptr + b * stride_row
    offs_d = tl.arange(0, HALF)
    offs_full = tl.arange(0, D)
    ang = pos.to(tl.float32) * tl.load(f_ptr + offs_d)
    c = cos_f32(ang)[None, :]
    s = sin_f32(ang)[None, :]
    cdt = kc_ptr.dtype.element_ty
    qdt = qkv_ptr.dtype.element_ty

    # the GROUP query heads as [BLOCK_G, HALF] halves, rounded to q's dtype (as the unfused q)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g[:, None] < GROUP
    q_src = src + (kvh * GROUP + offs_g[:, None]) * D + offs_d[None, :]
    q1, q2 = _norm_rope(
        tl.load(q_src, mask=g_mask, other=0.0).to(tl.float32),
        tl.load(q_src + HALF, mask=g_mask, other=0.0).to(tl.float32),
        qw_ptr, offs_d, c, s, eps, D,
    )  # fmt: skip
    q1 = tl.where(g_mask, q1, 0.0).to(qdt)
    q2 = tl.where(g_mask, q2, 0.0).to(qdt)
    if F16 and KV_FP8:  # (first: the interpreter runs this path too)
        q1 = q1.to(tl.float16)
        q2 = q2.to(tl.float16)
    elif DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)

    head = slot * stride_cslot + kvh.to(tl.int64) * stride_ch
    if DYNAMIC:  # (every position 0..pos in exactly one split, pos in the last that works)
        chunk = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_S) * BLOCK_S
    start = sp * chunk
    holds_pos = (pos >= start) & (pos < start + chunk)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    end = tl.minimum(start + chunk, pos)  # the cached positions of this chunk: below pos
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < end
        at = head + offs_s[:, None].to(tl.int64) * stride_cs
        k1 = tl.load(kc_ptr + at + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        k2 = tl.load(kc_ptr + at + HALF + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + at + offs_full[None, :], mask=s_mask[:, None], other=0.0)
        if DOT_F32 or KV_FP8:  # (e4m3 -> bf16 / fp16 is exact)
            k1 = k1.to(q1.dtype)
            k2 = k2.to(q1.dtype)
            v = v.to(q1.dtype)
        qk = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * qk_scale  # log2 units
        m_i, l_i, acc = _online_step(qk, s_mask, v, m_i, l_i, acc)
    if holds_pos:
        # the new key and value, rounded as the cache stores them; written for later steps
        k_src = src + (HQ + kvh) * D + offs_d[None, :]
        kn1, kn2 = _norm_rope(
            tl.load(k_src).to(tl.float32), tl.load(k_src + HALF).to(tl.float32),
            kw_ptr, offs_d, c, s, eps, D,
        )  # fmt: skip
        vn = tl.load(src + (HQ + HKV + kvh) * D + offs_full)
        if KV_FP8:
            kn1 = e4m3_value(kn1, k_scale)
            kn2 = e4m3_value(kn2, k_scale)
            vn = e4m3_value(vn.to(tl.float32), v_scale)
        kn1, kn2, vn = kn1.to(cdt), kn2.to(cdt), vn.to(cdt)
        new_at = head + pos * stride_cs
        tl.store(kc_ptr + new_at + offs_d[None, :], kn1)
        tl.store(kc_ptr + new_at + HALF + offs_d[None, :], kn2)
        tl.store(vc_ptr + new_at + offs_full, vn)
        score = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32), axis=1)
        score += tl.sum(q2.to(tl.float32) * kn2.to(tl.float32), axis=1)
        score = score * qk_scale  # [BLOCK_G]
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(score - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
        m_i = m_new
    if KV_FP8:
        acc = acc * v_scale
    heads = kvh * GROUP + offs_g
    if SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * D + offs_full[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask)
    else:
        # partials: po [B, Hq, SPLITS, D], pml [B, Hq, SPLITS, 2], as the split kernel's
        prow = (b * HQ + heads).to(tl.int64) * SPLITS + sp
        tl.store(po_ptr + prow[:, None] * D + offs_full[None, :], acc, mask=g_mask)
        tl.store(pml_ptr + prow * 2, m_i, mask=offs_g < GROUP)
        tl.store(pml_ptr + prow * 2 + 1, l_i, mask=offs_g < GROUP)
        tl.debug_barrier()
        item = b * HKV + kvh
        arrived = tl.atomic_add(cnt_ptr + item, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            offs_sp = tl.arange(0, BLOCK_SP)
            sp_mask = offs_sp < SPLITS
            for g in tl.static_range(GROUP):
                row = (b * HQ + kvh * GROUP + g) * SPLITS + offs_sp
                m = tl.load(pml_ptr + row * 2, mask=sp_mask, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
                lsum = tl.load(pml_ptr + row * 2 + 1, mask=sp_mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                w = tl.where(m > float("-inf"), tl.exp2(m - tl.max(m, axis=0)), 0.0)
                o = tl.load(po_ptr + row[:, None] * D + offs_full[None, :], mask=sp_mask[:, None],
                            other=0.0, cache_modifier=".cg")  # fmt: skip
                num = tl.sum(o * w[:, None], axis=0)
                den = tl.sum(lsum * w, axis=0)
                dst = out_ptr + b * stride_ob + (kvh * GROUP + g) * D + offs_full
                tl.store(dst, (num / den).to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + item, 0)


def qk_norm_rope_decode_attention_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    max_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
    splits: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    dynamic_chunk: bool | str | None = None,
    f16_dot: bool | None = None,
) -> torch.Tensor:
    """The attention output [R, Hq * D] (see `_qk_attend_split_kernel`); dynamic_chunk and
    f16_dot as `decode_attention_triton`'s."""
    R = qkv.shape[0]
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    check_qkv_caches(qkv, k_cache, v_cache, num_heads, num_kv_heads)
    ks, vs = kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    max_len = min(max_len, S)
    group = num_heads // num_kv_heads
    out = torch.empty((R, num_heads * D), dtype=qkv.dtype, device=qkv.device)
    if R == 0:
        return out
    block_s, splits, chunk = _tiles(R, num_kv_heads, max_len, qkv.device, splits)
    if R * num_kv_heads > _MAX_TILES:
        raise ValueError(f"{R} rows x {num_kv_heads} KV heads exceed the {_MAX_TILES} counters")
    if splits > 1:
        po = torch.empty((R, num_heads, splits, D), dtype=torch.float32, device=qkv.device)
        pml = torch.empty((R, num_heads, splits, 2), dtype=torch.float32, device=qkv.device)
    else:
        po = pml = out
    _qk_attend_split_kernel[(R, num_kv_heads, splits)](
        qkv, q_weight, k_weight, freqs, positions.reshape(-1), slots.reshape(-1), k_cache,
        v_cache, out, po, pml, _counters(qkv.device), qkv.stride(0), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, scale * ks * _LOG2E, ks,
        vs, chunk, HQ=num_heads, HKV=num_kv_heads, D=D, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_S=block_s, SPLITS=splits,
        BLOCK_SP=triton.next_power_of_2(splits), DOT_F32=interpret_mode(),
        KV_FP8=k_cache.dtype == KV_FP8_DTYPE,
        DYNAMIC=dynamic_for(dynamic_chunk, splits), F16=f16_for(f16_dot, qkv.dtype),
        **pdl_args(pdl_enabled(qkv)), num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
