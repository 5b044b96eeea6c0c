"""Single-query (decode) GQA attention over a slot-indexed KV cache with per-row lengths.

q [B, Hq, D]; caches [slots, Hkv, S, D]; row b attends to positions [0, lengths[b]) of
cache slot slots[b]. `max_len` bounds the lengths (a Python int: no host sync); the
reference gathers [0, max_len) and masks, as the model does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.qk_norm_rope import (
    dequantize_kv,
    inv_freq,
    kv_cache_scales,
    qk_norm_rope_reference,
)


def decode_attention_reference(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, S, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    lengths: torch.Tensor,  # [B], 1 <= lengths <= max_len
    max_len: int | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = torch.float32,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """SDPA over the gathered, masked cache (the model's path). compute_dtype None: in the
    input dtype (the PyTorch baseline); float32/64: an upcast reference. An FP8 cache
    (`qk_norm_rope.KV_FP8_DTYPE`) is read as its values times k_scale / v_scale."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    S = k_cache.shape[2] if max_len is None else max_len
    scale = D**-0.5 if scale is None else scale
    dt = compute_dtype or q.dtype
    ks, vs = kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    # [B, Hq, S, D]
    keys = dequantize_kv(k_cache[slots, :, :S], ks, dt).repeat_interleave(Hq // Hkv, dim=1)
    values = dequantize_kv(v_cache[slots, :, :S], vs, dt).repeat_interleave(Hq // Hkv, dim=1)
    mask = torch.arange(S, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q.to(dt)[:, :, None], keys, values, attn_mask=mask[:, None, None], scale=scale
    )  # [B, Hq, 1, D]
    return out[:, :, 0].to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int | None = None,
    scale: float | None = None,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[B, Hq, D] in q's dtype. Triton: one pass for short caches (the code predictor's 16
    positions), flash-decoding splits + a combine kernel for long ones (the talker).
    k_scale, v_scale: an FP8 cache's scales (required with one, refused without)."""
    kv = dict(k_scale=k_scale, v_scale=v_scale)
    if not want_triton(q, use_triton):
        return decode_attention_reference(q, k_cache, v_cache, slots, lengths, max_len, scale,
                                          **kv)  # fmt: skip
    from ttsbuild.plugins._tl.decode_attention import decode_attention_triton

    return decode_attention_triton(q, k_cache, v_cache, slots, lengths, max_len, scale, **kv)


def qk_norm_rope_decode_attention(
    qkv: torch.Tensor,  # [R, (Hq + 2 Hkv) * D]: the layer's packed q/k/v of one token per row
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [R] int: each row's token position, < max_len
    slots: torch.Tensor,  # [R] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D]
    v_cache: torch.Tensor,
    max_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """`qk_norm_rope` then `decode_attention` over positions [0, position] (the talker's
    decode step): the attention output [R, Hq * D]; k and v of each row's token are written
    into the caches (an FP8 cache's with k_scale / v_scale). Triton: one launch
    (flash-decoding splits merged by the last to arrive) instead of three."""
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    kv = dict(k_scale=k_scale, v_scale=v_scale)
    if not want_triton(qkv, use_triton):
        q = qk_norm_rope_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, theta=theta, **kw,
            **kv,
        )  # fmt: skip
        attn = decode_attention_reference(q, k_cache, v_cache, slots, positions + 1, max_len,
                                          **kv)  # fmt: skip
        return attn.reshape(qkv.shape[0], -1)
    from ttsbuild.plugins._tl.decode_attention import qk_norm_rope_decode_attention_triton

    D = k_cache.shape[-1]
    return qk_norm_rope_decode_attention_triton(
        qkv, q_weight, k_weight, inv_freq(D, theta, qkv.device), positions, slots, k_cache,
        v_cache, max_len, scale=D**-0.5, **kw, **kv,
    )  # fmt: skip
