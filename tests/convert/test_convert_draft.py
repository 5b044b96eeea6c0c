"""`ttsbuild convert --draft`: a draft that fits ships in the checkpoint; one whose shapes,
vocabulary or format do not fit is refused with a clear error and nothing is written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ttsbuild.cli import app
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.model.config import ModelConfig
from ttsbuild.runtime.draft import DRAFT_FILE, draft_metadata, draft_shape, read_draft, write_draft


@pytest.fixture
def target(tiny_checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    return root, ModelConfig.from_official(load_checkpoint(root).config)


def _heads(shape, seed=0):
    return 0.02 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(*args):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


def test_a_fitting_draft_is_attached(target, tmp_path):
    root, cfg = target
    heads = _heads(draft_shape(cfg))
    write_draft(tmp_path / "d.safetensors", heads, cfg, window=3)
    result = _run(root, "--draft", tmp_path / "d.safetensors")
    assert result.exit_code == 0, result.output
    ckpt = load_checkpoint(root)  # the manifest lists the draft with its hash
    assert DRAFT_FILE in ckpt.manifest["files"] and ckpt.manifest["draft"]["window"] == "3"
    loaded, _ = read_draft(root / DRAFT_FILE, cfg)
    assert torch.equal(loaded, heads)


def _bad_drafts(cfg, tmp_path):
    G, V, H = draft_shape(cfg)
    meta = draft_metadata(cfg, 2)
    cases = {
        "shape": ({"heads.weight": _heads((G, V, H + 8))}, meta, "needs"),
        "vocab": ({"heads.weight": _heads((G, V // 2, H))},
                  {**meta, "codebook_size": str(V // 2)}, "codebook_size 1024"),
        "groups": ({"heads.weight": _heads((G - 1, V, H))},
                   {**meta, "num_code_groups": str(G)}, "num_code_groups"),
        "format": ({"heads.weight": _heads((G, V, H))}, {"format": "pt"}, "not a ttsbuild draft"),
        "extra": ({"heads.weight": _heads((G, V, H)), "bias": torch.zeros(3)}, meta,
                  "exactly one tensor"),
        "nan": ({"heads.weight": _heads((G, V, H)).index_fill(0, torch.tensor([2]), float("nan"))},
                meta, "non-finite"),
        "dtype": ({"heads.weight": torch.zeros((G, V, H), dtype=torch.int32)}, meta, "dtype"),
    }  # fmt: skip
    for name, (tensors, m, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=m)
        yield name, path, message
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    yield "garbage", garbage, "not a readable safetensors"
    yield "missing", tmp_path / "none.safetensors", "does not exist"


def test_drafts_that_do_not_fit_are_refused(target, tmp_path):
    root, cfg = target
    manifest = (root / "manifest.json").read_text()
    for name, path, message in _bad_drafts(cfg, tmp_path):
        result = _run(root, "--draft", path)
        assert result.exit_code == 1, (name, result.output)
        assert message in " ".join(result.output.split()), (name, result.output)
        assert "Traceback" not in result.output
        assert (root / "manifest.json").read_text() == manifest  # nothing changed
        assert not (root / DRAFT_FILE).exists()


def test_convert_with_a_bad_draft_writes_nothing(tmp_path):
    from ttsbuild.convert.init_random import init_random

    init_random(tmp_path / "src", "tiny", seed=1)
    cfg = ModelConfig.from_official(json.loads((tmp_path / "src" / "config.json").read_text()))
    G, V, H = draft_shape(cfg)
    bad = tmp_path / "bad.safetensors"
    save_file({"heads.weight": _heads((G, V, 2 * H))}, str(bad), metadata=draft_metadata(cfg, 2))
    result = _run(tmp_path / "src", "-o", tmp_path / "out", "--draft", bad)
    assert result.exit_code == 1 and "needs" in result.output
    assert not (tmp_path / "out").exists()
    good = tmp_path / "good.safetensors"
    write_draft(good, _heads((G, V, H)), cfg, window=2)
    result = _run(tmp_path / "src", "-o", tmp_path / "out", "--draft", good)
    assert result.exit_code == 0, result.output
    assert DRAFT_FILE in load_checkpoint(tmp_path / "out").manifest["files"]
