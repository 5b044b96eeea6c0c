"""Peaked stand-ins: trained-model-like sharpness, recorded, measured, and the length rule kept."""

from __future__ import annotations

import json

import pytest
import torch

from ttsbuild.convert.init_random import init_random, load_variant, standin_models
from ttsbuild.model.standin import (
    LOGIT_STD,
    expected_sharpness,
    peak_code_predictor,
    peak_logits,
    sharpness,
)
from ttsbuild.runtime.engine import EagerEngine, random_models, synthesize
from ttsbuild.runtime.request import SamplingOverrides, SynthesisRequest

# ~100 characters: ~83 frames by the speaking-rate rule, longer than the repetition guard's
# 50-frame window, so a stand-in stuck in a code loop would be stopped before its length.
LONG_TEXT = ("The birch canoe slid on the smooth planks, and the boy was there when the sun rose "
             "over the quiet bay.")


def test_the_construction_is_as_peaked_as_the_target():
    """iid N(0, 6^2) logits over 2048 codes: mean top-1 probability in the 0.5-0.8 band of a
    trained LM, with certain and uncertain positions both present."""
    s = expected_sharpness(LOGIT_STD, 2049, samples=1000, seed=1)
    assert 0.55 < s["mean_top1_prob"] < 0.65
    assert 1.2 < s["mean_entropy_nats"] < 1.7
    p10, _, p90 = s["top1_prob_p10_p50_p90"]
    assert p10 < 0.4 and p90 > 0.85
    flat = expected_sharpness(0.02 * 128**0.5, 2049, samples=200)  # the old tiny stand-in
    assert flat["mean_top1_prob"] < 0.01 and flat["mean_entropy_nats"] > 7


def test_sharpness_of_known_distributions():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    s = sharpness(logits)
    assert s["mean_top1_prob"] == pytest.approx((0.25 + 1.0) / 2, abs=1e-4)
    assert s["mean_entropy_nats"] == pytest.approx(torch.log(torch.tensor(4.0)).item() / 2,
                                                   abs=1e-4)


def test_init_random_records_its_measured_sharpness(tmp_path):
    """The stand-in as written speaks shipped texts on CPU; its own logits are about as
    peaked as the construction says (fresh weights: seed 3)."""
    standin = init_random(tmp_path / "s", "tiny", seed=3, measure=True, device="cpu")
    assert json.loads((tmp_path / "s" / "ttsbuild_standin.json").read_text()) == standin
    logits = standin["logits"]
    assert logits["logit_std"] == LOGIT_STD and logits["residual_gain"] > 0
    for group in ("codebook0", "codebooks_1_15"):
        expected, measured = logits["expected"][group], logits["measured"][group]
        assert measured["positions"] >= 64
        assert abs(measured["mean_top1_prob"] - expected["mean_top1_prob"]) < 0.1, group
        assert abs(measured["mean_entropy_nats"] - expected["mean_entropy_nats"]) < 0.4, group
        assert 0.5 <= measured["mean_top1_prob"] <= 0.8, group


def test_flat_stand_ins_stay_available(tmp_path):
    standin = init_random(tmp_path / "s", "tiny", seed=3, peaked=False, measure=False)
    assert standin["logits"] == {"method": "flat (plain N(0, 0.02) weights)"}
    config, _, gen = load_variant("tiny")
    models = standin_models(tmp_path / "s", config, gen, "cpu")
    assert 0.015 < models.talker.codec_head.weight.std().item() < 0.025


def test_peak_logits_in_memory_is_idempotent_and_stand_in_only():
    flat = random_models("tiny", seed=5, peaked=False)
    assert flat.manifest["standin"]["logits"]["method"].startswith("flat")
    record = peak_logits(flat)
    assert record["logit_std"] == LOGIT_STD
    head = flat.talker.codec_head.weight
    assert head.std().item() * flat.cfg.talker.hidden_size**0.5 == pytest.approx(LOGIT_STD,
                                                                                  rel=1e-3)
    before = {k: v.clone() for k, v in flat.talker.state_dict().items()}
    peak_logits(flat)
    after = flat.talker.state_dict()
    assert all(torch.allclose(before[k], after[k], rtol=1e-5, atol=0) for k in before)
    peaked = random_models("tiny", seed=5)  # the default: peaked like init-random
    assert torch.allclose(peaked.talker.codec_head.weight, head, rtol=1e-5, atol=0)
    flat.length_rule = None  # a real checkpoint
    with pytest.raises(ValueError, match="stand-ins only"):
        peak_logits(flat)


def test_peak_code_predictor_is_peak_logits_for_the_code_predictor():
    """The code-predictor benchmarks' own module, peaked alone, has the weights a peaked
    stand-in's code predictor has (and the talker is left alone)."""
    flat, peaked = random_models("tiny", seed=5, peaked=False), random_models("tiny", seed=5)
    talker = {k: v.clone() for k, v in flat.talker.state_dict().items()}
    before = {k: v.clone() for k, v in flat.code_predictor.state_dict().items()}
    peak_code_predictor(flat.code_predictor, flat.cfg)
    want = peaked.code_predictor.state_dict()
    got = flat.code_predictor.state_dict()
    changed = [k for k in got if not torch.equal(got[k], before[k])]
    assert any("lm_head" in k for k in changed) and any("o_proj" in k for k in changed)
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=0) for k in want)
    assert all(torch.equal(talker[k], v) for k, v in flat.talker.state_dict().items())


@pytest.mark.parametrize("greedy", [False, True])
def test_peaked_stand_in_speaks_for_its_length_rule(greedy):
    """Peaked logits do not end a stand-in early: it stops at its length rule (by characters),
    not at a repetition or silence guard, sampled and greedy."""
    models = random_models("tiny", seed=0)
    engine = EagerEngine(models, num_slots=1, max_len=512)
    over = SamplingOverrides(do_sample=False, subtalker_do_sample=False) if greedy else None
    req = SynthesisRequest(text=LONG_TEXT, voice="ryan", language="english", seed=4,
                           sampling=over or SamplingOverrides())
    _, stats = synthesize(engine, req)
    expected = models.length_rule.frames_for(LONG_TEXT, "english")
    assert expected > 60
    assert (stats["frames"], stats["stopped_by"]) == (expected, "length_rule")


def test_the_instruction_moves_the_peaked_stand_ins_logits(tiny_checkpoint):
    """The peaked stand-in depends little on its context (its residual branches are scaled
    down), but an instruction still reaches its logits."""
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.generation.generate import ReferenceModel
    from ttsbuild.generation.prompt import build_prompt
    from ttsbuild.runtime.engine import Models
    from ttsbuild.runtime.request import SynthesisRequest

    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")

    def logits(instruct):
        req = SynthesisRequest("Hi there.", voice="ryan", seed=7, instruct=instruct)
        prompt = build_prompt(models.talker, models.prompt_spec(req), models.code_predictor)
        return ReferenceModel(models.talker, models.code_predictor, 1, 512).prefill(0, prompt)[1]

    a, b = logits(None), logits("Whisper, slowly.")
    assert (a - b).abs().max() > 1e-3 * a.abs().max()
