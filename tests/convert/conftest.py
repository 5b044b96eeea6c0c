"""Shared fixtures: stand-in checkpoints written once per test session."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

DATA = pathlib.Path(__file__).resolve().parent / "data"


def tiny_base_configs() -> tuple[dict, dict, dict]:
    """The tiny variant as a Base (voice clone) model with a small speaker encoder."""
    from ttsbuild.convert.init_random import load_variant

    config, st, gen = load_variant("tiny")
    config = json.loads(json.dumps(config))
    config["tts_model_type"] = "base"
    config["talker_config"]["spk_id"] = {}
    config["talker_config"]["spk_is_dialect"] = {}
    config["speaker_encoder_config"] = {
        "enc_dim": config["talker_config"]["hidden_size"],
        "sample_rate": 24000,
        "enc_channels": [64, 64, 64, 64, 192],
        "enc_attention_channels": 32,
        "enc_se_channels": 32,
    }
    return config, st, gen


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> pathlib.Path:
    from ttsbuild.convert.init_random import init_random

    d = tmp_path_factory.mktemp("standins") / "tiny"
    init_random(d, "tiny", seed=7)
    return d


@pytest.fixture(scope="session")
def tiny_base_ckpt(tmp_path_factory) -> pathlib.Path:
    from ttsbuild.convert.init_random import write_random_checkpoint

    d = tmp_path_factory.mktemp("standins") / "tiny-base"
    write_random_checkpoint(d, *tiny_base_configs(), seed=5, variant="tiny-base")
    return d


@pytest.fixture(scope="session")
def tiny_converted(tiny_ckpt, tmp_path_factory) -> pathlib.Path:
    from ttsbuild.convert.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("converted") / "tiny"
    convert_checkpoint(tiny_ckpt, d)
    return d
