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


def _alone_and_paired(models, speculative, sampling=None):
    """The first request's codes run alone (bucket 1) and beside a second (bucket 2)."""
    out = []
    for paired in (False, True):
        plan = EnginePlan.default(num_slots=4, speculative=speculative, admission_lane=())
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
