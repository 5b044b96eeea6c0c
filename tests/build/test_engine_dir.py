"""Engine manifest validation: every problem is refused with a message that names it."""

from __future__ import annotations

import json
import shutil

import pytest

from ttsbuild.build import engine_dir
from ttsbuild.build.engine_dir import EngineError, load_engine_dir


@pytest.fixture
def engine_copy(bf16_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(bf16_engine, dst)
    return dst


def _edit_manifest(path, edit):
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_loads_and_prints_summary(bf16_engine, capsys):
    from rich.console import Console

    console = Console(file=None, force_terminal=False, width=120, record=True)
    art = load_engine_dir(bf16_engine, "cpu", console=console)
    text = console.export_text()
    assert "ttsbuild-engine v2" in text and "bf16" in text and "any (cpu)" in text
    assert art.manifest.plan.batch_buckets == (1, 2, 4, 8)  # the plan compile wrote
    assert art.manifest.precision == "bf16"
    assert set(art.manifest.files) >= {"talker.safetensors", "codec.onnx", "tokenizer/vocab.json"}


def test_wrong_format_version(engine_copy):
    _edit_manifest(engine_copy, lambda m: m.update(format_version=1, new_field=1))
    with pytest.raises(EngineError, match="format version 1 is not supported.*version 2"):
        load_engine_dir(engine_copy)


def test_not_an_engine(engine_copy):
    _edit_manifest(engine_copy, lambda m: m.update(format="ttsbuild-checkpoint"))
    with pytest.raises(EngineError, match="not a ttsbuild engine"):
        load_engine_dir(engine_copy)


def test_unknown_keys(engine_copy):
    def edit(m):
        m["turbo"] = True
        m["plan"]["warp_size"] = 32

    _edit_manifest(engine_copy, edit)
    with pytest.raises(EngineError, match=r"plan\.warp_size: unknown key; turbo: unknown key"):
        load_engine_dir(engine_copy)


def test_tampered_file(engine_copy):
    with open(engine_copy / "codec.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(EngineError, match="codec.safetensors does not match its sha256"):
        load_engine_dir(engine_copy)


def test_missing_file(engine_copy):
    (engine_copy / "tokenizer" / "merges.txt").unlink()
    with pytest.raises(EngineError, match="tokenizer/merges.txt is missing"):
        load_engine_dir(engine_copy)


def test_missing_manifest(engine_copy):
    (engine_copy / "manifest.json").unlink()
    with pytest.raises(EngineError, match="manifest.json is missing"):
        load_engine_dir(engine_copy)


def test_wrong_arch_on_faked_gpu(engine_copy, monkeypatch):
    _edit_manifest(engine_copy, lambda m: m["target"].update(arch="sm_90", device_name="H200"))
    monkeypatch.setattr(engine_dir, "device_arch", lambda device: "sm_80")
    with pytest.raises(EngineError, match="built for sm_90, this GPU is sm_80"):
        load_engine_dir(engine_copy, "cpu")
    monkeypatch.setattr(engine_dir, "device_arch", lambda device: "sm_90")
    load_engine_dir(engine_copy, "cpu")  # the matching GPU accepts it


def test_cpu_accepts_any_arch(engine_copy):
    _edit_manifest(engine_copy, lambda m: m["target"].update(arch="sm_90"))
    load_engine_dir(engine_copy, "cpu")
    engine_dir.check_target("any", "sm_80")  # a CPU-compiled engine holds nothing arch-specific
