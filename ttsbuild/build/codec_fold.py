"""The codec decoder with its load-time arithmetic done ahead of time.

Folds (each one the exact expression the unfolded module evaluates, computed once in fp32):
  codebook   `embedding_sum / clamp(cluster_usage, 1e-5)[:, None]` -> `embed` [size, dim]
  SnakeBeta  `exp(alpha)` -> `alpha`,  `1 / (exp(beta) + 1e-9)` -> `inv_beta`
  quantizer  `input_proj` (the encoder's side) is dropped.
`FoldedCodec` is a `CodecDecoder` with those submodules swapped, so `forward`, `step` and
`CodecStream` work unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ttsbuild.model.codec import Codebook, CodecConfig, CodecDecoder, QuantizerGroup, SnakeBeta


class FoldedSnakeBeta(nn.Module):
    """x + inv_beta * sin(alpha * x)^2 with alpha = exp(log alpha), inv_beta precomputed."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(dim))
        self.inv_beta = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        return x + self.inv_beta[:, None] * torch.sin(x * self.alpha[:, None]).pow(2)

    def step(self, x: Tensor, st) -> Tensor:
        return self(x)


class FoldedCodebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(size, dim))

    def embedding(self) -> Tensor:  # [size, dim]
        return self.embed


def _swap(root: nn.Module, old: type, make) -> None:
    for name, child in list(root.named_children()):
        if isinstance(child, old):
            setattr(root, name, make(child))
        else:
            _swap(child, old, make)


class FoldedCodec(CodecDecoder):
    def __init__(self, cfg: CodecConfig):
        super().__init__(cfg)
        _swap(self, SnakeBeta, lambda m: FoldedSnakeBeta(m.alpha.shape[0]))
        _swap(self, Codebook, lambda m: FoldedCodebook(*m.embedding_sum.shape))
        for group in self.modules():
            if isinstance(group, QuantizerGroup):
                del group.input_proj


@torch.no_grad()
def fold_codec_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`CodecDecoder` state dict -> `FoldedCodec` state dict (fp32 arithmetic, fp32 out)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        t = t.float()
        if name.endswith("._codebook.cluster_usage"):
            continue
        if name.endswith("._codebook.embedding_sum"):
            usage = state[name.replace("embedding_sum", "cluster_usage")].float()
            out[name.replace("embedding_sum", "embed")] = t / usage.clamp(min=1e-5)[:, None]
        elif name.endswith(".input_proj.weight") and name.startswith("quantizer."):
            continue
        elif name.endswith(".alpha"):
            out[name] = t.exp()
        elif name.endswith(".beta"):
            out[name.removesuffix(".beta") + ".inv_beta"] = 1.0 / (t.exp() + 1e-9)
        else:
            out[name] = t
    return out


def load_folded_codec(cfg: CodecConfig, state: dict[str, Tensor]) -> FoldedCodec:
    """A FoldedCodec on the state's device from a folded state dict (strict)."""
    with torch.device("meta"):
        codec = FoldedCodec(cfg)
    codec.load_state_dict(state, strict=True, assign=True)
    return codec.eval()
