"""plugins.spec_accept: a speculative round's acceptance in one kernel against the chain of
reference ops it replaces (runtime.cp_spec), on fresh random logits of several sharpnesses,
greedy and sampled rows, top-k / top-p on and off; and the greedy rule stated directly."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.plugins.spec_accept import RoundState, spec_accept
from ttsbuild.runtime.cp_spec import DRAFT_DRAW, per_draft, spec_counters

G = 16


def _case(B: int, k: int, V: int, seed: int, greedy_only: bool = False):
    """Target logits, draft logits near them (some rows equal: all accepted), drafts drawn
    from the draft's distribution as a round draws them, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    sharp = torch.tensor([0.5, 2.0, 6.0])[torch.randint(0, 3, (B,), generator=g)]
    target = torch.randn(B, k + 1, V, generator=g) * sharp[:, None, None]
    noise = torch.tensor([0.0, 0.3, 1.5])[torch.randint(0, 3, (B,), generator=g)]
    draft = target[:, :k] + noise[:, None, None] * torch.randn(B, k, V, generator=g)
    sampling = SamplingBatch(
        do_sample=torch.zeros(B, dtype=torch.bool) if greedy_only
        else torch.rand(B, generator=g) < 0.8,
        temperature=torch.tensor([0.7, 1.0, 1.3])[torch.randint(0, 3, (B,), generator=g)],
        top_k=torch.tensor([0, 5, 50])[torch.randint(0, 3, (B,), generator=g)],
        top_p=torch.tensor([1.0, 0.8, 0.95])[torch.randint(0, 3, (B,), generator=g)],
        repetition_penalty=torch.ones(B),
    )  # fmt: skip
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    frames = torch.randint(0, 5000, (B,), generator=g)
    depth = torch.randint(1, G - 1, (B,), generator=g)
    books = depth[:, None] + 1 + torch.arange(k + 1)
    counters = spec_counters(frames, books[:, :k], DRAFT_DRAW, G).reshape(-1)
    drafts = fused_sample(draft.reshape(B * k, V), per_draft(sampling, k),
                          seeds.repeat_interleave(k), counters,
                          use_triton=False).reshape(B, k)  # fmt: skip
    return draft, target, drafts, books, sampling, seeds, frames


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _sampling_on(s: SamplingBatch, device) -> SamplingBatch:
    return SamplingBatch(**{f: getattr(s, f).to(device) for f in s.__dataclass_fields__})


@needs_kernel
@pytest.mark.parametrize("k,V,seed", [(1, 300, 1), (3, 300, 2), (4, 2048, 3)])
def test_spec_accept_kernel_equals_the_reference_ops(k, V, seed, monkeypatch):
    B = 24
    draft, target, drafts, books, sampling, seeds, frames = _case(B, k, V, seed)
    dev = _on(KDEV, draft, target, drafts, books, seeds, frames)
    got = spec_accept(dev[0], dev[1], dev[2], dev[3], _sampling_on(sampling, KDEV), dev[4],
                      dev[5], G, use_triton=True)  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference: the torch ops on the CPU
    accepted, final, ok = spec_accept(draft, target, drafts, books, sampling, seeds, frames, G,
                                      use_triton=False)  # fmt: skip
    # the case covers every outcome: a rejection at the first draft, one later, all accepted
    assert (accepted == 0).any() and (accepted == k).any(), accepted
    if k > 1:
        assert ((accepted > 0) & (accepted < k)).any(), accepted
    assert torch.equal(got[0].cpu(), accepted)
    assert torch.equal(got[1].cpu(), final)
    tested = torch.arange(k)[None, :] <= accepted[:, None]  # the tests that were run
    assert torch.equal(got[2].cpu()[tested], ok[tested])
    assert not got[2].cpu()[~tested].any()


@needs_kernel
def test_spec_accept_kernel_greedy_rule():
    """Greedy rows: the leading drafts equal to the target's argmax are accepted, the code
    after them is the target's argmax at the first mismatch (or at the bonus position)."""
    B, k, V = 16, 3, 300
    draft, target, drafts, books, sampling, seeds, frames = _case(B, k, V, 7, greedy_only=True)
    drafts[::3] = target[::3, :k].argmax(-1)  # every third row: every draft right
    dev = _on(KDEV, draft, target, drafts, books, seeds, frames)
    accepted, final, _ = spec_accept(dev[0], dev[1], dev[2], dev[3],
                                     _sampling_on(sampling, KDEV), dev[4], dev[5], G,
                                     use_triton=True)  # fmt: skip
    best = target.argmax(-1)  # [B, k + 1]
    right = (drafts == best[:, :k]).long().cumprod(1).sum(1)
    assert torch.equal(accepted.cpu(), right)
    assert torch.equal(final.cpu(), best.gather(1, right[:, None])[:, 0])
    assert (right[::3] == k).all() and (right < k).any()


def _state(B: int, k: int, H: int, books: torch.Tensor, seed: int, device) -> RoundState:
    g = torch.Generator().manual_seed(seed)
    W = 6
    codes = torch.randint(0, 1000, (B, G + W + 2), generator=g)
    return RoundState(
        codes=codes.to(device), source=torch.randn(B, H, generator=g).to(device),
        pending=torch.randint(0, 1000, (B,), generator=g).to(device),
        depth=(books[:, 0] - 1).to(device), live=torch.zeros(1, dtype=torch.int32).to(device),
        arrivals=torch.zeros(1, dtype=torch.int32).to(device), trash=G + W + 1,
    )  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("k,B,done", [(3, 9, False), (2, 5, True)])
def test_spec_accept_kernel_applies_the_round_as_the_reference_ops(k, B, done, monkeypatch):
    """With the rows' state: codes (all but the trash column), source, pending, depth and
    live as the reference ops leave them, and the kernel's arrival count back at 0; `done`:
    every row ends the round at the last codebook (live 0), else some row is still live."""
    V, H = 300, 40
    draft, target, drafts, books, sampling, seeds, frames = _case(B, k, V, 11 + k)
    if done:  # depths near the end: every row reaches G - 1 whatever it accepts
        books = books - books[:, :1] + (G - 1)
    h = torch.randn(B, k + 1, H, generator=torch.Generator().manual_seed(5))
    dev = _on(KDEV, draft, target, drafts, books, seeds, frames, h)
    got = _state(B, k, H, books, 3, KDEV)
    spec_accept(*dev[:4], _sampling_on(sampling, KDEV), dev[4], dev[5], G, dev[6], got,
                use_triton=True)  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = _state(B, k, H, books, 3, "cpu")
    spec_accept(draft, target, drafts, books, sampling, seeds, frames, G, h, want,
                use_triton=False)  # fmt: skip
    assert torch.equal(got.codes.cpu()[:, : want.trash], want.codes[:, : want.trash])
    assert torch.equal(got.source.cpu(), want.source)
    assert torch.equal(got.pending.cpu(), want.pending)
    assert torch.equal(got.depth.cpu(), want.depth)
    assert int(got.live) == int(want.live) == (0 if done else 1)
    assert int(got.arrivals) == 0


def test_spec_accept_refuses_shapes_that_do_not_fit():
    draft, target, drafts, books, sampling, seeds, frames = _case(2, 3, 50, 0)
    with pytest.raises(ValueError, match="do not fit"):
        spec_accept(draft, target[:, :3], drafts, books, sampling, seeds, frames, G)
    with pytest.raises(ValueError, match="hidden states"):
        spec_accept(draft, target, drafts, books, sampling, seeds, frames, G,
                    state=_state(2, 3, 8, books, 0, "cpu"))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_input", [False, True])
def test_head_gemv_kernel_matches_the_gathered_heads(dtype, shared_input, monkeypatch):
    """Each position's head read in place == the product with the gathered heads (fresh
    random heads, inputs and indices; the index a strided view, offset by -1 and clamped as
    the reference clamps it; shared_input: one input per row, an expanded view)."""
    from ttsbuild.plugins.head_gemv import head_gemv

    g = torch.Generator().manual_seed(21 + shared_input)
    C, V, H, B, T = 5, 200, 72, 3, 4
    heads = (torch.randn(C, V, H, generator=g) * 0.2).to(dtype)
    x = torch.randn(B, 1 if shared_input else T, H, generator=g).to(dtype).expand(B, T, H)
    books = torch.randint(0, C + 2, (B, T + 1), generator=g)  # 0 and C + 1 clamp
    index = books[:, :T]  # a view: row stride T + 1
    got = head_gemv(heads.to(KDEV), x.to(KDEV), books.to(KDEV)[:, :T], -1, use_triton=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    chosen = (index - 1).clamp(0, C - 1)
    ref = torch.einsum("btvh,bth->btv", heads.double()[chosen], x.double())
    rel = ((got.cpu().double() - ref).norm() / ref.norm()).item()
    assert got.shape == (B, T, V) and got.dtype == torch.float32
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2), rel
    # one position's head off by one is seen
    other = (int(chosen[0, 1]) + 1) % C
    ref[0, 1] = torch.einsum("vh,h->v", heads.double()[other], x.double()[0, 1])
    assert ((got.cpu().double() - ref).norm() / ref.norm()).item() > 1e-2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gemv_kernel_applies_the_final_norm_itself(dtype, monkeypatch):
    """norm=(weight, eps): the residual stream in, the model's RMSNorm applied in the kernel
    == rms_norm then the heads (float64 reference of the normed rows); inputs of very
    different scales per position (the norm's job); a norm with the weight left out fails."""
    from ttsbuild.plugins.head_gemv import head_gemv

    g = torch.Generator().manual_seed(33)
    C, V, H, B, T = 4, 150, 96, 2, 3
    heads = (torch.randn(C, V, H, generator=g) * 0.2).to(dtype)
    scale = torch.tensor([0.01, 1.0, 40.0])[None, :, None]  # per position
    x = (torch.randn(B, T, H, generator=g) * scale).to(dtype)
    weight = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    books = torch.randint(1, C + 1, (B, T), generator=g)
    got = head_gemv(heads.to(KDEV), x.to(KDEV), books.to(KDEV), -1,
                    norm=(weight.to(KDEV), 1e-6), use_triton=True).cpu().double()  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    chosen = (books - 1).clamp(0, C - 1)
    ref = torch.einsum("btvh,bth->btv", heads.double()[chosen], normed)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 2e-2), rel
    for t in range(T):  # every position normalised, whatever its scale
        r = ((got[:, t] - ref[:, t]).norm() / ref[:, t].norm()).item()
        assert r < (1e-6 if dtype == torch.float32 else 2e-2), (t, r)
    unweighted = torch.einsum("btvh,bth->btv", heads.double()[chosen], normed / weight.double())
    assert ((got - unweighted).norm() / unweighted.norm()).item() > 5e-2
    # the reference path of the same call agrees with the kernel
    cpu = head_gemv(heads, x, books, -1, norm=(weight, 1e-6), use_triton=False).double()
    assert ((got - cpu).norm() / cpu.norm()).item() < (1e-6 if dtype == torch.float32 else 2e-2)


def _shared_noise_drafts(draft, books, sampling, seeds, frames):
    """Drafts as exact-match rounds draw them: with the plain sampler's counters."""
    from ttsbuild.generation.sampling import draw_counter

    B, k, V = draft.shape
    counters = draw_counter(frames[:, None], G, books[:, :k]).reshape(-1)
    return fused_sample(draft.reshape(B * k, V), per_draft(sampling, k),
                        seeds.repeat_interleave(k), counters,
                        use_triton=False).reshape(B, k)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("k,V,seed", [(1, 300, 1), (3, 300, 2), (4, 2048, 3)])
def test_exact_match_kernel_equals_the_reference_ops(k, V, seed, monkeypatch):
    """The acceptance kernel's EXACT mode against the torch ops: each position's draw is the
    plain sampler's (`fused_sample` with counters frame * G + codebook), the drafts kept while
    equal; the rows' state applied as the reference applies it."""
    B, H = 24, 40
    draft, target, _, books, sampling, seeds, frames = _case(B, k, V, seed)
    drafts = _shared_noise_drafts(draft, books, sampling, seeds, frames)
    h = torch.randn(B, k + 1, H, generator=torch.Generator().manual_seed(seed))
    dev = _on(KDEV, draft, target, drafts, books, seeds, frames, h)
    got_state = _state(B, k, H, books, 3, KDEV)
    got = spec_accept(*dev[:4], _sampling_on(sampling, KDEV), dev[4], dev[5], G, dev[6],
                      got_state, exact=True, use_triton=True)  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want_state = _state(B, k, H, books, 3, "cpu")
    accepted, final, ok = spec_accept(draft, target, drafts, books, sampling, seeds, frames, G,
                                      h, want_state, exact=True, use_triton=False)  # fmt: skip
    assert (accepted == 0).any() and (accepted == k).any(), accepted
    assert torch.equal(got[0].cpu(), accepted) and torch.equal(got[1].cpu(), final)
    tested = torch.arange(k)[None, :] <= accepted[:, None]
    assert torch.equal(got[2].cpu()[tested], ok[tested]) and not got[2].cpu()[~tested].any()
    trash = want_state.trash
    assert torch.equal(got_state.codes.cpu()[:, :trash], want_state.codes[:, :trash])
    assert torch.equal(got_state.source.cpu(), want_state.source)
    assert torch.equal(got_state.depth.cpu(), want_state.depth)
    assert int(got_state.live) == int(want_state.live) and int(got_state.arrivals) == 0
    # the codes kept are the plain sampler's draws at their positions
    plain = fused_sample(target.reshape(-1, V), per_draft(sampling, k + 1),
                         seeds.repeat_interleave(k + 1),
                         (frames[:, None] * G + books).reshape(-1),
                         use_triton=False).reshape(B, k + 1)  # fmt: skip
    assert torch.equal(final, plain.gather(1, accepted[:, None])[:, 0])
