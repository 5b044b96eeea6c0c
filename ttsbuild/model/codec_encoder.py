"""The 12 Hz codec's encoder: 24 kHz waveform [B, N] -> codes [B, ceil(N / 1920), 16].

Needed only to encode a reference clip for in-context voice cloning. The official speech
tokenizer uses the Mimi encoder of `transformers` (Defossez et al., "Moshi", 2024) with its
decoder half removed and keeps the first 16 of its 32 codebooks:
  1. SEANet conv stack at 24 kHz: conv k7 (1 -> F); for each ratio in (4, 5, 6, 8): a residual
     unit (ELU, conv k3 C -> C/2, ELU, conv k1 C/2 -> C, identity shortcut), ELU, strided conv
     (kernel 2r, stride r, C -> 2C); ELU, conv k3 -> hidden. 24 kHz / 960 = 25 Hz.
  2. Transformer at 25 Hz: pre-LayerNorm, causal attention with rotate-half RoPE, GELU MLP,
     LayerScale on both branches.
  3. Downsample 25 -> 12.5 Hz: conv k4 stride 2, no bias, replicate padding.
  4. Split residual VQ: the semantic group (1 codebook) and the acoustic group (the rest) each
     project the same embedding with a 1x1 conv and quantise it residually by nearest
     codebook entry (Euclidean), each codebook stored as embed_sum / max(cluster_usage, 1e-5).
Every conv is causal: left padding of (effective kernel - stride), zeros except for the
downsample, plus right padding so the last window is complete. Attention is plain causal over
the whole clip: the config's `sliding_window` only bounds the official streaming cache, which
a one-shot encode never reuses (checked against the official code in the parity tests).
Parameter names mirror the official `encoder.*` keys (prefix removed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsbuild.model.layers import apply_rope, rope_cos_sin

# transformers' MimiConfig defaults for fields the published encoder config leaves out.
_DEFAULTS = {"dilation_growth_rate": 2, "use_conv_shortcut": False, "attention_bias": False}


@dataclass(frozen=True)
class CodecEncoderConfig:
    num_filters: int
    kernel_size: int
    residual_kernel_size: int
    last_kernel_size: int
    num_residual_layers: int
    compress: int
    dilation_growth_rate: int
    upsampling_ratios: tuple[int, ...]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    layer_scale_initial_scale: float
    rope_theta: float
    num_quantizers: int
    num_semantic_quantizers: int
    codebook_size: int
    codebook_dim: int
    vector_quantization_hidden_dimension: int
    sampling_rate: int
    frame_rate: float
    valid_quantizers: int  # codebooks kept (16): the talker's code groups

    @property
    def hop(self) -> int:
        """Samples per code frame (1920)."""
        return round(self.sampling_rate / self.frame_rate)

    @property
    def downsample_stride(self) -> int:
        return round(self.sampling_rate / math.prod(self.upsampling_ratios) / self.frame_rate)

    @classmethod
    def from_official(cls, st_config: dict) -> CodecEncoderConfig:
        """From the speech tokenizer's config.json (its `encoder_config`)."""
        e = {**_DEFAULTS, **st_config["encoder_config"]}
        unsupported = []
        if e.get("audio_channels", 1) != 1:
            unsupported.append("audio_channels != 1")
        if e.get("use_conv_shortcut"):
            unsupported.append("use_conv_shortcut")
        if not e.get("use_causal_conv", True):
            unsupported.append("non-causal convs")
        if e.get("pad_mode", "constant") != "constant":
            unsupported.append(f"pad_mode {e['pad_mode']!r}")
        if e.get("hidden_act", "gelu") != "gelu":
            unsupported.append(f"hidden_act {e['hidden_act']!r}")
        if e.get("attention_bias"):
            unsupported.append("attention_bias")
        if unsupported:
            raise ValueError("unsupported codec encoder config: " + ", ".join(unsupported))
        heads = int(e["num_attention_heads"])
        cfg = cls(
            num_filters=int(e["num_filters"]),
            kernel_size=int(e["kernel_size"]),
            residual_kernel_size=int(e["residual_kernel_size"]),
            last_kernel_size=int(e["last_kernel_size"]),
            num_residual_layers=int(e["num_residual_layers"]),
            compress=int(e["compress"]),
            dilation_growth_rate=int(e["dilation_growth_rate"]),
            upsampling_ratios=tuple(int(r) for r in e["upsampling_ratios"]),
            hidden_size=int(e["hidden_size"]),
            num_hidden_layers=int(e["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(e.get("num_key_value_heads", heads)),
            head_dim=int(e.get("head_dim") or int(e["hidden_size"]) // heads),
            intermediate_size=int(e["intermediate_size"]),
            norm_eps=float(e["norm_eps"]),
            layer_scale_initial_scale=float(e["layer_scale_initial_scale"]),
            rope_theta=float(e["rope_theta"]),
            num_quantizers=int(e["num_quantizers"]),
            num_semantic_quantizers=int(e["num_semantic_quantizers"]),
            codebook_size=int(e["codebook_size"]),
            codebook_dim=int(e["codebook_dim"]),
            vector_quantization_hidden_dimension=int(e["vector_quantization_hidden_dimension"]),
            sampling_rate=int(e["sampling_rate"]),
            frame_rate=float(e["frame_rate"]),
            valid_quantizers=int(st_config.get("encoder_valid_num_quantizers", 16)),
        )
        if not cfg.num_semantic_quantizers < cfg.valid_quantizers <= cfg.num_quantizers:
            raise ValueError("need num_semantic_quantizers < encoder_valid_num_quantizers "
                             "<= num_quantizers")
        if cfg.hop != st_config.get("encode_downsample_rate", cfg.hop):
            raise ValueError(f"encode_downsample_rate {st_config['encode_downsample_rate']} "
                             f"!= sampling_rate / frame_rate ({cfg.hop})")
        return cfg


class CausalConv(nn.Module):
    """Conv1d with causal padding: (effective kernel - stride) on the left, then whatever the
    right needs so the last window is complete (output length ceil(T / stride))."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.effective_kernel = (kernel - 1) * dilation + 1
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:  # x: [B, Cin, T] -> [B, Cout, ceil(T / stride)]
        left = self.effective_kernel - self.stride
        n_out = math.ceil((x.shape[-1] + left - self.effective_kernel) / self.stride) + 1
        right = (n_out - 1) * self.stride + self.effective_kernel - left - x.shape[-1]
        return self.conv(F.pad(x, (left, right), mode=self.pad_mode))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int):
        super().__init__()
        # Indices 0 and 2 are the ELUs of the official module list (no parameters).
        self.block = nn.ModuleList(
            [nn.ELU(), CausalConv(dim, hidden, kernel, dilation=dilation), nn.ELU(),
             CausalConv(hidden, dim, 1)]
        )

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for m in self.block:
            h = m(h)
        return x + h


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv(1, cfg.num_filters, cfg.kernel_size)]
        dim = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            for j in range(cfg.num_residual_layers):
                layers.append(ResidualUnit(dim, dim // cfg.compress, cfg.residual_kernel_size,
                                           cfg.dilation_growth_rate**j))
            layers += [nn.ELU(), CausalConv(dim, dim * 2, ratio * 2, stride=ratio)]
            dim *= 2
        layers += [nn.ELU(), CausalConv(dim, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:  # [B, 1, N] -> [B, hidden, ceil(N / 960)]
        for m in self.layers:
            x = m(x)
        return x


class Attention(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        hs, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, hd)
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(hs, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(hs, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(hs, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, hs, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, T, hidden]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
        pos = torch.arange(T, device=x.device)[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.heads != self.kv_heads,
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        hs = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(hs, cfg.intermediate_size)
        self.input_layernorm = nn.LayerNorm(hs, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(hs, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(hs, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(hs, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x)))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def embedding(self) -> Tensor:  # [size, dim]
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualQuantizer(nn.Module):
    """One group: 1x1 projection, then each codebook quantises what the previous ones left."""

    def __init__(self, n_q: int, size: int, dim: int, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantizer(size, dim) for _ in range(n_q))
        self.input_proj = nn.Conv1d(hidden, dim, 1, bias=False) if dim != hidden else None

    def encode(self, x: Tensor) -> Tensor:  # x: [B, hidden, T] -> codes [B, n_q, T]
        residual = (self.input_proj(x) if self.input_proj is not None else x).transpose(1, 2)
        codes = []
        for layer in self.layers:
            table = layer.codebook.embedding()  # [size, dim]
            # Distances in fp32 whatever the weights' dtype: the official quantiser's numerics,
            # so near-equidistant entries resolve the same way.
            dist = torch.cdist(residual.float(), table.float()[None].expand(residual.shape[0],
                                                                            -1, -1))
            idx = dist.argmin(dim=-1)  # [B, T]
            residual = residual - F.embedding(idx, table)
            codes.append(idx)
        return torch.stack(codes, dim=1)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        n_sem = cfg.num_semantic_quantizers
        args = (cfg.codebook_size, cfg.vector_quantization_hidden_dimension, cfg.hidden_size)
        self.semantic_residual_vector_quantizer = ResidualQuantizer(n_sem, *args)
        # Only the acoustic codebooks the talker uses: later ones never change earlier codes.
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(
            cfg.valid_quantizers - n_sem, *args
        )

    def encode(self, x: Tensor) -> Tensor:  # [B, hidden, T] -> [B, valid_quantizers, T]
        return torch.cat([self.semantic_residual_vector_quantizer.encode(x),
                          self.acoustic_residual_vector_quantizer.encode(x)], dim=1)


class CodecEncoder(nn.Module):
    """wav [B, N] at 24 kHz -> codes [B, ceil(N / hop), valid_quantizers] (int64)."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        stride = cfg.downsample_stride
        self.downsample = CausalConv(cfg.hidden_size, cfg.hidden_size, 2 * stride, stride=stride,
                                     bias=False, pad_mode="replicate")
        self.quantizer = SplitQuantizer(cfg)

    @torch.no_grad()
    def forward(self, wav: Tensor) -> Tensor:
        x = wav.to(self.downsample.conv.weight.dtype)[:, None, :]  # [B, 1, N]
        x = self.encoder(x)  # [B, hidden, T25]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        codes = self.quantizer.encode(self.downsample(x))  # [B, Q, T12]
        n_frames = -(-wav.shape[-1] // self.cfg.hop)
        return codes[:, :, :n_frames].transpose(1, 2)

    def load_official(self, tensors: dict[str, Tensor]) -> None:
        """Load from the official `encoder.*` tensors (prefix removed). The checkpoint also
        holds what encoding never reads (output projections, the unused acoustic codebooks,
        `initialized` flags); anything this module needs and does not find is an error."""
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"codec encoder tensors missing: {missing[:5]}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        self.load_state_dict({k: tensors[k] for k in own}, strict=True)
