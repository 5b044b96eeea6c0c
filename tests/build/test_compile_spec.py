"""compile packs a checkpoint's draft and the speculative plan; the engine loads both and its
greedy codes equal speculation-off codes (CPU, eager graph backend)."""

import shutil

import pytest
import torch
from typer.testing import CliRunner

from ttsbuild.build.compile import BuildConfig, compile_engine_dir
from ttsbuild.build.engine_dir import load_engine_dir, models_from_engine
from ttsbuild.cli import app
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.model.config import ModelConfig
from ttsbuild.runtime.draft import DRAFT_FILE, attach_draft, draft_shape, write_draft

from .conftest import QUICK


@pytest.fixture
def ckpt_with_draft(ckpt, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root)
    cfg = ModelConfig.from_official(load_checkpoint(root).config)
    heads = 0.05 * torch.randn(draft_shape(cfg), generator=torch.Generator().manual_seed(2))
    write_draft(tmp_path / "d.safetensors", heads, cfg, window=3)
    attach_draft(root, tmp_path / "d.safetensors")
    return root, heads


def test_compile_packs_the_draft_and_the_plan(ckpt_with_draft, tmp_path):
    root, heads = ckpt_with_draft
    spec = {1: ("draft", 3), 2: ("self", 2)}
    out = tmp_path / "engine"
    manifest = compile_engine_dir(
        root, out, BuildConfig(precision="bf16", onnx=False, speculative=spec, **QUICK)
    )
    assert DRAFT_FILE in manifest["files"] and manifest["draft"]["window"] == "3"
    artifact = load_engine_dir(out)
    assert artifact.manifest.plan.speculative == spec
    models = models_from_engine(artifact, "cpu", decoder_layers=False)
    assert torch.equal(models.draft_heads, heads)


def test_a_draft_plan_needs_a_draft(ckpt, tmp_path):
    with pytest.raises(ValueError, match="ships none"):
        compile_engine_dir(
            ckpt,
            tmp_path / "e",
            BuildConfig(precision="bf16", onnx=False, speculative={1: ("draft", 2)}, **QUICK),
        )
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("value,message", [
    ("1:fast:2", "BUCKETS:self|draft:WINDOW"), ("3:self:2", "speculative must list batch"),
    ("1:self:9", "windows must be 1..8"),
])  # fmt: skip
def test_bad_speculative_flags_are_refused(ckpt, tmp_path, value, message):
    result = CliRunner().invoke(
        app,
        [
            "compile",
            str(ckpt),
            "-o",
            str(tmp_path / "e"),
            "--max-batch",
            "8",
            "--speculative",
            value,
        ],
    )
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "e").exists()
