"""Tensor names and shapes of the official speech tokenizer (the 12 Hz codec) checkpoint.

We implement only the decoder (`ttsbuild.model.codec`); the encoder is a Hugging Face Mimi
encoder used to encode reference audio for voice cloning. Checkpoint tooling still has to
validate and write the encoder tensors in the official layout, so `codec_encoder_shapes`
derives every `encoder.*` name and shape from config.json's `encoder_config` (with MimiConfig's
defaults for absent fields), in the order the official model's state_dict lists them.
"""

from __future__ import annotations

import math

from ttsbuild.model.codec import decoder_state_shapes

# MimiConfig defaults for the fields that shape the encoder.
_MIMI_DEFAULTS = {
    "sampling_rate": 24000,
    "frame_rate": None,
    "audio_channels": 1,
    "hidden_size": 512,
    "num_filters": 64,
    "num_residual_layers": 1,
    "upsampling_ratios": (8, 6, 5, 4),
    "kernel_size": 7,
    "last_kernel_size": 3,
    "residual_kernel_size": 3,
    "dilation_growth_rate": 2,
    "compress": 2,
    "codebook_size": 2048,
    "codebook_dim": 256,
    "num_quantizers": 32,
    "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256,
    "num_semantic_quantizers": 1,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": None,
    "attention_bias": False,
}

Shapes = dict[str, tuple[int, ...]]


def _conv(out: Shapes, name: str, cout: int, cin: int, k: int, bias: bool = True) -> None:
    out[f"{name}.conv.weight"] = (cout, cin, k)
    if bias:
        out[f"{name}.conv.bias"] = (cout,)


def _encoder_config(config: dict) -> dict:
    enc = config.get("encoder_config", config) if isinstance(config, dict) else None
    if not isinstance(enc, dict):
        raise ValueError("expected the speech tokenizer config dict (with encoder_config)")
    c = {k: enc.get(k, v) for k, v in _MIMI_DEFAULTS.items()}
    if not isinstance(c["residual_kernel_size"], int):
        raise ValueError("residual_kernel_size must be an int (as in MimiResnetBlock)")
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if not 0 <= c["num_semantic_quantizers"] < c["num_quantizers"]:
        raise ValueError("need num_semantic_quantizers < num_quantizers")
    return c


def codec_encoder_shapes(config: dict) -> Shapes:
    """`encoder.*` name -> shape of the official speech tokenizer, from its config.json dict
    (or from the `encoder_config` dict alone). Buffers the official file stores (codebook
    `initialized`, `cluster_usage`, `embed_sum`) are included."""
    c = _encoder_config(config)
    out: Shapes = {}

    # SEANet encoder: conv, then per ratio (residual blocks, ELU, strided conv), ELU, conv.
    p = "encoder.encoder.layers"
    nf = c["num_filters"]
    _conv(out, f"{p}.0", nf, c["audio_channels"], c["kernel_size"])
    idx, scale = 1, 1
    for ratio in reversed(c["upsampling_ratios"]):
        dim = scale * nf
        for _ in range(c["num_residual_layers"]):
            hidden = dim // c["compress"]
            _conv(out, f"{p}.{idx}.block.1", hidden, dim, c["residual_kernel_size"])
            _conv(out, f"{p}.{idx}.block.3", dim, hidden, 1)
            if c["use_conv_shortcut"]:
                _conv(out, f"{p}.{idx}.shortcut", dim, dim, 1)
            idx += 1
        idx += 1  # ELU
        _conv(out, f"{p}.{idx}", 2 * dim, dim, 2 * ratio)
        idx += 1
        scale *= 2
    idx += 1  # ELU
    _conv(out, f"{p}.{idx}", c["hidden_size"], scale * nf, c["last_kernel_size"])

    # Transformer (LayerNorm with bias, plain GELU MLP, LayerScale).
    h, hd = c["hidden_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.encoder_transformer.layers.{i}"
        for proj, (o, n_in) in {
            "q_proj": (q_dim, h),
            "k_proj": (kv_dim, h),
            "v_proj": (kv_dim, h),
            "o_proj": (h, q_dim),
        }.items():
            out[f"{p}.self_attn.{proj}.weight"] = (o, n_in)
            if c["attention_bias"]:
                out[f"{p}.self_attn.{proj}.bias"] = (o,)
        out[f"{p}.mlp.fc1.weight"] = (c["intermediate_size"], h)
        out[f"{p}.mlp.fc2.weight"] = (h, c["intermediate_size"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = (h,)
            out[f"{p}.{norm}.bias"] = (h,)
        out[f"{p}.self_attn_layer_scale.scale"] = (h,)
        out[f"{p}.mlp_layer_scale.scale"] = (h,)

    # Downsampling conv from the SEANet frame rate to the codec frame rate.
    hop = math.prod(c["upsampling_ratios"])
    encodec_rate = math.ceil(c["sampling_rate"] / hop)
    frame_rate = c["frame_rate"] or c["sampling_rate"] / (hop * 2)
    if frame_rate != encodec_rate:
        _conv(out, "encoder.downsample", h, h, 2 * int(encodec_rate / frame_rate), bias=False)

    # Split RVQ: semantic and acoustic groups, each with optional 1x1 in/out projections.
    n_sem = c["num_semantic_quantizers"]
    vq_dim = c["vector_quantization_hidden_dimension"]
    for group, n_q in (
        ("semantic_residual_vector_quantizer", n_sem),
        ("acoustic_residual_vector_quantizer", c["num_quantizers"] - n_sem),
    ):
        p = f"encoder.quantizer.{group}"
        for i in range(n_q):
            out[f"{p}.layers.{i}.codebook.initialized"] = (1,)
            out[f"{p}.layers.{i}.codebook.cluster_usage"] = (c["codebook_size"],)
            out[f"{p}.layers.{i}.codebook.embed_sum"] = (c["codebook_size"], c["codebook_dim"])
        if vq_dim != h:
            out[f"{p}.input_proj.weight"] = (vq_dim, h, 1)
            out[f"{p}.output_proj.weight"] = (h, vq_dim, 1)
    return out


def codec_decoder_shapes(config: dict) -> Shapes:
    """`decoder.*` name -> shape (with the `decoder.` prefix, as in the official file)."""
    return {f"decoder.{k}": v for k, v in decoder_state_shapes(config).items()}


def codec_shapes(config: dict) -> Shapes:
    """Every tensor of the official speech tokenizer checkpoint: encoder then decoder."""
    return {**codec_encoder_shapes(config), **codec_decoder_shapes(config)}
