"""q/k norm + RoPE + K/V cache write + attention over a short cache, fused (one launch).

For the code predictor, whose context is at most 17 positions: `qk_norm_rope` followed by
`decode_attention` over positions [0, position] of each row's cache slot, returning the
attention output flattened to [R, Hq * D] (the o projection's input). Long caches (the
talker) keep the two kernels.
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.decode_attention import decode_attention_reference
from ttsbuild.plugins.qk_norm_rope import inv_freq, qk_norm_rope_reference

MAX_POSITIONS = 64  # caches up to this many positions fit the fused kernel's register tile


def qk_norm_rope_attend_reference(
    qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, *,
    num_heads, num_kv_heads, eps, theta,
):  # fmt: skip
    q = qk_norm_rope_reference(
        qkv, q_weight, k_weight, positions, slots, k_cache, v_cache,
        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, theta=theta,
    )  # fmt: skip
    attn = decode_attention_reference(q, k_cache, v_cache, slots, positions + 1)
    return attn.reshape(qkv.shape[0], -1)


def qk_norm_rope_attend(
    qkv: torch.Tensor,  # [R, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [R] int, < S
    slots: torch.Tensor,  # [R] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D], S <= MAX_POSITIONS
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    use_triton: bool | None = None,
    inputs_ready: bool = False,
    tokens: int = 1,
) -> torch.Tensor:
    """Attention output [R, Hq * D] of each row's token at its position over the row's
    positions [0, position]; k and v of the token are written into the caches.
    inputs_ready: positions, slots and the cached entries below each position were written
    two or more launches before this one (only qkv by the launch right before it), so under
    programmatic dependent launch they are read before waiting for that launch.
    tokens: consecutive tokens of the same rows in one call, qkv [tokens * B, ...] token
    by token (row t * B + i: row i's token t), positions and slots [B] (token t at position
    positions[i] + t): each token attends over the ones before it, those of this call
    included (the code predictor's two-token prefill as one pass)."""
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if tokens < 1 or qkv.shape[0] != tokens * positions.numel() \
            or slots.numel() != positions.numel():
        raise ValueError(f"{tokens} tokens per row need qkv [{tokens} * B, ...] and positions "
                         f"and slots [B]; got qkv {tuple(qkv.shape)}, positions "
                         f"{tuple(positions.shape)}, slots {tuple(slots.shape)}")  # fmt: skip
    if not want_triton(qkv, use_triton):
        if tokens > 1:  # every token's k/v written before any attends (the reference's order)
            positions = torch.cat([positions.reshape(-1) + t for t in range(tokens)])
            slots = slots.reshape(-1).repeat(tokens)
        return qk_norm_rope_attend_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, theta=theta, **kw
        )
    from ttsbuild.plugins._tl.qk_norm_rope_attend import qk_norm_rope_attend_triton

    D = k_cache.shape[-1]
    return qk_norm_rope_attend_triton(
        qkv, q_weight, k_weight, inv_freq(D, theta, qkv.device), positions, slots,
        k_cache, v_cache, scale=D**-0.5, inputs_ready=inputs_ready, tokens=tokens, **kw,
    )  # fmt: skip
