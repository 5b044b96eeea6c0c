"""A prompt prefix's KV from the prefix pool into the slots being prefilled, in one launch
and only the prefix's own positions.

    prefix_copy(k_cache, v_cache [L, S, H, T, D], pool_k, pool_v [L, E, H, P, D],
                slots [b], entries [b], starts [b])   (int64, any stride)
    k_cache[:, slots[j], :, p] = pool_k[:, entries[j], :, p]  for p < min(starts[j], P)
    (the same for v)

`PrefixPool.copy_into`'s eager form copies all P positions of each entry through a gathered
temporary: at P = 128 on the 1.7B talker 4 kernels and ~58 MB of traffic per prefill step
for a prefix of ~10 positions. Positions at or past a row's start are left as they are: the
prefill writes them from the start or masks them, and decoding writes the rest before it
reads them (what the eager copy put there is not read either).
"""

from __future__ import annotations

from ttsbuild.plugins._dispatch import want_triton

BLOCK_P = 16


def prefix_copy_reference(k_cache, v_cache, pool_k, pool_v, slots, entries, starts) -> None:
    """Row by row on the host's view of the indices (a check, not the served path)."""
    P = pool_k.shape[3]
    for slot, entry, start in zip(slots.tolist(), entries.tolist(), starts.tolist(), strict=True):
        n = min(start, P)
        k_cache[:, slot, :, :n] = pool_k[:, entry, :, :n]
        v_cache[:, slot, :, :n] = pool_v[:, entry, :, :n]


def prefix_copy_supported(k_cache, pool_k) -> bool:
    return (k_cache.dim() == 5 and pool_k.dim() == 5 and k_cache.stride(-1) == 1
            and pool_k.stride(-1) == 1 and k_cache.shape[2::2] == pool_k.shape[2::2]
            and k_cache.dtype == pool_k.dtype and k_cache.shape[0] == pool_k.shape[0]
            and k_cache.shape[-1] & (k_cache.shape[-1] - 1) == 0)  # fmt: skip


def prefix_copy(k_cache, v_cache, pool_k, pool_v, slots, entries, starts, *,
                use_triton: bool | None = None) -> None:  # fmt: skip
    """See the module docstring: one launch on the GPU (or under the interpreter)."""
    if not want_triton(k_cache, use_triton):
        prefix_copy_reference(k_cache, v_cache, pool_k, pool_v, slots, entries, starts)
        return
    if not (prefix_copy_supported(k_cache, pool_k) and k_cache.stride() == v_cache.stride()
            and pool_k.stride() == pool_v.stride()):  # fmt: skip
        raise ValueError("prefix_copy: caches [L, S, H, T, D] and pools [L, E, H, P, D] of one "
                         "dtype, D a power of two and contiguous, K and V laid out alike")
    from ttsbuild.plugins._tl.kv_copy import _prefix_copy_kernel

    L, _, H, _, D = k_cache.shape
    P = pool_k.shape[3]
    b = slots.shape[0]
    grid = (L * H, b, -(-P // BLOCK_P))
    _prefix_copy_kernel[grid](
        k_cache, v_cache, pool_k, pool_v, slots, entries, starts,
        slots.stride(0), entries.stride(0), starts.stride(0), H, P,
        *k_cache.stride()[:4], *pool_k.stride()[:4], D=D, BLOCK_P=BLOCK_P, num_warps=4,
    )  # fmt: skip
