"""`ttsbuild distill-draft`: trains draft heads in the documented layout, and a run stopped
part-way and resumed from its checkpoint ends exactly where an uninterrupted run does."""

import torch
from safetensors import safe_open
from typer.testing import CliRunner

from ttsbuild.build.distill import DistillConfig, checkpoint_paths, distill_draft
from ttsbuild.build.spec_choice import draft_acceptance
from ttsbuild.cli import app
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.draft import read_draft
from ttsbuild.runtime.engine import Models

TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue."]


def _heads(path, cfg):
    return read_draft(path, cfg)[0]


def test_resume_continues_to_the_same_draft(tiny_checkpoint, tmp_path):
    models = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    common = dict(window=3, batch_frames=16, eval_every=2, max_frames=16, num_texts=2)
    whole = distill_draft(models, tmp_path / "whole.safetensors",
                          DistillConfig(steps=6, **common), TEXTS, "cpu")  # fmt: skip
    part = tmp_path / "part.safetensors"
    distill_draft(models, part, DistillConfig(steps=4, **common), TEXTS, "cpu")
    state, data = checkpoint_paths(part)
    assert state.is_file() and data.is_file()
    with safe_open(str(state), framework="pt") as f:
        assert f.metadata()["step"] == "4"
    resumed = distill_draft(models, part, DistillConfig(steps=6, **common), TEXTS, "cpu",
                            resume=True)  # fmt: skip
    assert resumed["steps"] == whole["steps"] == 6
    a, b = _heads(part, models.cfg), _heads(tmp_path / "whole.safetensors", models.cfg)
    assert torch.equal(a, b)
    # it trained: the heads moved away from the target's own (the self-speculative draft)
    target = torch.stack([h.weight for h in models.code_predictor.lm_head])
    assert not torch.allclose(a, target)
    assert len(resumed["acceptance"]) == 3 and all(0 < x <= 1 for x in resumed["acceptance"])
    # both acceptances are in the draft for `compile --speculative auto`
    with safe_open(str(part), framework="pt") as f:
        recorded = draft_acceptance(f.metadata())
    assert recorded == {"draft": [round(a, 4) for a in resumed["acceptance"]],
                        "self": [round(a, 4) for a in resumed["self_speculative"]]}


def test_resume_with_other_settings_is_refused(tiny_checkpoint, tmp_path):
    out = tmp_path / "d.safetensors"
    args = ["distill-draft", str(tiny_checkpoint), "-o", str(out), "--num-texts", "1",
            "--max-frames", "14", "--steps", "2", "--eval-every", "1", "--batch-frames", "8",
            "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "expected acceptance per depth" in result.output
    out = " ".join(result.output.split())
    assert "compile --speculative auto would choose: " in out
    assert "compile --speculative auto --speculative-exact would choose: " in out
    result = CliRunner().invoke(app, [*args[:-6], "--steps", "4", "--eval-every", "1",
                                      "--batch-frames", "16", "--device", "cpu", "--resume"])
    assert result.exit_code == 1 and "other settings (batch_frames)" in result.output
