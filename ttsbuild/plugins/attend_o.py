"""A decoder layer's attention and its o projection with the residual add, in one launch.

`attend_o_residual` = residual + o(qk_norm_rope_attend(qkv, ...)): the new residual [B, N];
k and v of each row's token are written into the caches. For the code predictor's short
caches (at most MAX_POSITIONS positions), one token per row. On the GPU one launch in which
every program attends one KV group itself and multiplies its heads' outputs by its share of
the o projection (split-K over the groups): the attention's own launch and its dependent hop
are gone (plugins/_tl/attend_o.py). The reference is the two unfused ops in order (the CPU
path equals the unfused runtime path).
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.fp8_linear import FP8_DTYPE
from ttsbuild.plugins.fused_linear import fused_linear_reference
from ttsbuild.plugins.qk_norm_rope import inv_freq
from ttsbuild.plugins.qk_norm_rope_attend import qk_norm_rope_attend_reference


def attend_o_residual(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [B] int, < S
    slots: torch.Tensor,  # [B] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D], S <= MAX_POSITIONS
    v_cache: torch.Tensor,
    weight: torch.Tensor,  # [N, Hq * D]: the o projection
    scale: torch.Tensor | None,  # [N] fp32, FP8 weights only
    residual: torch.Tensor,  # [B, N]
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    use_triton: bool | None = None,
    inputs_ready: bool = False,
    residual_ready: bool = False,
    block_n: int | None = None,
) -> torch.Tensor:
    """residual + qk_norm_rope_attend(qkv, ...) @ weight.T (times scale): [B, N].
    inputs_ready: positions, slots and the cached entries below each position were written
    two or more launches back; residual_ready: the residual was (both read before the PDL
    wait). block_n: the output columns per program (default by batch)."""
    if (scale is not None) != (weight.dtype == FP8_DTYPE):
        raise TypeError("FP8 weights need their per-channel scale, other weights none")
    if qkv.shape[0] != positions.numel() or slots.numel() != positions.numel():
        raise ValueError(f"one token per row: qkv [B, ...], positions and slots [B]; got qkv "
                         f"{tuple(qkv.shape)}, positions {tuple(positions.shape)}, slots "
                         f"{tuple(slots.shape)}")  # fmt: skip
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if not want_triton(qkv, use_triton):
        attn = qk_norm_rope_attend_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, theta=theta, **kw
        )
        return fused_linear_reference(attn, weight, scale, residual=residual)
    from ttsbuild.plugins._tl.attend_o import attend_o_residual_triton

    D = k_cache.shape[-1]
    return attend_o_residual_triton(
        qkv, q_weight, k_weight, inv_freq(D, theta, qkv.device), positions, slots, k_cache,
        v_cache, weight, scale, residual, scale_qk=D**-0.5, inputs_ready=inputs_ready,
        residual_ready=residual_ready, block_n=block_n, **kw,
    )  # fmt: skip
