"""A prefill layer's attention in one launch (the talker's prompt; runtime.fast_model).

T new tokens per row at positions start..start+T-1 of the row's cache slot (start: a prefix
already in the cache, copied in from the prefix pool; None: position 0): q/k RMSNorm + RoPE,
the new k/v written into the cache, each token attending causally to the row's cache up to
its own position. The reference is what the kernel path ran before it, per token:
`qk_norm_rope` (writing every token's k/v first) and a decode-attention query over the cache
up to the token's position (three launches a layer on the kernels); the kernel recomputes the
new keys it attends from qkv instead of reading them back, so one launch suffices
(plugins/_tl/prefill_attention.py).
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.decode_attention import decode_attention_reference
from ttsbuild.plugins.qk_norm_rope import inv_freq, qk_norm_rope_reference


def prefill_positions(start: torch.Tensor | None, B: int, T: int, S: int,
                      device) -> torch.Tensor:  # fmt: skip
    """Each token's cache position [B * T]: start + t, clamped to the cache's last position
    (padding rows past its end write there; no real token reads it first)."""
    offsets = torch.arange(T, device=device)
    if start is None:
        return offsets.repeat(B)
    return (start[:, None] + offsets).clamp(max=S - 1).reshape(-1)


def prefill_attention_reference(
    qkv: torch.Tensor,  # [B * T, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    start: torch.Tensor | None,  # [B]
    slots: torch.Tensor,  # [B]
    k_cache: torch.Tensor,  # [slots, Hkv, S, D]
    v_cache: torch.Tensor,
    T: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
) -> torch.Tensor:
    """The attention output [B * T, Hq * D]; the caches hold the new k/v."""
    B, S = slots.shape[0], k_cache.shape[-2]
    positions = prefill_positions(start, B, T, S, qkv.device)
    rows = slots.repeat_interleave(T)
    q = qk_norm_rope_reference(qkv, q_weight, k_weight, positions, rows, k_cache, v_cache,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                               theta=theta)  # fmt: skip
    out = decode_attention_reference(q, k_cache, v_cache, rows, positions + 1, S)
    return out.reshape(B * T, -1)


def prefill_attention(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    start: torch.Tensor | None,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    T: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    if qkv.shape[0] != slots.shape[0] * T or (start is not None and start.shape != slots.shape):
        raise ValueError(
            f"prefill_attention: qkv {tuple(qkv.shape)} is not {slots.shape[0]} rows x {T} "
            f"tokens, or start {None if start is None else tuple(start.shape)} does not fit"
        )
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if not want_triton(qkv, use_triton):
        return prefill_attention_reference(qkv, q_weight, k_weight, start, slots, k_cache,
                                           v_cache, T, theta=theta, **kw)  # fmt: skip
    from ttsbuild.plugins._tl.prefill_attention import prefill_attention_triton

    D = k_cache.shape[-1]
    return prefill_attention_triton(
        qkv, q_weight, k_weight, inv_freq(D, theta, qkv.device), start, slots, k_cache, v_cache,
        T, scale=D**-0.5, **kw,
    )  # fmt: skip
