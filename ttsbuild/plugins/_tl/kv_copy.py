"""Triton: a prompt prefix's KV from the prefix pool into slots, only its own positions (see
plugins.kv_copy)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _prefix_copy_kernel(
    dk_ptr, dv_ptr, sk_ptr, sv_ptr, slot_ptr, entry_ptr, start_ptr,
    stride_slot, stride_entry, stride_start, H, P,
    d_l, d_s, d_h, d_p, s_l, s_e, s_h, s_p,
    D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Program (layer x head, row j, block of positions): positions below row j's start of
    entry[j]'s K and V -> the same positions of slot[j] (D contiguous on both sides)."""
    lh = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
    start = tl.minimum(tl.load(start_ptr + j * stride_start), P)
    if pb * BLOCK_P < start:
        layer = (lh // H).to(tl.int64)
        head = (lh % H).to(tl.int64)
        slot = tl.load(slot_ptr + j * stride_slot)
        entry = tl.load(entry_ptr + j * stride_entry)
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        d = tl.arange(0, D)
        mask = (p < start)[:, None]
        src = layer * s_l + entry * s_e + head * s_h + p[:, None].to(tl.int64) * s_p + d[None, :]
        dst = layer * d_l + slot * d_s + head * d_h + p[:, None].to(tl.int64) * d_p + d[None, :]
        tl.store(dk_ptr + dst, tl.load(sk_ptr + src, mask=mask), mask=mask)
        tl.store(dv_ptr + dst, tl.load(sv_ptr + src, mask=mask), mask=mask)
