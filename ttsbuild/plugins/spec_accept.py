"""A speculative round's acceptance (runtime.cp_spec) as one kernel.

Given the draft's logits of the k drafted codebooks, the target's logits of those k + 1
positions, the drafted codes and each row's sampling settings: how many drafts each row
accepts, the code after them (the residual draw at the first rejection, the bonus draw after
k acceptances) and the acceptance tests. The reference is the chain of ops it replaces
(`runtime.cp_spec`'s `target_probs` twice, `noise`, `speculative_accept` and a plain
`fused_sample` over log(dist): ~45 launches of a round's ~100); the kernel runs them for a
row in one program, with the fused sampler's exact top-k / top-p thresholds and the same
counter-based noise, so it draws the same codes except where float rounding of a softmax
moves a test or a top-p cut by an ulp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins._dispatch import want_triton


def set_live(live: torch.Tensor, depth: torch.Tensor, groups: int) -> None:
    """live [1] int32 <- some row is not done (depth < G - 1): the WHILE node's condition."""
    live.copy_((depth < groups - 1).any().reshape(1))


@dataclass
class RoundState:
    """The rows' speculative state a round advances (runtime.cp_spec), [B, ...] views."""

    codes: torch.Tensor  # [B, C] int64: codebook c's code in column c
    source: torch.Tensor  # [B, H]: the hidden state at each row's depth
    pending: torch.Tensor  # [B] int64: the code at each row's depth
    depth: torch.Tensor  # [B] int64: the last codebook each row has
    live: torch.Tensor  # [1] int32: some row is not done (depth < G - 1)
    arrivals: torch.Tensor  # [1] int32, 0 between rounds: the kernel's count of rows done
    trash: int  # the column that writes past a row's accepted codes go to

    def apply(self, accepted, final, drafts, books, h, groups: int) -> None:
        """The round's results, as torch ops (the reference of the kernel's APPLY)."""
        k = drafts.shape[1]
        steps = torch.arange(k + 1, device=drafts.device)
        final = final[:, None]
        # codes[d+1+j] = drafts[j] for j < accepted, final at j = accepted
        values = torch.where(steps == accepted[:, None], final, torch.cat([drafts, final], 1))
        columns = torch.where(steps <= accepted[:, None], books, self.trash)
        self.codes.scatter_(1, columns, values)
        self.source.copy_(h.gather(1, accepted[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0])
        self.pending.copy_(final[:, 0])
        self.depth.copy_((self.depth + accepted + 1).clamp(max=groups - 1))
        set_live(self.live, self.depth, groups)


def spec_accept_reference(
    draft_logits: torch.Tensor,  # [B, k, V] fp32
    target_logits: torch.Tensor,  # [B, k + 1, V] fp32
    drafts: torch.Tensor,  # [B, k] int64, drawn from the draft's distribution
    books: torch.Tensor,  # [B, k + 1] int64: the codebook of each position
    sampling: SamplingBatch,
    seeds: torch.Tensor,  # [B] int64
    frames: torch.Tensor,  # [B] int64
    groups: int,
    h: torch.Tensor | None = None,  # [B, k + 1, H]: the verify pass's hidden states
    state: RoundState | None = None,  # the rows' state: the results applied to it
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted [B] in 0..k, the code after them [B], the tests ok [B, k] bool)."""
    from ttsbuild.plugins.sampling import fused_sample
    from ttsbuild.runtime import cp_spec as s

    k = drafts.shape[1]
    p = s.target_probs(target_logits, sampling)
    q = s.target_probs(draft_logits, sampling)
    u = s.noise(seeds, s.spec_counters(frames, books[:, :k], s.ACCEPT_TEST, groups), 1)[..., 0]
    accepted, dist, ok = s.speculative_accept(p, q, drafts, u)
    final_book = books.gather(1, accepted[:, None])
    counters = s.spec_counters(frames, final_book, s.FINAL_DRAW, groups)[:, 0]
    plain = s.plain_sampling(drafts.shape[0], drafts.device)
    final = fused_sample(torch.log(dist), plain, seeds, counters)
    if state is not None:
        state.apply(accepted, final, drafts, books, h, groups)
    return accepted, final, ok


def exact_accept_reference(
    draft_logits: torch.Tensor,  # [B, k, V]: not read (the signature of spec_accept's)
    target_logits: torch.Tensor,  # [B, k + 1, V] fp32
    drafts: torch.Tensor,  # [B, k] int64, drawn with the plain sampler's counters
    books: torch.Tensor,  # [B, k + 1] int64
    sampling: SamplingBatch,
    seeds: torch.Tensor,  # [B] int64
    frames: torch.Tensor,  # [B] int64
    groups: int,
    h: torch.Tensor | None = None,
    state: RoundState | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verification by exact match as torch ops: the plain sampler's draw at each position
    (`fused_sample`, counters `draw_counter(frame, G, codebook)`), the drafts kept while they
    equal those draws, then the draw. (accepted [B], the code after them [B], ok [B, k])."""
    from ttsbuild.generation.sampling import draw_counter
    from ttsbuild.plugins.sampling import fused_sample
    from ttsbuild.runtime.cp_spec import per_draft

    B, k1, V = target_logits.shape
    counters = draw_counter(frames[:, None], groups, books).reshape(B * k1)
    drawn = fused_sample(target_logits.reshape(B * k1, V), per_draft(sampling, k1),
                         seeds.repeat_interleave(k1), counters).reshape(B, k1)  # fmt: skip
    ok = drafts == drawn[:, :-1]
    accepted = ok.long().cumprod(1).sum(1)
    final = drawn.gather(1, accepted[:, None])[:, 0]
    if state is not None:
        state.apply(accepted, final, drafts, books, h, groups)
    return accepted, final, ok


def spec_accept(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    books: torch.Tensor,
    sampling: SamplingBatch,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    groups: int,
    h: torch.Tensor | None = None,
    state: RoundState | None = None,
    *,
    exact: bool = False,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted [B], final code [B], ok [B, k]); after a rejection at t the tests past t
    are False on the kernel (not run) and as computed in the reference (not used). With a
    state (and h), the round's results are applied to it in the same launch.
    exact: verification by exact match (runtime.cp_spec, `exact`; the draft logits are not
    read): each position's target draw is the plain sampler's (its settings, seed and counter
    frame * G + codebook), a row keeps its drafts while they equal those draws, then the draw
    itself, so every code is what the plain sampler draws; on the kernels the acceptance
    kernel's EXACT mode (a program per row and position, each the fused sampler's draw)."""
    B, k, V = draft_logits.shape
    if target_logits.shape != (B, k + 1, V) or drafts.shape != (B, k) or books.shape != (B, k + 1):
        raise ValueError(
            f"spec_accept: draft logits {tuple(draft_logits.shape)}, target logits "
            f"{tuple(target_logits.shape)}, drafts {tuple(drafts.shape)}, books "
            f"{tuple(books.shape)} do not fit [B, k, V], [B, k + 1, V], [B, k], [B, k + 1]"
        )
    if state is not None and (h is None or h.shape[:2] != (B, k + 1)):
        raise ValueError("spec_accept: applying a round needs its hidden states h [B, k + 1, H]")
    if not want_triton(draft_logits, use_triton):
        reference = exact_accept_reference if exact else spec_accept_reference
        return reference(draft_logits, target_logits, drafts, books, sampling, seeds, frames,
                         groups, h, state)  # fmt: skip
    from ttsbuild.plugins._tl.spec_accept import spec_accept_triton
    from ttsbuild.runtime.cp_spec import ACCEPT_TEST, FINAL_DRAW

    return spec_accept_triton(
        draft_logits.float(), target_logits.float(), drafts, books, sampling.temperature,
        sampling.top_k, sampling.top_p, sampling.do_sample, seeds, frames, groups,
        ACCEPT_TEST, FINAL_DRAW, h, state, exact=exact,
    )  # fmt: skip
