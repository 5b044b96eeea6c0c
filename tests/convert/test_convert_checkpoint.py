"""`ttsbuild convert`: accepts official layouts, rejects broken ones with every problem named,
never leaves partial output; `load_checkpoint` round trip and tamper detection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ttsbuild.convert.checkpoint import CheckpointError, load_checkpoint
from ttsbuild.convert.cli import convert as convert_cmd
from ttsbuild.convert.cli import init_random as init_random_cmd
from ttsbuild.convert.convert import ConversionError, convert_checkpoint

TALKER_Q = "talker.model.layers.0.self_attn.q_proj.weight"


def _copy(src, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _edit_model(ckpt, fn, file="model.safetensors"):
    tensors = load_file(ckpt / file)
    fn(tensors)
    save_file(tensors, ckpt / file, metadata={"format": "pt"})


def _assert_nothing_written(tmp_path):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _reject(src, tmp_path) -> list[str]:
    with pytest.raises(ConversionError) as exc:
        convert_checkpoint(src, tmp_path / "out")
    _assert_nothing_written(tmp_path)
    return exc.value.problems


def test_convert_tiny_and_round_trip(tiny_ckpt, tiny_converted):
    ck = load_checkpoint(tiny_converted)
    m = ck.manifest
    assert m["format"] == "ttsbuild-checkpoint" and m["format_version"] == 1
    assert m["variant"]["tts_model_type"] == "custom_voice"
    assert m["speakers"]["eric"] == {"id": 2875, "dialect": "sichuan_dialect"}
    assert m["speakers"]["ryan"] == {"id": 3061, "dialect": None}
    assert m["languages"]["english"] == 2050
    assert m["special_ids"]["codec"] == {"pad": 2148, "bos": 2149, "eos": 2150, "think": 2154,
                                         "nothink": 2155, "think_bos": 2156, "think_eos": 2157}
    assert m["special_ids"]["text"] == {"im_start": 151644, "im_end": 151645,
                                        "assistant": 77091, "newline": 198, "tts_pad": 151671,
                                        "tts_bos": 151672, "tts_eos": 151673}
    assert m["sampling"]["top_k"] == 50 and m["sampling"]["temperature"] == 0.9
    assert ck.is_standin and m["standin"]["length_rule"]["min_frames"] > 0
    assert set(m["source"]["files"]) >= {"model.safetensors", "config.json",
                                         "speech_tokenizer/model.safetensors"}
    assert (tiny_converted / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes()
    assert ck.config == json.loads((tiny_ckpt / "config.json").read_text())
    assert ck.codec_config == json.loads((tiny_ckpt / "speech_tokenizer/config.json").read_text())
    assert (ck.tokenizer_dir / "vocab.json").is_file()
    assert ck.modules == ["talker", "code_predictor", "codec", "codec_encoder"]

    source = load_file(tiny_ckpt / "model.safetensors")
    talker, cp = ck.tensors("talker"), ck.tensors("code_predictor")
    assert "model.layers.0.self_attn.q_proj.weight" in talker
    assert "model.codec_embedding.weight" in talker and "codec_head.weight" in talker
    assert "text_projection.linear_fc1.weight" in talker
    assert "lm_head.14.weight" in cp and "model.codec_embedding.0.weight" in cp
    assert "small_to_mtp_projection.weight" in cp
    assert len(talker) + len(cp) == len(source)
    for name, t in source.items():
        if name.startswith("talker.code_predictor."):
            got = cp[name[len("talker.code_predictor."):]]
        else:
            got = talker[name[len("talker."):]]
        assert got.dtype == torch.bfloat16 and torch.equal(got, t), name
    codec_src = load_file(tiny_ckpt / "speech_tokenizer/model.safetensors")
    codec, enc = ck.tensors("codec"), ck.tensors("codec_encoder")
    assert len(codec) + len(enc) == len(codec_src)
    for name, t in codec_src.items():
        prefix, _, rest = name.partition(".")
        got = (codec if prefix == "decoder" else enc)[rest]
        assert got.dtype == torch.float32 and torch.equal(got, t), name
    with pytest.raises(KeyError, match="no speaker_encoder"):
        ck.tensors("speaker_encoder")


def test_convert_base_keeps_speaker_encoder(tiny_base_ckpt, tmp_path):
    m = convert_checkpoint(tiny_base_ckpt, tmp_path / "out")
    assert m["variant"]["has_speaker_encoder"] and m["speakers"] == {}
    se = load_checkpoint(tmp_path / "out").tensors("speaker_encoder")
    assert "fc.weight" in se and "blocks.0.conv.weight" in se
    source = load_file(tiny_base_ckpt / "model.safetensors")
    assert len(se) == sum(k.startswith("speaker_encoder.") for k in source)


def test_rejects_missing_tensor(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    _edit_model(src, lambda t: t.pop(TALKER_Q))
    problems = _reject(src, tmp_path)
    assert problems == [f"model.safetensors: missing tensor {TALKER_Q} "
                        "(expected shape [128, 128], BF16)"]


def test_rejects_wrong_shape(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    _edit_model(src, lambda t: t.update({TALKER_Q: torch.zeros(128, 64, dtype=torch.bfloat16)}))
    assert _reject(src, tmp_path) == [
        f"model.safetensors: tensor {TALKER_Q} has shape [128, 64], expected [128, 128]"]


def test_rejects_wrong_dtype(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    _edit_model(src, lambda t: t.update({TALKER_Q: t[TALKER_Q].float()}))
    assert _reject(src, tmp_path) == [
        f"model.safetensors: tensor {TALKER_Q} has dtype F32, expected BF16"]


def test_rejects_unexpected_tensor(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    _edit_model(src, lambda t: t.update({"talker.extra.weight": torch.zeros(2)}))
    assert _reject(src, tmp_path) == ["model.safetensors: unexpected tensor talker.extra.weight"]


def test_rejects_truncated_file(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    path = src / "speech_tokenizer" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    (problem,) = _reject(src, tmp_path)
    assert problem.startswith("speech_tokenizer/model.safetensors: file is truncated")


def test_rejects_garbage_file(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    (problem,) = _reject(src, tmp_path)
    assert "model.safetensors" in problem and "corrupt" in problem


def test_rejects_missing_speech_tokenizer(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    shutil.rmtree(src / "speech_tokenizer")
    assert _reject(src, tmp_path) == ["speech_tokenizer/ directory is missing (the codec)"]


def test_rejects_unknown_variant(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["tts_model_type"] = "singing"
    (src / "config.json").write_text(json.dumps(config))
    assert _reject(src, tmp_path) == [
        "config.json: unknown tts_model_type 'singing' (known: custom_voice, voice_design, base)"]


def test_rejects_unknown_tokenizer_type(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["tokenizer_type"] = "qwen3_tts_tokenizer_25hz"
    (src / "config.json").write_text(json.dumps(config))
    (problem,) = _reject(src, tmp_path)
    assert "unknown tokenizer_type 'qwen3_tts_tokenizer_25hz'" in problem


def test_reports_all_problems_at_once(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)

    def damage(t):
        t.pop(TALKER_Q)
        t["talker.codec_head.weight"] = torch.zeros(3072, 64, dtype=torch.bfloat16)
        t["talker.model.norm.weight"] = t["talker.model.norm.weight"].half()

    _edit_model(src, damage)
    (src / "merges.txt").unlink()
    shutil.rmtree(src / "speech_tokenizer")
    problems = _reject(src, tmp_path)
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert f"missing tensor {TALKER_Q}" in text
    assert "talker.codec_head.weight has shape [3072, 64], expected [3072, 128]" in text
    assert "talker.model.norm.weight has dtype F16, expected BF16" in text
    assert "tokenizer files missing: merges.txt" in text
    assert "speech_tokenizer/ directory is missing" in text


def test_interrupted_conversion_leaves_nothing(tiny_ckpt, tmp_path, monkeypatch):
    import ttsbuild.convert.convert as mod

    real, calls = mod.write_safetensors, []

    def interrupt_third_file(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "write_safetensors", interrupt_third_file)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny_ckpt, tmp_path / "out")
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


def test_refuses_existing_output_unless_forced(tiny_ckpt, tiny_converted, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        convert_checkpoint(tiny_ckpt, out)
    convert_checkpoint(tiny_ckpt, out, force=True)
    assert not (out / "old.txt").exists()
    assert load_checkpoint(out).manifest["files"] == load_checkpoint(tiny_converted).manifest[
        "files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_load_checkpoint_detects_tampering(tiny_converted, tmp_path):
    ck = _copy(tiny_converted, tmp_path)
    data = bytearray((ck / "talker.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (ck / "talker.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="talker.safetensors does not match its sha256"):
        load_checkpoint(ck)
    load_checkpoint(ck, verify_hashes=False)  # explicit opt-out still opens it


def test_load_checkpoint_rejects_bad_manifest(tiny_converted, tmp_path):
    ck = _copy(tiny_converted, tmp_path)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["format_version"] = 99
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version 99 is not supported"):
        load_checkpoint(ck)
    (ck / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(ck)
    with pytest.raises(CheckpointError, match="is not a ttsbuild checkpoint"):
        (ck / "manifest.json").write_text('{"format": "other"}')
        load_checkpoint(ck)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("convert")(convert_cmd)
    app.command("init-random")(init_random_cmd)
    return app


def test_cli_reports_problems_without_traceback(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path)
    shutil.rmtree(src / "speech_tokenizer")
    _edit_model(src, lambda t: t.pop(TALKER_Q))
    result = CliRunner().invoke(_app(), ["convert", str(src), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    out = result.output
    assert "2 problems" in out and "speech_tokenizer/ directory is missing" in out
    assert "Traceback" not in out and not isinstance(result.exception, ConversionError)
    _assert_nothing_written(tmp_path)


def test_cli_init_random_and_convert(tmp_path):
    runner = CliRunner()
    result = runner.invoke(_app(), ["init-random", str(tmp_path / "s"), "--variant", "tiny",
                                    "--seed", "2"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(_app(), ["init-random", str(tmp_path / "s"), "--variant", "tiny"])
    assert result.exit_code == 1 and "not empty" in result.output
    result = runner.invoke(_app(), ["init-random", str(tmp_path / "t"), "--variant", "9b"])
    assert result.exit_code == 2 and "unknown variant '9b'" in result.output
    result = runner.invoke(_app(), ["convert", str(tmp_path / "s"), "-o", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert load_checkpoint(tmp_path / "c").standin["seed"] == 2


RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from ttsbuild.convert.convert import convert_checkpoint
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = peak()
    convert_checkpoint(sys.argv[1], sys.argv[2])
    print(json.dumps({"before": before, "after": peak()}))
""")


def test_conversion_memory_is_bounded_by_one_tensor(tmp_path):
    """Peak RSS growth while converting stays far below the checkpoint size."""
    from conftest import tiny_base_configs

    from ttsbuild.convert.init_random import write_random_checkpoint
    from ttsbuild.convert.schema import model_schema

    config, st, gen = tiny_base_configs()
    config["tts_model_type"] = "custom_voice"
    t = config["talker_config"]
    t.update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=128, text_vocab_size=8192,
             text_hidden_size=1024)
    t["rope_scaling"]["mrope_section"] = [24, 20, 20]
    src = tmp_path / "medium"
    write_random_checkpoint(src, config, st, gen, seed=1)
    specs = model_schema(config).values()
    total = sum(s.nbytes for s in specs)
    largest = max(s.nbytes for s in specs)
    assert total > 200e6 and largest < 20e6
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = rss["after"] - rss["before"]
    assert growth < 4 * largest + 48e6, (growth, total, largest)
    assert growth < total / 3, (growth, total)
