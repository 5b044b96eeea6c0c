"""A speculative frame's bookkeeping around its draft and verify passes (runtime.cp_spec): a
round's in two launches instead of eight, the frame's staging and its rows' start in one each.

- `round_books`: the codebooks a round verifies, books [B, k + 1] = depth + 1 .. depth + k + 1,
  the counters [B * k] of the draft draws, base + books[:, :k] (the draft's counter base per
  row, staged once per frame), and the verify pass's first positions, depth + 1, contiguous.
  Replaces an add for the books, an add plus a copy of the strided slice for the counters,
  and the add for the positions.
- `verify_index`: the flat row of each verify position's input embedding in the code
  predictor's tables viewed as [(G - 1) * V, H]: position t of row b takes codebook
  books[b, t] - 1's code (the row's pending code at t = 0, draft t - 1 after it) from that
  codebook's table, clamp(books[b, t] - 2, 0, G - 2). In position-major order (t * B + b:
  the fused verify pass's token-by-token rows) or row-major (b * (k + 1) + t: `extend`'s).
  The projection then gathers its rows itself (`FusedCodePredictor._project(table, index)`),
  so the cat of the inputs, the table arithmetic, the embedding gather and the transpose copy
  (five launches) are this one and none.
- `stage_frame`: a speculative frame's inputs copied into the fixed buffers its rounds read
  (the WHILE body is captured ahead against them): each row's five sampling settings, seed and
  frame; the settings and seed repeated for the row's k draft draws; the draft counters' base.
  One launch instead of ~20 copies and repeats; it also writes the counters of codebook 1's
  draws (frames * G + 1), two launches of the frame's first sampler fewer.
- `frame_start`: the rows' state after codebook 1 (depth 1, the pending code, the source
  hidden state, codes 0 and 1, and the WHILE node's "some row is live"): one launch instead
  of eight (a fill, four copies, the live flag's compare, any and copy).
The references are the ops they replace, exactly.
"""

from __future__ import annotations

import torch

from ttsbuild.generation.sampling import draw_counter
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.spec_accept import set_live


def round_books_reference(depth: torch.Tensor, base: torch.Tensor,
                          k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """depth [B], base [B] int64 -> (books [B, k + 1], counters [B * k], start [B]) int64."""
    books = depth[:, None] + torch.arange(1, k + 2, device=depth.device)
    return books, (base[:, None] + books[:, :k]).reshape(-1), depth + 1


def round_books(depth: torch.Tensor, base: torch.Tensor, k: int, *,
                use_triton: bool | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
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


def stage_frame_reference(fields: list[torch.Tensor], plain: list[torch.Tensor],
                          draft: list[torch.Tensor], base: torch.Tensor, first: torch.Tensor,
                          k: int, groups: int, base_offset: int) -> None:  # fmt: skip
    """fields: the frame's B-row inputs (do_sample, temperature, top_k, top_p,
    repetition_penalty, seeds, frames). plain: 7 buffers, each [:B] <- its field. draft: 6
    buffers (the settings and the seeds), [:B * k] <- the field repeated k times per row.
    base[:B] <- base_offset + frames * groups; first[:B] <- frames * groups + 1 (the counters
    of codebook 1's draws, the plain sampler's)."""
    B = fields[0].shape[0]
    for src, dst in zip(fields, plain, strict=True):
        dst[:B].copy_(src)
    for src, dst in zip(fields[:6], draft, strict=True):
        dst[: B * k].copy_(src.repeat_interleave(k))
    base[:B].copy_(base_offset + draw_counter(fields[6], groups))
    first[:B].copy_(draw_counter(fields[6], groups, 1))


def stage_frame(fields: list[torch.Tensor], plain: list[torch.Tensor], draft: list[torch.Tensor],
                base: torch.Tensor, first: torch.Tensor, k: int, groups: int, base_offset: int,
                *, use_triton: bool | None = None) -> None:  # fmt: skip
    B = fields[0].shape[0]
    if len(fields) != 7 or len(plain) != 7 or len(draft) != 6 or k < 1:
        raise ValueError("stage_frame: 7 fields, 7 row buffers, 6 draft buffers, a window >= 1")
    small = [t for t in (*plain, base, first) if t.shape[0] < B]
    small += [t for t in draft if t.shape[0] < B * k]
    if any(f.shape != (B,) for f in fields) or small:
        raise ValueError(f"stage_frame: fields of {B} rows, or buffers too short for them and "
                         f"their {k} drafts each")  # fmt: skip
    for src, dst in zip(fields, plain, strict=True):
        if src.dtype != dst.dtype:
            raise ValueError(f"stage_frame: a {src.dtype} field for a {dst.dtype} buffer")
    if not want_triton(base, use_triton):
        return stage_frame_reference(fields, plain, draft, base, first, k, groups, base_offset)
    from ttsbuild.plugins._tl.spec_round import stage_frame_triton

    return stage_frame_triton(fields, plain, draft, base, first, k, groups, base_offset)


def frame_start_reference(code1: torch.Tensor, c0: torch.Tensor, h: torch.Tensor,
                          depth: torch.Tensor, pending: torch.Tensor, source: torch.Tensor,
                          codes: torch.Tensor, live: torch.Tensor,
                          groups: int) -> None:  # fmt: skip
    """The B rows' state after codebook 1 (views [:B] of the predictor's buffers; live [1])."""
    depth.fill_(1)
    pending.copy_(code1)
    source.copy_(h)
    codes[:, 0], codes[:, 1] = c0, code1
    set_live(live, depth, groups)


def frame_start(code1: torch.Tensor, c0: torch.Tensor, h: torch.Tensor, depth: torch.Tensor,
                pending: torch.Tensor, source: torch.Tensor, codes: torch.Tensor,
                live: torch.Tensor, groups: int, *,
                use_triton: bool | None = None) -> None:  # fmt: skip
    B = code1.shape[0]
    if (c0.shape != (B,) or h.dim() != 2 or h.shape[0] != B or depth.shape != (B,)
            or pending.shape != (B,) or source.shape != h.shape or codes.shape[0] != B
            or codes.shape[1] < 2 or live.numel() != 1):  # fmt: skip
        raise ValueError("frame_start: code1, c0 [B], h [B, H], depth, pending [B], source "
                         "[B, H], codes [B, >= 2], live [1]")  # fmt: skip
    if not want_triton(h, use_triton):
        return frame_start_reference(code1, c0, h, depth, pending, source, codes, live, groups)
    from ttsbuild.plugins._tl.spec_round import frame_start_triton

    return frame_start_triton(code1, c0, h, depth, pending, source, codes, live, groups)
