"""plugins.spec_round: a speculative round's books / counters and its verify inputs' table rows,
the kernels against the references on fresh random rows (on CUDA, or the CPU under
TRITON_INTERPRET=1), and the references against what they replace: the verify inputs as
`embeddings[tables, codes]`, in the fused pass's position-major order or extend's row order."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.spec_round import (
    frame_start,
    frame_start_reference,
    round_books,
    round_books_reference,
    stage_frame,
    stage_frame_reference,
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
    books, counters, start = round_books_reference(depth, base, k)
    assert torch.equal(books, depth[:, None] + 1 + torch.arange(k + 1))
    assert torch.equal(start, depth + 1)
    assert torch.equal(counters, spec_counters(frames, books[:, :k], DRAFT_DRAW, G).reshape(-1))


@pytest.mark.parametrize("position_major", [True, False])
@pytest.mark.parametrize("B,k", [(1, 1), (3, 4), (8, 6)])
def test_the_index_picks_the_inputs_the_verify_pass_reads(B, k, position_major):
    depth, frames, pending, drafts = _rows(B, k, 7 * B + k)
    books, *_ = round_books_reference(depth, frames, k)
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
    books, *_ = round_books_reference(depth, frames, k)
    # drafts and books as the round passes them: a reshaped sampler output, a strided slice
    wide = torch.zeros(B, k + 3, dtype=torch.int64)
    wide[:, 1 : k + 2] = books
    got = verify_index(pending.to(KDEV), drafts.to(KDEV), wide.to(KDEV)[:, 1 : k + 2], G, V,
                       position_major, use_triton=True)  # fmt: skip
    want = verify_index_reference(pending, drafts, books, G, V, position_major)
    assert torch.equal(got.cpu(), want)


def test_shapes_that_do_not_fit_are_refused():
    depth, frames, pending, drafts = _rows(3, 2, 0)
    books, *_ = round_books_reference(depth, frames, 2)
    with pytest.raises(ValueError, match="round_books"):
        round_books(depth, frames[:2], 2)
    with pytest.raises(ValueError, match="round_books"):
        round_books(depth, frames, 0)
    with pytest.raises(ValueError, match="verify_index"):
        verify_index(pending, drafts, books[:, :2], G, V, True)


def _stage_case(B: int, k: int, seed: int, device):
    from ttsbuild.runtime.cp_spec import plain_sampling

    g = torch.Generator().manual_seed(seed)
    fields = [
        torch.rand(B, generator=g) < 0.5,
        torch.rand(B, generator=g) + 0.5,
        torch.randint(0, 100, (B,), generator=g),
        torch.rand(B, generator=g),
        torch.rand(B, generator=g) + 1.0,
        torch.randint(0, 2**62, (B,), generator=g),
        torch.randint(0, 2**20, (B,), generator=g),
    ]
    n = 8  # buffers for up to 8 rows x 6 drafts, filled with markers to see what is written
    rows, drafted = plain_sampling(n, "cpu"), plain_sampling(n * 6, "cpu")
    names = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
    plain = [getattr(rows, f) for f in names] + [torch.full((n,), -7), torch.full((n,), -7)]
    draft = [getattr(drafted, f) for f in names] + [torch.full((n * 6,), -7)]
    base, first = torch.full((n,), -7), torch.full((n,), -7)
    return ([f.to(device) for f in fields], [t.to(device) for t in plain],
            [t.to(device) for t in draft], base.to(device), first.to(device))  # fmt: skip


@pytest.mark.parametrize("B,k", [(1, 1), (3, 4), (8, 6)])
def test_stage_frame_reference_writes_the_rows_and_their_drafts(B, k):
    fields, plain, draft, base, first = _stage_case(B, k, B * k, "cpu")
    untouched = [t.clone() for t in plain]
    stage_frame_reference(fields, plain, draft, base, first, k, G, DRAFT_DRAW << 28)
    for f, p, d, before in zip(fields, plain, draft + [None], untouched, strict=True):
        assert torch.equal(p[:B], f) and torch.equal(p[B:], before[B:])
        if d is not None:
            assert torch.equal(d[: B * k].view(B, k), f[:, None].expand(B, k))
    assert torch.equal(base[:B], spec_counters(fields[6], torch.zeros(B, 1, dtype=torch.int64),
                                               DRAFT_DRAW, G)[:, 0])  # fmt: skip
    # codebook 1's draws: the plain sampler's counters (runtime.cp_fused._counters)
    assert torch.equal(first[:B], fields[6] * G + 1) and int(first[B:].ne(-7).sum()) == 0


@needs_kernel
@pytest.mark.parametrize("B,k,seed", [(1, 1, 1), (3, 4, 2), (8, 6, 3), (5, 3, 4)])
def test_stage_frame_kernel_equals_the_reference(B, k, seed):
    got = _stage_case(B, k, seed, KDEV)
    want = _stage_case(B, k, seed, "cpu")
    stage_frame(*got, k, G, DRAFT_DRAW << 28, use_triton=True)
    stage_frame_reference(*want, k, G, DRAFT_DRAW << 28)
    for a, b in zip([*got[1], *got[2], *got[3:]], [*want[1], *want[2], *want[3:]], strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


def test_stage_frame_refuses_what_does_not_fit():
    fields, plain, draft, base, first = _stage_case(3, 4, 0, "cpu")
    stage_frame(fields, plain, draft, base, first, 4, G, 0)  # 3 rows x 4 drafts fit in 48
    with pytest.raises(ValueError, match="too short"):
        stage_frame(fields, plain, [d[:10] for d in draft], base, first, 4, G, 0)
    with pytest.raises(ValueError, match="too short"):
        stage_frame(fields, plain, draft, base, first[:2], 4, G, 0)
    with pytest.raises(ValueError, match="field for a"):
        stage_frame([fields[0].long(), *fields[1:]], plain, draft, base, first, 4, G, 0)


def _start_case(B: int, H: int, seed: int, device, strided: bool):
    g = torch.Generator().manual_seed(seed)
    code1, c0 = torch.randint(0, V, (B,), generator=g), torch.randint(0, V, (B,), generator=g)
    wide = torch.randn(B, 2, H, generator=g)
    h = wide[:, 1] if strided else wide[:, 1].contiguous()  # prefill's last position: strided
    n = 8  # the predictor's buffers, with markers
    state = [torch.full((n,), -3), torch.full((n,), -3), torch.full((n, H), -3.0),
             torch.full((n, G + 5), -3), torch.zeros(1, dtype=torch.int32)]  # fmt: skip
    state = [t.to(device) for t in state]
    views = [state[0][:B], state[1][:B], state[2][:B], state[3][:B], state[4]]
    return [code1.to(device), c0.to(device), h.to(device)], views, state


@pytest.mark.parametrize("B", [1, 5])
def test_frame_start_reference_is_the_rows_state_after_codebook_1(B):
    inputs, views, state = _start_case(B, 24, B, "cpu", True)
    frame_start_reference(*inputs, *views, G)
    code1, c0, h = inputs
    assert torch.equal(state[0][:B], torch.ones(B, dtype=torch.int64))
    assert torch.equal(state[1][:B], code1) and torch.equal(state[2][:B], h)
    assert torch.equal(state[3][:B, 0], c0) and torch.equal(state[3][:B, 1], code1)
    assert int(state[3][:B, 2:].ne(-3).sum()) == 0 and int(state[0][B:].ne(-3).sum()) == 0
    assert int(state[4]) == 1  # G = 16: rows at depth 1 are live
    frame_start_reference(*inputs, *views, 2)  # a 2-codebook model: done after codebook 1
    assert int(state[4]) == 0


@needs_kernel
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("B,H,groups", [(1, 24, G), (5, 1100, G), (3, 40, 2)])
def test_frame_start_kernel_equals_the_reference(B, H, groups, strided):
    got_in, got_views, got = _start_case(B, H, B + H, KDEV, strided)
    want_in, want_views, want = _start_case(B, H, B + H, "cpu", strided)
    frame_start(*got_in, *got_views, groups, use_triton=True)
    frame_start_reference(*want_in, *want_views, groups)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b)
