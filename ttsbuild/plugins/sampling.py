"""Fused sampling: one kernel per step, token ids equal to `generation.sampling.sample`.

`fused_sample` = (optional `apply_repetition_penalty`) + `sample`: greedy argmax where
do_sample is off, else Gumbel-max over the temperature / top-k / top-p filtered logits with
the same counter-based noise. The kernel replaces the reference's sort by exact threshold
searches over the float bit patterns (the k-th largest value, then the top-p cut, each found
1 or, TTSBUILD_SAMPLE_RADIX_BITS=4, 4 bits per block reduction), so no host sync and no sort.

Exactness: temperature division (div_rn), Gumbel noise (the same 32-bit hash, libdevice
logf), ties (kept, as the reference keeps ties with the k-th value) and argmax tie-breaks
(lowest index) match the reference bit for bit. The one place rounding can differ is the
top-p cut: the reference's cumulative sum and ours add in different orders, so a token
whose cumulative mass is within a few ulps of 1 - top_p may land on the other side.
"""

from __future__ import annotations

import torch

from ttsbuild.generation.sampling import SamplingBatch, apply_repetition_penalty, sample
from ttsbuild.plugins._dispatch import want_triton


def fused_sample_reference(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    if history is not None:
        logits = apply_repetition_penalty(logits, history, batch.repetition_penalty)
    return sample(logits, batch, seeds, counters)


def fused_sample(
    logits: torch.Tensor,  # [B, V] fp32 or bf16
    batch: SamplingBatch,
    seeds: torch.Tensor,  # [B] int64
    counters: torch.Tensor,  # [B] int64
    history: torch.Tensor | None = None,  # [B, V] bool: apply the repetition penalty
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Token ids [B] int64."""
    if not want_triton(logits, use_triton):
        return fused_sample_reference(logits, batch, seeds, counters, history)
    from ttsbuild.plugins._tl.sampling import sample_triton

    return sample_triton(logits, batch, seeds, counters, history)
