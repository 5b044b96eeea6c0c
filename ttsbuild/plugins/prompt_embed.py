"""The prefill's prompt embedding in four launches (generation.prompt.PromptEmbedder.rows).

A prompt row [text id, x-vector flag, code_0 .. code_{G-1}] embeds as
  P(text id) + (the x-vector where flagged, else the sum of its codes' embeddings),
P = Linear -> SiLU -> Linear over the text embedding. The reference (PromptEmbedder's ops) is
~14 launches: the text table's gather (12 us a call in the 2026-12-04 prefill profile), two
cuBLAS GEMMs and the SiLU, the codebook gathers, a concatenation, the mask, the sum, the
x-vector select and the add. On the kernels: the codec track in one launch (every codebook's
row summed in fp32, the x-vector where flagged), the text table's gather inside fc1's launch
(`fused_linear(index=...)`), the SiLU, and fc2 with the codec track as its residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import want_triton

# Columns of a prompt row (generation.prompt's layout, defined here with the kernels that
# read them): text id, x-vector flag, first code.
TEXT, VOICE, CODES = 0, 1, 2


def codec_track_reference(rows: torch.Tensor, table0: torch.Tensor,
                          rest: torch.Tensor | list[torch.Tensor], x_vector: torch.Tensor | None,
                          rest_index: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """rows [T, 2 + G] -> the codec track [T, H]: the sum of the embeddings of the codes a
    row uses (code < 0: unused; codebook 0 from table0, 1..G-1 from rest: the tables stacked
    [G - 1, V, H], gathered in one launch, or a list of them), or the x-vector ([H] or
    [T, H]) where the row's flag is set. rest_index: arange(G - 1)[:, None] on rest's device,
    kept by a caller that runs this often (else made here)."""
    G = len(rest) + 1
    codes = rows[:, CODES : CODES + G]
    books = codes.clamp(min=0).T  # [G, T]
    if isinstance(rest, torch.Tensor):
        if rest_index is None:
            rest_index = torch.arange(G - 1, device=rows.device)[:, None]
        per_book = torch.cat([table0[books[0]][None], rest[rest_index, books[1:]]])  # [G, T, H]
    else:
        per_book = torch.stack([t[ids] for t, ids in zip([table0, *rest], books, strict=True)])
    codec = per_book.masked_fill((codes < 0).T[..., None], 0).sum(0)
    if x_vector is not None:
        voice = x_vector.to(device=codec.device, dtype=codec.dtype)
        codec = torch.where(rows[:, VOICE : VOICE + 1] > 0, voice, codec)
    return codec


def codec_track(rows, table0, rest, x_vector, *, use_triton: bool | None = None) -> torch.Tensor:
    if not want_triton(table0, use_triton):
        return codec_track_reference(rows, table0, rest, x_vector)
    from ttsbuild.plugins._tl.prompt_embed import codec_track_triton

    return codec_track_triton(rows, table0, rest, x_vector)


def text_embed(ids: torch.Tensor, text_table: torch.Tensor, fc1: torch.nn.Linear,
               fc2: torch.nn.Linear, *, use_triton: bool | None = None) -> torch.Tensor:
    """P(ids) [..., H] for ids of any shape: the text table's gather inside fc1's launch on
    the kernels."""
    if not want_triton(text_table, use_triton):
        return fc2(F.silu(fc1(text_table[ids])))
    from ttsbuild.plugins.fused_linear import fused_linear

    y = fused_linear(text_table, fc1.weight, index=ids.reshape(-1), bias=fc1.bias)
    out = fused_linear(F.silu(y), fc2.weight, bias=fc2.bias)
    return out.reshape(*ids.shape, out.shape[-1])


def prompt_embed(rows: torch.Tensor, text_table: torch.Tensor, fc1: torch.nn.Linear,
                 fc2: torch.nn.Linear, table0: torch.Tensor, rest: torch.Tensor,
                 x_vector: torch.Tensor | None, *,
                 use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    """rows [T, 2 + G] -> the talker's input embeddings [T, H]."""
    if not want_triton(table0, use_triton):
        text = fc2(F.silu(fc1(text_table[rows[:, TEXT]])))
        return text + codec_track_reference(rows, table0, rest, x_vector)
    from ttsbuild.plugins.fused_linear import fused_linear

    codec = codec_track(rows, table0, rest, x_vector, use_triton=True)
    y = fused_linear(text_table, fc1.weight, index=rows[:, TEXT], bias=fc1.bias)
    return fused_linear(F.silu(y), fc2.weight, bias=fc2.bias, residual=codec)
