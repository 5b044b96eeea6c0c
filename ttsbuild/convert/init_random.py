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

Logits (format 3). Stand-ins are peaked by default (`ttsbuild.model.standin`): the heads and
the residual branches are drawn with the stds that give trained-model-like next-code
distributions and FP8 robustness (`peaked=False`, `init-random --flat-logits`: every tensor
N(0, 0.02) as before). The record's `logits` says how, with the sharpness expected from the
construction and, where measured (`measure`), the stand-in's own: mean top-1 probability and
entropy of its codebook-0 and codebook-1..15 logits while it speaks a few shipped texts.
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
from ttsbuild.model.standin import (
    INIT_STD,
    LOGIT_STD,
    expected_sharpness,
    measure_sharpness,
    record,
    tensor_std,
)
from ttsbuild.text.standin import write_standin_tokenizer

STANDIN_FILE = "ttsbuild_standin.json"
STANDIN_FORMAT = 3  # 3: the logits record
LENGTH_RULE = {"frames": "speaking_rate", "min_frames": 13, "max_frames": 1500}

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


def random_tensor(spec: TensorSpec, seed: int, std: float = INIT_STD) -> torch.Tensor:
    """Deterministic per (seed, tensor name), independent of the order tensors are made in;
    random ones N(0, std)."""
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
        flat[start:start + n] = torch.randn(n, generator=gen) * std
    return out


def _codec_decoder_state(st_config: dict, seed: int) -> tuple[dict[str, torch.Tensor] | None, str]:
    try:
        from ttsbuild.model.codec import CodecConfig, random_codec_state
    except ImportError as exc:
        return None, f"ttsbuild.model.codec unavailable ({exc})"
    return random_codec_state(CodecConfig.from_official(st_config), seed), "ttsbuild.model.codec"


def init_random(dst: str | Path, variant: str, seed: int = 0, force: bool = False,
                progress=None, peaked: bool = True, measure: bool | None = None,
                device: str | None = None) -> dict:
    """Write the shipped `variant` as a stand-in checkpoint to `dst` atomically.

    Returns the stand-in record. `progress(advance_bytes, total_bytes, label)` is called as
    tensors are written. measure: run the stand-in on `device` (default: cuda if present)
    and record its sharpness (None: when a GPU is present; eager generation on a CPU takes
    ~10 s even for the tiny stand-in).
    """
    config, st_config, gen_config = load_variant(variant)
    return write_random_checkpoint(dst, config, st_config, gen_config, seed=seed,
                                   variant=variant, force=force, progress=progress,
                                   peaked=peaked, measure=measure, device=device)


def write_random_checkpoint(dst: str | Path, config: dict, st_config: dict, gen_config: dict,
                            seed: int = 0, variant: str = "custom", force: bool = False,
                            progress=None, peaked: bool = True, measure: bool | None = None,
                            device: str | None = None) -> dict:
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
        "logits": logits_record(config, peaked),
    }
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if measure is None:
        measure = torch.device(device).type == "cuda"

    def std(spec: TensorSpec) -> float:
        return tensor_std(spec.name, config) if peaked else INIT_STD

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
            ((s.name, random_tensor(s, seed, std(s))) for s in model_specs),
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
        if measure:
            models = standin_models(tmp, config, gen_config, device)
            standin["logits"]["measured"] = measure_sharpness(models)
            standin["logits"]["measured"]["device"] = device
        write_json(tmp / STANDIN_FILE, standin)
    return standin


def logits_record(config: dict, peaked: bool) -> dict:
    """How the stand-in's logits were made, and the sharpness that construction gives."""
    rec = record(peaked)
    if peaked:
        t = config["talker_config"]
        vocab0 = int(t["code_predictor_config"]["vocab_size"]) + 1  # codes + EOS
        rec["expected"] = {
            "codebook0": expected_sharpness(LOGIT_STD, vocab0),
            "codebooks_1_15": expected_sharpness(LOGIT_STD, vocab0 - 1),
        }
    return rec


def standin_models(root: Path, config: dict, gen_config: dict, device: str):
    """The talker and code predictor of a stand-in written at `root` (official layout) as
    `runtime.engine.Models` without a codec: enough to make it speak codes."""
    from safetensors import safe_open

    from ttsbuild.generation.generate import LengthRule
    from ttsbuild.model.config import ModelConfig
    from ttsbuild.model.talker import CodePredictor, Talker
    from ttsbuild.runtime.engine import Models
    from ttsbuild.text.tokenizer import TextTokenizer

    cfg = ModelConfig.from_official(config)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device("meta"):
        talker, cp = Talker(cfg), CodePredictor(cfg)
    states: dict[str, dict] = {"talker.": {}, "talker.code_predictor.": {}}
    with safe_open(str(Path(root) / "model.safetensors"), "pt", device=str(device)) as f:
        for k in f.keys():
            if k.startswith("talker."):
                prefix = "talker.code_predictor." if k.startswith("talker.code_predictor.") \
                    else "talker."
                states[prefix][k[len(prefix):]] = f.get_tensor(k).to(dtype)
    talker.load_state_dict(states["talker."], strict=True, assign=True)
    cp.load_state_dict(states["talker.code_predictor."], strict=True, assign=True)
    return Models(
        cfg=cfg, talker=talker.eval(), code_predictor=cp.eval(), codec=None, codec_cfg=None,
        tokenizer=TextTokenizer.from_dir(root), generation_config=gen_config,
        length_rule=LengthRule.from_standin({"length_rule": LENGTH_RULE}), manifest={},
    )
