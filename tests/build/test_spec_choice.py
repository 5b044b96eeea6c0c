"""compile --speculative auto: the expected frame time from a draft's recorded acceptance."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from ttsbuild.build.compile import BuildConfig, compile_engine_dir
from ttsbuild.build.engine_dir import load_engine_dir
from ttsbuild.build.spec_choice import (
    MIN_GAIN,
    choose,
    draft_acceptance,
    exact_acceptance,
    expected_frame_ms,
    expected_rounds,
    plain_frame_ms,
)
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.model.config import ModelConfig
from ttsbuild.runtime.draft import attach_draft, draft_shape, write_draft

from .conftest import QUICK


def simulate_rounds(acceptance, window, rng, frames=20000, codes=14) -> float:
    """Rounds per frame, drawn: each draft accepted with its depth's probability in turn."""
    total = 0
    for _ in range(frames):
        left = codes
        while left > 0:
            accepted = 0
            while accepted < window and rng.random() < acceptance[accepted]:
                accepted += 1
            left -= accepted + 1
            total += 1
    return total / frames


@pytest.mark.parametrize("window", [1, 3, 4])
def test_expected_rounds_match_drawn_rounds(window):
    rng = np.random.default_rng()
    acceptance = list(rng.uniform(0.2, 0.9, size=window))
    want = simulate_rounds(acceptance, window, rng)
    got = expected_rounds(acceptance, window)
    assert abs(got - want) / want < 0.02, (acceptance, got, want)


def test_expected_rounds_at_the_ends():
    assert expected_rounds([0.0, 0.0, 0.0], 3) == pytest.approx(14.0)  # one code a round
    for window in (1, 2, 3, 4):
        assert expected_rounds([1.0] * window, window) == pytest.approx(
            math.ceil(14 / (window + 1)))
    with pytest.raises(ValueError, match="depths 1..3"):
        expected_rounds([0.5, 0.5], 3)
    with pytest.raises(ValueError, match="within"):
        expected_rounds([0.5, 1.5], 2)


def test_choose_turns_speculation_on_only_where_it_is_expected_faster():
    high = choose({"self": [0.9, 0.85, 0.8, 0.75], "draft": [0.3, 0.3, 0.3, 0.3]})
    assert high.kind == "self" and high.plan() == {1: ("self", high.window)}
    assert high.expected_ms == pytest.approx(min(high.considered.values()), abs=1e-4)
    assert high.expected_ms == expected_frame_ms([0.9, 0.85, 0.8, 0.75], high.window)
    assert high.expected_ms < (1 - MIN_GAIN) * plain_frame_ms()
    # the engine stand-in's self draft (acceptance_cpu.py: 0.07 / 0.07 / 0.00): off, and the
    # model agrees with the engine's measured 3.31 ms against 1.90 there
    low = choose({"self": [0.07, 0.07, 0.0]})
    assert low.kind is None and low.plan() == {}
    assert min(low.considered.values()) > 1.4 * plain_frame_ms()
    # the window is capped by what the draft was trained for
    assert max(int(k.split("=")[1]) for k in choose({"self": [0.9] * 6}, 2).considered) == 2


def test_draft_acceptance_reads_distill_metadata():
    meta = {"acceptance": "[0.5, 0.4]", "self_acceptance": "[0.3, 0.2]", "window": "2"}
    assert draft_acceptance(meta) == {"draft": [0.5, 0.4], "self": [0.3, 0.2]}
    assert draft_acceptance({"window": "2"}) == {}
    for bad in ("[0.5, 1.4]", "not json", "[]"):
        with pytest.raises(ValueError, match="acceptance"):
            draft_acceptance({"acceptance": bad})


@pytest.fixture
def ckpt_draft(ckpt, tmp_path):
    def make(**info):
        root = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(ckpt, root)
        cfg = ModelConfig.from_official(load_checkpoint(root).config)
        heads = 0.05 * torch.randn(draft_shape(cfg))
        write_draft(tmp_path / "d.safetensors", heads, cfg, window=4, **info)
        attach_draft(root, tmp_path / "d.safetensors")
        return root
    return make


def test_compile_auto_decides_from_the_drafts_acceptance(ckpt_draft, tmp_path):
    root = ckpt_draft(acceptance=json.dumps([0.9, 0.85, 0.8, 0.75]),
                      self_acceptance=json.dumps([0.1, 0.05, 0.0, 0.0]))
    lines = []
    compile_engine_dir(root, tmp_path / "on", BuildConfig(
        precision="bf16", onnx=False, speculative_auto=True, **QUICK), log=lines.append)
    plan = load_engine_dir(tmp_path / "on").manifest.plan
    assert set(plan.speculative) == {1} and plan.speculative[1][0] == "draft"
    assert any("speculation on at batch 1: draft" in line for line in lines), lines
    # bucket 1 only: sampled codes depend on the load, and compile says so
    assert any("reproducible only at the same load" in line for line in lines), lines
    root = ckpt_draft(acceptance=json.dumps([0.2, 0.1, 0.1, 0.0]))
    compile_engine_dir(root, tmp_path / "off", BuildConfig(
        precision="bf16", onnx=False, speculative_auto=True, **QUICK))
    assert load_engine_dir(tmp_path / "off").manifest.plan.speculative == {}
    # asked for exact match too: decided off, it compiles (no drafts to verify)
    compile_engine_dir(root, tmp_path / "off-exact", BuildConfig(
        precision="bf16", onnx=False, speculative_auto=True, speculative_exact=True, **QUICK))
    plan = load_engine_dir(tmp_path / "off-exact").manifest.plan
    assert plan.speculative == {} and not plan.speculative_exact


def test_compile_auto_needs_a_recorded_acceptance(ckpt, ckpt_draft, tmp_path):
    for root, message in ((ckpt, "ships none"), (ckpt_draft(), "records no acceptance")):
        with pytest.raises(ValueError, match=message):
            compile_engine_dir(root, tmp_path / "e", BuildConfig(
                precision="bf16", onnx=False, speculative_auto=True, **QUICK))
        assert not (tmp_path / "e").exists()


def test_cli_auto_without_a_draft_is_a_clear_error(ckpt, tmp_path):
    from typer.testing import CliRunner

    from ttsbuild.cli import app

    result = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(tmp_path / "e"),
                                      "--max-batch", "8", "--speculative", "auto"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1 and "--speculative auto decides from the acceptance" in out, out
    assert not (tmp_path / "e").exists()


def test_exact_acceptance_is_the_coupling_bound_and_can_turn_speculation_off():
    """exact_acceptance: a / (2 - a) (shared-noise coupling's (1 - TV) / (1 + TV)), below the
    standard rule's a except at 0 and 1; a draft that pays under the standard rule may not
    pay verified by exact match, and a plan asking for it records it."""
    acc = [0.0, 0.3, 0.62, 1.0]
    assert exact_acceptance(acc) == pytest.approx([0.0, 0.3 / 1.7, 0.62 / 1.38, 1.0])
    standard = [0.64, 0.62, 0.6, 0.58]
    assert choose({"self": standard}).kind == "self"
    assert choose({"self": exact_acceptance(standard)}).kind is None
    assert choose({"self": standard}, exact=True) == choose({"self": exact_acceptance(standard)})
    assert choose({"self": exact_acceptance([0.95] * 4)}).kind == "self"
    plan = BuildConfig(speculative={1: ("self", 3)}, speculative_exact=True).runtime_plan()
    assert plan.speculative_exact and not plan.load_dependent_samples


def test_cli_speculative_exact_reaches_the_plan(ckpt, tmp_path):
    from typer.testing import CliRunner

    from ttsbuild.cli import app

    args = ["compile", str(ckpt), "-o", str(tmp_path / "e"), "--precision", "bf16", "--no-onnx",
            "--max-batch", "8", "--max-frames", "256", "--max-len", "512", "--quality-texts",
            "2", "--quality-frames", "6", "--speculative", "1:self:2", "--speculative-exact"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = load_engine_dir(tmp_path / "e").manifest.plan
    assert plan.speculative == {1: ("self", 2)} and plan.speculative_exact
    assert "reproducible only at the same load" not in result.output
    alone = [*args[:-3], "--force", "--speculative-exact"]  # no --speculative
    result = CliRunner().invoke(app, alone)
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "--speculative-exact says how drafts are verified" in out, out
    assert load_engine_dir(tmp_path / "e").manifest.plan.speculative_exact  # left as it was
