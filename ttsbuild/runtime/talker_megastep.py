"""The talker's decode step at batch 1 as one persistent CUDA kernel
(`ttsbuild/csrc/talker_step.cu`): 28 layers of one token in one launch, one CTA an SM, a
grid barrier after each dependent stage (5 a layer), and each stage's FP8 weights brought
into L2 by bulk prefetches issued `dist` stages ahead, so that HBM streams the step's
weights back to back. On the unfused kernels the step at batch 1 is ~1.05-1.09 ms on an
H200 against a 0.29-ms FP8 weight read: each small GEMV ends within a DRAM latency or two.

Here: the kernel's tensors from a PackedStack (`KernelTensors`: the stack's own FP8 weights
by address, no copy; its norms in fp32), its float32 reference (`reference`: what the kernel
is checked against; checked against `PackedStack.decode` in tests/runtime/
test_talker_megastep.py), the shapes it takes (`unsupported`) and the GPU wrapper
(`TalkerStep`, built on first use with torch.utils.cpp_extension: sm_90a).

Status (2026-12-07): a prototype with its bench (benchmarks/kernels/megatalker/); not in the
engine's plan until timed and checked on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ttsbuild.model.layers import apply_rope, rope_cos_sin
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, dequantize_weight_fp8
from ttsbuild.plugins.qk_norm_rope import inv_freq
from ttsbuild.runtime.fast_model import Dense, PackedStack

# The shapes compiled into the kernel (the 1.7B talker's); any number of layers
SHAPE = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 6144}
SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "talker_step.cu"
CHUNK = 32  # positions of one attention item (talker_step.cu CH)
PART = 4 + 2 * SHAPE["head_dim"]  # floats of one attention partial (talker_step.cu PART)
COUNTER_WORDS = 64 + 32 * SHAPE["kv_heads"]


def unsupported(stack: PackedStack, k_cache: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot run this stack (and cache), or None."""
    c = stack.cfg
    have = {"hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "intermediate": c.intermediate_size}  # fmt: skip
    if have != SHAPE:
        return f"shapes {have}, the kernel's are {SHAPE}"
    if not stack.is_fp8:
        return "the kernel takes FP8 weights"
    for d in stack.linears():
        w = d.weight
        if not (w.is_contiguous() and w.data_ptr() % 16 == 0) or d.scale is None:
            return "a weight not contiguous, not 16-byte aligned, or without its scale"
        if d.scale.dtype != torch.float32 or not d.scale.is_contiguous():
            return "a weight scale not contiguous fp32"
    return None if k_cache is None else _cache_unsupported(c, k_cache)


def _cache_unsupported(c, k_cache: torch.Tensor) -> str | None:
    if (k_cache.dtype != torch.bfloat16 or not k_cache.is_contiguous()
            or k_cache.shape[0] != c.num_layers):  # fmt: skip
        return "the kernel takes a contiguous bf16 cache [layers, slots, kv heads, S, D]"
    return None


def _dense(d: Dense) -> torch.Tensor:
    """The linear's weight in fp32 as the kernel multiplies it (fp8 * row scale)."""
    if d.weight.dtype == FP8_DTYPE:
        return dequantize_weight_fp8(d.weight, d.scale, torch.float32)
    return d.weight.float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@torch.no_grad()
def reference(stack: PackedStack, x: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot: int, pos: int) -> torch.Tensor:
    """The kernel's math in float32 (any shapes, any device): one token x [hidden] at position
    `pos` of cache slot `slot`; every activation in fp32, each weight as fp8 * row scale, the
    new k and v rounded to the cache's dtype and written at `pos` (the kernel's bf16), the
    attention over positions [0, pos]. Returns the final-norm hidden [hidden] in fp32."""
    c = stack.cfg
    D, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
    eps = c.rms_norm_eps
    P = pos + 1
    cos, sin = rope_cos_sin(torch.tensor([[pos]], device=x.device), D, c.rope_theta,
                            torch.float32)  # fmt: skip
    xres = x.float().reshape(-1)
    for i, p in enumerate(stack.layers):
        h = _rms(xres, p.input_norm, eps)
        qkv = _dense(p.qkv) @ h
        q, k, v = qkv.split([nh * D, nkv * D, nkv * D])
        q = apply_rope(_rms(q.reshape(1, 1, nh, D), p.q_norm, eps), cos, sin)[0, 0]
        k = apply_rope(_rms(k.reshape(1, 1, nkv, D), p.k_norm, eps), cos, sin)[0, 0]
        k_cache[i, slot, :, pos] = k.to(k_cache.dtype)
        v_cache[i, slot, :, pos] = v.reshape(nkv, D).to(v_cache.dtype)
        keys = k_cache[i, slot, :, :P].float()  # [nkv, P, D]
        values = v_cache[i, slot, :, :P].float()
        scores = q.reshape(nkv, nh // nkv, D) @ keys.transpose(1, 2) * D**-0.5  # [nkv, rep, P]
        attn = (scores.softmax(-1) @ values).reshape(-1)
        xres = xres + _dense(p.o) @ attn
        h = _rms(xres, p.post_norm, eps)
        gate, up = (_dense(p.gate_up) @ h).chunk(2)
        xres = xres + _dense(p.down) @ (F.silu(gate) * up)
    return _rms(xres, stack.norm, eps)


class KernelTensors:
    """The kernel's inputs from a PackedStack: the FP8 weights and row scales by address
    (int64 [L, 4]: qkv, o, gate_up, down; the stack keeps them alive: held here too), the
    norms in fp32 ([L, 2 hidden + 2 head_dim]: input, post, q, k; 0.5 MiB for 28 layers),
    the final norm and RoPE's inverse frequencies."""

    def __init__(self, stack: PackedStack, device: torch.device):
        why = unsupported(stack)
        if why:
            raise ValueError(f"the one-kernel talker step does not take this stack: {why}")
        c = stack.cfg
        self.stack = stack
        lin = stack.linears()  # layer by layer: qkv, o, gate_up, down, the kernel's order
        self.wptr = torch.tensor([d.weight.data_ptr() for d in lin], dtype=torch.int64,
                                 device=device).reshape(-1, 4)  # fmt: skip
        self.sptr = torch.tensor([d.scale.data_ptr() for d in lin], dtype=torch.int64,
                                 device=device).reshape(-1, 4)  # fmt: skip
        self.norms = torch.stack([
            torch.cat([p.input_norm.float(), p.post_norm.float(), p.q_norm.float(),
                       p.k_norm.float()]) for p in stack.layers
        ]).to(device).contiguous()  # fmt: skip
        self.final_norm = stack.norm.float().to(device).contiguous()
        self.inv_freq = inv_freq(c.head_dim, c.rope_theta, torch.device(device)).contiguous()
        self.eps = float(c.rms_norm_eps)


def scratch_floats(S: int) -> int:
    """The kernel's fp32 working buffer for a cache of S positions: qkv, attention output, o,
    act, d and the attention partials (talker_step.cu)."""
    s = SHAPE
    chunks = -(-S // CHUNK)
    qkv = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    return qkv + 3 * s["hidden"] + s["intermediate"] + s["kv_heads"] * chunks * PART


def extension():
    """The kernel's extension, compiled for sm_90a on first use (cached by
    torch.utils.cpp_extension across processes)."""
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]
    return load(name="ttsbuild_talker_step", sources=[str(SOURCE)], verbose=False,
                extra_cuda_cflags=flags)  # fmt: skip


class TalkerStep:
    """The talker's decode step at batch 1 on the kernel: `__call__(x [1, hidden] bf16,
    k_cache, v_cache, slots [1] int64, positions [1] int64)` -> the final-norm hidden
    [1, hidden] bf16 (a buffer of this instance's), k and v written at the position, as
    `PackedStack.decode` does. Capturable in a CUDA graph (no host sync; the slot and
    position are read on the device). dist: stages ahead whose weights are prefetched
    into L2 (0: none)."""

    def __init__(self, stack: PackedStack, max_positions: int, device="cuda",
                 dist: int = 2, ctas: int | None = None):  # fmt: skip
        self.t = KernelTensors(stack, torch.device(device))
        self.ext = extension()
        self.ctas = ctas or torch.cuda.get_device_properties(device).multi_processor_count
        self.dist = dist
        self.scratch = torch.zeros(scratch_floats(max_positions), device=device)
        self.counter = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
        self.out = torch.empty(1, SHAPE["hidden"], dtype=torch.bfloat16, device=device)
        self.max_positions = max_positions

    def __call__(self, x, k_cache, v_cache, slots, positions) -> torch.Tensor:
        if k_cache.shape[3] > self.max_positions:
            raise ValueError(f"cache of {k_cache.shape[3]} positions, scratch for "
                             f"{self.max_positions}")  # fmt: skip
        why = _cache_unsupported(self.t.stack.cfg, k_cache)  # (the stack: checked once)
        if why:
            raise ValueError(why)
        t = self.t
        self.ext.talker_step(x.reshape(-1), self.out, t.wptr, t.sptr, t.norms, t.final_norm,
                             t.inv_freq, k_cache, v_cache, slots.reshape(-1),
                             positions.reshape(-1), self.scratch, self.counter, self.ctas,
                             self.dist, t.eps)  # fmt: skip
        return self.out
