"""Logits of one head per row, the head picked per row from a stack: the speculative code
predictor's draft and verify heads (runtime.cp_spec.head_logits).

The reference gathers each row's head ([R, V, H]: a copy of every head a row uses) and
multiplies; with many rows it is cheaper to apply every head once and pick. The kernel reads
each row's head in place."""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton


def head_gemv_reference(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """heads [C, V, H], x [R, H], index [R] (clamped to 0..C-1) -> logits [R, V] fp32 (the
    product in the heads' dtype, as a matmul of that dtype rounds it)."""
    C = heads.shape[0]
    w = heads[index.clamp(0, C - 1)]  # [R, V, H]
    return torch.einsum("rvh,rh->rv", w, x.to(heads.dtype)).float()


def head_gemv(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor, *,
              use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    if x.dim() != 2 or index.shape != (x.shape[0],) or x.shape[1] != heads.shape[2]:
        raise ValueError(
            f"head_gemv: heads {tuple(heads.shape)}, x {tuple(x.shape)}, index "
            f"{tuple(index.shape)} do not fit [C, V, H], [R, H], [R]"
        )
    if not want_triton(x, use_triton):
        return head_gemv_reference(heads, x, index)
    from ttsbuild.plugins._tl.head_gemv import head_gemv_triton

    return head_gemv_triton(heads, x.to(heads.dtype), index)
