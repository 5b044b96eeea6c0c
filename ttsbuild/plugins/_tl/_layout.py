"""The operand layout the attention-side kernels assume, checked once for all of them."""

from __future__ import annotations

import torch


def check_qkv_caches(
    qkv: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """qkv [R, (Hq + 2 Hkv) * D] with contiguous rows (None: the kernel makes it), and the
    caches [..., S, D] sharing one layout with a contiguous head_dim; ValueError otherwise."""
    D = k_cache.shape[-1]
    if qkv is not None and (
        qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or qkv.stride(1) != 1
    ):
        raise ValueError(f"qkv must be [R, (Hq + 2 Hkv) * D] row-major, got {tuple(qkv.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share a layout with contiguous head_dim")
