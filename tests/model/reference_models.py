"""Build the official model and ours from one small config with the same random weights."""

from __future__ import annotations

import copy
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from official import import_official  # noqa: E402

from ttsbuild.model.config import ModelConfig  # noqa: E402
from ttsbuild.model.talker import CodePredictor, Talker  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


def small_config(variant: str = "1.7b-customvoice") -> dict:
    """The published config with small stacks: same ids, speakers, languages and structure."""
    cfg = json.loads((DATA / f"{variant}.json").read_text())
    t = cfg["talker_config"]
    t.update(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        text_hidden_size=32,
    )
    t["rope_scaling"] = {"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"}
    t["code_predictor_config"].update(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return cfg


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations and well-separated logits (the default init's 0.02
    std gives near-ties that make greedy parity a coin toss on rounding)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def build_pair(cfg_dict: dict, seed: int = 0, dtype=torch.float64):
    """Returns (official Qwen3TTSForConditionalGeneration, our Talker, our CodePredictor)."""
    _, models = import_official()
    cfg_dict = copy.deepcopy(cfg_dict)
    config = models.Qwen3TTSConfig(**cfg_dict)
    config._attn_implementation = "sdpa"
    config.talker_config._attn_implementation = "sdpa"
    config.talker_config.code_predictor_config._attn_implementation = "sdpa"
    official = models.Qwen3TTSForConditionalGeneration(config).eval()
    randomize_(official, seed)
    eos = cfg_dict["talker_config"]["codec_eos_token_id"]
    with torch.no_grad():
        # Keep EOS away so greedy runs last long enough to compare (tests of EOS set it back).
        official.talker.codec_head.weight[eos].zero_()
    official = official.to(dtype)

    ours_cfg = ModelConfig.from_official(cfg_dict)
    talker, cp = Talker(ours_cfg), CodePredictor(ours_cfg)
    state = official.state_dict()
    talker_state = {
        k[len("talker.") :]: v
        for k, v in state.items()
        if k.startswith("talker.") and not k.startswith("talker.code_predictor.")
    }
    cp_state = {
        k[len("talker.code_predictor.") :]: v
        for k, v in state.items()
        if k.startswith("talker.code_predictor.")
    }
    talker.load_state_dict(talker_state, strict=True)
    cp.load_state_dict(cp_state, strict=True)
    return official, talker.to(dtype).eval(), cp.to(dtype).eval()
