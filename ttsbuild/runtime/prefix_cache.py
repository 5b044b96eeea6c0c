"""Prefix KV cache: the talker KV of prompt prefixes shared by many requests, on the device.

The first positions of a prompt depend only on (voice, language, instruct, text mode)
(`generation.prompt`): the role, the codec prefix with the speaker or the x-vector, and for
an in-context clone its reference transcript. Their KV is computed once, kept in an entry of
a fixed pool [layers, entries, kv heads, max_prefix, head dim], and copied into a slot's KV
at admission (inside the prefill graph, from a staged entry index), so only the rest of the
prompt is prefilled. Entries are keyed by the prefix's content (`PromptLayout.prefix_key`):
any request with the same voice, language and instruction hits, whether its voice is built
in, registered or sent with the request, and deleting a registered voice cannot strand a
request that still uses it. Least recently used entries are evicted; an entry held by a slot
that is admitted but not yet prefilled never is (a full pool means a full prefill, not an
error). All device work is on the engine's one stream, so an entry overwritten after a slot
was prefilled from it cannot change that slot: its copy ran first.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.kv_copy import prefix_copy, prefix_copy_supported

# The prefix's own positions in one launch (plugins.kv_copy) instead of all max_prefix
# positions through a gathered copy (4 kernels, ~58 MB per prefill step on the 1.7B at
# max_prefix 128). On since 2026-12-04 (timed with graph_engine.ADMIT_FUSED, see there);
# TTSBUILD_PREFIX_COPY_KERNEL=0 turns it off.
COPY_KERNEL = os.environ.get("TTSBUILD_PREFIX_COPY_KERNEL", "1") == "1"


@dataclass
class _Entry:
    key: bytes  # the prefix's content (PromptLayout.prefix_key)
    index: int  # row of the pool
    holders: int = 0  # slots admitted with this prefix and not yet prefilled
    ready: bool = False  # its KV has been computed


class PrefixPool:
    """Host bookkeeping (LRU, holders) over the device tensors `k` and `v`."""

    def __init__(self, cfg: DecoderStackConfig, entries: int, max_prefix: int, dtype, device):
        shape = (cfg.num_layers, entries, cfg.num_kv_heads, max_prefix, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_prefix = max_prefix
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self._free = list(range(entries))
        self.hits = self.misses = self.evictions = self.full = 0

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, key: bytes) -> _Entry | None:
        """Hold the entry of `key` until `release`: the existing one (a hit), else a free or
        least recently used unheld one to fill (not ready). None when every entry is held."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        else:
            index = self._free.pop() if self._free else self._evict()
            if index is None:
                self.full += 1
                return None
            entry = self._entries[key] = _Entry(key, index)
            self.misses += 1
        entry.holders += 1
        return entry

    def _evict(self) -> int | None:
        victim = next((k for k, e in self._entries.items() if e.holders == 0), None)
        if victim is None:
            return None
        self.evictions += 1
        return self._entries.pop(victim).index

    def release(self, entry: _Entry) -> None:
        entry.holders -= 1
        if not entry.ready and entry.holders == 0:  # never filled: nothing worth keeping
            del self._entries[entry.key]
            self._free.append(entry.index)

    def store(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, entry: _Entry):
        """Keep the first max_prefix positions of `slot`'s KV [L, slots, Hkv, S, D] in
        `entry` (positions past the prefix are junk nobody reads: see `copy_into`)."""
        n = self.max_prefix
        self.k[:, entry.index].copy_(k_cache[:, slot, :, :n])
        self.v[:, entry.index].copy_(v_cache[:, slot, :, :n])
        entry.ready = True

    def copy_into(self, k_cache, v_cache, slot: torch.Tensor, index: torch.Tensor,
                  start: torch.Tensor | None = None) -> None:  # fmt: skip
        """Entry `index` [b] -> the first max_prefix positions of `slot` [b] (device indices,
        fixed shapes: runs inside the prefill graph). Positions past the real prefix are
        overwritten by the prefill that follows or masked from it, then written by decoding
        before it reads them. With `start` [b] (each row's prefix length) and COPY_KERNEL,
        only the positions below it, in one launch (plugins.kv_copy)."""
        if (start is not None and COPY_KERNEL and want_triton(k_cache, None)
                and prefix_copy_supported(k_cache, self.k)):  # fmt: skip
            prefix_copy(k_cache, v_cache, self.k, self.v, slot, index, start)
            return
        n = self.max_prefix
        for cache, pool in ((k_cache, self.k), (v_cache, self.v)):
            if cache.element_size() == 1:  # an FP8 cache: as bytes (no fp8 index_copy_)
                cache, pool = cache.view(torch.uint8), pool.view(torch.uint8)
            cache[:, :, :, :n].index_copy_(1, slot, pool.index_select(1, index))

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
