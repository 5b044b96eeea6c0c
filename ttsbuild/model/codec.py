"""Qwen3-TTS 12 Hz codec decoder: codes [B, 16, T] -> 24 kHz waveform [B, 1, T * 1920].

Our own implementation of the speech tokenizer's `decoder.*` half. `CodecDecoder.state_dict()`
uses the official names with the leading `decoder.` stripped, so an official checkpoint loads
with `load_state_dict(strict=True)`.

The decoder is strictly causal (left-padded convs, right-trimmed transposed convs, a causal
sliding-window transformer), so it can be run incrementally with no approximation:
`CodecStream` carries every layer's left context in preallocated fixed-shape buffers and
`CodecStream.step(codes[B, 16, n])` returns exactly the next `n * 1920` samples of the full
decode, for any split of the sequence into steps.

Sliding window: a query at frame p attends to the keys at frames p - W + 1 .. p (itself and
the W - 1 previous frames; W = `sliding_window` = 72), the semantics of the official mask
(`q - W < k <= q`). The stream therefore keeps the last W - 1 keys and values per layer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsbuild.plugins.norm_act import snake_beta

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# decoder_config fields that must be present in an official config.json.
_REQUIRED = (
    "latent_dim",
    "codebook_dim",
    "codebook_size",
    "decoder_dim",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "layer_scale_initial_scale",
    "rope_theta",
    "sliding_window",
    "num_quantizers",
    "upsample_rates",
    "upsampling_ratios",
)
# Optional decoder_config fields and the official defaults.
_OPTIONAL = {
    "num_semantic_quantizers": 1,
    "vector_quantization_hidden_dimension": None,  # unused by the decoder
    "attention_bias": False,
    "max_position_embeddings": 8000,  # unused: RoPE is computed for any position
    "hidden_act": "silu",
    "attention_dropout": 0.0,
}
# Top-level keys of the speech tokenizer's config.json that we know (HF bookkeeping included).
_TOP_LEVEL = {
    "architectures",
    "model_type",
    "encoder_config",
    "decoder_config",
    "encoder_valid_num_quantizers",
    "input_sample_rate",
    "output_sample_rate",
    "decode_upsample_rate",
    "encode_downsample_rate",
    "transformers_version",
    "torch_dtype",
    "dtype",
}


@dataclass(frozen=True)
class CodecConfig:
    """Architecture of the codec decoder (the `decoder_config` of the speech tokenizer)."""

    latent_dim: int
    codebook_dim: int
    codebook_size: int
    decoder_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_scale_initial_scale: float
    rope_theta: float
    sliding_window: int
    num_quantizers: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    num_semantic_quantizers: int = 1
    vector_quantization_hidden_dimension: int | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 8000
    sample_rate: int = 24000
    decode_upsample_rate: int = 1920

    def __post_init__(self) -> None:
        object.__setattr__(self, "upsample_rates", tuple(int(r) for r in self.upsample_rates))
        object.__setattr__(self, "upsampling_ratios", tuple(int(r) for r in self.upsampling_ratios))
        problems = []
        if self.num_semantic_quantizers != 1:
            problems.append("num_semantic_quantizers must be 1 (the official decoder hard-codes 1)")
        if not 0 < self.num_semantic_quantizers < self.num_quantizers:
            problems.append("need 0 < num_semantic_quantizers < num_quantizers")
        if self.codebook_dim % 2:
            problems.append("codebook_dim must be even (codebooks have codebook_dim // 2 dims)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            problems.append("head_dim must be even (RoPE)")
        if self.sliding_window < 1:
            problems.append("sliding_window must be >= 1")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            problems.append("decoder_dim must halve exactly once per upsample rate")
        if self.decode_upsample_rate != self.total_upsample:
            problems.append(
                f"decode_upsample_rate {self.decode_upsample_rate} != product of upsampling_ratios"
                f" and upsample_rates ({self.total_upsample})"
            )
        if problems:
            raise ValueError("invalid codec config: " + "; ".join(problems))

    @property
    def total_upsample(self) -> int:
        """Output samples per code frame (1920)."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @property
    def output_dim(self) -> int:
        """Channels entering the final conv (96)."""
        return self.decoder_dim // 2 ** len(self.upsample_rates)

    @classmethod
    def from_official(cls, d: dict) -> CodecConfig:
        """Build from the speech tokenizer's config.json dict (or just its `decoder_config`)."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a config dict, got {type(d).__name__}")
        if "decoder_config" in d:
            top = d
            unknown = sorted(set(top) - _TOP_LEVEL)
            if unknown:
                raise ValueError(f"unknown speech tokenizer config fields: {unknown}")
            if top.get("model_type", MODEL_TYPE) != MODEL_TYPE:
                raise ValueError(f"model_type {top['model_type']!r} is not {MODEL_TYPE!r}")
            dec = top["decoder_config"]
            if not isinstance(dec, dict):
                raise ValueError("decoder_config must be a dict")
        else:
            top, dec = {}, d
        missing = [k for k in _REQUIRED if k not in dec]
        if missing:
            raise ValueError(f"decoder_config is missing required fields: {missing}")
        unknown = sorted(set(dec) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ValueError(f"unknown decoder_config fields: {unknown}")
        if dec.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {dec['hidden_act']!r} unsupported (only 'silu')")
        kw = {k: dec[k] for k in _REQUIRED}
        for k in ("num_semantic_quantizers", "vector_quantization_hidden_dimension"):
            if k in dec:
                kw[k] = dec[k]
        kw["attention_bias"] = bool(dec.get("attention_bias", False))
        kw["max_position_embeddings"] = int(dec.get("max_position_embeddings", 8000))
        in_sr, out_sr = top.get("input_sample_rate"), top.get("output_sample_rate", 24000)
        if in_sr is not None and in_sr != out_sr:
            raise ValueError(f"input_sample_rate {in_sr} != output_sample_rate {out_sr}")
        kw["sample_rate"] = int(out_sr)
        kw["decode_upsample_rate"] = int(top.get("decode_upsample_rate", 0)) or math.prod(
            list(dec["upsample_rates"]) + list(dec["upsampling_ratios"])
        )
        for k in ("rms_norm_eps", "layer_scale_initial_scale", "rope_theta"):
            kw[k] = float(kw[k])
        return cls(**kw)

    def to_official(self) -> dict:
        """The `decoder_config` dict in the official config.json layout."""
        d = asdict(self)
        for k in ("sample_rate", "decode_upsample_rate"):
            d.pop(k)
        if d["vector_quantization_hidden_dimension"] is None:
            d.pop("vector_quantization_hidden_dimension")
        d["upsample_rates"] = list(self.upsample_rates)
        d["upsampling_ratios"] = list(self.upsampling_ratios)
        d["hidden_act"] = "silu"
        return d


# --------------------------------------------------------------------------------------------
# Streaming state
# --------------------------------------------------------------------------------------------


class CodecStream:
    """Incremental decoding state for a batch of independent rows.

    Every buffer is allocated once with a fixed shape: a causal conv keeps its last
    (kernel - 1) * dilation input samples, a transposed conv the (kernel - stride) output
    samples that spill into the next step, each attention layer the keys/values of the last
    `sliding_window - 1` frames; `pos[b]` counts the frames row b has decoded (RoPE positions
    and the attention mask come from it, so rows may be at different positions). A step only
    runs fixed-shape tensor ops and in-place updates, so it can be captured in a CUDA graph
    for a fixed `n`.
    """

    def __init__(
        self,
        decoder: CodecDecoder,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        p = next(decoder.parameters())
        device = p.device if device is None else torch.device(device)
        dtype = p.dtype if dtype is None else dtype
        self.decoder = decoder
        self.batch_size = batch_size
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # frames decoded
        self.buffers: list[tuple[Tensor, ...]] = [
            m.new_state(batch_size, device, dtype) for m in decoder.stateful
        ]

    def tensors(self) -> list[Tensor]:
        """Every state tensor (the position counter included)."""
        return [self.pos, *(t for group in self.buffers for t in group)]

    @torch.no_grad()
    def reset(self, rows: Sequence[int] | Tensor | None = None) -> None:
        """Zero the state of `rows` to start new requests there; the other rows are untouched.

        rows: row indices, a bool mask [B] (a device tensor mask needs no host sync and can be
        captured in a graph), or None for all rows.
        """
        if rows is None:
            for t in self.tensors():
                t.zero_()
            return
        rows = torch.as_tensor(rows, device=self.pos.device)
        if rows.dtype == torch.bool:
            for t in self.tensors():
                t.masked_fill_(rows.view(-1, *(1,) * (t.dim() - 1)), 0)
        else:
            for t in self.tensors():
                t.index_fill_(0, rows, 0)

    @torch.no_grad()
    def step(self, codes: Tensor) -> Tensor:
        """codes: [B, Q, n] -> wav [B, 1, n * 1920], the continuation of every row."""
        if codes.shape[0] != self.batch_size:
            raise ValueError(f"expected {self.batch_size} rows, got {codes.shape[0]}")
        wav = self.decoder.step(codes, self)
        self.pos.add_(codes.shape[-1])
        return wav


# --------------------------------------------------------------------------------------------
# Convolutions (all stride 1 or right-trimmed transposed: strictly causal)
# --------------------------------------------------------------------------------------------


class CausalConv1d(nn.Module):
    """Conv1d left-padded with (kernel - 1) * dilation zeros: output length == input length."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        self.slot = -1  # index into CodecStream.buffers, set by CodecDecoder

    def forward(self, x: Tensor) -> Tensor:  # x: [B, Cin, T]
        return self.conv(F.pad(x, (self.context, 0)))  # [B, Cout, T]

    def new_state(self, batch: int, device, dtype) -> tuple[Tensor, ...]:
        if self.context == 0:
            return ()
        shape = (batch, self.conv.in_channels, self.context)
        return (torch.zeros(shape, device=device, dtype=dtype),)

    def step(self, x: Tensor, st: CodecStream) -> Tensor:  # x: [B, Cin, n]
        if self.context == 0:
            return self.conv(x)
        (tail,) = st.buffers[self.slot]  # [B, Cin, context]: the last inputs seen
        x = torch.cat([tail, x], dim=-1)  # [B, Cin, context + n]
        tail.copy_(x[..., -self.context :])
        return self.conv(x)  # [B, Cout, n]


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d(kernel, stride), last kernel - stride samples cut: T -> T * stride."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.overlap = kernel - stride  # samples each step spills into the next one
        self.slot = -1

    def forward(self, x: Tensor) -> Tensor:  # x: [B, Cin, T]
        return self.conv(x)[..., : x.shape[-1] * self.stride]  # [B, Cout, T * stride]

    def new_state(self, batch: int, device, dtype) -> tuple[Tensor, ...]:
        if self.overlap == 0:
            return ()
        shape = (batch, self.conv.out_channels, self.overlap)
        return (torch.zeros(shape, device=device, dtype=dtype),)

    def step(self, x: Tensor, st: CodecStream) -> Tensor:  # x: [B, Cin, n]
        if self.overlap == 0:
            return self.conv(x)
        (spill,) = st.buffers[self.slot]  # [B, Cout, overlap], bias not included
        n_out = x.shape[-1] * self.stride
        y = F.conv_transpose1d(x, self.conv.weight, None, stride=self.stride)  # [B, Cout, n_out+ov]
        y = torch.cat([y[..., : self.overlap] + spill, y[..., self.overlap :]], dim=-1)
        spill.copy_(y[..., n_out:])
        return y[..., :n_out] + self.conv.bias[:, None]  # [B, Cout, n_out]


class SnakeBeta(nn.Module):
    """x + 1/beta * sin(alpha * x)^2 per channel; alpha and beta are stored as logs."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        if x.is_cuda and not (
            torch.is_grad_enabled()
            and (x.requires_grad or self.alpha.requires_grad or self.beta.requires_grad)
        ):
            # One fused kernel (plugins.norm_act) when Triton imports, else the eager ops.
            return snake_beta(x, self.alpha, self.beta)
        alpha = self.alpha.exp()[:, None]  # [C, 1]
        inv_beta = 1.0 / (self.beta.exp()[:, None] + 1e-9)
        return x + inv_beta * torch.sin(x * alpha).pow(2)

    def step(self, x: Tensor, st: CodecStream) -> Tensor:
        return self(x)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm -> Linear 4x -> GELU -> Linear -> gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _mix(self, x: Tensor, h: Tensor) -> Tensor:  # x, h: [B, C, T]
        h = h.transpose(1, 2)  # [B, T, C]
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self._mix(x, self.dwconv(x))

    def step(self, x: Tensor, st: CodecStream) -> Tensor:
        return self._mix(x, self.dwconv.step(x, st))


class ResidualUnit(nn.Module):
    """SnakeBeta -> causal conv k7 (dilated) -> SnakeBeta -> conv k1, residual."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: Tensor, st: CodecStream) -> Tensor:
        return x + self.conv2.step(self.act2(self.conv1.step(self.act1(x), st)), st)


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv upsampling by `rate` (channels halve), 3 residual units."""

    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [
                SnakeBeta(cin),
                CausalConvTranspose1d(cin, cout, 2 * rate, rate),
                *(ResidualUnit(cout, d) for d in (1, 3, 9)),
            ]
        )

    def forward(self, x: Tensor) -> Tensor:  # x: [B, Cin, T] -> [B, Cout, T * rate]
        for m in self.block:
            x = m(x)
        return x

    def step(self, x: Tensor, st: CodecStream) -> Tensor:
        for m in self.block:
            x = m.step(x, st)
        return x


# --------------------------------------------------------------------------------------------
# Pre-transformer: 8 pre-norm layers, RoPE, causal sliding-window attention, LayerScale
# --------------------------------------------------------------------------------------------


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Bool [B, 1, Tq, Tk]: key frame k is visible to query frame q iff q - window < k <= q.

    q_pos: [B, Tq], k_pos: [B, Tk] absolute frame numbers; negative key positions (no history
    yet) are never visible.
    """
    d = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Tq, Tk]
    visible = (d >= 0) & (d < window) & (k_pos >= 0)[:, None, :]
    return visible[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute frame positions (computed on the fly: no buffer to load)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # pos: [B, T] -> cos, sin: [B, 1, T, head_dim]
        idx = torch.arange(0, self.head_dim, 2, device=pos.device, dtype=torch.int64).float()
        inv_freq = 1.0 / (self.theta ** (idx / self.head_dim))  # [head_dim / 2]
        freqs = pos.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [B, H, T, D]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.cache_len = cfg.sliding_window - 1  # past frames a new frame can still see
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=bias)
        self.slot = -1

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape  # x: [B, T, hidden]
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        if self.n_kv != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        b, _, t, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # [B, T, hidden]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)
        return self._attend(q, k, v, mask)

    def new_state(self, batch: int, device, dtype) -> tuple[Tensor, ...]:
        shape = (batch, self.n_kv, self.cache_len, self.head_dim)
        return (
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
        )

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, st: CodecStream) -> Tensor:
        # x: [B, n, hidden]; the cache holds frames pos - cache_len .. pos - 1 (oldest first).
        q, k, v = self._qkv(x, cos, sin)
        k_cache, v_cache = st.buffers[self.slot]  # [B, Hkv, cache_len, D]
        k = torch.cat([k_cache, k], dim=2)  # [B, Hkv, cache_len + n, D]
        v = torch.cat([v_cache, v], dim=2)
        k_cache.copy_(k[:, :, k.shape[2] - self.cache_len :])
        v_cache.copy_(v[:, :, v.shape[2] - self.cache_len :])
        return self._attend(q, k, v, mask)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(dim, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(dim, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(dim, cfg.layer_scale_initial_scale)

    def _mlp(self, x: Tensor) -> Tensor:
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return self._mlp(x + self.self_attn_layer_scale(h))

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, st: CodecStream) -> Tensor:
        h = self.self_attn.step(self.input_layernorm(x), cos, sin, mask, st)
        return self._mlp(x + self.self_attn_layer_scale(h))


class PreTransformer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.window = cfg.sliding_window
        self.cache_len = cfg.sliding_window - 1
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, T, latent]
        pos = torch.arange(x.shape[1], device=x.device)[None]  # [1, T]
        mask = window_mask(pos, pos, self.window)
        h = self.input_proj(x)  # [B, T, hidden]
        cos, sin = self.rotary(pos, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))  # [B, T, latent]

    def step(self, x: Tensor, st: CodecStream) -> Tensor:  # x: [B, n, latent]
        dev = x.device
        q_pos = st.pos[:, None] + torch.arange(x.shape[1], device=dev)  # [B, n]
        past = st.pos[:, None] - self.cache_len + torch.arange(self.cache_len, device=dev)
        mask = window_mask(q_pos, torch.cat([past, q_pos], dim=1), self.window)
        h = self.input_proj(x)
        cos, sin = self.rotary(q_pos, h.dtype)
        for layer in self.layers:
            h = layer.step(h, cos, sin, mask, st)
        return self.output_proj(self.norm(h))


# --------------------------------------------------------------------------------------------
# Split residual vector quantizer (decode only)
# --------------------------------------------------------------------------------------------


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def embedding(self) -> Tensor:  # [size, dim]
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class ResidualVQ(nn.Module):
    def __init__(self, n_q: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantizer(size, dim) for _ in range(n_q))


class QuantizerGroup(nn.Module):
    """n_q codebooks summed, then output_proj (1x1 conv). input_proj is the encoder's side."""

    def __init__(self, n_q: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = ResidualVQ(n_q, size, dim)

    def forward(self, codes: Tensor) -> Tensor:  # codes: [B, n_q, T]
        h = 0
        for i, layer in enumerate(self.vq.layers):
            h = h + F.embedding(codes[:, i], layer._codebook.embedding())  # [B, T, dim]
        return self.output_proj(h.transpose(1, 2))  # [B, io_dim, T]


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        n_sem, dim = cfg.num_semantic_quantizers, cfg.codebook_dim // 2
        size, io_dim = cfg.codebook_size, cfg.codebook_dim
        self.n_semantic = n_sem
        self.rvq_first = QuantizerGroup(n_sem, size, dim, io_dim)
        self.rvq_rest = QuantizerGroup(cfg.num_quantizers - n_sem, size, dim, io_dim)

    def forward(self, codes: Tensor) -> Tensor:  # codes: [B, Q, T] -> [B, codebook_dim, T]
        n = self.n_semantic
        return self.rvq_first(codes[:, :n]) + self.rvq_rest(codes[:, n:])


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.config = cfg
        latent = cfg.latent_dim
        # Registration order = the official state_dict order.
        self.pre_transformer = PreTransformer(cfg)
        self.quantizer = SplitQuantizer(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, latent, 3)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(latent, latent, r, r), ConvNeXtBlock(latent)])
            for r in cfg.upsampling_ratios
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [
                CausalConv1d(latent, cfg.decoder_dim, 7),
                *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
                SnakeBeta(dims[-1]),
                CausalConv1d(dims[-1], 1, 7),
            ]
        )
        # Modules with streaming state; CodecStream.buffers[m.slot] belongs to module m.
        self.stateful: list[nn.Module] = [m for m in self.modules() if hasattr(m, "new_state")]
        for i, m in enumerate(self.stateful):
            m.slot = i

    def _check(self, codes: Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(
                f"expected codes [B, {self.config.num_quantizers}, T], got {tuple(codes.shape)}"
            )

    def forward(self, codes: Tensor) -> Tensor:
        """codes: [B, Q, T] int -> wav [B, 1, T * 1920] in [-1, 1]."""
        self._check(codes)
        x = self.pre_conv(self.quantizer(codes))  # [B, latent, T]
        x = self.pre_transformer(x.transpose(1, 2)).transpose(1, 2)  # [B, latent, T]
        for up, block in self.upsample:
            x = block(up(x))  # [B, latent, T * 4] after both stages
        for m in self.decoder:
            x = m(x)
        return x.clamp(-1.0, 1.0)  # [B, 1, T * 1920]

    def step(self, codes: Tensor, st: CodecStream) -> Tensor:
        """One incremental step (use CodecStream.step, which also advances the positions)."""
        self._check(codes)
        x = self.pre_conv.step(self.quantizer(codes), st)  # [B, latent, n]
        x = self.pre_transformer.step(x.transpose(1, 2), st).transpose(1, 2)
        for up, block in self.upsample:
            x = block.step(up.step(x, st), st)
        for m in self.decoder:
            x = m.step(x, st)
        return x.clamp(-1.0, 1.0)  # [B, 1, n * 1920]

    def stream(self, batch_size: int, **kw) -> CodecStream:
        return CodecStream(self, batch_size, **kw)


# --------------------------------------------------------------------------------------------
# Shapes and random weights
# --------------------------------------------------------------------------------------------


def decoder_state_shapes(config: dict | CodecConfig) -> dict[str, tuple[int, ...]]:
    """`CodecDecoder.state_dict()` name -> shape, built on the meta device. These are the
    official `decoder.*` tensors with the prefix stripped (`codec_schema.codec_decoder_shapes`
    gives them with the prefix)."""
    cfg = config if isinstance(config, CodecConfig) else CodecConfig.from_official(config)
    with torch.device("meta"):
        model = CodecDecoder(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# Transposed convs store weight as [Cin, Cout, kernel]; an output sample sees kernel/stride taps.
_RESIDUAL_GAIN = 0.25
_TRANSPOSED = re.compile(r"^(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight$")


@torch.no_grad()
def audible_random_init_(
    state: dict[str, Tensor], generator: torch.Generator, *, out_gain: float = 0.15
) -> dict[str, Tensor]:
    """Make a generic random decoder state (weights ~N(0, 0.02), zero biases, ones for other 1-D
    tensors) decode random codes to audible, mostly unclipped audio, in place.

    The generic init is silent or saturated where a tensor has a special meaning: codebooks
    (`embedding_sum`) are re-drawn N(0, 1) with `cluster_usage` 1; LayerScale and ConvNeXt
    `gamma` become 0.1; SnakeBeta log-alpha/log-beta become 0 (alpha = beta = 1). Every weight
    matrix keeps its random draw but is rescaled to std 1/sqrt(fan_in) (variance preserving, so
    the loudness does not depend on the layer widths); the residual units' output convs get a
    gain of 0.25 (twelve stacked residual units would otherwise grow the signal ~100x and clip)
    and the final conv `out_gain`.
    """
    final_conv = max(
        (k for k in state if re.fullmatch(r"decoder\.\d+\.conv\.weight", k)),
        key=lambda k: int(k.split(".")[1]),
    )
    for name, t in state.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32))
        elif leaf == "cluster_usage":
            t.fill_(1.0)
        elif name.endswith("_layer_scale.scale") or leaf == "gamma":
            t.fill_(0.1)
        elif leaf in ("alpha", "beta"):
            t.zero_()
        elif t.dim() >= 2:
            if _TRANSPOSED.match(name):  # [Cin, Cout, k], stride k/2 (or k): <= 2 taps
                fan_in = t.shape[0] * min(2, t.shape[2])
            else:  # [Cout, Cin / groups, k...] or [out, in]
                fan_in = t[0].numel()
            std = t.float().std().clamp(min=1e-12)
            gain = 1.0
            if name == final_conv:
                gain = out_gain
            elif name.endswith(".conv2.conv.weight"):  # residual unit branch: keep growth small
                gain = _RESIDUAL_GAIN
            t.mul_(gain / math.sqrt(fan_in) / std)
    return state


def random_codec_state(config: dict | CodecConfig, seed: int = 0) -> dict[str, Tensor]:
    """A full random decoder state (fp32, CPU, names without `decoder.`) that decodes to audio."""
    cfg = config if isinstance(config, CodecConfig) else CodecConfig.from_official(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in decoder_state_shapes(cfg).items():
        if name.endswith(".bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        state[name] = t
    return audible_random_init_(state, gen)
