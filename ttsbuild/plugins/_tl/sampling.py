"""Triton fused sampler: one program per row, the whole vocabulary in registers.

Order keys: a float's bits, flipped so unsigned order = float order (-0.0 made +0.0 first
so that it ties with +0.0 as in float compares). The k-th largest key is found digit by digit
(largest t with #{key >= t} >= k); the top-p cut likewise (largest t with
mass{key <= t} <= 1 - top_p; keep keys > t, and always the maximum). A digit of RADIX_BITS bits
takes one block reduction over all its 2^RADIX_BITS candidates (the counts fall, the masses
grow, with the digit: the largest digit that still holds is the bit-by-bit search's choice),
so 32 / RADIX_BITS reductions per search instead of 32: each reduction is a cross-warp
round trip through shared memory, and at one program per row they are the kernel's latency.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import exp_f32, log_f32, pdl_prologue

# Bits per digit of the threshold searches: 1 (bit by bit, 32 reductions per search: the
# timed default) until 4 (8 reductions) is timed on the GPU (TTSBUILD_SAMPLE_RADIX_BITS=4;
# gpu_session.sh step cp times both).
_RADIX_ENV = os.environ.get("TTSBUILD_SAMPLE_RADIX_BITS", "1")
if _RADIX_ENV not in ("1", "2", "4"):
    raise ValueError(f"TTSBUILD_SAMPLE_RADIX_BITS must be 1, 2 or 4, got {_RADIX_ENV!r}")
_RADIX_BITS = int(_RADIX_ENV)


# Warps per row's program, all vocabularies (unset: `_warps`' choice). For the engine-level A/B
# of what benchmarks/kernels/bench_sampler.py times alone (the 2026-12-03 profile: 18.7 us a
# call at 8 warps, 16 calls a frame, each mostly 32 dependent cross-warp reductions).
_WARPS_ENV = os.environ.get("TTSBUILD_SAMPLE_WARPS", "")
if _WARPS_ENV not in ("", "1", "2", "4", "8", "16"):
    raise ValueError(f"TTSBUILD_SAMPLE_WARPS must be 1, 2, 4, 8 or 16, got {_WARPS_ENV!r}")


# The bit-by-bit top-k search stopped once decided (`topk_threshold_early`: exact, ~half the
# reductions on fine fp32 logits). On by default since timed on the H200 (2026-12-04: a
# code-predictor sampler call 12.5 -> 6.8 us, the batch-1 frame 3.29 -> 3.17 ms);
# TTSBUILD_SAMPLE_EARLY_EXIT=0 turns it off (bench_sampler.py times both).
EARLY_EXIT = os.environ.get("TTSBUILD_SAMPLE_EARLY_EXIT", "1") != "0"

# Sampling rows with top-p 1 (the 12 Hz models' config) try the unrestricted Gumbel-max first:
# its winner is the top-k draw exactly when fewer than k keys lie above the winner's (one
# count instead of the threshold search; the winner is the maximum over a superset of the
# kept set, so over the set too, ties to the first index alike). A trained model's logits put
# nearly all the mass in the top k, so the search is then skipped; flat logits fall back to it
# (three block reductions more). On by default since timed on the H200 (2026-12-04, one
# process, 9 rounds: the code-predictor frame at 1 / 8 rows 1.979 / 2.523 -> 1.849 / 2.412 ms,
# the same codes; benchmarks/kernels/2026-12-04-h200-first-try/); TTSBUILD_SAMPLE_FIRST_TRY=0
# turns it off (bench_sampler.py times both).
FIRST_TRY = os.environ.get("TTSBUILD_SAMPLE_FIRST_TRY", "1") != "0"


def _warps(block_v: int, radix_bits: int) -> int:
    """Warps for a row of block_v: the [2^radix_bits, block_v] candidate tiles of the digit
    searches in registers without spilling (offline sm_90 compile: 4096 x 16 candidates at
    8 warps spills 616 bytes of stack; at 16 warps 82 registers; 2048 at 8 warps 95)."""
    if _WARPS_ENV:
        return int(_WARPS_ENV)
    if block_v >= 4096 and radix_bits == 4:
        return 16
    return 8 if block_v >= 2048 else 4


@triton.jit
def _hash32(x):
    # lowbias32 on uint32 (wrapping multiplies), as generation.sampling.hash32
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, dosample_ptr,
    seed_ptr, ctr_ptr, stride_ctr, hist_ptr, stride_hist, pen_ptr, out_ptr,
    BLOCK_V: tl.constexpr, HAS_PENALTY: tl.constexpr, IS_BF16: tl.constexpr,
    RADIX_BITS: tl.constexpr, PDL: tl.constexpr = False, EARLY_EXIT: tl.constexpr = False,
    FIRST_TRY: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    token = sample_row(
        row, logits_ptr + row.to(tl.int64) * stride_row, V, temp_ptr, topk_ptr, topp_ptr,
        dosample_ptr, seed_ptr, ctr_ptr, stride_ctr, hist_ptr, stride_hist, pen_ptr,
        BLOCK_V, HAS_PENALTY, IS_BF16, RADIX_BITS, False, EARLY_EXIT, FIRST_TRY,
    )  # fmt: skip
    tl.store(out_ptr + row, token)


# The bit-by-bit search's step after which `topk_threshold_early` checks once for ties at the
# k-th largest key (equal keys never split, so only this check ends such a search before bit 32).
TIE_CHECK_STEP = tl.constexpr(18)


@triton.jit
def topk_threshold_early(key, k, BLOCK_V: tl.constexpr):
    """A threshold t with {key >= t} = {key >= K}, K the k-th largest of `key` (uint32
    [BLOCK_V], padding 0, 0 < k < BLOCK_V): the bit-by-bit search for K (the largest t with
    #{key >= t} >= k), stopped as soon as its prefix t decides the set:
    - #{key >= t} == k: those k keys are the top k (a key in [t, K) would make k + 1);
    - once, after TIE_CHECK_STEP bits: m = min{key >= t} with #{key > m} < k is K itself
      (#{key >= m} >= k, and fewer than k above it), returned as t;
    - else bit 32, where t = K.
    Fine fp32 keys decide after ~16 of 32 bits (CPU simulation: median 16-17 at V 2048 /
    3072, never over 25); bf16 ties end at the check."""
    kth = tl.zeros((), tl.uint32)
    count = tl.full((), BLOCK_V, tl.int32)  # keys >= 0: all of them, padding included
    i = tl.zeros((), tl.int32)
    while (count != k) & (i < 32):
        cand = kth | (tl.full((), 1, tl.uint32) << (31 - i).to(tl.uint32))
        cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
        take = cnt >= k
        kth = tl.where(take, cand, kth)
        count = tl.where(take, cnt, count)
        i += 1
        if (i == TIE_CHECK_STEP) & (count != k):
            m = tl.min(tl.where(key >= kth, key, tl.full((BLOCK_V,), 0xFFFFFFFF, tl.uint32)),
                       axis=0)  # fmt: skip
            if tl.sum((key > m).to(tl.int32), axis=0) < k:
                kth = m
                count = k
    return kth


@triton.jit
def uniforms(seed, ctr, offs):
    """u in (0, 1) at columns `offs` of the draw keyed by (seed, ctr) (int64 values): the
    counter-based noise of generation.sampling.uniform_noise."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    skey = _hash32(lo) ^ _hash32(hi ^ 0x68E31DA4)
    stream = _hash32(skey ^ _hash32(((ctr + 0x1B873593) & 0xFFFFFFFF).to(tl.uint32)))
    cols = _hash32(offs.to(tl.uint32) + 0x3C6EF372)
    rbits = _hash32(stream ^ cols)
    u = ((rbits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return tl.minimum(u, 0.999999940395355224609375)  # 1 - 2^-24: the top bin rounds to 1.0


@triton.jit
def gumbel_noise(seed, ctr, offs):
    """Gumbel noise at columns `offs` of the draw keyed by (seed, ctr)."""
    return -log_f32(-log_f32(uniforms(seed, ctr, offs)))


@triton.jit
def _gumbel(seed_ptr, ctr_ptr, row, stride_ctr, offs):
    """Gumbel noise [BLOCK_V] of the row's draw: the counter-based noise of
    generation.sampling.uniform_noise."""
    seed = tl.load(seed_ptr + row)
    ctr = tl.load(ctr_ptr + row * stride_ctr)
    return gumbel_noise(seed, ctr, offs)


@triton.jit
def scaled_keys(x, temp, vmask):
    """x / temperature (fp32, -0.0 made +0.0) and its order keys (uint32, padding 0: below
    every real value, -inf included)."""
    scaled = tl.math.div_rn(x, temp + tl.zeros_like(x))
    scaled = tl.where(scaled == 0.0, 0.0, scaled)  # -0.0 -> +0.0
    bits = scaled.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return scaled, tl.where(vmask, key, 0)


@triton.jit
def kept_set(key, scaled, vmask, k, top_p, V, BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr,
             EARLY_EXIT: tl.constexpr):  # fmt: skip
    """The tokens top-k (k in 1..V; ties with the k-th value kept) then top-p (over what top-k
    kept; the maximum always kept) keep: a bool [BLOCK_V]."""
    # top-k: the k-th largest key (ties with it kept)
    kth = tl.zeros((), tl.uint32)
    digits = tl.arange(0, 1 << RADIX_BITS).to(tl.uint32)  # [R]: a candidate per digit value
    if EARLY_EXIT and RADIX_BITS == 1:
        if k < V:
            kth = topk_threshold_early(key, k, BLOCK_V)
    elif k < V:
        for i in tl.static_range(32 // RADIX_BITS):
            shift = 32 - RADIX_BITS * (i + 1)
            cand = kth | (digits << shift)  # [R]
            cnt = tl.sum((key[None, :] >= cand[:, None]).to(tl.int32), axis=1)
            # the count falls as the digit grows: the largest digit still counting k
            kth = kth | (tl.max(tl.where(cnt >= k, digits, 0), axis=0) << shift)
    keep = vmask & (key >= kth)

    # top-p over what top-k kept
    if top_p < 1.0:
        z = tl.where(keep, scaled, float("-inf"))
        zmax = tl.max(z, axis=0)
        e = tl.where(keep, exp_f32(z - zmax), 0.0)
        total = tl.sum(e, axis=0)
        budget = 1.0 - top_p
        kmax = tl.max(tl.where(keep, key, 0), axis=0)
        cut = tl.zeros((), tl.uint32)
        for i in tl.static_range(32 // RADIX_BITS):
            shift = 32 - RADIX_BITS * (i + 1)
            cand = cut | (digits << shift)  # [R]
            mass = tl.sum(tl.where(key[None, :] <= cand[:, None], e[None, :], 0.0),
                          axis=1) / total  # fmt: skip
            # the mass grows with the digit: the largest digit still within the budget
            cut = cut | (tl.max(tl.where(mass <= budget, digits, 0), axis=0) << shift)
        keep = keep & ((key > cut) | (key == kmax))
    return keep


@triton.jit
def sample_row(
    row, x_ptr, V, temp_ptr, topk_ptr, topp_ptr, dosample_ptr, seed_ptr, ctr_ptr, stride_ctr,
    hist_ptr, stride_hist, pen_ptr,
    BLOCK_V: tl.constexpr, HAS_PENALTY: tl.constexpr, IS_BF16: tl.constexpr,
    RADIX_BITS: tl.constexpr, L2_ONLY: tl.constexpr, EARLY_EXIT: tl.constexpr = False,
    FIRST_TRY: tl.constexpr = False,
):  # fmt: skip
    """The token (int64) of `row`, whose logits start at x_ptr, with that row's settings.
    L2_ONLY: the logits were written by other programs of the same launch (read past L1).
    EARLY_EXIT (bit by bit only): the top-k search stops once its prefix decides the kept
    set (`topk_threshold_early`). FIRST_TRY: a sampling row with top-p 1 takes the
    unrestricted Gumbel-max winner when it is in the top k (see the module's FIRST_TRY)."""
    offs = tl.arange(0, BLOCK_V)
    vmask = offs < V
    if L2_ONLY:
        x = tl.load(x_ptr + offs, mask=vmask, other=float("-inf"), cache_modifier=".cg")
    else:
        x = tl.load(x_ptr + offs, mask=vmask, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_PENALTY:
        pen = tl.load(pen_ptr + row)
        if IS_BF16:
            pen = pen.to(tl.bfloat16).to(tl.float32)
        hist = tl.load(hist_ptr + row.to(tl.int64) * stride_hist + offs, mask=vmask, other=0)
        pen_x = tl.where(x < 0, x * pen, tl.math.div_rn(x, pen + tl.zeros_like(x)))
        if IS_BF16:
            pen_x = pen_x.to(tl.bfloat16).to(tl.float32)
        x = tl.where(hist != 0, pen_x, x)
    greedy = tl.argmax(x, axis=0, tie_break_left=True)

    temp = tl.load(temp_ptr + row)
    scaled, key = scaled_keys(x, temp, vmask)

    do_sample = tl.load(dosample_ptr + row)
    k = tl.load(topk_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    top_p = tl.load(topp_ptr + row)
    drawn = tl.zeros((), tl.int32)
    found = tl.zeros((), tl.int32)
    if FIRST_TRY:
        if do_sample == 0:
            found = tl.full((), 1, tl.int32)  # greedy: no search
        elif top_p >= 1.0:
            first = tl.argmax(scaled + _gumbel(seed_ptr, ctr_ptr, row, stride_ctr, offs), axis=0,
                              tie_break_left=True)  # fmt: skip
            first_key = tl.max(tl.where(offs == first, key, 0), axis=0)
            found = (tl.sum((key > first_key).to(tl.int32), axis=0) < k).to(tl.int32)
            drawn = first
    if found == 0:
        keep = kept_set(key, scaled, vmask, k, top_p, V, BLOCK_V, RADIX_BITS, EARLY_EXIT)
        # Gumbel-max (the first try's noise recomputed, so that the search runs with no more
        # live registers than without it)
        gumbel = _gumbel(seed_ptr, ctr_ptr, row, stride_ctr, offs)
        score = tl.where(keep, scaled + gumbel, float("-inf"))
        drawn = tl.argmax(score, axis=0, tie_break_left=True)
    return tl.where(do_sample != 0, drawn, greedy).to(tl.int64)


def sample_triton(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    history: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
    early_exit: bool | None = None,
    first_try: bool | None = None,
) -> torch.Tensor:
    """num_warps: warps per row's program (None: `_warps`' choice for the vocabulary);
    early_exit: the top-k search stopped once decided (None: EARLY_EXIT); first_try: the
    unrestricted draw tried first (None: FIRST_TRY). The tokens depend on none of them
    (integer counts, exact thresholds, first-index argmax; only the top-p mass sums in another
    order)."""
    B, V = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be fp32/bf16/fp16, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    has_pen = history is not None
    if has_pen:
        hist = history if history.dtype != torch.bool else history.view(torch.uint8)
        pen = batch.repetition_penalty.float()
        hstride = hist.stride(0)
    else:
        hist, pen, hstride = out, out, 0
    block_v = triton.next_power_of_2(V)
    pdl = pdl_enabled(logits)
    _sample_kernel[(B,)](
        logits, logits.stride(0), V, batch.temperature.float(), batch.top_k, batch.top_p.float(),
        batch.do_sample.view(torch.uint8) if batch.do_sample.dtype == torch.bool
        else batch.do_sample,
        seeds, counters, counters.stride(0), hist, hstride, pen, out,
        BLOCK_V=block_v, HAS_PENALTY=has_pen, IS_BF16=logits.dtype == torch.bfloat16,
        RADIX_BITS=_RADIX_BITS, **pdl_args(pdl),
        EARLY_EXIT=EARLY_EXIT if early_exit is None else early_exit,
        FIRST_TRY=FIRST_TRY if first_try is None else first_try,
        num_warps=num_warps or _warps(block_v, _RADIX_BITS),
    )  # fmt: skip
    return out
