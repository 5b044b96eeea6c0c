"""init-random stand-ins load through the official classes; the length rule is recorded."""

from __future__ import annotations

import json

import pytest
import torch
from official import import_official
from safetensors import safe_open
from safetensors.torch import load_file

from ttsbuild.convert.init_random import (
    LENGTH_RULE,
    VARIANTS,
    init_random,
    load_variant,
    random_tensor,
)
from ttsbuild.convert.io import OutputExistsError
from ttsbuild.convert.schema import model_schema, speech_tokenizer_schema
from ttsbuild.model.standin import INIT_STD, tensor_std
from ttsbuild.text import TextTokenizer

OFFICIAL_FILES = [
    "config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
    "vocab.json", "merges.txt", "tokenizer_config.json", "ttsbuild_standin.json",
    "speech_tokenizer/config.json", "speech_tokenizer/configuration.json",
    "speech_tokenizer/model.safetensors", "speech_tokenizer/preprocessor_config.json",
]


def test_layout_and_configs(tiny_ckpt):
    files = sorted(p.relative_to(tiny_ckpt).as_posix() for p in tiny_ckpt.rglob("*")
                   if p.is_file())
    assert files == sorted(OFFICIAL_FILES)
    config, st, gen = load_variant("tiny")
    assert json.loads((tiny_ckpt / "config.json").read_text()) == config
    assert json.loads((tiny_ckpt / "speech_tokenizer/config.json").read_text()) == st
    assert json.loads((tiny_ckpt / "generation_config.json").read_text()) == gen
    standin = json.loads((tiny_ckpt / "ttsbuild_standin.json").read_text())
    assert standin["format"] == 3 and standin["kind"] == "random-weight stand-in"
    assert standin["length_rule"] == LENGTH_RULE and standin["seed"] == 7
    assert standin["variant"] == "tiny"


def test_dtypes_and_init(tiny_ckpt):
    config = load_variant("tiny")[0]
    peaked = 0
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16, name
            if name.endswith("norm.weight"):
                assert torch.all(t == 1), name
            elif name.endswith(".bias"):
                assert torch.all(t == 0), name
            else:
                std = tensor_std(name, config)  # 0.02, or a peaked head / residual branch
                assert 0.75 * std < t.float().std().item() < 1.25 * std, name
                peaked += std != INIT_STD
    assert peaked == 2 * (2 + 2) + 1 + 15  # o/down of 2 + 2 layers, codec_head, 15 lm heads
    with safe_open(tiny_ckpt / "speech_tokenizer/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


def test_loads_in_official_classes_without_missing_or_unexpected_keys(tiny_ckpt):
    core, models = import_official()
    model = models.Qwen3TTSForConditionalGeneration.from_pretrained(
        str(tiny_ckpt), local_files_only=True, attn_implementation="sdpa")
    stored = load_file(tiny_ckpt / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name
    assert model.generate_config == load_variant("tiny")[2]

    codec, info = core.Qwen3TTSTokenizerV2Model.from_pretrained(
        str(tiny_ckpt / "speech_tokenizer"), local_files_only=True, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == []
    stored = load_file(tiny_ckpt / "speech_tokenizer/model.safetensors")
    state = codec.state_dict()
    assert set(state) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name
    # The codec is audible: random codes decode to a non-silent waveform.
    codes = torch.randint(0, 2048, (1, 16, 6))
    with torch.no_grad():
        wav = codec.decoder(codes)
    assert wav.shape[-1] == 6 * 1920
    assert wav.abs().max().item() > 1e-3


def test_tiny_base_loads_in_official_classes(tiny_base_ckpt):
    _core, models = import_official()
    model = models.Qwen3TTSForConditionalGeneration.from_pretrained(
        str(tiny_base_ckpt), local_files_only=True, attn_implementation="sdpa")
    stored = load_file(tiny_base_ckpt / "model.safetensors")
    assert set(model.state_dict()) == set(stored)
    assert any(k.startswith("speaker_encoder.") for k in stored)


def test_tokenizer_files_are_the_standin(tiny_ckpt):
    tok = TextTokenizer.from_dir(tiny_ckpt)
    assert tok.encode("<|im_start|>assistant\n")[:3] == [151644, 77091, 198]


def test_random_tensors_are_deterministic_per_name_and_seed():
    config = load_variant("tiny")[0]
    spec = model_schema(config)["talker.model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(random_tensor(spec, 3), random_tensor(spec, 3))
    assert not torch.equal(random_tensor(spec, 3), random_tensor(spec, 4))


def test_every_variant_has_a_valid_schema():
    for variant in VARIANTS:
        config, st, _ = load_variant(variant)
        assert model_schema(config) and speech_tokenizer_schema(st)


def test_refuses_non_empty_destination_and_unknown_variant(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="--force"):
        init_random(tmp_path, "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="unknown variant 'huge'"):
        init_random(tmp_path / "x", "huge")
    assert not (tmp_path / "x").exists()


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    import ttsbuild.convert.init_random as mod

    real = mod.write_safetensors
    calls = []

    def interrupt_second_file(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:  # model.safetensors written, now the codec: Ctrl-C
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "write_safetensors", interrupt_second_file)
    with pytest.raises(KeyboardInterrupt):
        init_random(tmp_path / "out" / "ckpt", "tiny")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []
