"""The reference generation loop: eager PyTorch, any device, batched over cache slots.

One frame = one talker step (codebook 0) + the code predictor (codebooks 1..15), run
right after codebook 0 so each frame is complete at once (the official loop runs the code
predictor inside the next talker call; the result is the same). The GPU runtime replaces
these functions with captured graphs and must match them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ttsbuild.generation.guards import expected_frames
from ttsbuild.generation.prompt import Prompt
from ttsbuild.generation.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    draw_counter,
    sample,
)
from ttsbuild.model.config import ModelConfig
from ttsbuild.model.layers import KVCache
from ttsbuild.model.talker import CodePredictor, Talker


@dataclass(frozen=True)
class LengthRule:
    """Random weights never learn EOS: a stand-in checkpoint says how long to speak instead.

    frames = clamp(expected_frames(text, language), min_frames, max_frames): as long as a
    typical reader takes to read the text aloud (the speaking-rate model in
    `ttsbuild.generation.guards`, by characters, not by the stand-in tokenizer's tokens, which
    split unfamiliar words into many pieces). EOS is never sampled for a stand-in. Real
    checkpoints have no rule and stop at EOS (or a guard).
    """

    min_frames: int
    max_frames: int

    def frames_for(self, text: str, language: str = "auto") -> int:
        return max(self.min_frames, min(self.max_frames, expected_frames(text, language)))

    @classmethod
    def from_standin(cls, standin: dict | None) -> LengthRule | None:
        if not standin:
            return None
        rule = standin["length_rule"]
        return cls(int(rule["min_frames"]), int(rule["max_frames"]))


@dataclass(frozen=True)
class GenerationParams:
    """Per-request generation settings (defaults: the published generation_config.json)."""

    talker: SamplingParams = field(default_factory=lambda: SamplingParams(repetition_penalty=1.05))
    code_predictor: SamplingParams = field(default_factory=SamplingParams)
    min_new_tokens: int = 2  # EOS is banned for the first frames (hard-coded upstream)
    max_frames: int = 8192

    @classmethod
    def from_generation_config(cls, gc: dict, **overrides) -> GenerationParams:
        talker = SamplingParams(
            do_sample=bool(gc.get("do_sample", True)),
            temperature=float(gc.get("temperature", 0.9)),
            top_k=int(gc.get("top_k", 50)),
            top_p=float(gc.get("top_p", 1.0)),
            repetition_penalty=float(gc.get("repetition_penalty", 1.05)),
        )
        cp = SamplingParams(
            do_sample=bool(gc.get("subtalker_dosample", True)),
            temperature=float(gc.get("subtalker_temperature", 0.9)),
            top_k=int(gc.get("subtalker_top_k", 50)),
            top_p=float(gc.get("subtalker_top_p", 1.0)),
        )
        return cls(
            talker=talker,
            code_predictor=cp,
            max_frames=int(gc.get("max_new_tokens", 8192)),
            **overrides,
        )


def codebook0_logits_mask(cfg: ModelConfig, vocab: int, device) -> torch.Tensor:
    """[vocab] bool: ids never sampled for codebook 0 (control/speaker rows; EOS stays)."""
    suppressed = torch.zeros(vocab, dtype=torch.bool, device=device)
    suppressed[cfg.codebook_size :] = True
    suppressed[cfg.codec_ids.eos] = False
    return suppressed


class ReferenceModel:
    """Talker + code predictor with a slot-addressed KV cache: the eager reference path."""

    def __init__(
        self,
        talker: Talker,
        code_predictor: CodePredictor,
        num_slots: int,
        max_len: int,
    ):
        self.cfg = talker.cfg
        self.talker, self.code_predictor = talker, code_predictor
        weight = talker.codec_head.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.cache = KVCache(self.cfg.talker, num_slots, max_len, self.dtype, self.device)
        self.suppressed = codebook0_logits_mask(self.cfg, self.cfg.codec_vocab_size, self.device)

    @torch.no_grad()
    def prefill(self, slot: int, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the prompt into `slot`. Returns (last hidden [hidden], logits [vocab])."""
        n = prompt.embeds.shape[0]
        positions = torch.arange(n, device=self.device)[None]
        slots = torch.tensor([slot], device=self.device)
        hidden, logits = self.talker(
            prompt.embeds[None].to(self.dtype), self.cache, slots, positions
        )
        return hidden[0, -1], logits[0, -1]

    @torch.no_grad()
    def decode(
        self,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B] position of the new token
        inputs: torch.Tensor,  # [B, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One talker step per row. Returns (hidden [B, hidden], logits [B, vocab])."""
        hidden, logits = self.talker(inputs[:, None], self.cache, slots, positions[:, None])
        return hidden[:, 0], logits[:, 0]

    def choose_codebook0(
        self,
        logits: torch.Tensor,  # [B, vocab]
        history: torch.Tensor,  # [B, vocab] bool: codebook-0 ids generated so far
        eos_allowed: torch.Tensor,  # [B] bool
        sampling: SamplingBatch,
        seeds: torch.Tensor,  # [B]
        frames: torch.Tensor,  # [B] index of the frame being generated
    ) -> torch.Tensor:
        logits = apply_repetition_penalty(logits.float(), history, sampling.repetition_penalty)
        banned = self.suppressed[None].expand_as(logits).clone()
        banned[:, self.cfg.codec_ids.eos] = ~eos_allowed
        logits = logits.masked_fill(banned, float("-inf"))
        return sample(logits, sampling, seeds, draw_counter(frames, self.cfg.num_code_groups))

    @torch.no_grad()
    def complete_frames(
        self,
        hidden: torch.Tensor,  # [B, hidden] talker hidden that produced c0
        c0: torch.Tensor,  # [B]
        sampling: SamplingBatch,
        seeds: torch.Tensor,  # [B]
        frames: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """Codebooks 1..15 with a fresh cache. Returns the whole frame [B, num_code_groups]."""
        B = hidden.shape[0]
        cp, groups = self.code_predictor, self.cfg.num_code_groups
        cache = cp.new_cache(B, self.dtype, self.device)
        slots = torch.arange(B, device=self.device)
        codes = [c0]
        x = torch.stack([hidden, self.talker.embed_codec(c0)], dim=1)  # [B, 2, hidden]
        positions = torch.arange(2, device=self.device)[None].expand(B, 2)
        for codebook in range(1, groups):
            logits = cp(x, cache, slots, positions, codebook)
            code = sample(logits, sampling, seeds, draw_counter(frames, groups, codebook))
            codes.append(code)
            if codebook + 1 < groups:
                x = cp.embed_codes(codebook, code)[:, None]
                positions = torch.full((B, 1), codebook + 1, device=self.device)
        return torch.stack(codes, dim=1)

    @torch.no_grad()
    def next_inputs(self, codes: torch.Tensor, text_track: torch.Tensor) -> torch.Tensor:
        """Talker input for the next step: sum of the frame's 16 code embeddings + text track."""
        x = self.talker.embed_codec(codes[:, 0])
        for codebook in range(1, self.cfg.num_code_groups):
            x = x + self.code_predictor.embed_codes(codebook, codes[:, codebook])
        return x + text_track


@dataclass
class GenerationResult:
    codes: torch.Tensor  # [frames, num_code_groups] int64
    stopped_by: str  # "eos" | "length_rule" | "max_frames"


@torch.no_grad()
def generate_codes(
    model: ReferenceModel,
    prompts: list[Prompt],
    params: list[GenerationParams],
    seeds: list[int],
    frame_targets: list[int | None] | None = None,
    on_frames=None,
) -> list[GenerationResult]:
    """Generate every request of the batch to completion, one slot each.

    frame_targets[i] set = stand-in length rule: exactly that many frames, EOS never sampled.
    on_frames(step, active_rows, codes [B, groups]) is called after each frame.
    """
    B = len(prompts)
    if B > model.cache.num_slots:
        raise ValueError(f"{B} requests exceed the {model.cache.num_slots} cache slots")
    targets = frame_targets or [None] * B
    device, cfg = model.device, model.cfg
    talker_sampling = SamplingBatch.from_params([p.talker for p in params], device)
    cp_sampling = SamplingBatch.from_params([p.code_predictor for p in params], device)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    max_frames = [
        min(p.max_frames, t) if t is not None else p.max_frames
        for p, t in zip(params, targets, strict=True)
    ]

    hidden, logits, lengths = [], [], []
    for slot, prompt in enumerate(prompts):
        h, lg = model.prefill(slot, prompt)
        hidden.append(h)
        logits.append(lg)
        lengths.append(prompt.embeds.shape[0])
    hidden, logits = torch.stack(hidden), torch.stack(logits)
    positions = torch.tensor(lengths, device=device)
    history = torch.zeros(B, cfg.codec_vocab_size, dtype=torch.bool, device=device)
    min_new = torch.tensor([p.min_new_tokens for p in params], device=device)
    is_standin = torch.tensor([t is not None for t in targets], device=device)
    frames: list[list[torch.Tensor]] = [[] for _ in range(B)]
    stopped: list[str | None] = [None] * B
    active = list(range(B))
    step = 0
    while active:
        rows = torch.tensor(active, device=device)
        frame_idx = torch.full((len(active),), step, device=device)
        eos_allowed = (frame_idx >= min_new[rows]) & ~is_standin[rows]
        c0 = model.choose_codebook0(
            logits[rows],
            history[rows],
            eos_allowed,
            talker_sampling.select(rows),
            seed_t[rows],
            frame_idx,
        )
        history[rows, c0] = True
        codes = model.complete_frames(
            hidden[rows], c0, cp_sampling.select(rows), seed_t[rows], frame_idx
        )
        still_active = []
        for j, r in enumerate(active):
            if int(c0[j]) == cfg.codec_ids.eos:
                stopped[r] = "eos"  # the EOS frame itself is dropped
                continue
            frames[r].append(codes[j])
            if len(frames[r]) >= max_frames[r]:
                stopped[r] = "length_rule" if targets[r] is not None else "max_frames"
            else:
                still_active.append(r)
        if on_frames is not None:
            on_frames(step, active, codes)
        step += 1
        if not still_active:
            break
        keep = [active.index(r) for r in still_active]
        rows = torch.tensor(still_active, device=device)
        text = torch.stack([prompts[r].text_track(step - 1) for r in still_active]).to(model.dtype)
        inputs = model.next_inputs(codes[keep], text)
        h, lg = model.decode(rows, positions[rows], inputs)
        positions[rows] += 1
        hidden[rows], logits[rows] = h, lg
        active = still_active
    empty = torch.zeros(0, cfg.num_code_groups, dtype=torch.int64)
    return [
        GenerationResult(torch.stack(f).cpu() if f else empty, stopped[i] or "eos")
        for i, f in enumerate(frames)
    ]
