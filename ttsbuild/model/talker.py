"""The talker (codebook 0 of each frame) and the code predictor (codebooks 1..15).

Tensors in, tensors out: these modules know nothing about requests or scheduling.
Module and parameter names mirror the official checkpoint, so the canonical
`talker.safetensors` / `code_predictor.safetensors` load with `load_state_dict(strict=True)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ttsbuild.model.config import ModelConfig
from ttsbuild.model.layers import DecoderStack, KVCache


class TextProjection(nn.Module):
    """Text embedding -> talker width: Linear -> SiLU -> Linear (both with bias)."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerStack(DecoderStack):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.talker)
        self.codec_embedding = nn.Embedding(cfg.codec_vocab_size, cfg.talker.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class Talker(nn.Module):
    """Predicts codebook 0 of the next frame from the dual-track (text + codec) input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerStack(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.talker.hidden_size)
        self.codec_head = nn.Linear(cfg.talker.hidden_size, cfg.codec_vocab_size, bias=False)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """P(ids): [..., hidden]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """E(ids): [..., hidden]."""
        return self.model.codec_embedding(ids)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden] input embeddings
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (final-norm hidden [B, T, hidden], codebook-0 logits [B, T, codec_vocab])."""
        hidden = self.model(x, cache, slots, positions)
        return hidden, self.codec_head(hidden)


class CodePredictorStack(DecoderStack):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.code_predictor)
        # Input embeddings of codebooks 1..15 are talker-width (the talker sums them too).
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.codebook_size, cfg.talker.hidden_size)
            for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    """Fills codebooks 1..15 of a frame, one single-token pass per codebook.

    Input sequence per frame: [h_t, E0(c0), E1(c1), ..., E14(c14)] (talker width), each
    through `small_to_mtp_projection`; `lm_head[i]` on position i+1 gives codebook i+1.
    A fresh cache per frame: at most num_code_groups positions.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorStack(cfg)
        hidden = cfg.code_predictor.hidden_size
        self.lm_head = nn.ModuleList(
            nn.Linear(hidden, cfg.codebook_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )
        if cfg.code_predictor.hidden_size != cfg.talker.hidden_size:
            self.small_to_mtp_projection = nn.Linear(
                cfg.talker.hidden_size, cfg.code_predictor.hidden_size, bias=True
            )
        else:
            self.small_to_mtp_projection = nn.Identity()

    def embed_codes(self, codebook: int, ids: torch.Tensor) -> torch.Tensor:
        """Talker-width embedding of codes of `codebook` (1..15)."""
        return self.model.codec_embedding[codebook - 1](ids)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, talker hidden] unprojected inputs
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
        codebook: int,  # which head: logits for codebook `codebook` (1..15) from the last position
    ) -> torch.Tensor:
        """Returns logits [B, codebook_size] of `codebook` at the last input position."""
        hidden = self.model(self.small_to_mtp_projection(x), cache, slots, positions)
        return self.lm_head[codebook - 1](hidden[:, -1])

    def new_cache(self, batch: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(self.cfg.code_predictor, batch, self.cfg.num_code_groups, dtype, device)
