"""The Qwen3 decoder block shared by the talker and the code predictor.

Pre-norm RMSNorm, grouped-query attention with per-head RMSNorm on q and k before
rotate-half RoPE, SwiGLU MLP. The talker's config declares interleaved M-RoPE, but for
speech all three position rows are equal, which makes it exactly plain RoPE.

Attention reads and writes an explicit KV cache: rows of the batch name their cache slot
and the absolute position of each token, so requests of different lengths share a batch
without padding. Parameter names mirror the official checkpoint keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ttsbuild.model.config import DecoderStackConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32, scale applied in the input dtype (as the reference does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [*positions.shape, head_dim], computed in fp32 then cast."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Static per-layer K/V storage: k, v: [num_layers, num_slots, kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        cfg: DecoderStackConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        k_cache: torch.Tensor,  # [slots, kv_heads, S, D] (this layer)
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B] cache slot of each row
        positions: torch.Tensor,  # [B, T] absolute position of each token
        kv_len: int,  # attend over cache positions [0, kv_len)
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Write this step's keys/values at their positions: k_cache[slot, :, pos] = k[b, t]
        rows = slots[:, None].expand(B, T)
        k_cache[rows, :, positions] = k
        v_cache[rows, :, positions] = v
        keys = k_cache[slots, :, :kv_len]  # [B, kv_heads, S, D]
        values = v_cache[slots, :, :kv_len]

        # Causal by absolute position: a token sees every cached position <= its own.
        cache_pos = torch.arange(kv_len, device=x.device)
        mask = cache_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
        rep = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=self.head_dim**-0.5
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, positions, kv_len):
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, k_cache, v_cache, slots, positions, kv_len
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm. Subclasses add their embeddings under the same `model.` prefix."""

    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden] input embeddings
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
    ) -> torch.Tensor:
        """Returns the final-norm hidden states [B, T, hidden]."""
        kv_len = int(positions.max()) + 1
        if kv_len > cache.max_len:
            raise ValueError(f"position {kv_len - 1} exceeds the KV cache length {cache.max_len}")
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], slots, positions, kv_len)
        return self.norm(x)
