"""The runtime's own forward pass: packed weights, fused kernels, static shapes.

Same function as `ttsbuild.model` (checked against it in tests), organised for speed:
q/k/v and gate/up are packed into one matrix each, linears are bf16 or FP8 weight-only
(`plugins.fp8_linear`), q/k norm + RoPE + the cache write is one kernel
(`plugins.qk_norm_rope`), decode attention reads the slot-indexed cache directly
(`plugins.decode_attention`), RMSNorm is one kernel fused with the residual add before it
and silu(gate) * up one kernel (`plugins.norm_act`). Every function takes and returns
tensors of fixed shape and never synchronises with the host, so a whole frame can be
captured in one CUDA graph.
On CPU the plugins fall back to their eager references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ttsbuild.model.config import DecoderStackConfig
from ttsbuild.model.layers import DecoderStack
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.decode_attention import decode_attention, qk_norm_rope_decode_attention
from ttsbuild.plugins.fp8_linear import (
    FP8_DTYPE,
    dequantize_weight_fp8,
    fp8_gate_up_silu,
    fp8_linear,
    quantize_weight_fp8,
)
from ttsbuild.plugins.fp8_w8a8 import fp8_linear_w8a8, w8a8_supported
from ttsbuild.plugins.norm_act import add_rms_norm, rms_norm, silu_mul
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, dequantize_kv, qk_norm_rope
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS, qk_norm_rope_attend

# The decode step's attention (q/k norm + RoPE + cache write, flash-decoding splits, their
# combine) as one launch instead of three (`qk_norm_rope_decode_attention`): 56 launches fewer
# per talker step. Off until timed on the GPU (TTSBUILD_TALKER_ATTEND_FUSED=1 turns it on).
TALKER_ATTEND_FUSED = os.environ.get("TTSBUILD_TALKER_ATTEND_FUSED", "0") == "1"
# The FP8 weight-only gate/up GEMV with silu(gate) * up in its epilogue (`fp8_gate_up_silu`):
# one launch per layer fewer where the MLP runs on the FP8 kernel (below bf16_min_rows rows).
# Off until timed on the GPU (TTSBUILD_GATE_UP_SILU=1 turns it on).
GATE_UP_SILU = os.environ.get("TTSBUILD_GATE_UP_SILU", "0") == "1"
# The same for the W8A8 Triton tiles (`fp8_linear_w8a8(gate_up=True)`, rows at or above
# w8a8_min_rows). On by default since 2026-12-04 (H200, in one process, the talker's output
# the same bits as without: with A8_NORM_QUANT, prefill 1x32 / 1x64 -4.9 / -3.9 %, decode
# 32 / 64 rows -3.2 / -2.5 %; benchmarks/kernels/2026-12-04-h200-switches-inproc/);
# TTSBUILD_A8_GATE_UP_SILU=0 turns it off.
A8_GATE_UP_SILU = os.environ.get("TTSBUILD_A8_GATE_UP_SILU", "1") == "1"
# The norm before a W8A8 qkv or gate/up linear also writes its rows quantised to FP8
# (`add_rms_norm(quantize=True)`): the row quantisation's own launch goes, two per talker
# layer (1.5 us each at 2048 columns in graph replays on the H200). On by default since
# 2026-12-04 (alone: prefill 1x32 -2.2 %, decode 64 rows -1.4 %, same bits; figures above);
# TTSBUILD_A8_NORM_QUANT=0 turns it off.
A8_NORM_QUANT = os.environ.get("TTSBUILD_A8_NORM_QUANT", "1") == "1"
# The same for the MLP's silu(gate) * up before a W8A8 down projection (`silu_mul(quantize=True)`,
# one program per row): the down input's quantisation launch goes (3.9 us at 6144 columns).
# Off: slower in one process on the H200 (prefill 1x32 +1.4 %, 1x64 +1.8 %, 2026-12-04);
# TTSBUILD_A8_SILU_QUANT=1 turns it on.
A8_SILU_QUANT = os.environ.get("TTSBUILD_A8_SILU_QUANT", "0") == "1"
# Decode over a short cache (at most MAX_POSITIONS positions: the code predictor's, on its
# unfused path, batches past fused_code_predictor's) with q/k norm + RoPE + cache write +
# attention in one launch (`qk_norm_rope_attend`, one program per row and KV head, as the
# fused path runs it) instead of qk_norm_rope and decode_attention's split and combine
# kernels: two launches fewer per layer, 140 per frame. Off: not faster on the H200
# (2026-12-04, one process: the frame at 16 / 64 / 256 rows 0.996 / 0.999 / 1.121;
# benchmarks/runtime/2026-12-04-h200-first-try-engine/). TTSBUILD_SHORT_ATTEND_FUSED=1 turns it on.
SHORT_ATTEND_FUSED = os.environ.get("TTSBUILD_SHORT_ATTEND_FUSED", "0") == "1"


def prefill_positions(start: torch.Tensor | None, B: int, T: int, S: int,
                      device) -> torch.Tensor:  # fmt: skip
    """Each prompt token's cache position [B * T]: start + t, clamped to the cache's last
    position (padding rows past its end write there; no real token reads it first)."""
    offsets = torch.arange(T, device=device)
    if start is None:
        return offsets.repeat(B)
    return (start[:, None] + offsets).clamp(max=S - 1).reshape(-1)


class Dense:
    """A bias-free linear: bf16/fp32 weight, or FP8 e4m3 weight + per-channel scale.

    FP8 weights run weight-only (`fp8_linear`), or W8A8 (`fp8_linear_w8a8`: activations
    quantised per row, an FP8 tensor-core GEMM) for inputs of at least `w8a8_min_rows` rows
    (0: never; `EnginePlan.w8a8_min_rows`) that the FP8 GEMM takes, or, from
    `bf16_min_rows` rows on (`EnginePlan.bf16_min_rows`), cuBLAS on a bf16 copy of the
    dequantised weight (`keep_bf16`): measured faster than either FP8 path from ~16 rows
    (benchmarks/kernels/RESULTS.md), at twice the bytes held."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        self.weight, self.scale = weight, scale
        self.w8a8_min_rows = 0
        self.bf16_min_rows = 0
        self.bf16_weight: torch.Tensor | None = None
        # (x, (q, scale)): x's rows quantised by the norm that wrote x (`hand_quantized`),
        # taken by the next call on that same tensor and dropped by any call
        self._quantized: tuple | None = None

    def takes_w8a8(self, rows: int, dtype: torch.dtype = torch.bfloat16,
                   cuda: bool = True) -> bool:  # fmt: skip
        """Whether an input of `rows` rows of `dtype` runs W8A8 here: bf16 on CUDA (the FP8
        GEMM writes bf16); off CUDA the reference takes fp32 too (a CPU run of an FP8 engine,
        e.g. the compile's quality gate, then rounds its activations as the GPU does)."""
        return bool(
            self.is_fp8 and (dtype == torch.bfloat16 or not cuda and dtype == torch.float32)
            and not (self.bf16_min_rows and rows >= self.bf16_min_rows)
            and self.w8a8_min_rows and rows >= self.w8a8_min_rows
            and w8a8_supported(rows, self.weight)
        )  # fmt: skip

    def hand_quantized(self, x: torch.Tensor, quantized: tuple) -> None:
        """x's rows already quantised to FP8 per row ((q, scale), as `quantize_rows(x)`), for
        the next call with x itself to use instead of quantising again."""
        self._quantized = (x, quantized)

    def _take_quantized(self, x: torch.Tensor):
        held, self._quantized = self._quantized, None
        return held[1] if held is not None and held[0] is x else None

    def keep_bf16(self, min_rows: int) -> None:
        """Inputs of at least min_rows rows (0: none) run on a bf16 copy of the weight,
        dequantised once here: (w_fp8 * scale) rounded to bf16, which adds an error of 2^-9
        relative per weight to FP8's 2^-4."""
        self.bf16_min_rows = min_rows if self.is_fp8 else 0
        if self.bf16_min_rows and self.bf16_weight is None:
            self.bf16_weight = dequantize_weight_fp8(self.weight, self.scale, torch.bfloat16)
        elif not self.bf16_min_rows:
            self.bf16_weight = None

    @classmethod
    def make(cls, weight: torch.Tensor, fp8: bool) -> Dense:
        return cls(*quantize_weight_fp8(weight)) if fp8 else cls(weight)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self._take_quantized(x)
        if self.is_fp8:
            rows = x.numel() // x.shape[-1]
            if self.bf16_min_rows and rows >= self.bf16_min_rows and x.dtype == torch.bfloat16:
                return F.linear(x, self.bf16_weight)
            if self.takes_w8a8(rows, x.dtype, x.is_cuda):
                return fp8_linear_w8a8(x, self.weight, self.scale, quantized=quantized)
            return fp8_linear(x, self.weight, self.scale)
        return F.linear(x, self.weight)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu_mul(self(x)) for a packed gate/up weight: one launch where the FP8
        weight-only GEMV takes x (GATE_UP_SILU on), else the linear and then silu_mul."""
        if (GATE_UP_SILU or A8_GATE_UP_SILU) and self.is_fp8:
            rows = x.numel() // x.shape[-1]
            bf16 = self.bf16_min_rows and rows >= self.bf16_min_rows
            w8a8 = self.takes_w8a8(rows, x.dtype, x.is_cuda)
            if GATE_UP_SILU and not bf16 and not w8a8:
                return fp8_gate_up_silu(x, self.weight, self.scale)
            if A8_GATE_UP_SILU and w8a8:  # (takes_w8a8 is false where the bf16 copy runs)
                return fp8_linear_w8a8(x, self.weight, self.scale, gate_up=True,
                                       quantized=self._take_quantized(x))  # fmt: skip
        return silu_mul(self(x))

    def nbytes(self) -> int:
        """Bytes held: the weight as stored, its scale and the bf16 copy if kept."""
        copy = self.bf16_weight
        return self.read_bytes() + (0 if copy is None else copy.numel() * copy.element_size())

    def read_bytes(self) -> int:
        """Bytes one call of few rows reads: the weight as stored and its scale."""
        extra = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + extra


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
    # each layer's (k_scale, v_scale) for an FP8 KV cache (EnginePlan.talker_kv_fp8): the
    # calibrated ones of a compiled engine (`from_packed`), else None. Read only where the
    # cache a call is given is FP8 (`kv_cache_args`).
    kv_scales: list[tuple[float, float]] | None = None

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

    @classmethod
    def from_packed(cls, cfg: DecoderStackConfig, t: dict[str, torch.Tensor]) -> PackedStack:
        """From an engine's packed tensors (`model.layers.N.self_attn.qkv_proj.weight`, ...),
        used as compiled: FP8 weights come with their `weight_scale`, nothing is re-quantised."""

        def dense(name: str) -> Dense:
            return Dense(t[f"{name}.weight"], t.get(f"{name}.weight_scale"))

        layers, kv_scales = [], []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}"
            layers.append(
                PackedLayer(
                    input_norm=t[f"{pre}.input_layernorm.weight"],
                    qkv=dense(f"{pre}.self_attn.qkv_proj"),
                    q_norm=t[f"{pre}.self_attn.q_norm.weight"],
                    k_norm=t[f"{pre}.self_attn.k_norm.weight"],
                    o=dense(f"{pre}.self_attn.o_proj"),
                    post_norm=t[f"{pre}.post_attention_layernorm.weight"],
                    gate_up=dense(f"{pre}.mlp.gate_up_proj"),
                    down=dense(f"{pre}.mlp.down_proj"),
                )
            )
            ks, vs = t.get(f"{pre}.self_attn.k_scale"), t.get(f"{pre}.self_attn.v_scale")
            if ks is not None and vs is not None:
                kv_scales.append((float(ks), float(vs)))
        full = len(kv_scales) == cfg.num_layers  # (calibrated: every layer has both)
        return cls(cfg, layers, t["model.norm.weight"], kv_scales if full else None)

    def kv_cache_args(self, i: int, k_cache: torch.Tensor) -> dict:
        """The scales layer i's cache kernels take: {} for a bf16 cache; k_scale and v_scale
        for an FP8 one (ValueError where the stack has none: an uncalibrated engine)."""
        if k_cache.dtype != KV_FP8_DTYPE:
            return {}
        if self.kv_scales is None:
            raise ValueError("an FP8 KV cache needs each layer's k/v scales: compile the "
                             "engine with a calibration (--calib)")  # fmt: skip
        k_scale, v_scale = self.kv_scales[i]
        return dict(k_scale=k_scale, v_scale=v_scale)

    @property
    def is_fp8(self) -> bool:
        return self.layers[0].qkv.is_fp8

    def linears(self) -> list[Dense]:
        """Every layer's linears, layer by layer: qkv, o, gate/up, down."""
        return [d for p in self.layers for d in (p.qkv, p.o, p.gate_up, p.down)]

    def weight_bytes(self) -> int:
        """Bytes the linears hold (bf16 copies included)."""
        return sum(d.nbytes() for d in self.linears())

    def read_bytes(self) -> int:
        """Bytes one decode step of few rows reads from the linears (the weight-read floor)."""
        return sum(d.read_bytes() for d in self.linears())

    def set_bf16_min_rows(self, rows: int) -> None:
        """The FP8 linears on bf16 copies of their weights from `rows` rows on (0: never)."""
        for d in self.linears():
            d.keep_bf16(rows)

    def set_linear_paths(self, plan, code_predictor: PackedStack, cp_heads) -> None:
        """The plan's path for the FP8 linears by rows, on this (the talker's) stack and on
        the code predictor's stack and heads: W8A8 from w8a8_min_rows / cp_w8a8_min_rows, bf16
        copies from bf16_min_rows / cp_bf16_min_rows (checked first), weight-only below. One
        place for the engine and the quality gate that measures it."""
        self.set_w8a8_min_rows(plan.w8a8_min_rows)
        self.set_bf16_min_rows(plan.bf16_min_rows)
        code_predictor.set_w8a8_min_rows(plan.cp_w8a8_min_rows)
        # (copies only where a bucket reaches the threshold: none held for nothing)
        cp_copies = plan.cp_bf16_min_rows if plan.max_batch >= plan.cp_bf16_min_rows else 0
        code_predictor.set_bf16_min_rows(cp_copies)
        for head in cp_heads:
            head.w8a8_min_rows = plan.cp_w8a8_min_rows
            head.keep_bf16(cp_copies)

    def set_w8a8_min_rows(self, rows: int) -> None:
        """W8A8 for the FP8 linears from `rows` rows on (0: weight-only everywhere)."""
        for d in self.linears():
            d.w8a8_min_rows = rows

    def _project_qk(self, i, p, qkv, positions, rows, k_cache, v_cache) -> torch.Tensor:
        """q/k norm + RoPE of layer i's packed qkv [R, ...]; k and v go into the cache at
        (rows, positions). Returns q [R, Hq, D]."""
        c = self.cfg
        return qk_norm_rope(
            qkv, p.q_norm, p.k_norm, positions, rows, k_cache, v_cache,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, eps=c.rms_norm_eps,
            theta=c.rope_theta, **self.kv_cache_args(i, k_cache),
        )  # fmt: skip

    def attend_decode(self, i, p, qkv, positions, slots, k_cache, v_cache) -> torch.Tensor:
        """One token per row: q/k norm + RoPE, k and v into layer i's cache at (slots,
        positions), attention over positions [0, position]: the attention output [R, Hq * D]
        in one launch (`qk_norm_rope_decode_attention`)."""
        c = self.cfg
        return qk_norm_rope_decode_attention(
            qkv, p.q_norm, p.k_norm, positions, slots, k_cache, v_cache, k_cache.shape[2],
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, eps=c.rms_norm_eps,
            theta=c.rope_theta, **self.kv_cache_args(i, k_cache),
        )  # fmt: skip

    def _cache_read(self, i: int, k: torch.Tensor, v: torch.Tensor, dtype) -> tuple:
        """Layer i's gathered cache entries (the eager paths' SDPA) as values of dtype."""
        kv = self.kv_cache_args(i, k)
        if not kv:
            return k, v
        return dequantize_kv(k, kv["k_scale"], dtype), dequantize_kv(v, kv["v_scale"], dtype)

    @staticmethod
    def _mlp(p: PackedLayer, h: torch.Tensor) -> torch.Tensor:
        """The MLP's output (before the residual add) of the post-attention-normed h."""
        rows = h.numel() // h.shape[-1]
        if A8_SILU_QUANT and p.down.takes_w8a8(rows, h.dtype, h.is_cuda):
            act, q = silu_mul(p.gate_up(h), quantize=True)
            p.down.hand_quantized(act, q)
            return p.down(act)
        return p.down(p.gate_up.gate_up_silu(h))

    def _attend_by_position(self, B: int, T: int, positions, rows, k_cache, v_cache,
                            keys: int):  # fmt: skip
        """attend(i, p, h) for T tokens per row (prefill, extend) on the kernels: each token,
        at positions [B * T] of cache slot rows [B * T], is a decode-attention query over its
        row's cache up to its own position (its k/v and any prefix's are written there
        first): one launch per layer where the eager paths gather K and V, repeat them per
        query head and mask (six or more kernels a layer). keys bounds the positions read."""
        lengths = positions + 1

        def attend(i: int, p: PackedLayer, h: torch.Tensor) -> torch.Tensor:
            qkv = p.qkv(h).reshape(B * T, -1)
            q = self._project_qk(i, p, qkv, positions, rows, k_cache[i], v_cache[i])
            return decode_attention(q, k_cache[i], v_cache[i], rows, lengths, keys,
                                    **self.kv_cache_args(i, k_cache)).reshape(B, T, -1)

        return attend

    def _run_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The pre-norm chain with the residual carried: each residual add is fused into
        the norm after it (add_rms_norm), the last one into the final norm.
        attend(i, p, h) -> the attention output (before o) of layer i for normed h."""
        eps = self.cfg.rms_norm_eps
        residual, delta = x, None
        rows = x.numel() // x.shape[-1]

        def norm(delta, residual, weight, then: Dense):
            """(residual, normed) for the linear `then`, handed its input's rows quantised
            where it runs W8A8 and A8_NORM_QUANT is on."""
            quant = A8_NORM_QUANT and then.takes_w8a8(rows, x.dtype, x.is_cuda)
            if delta is None:
                out = rms_norm(residual, weight, eps, quantize=quant)
                (h, q), res = (out if quant else (out, None)), residual
            else:
                res, h, *q = add_rms_norm(delta, residual, weight, eps, quantize=quant)
                q = q[0] if q else None
            if q is not None:
                then.hand_quantized(h, q)
            return res, h

        for i, p in enumerate(self.layers):
            residual, h = norm(delta, residual, p.input_norm, p.qkv)
            residual, h = norm(p.o(attend(i, p, h)), residual, p.post_norm, p.gate_up)
            delta = self._mlp(p, h)
        if delta is None:
            return rms_norm(residual, self.norm, eps)
        return add_rms_norm(delta, residual, self.norm, eps)[1]

    def decode(
        self,
        x: torch.Tensor,  # [B, hidden] one token per row
        k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """One token per row at `positions`; returns the final-norm hidden [B, hidden]."""
        lengths = positions + 1
        max_len = k_cache.shape[3]
        c = self.cfg
        # (the short caches' kernel: a floating cache only; the code predictor's)
        short = SHORT_ATTEND_FUSED and max_len <= MAX_POSITIONS and k_cache.dtype != KV_FP8_DTYPE

        def attend(i: int, p: PackedLayer, h: torch.Tensor) -> torch.Tensor:
            if short:
                return qk_norm_rope_attend(p.qkv(h), p.q_norm, p.k_norm, positions, slots,
                                           k_cache[i], v_cache[i], num_heads=c.num_heads,
                                           num_kv_heads=c.num_kv_heads, eps=c.rms_norm_eps,
                                           theta=c.rope_theta)  # fmt: skip
            if TALKER_ATTEND_FUSED:
                return self.attend_decode(i, p, p.qkv(h), positions, slots, k_cache[i],
                                          v_cache[i])  # fmt: skip
            q = self._project_qk(i, p, p.qkv(h), positions, slots, k_cache[i], v_cache[i])
            attn = decode_attention(q, k_cache[i], v_cache[i], slots, lengths, max_len,
                                    **self.kv_cache_args(i, k_cache))  # fmt: skip
            return attn.reshape(h.shape[0], -1)

        return self._run_layers(x, attend)

    def prefill(
        self,
        x: torch.Tensor,  # [B, T, hidden] tokens at positions start..start+T-1 of each row
        k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        start: torch.Tensor | None = None,  # [B] first position of each row (None: 0)
        keys: int | None = None,  # cache positions the rows may attend to (static; None: T)
    ) -> torch.Tensor:
        """A sequence of each row: causal attention over its own keys and, from `start` on,
        over the keys already in the slot's cache below `start` (a prefix copied in). Padding
        after the real tokens is harmless: causal attention keeps it out of the real
        positions, and decoding overwrites its cache entries before it attends to them.
        Returns final-norm hidden [B, T, hidden]."""
        c = self.cfg
        B, T, _ = x.shape
        D = c.head_dim
        S = k_cache.shape[3]
        rep = c.num_heads // c.num_kv_heads
        # Padding rows past the cache's end write its last position (never read first).
        positions = prefill_positions(start, B, T, S, x.device)  # [B * T]
        keys = T if start is None else min(keys or T, S)
        rows = slots.repeat_interleave(T)
        if want_triton(x, None):
            return self._run_layers(x, self._attend_by_position(B, T, positions, rows, k_cache,
                                                                v_cache, keys))  # fmt: skip

        mask = None
        if start is not None:
            visible = torch.arange(keys, device=x.device) <= positions.reshape(B, T, 1)
            mask = visible[:, None]  # [B, 1, T, keys]

        def attend(i: int, p: PackedLayer, h: torch.Tensor) -> torch.Tensor:
            qkv = p.qkv(h).reshape(B * T, -1)
            q = self._project_qk(i, p, qkv, positions, rows, k_cache[i], v_cache[i])
            # [B, Hkv, keys, D]
            k, v = self._cache_read(i, k_cache[i][slots, :, :keys], v_cache[i][slots, :, :keys],
                                    q.dtype)  # fmt: skip
            attn = F.scaled_dot_product_attention(
                q.reshape(B, T, c.num_heads, D).transpose(1, 2),
                k.repeat_interleave(rep, dim=1),
                v.repeat_interleave(rep, dim=1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=D**-0.5,
            )  # [B, Hq, T, D]
            return attn.transpose(1, 2).reshape(B, T, -1)

        return self._run_layers(x, attend)

    def extend(
        self,
        x: torch.Tensor,  # [B, T, hidden] tokens at positions start..start+T-1 of each row
        k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        start: torch.Tensor,  # [B] position of each row's first token
    ) -> torch.Tensor:
        """T tokens per row after the row's cached prefix (positions < start): each token
        attends to the cache up to its own position, so one pass verifies T tokens a
        speculative decoder proposed (T = 1 is `decode`). Positions must stay < S. Entries of
        the cache past a token's position are masked, so stale ones from a rejected draft
        are harmless. Returns final-norm hidden [B, T, hidden]."""
        c = self.cfg
        B, T, _ = x.shape
        D, S = c.head_dim, k_cache.shape[3]
        positions = start[:, None] + torch.arange(T, device=x.device)  # [B, T]
        rows = slots.repeat_interleave(T)
        if want_triton(x, None):
            return self._run_layers(x, self._attend_by_position(
                B, T, positions.reshape(-1), rows, k_cache, v_cache, S))  # fmt: skip
        visible = torch.arange(S, device=x.device) <= positions[:, :, None]  # [B, T, S]
        rep = c.num_heads // c.num_kv_heads

        def attend(i: int, p: PackedLayer, h: torch.Tensor) -> torch.Tensor:
            qkv = p.qkv(h).reshape(B * T, -1)
            q = self._project_qk(i, p, qkv, positions.reshape(-1), rows, k_cache[i], v_cache[i])
            k, v = self._cache_read(i, k_cache[i][slots], v_cache[i][slots], q.dtype)
            attn = F.scaled_dot_product_attention(
                q.reshape(B, T, c.num_heads, D).transpose(1, 2),
                k.repeat_interleave(rep, dim=1),  # [B, Hq, S, D]
                v.repeat_interleave(rep, dim=1),
                attn_mask=visible[:, None],
                scale=D**-0.5,
            )  # [B, Hq, T, D]
            return attn.transpose(1, 2).reshape(B, T, -1)

        return self._run_layers(x, attend)
