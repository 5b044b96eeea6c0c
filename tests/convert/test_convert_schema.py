"""The computed checkpoint schema against the official model classes' state_dicts."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from conftest import DATA, tiny_base_configs
from official import import_official

from ttsbuild.convert.init_random import load_variant
from ttsbuild.convert.schema import (
    BF16,
    F32,
    model_schema,
    speech_tokenizer_schema,
    validate_config,
    validate_speech_tokenizer_config,
)

REAL = ["0.6b-customvoice", "0.6b-base", "1.7b-customvoice", "1.7b-voicedesign", "1.7b-base"]
COUNTS = {"1.7b-customvoice": 404, "1.7b-voicedesign": 404, "0.6b-customvoice": 402,
          "1.7b-base": 480, "0.6b-base": 478}


def _small(config: dict) -> dict:
    """A small config of the same structure as a real one (every branch kept)."""
    c = copy.deepcopy(config)
    t = c["talker_config"]
    t.update(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, text_hidden_size=64, text_vocab_size=1000)
    t["rope_scaling"]["mrope_section"] = [4, 2, 2]
    t["code_predictor_config"].update(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    if c["tts_model_type"] == "base":
        c["speaker_encoder_config"] = {"enc_dim": 96, "sample_rate": 24000,
                                       "enc_channels": [32, 32, 32, 32, 96],
                                       "enc_attention_channels": 16, "enc_se_channels": 16}
    return c


def _official_model_state(config: dict, meta: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    _core, models = import_official()
    cfg = models.Qwen3TTSConfig(**copy.deepcopy(config))
    cfg._attn_implementation = "sdpa"
    if meta:
        with torch.device("meta"):
            model = models.Qwen3TTSForConditionalGeneration(cfg)
    else:
        model = models.Qwen3TTSForConditionalGeneration(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _official_codec_state(st: dict, meta: bool) -> dict[str, tuple[int, ...]]:
    core, _models = import_official()
    cfg = core.Qwen3TTSTokenizerV2Config(**copy.deepcopy(st))
    if meta:
        with torch.device("meta"):
            model = core.Qwen3TTSTokenizerV2Model(cfg)
    else:
        model = core.Qwen3TTSTokenizerV2Model(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _ours(schema) -> dict[str, tuple[int, ...]]:
    return {k: s.shape for k, s in schema.items()}


@pytest.mark.parametrize("variant", ["1.7b-customvoice", "1.7b-voicedesign", "1.7b-base",
                                     "0.6b-customvoice"])
def test_small_model_schema_matches_official(variant):
    config = _small(load_variant(variant)[0])
    assert validate_config(config) == []
    assert _ours(model_schema(config)) == _official_model_state(config, meta=False)


@pytest.mark.parametrize("variant", REAL)
def test_real_model_schema_matches_official_on_meta(variant):
    config = load_variant(variant)[0]
    schema = model_schema(config)
    assert len(schema) == COUNTS[variant]  # MODEL.md
    assert list(_ours(schema).items()) == list(_official_model_state(config, meta=True).items())
    assert {s.dtype for s in schema.values()} == {BF16}


def test_tiny_variants_match_official():
    for config in (load_variant("tiny")[0], tiny_base_configs()[0]):
        assert _ours(model_schema(config)) == _official_model_state(config, meta=False)
    st = load_variant("tiny")[1]
    assert _ours(speech_tokenizer_schema(st)) == _official_codec_state(st, meta=False)


def test_speech_tokenizer_schema_matches_official_on_meta():
    st = load_variant("1.7b-customvoice")[1]
    assert validate_speech_tokenizer_config(st) == []
    schema = speech_tokenizer_schema(st)
    assert list(_ours(schema).items()) == list(_official_codec_state(st, meta=True).items())
    assert {s.dtype for s in schema.values()} == {F32}
    decoder = sum(s.numel for k, s in schema.items() if k.startswith("decoder."))
    encoder = sum(s.numel for k, s in schema.items() if k.startswith("encoder."))
    assert round(decoder / 1e6, 1) == 114.3 and round(encoder / 1e6, 1) == 56.2  # MODEL.md
    # MODEL.md: the file is 682,293,092 B; the rest is the JSON header (~116 B per tensor).
    header = 682_293_092 - sum(s.nbytes for s in schema.values())
    assert 0 < header < 200 * len(schema)


def _listing(name: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for line in (DATA / name).read_text().splitlines():
        m = re.fullmatch(r"(\S+) \(([\d, ]*)\)", line.strip())
        assert m, line
        out[m[1]] = tuple(int(x) for x in m[2].replace(" ", "").split(",") if x)
    return out


@pytest.mark.parametrize(("listing", "variant"), [
    ("0.6b-customvoice.keys.txt", "0.6b-customvoice"),
    ("1.7b-base.keys.txt", "1.7b-base"),
    ("speech_tokenizer-12hz.layer0.keys.txt", None),
])
def test_schema_agrees_with_published_key_listings(listing, variant):
    keys = _listing(listing)
    if variant is None:
        schema = _ours(speech_tokenizer_schema(load_variant("1.7b-base")[1]))
    else:
        schema = _ours(model_schema(load_variant(variant)[0]))
    for name, shape in keys.items():
        assert schema.get(name) == shape, name


def test_validate_config_reports_every_problem():
    config = json.loads(json.dumps(load_variant("1.7b-customvoice")[0]))
    config["tts_model_type"] = "mystery"
    config["tokenizer_type"] = "qwen3_tts_tokenizer_25hz"
    del config["talker_config"]["hidden_size"]
    config["talker_config"]["num_hidden_layers"] = "28"
    problems = validate_config(config)
    text = "\n".join(problems)
    assert "unknown tts_model_type 'mystery'" in text
    assert "unknown tokenizer_type 'qwen3_tts_tokenizer_25hz'" in text
    assert "'talker_config.hidden_size' is missing" in text
    assert "'talker_config.num_hidden_layers' must be int" in text
    assert len(problems) == 4


def test_speaker_ids_as_one_element_lists_are_accepted():
    config = json.loads(json.dumps(load_variant("1.7b-customvoice")[0]))
    config["talker_config"]["spk_id"]["ryan"] = [3061]
    assert validate_config(config) == []
    config["talker_config"]["spk_id"]["ryan"] = [3061, 3062]
    assert any("spk_id['ryan']" in p for p in validate_config(config))
