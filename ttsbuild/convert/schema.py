"""The official Qwen3-TTS (12 Hz) checkpoint layout, computed from its configs.

`model_schema(config)` lists every tensor of `model.safetensors` (talker, code predictor and,
for Base, the ECAPA-TDNN speaker encoder); `speech_tokenizer_schema(config)` every tensor of
`speech_tokenizer/model.safetensors` (`encoder.*`: the HF Mimi encoder without its decoder
half; `decoder.*`: the codec decoder). Names, shapes and dtypes follow the official module
definitions (qwen-tts 0.1.1, transformers' Mimi), in the official `state_dict()` order.
Non-persistent buffers (RoPE `inv_freq`, conv stride/kernel buffers) are not stored; the Mimi
codebook buffers (`initialized`, `cluster_usage`, `embed_sum`) are persistent and are.

`validate_config` / `validate_speech_tokenizer_config` check every config field the schema
and the engine rely on (see `MODEL_FIELDS`, `SPEECH_TOKENIZER_FIELDS`) and return problems
in plain words instead of raising, so a converter can report them all at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

BF16 = "BF16"
F32 = "F32"

TTS_MODEL_TYPES = ("custom_voice", "voice_design", "base")
TTS_MODEL_SIZES = ("0b6", "1b7", "tiny")
TOKENIZER_TYPES = ("qwen3_tts_tokenizer_12hz",)
SPEECH_TOKENIZER_MODEL_TYPES = ("qwen3_tts_tokenizer_12hz",)

# Official defaults of the speaker encoder (the published configs only set enc_dim, sample_rate).
SPEAKER_ENCODER_DEFAULTS = {
    "mel_dim": 128,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}
# transformers' MimiConfig defaults for fields the published encoder config leaves out.
MIMI_DEFAULTS = {"dilation_growth_rate": 2, "use_conv_shortcut": False, "attention_bias": False}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor. `init` says how a random stand-in fills it:
    "normal" (std 0.02), "ones", "zeros" or "const" (`value`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    init: str = "normal"
    value: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (2 if self.dtype == BF16 else 4)


Schema = dict[str, TensorSpec]


class _Builder:
    def __init__(self, dtype: str):
        self.dtype = dtype
        self.specs: Schema = {}

    def add(self, name: str, shape, init: str = "normal", value: float = 0.0) -> None:
        if name in self.specs:
            raise AssertionError(f"duplicate tensor {name}")
        self.specs[name] = TensorSpec(name, tuple(int(s) for s in shape), self.dtype, init, value)

    def linear(self, name: str, out_f: int, in_f: int, bias: bool) -> None:
        self.add(f"{name}.weight", (out_f, in_f))
        if bias:
            self.add(f"{name}.bias", (out_f,), "zeros")

    def conv(self, name: str, out_c: int, in_c: int, k: int, bias: bool = True) -> None:
        self.add(f"{name}.weight", (out_c, in_c, k))
        if bias:
            self.add(f"{name}.bias", (out_c,), "zeros")

    def conv_transpose(self, name: str, in_c: int, out_c: int, k: int) -> None:
        self.add(f"{name}.weight", (in_c, out_c, k))  # torch stores (in, out, k) here
        self.add(f"{name}.bias", (out_c,), "zeros")

    def norm(self, name: str, dim: int, bias: bool = False) -> None:
        self.add(f"{name}.weight", (dim,), "ones")
        if bias:
            self.add(f"{name}.bias", (dim,), "zeros")


# ----------------------------------------------------------------------------- model.safetensors


def _qwen3_layers(b: _Builder, prefix: str, c: dict) -> None:
    hidden, hd = c["hidden_size"], c["head_dim"]
    heads, kv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        b.linear(f"{p}.self_attn.q_proj", heads * hd, hidden, False)
        b.linear(f"{p}.self_attn.k_proj", kv * hd, hidden, False)
        b.linear(f"{p}.self_attn.v_proj", kv * hd, hidden, False)
        b.linear(f"{p}.self_attn.o_proj", hidden, heads * hd, False)
        b.norm(f"{p}.self_attn.q_norm", hd)
        b.norm(f"{p}.self_attn.k_norm", hd)
        b.linear(f"{p}.mlp.gate_proj", inter, hidden, False)
        b.linear(f"{p}.mlp.up_proj", inter, hidden, False)
        b.linear(f"{p}.mlp.down_proj", hidden, inter, False)
        b.norm(f"{p}.input_layernorm", hidden)
        b.norm(f"{p}.post_attention_layernorm", hidden)


def speaker_encoder_config(config: dict) -> dict:
    return {**SPEAKER_ENCODER_DEFAULTS, **(config.get("speaker_encoder_config") or {})}


def _speaker_encoder(b: _Builder, prefix: str, sc: dict) -> None:
    ch, ks = sc["enc_channels"], sc["enc_kernel_sizes"]
    scale, se, att = sc["enc_res2net_scale"], sc["enc_se_channels"], sc["enc_attention_channels"]
    b.conv(f"{prefix}.blocks.0.conv", ch[0], sc["mel_dim"], ks[0])
    for i in range(1, len(ch) - 1):
        p = f"{prefix}.blocks.{i}"
        b.conv(f"{p}.tdnn1.conv", ch[i], ch[i - 1], 1)
        for j in range(scale - 1):
            b.conv(f"{p}.res2net_block.blocks.{j}.conv", ch[i] // scale, ch[i] // scale, ks[i])
        b.conv(f"{p}.tdnn2.conv", ch[i], ch[i], 1)
        b.conv(f"{p}.se_block.conv1", se, ch[i], 1)
        b.conv(f"{p}.se_block.conv2", ch[i], se, 1)
    b.conv(f"{prefix}.mfa.conv", ch[-1], ch[-1], ks[-1])
    b.conv(f"{prefix}.asp.tdnn.conv", att, ch[-1] * 3, 1)
    b.conv(f"{prefix}.asp.conv", ch[-1], att, 1)
    b.conv(f"{prefix}.fc", sc["enc_dim"], ch[-1] * 2, 1)


def model_schema(config: dict) -> Schema:
    """Every tensor of the official `model.safetensors` (all bf16). Config must be valid."""
    t = config["talker_config"]
    cp = t["code_predictor_config"]
    b = _Builder(BF16)
    _qwen3_layers(b, "talker.model", t)
    b.norm("talker.model.norm", t["hidden_size"])
    b.add("talker.model.codec_embedding.weight", (t["vocab_size"], t["hidden_size"]))
    b.add("talker.model.text_embedding.weight", (t["text_vocab_size"], t["text_hidden_size"]))
    th = t["text_hidden_size"]
    b.linear("talker.text_projection.linear_fc1", th, th, True)
    b.linear("talker.text_projection.linear_fc2", t["hidden_size"], th, True)
    b.linear("talker.codec_head", t["vocab_size"], t["hidden_size"], False)
    _qwen3_layers(b, "talker.code_predictor.model", cp)
    b.norm("talker.code_predictor.model.norm", cp["hidden_size"])
    groups = cp["num_code_groups"] - 1
    for k in range(groups):
        b.add(f"talker.code_predictor.model.codec_embedding.{k}.weight",
              (cp["vocab_size"], t["hidden_size"]))
    for k in range(groups):
        b.linear(f"talker.code_predictor.lm_head.{k}", cp["vocab_size"], cp["hidden_size"], False)
    if cp["hidden_size"] != t["hidden_size"]:
        b.linear("talker.code_predictor.small_to_mtp_projection", cp["hidden_size"],
                 t["hidden_size"], True)
    if config["tts_model_type"] == "base":
        _speaker_encoder(b, "speaker_encoder", speaker_encoder_config(config))
    return b.specs


# ------------------------------------------------------------- speech_tokenizer/model.safetensors


def mimi_encoder_config(st_config: dict) -> dict:
    return {**MIMI_DEFAULTS, **st_config["encoder_config"]}


def _mimi_encoder(b: _Builder, prefix: str, e: dict) -> None:
    nf = e["num_filters"]
    idx = 0
    b.conv(f"{prefix}.encoder.layers.{idx}.conv", nf, e["audio_channels"], e["kernel_size"])
    idx += 1
    scaling = 1
    for ratio in reversed(e["upsampling_ratios"]):
        dim = scaling * nf
        hidden = dim // e["compress"]
        for _ in range(e["num_residual_layers"]):
            p = f"{prefix}.encoder.layers.{idx}"
            b.conv(f"{p}.block.1.conv", hidden, dim, e["residual_kernel_size"])
            b.conv(f"{p}.block.3.conv", dim, hidden, 1)
            if e["use_conv_shortcut"]:
                b.conv(f"{p}.shortcut.conv", dim, dim, 1)
            idx += 1
        idx += 1  # ELU
        b.conv(f"{prefix}.encoder.layers.{idx}.conv", dim * 2, dim, ratio * 2)
        idx += 1
        scaling *= 2
    idx += 1  # ELU
    b.conv(f"{prefix}.encoder.layers.{idx}.conv", e["hidden_size"], scaling * nf,
           e["last_kernel_size"])

    hs, heads = e["hidden_size"], e["num_attention_heads"]
    kv = e.get("num_key_value_heads", heads)
    hd = e.get("head_dim") or hs // heads
    bias = bool(e["attention_bias"])
    for i in range(e["num_hidden_layers"]):
        p = f"{prefix}.encoder_transformer.layers.{i}"
        b.linear(f"{p}.self_attn.q_proj", heads * hd, hs, bias)
        b.linear(f"{p}.self_attn.k_proj", kv * hd, hs, bias)
        b.linear(f"{p}.self_attn.v_proj", kv * hd, hs, bias)
        b.linear(f"{p}.self_attn.o_proj", hs, heads * hd, bias)
        b.linear(f"{p}.mlp.fc1", e["intermediate_size"], hs, False)
        b.linear(f"{p}.mlp.fc2", hs, e["intermediate_size"], False)
        b.norm(f"{p}.input_layernorm", hs, bias=True)
        b.norm(f"{p}.post_attention_layernorm", hs, bias=True)
        b.add(f"{p}.self_attn_layer_scale.scale", (hs,), "const", e["layer_scale_initial_scale"])
        b.add(f"{p}.mlp_layer_scale.scale", (hs,), "const", e["layer_scale_initial_scale"])

    encodec_rate = math.ceil(e["sampling_rate"] / math.prod(e["upsampling_ratios"]))
    if e["frame_rate"] != encodec_rate:
        b.conv(f"{prefix}.downsample.conv", hs, hs, 2 * int(encodec_rate / e["frame_rate"]),
               bias=False)

    vq_dim = e["vector_quantization_hidden_dimension"]
    n_sem = e["num_semantic_quantizers"]
    for group, count in (("semantic", n_sem), ("acoustic", e["num_quantizers"] - n_sem)):
        p = f"{prefix}.quantizer.{group}_residual_vector_quantizer"
        for i in range(count):
            b.add(f"{p}.layers.{i}.codebook.initialized", (1,), "ones")
            b.add(f"{p}.layers.{i}.codebook.cluster_usage", (e["codebook_size"],), "ones")
            b.add(f"{p}.layers.{i}.codebook.embed_sum", (e["codebook_size"], e["codebook_dim"]))
        if vq_dim != hs:
            b.conv(f"{p}.input_proj", vq_dim, hs, 1, bias=False)
            b.conv(f"{p}.output_proj", hs, vq_dim, 1, bias=False)


def _codec_decoder(b: _Builder, prefix: str, d: dict) -> None:
    hs, heads, kv, hd = (d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"],
                         d["head_dim"])
    latent, inter, bias = d["latent_dim"], d["intermediate_size"], bool(d["attention_bias"])
    for i in range(d["num_hidden_layers"]):
        p = f"{prefix}.pre_transformer.layers.{i}"
        b.linear(f"{p}.self_attn.q_proj", heads * hd, hs, bias)
        b.linear(f"{p}.self_attn.k_proj", kv * hd, hs, bias)
        b.linear(f"{p}.self_attn.v_proj", kv * hd, hs, bias)
        b.linear(f"{p}.self_attn.o_proj", hs, heads * hd, bias)
        b.linear(f"{p}.mlp.gate_proj", inter, hs, False)
        b.linear(f"{p}.mlp.up_proj", inter, hs, False)
        b.linear(f"{p}.mlp.down_proj", hs, inter, False)
        b.norm(f"{p}.input_layernorm", hs)
        b.norm(f"{p}.post_attention_layernorm", hs)
        b.add(f"{p}.self_attn_layer_scale.scale", (hs,), "const", d["layer_scale_initial_scale"])
        b.add(f"{p}.mlp_layer_scale.scale", (hs,), "const", d["layer_scale_initial_scale"])
    b.norm(f"{prefix}.pre_transformer.norm", hs)
    b.linear(f"{prefix}.pre_transformer.input_proj", hs, latent, True)
    b.linear(f"{prefix}.pre_transformer.output_proj", latent, hs, True)

    cd = d["codebook_dim"]
    for group, count in (("rvq_first", 1), ("rvq_rest", d["num_quantizers"] - 1)):
        p = f"{prefix}.quantizer.{group}"
        b.conv(f"{p}.input_proj", cd // 2, cd, 1, bias=False)
        b.conv(f"{p}.output_proj", cd, cd // 2, 1, bias=False)
        for i in range(count):
            b.add(f"{p}.vq.layers.{i}._codebook.cluster_usage", (d["codebook_size"],), "ones")
            b.add(f"{p}.vq.layers.{i}._codebook.embedding_sum", (d["codebook_size"], cd // 2))
    b.conv(f"{prefix}.pre_conv.conv", latent, cd, 3)
    for k, factor in enumerate(d["upsampling_ratios"]):
        p = f"{prefix}.upsample.{k}"
        b.conv_transpose(f"{p}.0.conv", latent, latent, factor)
        b.add(f"{p}.1.gamma", (latent,), "const", 1e-6)
        b.conv(f"{p}.1.dwconv.conv", latent, 1, 7)
        b.norm(f"{p}.1.norm", latent, bias=True)
        b.linear(f"{p}.1.pwconv1", 4 * latent, latent, True)
        b.linear(f"{p}.1.pwconv2", latent, 4 * latent, True)
    dd = d["decoder_dim"]
    b.conv(f"{prefix}.decoder.0.conv", dd, latent, 7)
    rates = d["upsample_rates"]
    for i, rate in enumerate(rates):
        p = f"{prefix}.decoder.{i + 1}.block"
        in_dim, out_dim = dd // 2**i, dd // 2 ** (i + 1)
        b.add(f"{p}.0.alpha", (in_dim,), "zeros")
        b.add(f"{p}.0.beta", (in_dim,), "zeros")
        b.conv_transpose(f"{p}.1.conv", in_dim, out_dim, 2 * rate)
        for j in range(3):
            u = f"{p}.{j + 2}"
            b.add(f"{u}.act1.alpha", (out_dim,), "zeros")
            b.add(f"{u}.act1.beta", (out_dim,), "zeros")
            b.conv(f"{u}.conv1.conv", out_dim, out_dim, 7)
            b.add(f"{u}.act2.alpha", (out_dim,), "zeros")
            b.add(f"{u}.act2.beta", (out_dim,), "zeros")
            b.conv(f"{u}.conv2.conv", out_dim, out_dim, 1)
    out_dim = dd // 2 ** len(rates)
    n = len(rates) + 1
    b.add(f"{prefix}.decoder.{n}.alpha", (out_dim,), "zeros")
    b.add(f"{prefix}.decoder.{n}.beta", (out_dim,), "zeros")
    b.conv(f"{prefix}.decoder.{n + 1}.conv", 1, out_dim, 7)


def speech_tokenizer_schema(st_config: dict) -> Schema:
    """Every tensor of the official `speech_tokenizer/model.safetensors` (all fp32)."""
    b = _Builder(F32)
    _mimi_encoder(b, "encoder", mimi_encoder_config(st_config))
    _codec_decoder(b, "decoder", st_config["decoder_config"])
    return b.specs


# ------------------------------------------------------------------------- config validation

_INT, _NUM, _STR, _BOOL, _DICT, _LIST = int, (int, float), str, bool, dict, list

# (dotted path, expected type). Every field the schema or the engine reads.
MODEL_FIELDS: tuple[tuple[str, object], ...] = (
    ("tts_model_type", _STR), ("tts_model_size", _STR), ("tokenizer_type", _STR),
    ("im_start_token_id", _INT), ("im_end_token_id", _INT), ("assistant_token_id", _INT),
    ("tts_pad_token_id", _INT), ("tts_bos_token_id", _INT), ("tts_eos_token_id", _INT),
    ("talker_config", _DICT),
    *((f"talker_config.{k}", _INT) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "text_vocab_size", "text_hidden_size",
        "num_code_groups", "codec_bos_id", "codec_eos_token_id", "codec_pad_id", "codec_think_id",
        "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")),
    ("talker_config.rms_norm_eps", _NUM), ("talker_config.rope_theta", _NUM),
    ("talker_config.hidden_act", _STR),
    ("talker_config.codec_language_id", _DICT), ("talker_config.spk_id", _DICT),
    ("talker_config.spk_is_dialect", _DICT),
    ("talker_config.code_predictor_config", _DICT),
    *((f"talker_config.code_predictor_config.{k}", _INT) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "num_code_groups")),
    ("talker_config.code_predictor_config.rms_norm_eps", _NUM),
    ("talker_config.code_predictor_config.rope_theta", _NUM),
)
BASE_FIELDS = (("speaker_encoder_config", _DICT), ("speaker_encoder_config.enc_dim", _INT))

SPEECH_TOKENIZER_FIELDS: tuple[tuple[str, object], ...] = (
    ("model_type", _STR), ("encoder_valid_num_quantizers", _INT),
    ("output_sample_rate", _INT), ("decode_upsample_rate", _INT),
    ("encoder_config", _DICT),
    *((f"encoder_config.{k}", _INT) for k in (
        "audio_channels", "num_filters", "kernel_size", "residual_kernel_size",
        "last_kernel_size", "num_residual_layers", "compress", "hidden_size",
        "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_quantizers",
        "num_semantic_quantizers", "codebook_size", "codebook_dim",
        "vector_quantization_hidden_dimension", "sampling_rate")),
    ("encoder_config.upsampling_ratios", _LIST), ("encoder_config.frame_rate", _NUM),
    ("encoder_config.layer_scale_initial_scale", _NUM),
    ("decoder_config", _DICT),
    *((f"decoder_config.{k}", _INT) for k in (
        "latent_dim", "codebook_dim", "codebook_size", "decoder_dim", "hidden_size",
        "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "sliding_window", "num_quantizers")),
    ("decoder_config.rms_norm_eps", _NUM), ("decoder_config.rope_theta", _NUM),
    ("decoder_config.layer_scale_initial_scale", _NUM),
    ("decoder_config.upsample_rates", _LIST), ("decoder_config.upsampling_ratios", _LIST),
)


def _lookup(d: dict, path: str) -> tuple[bool, object]:
    cur: object = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _check_fields(d: dict, fields, where: str) -> Iterator[str]:
    for path, typ in fields:
        present, value = _lookup(d, path)
        if not present:
            parent = path.rpartition(".")[0]
            if parent and not isinstance(_lookup(d, parent)[1], dict):
                continue  # the parent's own problem is reported once
            yield f"{where}: field '{path}' is missing"
        elif isinstance(value, bool) and typ is not _BOOL or not isinstance(value, typ):
            want = typ.__name__ if isinstance(typ, type) else "number"
            yield f"{where}: field '{path}' must be {want}, got {value!r}"


def validate_config(config: object, where: str = "config.json") -> list[str]:
    """Problems with an official `config.json` dict (empty when it is usable)."""
    if not isinstance(config, dict):
        return [f"{where}: must be a JSON object"]
    problems = list(_check_fields(config, MODEL_FIELDS, where))
    mtype = config.get("tts_model_type")
    if isinstance(mtype, str) and mtype not in TTS_MODEL_TYPES:
        problems.append(f"{where}: unknown tts_model_type {mtype!r} "
                        f"(known: {', '.join(TTS_MODEL_TYPES)})")
    size = config.get("tts_model_size")
    if isinstance(size, str) and size not in TTS_MODEL_SIZES:
        problems.append(f"{where}: unknown tts_model_size {size!r} "
                        f"(known: {', '.join(TTS_MODEL_SIZES)})")
    ttype = config.get("tokenizer_type")
    if isinstance(ttype, str) and ttype not in TOKENIZER_TYPES:
        problems.append(f"{where}: unknown tokenizer_type {ttype!r} "
                        f"(this engine supports {', '.join(TOKENIZER_TYPES)})")
    if mtype == "base":
        problems += _check_fields(config, BASE_FIELDS, where)
    if problems:
        return problems
    t = config["talker_config"]
    for name, c in (("talker_config", t), ("talker_config.code_predictor_config",
                                           t["code_predictor_config"])):
        if c.get("attention_bias"):
            problems.append(f"{where}: {name}.attention_bias=true is not supported")
        if c["num_attention_heads"] % c["num_key_value_heads"]:
            problems.append(f"{where}: {name}.num_attention_heads must be a multiple of "
                            "num_key_value_heads")
    if t["code_predictor_config"]["num_code_groups"] != t["num_code_groups"]:
        problems.append(f"{where}: talker and code predictor disagree on num_code_groups")
    for path, value in (("talker_config.spk_id", t["spk_id"]),
                        ("talker_config.codec_language_id", t["codec_language_id"])):
        for key, raw in value.items():
            ids = raw if isinstance(raw, list) else [raw]
            if len(ids) != 1 or not isinstance(ids[0], int) or not 0 <= ids[0] < t["vocab_size"]:
                problems.append(f"{where}: {path}[{key!r}] must be one codec id below "
                                f"vocab_size {t['vocab_size']}, got {raw!r}")
    return problems


def validate_speech_tokenizer_config(st: object,
                                     where: str = "speech_tokenizer/config.json") -> list[str]:
    if not isinstance(st, dict):
        return [f"{where}: must be a JSON object"]
    problems = list(_check_fields(st, SPEECH_TOKENIZER_FIELDS, where))
    mt = st.get("model_type")
    if isinstance(mt, str) and mt not in SPEECH_TOKENIZER_MODEL_TYPES:
        problems.append(f"{where}: unknown speech tokenizer model_type {mt!r} "
                        f"(this engine supports {', '.join(SPEECH_TOKENIZER_MODEL_TYPES)})")
    if problems:
        return problems
    d = st["decoder_config"]
    total = math.prod(d["upsample_rates"]) * math.prod(d["upsampling_ratios"])
    if total != st["decode_upsample_rate"]:
        problems.append(f"{where}: decoder upsampling gives {total} samples per frame but "
                        f"decode_upsample_rate is {st['decode_upsample_rate']}")
    if d["decoder_dim"] % 2 ** len(d["upsample_rates"]):
        problems.append(f"{where}: decoder_dim must be divisible by 2**len(upsample_rates)")
    if d["num_quantizers"] < 2:
        problems.append(f"{where}: decoder_config.num_quantizers must be at least 2")
    return problems
