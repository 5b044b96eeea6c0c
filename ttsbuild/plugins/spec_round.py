"""A speculative round's bookkeeping around its draft and verify passes (runtime.cp_spec), in
two launches instead of eight.

- `round_books`: the codebooks a round verifies, books [B, k + 1] = depth + 1 .. depth + k + 1,
  and the counters [B * k] of the draft draws, base + books[:, :k] (the draft's counter base
  per row, staged once per frame). Replaces an add for the books and an add plus a copy of
  the strided slice for the counters.
- `verify_index`: the flat row of each verify position's input embedding in the code
  predictor's tables viewed as [(G - 1) * V, H]: position t of row b takes codebook
  books[b, t] - 1's code (the row's pending code at t = 0, draft t - 1 after it) from that
  codebook's table, clamp(books[b, t] - 2, 0, G - 2). In position-major order (t * B + b:
  the fused verify pass's token-by-token rows) or row-major (b * (k + 1) + t: `extend`'s).
  The projection then gathers its rows itself (`FusedCodePredictor._project(table, index)`),
  so the cat of the inputs, the table arithmetic, the embedding gather and the transpose copy
  (five launches) are this one and none.
The references are the ops they replace, exactly.
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import want_triton


def round_books_reference(depth: torch.Tensor, base: torch.Tensor,
                          k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """depth [B], base [B] int64 -> (books [B, k + 1], counters [B * k]) int64."""
    books = depth[:, None] + torch.arange(1, k + 2, device=depth.device)
    return books, (base[:, None] + books[:, :k]).reshape(-1)


def round_books(depth: torch.Tensor, base: torch.Tensor, k: int, *,
                use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if depth.dim() != 1 or base.shape != depth.shape or k < 1:
        raise ValueError(f"round_books: depth {tuple(depth.shape)}, base {tuple(base.shape)}, "
                         f"window {k}")  # fmt: skip
    if not want_triton(depth, use_triton):
        return round_books_reference(depth, base, k)
    from ttsbuild.plugins._tl.spec_round import round_books_triton

    return round_books_triton(depth, base, k)


def verify_index_reference(pending: torch.Tensor, drafts: torch.Tensor, books: torch.Tensor,
                           groups: int, vocab: int,
                           position_major: bool) -> torch.Tensor:  # fmt: skip
    """pending [B], drafts [B, k], books [B, k + 1] int64 -> flat table rows [(k + 1) * B]."""
    codes = torch.cat([pending[:, None], drafts], dim=1)  # [B, k + 1]
    tables = (books - 2).clamp(0, groups - 2)
    index = tables * vocab + codes
    return (index.T if position_major else index).reshape(-1)


def verify_index(pending: torch.Tensor, drafts: torch.Tensor, books: torch.Tensor, groups: int,
                 vocab: int, position_major: bool, *,
                 use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    B = pending.shape[0]
    k = drafts.shape[1] if drafts.dim() == 2 else -1
    if pending.dim() != 1 or drafts.shape != (B, k) or books.shape != (B, k + 1):
        raise ValueError(f"verify_index: pending {tuple(pending.shape)}, drafts "
                         f"{tuple(drafts.shape)}, books {tuple(books.shape)} do not fit "
                         "[B], [B, k], [B, k + 1]")  # fmt: skip
    if not want_triton(pending, use_triton):
        return verify_index_reference(pending, drafts, books, groups, vocab, position_major)
    from ttsbuild.plugins._tl.spec_round import verify_index_triton

    return verify_index_triton(pending, drafts, books, groups, vocab, position_major)
