"""The runtime's own forward pass: packed weights, fused kernels, static shapes.

Same function as `ttsbuild.model` (checked against it in tests), organised for speed:
q/k/v and gate/up are packed into one matrix each, linears are bf16 or FP8 weight-only
(`plugins.fp8_linear`), q/k norm + RoPE + the cache write is one kernel
(`plugins.qk_norm_rope`), decode attention reads the slot-indexed cache directly
(`plugins.decode_attention`). Every function takes and returns tensors of fixed shape and
never synchronises with the host, so a whole frame can be captured in one CUDA graph.
On CPU the plugins fall back to their eager references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.model.layers import DecoderStack
from ttsbuild.plugins.decode_attention import decode_attention
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, fp8_linear, quantize_weight_fp8
from ttsbuild.plugins.qk_norm_rope import qk_norm_rope


class Dense:
    """A bias-free linear: bf16/fp32 weight, or FP8 e4m3 weight + per-channel scale."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        self.weight, self.scale = weight, scale

    @classmethod
    def make(cls, weight: torch.Tensor, fp8: bool) -> Dense:
        return cls(*quantize_weight_fp8(weight)) if fp8 else cls(weight)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return fp8_linear(x, self.weight, self.scale)
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        extra = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + extra


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class PackedLayer:
    input_norm: torch.Tensor
    qkv: Dense  # [(Hq + 2 Hkv) * D, hidden]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Dense
    post_norm: torch.Tensor
    gate_up: Dense  # [2 * intermediate, hidden]
    down: Dense


@dataclass
class PackedStack:
    cfg: DecoderStackConfig
    layers: list[PackedLayer]
    norm: torch.Tensor

    @classmethod
    def from_module(cls, stack: DecoderStack, fp8: bool) -> PackedStack:
        layers = []
        for layer in stack.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            layers.append(
                PackedLayer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=Dense.make(qkv.detach(), fp8),
                    q_norm=a.q_norm.weight.detach(),
                    k_norm=a.k_norm.weight.detach(),
                    o=Dense.make(a.o_proj.weight.detach(), fp8),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=Dense.make(gate_up.detach(), fp8),
                    down=Dense.make(m.down_proj.weight.detach(), fp8),
                )
            )
        return cls(stack.cfg, layers, stack.norm.weight.detach())

    def weight_bytes(self) -> int:
        return sum(d.nbytes() for p in self.layers for d in (p.qkv, p.o, p.gate_up, p.down))

    def _mlp(self, p: PackedLayer, x: torch.Tensor) -> torch.Tensor:
        gate, up = p.gate_up(rms_norm(x, p.post_norm, self.cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + p.down(F.silu(gate) * up)

    def decode(
        self,
        x: torch.Tensor,  # [B, hidden] one token per row
        k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """One token per row at `positions`; returns the final-norm hidden [B, hidden]."""
        c = self.cfg
        lengths = positions + 1
        max_len = k_cache.shape[3]
        for i, p in enumerate(self.layers):
            h = rms_norm(x, p.input_norm, c.rms_norm_eps)
            q = qk_norm_rope(
                p.qkv(h),
                p.q_norm,
                p.k_norm,
                positions,
                slots,
                k_cache[i],
                v_cache[i],
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                eps=c.rms_norm_eps,
                theta=c.rope_theta,
            )  # [B, Hq, D]
            attn = decode_attention(q, k_cache[i], v_cache[i], slots, lengths, max_len)
            x = x + p.o(attn.reshape(x.shape[0], -1))
            x = self._mlp(p, x)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def prefill(
        self,
        x: torch.Tensor,  # [B, T, hidden] tokens at positions 0..T-1 of each row
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """A sequence from position 0: causal attention over its own keys (the cache of the
        slot is written, never read). Padding after the real tokens is harmless: causal
        attention keeps it out of the real positions, and decoding overwrites its cache
        entries before it attends to them. Returns final-norm hidden [B, T, hidden]."""
        c = self.cfg
        B, T, _ = x.shape
        D = c.head_dim
        positions = torch.arange(T, device=x.device).repeat(B)  # [B * T]
        rows = slots.repeat_interleave(T)
        for i, p in enumerate(self.layers):
            h = rms_norm(x, p.input_norm, c.rms_norm_eps)
            q = qk_norm_rope(
                p.qkv(h).reshape(B * T, -1),
                p.q_norm,
                p.k_norm,
                positions,
                rows,
                k_cache[i],
                v_cache[i],
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                eps=c.rms_norm_eps,
                theta=c.rope_theta,
            )  # [B * T, Hq, D]
            k = k_cache[i][slots, :, :T]  # [B, Hkv, T, D]
            v = v_cache[i][slots, :, :T]
            rep = c.num_heads // c.num_kv_heads
            attn = F.scaled_dot_product_attention(
                q.reshape(B, T, c.num_heads, D).transpose(1, 2),
                k.repeat_interleave(rep, dim=1),
                v.repeat_interleave(rep, dim=1),
                is_causal=True,
                scale=D**-0.5,
            )  # [B, Hq, T, D]
            x = x + p.o(attn.transpose(1, 2).reshape(B, T, -1))
            x = self._mlp(p, x)
        return rms_norm(x, self.norm, c.rms_norm_eps)
