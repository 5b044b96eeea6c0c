"""`ttsbuild init-random`: a random-weight stand-in checkpoint in the official layout.

The directory looks exactly like a published Qwen3-TTS repo (the official classes load it),
with the stand-in BPE tokenizer (`ttsbuild.text.standin`) and one extra file,
`ttsbuild_standin.json`, that marks it as a stand-in and carries its length rule.

Length rule. Random weights never choose EOS, so generation for a stand-in stops after

    frames = clamp(expected_frames(text, language), min_frames, max_frames)

the frames (12.5 per second) a typical reader takes to read the request's text aloud: the
speaking-rate model of `ttsbuild.generation.guards` (about 15 characters per second of
English, by characters and script, with its sources). Counting characters, not stand-in
tokens, keeps the length realistic: the 3k-token stand-in tokenizer splits unfamiliar words
into many pieces. `min_frames` (1 s) keeps one-word requests audible, `max_frames` (2 min)
bounds long ones. Format 1 records (a rule by text tokens) load with the same rule.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import torch

from ttsbuild.convert.io import atomic_output_dir, write_json, write_safetensors
from ttsbuild.convert.schema import (
    F32,
    TensorSpec,
    model_schema,
    speech_tokenizer_schema,
    validate_config,
    validate_speech_tokenizer_config,
)
from ttsbuild.convert.variants import VARIANTS
from ttsbuild.text.standin import write_standin_tokenizer

STANDIN_FILE = "ttsbuild_standin.json"
STANDIN_FORMAT = 2
LENGTH_RULE = {"frames": "speaking_rate", "min_frames": 13, "max_frames": 1500}
INIT_STD = 0.02

# Inferred: the published files' exact contents are not known here; these are what the
# official loaders need (an Encodec-style feature extractor for the speech tokenizer).
SPEECH_TOKENIZER_PREPROCESSOR = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}
PREPROCESSOR = {"processor_class": "Qwen3TTSProcessor"}
CONFIGURATION = {"framework": "pytorch", "task": "text-to-speech", "allow_remote": True}


class InitRandomError(ValueError):
    pass


def load_variant(variant: str) -> tuple[dict, dict, dict]:
    """(config, speech tokenizer config, generation config) of a shipped variant."""
    if variant not in VARIANTS:
        raise InitRandomError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    files = resources.files("ttsbuild.convert.variants")
    cfg_name, st_name = VARIANTS[variant]
    config = json.loads(files.joinpath(cfg_name).read_text(encoding="utf-8"))
    st = json.loads(files.joinpath(st_name).read_text(encoding="utf-8"))
    gen = json.loads(files.joinpath("generation_config.json").read_text(encoding="utf-8"))
    return config, st, gen


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic per (seed, tensor name), independent of the order tensors are made in."""
    dtype = torch.bfloat16 if spec.dtype == "BF16" else torch.float32
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=dtype)
    if spec.init == "const":
        return torch.full(spec.shape, spec.value, dtype=dtype)
    gen = _generator(seed, spec.name)
    out = torch.empty(spec.shape, dtype=dtype)
    flat = out.view(-1)
    step = 1 << 24  # fill in chunks: bounded fp32 scratch for the big embeddings
    for start in range(0, flat.numel(), step):
        n = min(step, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=gen) * INIT_STD
    return out


def _codec_decoder_state(st_config: dict, seed: int) -> tuple[dict[str, torch.Tensor] | None, str]:
    try:
        from ttsbuild.model.codec import CodecConfig, random_codec_state
    except ImportError as exc:
        return None, f"ttsbuild.model.codec unavailable ({exc})"
    return random_codec_state(CodecConfig.from_official(st_config), seed), "ttsbuild.model.codec"


def init_random(dst: str | Path, variant: str, seed: int = 0, force: bool = False,
                progress=None) -> dict:
    """Write the shipped `variant` as a stand-in checkpoint to `dst` atomically.

    Returns the stand-in record. `progress(advance_bytes, total_bytes, label)` is called as
    tensors are written.
    """
    config, st_config, gen_config = load_variant(variant)
    return write_random_checkpoint(dst, config, st_config, gen_config, seed=seed,
                                   variant=variant, force=force, progress=progress)


def write_random_checkpoint(dst: str | Path, config: dict, st_config: dict, gen_config: dict,
                            seed: int = 0, variant: str = "custom", force: bool = False,
                            progress=None) -> dict:
    """Like `init_random` for any valid pair of configs (tests use custom sizes)."""
    problems = validate_config(config) + validate_speech_tokenizer_config(st_config)
    if problems:  # a shipped config is broken: a bug, not user error
        raise InitRandomError("; ".join(problems))
    model_specs = list(model_schema(config).values())
    st_specs = list(speech_tokenizer_schema(st_config).values())
    total = sum(s.nbytes for s in model_specs + st_specs)
    standin = {
        "format": STANDIN_FORMAT,
        "kind": "random-weight stand-in",
        "length_rule": dict(LENGTH_RULE),
        "seed": int(seed),
        "variant": variant,
    }

    def tick(spec: TensorSpec) -> None:
        if progress is not None:
            progress(spec.nbytes, total, spec.name)

    with atomic_output_dir(dst, force=force) as tmp:
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", gen_config)
        write_json(tmp / "preprocessor_config.json", PREPROCESSOR)
        write_standin_tokenizer(tmp)

        write_safetensors(
            tmp / "model.safetensors",
            model_specs,
            ((s.name, random_tensor(s, seed)) for s in model_specs),
            on_tensor=tick,
        )

        st_dir = tmp / "speech_tokenizer"
        st_dir.mkdir()
        write_json(st_dir / "config.json", st_config)
        write_json(st_dir / "configuration.json", CONFIGURATION)
        write_json(st_dir / "preprocessor_config.json", SPEECH_TOKENIZER_PREPROCESSOR)
        decoder_state, codec_source = _codec_decoder_state(st_config, seed)
        standin["codec_init"] = codec_source
        if decoder_state is not None:
            expected = {s.name[len("decoder."):]: s for s in st_specs
                        if s.name.startswith("decoder.")}
            extra = sorted(set(decoder_state) - set(expected))
            missing = sorted(set(expected) - set(decoder_state))
            bad = [k for k, s in expected.items()
                   if k in decoder_state and tuple(decoder_state[k].shape) != s.shape]
            if extra or missing or bad:
                raise InitRandomError(
                    f"random_codec_state does not match the official codec layout: "
                    f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {bad[:5]}")

        def st_tensors():
            for s in st_specs:
                if decoder_state is not None and s.name.startswith("decoder."):
                    t = decoder_state.pop(s.name[len("decoder."):])
                    yield s.name, t.detach().to(torch.float32 if s.dtype == F32 else t.dtype)
                else:
                    yield s.name, random_tensor(s, seed)

        write_safetensors(st_dir / "model.safetensors", st_specs, st_tensors(), on_tensor=tick)
        write_json(tmp / STANDIN_FILE, standin)
    return standin
