"""Triton: a prompt's codec track in one launch (plugins.prompt_embed).

Grid (row, tile of the hidden size): the row's codes read once, each used codebook's
embedding row added in fp32 (codebook 0 from its table, the rest from the stacked
[G - 1, V, H] tables), rounded once to the tables' dtype; the x-vector instead where the
row's flag is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _codec_track_kernel(rows_ptr, stride_row, t0_ptr, rest_ptr, xv_ptr, stride_xv, out_ptr,
                        H, V, G: tl.constexpr, VOICE: tl.constexpr, CODES: tl.constexpr,
                        HAS_XV: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    row = rows_ptr + r * stride_row
    acc = tl.zeros((BLOCK_H,), tl.float32)
    c0 = tl.load(row + CODES)
    if c0 >= 0:
        acc += tl.load(t0_ptr + c0 * H + offs, mask=m, other=0.0).to(tl.float32)
    for g in tl.static_range(1, G):
        c = tl.load(row + CODES + g)
        if c >= 0:
            acc += tl.load(rest_ptr + ((g - 1) * V + c) * H + offs, mask=m,
                           other=0.0).to(tl.float32)  # fmt: skip
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_XV:
        if tl.load(row + VOICE) > 0:
            out = tl.load(xv_ptr + r * stride_xv + offs, mask=m, other=0.0).to(
                out_ptr.dtype.element_ty)  # fmt: skip
    tl.store(out_ptr + r * H + offs, out, mask=m)


def codec_track_triton(rows: torch.Tensor, table0: torch.Tensor, rest: torch.Tensor,
                       x_vector: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    from ttsbuild.plugins.prompt_embed import CODES, VOICE

    T = rows.shape[0]
    G, V, H = rest.shape[0] + 1, rest.shape[1], rest.shape[2]
    if table0.shape[1] != H or rows.shape[1] < CODES + G:
        raise ValueError(f"codec_track: rows {tuple(rows.shape)}, table0 {tuple(table0.shape)}, "
                         f"rest {tuple(rest.shape)} do not fit")  # fmt: skip
    out = torch.empty((T, H), dtype=table0.dtype, device=table0.device)
    if T == 0:
        return out
    xv, stride_xv = (out, 0) if x_vector is None else (
        x_vector, 0 if x_vector.dim() == 1 else x_vector.stride(0))  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(H))
    _codec_track_kernel[(T, triton.cdiv(H, block_h))](
        rows, rows.stride(0), table0.contiguous(), rest.contiguous(), xv, stride_xv, out, H, V,
        G=G, VOICE=VOICE, CODES=CODES, HAS_XV=x_vector is not None, BLOCK_H=block_h,
        num_warps=4, **pdl_args(pdl_enabled(table0)),
    )  # fmt: skip
    return out
