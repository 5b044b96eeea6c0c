"""Speculation through the engine (CPU): greedy codes of the code predictor are identical
with speculation off (GraphBackend, EagerBackend) and on (both draft kinds), over >= 32
frames of requests batched together; the draft ships in the checkpoint (`attach_draft`)."""

import shutil

import pytest
import torch

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.model.config import ModelConfig
from ttsbuild.runtime.draft import attach_draft, draft_shape, write_draft
from ttsbuild.runtime.engine import EagerEngine, Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SamplingOverrides, SynthesisRequest

FRAMES = 34
TEXTS = [
    "The birch canoe slid on the smooth planks, glued the sheet to the dark blue background.",
    "It is easy to tell the depth of a well; these days a chicken leg is a rare dish.",
]


@pytest.fixture(scope="module")
def models_with_draft(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec") / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    cfg = ModelConfig.from_official(load_checkpoint(root).config)
    g = torch.Generator().manual_seed(3)
    write_draft(
        root.parent / "draft.safetensors",
        0.05 * torch.randn(draft_shape(cfg), generator=g),
        cfg,
        window=4,
    )
    attach_draft(root, root.parent / "draft.safetensors")
    models = Models.load(load_checkpoint(root), device="cpu")
    assert models.draft_heads is not None and models.draft_heads.shape == draft_shape(cfg)
    return models


def _codes(engine):
    sampling = SamplingOverrides(subtalker_do_sample=False)  # greedy code predictor
    slots = [
        engine.admit(SynthesisRequest(text=t, voice="ryan", seed=5 + i, max_frames=FRAMES,
                                      sampling=sampling))
        for i, t in enumerate(TEXTS)
    ]  # fmt: skip
    engine.prefill(slots)
    frames = {s: [] for s in slots}
    while not all(engine.is_finished(s) for s in slots):
        live = [s for s in slots if not engine.is_finished(s)]
        for s, out in zip(live, engine.frames(live), strict=True):
            if out.codes is not None:
                frames[s].append(out.codes)
    return [torch.stack(frames[s]) for s in slots]


def test_greedy_codes_identical_with_speculation_on_and_off(models_with_draft):
    rc = dict(num_slots=2, max_len=256, max_text=128, batch_buckets=(1, 2), prefill_buckets=(64,))
    reference = _codes(EagerEngine(models_with_draft, plan=EnginePlan(**rc)))
    assert all(c.shape[0] >= 32 for c in reference)
    for speculative in ({}, {1: ("self", 3), 2: ("self", 2)}, {1: ("draft", 4), 2: ("draft", 1)}):
        plan = EnginePlan(speculative=speculative, **rc)
        codes = _codes(GraphEngine(models_with_draft, plan, use_graphs=False))
        for got, want in zip(codes, reference, strict=True):
            assert torch.equal(got, want), speculative


def test_a_draft_plan_without_a_draft_is_refused(tiny_checkpoint):
    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    plan = EnginePlan(
        num_slots=1,
        max_len=128,
        max_text=64,
        batch_buckets=(1,),
        prefill_buckets=(32,),
        speculative={1: ("draft", 2)},
    )
    with pytest.raises(ValueError, match="has none: attach one"):
        GraphEngine(models, plan, use_graphs=False)


def _alone_and_paired(models, speculative, sampling=None, exact=False):
    """The first request's codes run alone (bucket 1) and beside a second (bucket 2)."""
    out = []
    for paired in (False, True):
        plan = EnginePlan.default(num_slots=4, speculative=speculative, admission_lane=(),
                                  speculative_exact=exact)  # fmt: skip
        engine = GraphEngine(models, plan, keep_codes=True)
        reqs = [SynthesisRequest(text=t, voice="ryan", seed=5 + i, max_frames=6,
                                 sampling=sampling or SamplingOverrides())
                for i, t in enumerate(TEXTS)]  # fmt: skip
        slots = [engine.admit(r) for r in reqs[: 1 + paired]]
        engine.prefill(slots)
        for _ in range(6):
            engine.frames(slots)
        out.append(engine.codes_of(slots[0]))
    return out


def test_speculation_on_some_buckets_makes_sampled_codes_load_dependent(models_with_draft,
                                                                       caplog):  # fmt: skip
    """What EnginePlan.load_dependent_samples says, shown: with speculation at bucket 1 only, a
    sampled request's codes alone differ from its codes beside another request (plain at
    bucket 2), while greedy codes, and sampled ones without speculation, are the same; the
    engine warns of it."""
    spec = {1: ("self", 3)}
    plain_alone, plain_paired = _alone_and_paired(models_with_draft, {})
    assert torch.equal(plain_alone, plain_paired)
    with caplog.at_level("WARNING", logger="ttsbuild.runtime.graph_engine"):
        alone, paired = _alone_and_paired(models_with_draft, spec)
    assert "reproducible only at the same load" in caplog.text
    assert torch.equal(paired, plain_paired) and not torch.equal(alone, paired)
    greedy = SamplingOverrides(do_sample=False, subtalker_do_sample=False)
    alone, paired = _alone_and_paired(models_with_draft, spec, greedy)
    assert torch.equal(alone, paired)


def test_load_dependent_samples_only_where_some_frames_skip_speculation():
    buckets = dict(num_slots=4)
    assert not EnginePlan.default(**buckets, admission_lane=()).load_dependent_samples
    every = {b: ("self", 3) for b in EnginePlan.default(**buckets).batch_buckets}
    assert not EnginePlan.default(**buckets, speculative=every,
                                  admission_lane=()).load_dependent_samples  # fmt: skip
    assert EnginePlan.default(**buckets, speculative=every).load_dependent_samples  # the lane
    plan = EnginePlan.default(**buckets, speculative={1: ("self", 3)}, admission_lane=())
    assert plan.load_dependent_samples and "bucket(s) 1 only" in plan.speculation_note()
    assert not EnginePlan.default(**buckets, speculative={1: ("self", 3)},
                                  speculative_exact=True).load_dependent_samples  # fmt: skip


@pytest.mark.parametrize("kind", ["self", "draft"])
def test_exact_match_verification_keeps_the_plain_draws_at_any_load(models_with_draft, kind,
                                                                    monkeypatch):  # fmt: skip
    """With speculative_exact every code is the plain sampler's draw: a sampled request's
    codes alone (bucket 1, speculative) equal its codes beside another request (bucket 2,
    plain) and without speculation; the rounds did run, verifying drafts."""
    from ttsbuild.runtime import cp_spec

    rounds = []
    accept = cp_spec.spec_accept  # imported there from plugins.spec_accept
    monkeypatch.setattr(cp_spec, "spec_accept",
                        lambda *a, **k: rounds.append(k["exact"]) or accept(*a, **k))  # fmt: skip
    plain_alone, _ = _alone_and_paired(models_with_draft, {})
    alone, paired = _alone_and_paired(models_with_draft, {1: (kind, 3)}, exact=True)
    assert len(rounds) >= 6 and all(rounds)  # at least a round a frame, alone; exact ones
    assert torch.equal(alone, plain_alone) and torch.equal(paired, plain_alone)


def test_exact_accept_keeps_drafts_while_they_equal_the_targets_draws():
    """spec_accept(exact=True) on chosen drafts: the matching prefix is kept, then the
    target's own draw (the plain sampler's, same counters); drafts equal to those draws (as
    the shared noise gives a draft equal to the target) keep all k and get the bonus draw;
    greedy rows compare argmaxes."""
    from ttsbuild.generation.sampling import SamplingBatch, draw_counter
    from ttsbuild.plugins.sampling import fused_sample
    from ttsbuild.plugins.spec_accept import RoundState, spec_accept
    from ttsbuild.runtime.cp_spec import per_draft

    g = torch.Generator().manual_seed(11)
    B, k, V, H, G = 4, 3, 64, 8, 16
    logits = 3 * torch.randn(B, k + 1, V, generator=g)
    sampling = SamplingBatch(
        do_sample=torch.tensor([True, True, True, False]), temperature=torch.full((B,), 0.9),
        top_k=torch.full((B,), 20), top_p=torch.ones(B), repetition_penalty=torch.ones(B))
    seeds, frames = torch.tensor([3, 4, 5, 6]), torch.tensor([0, 7, 2, 9])
    books = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [2, 3, 4, 5], [9, 10, 11, 12]])
    counters = draw_counter(frames[:, None], G, books).reshape(-1)
    want = fused_sample(logits.reshape(-1, V), per_draft(sampling, k + 1),
                        seeds.repeat_interleave(k + 1), counters).reshape(B, k + 1)  # fmt: skip
    keep = torch.tensor([0, 1, 2, 3])  # drafts matching for this many positions, then not
    drafts = want[:, :k].clone()
    for b in range(B):
        if keep[b] < k:
            drafts[b, keep[b]] = (want[b, keep[b]] + 1) % V
    h = torch.randn(B, k + 1, H, generator=g)
    state = RoundState(torch.zeros(B, G + k + 2, dtype=torch.int64), torch.zeros(B, H),
                       torch.zeros(B, dtype=torch.int64), books[:, 0] - 1,
                       torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       G + k + 1)  # fmt: skip
    accepted, final, ok = spec_accept(logits[:, :k], logits, drafts, books, sampling, seeds,
                                      frames, G, h, state, exact=True)  # fmt: skip
    assert accepted.tolist() == keep.tolist()
    assert final.tolist() == [want[b, keep[b]].item() for b in range(B)]
    for b in range(B):  # the kept codes in their columns, the source the last kept position's
        cols = books[b, : keep[b] + 1]
        assert state.codes[b, cols].tolist() == want[b, : keep[b] + 1].tolist()
        assert torch.equal(state.source[b], h[b, keep[b]])
    assert torch.equal(ok[:, 0], keep > 0)
    assert (want[3] == logits[3].argmax(-1)).all()  # the greedy row: argmaxes
