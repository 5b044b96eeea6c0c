"""Triton: logits of one head per (row, position) from a stack of heads, read in place
(plugins.head_gemv).

out[b, t] = heads[clamp(index[b, t] + offset)] @ x[b, t] for B rows of T positions: a grid of
((row, position), tile of the vocabulary), each program reading its tile of its head straight
from the stack (no gathered copy of the heads, no product with every head), fp32 sums rounded
to the input dtype as a matmul of that dtype rounds its output. x and index are read through
their strides (x's position stride 0: one input for every position of a row), so callers pass
views, not copies. Everything is read after the PDL wait: the head a row needs comes from the
kernels before it. NORM: x is the residual stream; each program first sums its row's squares
(one extra read of H values) and feeds the head the RMSNorm's output as the model's norm
rounds it (x * rstd in fp32, rounded to the input dtype, times the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _head_gemv_kernel(x_ptr, stride_xb, stride_xt, w_ptr, idx_ptr, stride_ib, stride_it,
                      offset, out_ptr, T, V, H, C, g_ptr, eps, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NORM: tl.constexpr = False,
                      PDL: tl.constexpr = False):  # fmt: skip
    r = tl.program_id(0)
    b = r // T
    t = r % T
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < V
    pdl_prologue(PDL)
    c = tl.load(idx_ptr + b * stride_ib + t * stride_it) + offset
    c = tl.minimum(tl.maximum(c, 0), C - 1)
    w_base = w_ptr + c.to(tl.int64) * V * H
    x_base = x_ptr + b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xt
    rstd = 1.0
    if NORM:
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_base + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)
            squares += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / H + eps)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < H
        x = tl.load(x_base + offs_k, mask=kmask, other=0.0)
        if NORM:
            g = tl.load(g_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            # weight * normed in the input dtype, as torch multiplies two of them: in fp32,
            # rounded once (and no 16-bit arithmetic, which the interpreter gets wrong)
            normed = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (g * normed).to(x_ptr.dtype.element_ty)
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * H + offs_k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * V + offs_n, out, mask=nmask)


def head_gemv_triton(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor, offset: int,
                     norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:  # fmt: skip
    """heads [C, V, H]; x [B, T, H] (any strides but a unit last one); index [B, T] ->
    [B, T, V] fp32; norm: (weight [H] in x's dtype, eps)."""
    C, V, H = heads.shape
    B, T = index.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(B, T, V, dtype=torch.float32, device=x.device)
    block_n = 64
    _head_gemv_kernel[(B * T, triton.cdiv(V, block_n))](
        x, x.stride(0), x.stride(1), heads.contiguous(), index, index.stride(0), index.stride(1),
        offset, out, T, V, H, C, x if norm is None else norm[0].to(x.dtype).contiguous(),
        0.0 if norm is None else float(norm[1]), BLOCK_N=block_n,
        BLOCK_K=min(256, triton.next_power_of_2(H)), NORM=norm is not None,
        **pdl_args(pdl_enabled(x)), num_warps=4,
    )  # fmt: skip
    return out
