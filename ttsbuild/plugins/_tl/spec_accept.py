"""Triton: a speculative round's acceptance in one launch (plugins.spec_accept).

One program per row and position, the whole vocabulary in registers (as the fused
sampler). Program (row, t < K): the target's and the draft's filtered distributions p_t, q_t
(temperature, top-k, top-p: the fused sampler's exact thresholds, `kept_set`; one-hot at the
raw argmax for greedy rows), the test u < p(x) / q(x) with u of the row's ACCEPT_TEST counter
for t's codebook, and where it fails the draw from normalise(max(0, p_t - q_t)) (p_t where no
mass is left) by Gumbel-max with the FINAL_DRAW counter; program (row, K): the bonus draw
from p_K. A test and a draw depend on t's codebook only, never on the positions before it,
so the K + 1 programs run side by side, and the row's last program to arrive (its count in
the arrival counters) takes the first failed test as the row's result: accepted = the tests
passed before it, the code after them its draw (the bonus draw when all K pass). Before
(2026-12-05) one program per row ran the positions in turn: up to 2K + 1 threshold searches
back to back, each about one fused sampler's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import exp_f32, log_f32, pdl_prologue
from ttsbuild.plugins._tl.fp8_linear import _counters
from ttsbuild.plugins._tl.sampling import gumbel_noise, kept_set, scaled_keys, uniforms


@triton.jit
def _kept(x_ptr, V, temp, k, top_p, BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr):
    """A row's logits as its sampler sees them: (the raw argmax, the scaled logits, the kept
    set: the fused sampler's exact top-k / top-p thresholds)."""
    offs = tl.arange(0, BLOCK_V)
    vmask = offs < V
    x = tl.load(x_ptr + offs, mask=vmask, other=float("-inf")).to(tl.float32)
    greedy = tl.argmax(x, axis=0, tie_break_left=True)
    scaled, key = scaled_keys(x, temp, vmask)
    return greedy, scaled, kept_set(key, scaled, vmask, k, top_p, V, BLOCK_V, RADIX_BITS, True)


@triton.jit
def _probs(x_ptr, V, temp, k, top_p, do_sample, BLOCK_V: tl.constexpr,
           RADIX_BITS: tl.constexpr):  # fmt: skip
    """The distribution the row's sampler draws from, fp32 [BLOCK_V] (0 on padding)."""
    offs = tl.arange(0, BLOCK_V)
    greedy, scaled, keep = _kept(x_ptr, V, temp, k, top_p, BLOCK_V, RADIX_BITS)
    z = tl.where(keep, scaled, float("-inf"))
    zmax = tl.max(z, axis=0)
    e = tl.where(keep, exp_f32(z - zmax), 0.0)
    p = e / tl.sum(e, axis=0)
    return tl.where(do_sample != 0, p, tl.where(offs == greedy, 1.0, 0.0))


@triton.jit
def _plain_draw(x_ptr, V, temp, k, top_p, do_sample, seed, ctr, BLOCK_V: tl.constexpr,
                RADIX_BITS: tl.constexpr):  # fmt: skip
    """The plain sampler's draw (plugins._tl.sampling.sample_row, no penalty) of the logits at
    x_ptr with counter ctr: Gumbel-max over the kept set of the scaled logits, or the raw
    argmax for a greedy row."""
    offs = tl.arange(0, BLOCK_V)
    greedy, scaled, keep = _kept(x_ptr, V, temp, k, top_p, BLOCK_V, RADIX_BITS)
    score = tl.where(keep, scaled + gumbel_noise(seed, ctr, offs), float("-inf"))
    drawn = tl.argmax(score, axis=0, tie_break_left=True)
    return tl.where(do_sample != 0, drawn, greedy).to(tl.int64)


@triton.jit
def _draw(dist, seed, ctr, offs):
    """Gumbel-max over log(dist): a draw from dist (the fused sampler at temperature 1)."""
    score = log_f32(dist) + gumbel_noise(seed, ctr, offs)
    return tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)


@triton.jit
def _apply(row, accepted, final, drafts_ptr, books_ptr, h_ptr, stride_hb, stride_ht, H,
           codes_ptr, stride_codes, source_ptr, stride_source, pending_ptr, depth_ptr, live_ptr,
           arrivals_ptr, B, G, K: tl.constexpr, BLOCK_H: tl.constexpr,
           BLOCK_B: tl.constexpr):  # fmt: skip
    """The round's results into the row state (`plugins.spec_accept`'s RoundState): the
    accepted drafts and the final code into codes (the trash column is not written), the
    hidden state at the accepted depth into source, pending, depth; the last program to
    arrive writes live = some row is not done, and resets the arrival count."""
    for t in range(K + 1):
        book = tl.load(books_ptr + row * (K + 1) + t)
        if t < accepted:
            tl.store(codes_ptr + row * stride_codes + book, tl.load(drafts_ptr + row * K + t))
        elif t == accepted:
            tl.store(codes_ptr + row * stride_codes + book, final)
    src = h_ptr + row.to(tl.int64) * stride_hb + accepted * stride_ht
    for start in range(0, H, BLOCK_H):
        offs_h = start + tl.arange(0, BLOCK_H)
        mask = offs_h < H
        tl.store(source_ptr + row * stride_source + offs_h, tl.load(src + offs_h, mask=mask),
                 mask=mask)  # fmt: skip
    tl.store(pending_ptr + row, final)
    depth = tl.minimum(tl.load(depth_ptr + row) + accepted + 1, G - 1)
    tl.store(depth_ptr + row, depth)
    # release this row's depth (the barrier orders every thread's stores before the
    # atomic's release), then count it in; the last row reads every row's depth
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel") == B - 1:
        tl.debug_barrier()  # the acquire, for every thread of the program
        rows = tl.arange(0, BLOCK_B)
        depths = tl.load(depth_ptr + rows, mask=rows < B, other=G - 1, cache_modifier=".cg")
        tl.store(live_ptr, (tl.sum((depths < G - 1).to(tl.int32), axis=0) > 0).to(tl.int32))
        tl.atomic_xchg(arrivals_ptr, 0)


@triton.jit
def _spec_accept_kernel(
    draft_ptr, target_ptr, drafts_ptr, books_ptr, temp_ptr, topk_ptr, topp_ptr, dosample_ptr,
    seed_ptr, frames_ptr, accepted_ptr, final_ptr, ok_ptr, draws_ptr, rowcnt_ptr, V, G,
    h_ptr, stride_hb, stride_ht, H, codes_ptr, stride_codes, source_ptr, stride_source,
    pending_ptr, depth_ptr, live_ptr, arrivals_ptr, B,
    ACCEPT_KIND: tl.constexpr, FINAL_KIND: tl.constexpr, K: tl.constexpr,
    BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr, APPLY: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 1024, BLOCK_B: tl.constexpr = 1, BLOCK_K: tl.constexpr = 1,
    PDL: tl.constexpr = False, EXACT: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    t = tl.program_id(1)
    offs = tl.arange(0, BLOCK_V)
    temp = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    top_p = tl.load(topp_ptr + row)
    do_sample = tl.load(dosample_ptr + row)
    seed = tl.load(seed_ptr + row)
    frame = tl.load(frames_ptr + row)
    book = tl.load(books_ptr + row * (K + 1) + t)
    ctr = (FINAL_KIND << 28) + frame * G + book
    if EXACT:  # exact match: the target's plain draw; a draft passes where it equals it
        d = _plain_draw(target_ptr + (row * (K + 1) + t).to(tl.int64) * V, V, temp, k, top_p,
                        do_sample, seed, frame * G + book, BLOCK_V, RADIX_BITS)  # fmt: skip
        tl.store(draws_ptr + row * (K + 1) + t, d)
        if t < K:
            tl.store(ok_ptr + row * K + t, (tl.load(drafts_ptr + row * K + t) == d).to(tl.int8))
    elif t < K:
        p = _probs(target_ptr + (row * (K + 1) + t).to(tl.int64) * V, V, temp, k, top_p,
                   do_sample, BLOCK_V, RADIX_BITS)  # fmt: skip
        q = _probs(draft_ptr + (row * K + t).to(tl.int64) * V, V, temp, k, top_p, do_sample,
                   BLOCK_V, RADIX_BITS)  # fmt: skip
        x = tl.load(drafts_ptr + row * K + t)
        px = tl.sum(tl.where(offs == x, p, 0.0), axis=0)
        qx = tl.sum(tl.where(offs == x, q, 0.0), axis=0)
        u = uniforms(seed, (ACCEPT_KIND << 28) + frame * G + book, tl.zeros((), tl.int32))
        ok = u * qx < px
        tl.store(ok_ptr + row * K + t, ok.to(tl.int8))
        if ok == 0:
            residual = tl.maximum(p - q, 0.0)
            dist = tl.where(tl.sum(residual, axis=0) > 0, residual, p)
            tl.store(draws_ptr + row * (K + 1) + t, _draw(dist, seed, ctr, offs))
    else:
        p = _probs(target_ptr + (row * (K + 1) + t).to(tl.int64) * V, V, temp, k, top_p,
                   do_sample, BLOCK_V, RADIX_BITS)  # fmt: skip
        tl.store(draws_ptr + row * (K + 1) + t, _draw(p, seed, ctr, offs))
    # release this position's test and draw (the barrier orders every thread's stores before
    # the atomic's release), then count it in; the row's last program takes the result
    tl.debug_barrier()
    if tl.atomic_add(rowcnt_ptr + row, 1, sem="acq_rel") == K:
        tl.debug_barrier()  # the acquire, for every thread of the program
        tl.atomic_xchg(rowcnt_ptr + row, 0)
        steps = tl.arange(0, BLOCK_K)
        oks = tl.load(ok_ptr + row * K + steps, mask=steps < K, other=0, cache_modifier=".cg")
        # accepted = the tests passed before the first failure (K where none failed)
        accepted = tl.min(tl.where((oks == 0) & (steps < K), steps, K), axis=0).to(tl.int64)
        final = tl.load(draws_ptr + row * (K + 1) + accepted, cache_modifier=".cg")
        tl.store(ok_ptr + row * K + steps, (steps < accepted).to(tl.int8), mask=steps < K)
        tl.store(accepted_ptr + row, accepted)
        tl.store(final_ptr + row, final)
        if APPLY:
            _apply(row, accepted, final, drafts_ptr, books_ptr, h_ptr, stride_hb, stride_ht, H,
                   codes_ptr, stride_codes, source_ptr, stride_source, pending_ptr, depth_ptr,
                   live_ptr, arrivals_ptr, B, G, K, BLOCK_H, BLOCK_B)  # fmt: skip


def spec_accept_triton(
    draft_logits: torch.Tensor,  # [B, K, V] fp32
    target_logits: torch.Tensor,  # [B, K + 1, V] fp32
    drafts: torch.Tensor,  # [B, K] int64
    books: torch.Tensor,  # [B, K + 1] int64
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    do_sample: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    groups: int,
    accept_kind: int,
    final_kind: int,
    h: torch.Tensor | None = None,  # [B, K + 1, H]: the verify pass's hidden states
    state=None,  # plugins.spec_accept.RoundState: apply the results to it
    exact: bool = False,  # exact match (plugins.spec_accept, exact=True): draft logits unread
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, K, V = draft_logits.shape
    dev = draft_logits.device
    accepted = torch.empty(B, dtype=torch.int64, device=dev)
    final = torch.empty(B, dtype=torch.int64, device=dev)
    ok = torch.empty(B, K, dtype=torch.int8, device=dev)
    block_v = triton.next_power_of_2(V)
    drafts = drafts.contiguous()
    books = books.contiguous()
    if state is None:
        apply = (accepted, 0, 0, 0, accepted, 0, accepted, 0, accepted, accepted, ok, ok, B)
        blocks = {}
    else:
        for name in ("codes", "source", "pending", "depth"):
            if getattr(state, name).stride(-1) != 1:
                raise ValueError(f"spec_accept: the state's {name} must be contiguous rows")
        if h.stride(-1) != 1:
            h = h.contiguous()
        apply = (h, h.stride(0), h.stride(1), h.shape[-1], state.codes, state.codes.stride(0),
                 state.source, state.source.stride(0), state.pending, state.depth, state.live,
                 state.arrivals, B)  # fmt: skip
        blocks = {"APPLY": True, "BLOCK_H": min(1024, triton.next_power_of_2(h.shape[-1])),
                  "BLOCK_B": triton.next_power_of_2(B)}  # fmt: skip
    draws = torch.empty(B, K + 1, dtype=torch.int64, device=dev)  # each position's draw
    _spec_accept_kernel[(B, K + 1)](
        draft_logits.contiguous(), target_logits.contiguous(), drafts, books,
        temperature.float(), top_k, top_p.float(),
        do_sample.view(torch.uint8) if do_sample.dtype == torch.bool else do_sample,
        seeds, frames, accepted, final, ok, draws, _counters(dev), V, groups, *apply,
        ACCEPT_KIND=accept_kind, FINAL_KIND=final_kind, K=K, BLOCK_V=block_v, RADIX_BITS=1,
        BLOCK_K=triton.next_power_of_2(max(K, 1)), EXACT=exact, **blocks,
        **pdl_args(pdl_enabled(draft_logits)), num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    return accepted, final, ok.view(torch.bool)  # 0 / 1: a view, not a conversion
