"""Logits of one head per (row, position), the head picked from a stack: the speculative code
predictor's draft and verify heads (runtime.cp_spec.head_logits).

The reference gathers each position's head ([B, T, V, H]: a copy of every head used) and
multiplies; the kernel reads each head in place, and its inputs and indices through their
strides. With `norm` (weight, eps) the input is the residual stream and the model's final
RMSNorm is applied first (in the kernel: each program normalises its position's row itself),
so the verify pass needs no norm launch of its own."""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.norm_act import rms_norm_reference


def head_gemv_reference(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor,
                        offset: int = 0, norm: tuple[torch.Tensor, float] | None = None,
                        ) -> torch.Tensor:  # fmt: skip
    """heads [C, V, H], x [B, T, H], index [B, T] (head clamp(index + offset, 0, C - 1)) ->
    logits [B, T, V] fp32 (the product in the heads' dtype, as a matmul of it rounds);
    norm: (weight [H], eps) of an RMSNorm applied to x first."""
    C = heads.shape[0]
    if norm is not None:
        x = rms_norm_reference(x, norm[0], norm[1])
    w = heads[(index + offset).clamp(0, C - 1)]  # [B, T, V, H]
    return torch.einsum("btvh,bth->btv", w, x.to(heads.dtype)).float()


def head_gemv(heads: torch.Tensor, x: torch.Tensor, index: torch.Tensor, offset: int = 0, *,
              norm: tuple[torch.Tensor, float] | None = None,
              use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    """x may be an expanded view (one input for every position of a row: stride 0)."""
    if x.dim() != 3 or index.shape != x.shape[:2] or x.shape[2] != heads.shape[2]:
        raise ValueError(
            f"head_gemv: heads {tuple(heads.shape)}, x {tuple(x.shape)}, index "
            f"{tuple(index.shape)} do not fit [C, V, H], [B, T, H], [B, T]"
        )
    if norm is not None and norm[0].shape != (heads.shape[2],):
        raise ValueError(f"head_gemv: a norm weight {tuple(norm[0].shape)} for heads of width "
                         f"{heads.shape[2]}")  # fmt: skip
    if not want_triton(x, use_triton):
        return head_gemv_reference(heads, x, index, offset, norm)
    from ttsbuild.plugins._tl.head_gemv import head_gemv_triton

    return head_gemv_triton(heads, x.to(heads.dtype), index, offset, norm)
