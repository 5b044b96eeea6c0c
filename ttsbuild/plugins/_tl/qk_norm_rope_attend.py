"""Triton: q/k RMSNorm + RoPE + K/V cache write + attention over a short cache, one launch.

Grid (rows, Hkv): a program owns one KV head of one row and the GROUP = Hq / Hkv query
heads that read it. It normalises and rotates its k head (as two D/2 halves, so
rotate-half is register arithmetic), writes k and v into the cache at the row's position,
normalises and rotates its q heads, then attends over the row's positions [0, pos] in one
[BLOCK_S] tile held in registers (the code predictor's cache has 16 positions). The new
key/value enter the tile from registers, not from the cache just written, so no barrier
between the store and the loads is needed. fp32 math, one rounding of q/k/v to the cache
dtype (as the unfused kernels store them). Several tokens of a row in one call: in turn in
the row's program, or (TOKENS_PARALLEL) a program per token, grid (rows, Hkv, tokens).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_early_reads, pdl_enabled
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl._math import cos_f32, pdl_prologue, sin_f32
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS

_LOG2E = 1.4426950408889634
# Several tokens of a row in one call (the code predictor's two-token first pass, the
# speculative verify pass's k + 1) as one program per token (the kernel's PARALLEL form:
# each recomputes the call's earlier keys and values from qkv) instead of one
# program per row running its tokens in turn. The H200 profile of 2026-12-05
# (benchmarks/spec/2026-12-05-h200-profile/): 28 us a launch at 4 tokens against 4.8 us at
# one. On the H200 the same day (benchmarks/spec/2026-12-05-h200-tokens-parallel/): 13 us a
# launch at 4 tokens, the self-speculative frame at batch 1 1.54 ms against 2.02 without
# speculation (peaked stand-in, window 3), the plain frame unchanged (2.03 against 2.02).
# On by default; TTSBUILD_ATTEND_TOKENS_PARALLEL=0 runs the tokens in turn.
TOKENS_PARALLEL = os.environ.get("TTSBUILD_ATTEND_TOKENS_PARALLEL", "1") == "1"


@triton.jit
def _norm_rope(x1, x2, w_ptr, offs_d, c, s, eps, D: tl.constexpr):
    """RMSNorm (fp32) of heads given as halves [H, D/2], times the weight, then RoPE."""
    HALF: tl.constexpr = D // 2
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    r = (1.0 / tl.sqrt_rn(ms + eps))[:, None]
    y1 = x1 * r * tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
    y2 = x2 * r * tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
    return y1 * c - y2 * s, y2 * c + y1 * s


@triton.jit
def old_kv(kc_ptr, vc_ptr, kvh, pos, slot, stride_cslot, stride_ch, stride_cs,
           D: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """The cached keys/values of positions [0, pos) of one (slot, KV head) as [BLOCK_S, D/2]
    halves (zeros elsewhere): written by earlier steps, so a PDL kernel may read them before
    waiting for the kernel right before it, where pos and slot are old too."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    offs_s = tl.arange(0, BLOCK_S)
    old = (offs_s[:, None] < pos) & (offs_d[None, :] < HALF)
    at = offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
    head = kc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch
    vhead = vc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch
    k1 = tl.load(head + at, mask=old, other=0.0)
    k2 = tl.load(head + at + HALF, mask=old, other=0.0)
    v1 = tl.load(vhead + at, mask=old, other=0.0)
    v2 = tl.load(vhead + at + HALF, mask=old, other=0.0)
    return k1, k2, v1, v2


@triton.jit
def row_old_kv(pos_ptr, slot_ptr, kc_ptr, vc_ptr, row, kvh, stride_cslot, stride_ch, stride_cs,
               D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
               EARLY: tl.constexpr):  # fmt: skip
    """The row's position and slot and its KV head's cached entries below the position
    (`old_kv`): (pos, slot, ok1, ok2, ov1, ov2). With EARLY (all written two or more
    launches back) read before the PDL wait, else after it; the wait is passed either way."""
    if not EARLY:
        pdl_prologue(PDL)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    ok1, ok2, ov1, ov2 = old_kv(kc_ptr, vc_ptr, kvh, pos, slot, stride_cslot, stride_ch,
                                stride_cs, D, BLOCK_S)  # fmt: skip
    if EARLY:
        pdl_prologue(PDL)
    return pos, slot, ok1, ok2, ov1, ov2


@triton.jit
def kv_group_of(head, HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr):
    """The KV group of packed qkv head `head` (q heads 0..HQ-1, then HKV k heads, then HKV v
    heads): what a qkv tile counts toward where the last writer of a group attends it."""
    return tl.where(
        head < HQ, head // GROUP, tl.where(head < HQ + HKV, head - HQ, head - HQ - HKV)
    )


@triton.jit
def new_kv(qkv_ptr, kw_ptr, kc_ptr, row, kvh, c, s, stride_row, eps,
           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """qkv row `row`'s key (RMSNorm + RoPE at the angle's cos c and sin s) and value of KV
    head kvh as [1, D/2] halves, rounded as the cache stores them (read with .cg)."""
    HALF: tl.constexpr = D // 2
    src = qkv_ptr + row * stride_row
    offs_d = tl.arange(0, HALF)
    cdt = kc_ptr.dtype.element_ty
    k_src = src + (HQ + kvh) * D + offs_d[None, :]
    k1, k2 = _norm_rope(
        tl.load(k_src, cache_modifier=".cg").to(tl.float32),
        tl.load(k_src + HALF, cache_modifier=".cg").to(tl.float32),
        kw_ptr, offs_d, c, s, eps, D,
    )  # fmt: skip
    v_src = src + (HQ + HKV + kvh) * D + offs_d[None, :]
    v1 = tl.load(v_src, cache_modifier=".cg").to(cdt)
    v2 = tl.load(v_src + HALF, cache_modifier=".cg").to(cdt)
    return k1.to(cdt), k2.to(cdt), v1, v2


@triton.jit
def store_kv(kc_ptr, vc_ptr, kvh, pos, slot, k1, k2, v1, v2, stride_cslot, stride_ch,
             stride_cs, D: tl.constexpr):  # fmt: skip
    """A key and value ([1, D/2] halves) into the caches of (slot, kvh) at `pos`."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    head = kc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch
    new_at = pos * stride_cs + offs_d[None, :]
    tl.store(head + new_at, k1)
    tl.store(head + new_at + HALF, k2)
    vhead = vc_ptr + slot * stride_cslot + tl.cast(kvh, tl.int64) * stride_ch
    tl.store(vhead + new_at, v1)
    tl.store(vhead + new_at + HALF, v2)


@triton.jit
def attend_tile(qkv_ptr, qw_ptr, row, kvh, pos, c, s, kt1, kt2, vt1, vt2, stride_row, eps,
                qk_scale, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_S: tl.constexpr):  # fmt: skip
    """The GROUP query heads of KV head kvh in qkv row `row` (RMSNorm + RoPE at c, s; rounded
    to q's dtype as the unfused q) attended over the fp32 key/value tile's positions
    [0, pos]: [BLOCK_G, D/2] halves (rows past GROUP zero)."""
    HALF: tl.constexpr = D // 2
    src = qkv_ptr + row * stride_row
    offs_d = tl.arange(0, HALF)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g[:, None] < GROUP
    q_src = src + (kvh * GROUP + offs_g[:, None]) * D + offs_d[None, :]
    q1, q2 = _norm_rope(
        tl.load(q_src, mask=g_mask, other=0.0, cache_modifier=".cg").to(tl.float32),
        tl.load(q_src + HALF, mask=g_mask, other=0.0, cache_modifier=".cg").to(tl.float32),
        qw_ptr, offs_d, c, s, eps, D,
    )  # fmt: skip
    q1 = q1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    q2 = q2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    scores = tl.sum(q1[:, None, :] * kt1[None, :, :], axis=2)
    scores += tl.sum(q2[:, None, :] * kt2[None, :, :], axis=2)  # [BLOCK_G, BLOCK_S]
    scores = tl.where(offs_s[None, :] <= pos, scores * qk_scale, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    o1 = tl.sum(p[:, :, None] * vt1[None, :, :], axis=1)  # [BLOCK_G, HALF]
    o2 = tl.sum(p[:, :, None] * vt2[None, :, :], axis=1)
    return tl.where(g_mask, o1, 0.0), tl.where(g_mask, o2, 0.0)


@triton.jit
def attend_group(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, row, kvh, pos, slot,
    stride_row, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
    ok1, ok2, ov1, ov2, store_kv_too,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One (row, KV head): its k/v into the cache at `pos` (where store_kv_too), its GROUP
    query heads attended over positions [0, pos] (ok1..ov2: the cached ones below pos, from
    `old_kv`). Returns the heads' outputs as fp32 [BLOCK_G, D/2] halves (rows past GROUP
    zero). q/k/v are read with .cg (L2, not a stale L1 line), so a persistent kernel can call
    this on qkv written by other programs (plugins/_tl/cp_pass)."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    ang = pos.to(tl.float32) * tl.load(f_ptr + offs_d)
    c = cos_f32(ang)[None, :]
    s = sin_f32(ang)[None, :]
    k1, k2, v1, v2 = new_kv(qkv_ptr, kw_ptr, kc_ptr, row, kvh, c, s, stride_row, eps, HQ, HKV,
                            D)  # fmt: skip
    if store_kv_too:
        store_kv(kc_ptr, vc_ptr, kvh, pos, slot, k1, k2, v1, v2, stride_cslot, stride_ch,
                 stride_cs, D)  # fmt: skip
    # keys/values [BLOCK_S, HALF] of positions [0, pos]; the new ones from registers
    is_new = tl.arange(0, BLOCK_S)[:, None] == pos
    kt1 = tl.where(is_new, k1, ok1).to(tl.float32)
    kt2 = tl.where(is_new, k2, ok2).to(tl.float32)
    vt1 = tl.where(is_new, v1, ov1).to(tl.float32)
    vt2 = tl.where(is_new, v2, ov2).to(tl.float32)
    return attend_tile(qkv_ptr, qw_ptr, row, kvh, pos, c, s, kt1, kt2, vt1, vt2, stride_row,
                       eps, qk_scale, D, GROUP, BLOCK_G, BLOCK_S)  # fmt: skip


@triton.jit
def attend_item(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, out_ptr, row, kvh, pos, slot,
    stride_row, stride_orow, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
    ok1, ok2, ov1, ov2,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """`attend_group` (the k/v stored), its heads' outputs stored in out's row."""
    o1, o2 = attend_group(
        qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, row, kvh, pos, slot,
        stride_row, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
        ok1, ok2, ov1, ov2, True, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
    )  # fmt: skip
    store_heads(out_ptr, row, kvh, o1, o2, stride_orow, D, GROUP, BLOCK_G)


@triton.jit
def store_heads(out_ptr, row, kvh, o1, o2, stride_orow, D: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_G: tl.constexpr):  # fmt: skip
    """The GROUP heads' outputs ([BLOCK_G, D/2] halves) into out's row."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g[:, None] < GROUP
    dst = out_ptr + row * stride_orow + (kvh * GROUP + offs_g[:, None]) * D + offs_d[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=g_mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=g_mask)


@triton.jit
def _qk_norm_rope_attend_kernel(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, out_ptr,
    stride_row, stride_orow, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False, TOKENS: tl.constexpr = 1, B=1,
    PARALLEL: tl.constexpr = False,
):  # fmt: skip
    # EARLY: positions, slots and the cached entries below each position were written two or
    # more launches back: read before the PDL wait (only qkv is the previous kernel's).
    # TOKENS > 1: qkv rows i, i + B, ..., i + (TOKENS - 1) B are row i's tokens, at positions
    # pos[i] + t of slot slots[i]. Program (i, kvh) runs them in turn; token t > 0 reads the
    # entries tokens 0..t-1 wrote (this program's own stores: a barrier between, no other
    # program involved). PARALLEL: program (i, kvh, t) runs token t alone; the call's own
    # tokens enter its tile from registers, each program computing their keys and values from
    # qkv itself (later ones are masked by the causal limit), so no program reads what another
    # of this launch writes; it stores its own token's k/v only.
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    pos, slot, ok1, ok2, ov1, ov2 = row_old_kv(pos_ptr, slot_ptr, kc_ptr, vc_ptr, row, kvh,
                                               stride_cslot, stride_ch, stride_cs, D, BLOCK_S,
                                               PDL, EARLY)  # fmt: skip
    if PARALLEL:
        t = tl.program_id(2)
        HALF: tl.constexpr = D // 2
        f = tl.load(f_ptr + tl.arange(0, HALF))
        offs_s = tl.arange(0, BLOCK_S)
        kt1, kt2 = ok1.to(tl.float32), ok2.to(tl.float32)
        vt1, vt2 = ov1.to(tl.float32), ov2.to(tl.float32)
        for u in tl.static_range(TOKENS):
            ang = (pos + u).to(tl.float32) * f
            k1, k2, v1, v2 = new_kv(qkv_ptr, kw_ptr, kc_ptr, row + u * B, kvh,
                                    cos_f32(ang)[None, :], sin_f32(ang)[None, :], stride_row,
                                    eps, HQ, HKV, D)  # fmt: skip
            at = offs_s[:, None] == pos + u
            kt1 = tl.where(at, k1.to(tl.float32), kt1)
            kt2 = tl.where(at, k2.to(tl.float32), kt2)
            vt1 = tl.where(at, v1.to(tl.float32), vt1)
            vt2 = tl.where(at, v2.to(tl.float32), vt2)
            if t == u:
                store_kv(kc_ptr, vc_ptr, kvh, pos + u, slot, k1, k2, v1, v2, stride_cslot,
                         stride_ch, stride_cs, D)  # fmt: skip
        ang = (pos + t).to(tl.float32) * f
        o1, o2 = attend_tile(qkv_ptr, qw_ptr, row + t * B, kvh, pos + t, cos_f32(ang)[None, :],
                             sin_f32(ang)[None, :], kt1, kt2, vt1, vt2, stride_row, eps,
                             qk_scale, D, GROUP, BLOCK_G, BLOCK_S)  # fmt: skip
        store_heads(out_ptr, row + t * B, kvh, o1, o2, stride_orow, D, GROUP, BLOCK_G)
    else:
        attend_item(
            qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, out_ptr, row, kvh, pos, slot,
            stride_row, stride_orow, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
            ok1, ok2, ov1, ov2, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
        )  # fmt: skip
        for t in tl.static_range(1, TOKENS):
            tl.debug_barrier()  # token t - 1's cache stores precede token t's loads (one CTA)
            ok1, ok2, ov1, ov2 = old_kv(kc_ptr, vc_ptr, kvh, pos + t, slot, stride_cslot,
                                        stride_ch, stride_cs, D, BLOCK_S)  # fmt: skip
            attend_item(
                qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, out_ptr, row + t * B, kvh,
                pos + t, slot, stride_row, stride_orow, stride_cslot, stride_ch, stride_cs,
                eps, qk_scale, ok1, ok2, ov1, ov2, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
            )  # fmt: skip


def qk_norm_rope_attend_triton(
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
    scale: float,
    inputs_ready: bool = False,
    tokens: int = 1,
) -> torch.Tensor:
    R = qkv.shape[0]
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    check_qkv_caches(qkv, k_cache, v_cache, num_heads, num_kv_heads)
    if S > MAX_POSITIONS:
        raise ValueError(f"caches of more than {MAX_POSITIONS} positions take decode_attention")
    group = num_heads // num_kv_heads
    out = torch.empty((R, num_heads * D), dtype=qkv.dtype, device=qkv.device)
    if R == 0:
        return out
    pdl = pdl_enabled(qkv)
    B = R // tokens
    parallel = tokens > 1 and TOKENS_PARALLEL
    _qk_norm_rope_attend_kernel[(B, num_kv_heads, tokens if parallel else 1)](
        qkv, q_weight, k_weight, freqs, positions.reshape(-1), slots.reshape(-1),
        k_cache, v_cache, out, qkv.stride(0), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, scale * _LOG2E,
        HQ=num_heads, HKV=num_kv_heads, D=D, GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=triton.next_power_of_2(S),
        EARLY=inputs_ready and pdl_early_reads(), TOKENS=tokens, B=B, PARALLEL=parallel,
        **pdl_args(pdl),
        num_warps=4,
    )  # fmt: skip
    return out
