"""Triton: a speculative round's books and counters, its verify inputs' table rows, a frame's
staged inputs and the rows' state after codebook 1 (plugins.spec_round). One program each
(a round has at most a few hundred entries), one per row for the state; every input is read
after the PDL wait (the depths and pending codes come from the kernel before: the previous
round's acceptance, or the first pass's sampler)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _round_books_kernel(depth_ptr, base_ptr, books_ptr, counters_ptr, start_ptr, B, K,
                        BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    offs_b = tl.arange(0, BLOCK_B)
    offs_t = tl.arange(0, BLOCK_T)
    bmask = offs_b < B
    pdl_prologue(PDL)
    depth = tl.load(depth_ptr + offs_b, mask=bmask, other=0)
    base = tl.load(base_ptr + offs_b, mask=bmask, other=0)
    books = depth[:, None] + 1 + offs_t[None, :]
    tl.store(start_ptr + offs_b, depth + 1, mask=bmask)
    tl.store(books_ptr + offs_b[:, None] * (K + 1) + offs_t[None, :], books,
             mask=bmask[:, None] & (offs_t[None, :] <= K))  # fmt: skip
    tl.store(counters_ptr + offs_b[:, None] * K + offs_t[None, :], base[:, None] + books,
             mask=bmask[:, None] & (offs_t[None, :] < K))  # fmt: skip


def round_books_triton(depth: torch.Tensor, base: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    B = depth.shape[0]
    books = torch.empty(B, k + 1, dtype=torch.int64, device=depth.device)
    counters = torch.empty(B * k, dtype=torch.int64, device=depth.device)
    start = torch.empty(B, dtype=torch.int64, device=depth.device)
    _round_books_kernel[(1,)](
        depth.contiguous(), base.contiguous(), books, counters, start, B, k,
        BLOCK_B=triton.next_power_of_2(B), BLOCK_T=triton.next_power_of_2(k + 1),
        **pdl_args(pdl_enabled(depth)), num_warps=1,
    )  # fmt: skip
    return books, counters, start


@triton.jit
def _verify_index_kernel(pending_ptr, drafts_ptr, stride_db, books_ptr, stride_bb, out_ptr, B,
                         K, G, V, POSITION_MAJOR: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    offs_b = tl.arange(0, BLOCK_B)[:, None]
    offs_t = tl.arange(0, BLOCK_T)[None, :]
    mask = (offs_b < B) & (offs_t <= K)
    pdl_prologue(PDL)
    pending = tl.load(pending_ptr + offs_b, mask=offs_b < B, other=0)
    drafts = tl.load(drafts_ptr + offs_b * stride_db + (offs_t - 1),
                     mask=mask & (offs_t >= 1), other=0)  # fmt: skip
    codes = tl.where(offs_t == 0, pending, drafts)
    books = tl.load(books_ptr + offs_b * stride_bb + offs_t, mask=mask, other=2)
    tables = tl.minimum(tl.maximum(books - 2, 0), G - 2)
    if POSITION_MAJOR:
        where = offs_t * B + offs_b
    else:
        where = offs_b * (K + 1) + offs_t
    tl.store(out_ptr + where, tables * V + codes, mask=mask)


def verify_index_triton(pending: torch.Tensor, drafts: torch.Tensor, books: torch.Tensor,
                        groups: int, vocab: int, position_major: bool) -> torch.Tensor:  # fmt: skip
    B, k = drafts.shape
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    if books.stride(1) != 1:
        books = books.contiguous()
    out = torch.empty(B * (k + 1), dtype=torch.int64, device=pending.device)
    _verify_index_kernel[(1,)](
        pending.contiguous(), drafts, drafts.stride(0), books, books.stride(0), out, B, k,
        groups, vocab, POSITION_MAJOR=position_major, BLOCK_B=triton.next_power_of_2(B),
        BLOCK_T=triton.next_power_of_2(k + 1), **pdl_args(pdl_enabled(pending)), num_warps=1,
    )  # fmt: skip
    return out


@triton.jit
def _stage_field(src, plain_dst, draft_dst, j, row, plain, drafted):
    """A field's rows as they are, then repeated per draft draw (lane j is draft row j)."""
    tl.store(plain_dst + j, tl.load(src + j, mask=plain), mask=plain)
    tl.store(draft_dst + j, tl.load(src + row, mask=drafted), mask=drafted)


@triton.jit
def _stage_frame_kernel(f0, f1, f2, f3, f4, f5, f6, p0, p1, p2, p3, p4, p5, p6,
                        d0, d1, d2, d3, d4, d5, base_ptr, first_ptr, B, K, groups, base_offset,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    j = tl.arange(0, BLOCK)
    row = j // K
    pdl_prologue(PDL)
    plain = j < B
    drafted = j < B * K
    _stage_field(f0, p0, d0, j, row, plain, drafted)
    _stage_field(f1, p1, d1, j, row, plain, drafted)
    _stage_field(f2, p2, d2, j, row, plain, drafted)
    _stage_field(f3, p3, d3, j, row, plain, drafted)
    _stage_field(f4, p4, d4, j, row, plain, drafted)
    _stage_field(f5, p5, d5, j, row, plain, drafted)
    frames = tl.load(f6 + j, mask=plain)
    tl.store(p6 + j, frames, mask=plain)
    tl.store(base_ptr + j, base_offset + frames * groups, mask=plain)
    tl.store(first_ptr + j, frames * groups + 1, mask=plain)


def stage_frame_triton(fields, plain, draft, base, first, k: int, groups: int,
                       base_offset: int) -> None:  # fmt: skip
    B = fields[0].shape[0]
    fields = [f.contiguous() for f in fields]
    _stage_frame_kernel[(1,)](
        *fields, *plain, *draft, base, first, B, k, groups, base_offset,
        BLOCK=triton.next_power_of_2(B * k), **pdl_args(pdl_enabled(base)), num_warps=1,
    )  # fmt: skip


@triton.jit
def _frame_start_kernel(code1_ptr, c0_ptr, h_ptr, stride_h, depth_ptr, pending_ptr, source_ptr,
                        stride_s, codes_ptr, stride_c, live_ptr, H, groups,
                        BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    b = tl.program_id(0)
    pdl_prologue(PDL)
    code1 = tl.load(code1_ptr + b)
    tl.store(depth_ptr + b, tl.full((), 1, tl.int64))
    tl.store(pending_ptr + b, code1)
    tl.store(codes_ptr + b * stride_c, tl.load(c0_ptr + b))
    tl.store(codes_ptr + b * stride_c + 1, code1)
    for k0 in range(0, H, BLOCK_H):
        offs = k0 + tl.arange(0, BLOCK_H)
        row = tl.load(h_ptr + b.to(tl.int64) * stride_h + offs, mask=offs < H)
        tl.store(source_ptr + b.to(tl.int64) * stride_s + offs, row, mask=offs < H)
    if b == 0:  # every row is at depth 1: live while 1 < G - 1
        tl.store(live_ptr, (groups > 2).to(tl.int32))


def frame_start_triton(code1, c0, h, depth, pending, source, codes, live, groups: int) -> None:
    B, H = h.shape
    if h.stride(1) != 1:
        h = h.contiguous()
    _frame_start_kernel[(B,)](
        code1.contiguous(), c0.contiguous(), h, h.stride(0), depth, pending, source,
        source.stride(0), codes, codes.stride(0), live, H, groups,
        BLOCK_H=min(1024, triton.next_power_of_2(H)), **pdl_args(pdl_enabled(h)), num_warps=4,
    )  # fmt: skip
