"""Fused per-head q/k RMSNorm + rotate-half RoPE + K/V cache write (one launch).

Input is the fused projection output qkv [R, (Hq + 2 Hkv) * D] (q heads, then k, then v)
of R tokens; each token has a cache slot and an absolute position. Replaces the model's
q_norm, k_norm, two apply_rope, cos/sin and the two indexed cache writes (~10 ops).
"""

from __future__ import annotations

import math

import torch

from ttsbuild.model.layers import apply_rope, rope_cos_sin
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, FP8_MAX


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly the model's RMSNorm.forward.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# An FP8 KV cache (EnginePlan.talker_kv_fp8): e4m3 values (the FP8 weights' format) with a
# scale per layer for k and one for v (calibrated: the layer's amax / 448,
# `build.pack.calibrated_scales`); the kernels store x / scale clamped to +-448 and read back
# value * scale.
KV_FP8_DTYPE, KV_FP8_MAX = FP8_DTYPE, FP8_MAX


def kv_cache_scales(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float | None, v_scale: float | None
) -> tuple[float, float]:
    """(k_scale, v_scale) a kernel applies: an FP8 cache's own (required, finite, > 0); 1.0
    for a cache in a floating dtype, which takes none. ValueError otherwise."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k and v caches differ in dtype: {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dtype == KV_FP8_DTYPE:
        scales = (k_scale, v_scale)
        if any(s is None or not math.isfinite(s) or s <= 0 for s in scales):
            raise ValueError(f"an FP8 KV cache needs finite positive k_scale and v_scale, got "
                             f"{k_scale}, {v_scale}")  # fmt: skip
        return float(k_scale), float(v_scale)
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale are an FP8 KV cache's; this cache is {k_cache.dtype}")
    return 1.0, 1.0


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: x / scale clamped and cast for an FP8 cache, else
    cast (scale 1)."""
    if dtype != KV_FP8_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as values of `dtype`: an FP8 cache's times its scale (in fp32)."""
    if x.dtype != KV_FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


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
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """The model's unfused ops (layers.Attention): returns q [R, Hq, D]; writes the caches
    (an FP8 cache: k and v as rounded by the model, then quantised, `quantize_kv`)."""
    ks, vs = kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    R = qkv.shape[0]
    D = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = _rms_norm(q.reshape(R, 1, num_heads, D), q_weight, eps)
    k = _rms_norm(k.reshape(R, 1, num_kv_heads, D), k_weight, eps)
    cos, sin = rope_cos_sin(positions.reshape(R, 1), D, theta, qkv.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[slots, :, positions] = quantize_kv(k[:, 0], ks, k_cache.dtype)
    v_cache[slots, :, positions] = quantize_kv(v.reshape(R, num_kv_heads, D), vs, v_cache.dtype)
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
    k_scale: float | None = None,
    v_scale: float | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """q [R, Hq, D] normed and rotated; k (normed, rotated) and v written to the caches at
    [slot, :, position] of each row (an FP8 cache's: divided by k_scale / v_scale, clamped,
    rounded to e4m3). Triton computes in fp32 and rounds once (the reference rounds after
    each op in the input dtype, as the model does)."""
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, theta=theta,
              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if not want_triton(qkv, use_triton):
        return qk_norm_rope_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, **kw
        )
    from ttsbuild.plugins._tl.qk_norm_rope import qk_norm_rope_triton

    freqs = inv_freq(k_cache.shape[-1], theta, qkv.device)
    return qk_norm_rope_triton(
        qkv, q_weight, k_weight, freqs, positions, slots, k_cache, v_cache, **kw
    )
