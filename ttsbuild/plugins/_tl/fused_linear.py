"""Triton: one skinny GEMM/GEMV with the decoder block's neighbours fused around it.

out[m, n] = epilogue(scale[n] * sum_k prologue(x)[m, k] * w[n, k]), fp32 accumulation.

Prologue: GATHER takes row idx[m] of a table instead of row m. PRE_NORM: RMSNorm is
w_norm * x * rstd[m] with one rstd per row, so the K loop multiplies x by the norm weight
(rounded once to x's dtype for the MMA) while summing x^2 of the same tiles, and rstd scales
the accumulator in the epilogue: no extra pass over x, and split-K partials each carry their
slice's sum of squares. (Eager RMSNorm rounds x * rstd to x's dtype before the weight; here
the one rounding is of x * w_norm: the same size of error, in another place.)
Epilogue: HAS_SCALE (FP8 per-output-channel scale), HAS_BIAS, GATE_UP (w is the packed
[2N, K] gate/up matrix: the program streams gate rows n and up rows N + n in the same K
loop and writes silu(gate) * up), HAS_RES (adds the residual: out is the new residual).

Tiles: M == 1 is a GEMV (elementwise products, one reduction at the end); otherwise
"swap AB" tensor-core tiles acc[BLOCK_N, BLOCK_M] += w_tile @ x_tile^T (the weight fills the
MMA's wide side, the <= 64 rows its narrow side), so each weight tile is read once for all
rows. Split-K when the N tiles alone cannot fill the SMs: each split writes an fp32 partial,
the last to arrive (atomic counter, reset by it) sums them in split order and runs the
epilogue: one launch, deterministic. Configs are fixed per shape (`plan`): no autotuning.

`_norm_linear_attend_kernel` is the qkv GEMV followed, in the same launch, by
`qk_norm_rope_attend`'s work (its helpers `old_kv` / `attend_item`). Tiles are narrowed to lie
within one head, so each belongs to one KV group (its q heads, k head and v head). The
program that writes a tile's output (every program without split-K, the last split with it)
counts the tile on its group's counter (acq_rel, after a CTA barrier: split-K's protocol);
the one that completes the group's (GROUP + 2) * D / BLOCK_N tiles (times the M tiles) runs
the group's cache write and attention for every row, reading qkv through L2, and resets the
counter. No program waits for another, so any scheduling order completes.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins import ring_attention as _ring
from ttsbuild.plugins._dispatch import (
    bulk_prefetchable,
    interpret_mode,
    pdl_args,
    pdl_early_reads,
    pdl_enabled,
)
from ttsbuild.plugins._tl import sampling as _sampling
from ttsbuild.plugins._tl._layout import check_qkv_caches
from ttsbuild.plugins._tl._math import exp_f32, l2_prefetch_tile, pdl_prologue
from ttsbuild.plugins._tl.fp8_linear import _MAX_TILES, _counters, _num_sms, wo_config
from ttsbuild.plugins._tl.qk_norm_rope_attend import _LOG2E, attend_item, kv_group_of, old_kv
from ttsbuild.plugins._tl.sampling import sample_row
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS
from ttsbuild.plugins.ring_attention import ring_rope_item

_MAX_SPLIT = 8
# Under PDL, load the first weight block before waiting for the previous kernel.
# TTSBUILD_PDL_PREFETCH=0 turns it off (side-by-side measurements).
_PREFETCH = os.environ.get("TTSBUILD_PDL_PREFETCH", "1") != "0"
# K blocks of a GEMV (M = 1) program loaded before the wait; tensor-core tiles prefetch one.
# 2 (a CP GEMV program's whole K range) timed faster than 1 on the H200: the fused code
# predictor frame at batch 1, 2.410 -> 2.314 ms, equal at batch 8 and 64
# (benchmarks/kernels/RESULTS.md); TTSBUILD_PDL_PREFETCH_BLOCKS=1 for one.
_PREFETCH_BLOCKS_ENV = os.environ.get("TTSBUILD_PDL_PREFETCH_BLOCKS", "2")
if _PREFETCH_BLOCKS_ENV not in ("1", "2"):
    raise ValueError(f"TTSBUILD_PDL_PREFETCH_BLOCKS must be 1 or 2, got {_PREFETCH_BLOCKS_ENV!r}")
_PREFETCH_BLOCKS = int(_PREFETCH_BLOCKS_ENV)
# Under PDL a program also brings its whole weight tile into L2 before waiting for the
# previous kernel (one `cp.async.bulk.prefetch.L2` from thread 0; tiles without split-K, whose
# rows are one contiguous block): the K blocks past the ones loaded early then come from L2,
# not HBM. Off until timed on the GPU (TTSBUILD_PDL_L2_AHEAD=1; read at each launch).
L2_AHEAD = os.environ.get("TTSBUILD_PDL_L2_AHEAD", "0") == "1"
# A GEMV (M = 1) whose 16-column tiles leave SMs idle: 8-column tiles (one program per 8
# columns, no split-K: no partials, atomic and second pass) when that fills the SMs, instead
# of split-K. Measured on the H200: the code predictor's frame at batch 1 2.104 -> 2.084 ms
# and at batch 8 2.835 -> 2.822 ms (benchmarks/kernels/RESULTS.md, session 6);
# TTSBUILD_GEMV_NARROW=0 for the split-K tiles.
_GEMV_NARROW = os.environ.get("TTSBUILD_GEMV_NARROW", "1") != "0"
# fp32 activations (the codec's pre-transformer) with at most this many rows: one GEMV program
# per row and column tile (BLOCK_M 1) instead of 16-row tiles through tl.dot, which for fp32
# is the IEEE (non-tensor-core) path. H200, 2026-12-03: the codec's pre-transformer as fused
# linears cost 0.745 ms a step at 1 frame (a GEMV) but 2.595 / 2.929 ms at 2 / 16 frames
# (16-row tiles), against 0.978 / 1.454 unfused; as GEMVs 0.742 / 0.824 / 0.935 / 1.029 /
# 1.507 ms at 1 / 2 / 4 / 8 / 16 rows (benchmarks/codec/RESULTS.md). The codec asks for it
# per call (fused_linear's gemv_rows_f32, its fused_layers_max_rows); this is the default of
# every other caller (fp32 models in checks): 0, off.
_GEMV_ROWS_F32 = int(os.environ.get("TTSBUILD_GEMV_ROWS_F32", "0"))
# Half-precision activations of 2 to GEMV_FEW_ROWS_MAX rows (every caller's: the code
# predictor's passes at batch 2-4 and its two-token first pass at batch 1-2, the speculative
# verify pass's k + 1 positions of a row, the codec's fused layers where half) as GEMVs, a
# program per row and column tile, instead of 16-row tensor-core tiles: the H200 profile of
# 2026-12-05 had the verify pass's linears at 4 rows 6.9 us a launch against 5.5 us at one
# (benchmarks/spec/2026-12-05-h200-profile/). Timed the same day
# (benchmarks/spec/2026-12-05-h200-tokens-parallel/): the self-speculative frame at batch 1
# 1.72 ms with it against 1.54 without, so off (TTSBUILD_GEMV_FEW_ROWS=1; read at each
# launch, so bench_switches can flip it; the plain frame at batch 2-4 is not yet timed).
GEMV_FEW_ROWS = os.environ.get("TTSBUILD_GEMV_FEW_ROWS", "0") == "1"
GEMV_FEW_ROWS_MAX = 4
# The K block of fp32-activation GEMVs (the codec pre-transformer's fused layers; gate/up
# tiles half of it), 0: the default (512, gate/up 256). An offline sm_90 compile has the
# qkv GEMV's program at 212 registers a thread with the default 16 x 512 fp32 accumulator and
# two weight blocks loaded ahead, and its N = 512 linears run 64 programs on 132 SMs; a
# smaller block splits K further (up to 8 ways) at fewer registers. A sweep knob for the
# GPU (TTSBUILD_GEMV_F32_BLOCK_K=128 or 256; not yet timed).
GEMV_F32_BLOCK_K = int(os.environ.get("TTSBUILD_GEMV_F32_BLOCK_K", "0"))
# Half-precision tiles of 17-64 rows on the weight-only FP8 tiles' rule (`fp8_linear.wo_config`:
# 64 x 256 weight tiles, 128-wide K blocks where the N tiles fill the SMs or for gate/up,
# split-K to half a wave, 4 warps, 3 stages) instead of `plan`'s 64 x 128 tiles split to a
# full wave: TTSBUILD_FUSED_WO_RULE=1. The fused code predictor lost 0.9 ms a frame to the
# unfused path at 64 rows (H100, benchmarks/runtime/2026-12-07-h100-cp-bf16); off (read at
# import): the H100 sweep (benchmarks/runtime/2026-12-07-h100-rules) has the fused linears
# slower than the plain weight-only ones past 16 rows whatever the tiles.
FUSED_WO_RULE = os.environ.get("TTSBUILD_FUSED_WO_RULE", "0") == "1"
# 16-row tiles (2-16 rows: the fused code predictor's default buckets past the GEMV) of FP8
# weights and half-precision activations: `plan`'s split, then 256-wide K blocks where each
# split's K holds whole ones (not gate/up), else 32-column weight tiles. An H100 sweep of the
# code predictor's four fused linears at 16 rows (benchmarks/runtime/2026-12-07-h100-rules,
# sweep_fused_cp.json; back to back in a graph, weights rotated past L2) timed these
# 6.15 / 4.82 / 8.29 / 5.79 us (qkv 64 x 256 split 4, o 64 x 256 split 8, gate/up 32 x 128
# split 4, down 32 x 128 split 8; each the best or within 4 % of it) against `plan`'s 64 x
# 128 tiles' 7.33 / 5.31 / 8.79 / 6.13: 2.5 us a layer, ~0.19 ms of a frame's 75 layer
# passes. In the engine (H100, benchmarks/runtime/2026-12-08-h100-l2) the code predictor at
# 16 rows took 3.24 ms a frame with them against 2.85 without: off. TTSBUILD_FUSED_TILE16=1
# (read at import).
FUSED_TILE16 = os.environ.get("TTSBUILD_FUSED_TILE16", "0") == "1"
# One-row GEMVs of FP8 weights on the weight-only kernel's GEMV rule (`fp8_linear.wo_config`
# at one row: 8 weight rows a program, K blocks of 1024 (256 where the programs fill eight
# waves), no split, 4 warps, 3 stages: the configs the engine's own autotuner picks for the
# talker's plain GEMVs) where those 8-row programs fill a wave, instead of `plan`'s 16 x 512
# tiles split to a wave. Why: the fused talker step (`decode_fused`: the norms and residual
# adds inside the linears, fewer launches a layer than the unfused path) has been level
# with the unfused one since PDL (unfused / fused 1.072 / 1.026 and 1.059 / 1.088 ms in two
# processes, benchmarks/kernels/RESULTS.md), its GEMVs slower than `fp8_linear`'s at the
# talker's K of 2048-6144 (a step 1.46 against 1.26 ms before PDL): on the plain GEMVs'
# tiles the launches it saves would show. Gate/up (two 8-row weight tiles a program) keeps K
# blocks of at most 512 (the plain GEMV's accumulator). TTSBUILD_FUSED_GEMV_RULE=1; off
# until timed (`bench_talker.py` and `bench_cp_fused.py`: gpu_session step `gemvrule`; read
# at import).
FUSED_GEMV_RULE = os.environ.get("TTSBUILD_FUSED_GEMV_RULE", "0") == "1"


@triton.jit
def _mac(acc, w, xt, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr):
    # One return at the end: Triton compiles the code after an early return inside a
    # constexpr branch too (the GEMV's [BLOCK_N, BLOCK_K] accumulator then fails tl.dot).
    if BLOCK_M == 1:  # GEMV: acc is [BLOCK_N, BLOCK_K], reduced after the loop
        out = acc + w.to(tl.float32) * tl.sum(xt.to(tl.float32), axis=1)[None, :]
    elif DOT_F32:  # fp32 models (IEEE, not TF32), and the interpreter (mis-rounds fp8->bf16)
        out = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:  # TF32 for fp32 operands (said here: TRITON_F32_DEFAULT may ask for IEEE)
        out = tl.dot(w.to(xt.dtype), xt, acc, input_precision="tf32")
    return out


@triton.jit
def _k_block(
    acc_g, acc_u, ss, w, wu, x_cols, nw, offs_k, k_mask, m_mask,
    X_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, PRE_NORM: tl.constexpr,
    GATE_UP: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    # One K block: the activations (normed in the load under PRE_NORM, nw the block's norm
    # weight in fp32) times the weight tiles.
    xt = tl.load(x_cols + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
    if PRE_NORM:
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=0)
        xt = (xf * nw[:, None]).to(X_DTYPE)
    acc_g = _mac(acc_g, w, xt, BLOCK_M, DOT_F32)
    if GATE_UP:
        acc_u = _mac(acc_u, wu, xt, BLOCK_M, DOT_F32)
    return acc_g, acc_u, ss


@triton.jit
def _norm_block(nw_ptr, offs_k, k_mask, PRE_NORM: tl.constexpr):
    """The norm weight of a K block in fp32 (a placeholder scalar without PRE_NORM)."""
    if PRE_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    else:
        nw = 0.0
    return nw


@triton.jit
def _out_vectors(s_ptr, b_ptr, offs_n, n_mask, N, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr):  # fmt: skip
    """The epilogue's per-column weights [BLOCK_N, 1] fp32: the scale (of the gate half), the
    up half's scale, the bias (placeholder scalars where absent). Weights, so a PDL kernel
    reads them before waiting for the previous kernel."""
    sc = 1.0
    sc_u = 1.0
    bias = 0.0
    if HAS_SCALE:
        sc = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if GATE_UP:
            sc_u = tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return sc, sc_u, bias


@triton.jit
def _load_residual(r_ptr, offs_n, n_mask, offs_m, m_mask, stride_rm, HAS_RES: tl.constexpr):
    r = 0.0
    if HAS_RES:
        r_ptrs = r_ptr + offs_m[None, :].to(tl.int64) * stride_rm + offs_n[:, None]
        r = tl.load(r_ptrs, mask=n_mask[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
    return r


@triton.jit
def _epilogue(
    acc_g, acc_u, ss, K, eps, offs_n, n_mask, offs_m, m_mask, sc, sc_u, bias, r, out_ptr,
    stride_om,
    X_DTYPE: tl.constexpr, PRE_NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATE_UP: tl.constexpr,
):  # fmt: skip
    # acc_*: [BLOCK_N, BLOCK_M] fp32; ss [BLOCK_M]: the rows' sums of squares (PRE_NORM);
    # sc, sc_u, bias from _out_vectors, r from _load_residual.
    # Rounded to x's dtype where the eager linear rounds.
    if PRE_NORM:
        rstd = (1.0 / tl.sqrt_rn(ss / K + eps))[None, :]
        acc_g = acc_g * rstd
        acc_u = acc_u * rstd
    y = acc_g
    if HAS_SCALE:
        y = y * sc
    if HAS_BIAS:
        y = y + bias
    o_mask = n_mask[:, None] & m_mask[None, :]
    if GATE_UP:
        u = acc_u
        if HAS_SCALE:
            u = u * sc_u
        g = y.to(X_DTYPE).to(tl.float32)
        u = u.to(X_DTYPE).to(tl.float32)
        s = tl.math.div_rn(g, 1.0 + exp_f32(-g)).to(X_DTYPE)  # F.silu, rounded as eager
        y = s.to(tl.float32) * u
    if HAS_RES:
        y = y.to(X_DTYPE).to(tl.float32) + r
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _linear_program(
    x_ptr, idx_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GATHER: tl.constexpr, PRE_NORM: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    GATE_UP: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, RES_EARLY: tl.constexpr, L2_AHEAD: tl.constexpr = False,
):  # fmt: skip
    """One program of `_fused_linear_kernel`. Returns whether it wrote its tile's output (the
    split that summed the partials; always without split-K), for a kernel that follows up on
    the output within the launch (`_norm_linear_attend_kernel`). L2_AHEAD (no split-K, rows of
    K contiguous weights): the tile's weight rows into L2 before the PDL wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = g_rows + N * stride_wn  # GATE_UP only: the up half of the packed matrix
    if PREFETCH >= 1:
        # The first PREFETCH K blocks' weights (and their norm weights, and the epilogue's
        # scale and bias) do not depend on the previous kernel: they are loaded before waiting
        # for it (PDL), so the weight stream starts while that kernel ends. Activations and
        # the gather's index are previous outputs: read after the wait.
        offs_k0 = k_lo + tl.arange(0, BLOCK_K)
        w_mask0 = n_mask[:, None] & (offs_k0 < k_hi)[None, :]
        w0 = tl.load(g_rows + offs_k0[None, :], mask=w_mask0, other=0.0)
        wu0 = w0
        if GATE_UP:
            wu0 = tl.load(u_rows + offs_k0[None, :], mask=w_mask0, other=0.0)
        nw0 = _norm_block(nw_ptr, offs_k0, offs_k0 < k_hi, PRE_NORM)
    if PREFETCH >= 2:
        offs_k1 = offs_k0 + BLOCK_K
        w_mask1 = n_mask[:, None] & (offs_k1 < k_hi)[None, :]
        w1 = tl.load(g_rows + offs_k1[None, :], mask=w_mask1, other=0.0)
        wu1 = w1
        if GATE_UP:
            wu1 = tl.load(u_rows + offs_k1[None, :], mask=w_mask1, other=0.0)
        nw1 = _norm_block(nw_ptr, offs_k1, offs_k1 < k_hi, PRE_NORM)
    if L2_AHEAD:
        l2_prefetch_tile(w_ptr, pid_n * BLOCK_N, N, K, BLOCK_N, GATE_UP)
    if SPLIT_K == 1:
        sc, sc_u, bias = _out_vectors(s_ptr, b_ptr, offs_n, n_mask, N, HAS_SCALE, HAS_BIAS,
                                      GATE_UP)  # fmt: skip
        if RES_EARLY:
            # The caller vouches that the residual was written at least two kernels back:
            # under PDL that kernel has finished once this one runs at all.
            r = _load_residual(r_ptr, offs_n, n_mask, offs_m, m_mask, stride_rm, HAS_RES)
    pdl_prologue(PDL)
    if GATHER:
        rows = tl.load(idx_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    x_cols = x_ptr + rows[None, :] * stride_xm
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_u = tl.zeros_like(acc_g)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    if PREFETCH >= 1:
        acc_g, acc_u, ss = _k_block(
            acc_g, acc_u, ss, w0, wu0, x_cols, nw0, offs_k0, offs_k0 < k_hi, m_mask,
            X_DTYPE, BLOCK_M, PRE_NORM, GATE_UP, DOT_F32,
        )  # fmt: skip
    if PREFETCH >= 2:
        acc_g, acc_u, ss = _k_block(
            acc_g, acc_u, ss, w1, wu1, x_cols, nw1, offs_k1, offs_k1 < k_hi, m_mask,
            X_DTYPE, BLOCK_M, PRE_NORM, GATE_UP, DOT_F32,
        )  # fmt: skip
    k_first = k_lo + PREFETCH * BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0)
        wu = w
        if GATE_UP:
            wu = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0)
        acc_g, acc_u, ss = _k_block(
            acc_g, acc_u, ss, w, wu, x_cols, _norm_block(nw_ptr, offs_k, k_mask, PRE_NORM),
            offs_k, k_mask, m_mask, X_DTYPE, BLOCK_M, PRE_NORM, GATE_UP, DOT_F32,
        )  # fmt: skip
    if BLOCK_M == 1:
        acc_g = tl.sum(acc_g, axis=1)[:, None]
        acc_u = tl.sum(acc_u, axis=1)[:, None]

    if SPLIT_K == 1:
        if not RES_EARLY:
            r = _load_residual(r_ptr, offs_n, n_mask, offs_m, m_mask, stride_rm, HAS_RES)
        _epilogue(
            acc_g, acc_u, ss, K, eps, offs_n, n_mask, offs_m, m_mask, sc, sc_u, bias, r,
            out_ptr, stride_om,
            X_DTYPE, PRE_NORM, HAS_SCALE, HAS_BIAS, HAS_RES, GATE_UP,
        )  # fmt: skip
        wrote = True
    else:
        # partials: ws [SPLIT_K, 2, M, N] fp32 (index 1: the up half), then the sums of
        # squares [SPLIT_K, M] (every N tile of a split writes the same values)
        o_mask = n_mask[:, None] & m_mask[None, :]
        ws_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        part = ws_ptr + pid_k * 2 * M * N
        ss_ws = ws_ptr + SPLIT_K * 2 * M * N
        tl.store(part + ws_offs, acc_g, mask=o_mask)
        if GATE_UP:
            tl.store(part + M * N + ws_offs, acc_u, mask=o_mask)
        if PRE_NORM:
            tl.store(ss_ws + pid_k * M + offs_m, ss, mask=m_mask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        wrote = arrived == SPLIT_K - 1
        if wrote:
            tot_g = tl.zeros_like(acc_g)
            tot_u = tl.zeros_like(acc_u)
            tot_ss = tl.zeros_like(ss)
            for s in tl.static_range(SPLIT_K):
                part = ws_ptr + s * 2 * M * N
                if PRE_NORM:
                    tot_ss += tl.load(
                        ss_ws + s * M + offs_m, mask=m_mask, other=0.0, cache_modifier=".cg"
                    )
                tot_g += tl.load(part + ws_offs, mask=o_mask, other=0.0, cache_modifier=".cg")
                if GATE_UP:
                    tot_u += tl.load(
                        part + M * N + ws_offs, mask=o_mask, other=0.0, cache_modifier=".cg"
                    )
            sc, sc_u, bias = _out_vectors(s_ptr, b_ptr, offs_n, n_mask, N, HAS_SCALE,
                                          HAS_BIAS, GATE_UP)  # fmt: skip
            r = _load_residual(r_ptr, offs_n, n_mask, offs_m, m_mask, stride_rm, HAS_RES)
            _epilogue(
                tot_g, tot_u, tot_ss, K, eps, offs_n, n_mask, offs_m, m_mask, sc, sc_u, bias,
                r, out_ptr, stride_om,
                X_DTYPE, PRE_NORM, HAS_SCALE, HAS_BIAS, HAS_RES, GATE_UP,
            )  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tile, 0)
    return wrote


@triton.jit
def _fused_linear_kernel(
    x_ptr, idx_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GATHER: tl.constexpr, PRE_NORM: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    GATE_UP: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, RES_EARLY: tl.constexpr = False, L2_AHEAD: tl.constexpr = False,
):  # fmt: skip
    _linear_program(
        x_ptr, idx_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GATHER, PRE_NORM, HAS_SCALE, HAS_BIAS, HAS_RES,
        GATE_UP, DOT_F32, PDL, PREFETCH, RES_EARLY, L2_AHEAD,
    )  # fmt: skip


@triton.jit
def _norm_gemv_program(
    x_ptr, nw_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
    stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    """One program of norm_linear (input norm + linear, no gather, bias or residual), for the
    kernels that follow up on its output within the launch; returns `_linear_program`'s
    `wrote`."""
    return _linear_program(
        x_ptr, x_ptr, nw_ptr, w_ptr, s_ptr, s_ptr, x_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_wn, 0, stride_om, eps,
        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, False, True, HAS_SCALE, False, False, False,
        DOT_F32, PDL, PREFETCH, False,
    )  # fmt: skip


@triton.jit
def _norm_linear_attend_kernel(
    x_ptr, nw_ptr, w_ptr, s_ptr, qkv_ptr, ws_ptr, cnt_ptr, gcnt_ptr,
    qw_ptr, kw_ptr, f_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, att_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_arow, stride_cslot, stride_ch, stride_cs,
    eps, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    # The qkv GEMV (norm_linear), then qk_norm_rope_attend's work for each KV group, run by
    # the program that wrote the group's last qkv tile. A tile lies in one head (BLOCK_N
    # divides D), so it counts toward one group: that of its q head, its k head or v head.
    wrote = _norm_gemv_program(
        x_ptr, nw_ptr, w_ptr, s_ptr, qkv_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
        stride_om, eps, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, HAS_SCALE, DOT_F32, PDL, PREFETCH,
    )  # fmt: skip
    if wrote:
        kvh = kv_group_of(tl.program_id(0) * BLOCK_N // D, HQ, HKV, GROUP)
        # every thread's qkv stores are issued before the release (as split-K's partials)
        tl.debug_barrier()
        arrived = tl.atomic_add(gcnt_ptr + kvh, 1, sem="acq_rel")
        if arrived == (GROUP + 2) * (D // BLOCK_N) * tl.num_programs(1) - 1:
            # the acquire makes the other programs' qkv columns visible; attend_item reads
            # them with .cg (L2, not a stale L1 line). Positions, slots and the cache below
            # each position are old: nothing of this launch writes them but this program.
            for row in range(0, M):
                r = tl.cast(row, tl.int64)
                pos = tl.load(pos_ptr + r).to(tl.int64)
                slot = tl.load(slot_ptr + r).to(tl.int64)
                ok1, ok2, ov1, ov2 = old_kv(kc_ptr, vc_ptr, kvh, pos, slot, stride_cslot,
                                            stride_ch, stride_cs, D, BLOCK_S)  # fmt: skip
                attend_item(
                    qkv_ptr, qw_ptr, kw_ptr, f_ptr, kc_ptr, vc_ptr, att_ptr, r, kvh, pos,
                    slot, stride_om, stride_arow, stride_cslot, stride_ch, stride_cs, eps,
                    qk_scale, ok1, ok2, ov1, ov2, HQ, HKV, D, GROUP, BLOCK_G, BLOCK_S,
                )  # fmt: skip
            tl.atomic_xchg(gcnt_ptr + kvh, 0)


def plan(M: int, N: int, K: int, gate_up: bool, sms: int, fp32: bool = False,
         gemv_rows_f32: int | None = None, tf32: bool = False,
         fp8_weight: bool = True) -> dict:  # fmt: skip
    """Fixed tile config for a shape: BLOCK_M from M, split-K until ~one wave of programs
    (under FUSED_GEMV_RULE, one half-precision row of FP8 weights where 8-row programs fill a
    wave: `wo_config`'s GEMV tiles; under FUSED_WO_RULE, half-precision 17-64 rows of FP8
    weights: `wo_config`'s tiles, warps and stages, what the rule was timed on: its 64 x 256
    tiles of two-byte weights outgrow shared memory at 64 rows, 262144 bytes against the
    H100's 232448 for the code predictor's bf16 input projection).
    fp32: the activations are fp32; then up to gemv_rows_f32 rows (default
    TTSBUILD_GEMV_ROWS_F32) run as GEMVs, a program per row and column tile; half precision:
    up to GEMV_FEW_ROWS_MAX rows where GEMV_FEW_ROWS is on. tf32: fp32 tiles on TF32 tensor
    cores, 32-wide K blocks (an offline sm_90 compile: 166 registers a thread, no spills, at
    64 x 64 with fp32 weights; 64-wide blocks spill)."""
    if fp32:
        rows_as_gemv = _GEMV_ROWS_F32 if gemv_rows_f32 is None else gemv_rows_f32
    else:
        rows_as_gemv = GEMV_FEW_ROWS_MAX if GEMV_FEW_ROWS else 1
    tile16 = False
    if (FUSED_GEMV_RULE and M == 1 and fp8_weight and not fp32
            and triton.cdiv(N, 8) >= sms):  # fmt: skip
        c = wo_config(1, 2 * N if gate_up else N, K, sms)
        if gate_up:
            c["BLOCK_K"] = min(c["BLOCK_K"], 512)
        return {**c, "BLOCK_M": 1}
    if M == 1 or M <= rows_as_gemv:
        block_m, block_n, block_k = 1, 16, 256 if gate_up else 512
        if fp32 and GEMV_F32_BLOCK_K:
            block_k = max(16, GEMV_F32_BLOCK_K // 2 if gate_up else GEMV_F32_BLOCK_K)
        if M == 1 and _GEMV_NARROW and triton.cdiv(N, 16) < sms <= triton.cdiv(N, 8):
            block_n = 8
    else:
        block_m = min(64, max(16, triton.next_power_of_2(M)))
        block_n, block_k = 64, 32 if fp32 and tf32 else 128
        if FUSED_WO_RULE and fp8_weight and not fp32 and 16 < M <= 64:
            return {**wo_config(M, N, K, sms, gate_up), "BLOCK_M": block_m}
        tile16 = FUSED_TILE16 and block_m == 16 and fp8_weight and not fp32
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1
    while (
        tiles * split < sms
        and split < _MAX_SPLIT
        and K % (block_k * split * 2) == 0
        and tiles <= _MAX_TILES
    ):
        split *= 2
    if tile16:  # (FUSED_TILE16, above)
        if not gate_up and K % (256 * split) == 0:
            block_k = 256
        else:
            block_n = 32
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}


def _dot_f32(x: torch.Tensor, tf32: bool) -> bool:
    """The kernels' DOT_F32: IEEE fp32 tiles for fp32 activations unless `tf32` (TF32 tensor
    cores), and always under the interpreter."""
    return interpret_mode() or (x.dtype == torch.float32 and not tf32)


def _launch(x, weight, M, N, K, gate_up, config, out, *, head_dim=None, groups=0,
            gemv_rows_f32=None, tf32=False):  # fmt: skip
    """How an [M, N] linear of x launches: the tile config (the per-shape `plan` unless given,
    with gemv_rows_f32 as there; num_warps and num_stages 4 and 3 unless it names them), the
    grid, the split-K workspace, the arrival counters (split-K's per tile, then `groups`
    more), PDL, and the K blocks loaded before the PDL wait. head_dim: tiles narrowed to lie
    within one head of that many columns."""
    sms = _num_sms(x.device)
    c = (dict(config) if config is not None
         else plan(M, N, K, gate_up, sms, fp32=x.dtype == torch.float32,
                   gemv_rows_f32=gemv_rows_f32, tf32=tf32,
                   fp8_weight=weight.dtype == torch.float8_e4m3fn))  # fmt: skip
    c.setdefault("num_warps", 4)
    c.setdefault("num_stages", 3)
    if interpret_mode():
        c["BLOCK_N"] = min(c["BLOCK_N"], 32)  # the interpreter is slow on big tiles
    if head_dim is not None:
        c["BLOCK_N"] = math.gcd(c["BLOCK_N"], head_dim)
    grid = (triton.cdiv(N, c["BLOCK_N"]), triton.cdiv(M, c["BLOCK_M"]), c["SPLIT_K"])
    if c["SPLIT_K"] > 1 or groups:
        if grid[0] * grid[1] + groups > _MAX_TILES:
            raise ValueError("too many tiles for the arrival counters")
        cnt = _counters(x.device)
    else:
        cnt = out
    ws = out
    if c["SPLIT_K"] > 1:
        ws = torch.empty(c["SPLIT_K"] * (2 * M * N + M), dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x)
    prefetch = 0
    if _PREFETCH and (pdl or interpret_mode()):  # the interpreter checks the code path
        # K blocks loaded before the wait: a split's blocks up to _PREFETCH_BLOCKS (a GEMV
        # program's 16 rows x 2 blocks of 512 FP8 weights: 16 KB in registers); the
        # interpreter always takes 2, so both peeled blocks and the loop after them are tested
        blocks = triton.cdiv(triton.cdiv(K, c["SPLIT_K"]), c["BLOCK_K"])
        per_program = 2 if interpret_mode() else _PREFETCH_BLOCKS
        prefetch = min(blocks, per_program if c["BLOCK_M"] == 1 else 1)
    return c, grid, ws, cnt, pdl, prefetch


def fused_linear_triton(
    x: torch.Tensor,  # [M, K], or the gather table [rows, K] when index is given
    weight: torch.Tensor,  # [N, K] (or [2N, K] for gate_up) bf16/fp32/float8_e4m3fn
    scale: torch.Tensor | None,  # [N] (or [2N]) fp32 for FP8 weights
    *,
    index: torch.Tensor | None = None,  # [M] int rows of x
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N]
    gate_up: bool = False,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    residual_ready: bool = False,
    gemv_rows_f32: int | None = None,
    out: torch.Tensor | None = None,  # [M, N], rows contiguous (checked by fused_linear)
    tf32: bool = False,
) -> torch.Tensor:
    K = x.shape[1]
    if index is not None:
        index = index.contiguous()  # the kernel reads idx[m] at idx_ptr + m
    M = index.shape[0] if index is not None else x.shape[0]
    N = weight.shape[0] // 2 if gate_up else weight.shape[0]
    if weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x [M, {K}] and weight [N, {K}] need contiguous rows")
    if residual is not None and (residual.shape != (M, N) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{M}, {N}] row-major, got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    c, grid, ws, cnt, pdl, prefetch = _launch(x, weight, M, N, K, gate_up, config, out,
                                              gemv_rows_f32=gemv_rows_f32, tf32=tf32)  # fmt: skip
    dummy = out
    _fused_linear_kernel[grid](
        x, index if index is not None else dummy, norm_weight if norm_weight is not None else dummy,
        weight, scale if scale is not None else dummy, bias if bias is not None else dummy,
        residual if residual is not None else dummy, out, ws, cnt,
        M, N, K, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        **c, GATHER=index is not None, PRE_NORM=norm_weight is not None,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        GATE_UP=gate_up, DOT_F32=_dot_f32(x, tf32), PREFETCH=prefetch,
        RES_EARLY=residual is not None and residual_ready and prefetch > 0 and pdl_early_reads(),
        L2_AHEAD=_l2_ahead(weight, c, pdl), **pdl_args(pdl),
    )  # fmt: skip
    return out


def _l2_ahead(weight: torch.Tensor, config: dict, pdl: bool) -> bool:
    """Whether a launch brings its tiles' weights into L2 before the PDL wait (`L2_AHEAD`): on
    the GPU under PDL, tiles without split-K (a tile's rows one contiguous block) of a weight
    whose row blocks a bulk prefetch takes (`bulk_prefetchable`)."""
    return L2_AHEAD and pdl and config["SPLIT_K"] == 1 and bulk_prefetchable(weight)


def norm_linear_attend_triton(
    x: torch.Tensor,  # [R, K]
    norm_weight: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K] bf16/fp32/float8_e4m3fn
    scale: torch.Tensor | None,  # [(Hq + 2 Hkv) * D] fp32 for FP8 weights
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    freqs: torch.Tensor,  # [D / 2] fp32 RoPE inverse frequencies
    positions: torch.Tensor,  # [R] int
    slots: torch.Tensor,  # [R] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D], S <= MAX_POSITIONS
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    attn_scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    R, K = x.shape
    N = weight.shape[0]
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    if N != (num_heads + 2 * num_kv_heads) * D or weight.shape[1] != K:
        raise ValueError(f"weight must be [(Hq + 2 Hkv) * {D}, {K}], got {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows")
    check_qkv_caches(None, k_cache, v_cache, num_heads, num_kv_heads)
    if S > MAX_POSITIONS or D % 16:
        raise ValueError(f"needs at most {MAX_POSITIONS} cache positions, head_dim % 16 == 0")
    qkv = torch.empty((R, N), dtype=x.dtype, device=x.device)
    attn = torch.empty((R, num_heads * D), dtype=x.dtype, device=x.device)
    if R == 0:
        return attn
    c, grid, ws, cnt, pdl, prefetch = _launch(
        x, weight, R, N, K, False, config, qkv, head_dim=D, groups=num_kv_heads
    )
    group = num_heads // num_kv_heads
    _norm_linear_attend_kernel[grid](
        x, norm_weight, weight, scale if scale is not None else qkv, qkv, ws, cnt,
        cnt[grid[0] * grid[1]:], q_weight, k_weight, freqs, positions.reshape(-1),
        slots.reshape(-1), k_cache, v_cache, attn,
        R, N, K, x.stride(0), weight.stride(0), qkv.stride(0), attn.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps, attn_scale * _LOG2E,
        **c, HAS_SCALE=scale is not None, DOT_F32=interpret_mode() or x.dtype == torch.float32,
        HQ=num_heads, HKV=num_kv_heads, D=D, GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=triton.next_power_of_2(S),
        PREFETCH=prefetch, **pdl_args(pdl),
    )  # fmt: skip
    return attn


@triton.jit
def _norm_linear_ring_attend_kernel(
    x_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, qkv_ptr, ws_ptr, cnt_ptr, gcnt_ptr,
    pos_ptr, rows_ptr, k_ptr, v_ptr, f_ptr, att_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, eps, B, F, R, W, attn_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
    MERGE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    # The codec pre-transformer's qkv GEMV (input norm, linear, bias), then
    # ring_attention_rope's work for each head, run by the program that wrote the head's last
    # qkv tile. A tile lies in one head (BLOCK_N divides D): its q, k or v columns. Rows are
    # B streams x F frames, frame-major within a stream (qkv [B * F, 3 H D]).
    wrote = _linear_program(
        x_ptr, x_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, x_ptr, qkv_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_wn, 0, stride_om, eps,
        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, False, True, HAS_SCALE, HAS_BIAS, False, False,
        DOT_F32, PDL, PREFETCH, False,
    )  # fmt: skip
    if wrote:
        h = (tl.program_id(0) * BLOCK_N // D) % H
        tl.debug_barrier()  # every thread's qkv stores are issued before the release
        arrived = tl.atomic_add(gcnt_ptr + h, 1, sem="acq_rel")
        if arrived == 3 * (D // BLOCK_N) * tl.num_programs(1) - 1:
            # the acquire makes the other programs' qkv columns visible; ring_rope_item reads
            # them through L2. The rings, positions and slots are old: this program alone
            # writes the head's ring entries in this launch.
            for b in range(0, B):
                ring_rope_item(
                    qkv_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, f_ptr, att_ptr,
                    tl.cast(b, tl.int64), h, F, R, W, attn_scale, F * stride_om, stride_om, D,
                    1, H, D, BLOCK_R, MERGE, CHUNK, True,
                )  # fmt: skip
            tl.atomic_xchg(gcnt_ptr + h, 0)


def norm_linear_ring_attend_triton(
    x: torch.Tensor,  # [B * F, K] fp32 (or half)
    norm_weight: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [3 H D, K]
    scale: torch.Tensor | None,  # [3 H D] fp32: FP8 or scaled half weights
    bias: torch.Tensor | None,  # [3 H D]
    pos: torch.Tensor,  # [B]
    rows: torch.Tensor,  # [B]
    k_ring: torch.Tensor,  # [S, H, R, D] contiguous
    v_ring: torch.Tensor,
    inv_freq: torch.Tensor,  # [D / 2]
    *,
    frames: int,
    window: int,
    attn_scale: float,
    eps: float,
    gemv_rows_f32: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    B = pos.shape[0]
    _, H, R, D = k_ring.shape
    attn = torch.empty((M, H * D), dtype=x.dtype, device=x.device)
    if M == 0:
        return attn
    qkv = torch.empty((M, N), dtype=x.dtype, device=x.device)
    c, grid, ws, cnt, pdl, prefetch = _launch(x, weight, M, N, K, False, config, qkv, head_dim=D,
                                              groups=H, gemv_rows_f32=gemv_rows_f32)  # fmt: skip
    chunk = _ring.RING_CHUNK if B >= _ring.RING_CHUNK_MIN_ROWS else 0  # (as ring_attention_rope)
    _norm_linear_ring_attend_kernel[grid](
        x, norm_weight, weight, scale if scale is not None else qkv,
        bias if bias is not None else qkv, qkv, ws, cnt, cnt[grid[0] * grid[1]:], pos, rows,
        k_ring, v_ring, inv_freq, attn,
        M, N, K, x.stride(0), weight.stride(0), qkv.stride(0), eps, B, frames, R, int(window),
        float(attn_scale),
        **c, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        DOT_F32=_dot_f32(x, False), H=H, D=D,
        BLOCK_R=triton.next_power_of_2(R), MERGE=_ring.RING_MERGE and not chunk, CHUNK=chunk,
        PREFETCH=prefetch, **pdl_args(pdl),
    )  # fmt: skip
    return attn


@triton.jit
def _norm_linear_sample_kernel(
    x_ptr, nw_ptr, w_ptr, s_ptr, logits_ptr, ws_ptr, cnt_ptr, done_ptr,
    temp_ptr, topk_ptr, topp_ptr, dosample_ptr, seed_ptr, ctr_ptr, stride_ctr, tok_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    # The head GEMV (norm_linear, fp32 logits), then the sampler over the logits of every row,
    # run by the program that wrote the last logits tile (arrival counter as split-K's).
    wrote = _norm_gemv_program(
        x_ptr, nw_ptr, w_ptr, s_ptr, logits_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
        stride_wn, stride_om, eps, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, HAS_SCALE, DOT_F32, PDL,
        PREFETCH,
    )  # fmt: skip
    if wrote:
        tl.debug_barrier()  # every thread's logits stores are issued before the release
        arrived = tl.atomic_add(done_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            for row in range(0, M):
                r = tl.cast(row, tl.int64)
                token = sample_row(
                    r, logits_ptr + r * stride_om, N, temp_ptr, topk_ptr, topp_ptr,
                    dosample_ptr, seed_ptr, ctr_ptr, stride_ctr, logits_ptr, 0, temp_ptr,
                    BLOCK_V, False, False, RADIX_BITS, True,
                )  # fmt: skip
                tl.store(tok_ptr + r, token)
            tl.atomic_xchg(done_ptr, 0)


def _sample_radix_bits() -> int:
    """The sampler's digit width (TTSBUILD_SAMPLE_RADIX_BITS, read at call time), at most 2
    here: a 4-warp program holds [2^bits, V] candidate tiles (4 bits at V 2048 would spill)."""
    return min(_sampling._RADIX_BITS, 2)


def norm_linear_sample_triton(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [V, K] bf16/fp32/float8_e4m3fn: the head
    scale: torch.Tensor | None,  # [V] fp32 for FP8 weights
    batch: SamplingBatch,
    seeds: torch.Tensor,  # [M] int64
    counters: torch.Tensor,  # [M] int64 (may be a strided column)
    *,
    eps: float,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [M] int64, the fp32 logits [M, V] they were drawn from)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x [M, {K}] and weight [N, {K}] need contiguous rows")
    logits = torch.empty((M, N), dtype=torch.float32, device=x.device)
    tokens = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return tokens, logits
    c, grid, ws, cnt, pdl, prefetch = _launch(x, weight, M, N, K, False, config, logits, groups=1)
    do_sample = batch.do_sample
    _norm_linear_sample_kernel[grid](
        x, norm_weight, weight, scale if scale is not None else logits, logits, ws, cnt,
        cnt[grid[0] * grid[1]:], batch.temperature.float(), batch.top_k, batch.top_p.float(),
        do_sample.view(torch.uint8) if do_sample.dtype == torch.bool else do_sample,
        seeds, counters, counters.stride(0), tokens,
        M, N, K, x.stride(0), weight.stride(0), logits.stride(0), eps,
        **c, HAS_SCALE=scale is not None, DOT_F32=interpret_mode() or x.dtype == torch.float32,
        BLOCK_V=triton.next_power_of_2(N), RADIX_BITS=_sample_radix_bits(),
        PREFETCH=prefetch, **pdl_args(pdl),
    )  # fmt: skip
    return tokens, logits
