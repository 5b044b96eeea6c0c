"""Triton: logits of one head per row from a stack of heads, read in place (plugins.head_gemv).

out[r] = heads[index[r]] @ x[r] for R rows: a grid of (row, tile of the vocabulary), each
program reading its tile of its row's head straight from the stack (no gathered copy of the
heads, no product with every head), fp32 sums rounded to the input dtype as a bf16 matmul
rounds its output. Everything is read after the PDL wait: the head a row needs comes from the
kernels before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _head_gemv_kernel(x_ptr, stride_x, w_ptr, idx_ptr, out_ptr, V, H, C,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr = False):  # fmt: skip
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < V
    pdl_prologue(PDL)  # the head index and the input come from the kernels before
    c = tl.load(idx_ptr + r)
    c = tl.minimum(tl.maximum(c, 0), C - 1)
    w_base = w_ptr + c.to(tl.int64) * V * H
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < H
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + offs_k, mask=kmask, other=0.0)
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * H + offs_k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * V + offs_n, out, mask=nmask)


def head_gemv_triton(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    C, V, H = heads.shape
    R = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(R, V, dtype=torch.float32, device=x.device)
    block_n = 64
    _head_gemv_kernel[(R, triton.cdiv(V, block_n))](
        x, x.stride(0), heads.contiguous(), index.contiguous(), out, V, H, C,
        BLOCK_N=block_n, BLOCK_K=min(256, triton.next_power_of_2(H)),
        **pdl_args(pdl_enabled(x)), num_warps=4,
    )  # fmt: skip
    return out
