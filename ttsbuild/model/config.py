"""Model configuration, read from an official Qwen3-TTS `config.json`.

Only the fields the engine relies on are read; each is required, so a checkpoint with a
stale or partial config fails here with the field's name instead of computing garbage.
The config classes of the official code carry stale defaults (20 layers, eos 4198): we
never default a shape or a special id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json is missing a field we rely on, or holds a value we cannot use."""


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing required field '{key}'")
    return d[key]


@dataclass(frozen=True)
class DecoderStackConfig:
    """A Qwen3 decoder stack (talker or code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_official(cls, d: dict[str, Any], where: str) -> DecoderStackConfig:
        cfg = cls(
            hidden_size=int(_require(d, "hidden_size", where)),
            intermediate_size=int(_require(d, "intermediate_size", where)),
            num_layers=int(_require(d, "num_hidden_layers", where)),
            num_heads=int(_require(d, "num_attention_heads", where)),
            num_kv_heads=int(_require(d, "num_key_value_heads", where)),
            head_dim=int(_require(d, "head_dim", where)),
            rms_norm_eps=float(_require(d, "rms_norm_eps", where)),
            rope_theta=float(_require(d, "rope_theta", where)),
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"{where}: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if cfg.head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even for rotary embeddings")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported")
        if d.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported")
        if d.get("use_sliding_window", False):
            raise ConfigError(f"{where}: sliding-window attention is not supported")
        return cfg


@dataclass(frozen=True)
class CodecIds:
    """Control tokens of the codec vocabulary (rows of the talker's codec embedding)."""

    pad: int
    bos: int
    eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclass(frozen=True)
class TextIds:
    """Special tokens of the text vocabulary."""

    im_start: int
    im_end: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


@dataclass(frozen=True)
class Speaker:
    name: str
    codec_id: int
    dialect: str | None  # a language name such as "sichuan_dialect", or None


@dataclass(frozen=True)
class ModelConfig:
    """Everything about the talker and code predictor an engine needs."""

    tts_model_type: str  # "custom_voice" | "voice_design" | "base"
    tts_model_size: str  # "1b7" | "0b6" | ...
    talker: DecoderStackConfig
    code_predictor: DecoderStackConfig
    codec_vocab_size: int  # talker codec vocabulary (3072): codes + control + speakers
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int  # 16 codebooks per frame
    codebook_size: int  # 2048 codes per codebook
    codec_ids: CodecIds
    text_ids: TextIds
    languages: dict[str, int] = field(default_factory=dict)
    speakers: dict[str, Speaker] = field(default_factory=dict)

    @property
    def supports_instruct(self) -> bool:
        # The 0.6B CustomVoice model ignores instructions (official behaviour).
        return not (self.tts_model_type == "custom_voice" and self.tts_model_size == "0b6")

    @classmethod
    def from_official(cls, d: dict[str, Any]) -> ModelConfig:
        t = _require(d, "talker_config", "config.json")
        cp = _require(t, "code_predictor_config", "talker_config")
        w = "talker_config"
        model_type = str(_require(d, "tts_model_type", "config.json"))
        if model_type not in ("custom_voice", "voice_design", "base"):
            raise ConfigError(f"config.json: unknown tts_model_type {model_type!r}")
        spk_ids = t.get("spk_id") or {}
        dialects = t.get("spk_is_dialect") or {}
        speakers = {}
        for name, raw in spk_ids.items():
            # Published configs write a speaker id as an int or as a one-element list.
            sid = raw[0] if isinstance(raw, list) else raw
            dialect = dialects.get(name) or None
            speakers[name.lower()] = Speaker(name.lower(), int(sid), dialect)
        num_groups = int(_require(t, "num_code_groups", w))
        if int(_require(cp, "num_code_groups", "code_predictor_config")) != num_groups:
            raise ConfigError("talker and code predictor disagree on num_code_groups")
        return cls(
            tts_model_type=model_type,
            tts_model_size=str(_require(d, "tts_model_size", "config.json")),
            talker=DecoderStackConfig.from_official(t, w),
            code_predictor=DecoderStackConfig.from_official(cp, "code_predictor_config"),
            codec_vocab_size=int(_require(t, "vocab_size", w)),
            text_vocab_size=int(_require(t, "text_vocab_size", w)),
            text_hidden_size=int(_require(t, "text_hidden_size", w)),
            num_code_groups=num_groups,
            codebook_size=int(_require(cp, "vocab_size", "code_predictor_config")),
            codec_ids=CodecIds(
                pad=int(_require(t, "codec_pad_id", w)),
                bos=int(_require(t, "codec_bos_id", w)),
                eos=int(_require(t, "codec_eos_token_id", w)),
                think=int(_require(t, "codec_think_id", w)),
                nothink=int(_require(t, "codec_nothink_id", w)),
                think_bos=int(_require(t, "codec_think_bos_id", w)),
                think_eos=int(_require(t, "codec_think_eos_id", w)),
            ),
            text_ids=TextIds(
                im_start=int(_require(d, "im_start_token_id", "config.json")),
                im_end=int(_require(d, "im_end_token_id", "config.json")),
                assistant=int(_require(d, "assistant_token_id", "config.json")),
                tts_pad=int(_require(d, "tts_pad_token_id", "config.json")),
                tts_bos=int(_require(d, "tts_bos_token_id", "config.json")),
                tts_eos=int(_require(d, "tts_eos_token_id", "config.json")),
            ),
            languages={k.lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
            speakers=speakers,
        )
