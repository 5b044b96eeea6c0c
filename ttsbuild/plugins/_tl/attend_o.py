"""Triton: a decoder layer's attention (q/k norm, RoPE, K/V cache write, attention over a
short cache) and its o projection with the residual add, in one launch.

Grid (N tiles, rows, Hkv): program (n, i, g) attends KV group g of row i itself (the group's
GROUP query heads over the row's positions [0, pos], as `qk_norm_rope_attend` does: the
same `attend_group`) and multiplies the [GROUP * D] outputs by the o projection's columns of
those heads for its BLOCK_N output columns: split-K over the KV groups. Each group's
attention is recomputed by every N tile (a few thousand FMAs over a 16-position cache read
from L2), so no program waits for another's attention: the attention launch and its hop are
gone. The program of N tile 0 writes the group's new k/v into the cache.

The groups' fp32 partials go to a workspace; the last program of an (N tile, row) to arrive
(arrival counter, as `fused_linear`'s split-K) sums them in group order, scales (FP8 per
output channel), rounds to the activations' dtype as the eager linear does, adds the
residual and stores: deterministic. The attention output is rounded to the activations'
dtype before the product, as the unfused path stores it.

Under PDL the program loads, before waiting for the qkv projection, what older launches
wrote or nothing writes: its weight tile and the scale; the residual where the caller vouches
it was written before the qkv projection (residual_ready); positions, slots and the cached
keys/values below each position where they were (inputs_ready).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_early_reads, pdl_enabled
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl.fp8_linear import _MAX_TILES, _counters
from ttsbuild.plugins._tl.qk_norm_rope_attend import _LOG2E, attend_group, row_old_kv
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS


@triton.jit
def _attend_o_kernel(
    qkv_ptr, qw_ptr, kw_ptr, f_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
    w_ptr, s_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_row, stride_wn, stride_rm, stride_om, stride_cslot, stride_ch, stride_cs,
    eps, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
    RES_EARLY: tl.constexpr = False,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HALF)
    # the o projection's columns of the group's heads: [BLOCK_N, BLOCK_G, HALF] halves
    cols = (kvh * GROUP + offs_g)[None, :, None] * D + offs_d[None, None, :]
    w_at = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + cols
    w_mask = n_mask[:, None, None] & (offs_g < GROUP)[None, :, None]
    w1 = tl.load(w_at, mask=w_mask, other=0.0)
    w2 = tl.load(w_at + HALF, mask=w_mask, other=0.0)
    sc = 1.0
    if HAS_SCALE:
        sc = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    r_at = r_ptr + row * stride_rm + offs_n
    if RES_EARLY:  # the caller vouches the residual is older than the launch before this one
        r = tl.load(r_at, mask=n_mask, other=0.0).to(tl.float32)
    pos, slot, ok1, ok2, ov1, ov2 = row_old_kv(pos_ptr, slot_ptr, kc_ptr, vc_ptr, row, kvh,
                                               stride_cslot, stride_ch, stride_cs, D, BLOCK_S,
                                               PDL, EARLY)  # fmt: skip
    if not RES_EARLY:
        r = tl.load(r_at, mask=n_mask, other=0.0).to(tl.float32)
    o1, o2 = attend_group(
        qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, row, kvh, pos, slot,
        stride_row, stride_cslot, stride_ch, stride_cs, eps, qk_scale,
        ok1, ok2, ov1, ov2, pid_n == 0, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
    )  # fmt: skip
    X_DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    o1 = o1.to(X_DTYPE).to(tl.float32)  # the attention output as the unfused path stores it
    o2 = o2.to(X_DTYPE).to(tl.float32)
    part = tl.sum(tl.sum(w1.to(tl.float32) * o1[None, :, :], axis=2), axis=1)
    part += tl.sum(tl.sum(w2.to(tl.float32) * o2[None, :, :], axis=2), axis=1)  # [BLOCK_N]

    # split-K over the groups: partials [HKV, M, N] fp32; the last to arrive sums in order
    ws_at = ws_ptr + row * N + offs_n
    tl.store(ws_at + kvh * M * N, part, mask=n_mask)
    tl.debug_barrier()  # every thread's partial is issued before the release
    tile = row * tl.num_programs(0) + pid_n
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if arrived == HKV - 1:
        tot = tl.zeros((BLOCK_N,), tl.float32)
        for g in tl.static_range(HKV):
            tot += tl.load(ws_at + g * M * N, mask=n_mask, other=0.0, cache_modifier=".cg")
        y = (tot * sc).to(X_DTYPE).to(tl.float32) + r
        tl.store(out_ptr + row * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


def attend_o_residual_triton(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    freqs: torch.Tensor,  # [D / 2] fp32 RoPE inverse frequencies
    positions: torch.Tensor,  # [B] int
    slots: torch.Tensor,  # [B] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D], S <= MAX_POSITIONS
    v_cache: torch.Tensor,
    weight: torch.Tensor,  # [N, Hq * D] bf16/fp32/float8_e4m3fn: the o projection
    scale: torch.Tensor | None,  # [N] fp32 for FP8 weights
    residual: torch.Tensor,  # [B, N]
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale_qk: float,
    inputs_ready: bool = False,
    residual_ready: bool = False,
    block_n: int | None = None,
) -> torch.Tensor:
    B = qkv.shape[0]
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    N = weight.shape[0]
    check_qkv_caches(qkv, k_cache, v_cache, num_heads, num_kv_heads)
    if S > MAX_POSITIONS:
        raise ValueError(f"caches of more than {MAX_POSITIONS} positions take decode_attention")
    if weight.shape[1] != num_heads * D or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {num_heads * D}] row-major, got "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if residual.shape != (B, N) or residual.stride(1) != 1:
        raise ValueError(f"residual must be [{B}, {N}] row-major, got {tuple(residual.shape)}")
    out = torch.empty((B, N), dtype=residual.dtype, device=qkv.device)
    if B == 0:
        return out
    block_n = block_n or (32 if B == 1 else 64)
    grid = (triton.cdiv(N, block_n), B, num_kv_heads)
    if grid[0] * B > _MAX_TILES:
        raise ValueError("too many tiles for the arrival counters")
    ws = torch.empty(num_kv_heads * B * N, dtype=torch.float32, device=qkv.device)
    pdl = pdl_enabled(qkv)
    group = num_heads // num_kv_heads
    _attend_o_kernel[grid](
        qkv, q_weight, k_weight, freqs, positions.reshape(-1), slots.reshape(-1), k_cache,
        v_cache, weight, scale if scale is not None else weight, residual, out, ws,
        _counters(qkv.device),
        B, N, qkv.stride(0), weight.stride(0), residual.stride(0), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, scale_qk * _LOG2E,
        HQ=num_heads, HKV=num_kv_heads, D=D, GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=triton.next_power_of_2(S),
        BLOCK_N=block_n, HAS_SCALE=scale is not None,
        EARLY=inputs_ready and pdl_early_reads(), RES_EARLY=residual_ready and pdl_early_reads(),
        **pdl_args(pdl), num_warps=4,
    )  # fmt: skip
    return out
