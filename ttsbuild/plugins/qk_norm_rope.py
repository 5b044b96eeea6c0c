"""Fused per-head q/k RMSNorm + rotate-half RoPE + K/V cache write (one launch).

Input is the fused projection output qkv [R, (Hq + 2 Hkv) * D] (q heads, then k, then v)
of R tokens; each token has a cache slot and an absolute position. Replaces the model's
q_norm, k_norm, two apply_rope, cos/sin and the two indexed cache writes (~10 ops).
"""

from __future__ import annotations

import torch

from ttsbuild.model.layers import apply_rope, rope_cos_sin
from ttsbuild.plugins._dispatch import want_triton


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly the model's RMSNorm.forward.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def qk_norm_rope_reference(
    qkv: torch.Tensor,  # [R, (Hq + 2 Hkv) * D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [R] int
    slots: torch.Tensor,  # [R] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D]
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
) -> torch.Tensor:
    """The model's unfused ops (layers.Attention): returns q [R, Hq, D]; writes the caches."""
    R = qkv.shape[0]
    D = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = _rms_norm(q.reshape(R, 1, num_heads, D), q_weight, eps)
    k = _rms_norm(k.reshape(R, 1, num_kv_heads, D), k_weight, eps)
    cos, sin = rope_cos_sin(positions.reshape(R, 1), D, theta, qkv.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[slots, :, positions] = k[:, 0].to(k_cache.dtype)
    v_cache[slots, :, positions] = v.reshape(R, num_kv_heads, D).to(v_cache.dtype)
    return q[:, 0]


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    key = (head_dim, theta, str(device))
    if key not in _INV_FREQ:
        # Computed on the target device as rope_cos_sin would.
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
        _INV_FREQ[key] = 1.0 / (theta ** (exponents / head_dim))
    return _INV_FREQ[key]


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """q [R, Hq, D] normed and rotated; k (normed, rotated) and v written to the caches at
    [slot, :, position] of each row. Triton computes in fp32 and rounds once (the reference
    rounds after each op in the input dtype, as the model does)."""
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, theta=theta)
    if not want_triton(qkv, use_triton):
        return qk_norm_rope_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, **kw
        )
    from ttsbuild.plugins._tl.qk_norm_rope import qk_norm_rope_triton

    freqs = inv_freq(k_cache.shape[-1], theta, qkv.device)
    return qk_norm_rope_triton(
        qkv, q_weight, k_weight, freqs, positions, slots, k_cache, v_cache, **kw
    )
