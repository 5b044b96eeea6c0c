"""Triton weight-only FP8 skinny GEMM / GEMV.

out[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k]), fp32 accumulation, bf16 output.

- M == 1: GEMV. Each program owns BLOCK_N weight rows, streams [BLOCK_N, BLOCK_K] fp8
  tiles (16-byte loads along K), multiplies by the broadcast activation in fp32 and
  reduces once at the end.
- M > 1: "swap AB" tensor-core tiles: acc[BLOCK_N, BLOCK_M] += w_tile @ x_tile^T, so the
  weight tile fills the MMA's 64-row side and the few activation rows its narrow side
  (BLOCK_M = 16/32/64 bucket of M).
- GATE_UP: w is the packed [2N, K] gate/up matrix; each program streams gate rows n and up
  rows N + n in the same K loop and writes silu(gate) * up, rounded as the unfused
  `fp8_linear` + `silu_mul` round (the talker's MLP up half in one launch).
- Split-K (SPLIT_K > 1) for shapes with too few N tiles to fill the 132 SMs: each split
  writes an fp32 partial, and the last split to arrive at a tile (an atomic counter that it
  resets to 0) sums the partials in split order and writes the output: one launch,
  deterministic. The counters are shared per device: one stream at a time.
- A8 (M > 1): x is already FP8 (each row quantised with its own scale, `sx`:
  `fp8_w8a8.quantize_rows`), so the tiles multiply FP8 x FP8 on the tensor cores with no
  conversion in the loop, and the epilogue scales row m by sx[m] and column n by scale[n]
  (W8A8; `fp8_linear_a8_triton`). The weight-only tiles convert each weight tile to bf16
  first.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import bulk_prefetchable, interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl import wo_table
from ttsbuild.plugins._tl._math import exp_f32, l2_prefetch_tile, pdl_prologue

_NUM_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MAX_TILES = 1 << 16
_MAX_SPLIT = 8
# weights in each of gate_up's two tiles a program: larger ones spill (`_prune`)
GATE_UP_MAX_TILE = 8192
# Under PDL a tile without split-K brings its FP8 weight rows into L2 before waiting for the
# previous kernel (one `cp.async.bulk.prefetch.L2` from thread 0), so its K loop reads L2,
# not HBM: the talker's GEMVs and W8A8 tiles. Off until timed on the GPU
# (TTSBUILD_PDL_L2_AHEAD=1, as for plugins._tl.fused_linear; read at each launch).
L2_AHEAD = os.environ.get("TTSBUILD_PDL_L2_AHEAD", "0") == "1"
# The weight-only tiles' widest activation tile (BLOCK_M): 64, or 128 with
# TTSBUILD_FP8_WO_MAX_BLOCK_M=128, so that 128+ rows (the code predictor's unfused buckets of
# 128-256 rows) load and convert each weight tile half as often. Not yet timed (read at import).
WO_MAX_BLOCK_M = int(os.environ.get("TTSBUILD_FP8_WO_MAX_BLOCK_M", "64"))
if WO_MAX_BLOCK_M not in (64, 128):
    raise ValueError(f"TTSBUILD_FP8_WO_MAX_BLOCK_M must be 64 or 128, got {WO_MAX_BLOCK_M}")


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else 0
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = (
            torch.cuda.get_device_properties(idx).multi_processor_count
            if device.type == "cuda"
            else 132
        )
    return _NUM_SMS[idx]


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters (each reset by the last program of its tile), one set per
    CUDA stream: kernels of graphs captured on different streams may run concurrently (the
    engine's lanes) and must not count into the same tiles."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _cfg(bn, bk, split, warps, stages):
    return triton.Config(
        {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=stages
    )


# Small config sets: the autotuner times each once per (N, K, M bucket).
GEMV_CONFIGS = [  # 2026-12-01 sweep (benchmarks/kernels/sweep_fp8.py): 8 rows x 1024 wins
    _cfg(16, 512, 1, 4, 3),
    _cfg(32, 256, 1, 4, 4),
    _cfg(8, 512, 1, 4, 4),
    _cfg(8, 1024, 1, 4, 1),
    _cfg(8, 1024, 1, 4, 3),
    _cfg(8, 256, 1, 4, 1),
    _cfg(16, 512, 2, 4, 3),
    _cfg(16, 256, 4, 4, 4),
    _cfg(8, 512, 4, 4, 4),
    _cfg(32, 512, 4, 8, 1),
]
GEMM_CONFIGS = [
    _cfg(64, 128, 1, 4, 4),
    _cfg(64, 256, 1, 4, 3),
    _cfg(128, 128, 1, 4, 4),
    _cfg(64, 128, 2, 4, 4),
    _cfg(64, 128, 4, 4, 4),
    _cfg(128, 128, 4, 8, 3),
    _cfg(32, 128, 4, 4, 3),
    _cfg(64, 256, 4, 4, 3),
    _cfg(64, 256, 2, 4, 3),
    _cfg(128, 128, 4, 4, 3),
]
# For 128-row activation tiles only (TTSBUILD_FP8_WO_MAX_BLOCK_M=128; `_prune` drops them
# below): 8 warps without split-K, so a 128 x 128 fp32 accumulator is 64 registers a thread.
WIDE_M_CONFIGS = [
    _cfg(128, 128, 1, 8, 3),
    _cfg(64, 128, 1, 8, 4),
]
GEMM_CONFIGS += WIDE_M_CONFIGS


def _prune(configs, named_args, **kwargs):
    n, k, m = named_args["N"], named_args["K"], named_args["M"]
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    m_tiles = triton.cdiv(m, block_m)
    sms = _num_sms(named_args["out_ptr"].device)
    gate_up = kwargs.get("GATE_UP", named_args.get("GATE_UP", False))
    kept = []
    for c in configs:
        bn, bk, split = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if block_m < 128 and c in WIDE_M_CONFIGS:
            continue
        if bk > k or k % (bk * split) != 0 and split > 1:
            continue
        if gate_up and bn * bk > GATE_UP_MAX_TILE:
            # two weight tiles (and for a GEMV two [BLOCK_N, BLOCK_K] accumulators) per
            # program: larger tiles spill (offline sm_90 compile: 64 x 256 at 16 rows, 1 KB)
            continue
        tiles = triton.cdiv(n, bn) * m_tiles
        if split > 1 and (tiles >= 2 * sms or tiles > _MAX_TILES):
            continue  # enough tiles already: split-K only adds partial traffic
        kept.append(c)
    return kept or [configs[0]]


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    sx_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    GATE_UP: tl.constexpr = False,
    DOT_F32: tl.constexpr = False,
    A8: tl.constexpr = False,
    PDL: tl.constexpr = False,
    L2_AHEAD: tl.constexpr = False,
):
    if L2_AHEAD:  # (under PDL) the tile's FP8 weight rows into L2 before the wait
        if SPLIT_K == 1:  # a tile without split-K: its rows are one contiguous block
            l2_prefetch_tile(w_ptr, tl.program_id(0) * BLOCK_N, N, K, BLOCK_N, GATE_UP)
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = k_lo + k_per_split  # the last split may run past K: masked below (not EVEN)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = w_rows + N * stride_wn  # GATE_UP: the up rows

    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # GATE_UP only
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_rows + offs_k[None, :])
                if GATE_UP:
                    w_u = tl.load(u_rows + offs_k[None, :])
                xv = tl.load(x_ptr + offs_k)
            else:
                k_mask = offs_k < K
                wk_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0.0)
                if GATE_UP:
                    w_u = tl.load(u_rows + offs_k[None, :], mask=wk_mask, other=0.0)
                xv = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
            acc2 += w.to(tl.float32) * xv.to(tl.float32)[None, :]
            if GATE_UP:
                acc2_u += w_u.to(tl.float32) * xv.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
        acc_u = tl.sum(acc2_u, axis=1)[:, None]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATE_UP only
        x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_rows + offs_k[None, :])
                if GATE_UP:
                    w_u = tl.load(u_rows + offs_k[None, :])
                xt = tl.load(x_cols + offs_k[:, None], mask=m_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K
                wk_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0.0)
                if GATE_UP:
                    w_u = tl.load(u_rows + offs_k[None, :], mask=wk_mask, other=0.0)
                xt = tl.load(
                    x_cols + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0
                )
            if DOT_F32:  # the interpreter mis-multiplies bf16 converted from fp8
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
                if GATE_UP:
                    acc_u = tl.dot(w_u.to(tl.float32), xt.to(tl.float32), acc_u)
            elif A8:  # FP8 x FP8 on the tensor cores, fp32 accumulation
                acc = tl.dot(w, xt, acc)
                if GATE_UP:
                    acc_u = tl.dot(w_u, xt, acc_u)
            else:  # the weight in x's dtype (bf16 served; fp32 and fp16 x work too)
                acc = tl.dot(w.to(xt.dtype), xt, acc)
                if GATE_UP:
                    acc_u = tl.dot(w_u.to(xt.dtype), xt, acc_u)

    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if GATE_UP:
        scale_u = tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)
    else:
        scale_u = scale
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    o_mask = n_mask[:, None] & m_mask[None, :]
    if A8:
        sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    else:
        sx = 1.0
    if SPLIT_K == 1:
        y = _epilogue(acc * sx, acc_u * sx, scale, scale_u, out_ptr.dtype.element_ty, GATE_UP)
        tl.store(out_ptrs, y, mask=o_mask)
    else:
        # partials ws [SPLIT_K, 2, M, N] (index 1: the up half)
        ws_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptr + pid_k * 2 * M * N + ws_offs, acc, mask=o_mask)
        if GATE_UP:
            tl.store(ws_ptr + (pid_k * 2 + 1) * M * N + ws_offs, acc_u, mask=o_mask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            total_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    ws_ptr + s * 2 * M * N + ws_offs, mask=o_mask, other=0.0, cache_modifier=".cg"
                )
                if GATE_UP:
                    total_u += tl.load(ws_ptr + (s * 2 + 1) * M * N + ws_offs, mask=o_mask,
                                       other=0.0, cache_modifier=".cg")  # fmt: skip
            y = _epilogue(total * sx, total_u * sx, scale, scale_u, out_ptr.dtype.element_ty,
                          GATE_UP)  # fmt: skip
            tl.store(out_ptrs, y, mask=o_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _epilogue(acc, acc_u, scale, scale_u, OUT_DTYPE: tl.constexpr, GATE_UP: tl.constexpr):
    """The scaled output in OUT_DTYPE; GATE_UP: silu(gate) * up with gate, up, silu(gate) each
    rounded to OUT_DTYPE first, as `fp8_linear` followed by `silu_mul` rounds them."""
    y = (acc * scale[:, None]).to(OUT_DTYPE)
    if GATE_UP:
        g = y.to(tl.float32)
        u = (acc_u * scale_u[:, None]).to(OUT_DTYPE).to(tl.float32)
        s = tl.math.div_rn(g, 1.0 + exp_f32(-g)).to(OUT_DTYPE)  # F.silu, rounded as eager
        y = (s.to(tl.float32) * u).to(OUT_DTYPE)
    return y


def _even(args):
    return args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0 and args["N"] % args["BLOCK_N"] == 0


def _quick_bench(kernel_call, quantiles):
    import triton.testing

    # Autotuning cost: ~30 ms per config instead of triton's default ~125 ms.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_heur = triton.heuristics({"EVEN": _even})(_fp8_linear_kernel)
# The autotuner's key: the shape and the activation tile, so every row count in one BLOCK_M
# bucket (64, 128 and 256 rows at BLOCK_M 64) runs the config tuned, and pruned (`_prune`
# drops split-K once the row tiles fill the SMs), at the first of them to be called (the
# engine warms its buckets smallest first). TTSBUILD_FP8_TUNE_BY_ROWS=1 adds M: each row
# count tuned for itself (the engine's warm-up runs before each capture, so the tuning never
# runs inside one). Off until timed (benchmarks/kernels/cp_many_rows.py; read at import).
TUNE_BY_ROWS = os.environ.get("TTSBUILD_FP8_TUNE_BY_ROWS", "0") == "1"
_KEY = ["N", "K", "BLOCK_M", "GATE_UP"] + (["M"] if TUNE_BY_ROWS else [])
_gemv = triton.autotune(
    GEMV_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune}, do_bench=_quick_bench
)(_heur)
_gemm = triton.autotune(
    GEMM_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune}, do_bench=_quick_bench
)(_heur)


def m_bucket(m: int, a8: bool = False) -> int:
    """BLOCK_M for M rows: 1 (GEMV) or 16/32/64 (tensor-core tiles; A8 also 128, weight-only
    too with WO_MAX_BLOCK_M 128)."""
    if m == 1 and not a8:
        return 1
    return min(128 if a8 else WO_MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


_A8_SMEM = 200 * 1024  # of the H200's 227 KB a block may use: the stages' tiles stay under it


def a8_config(M: int, N: int, K: int, sms: int = 132, gate_up: bool = False) -> dict:
    """The A8 tiles' config, by rule rather than the autotuner: its quick timings (each
    candidate launched alone, no graph) picked configs up to 1.8x slower than the best of a
    64-config sweep on the H200 (benchmarks/kernels/2026-12-04-h200-a8/sweep_a8.log, the
    talker's four shapes at 16-128 rows). What the sweep's winners share:
    - 64-row weight tiles and K blocks of 256 (K blocks of 128 where the N tiles alone fill
      the SMs from 64 rows: gate_up; 128 x 128 tiles from 128 rows where half do);
    - split-K only when each split still streams >= 1536 columns (down, K = 6144: 4 splits;
      the 2048-column o projection is faster whole with 32 tiles on 132 SMs);
    - 4 warps (8 only tie); 4 stages, 3 where the N tiles alone fill the SMs at K blocks of
      256 (gate_up at 16-32 rows).
    Past 128 rows (several row tiles: long prompts, batched prefill, decode buckets of 128+),
    from a 128-512-row sweep of the same shapes (benchmarks/kernels/2026-12-06-h200-many-rows):
    - 64-row weight tiles always; K blocks of 256, or 128 with 3 stages where N >= 8192
      (gate_up: 14.5 against 18.6 us at 256 rows on the 128 x 128 tiles of the rule above);
    - split-K only while the grid stays under half the SMs (down, K = 6144: 12.0 against
      19.5 us at 256 rows with the few-row rule's 4 splits);
    - 8 warps for the wide N from four row tiles (gate_up at 512 rows).
    From eight row tiles (1024 rows: 4 x 256-token prefills), from a 256 / 1024-row sweep on an
    H100 (benchmarks/kernels/2026-12-07-h100-no-copies/call11): 128 x 128 weight tiles, K blocks
    of 128, 8 warps, 4 stages, no split; 256-row activation tiles (BLOCK_M) for the wide N
    (qkv 15.3, gate_up 48.0 us, against 27.6 / 65.8 on the rule above, quantisation included
    there; o 9.0, down 20.7 against 16.1 / 42.1). Not for gate_up's two weight tiles (the
    served gate_up + SiLU): that sweep timed gate_up as one plain linear, and in the engine
    the branch took the 4 x 256-token prefill from 8.1-8.8 to 15.9-16.1 ms on the H200
    (benchmarks/runtime/2026-12-07-h200-no-copies: two 128 x 256 fp32 accumulators are 256
    registers a thread at 8 warps); it keeps the many-row rule below.
    Stages (then the K block) shrink until the stages' tiles fit in shared memory: each holds
    the weight tile (two for gate_up) and the [BLOCK_K, BLOCK_M] activation tile, FP8. The
    config carries BLOCK_M where it is not `m_bucket`'s."""
    bm = m_bucket(M, a8=True)
    m_tiles = triton.cdiv(M, bm)
    warps = 4
    if m_tiles >= 8 and not gate_up:  # 1024+ rows: 128 x 128 weight tiles, 256-row tiles
        bn, bk, warps = 128, 128, 8
        bm = 256 if N >= 4096 else bm
    elif m_tiles > 1:  # many rows: 64-row weight tiles, K blocks by N
        bn, bk = (64, 128) if N >= 8192 else (64, 256)
        warps = 8 if N >= 8192 and m_tiles >= 4 else 4
    elif bm >= 128 and triton.cdiv(N, 128) >= sms // 2:
        bn, bk = 128, 128
    elif bm >= 64 and triton.cdiv(N, 64) >= sms:
        bn, bk = 64, 128
    else:
        bn, bk = 64, 256
    bk = min(bk, max(32, triton.next_power_of_2(K) // 2 if K < bk else bk))
    tiles = triton.cdiv(N, bn) * m_tiles
    split = 1
    while (split < _MAX_SPLIT and K % (bk * split * 2) == 0 and K // (split * 2) >= 1536
           and (m_tiles == 1 or tiles * split * 2 <= sms // 2)):  # fmt: skip
        split *= 2
    if m_tiles >= 8 and not gate_up:
        stages = 4
    elif m_tiles > 1:
        stages = 3 if bk == 128 else 4
    else:
        stages = 3 if bk == 256 and triton.cdiv(N, bn) >= sms else 4

    def smem(stages: int, bk: int) -> int:
        return stages * ((2 if gate_up else 1) * bn * bk + bk * bm)

    while stages > 2 and smem(stages, bk) > _A8_SMEM:
        stages -= 1
    while bk > 32 and smem(stages, bk) > _A8_SMEM:
        bk //= 2
    config = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
              "num_stages": stages}  # fmt: skip
    return config if bm == m_bucket(M, a8=True) else {**config, "BLOCK_M": bm}


# The weight-only kernel's configs at 1-64 rows by rule (`wo_config`) instead of the
# autotuner: TTSBUILD_FP8_WO_RULE=1 (read at import). Off: on the H100 engine bench
# (benchmarks/runtime/2026-12-07-h100-rules; the rule then had no 2-16 row branch) the talker
# at one row 1.08 against 1.09-1.10 ms, the code predictor at 32 rows 3.53 against 3.35-3.36
# (at its shapes the rule's tiles are 3-17 % slower than the autotuner's picks). Next: the
# talker at 2-8 rows (its weight-only buckets): ~0.04 ms a step against that engine's own
# autotuned picks (qkv and down 5-10 % slower than the sweep's winners).
# 2026-12-08 (H100, benchmarks/runtime/2026-12-08-h100-l2): with the 2-16 row branch the
# talker at 4 rows 1.55-1.56 against 1.60-1.63 ms, at 8 rows 1.75 against 1.64 / 1.87 (two
# processes), the code predictor at 32 rows still 0.15-0.21 ms slower: the rule on at 1-16
# rows only is TTSBUILD_FP8_WO_RULE_MAX_ROWS=16 (default 64), to time next.
WO_RULE = os.environ.get("TTSBUILD_FP8_WO_RULE", "0") == "1"


def _rule_max_rows() -> int:
    raw = os.environ.get("TTSBUILD_FP8_WO_RULE_MAX_ROWS", "64")
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"TTSBUILD_FP8_WO_RULE_MAX_ROWS={raw!r}: a number of rows from 1 to 64")
    return int(raw)


WO_RULE_MAX_ROWS = _rule_max_rows()


def wo_rule_rows(M: int) -> bool:
    """Whether `wo_config` covers M rows: 1 to WO_RULE_MAX_ROWS (default 64: the GEMV, the
    16-, 32- and 64-row tiles); the autotuner takes more."""
    return 1 <= M <= WO_RULE_MAX_ROWS


def wo_config(M: int, N: int, K: int, sms: int = 132, gate_up: bool = False) -> dict:
    """The weight-only kernel's config for 1-64 rows (one BLOCK_M tile), by rule.
    Why: the autotuner's quick timings (25 ms in one process, each candidate as one launch at
    a time with L2 flushed) picked configs up to 12 % slower at 17-64 rows, up to 30 % at one
    row (down: 8.45 against 6.50 us) and up to 25 % at 2-16 (gate_up) than the best of a
    sweep timed as the engine runs them (back to back in a CUDA graph, the weights rotated
    past L2) at the talker's four shapes, and other picks in other sweeps of the same shapes
    (H200: benchmarks/kernels/2026-12-01-h200-session5 and 2026-12-04-h200-a8; H100:
    benchmarks/runtime/2026-12-07-h100-rules/call3; sweep_fp8.json), so a plan's step time
    moved between processes.
    What the sweeps' winners share, 4 warps and 3 stages throughout:
    - one row (the GEMV): 8 weight rows a program, K blocks of 1024 (256 where those 8-row
      programs fill eight waves: gate_up, N 12288), no split;
    - 2-16 rows: K blocks of 128, 64-column weight tiles, split-K to 1.5 waves of programs
      while each split keeps 512 of K; 32-column tiles where that split leaves the grid
      short (o). The H100's winners at 2, 4, 8 and 16 rows alike: qkv 64 x 128 split 4, o 32
      x 128 split 4, gate/up (one linear of 12288 columns) 64 x 128 split 2, down 64 x 128
      split 8 (the H200's qkv, o and gate/up alike or within 3 %; its down 64 x 256 split 4,
      the rule's >= 10 % slower);
    - 17-64 rows: 64-column weight tiles; K blocks of 256 (128 where the N tiles alone fill
      the SMs: gate_up); split-K to about half a wave of programs: the smallest split (1-8)
      whose grid holds sms / 2 programs (qkv 2, o and down 4, gate_up 1).
    gate_up (two weight tiles a program): a tile of at most 8192 weights (`_prune`'s bound)."""
    if M == 1:
        bn = 8
        bk = 256 if triton.cdiv(N, bn) >= 8 * sms else 1024
        bk = min(bk, max(32, triton.next_power_of_2(K)))
        return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    if M <= 16:
        bn, bk = 64, min(128, max(32, triton.next_power_of_2(K)))
        want = sms * 3 // 2
        split = 1
        while (triton.cdiv(N, bn) * split < want and split < _MAX_SPLIT
               and K % (bk * split * 2) == 0 and K // (split * 2) >= 512):  # fmt: skip
            split *= 2
        if triton.cdiv(N, bn) * split < want:
            bn = 32
        return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}
    bn = 64
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, m_bucket(M))
    bk = 128 if triton.cdiv(N, bn) >= sms or gate_up else 256
    bk = min(bk, max(32, triton.next_power_of_2(K)))
    split = 1
    while tiles * split < sms // 2 and split < _MAX_SPLIT and K % (bk * split * 2) == 0:
        split *= 2
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


# Weight-only configs measured on this GPU model, per launch shape (`wo_table`): a table a
# sweep writes (benchmarks/kernels/sweep_fp8.py --table), TTSBUILD_FP8_WO_TABLE=PATH (read
# at import; a bad file fails the import with what is wrong). Ahead of the rule and the
# autotuner; a shape not in it keeps them.
_TABLE_PATH = os.environ.get("TTSBUILD_FP8_WO_TABLE", "")
WO_TABLE: wo_table.WoTable | None = wo_table.load(_TABLE_PATH) if _TABLE_PATH else None
_DEVICE_NAMES: dict[int, str] = {}


def _device_name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _DEVICE_NAMES.get(index)
    if name is None:
        name = _DEVICE_NAMES[index] = torch.cuda.get_device_name(index)
    return name


def _launch(x, w, scale, sx, out_dtype, config, gate_up):
    M, K = x.shape
    N = w.shape[0] // 2 if gate_up else w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has K={K} but the weight is {tuple(w.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    scale = scale.contiguous()
    a8 = sx is not None
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    block_m = m_bucket(M, a8)
    if config is None and a8 and not interpret_mode():  # by rule (`a8_config`), no autotuner
        config = a8_config(M, N, K, _num_sms(x.device), gate_up)
    if config is None and not a8 and WO_TABLE is not None and not interpret_mode():
        config = WO_TABLE.lookup(block_m, N, K, gate_up, _device_name(x.device))
    if config is None and not a8 and WO_RULE and wo_rule_rows(M) and not interpret_mode():
        config = wo_config(M, N, K, _num_sms(x.device), gate_up)
    if config is not None and "BLOCK_M" in config:  # a wider row tile (A8 only)
        config = dict(config)
        block_m = config.pop("BLOCK_M")
        if not a8 or block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"BLOCK_M {block_m} is for the A8 tiles: 16-256, a power of 2")
    ws = torch.empty(_MAX_SPLIT * 2 * M * N, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, block_m), meta["SPLIT_K"])

    args = (x, w, scale, out, ws, cnt, sx if a8 else scale, M, N, K, x.stride(0), w.stride(0),
            out.stride(0))  # fmt: skip
    pdl = pdl_enabled(x)
    l2 = L2_AHEAD and pdl and bulk_prefetchable(w)
    if interpret_mode():
        config = config or {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1}
        config = {**config, "DOT_F32": True}
    if config is not None:
        c = dict(config)
        if block_m == 1 and "DOT_F32" in c:
            c["BLOCK_N"] = min(c["BLOCK_N"], 16)
        _heur[grid(c)](*args, BLOCK_M=block_m, GATE_UP=gate_up, A8=a8, L2_AHEAD=l2, **c,
                       **pdl_args(pdl))  # fmt: skip
    else:
        tuner = _gemv if block_m == 1 else _gemm
        tuner[grid](*args, BLOCK_M=block_m, GATE_UP=gate_up, A8=a8, L2_AHEAD=l2, **pdl_args(pdl))
    return out


def fp8_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    config: dict | None = None,
    gate_up: bool = False,
) -> torch.Tensor:
    """x [M, K] bf16 (row-major), w [N, K] fp8, scale [N] fp32 -> [M, N] in x's dtype;
    gate_up: w is [2N, K] (gate rows, then up rows) -> silu(gate) * up [M, N].

    config: optional fixed {BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages} (benchmarks).
    """
    return _launch(x, w, scale, None, x.dtype, config, gate_up)


def fp8_linear_a8_triton(
    xq: torch.Tensor,
    sx: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    config: dict | None = None,
    gate_up: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """W8A8: xq [M, K] fp8 rows with scales sx [M] (or [M, 1]) fp32, w [N, K] fp8, scale
    [N] fp32 -> [M, N] out_dtype: sx[m] * scale[n] * sum_k xq[m, k] w[n, k] (fp32 sums);
    gate_up as in `fp8_linear_triton`."""
    if xq.dtype != w.dtype:
        raise TypeError(f"A8 needs FP8 rows like the weight ({w.dtype}), got {xq.dtype}")
    sx = sx.reshape(-1).float().contiguous()
    if sx.numel() != xq.shape[0]:
        raise ValueError(f"{sx.numel()} row scales for {xq.shape[0]} rows")
    return _launch(xq, w, scale, sx, out_dtype, config, gate_up)


def _config_dict(cfg: triton.Config) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def autotuned() -> list[dict]:
    """The weight-only kernel's autotuned picks so far in this process, one per tuning key, in
    `wo_table`'s entry form (rows: the row tile; "M" too under TUNE_BY_ROWS): what a run
    logs, so processes of one plan can be compared pick by pick (and a run's picks kept as
    a table)."""
    picks = []
    for tuner in (_gemv, _gemm):
        for key, cfg in getattr(tuner, "cache", {}).items():
            entry = {"rows": int(key[2]), "N": int(key[0]), "K": int(key[1]),
                     "gate_up": bool(key[3])}  # fmt: skip
            if TUNE_BY_ROWS:
                entry["M"] = int(key[4])
            entry["config"] = _config_dict(cfg)
            picks.append(entry)
    return sorted(picks, key=lambda e: (e["rows"], e["N"], e["K"], e["gate_up"], e.get("M", 0)))


def best_config(M: int, N: int, K: int, a8: bool = False) -> dict | None:
    """The autotuner's pick for this shape (after a call), for reports; A8 (and the
    weight-only kernel under WO_RULE, where it covers the rows): the rule's; a shape in
    WO_TABLE (on the GPU it was measured on): the table's."""
    if a8:
        return a8_config(M, N, K)
    if WO_TABLE is not None and torch.cuda.is_available():
        c = WO_TABLE.lookup(m_bucket(M), N, K, False, _device_name(torch.device("cuda")))
        if c is not None:
            return c
    if WO_RULE and wo_rule_rows(M):
        return wo_config(M, N, K)
    tuner = _gemv if m_bucket(M) == 1 else _gemm
    for key, cfg in tuner.cache.items():
        if tuple(key[:3]) == (N, K, m_bucket(M, a8)) and (not TUNE_BY_ROWS or key[4] == M):
            return _config_dict(cfg)
    return None
