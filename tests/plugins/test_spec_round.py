"""plugins.spec_round: a speculative round's books / counters and its verify inputs' table rows,
the kernels against the references on fresh random rows (on CUDA, or the CPU under
TRITON_INTERPRET=1), and the references against what they replace: the verify inputs as
`embeddings[tables, codes]`, in the fused pass's position-major order or extend's row order."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.spec_round import (
    round_books,
    round_books_reference,
    verify_index,
    verify_index_reference,
)
from ttsbuild.runtime.cp_spec import DRAFT_DRAW, spec_counters

G, V = 16, 37


def _rows(B: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    depth = torch.randint(1, G, (B,), generator=g)  # G - 1: a row that is done runs on
    frames = torch.randint(0, 5000, (B,), generator=g)
    pending = torch.randint(0, V, (B,), generator=g)
    drafts = torch.randint(0, V, (B, k), generator=g)
    return depth, frames, pending, drafts


@pytest.mark.parametrize("B,k", [(1, 1), (3, 4), (8, 6)])
def test_books_and_counters_are_the_rounds_rule(B, k):
    depth, frames, *_ = _rows(B, k, B + k)
    base = (DRAFT_DRAW << 28) + frames * G  # SpeculativeCodePredictor._stage's base
    books, counters = round_books_reference(depth, base, k)
    assert torch.equal(books, depth[:, None] + 1 + torch.arange(k + 1))
    assert torch.equal(counters, spec_counters(frames, books[:, :k], DRAFT_DRAW, G).reshape(-1))


@pytest.mark.parametrize("position_major", [True, False])
@pytest.mark.parametrize("B,k", [(1, 1), (3, 4), (8, 6)])
def test_the_index_picks_the_inputs_the_verify_pass_reads(B, k, position_major):
    depth, frames, pending, drafts = _rows(B, k, 7 * B + k)
    books, _ = round_books_reference(depth, frames, k)
    embeddings = torch.randn(G - 1, V, 5)
    # the round's inputs as first written: codebook c's code from table c - 1 at position c + 1
    codes = torch.cat([pending[:, None], drafts], 1)
    x = embeddings[(books - 2).clamp(0, G - 2), codes]  # [B, k + 1, H]
    want = x.transpose(0, 1).reshape(-1, 5) if position_major else x.reshape(-1, 5)
    index = verify_index_reference(pending, drafts, books, G, V, position_major)
    assert torch.equal(embeddings.reshape(-1, 5)[index], want)
    # the other order is a different permutation of the same rows (B > 1)
    other = verify_index_reference(pending, drafts, books, G, V, not position_major)
    if B > 1:
        assert not torch.equal(other, index)


@needs_kernel
@pytest.mark.parametrize("B,k,seed", [(1, 1, 1), (3, 3, 2), (5, 6, 3), (8, 4, 4), (64, 3, 5)])
def test_round_books_kernel_equals_the_reference(B, k, seed):
    depth, frames, *_ = _rows(B, k, seed)
    base = (DRAFT_DRAW << 28) + frames * G
    got = round_books(depth.to(KDEV), base.to(KDEV), k, use_triton=True)
    want = round_books_reference(depth, base, k)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a.cpu(), b)


@needs_kernel
@pytest.mark.parametrize("position_major", [True, False])
@pytest.mark.parametrize("B,k,seed", [(1, 1, 1), (3, 3, 2), (5, 6, 3), (64, 3, 5)])
def test_verify_index_kernel_equals_the_reference(B, k, seed, position_major):
    depth, frames, pending, drafts = _rows(B, k, seed)
    books, _ = round_books_reference(depth, frames, k)
    # drafts and books as the round passes them: a reshaped sampler output, a strided slice
    wide = torch.zeros(B, k + 3, dtype=torch.int64)
    wide[:, 1 : k + 2] = books
    got = verify_index(pending.to(KDEV), drafts.to(KDEV), wide.to(KDEV)[:, 1 : k + 2], G, V,
                       position_major, use_triton=True)  # fmt: skip
    want = verify_index_reference(pending, drafts, books, G, V, position_major)
    assert torch.equal(got.cpu(), want)


def test_shapes_that_do_not_fit_are_refused():
    depth, frames, pending, drafts = _rows(3, 2, 0)
    books, _ = round_books_reference(depth, frames, 2)
    with pytest.raises(ValueError, match="round_books"):
        round_books(depth, frames[:2], 2)
    with pytest.raises(ValueError, match="round_books"):
        round_books(depth, frames, 0)
    with pytest.raises(ValueError, match="verify_index"):
        verify_index(pending, drafts, books[:, :2], G, V, True)
