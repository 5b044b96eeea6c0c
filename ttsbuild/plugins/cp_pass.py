"""One code-predictor pass in one launch: the persistent kernel's weights, buffers and launcher.

A pass is projection -> every decoder layer -> (optionally) the head, for B rows at one cache
position: on the fused path that is 2 + 5 L launches (27 for the 5-layer code predictor); here
it is one (`plugins/_tl/cp_pass.py`: a program per SM, grid barriers between stages). The
arithmetic is `fused_linear`'s and `qk_norm_rope_attend`'s, so `PassWeights.reference` (the
fused functions in order) is what it is checked against.

The layer weights are stacked [L, ...] once, and the PackedStack's layers are re-pointed at
views of the stacks, so no weight is held twice.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ttsbuild.plugins._dispatch import bulk_prefetchable, interpret_mode, want_triton
from ttsbuild.plugins._tl.fp8_linear import _num_sms
from ttsbuild.plugins.fused_linear import fused_linear, norm_linear
from ttsbuild.plugins.qk_norm_rope import inv_freq
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS

_LOG2E = 1.4426950408889634
_FIELDS = ("input_norm", "q_norm", "k_norm", "post_norm")
_DENSE = ("qkv", "o", "gate_up", "down")
_BARRIERS: dict[torch.device, torch.Tensor] = {}
# Each program brings its tiles of the next two stages' weights into L2 while the current
# stage runs (`cp.async.bulk.prefetch.L2`, sm_90): a stage after the grid barrier then reads
# its weights from L2, not HBM. The 2026-11-30 profile: a stage's own work ~5 us against ~1 us
# of weight streaming, a few dependent memory round trips. Off until timed on the GPU
# (TTSBUILD_CP_PASS_PREFETCH=1 turns it on; read at each launch).
PREFETCH = os.environ.get("TTSBUILD_CP_PASS_PREFETCH", "0") == "1"
# The qkv stage's programs count their tiles per KV group and the one that writes a group's
# last tile attends it for every row (norm_linear_attend's protocol), so the attention stage
# and one grid barrier per layer go (5 of a pass's 27 barriers; one costs ~1.9 us on the H200).
# Off until timed on the GPU (TTSBUILD_CP_PASS_ATTEND_IN_QKV=1; read at each launch).
ATTEND_IN_QKV = os.environ.get("TTSBUILD_CP_PASS_ATTEND_IN_QKV", "0") == "1"
_GROUP_COUNTERS: dict[torch.device, torch.Tensor] = {}
# The counting grid barrier (`_tl.cp_pass._grid_sync_count`): one atomic per program per
# barrier and a wait for the count, instead of the generation barrier's arrival, reset and
# flip (1.86 us a barrier alone on the H200, 2026-11-30). Off until timed on the GPU
# (TTSBUILD_CP_PASS_COUNT_BARRIER=1; read at each launch).
COUNT_BARRIER = os.environ.get("TTSBUILD_CP_PASS_COUNT_BARRIER", "0") == "1"


@dataclass
class PassWeights:
    """A decoder stack's layer tensors stacked [L, ...], plus the pass's projection."""

    stack: object  # the PackedStack, its layers views of `stacked`
    stacked: dict[str, torch.Tensor]  # input_norm [L, H], qkv [L, Nqkv, H], qkv_scale, ...
    proj_weight: torch.Tensor | None  # [H, K_src]: small_to_mtp_projection (None: identity)
    proj_bias: torch.Tensor | None

    @property
    def cfg(self):  # DecoderStackConfig
        return self.stack.cfg

    @property
    def norm(self) -> torch.Tensor:  # [H] final norm
        return self.stack.norm

    @classmethod
    def from_stack(cls, stack, proj_weight=None, proj_bias=None) -> PassWeights:
        """Stack the layers' tensors and re-point the stack's layers at views of them."""
        stacked = {}
        for name in _FIELDS:
            stacked[name] = torch.stack([getattr(p, name) for p in stack.layers])
            for i, p in enumerate(stack.layers):
                setattr(p, name, stacked[name][i])
        for name in _DENSE:
            dense = [getattr(p, name) for p in stack.layers]
            stacked[name] = torch.stack([d.weight for d in dense])
            if dense[0].scale is not None:
                stacked[f"{name}_scale"] = torch.stack([d.scale for d in dense])
            for i, d in enumerate(dense):
                d.weight = stacked[name][i]
                if d.scale is not None:
                    d.scale = stacked[f"{name}_scale"][i]
        return cls(stack, stacked, proj_weight, proj_bias)

    @property
    def fp8(self) -> bool:
        return "qkv_scale" in self.stacked

    # -- the reference: the fused path's functions in order --------------------------------
    def reference(self, src, idx, pos, k_cache, v_cache, slots, head=None):
        """(x [B, H] after the layers, logits [B, V] fp32 or None): what `run` computes: the
        projection, runtime.cp_fused.decode_fused's layers, the head."""
        from ttsbuild.runtime.cp_fused import decode_fused  # (cp_fused imports this module)

        eps = self.cfg.rms_norm_eps
        if self.proj_weight is None:
            x = src if idx is None else src[idx]
        else:
            x = fused_linear(src, self.proj_weight, index=idx, bias=self.proj_bias)
        positions = torch.full((x.shape[0],), pos, dtype=torch.int64, device=x.device)
        x = decode_fused(self.stack, x, k_cache, v_cache, slots, positions, final_norm=False)
        logits = None
        if head is not None:
            logits = norm_linear(x, self.norm, head.weight, head.scale, eps=eps,
                                 out_dtype=torch.float32)  # fmt: skip
        return x, logits


class PassBuffers:
    """The kernel's activations between stages, for up to `rows` rows."""

    def __init__(self, w: PassWeights, rows: int, vocab: int, dtype, device):
        c = w.cfg
        nqkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.x = torch.zeros(rows, c.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(rows, nqkv, dtype=dtype, device=device)
        self.attn = torch.zeros(rows, c.num_heads * c.head_dim, dtype=dtype, device=device)
        self.act = torch.zeros(rows, c.intermediate_size, dtype=dtype, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.rows = torch.arange(rows, device=device)  # the gather index of "no index"


def run_pass(
    w: PassWeights,
    bufs: PassBuffers,
    src: torch.Tensor,  # [rows or table, K_src]: what the projection reads
    idx: torch.Tensor | None,  # [B] rows of src (None: rows 0..B-1)
    pos: int,  # the cache position every row writes
    k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    head=None,  # Dense: also the logits (bufs.logits[:B])
    *,
    use_triton: bool | None = None,
    num_programs: int | None = None,
    num_warps: int = 8,
    race_stages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass; returns views (x [B, H], logits [B, V] or None) of the buffers.
    num_programs (at most the SM count), num_warps and race_stages are for the benchmark:
    race_stages=True drops the grid barriers, so the stages race and the result is garbage,
    which times the stages' own work (benchmarks/kernels/bench_barrier.py)."""
    B = slots.shape[0]
    if not want_triton(src, use_triton):
        x, logits = w.reference(src, idx, pos, k_cache, v_cache, slots, head)
        bufs.x[:B] = x
        if logits is not None:
            bufs.logits[:B] = logits
        return bufs.x[:B], (None if head is None else bufs.logits[:B])
    from ttsbuild.plugins._tl.cp_pass import STAGES_PER_LAYER, cp_pass_kernel

    c = w.cfg
    S, D = k_cache.shape[-2], k_cache.shape[-1]
    idx = None if idx is None else idx.contiguous()  # the kernel reads idx[m] at idx_ptr + m
    slots = slots.contiguous()
    if S > MAX_POSITIONS or B > bufs.x.shape[0] or k_cache.stride() != v_cache.stride():
        raise ValueError("cache or batch outside the persistent pass's limits")
    if w.proj_weight is not None and src.shape[1] != w.proj_weight.shape[1]:
        raise ValueError("src width does not match the projection")
    interp = interpret_mode()
    dev = src.device
    group = c.num_heads // c.num_kv_heads
    bm = 1 if B == 1 else max(16, 1 << (B - 1).bit_length())
    st = w.stacked
    dummy = bufs.x
    last = 1 + STAGES_PER_LAYER.value * c.num_layers + (1 if head is not None else 0)
    nprog = num_programs or (4 if interp else _num_sms(dev))  # at most one program per SM
    args = (
        src, idx if idx is not None else bufs.rows,
        w.proj_weight if w.proj_weight is not None else dummy,
        w.proj_bias if w.proj_bias is not None else dummy,
        st["input_norm"], st["qkv"], st.get("qkv_scale", dummy), st["q_norm"], st["k_norm"],
        st["o"], st.get("o_scale", dummy), st["post_norm"], st["gate_up"],
        st.get("gate_up_scale", dummy), st["down"], st.get("down_scale", dummy), w.norm,
        head.weight if head is not None else dummy,
        head.scale if head is not None and head.scale is not None else dummy,
        inv_freq(D, c.rope_theta, dev), slots, k_cache, v_cache,
        bufs.x, bufs.qkv, bufs.attn, bufs.act, bufs.logits, _barrier(dev),
        _group_counters(dev, c.num_kv_heads),
        B, pos,
    )  # fmt: skip
    rest = (
        c.rms_norm_eps, D**-0.5 * _LOG2E,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
    )  # fmt: skip
    H, I, V = c.hidden_size, c.intermediate_size, bufs.logits.shape[1]
    welt = st["qkv"].element_size()
    nqkv = (c.num_heads + 2 * c.num_kv_heads) * D
    src_k = src.shape[1]

    def bn(n, k, elt=welt, halves=1):
        return _block_n(n, k * elt * halves, bm, nprog)

    attend_in_qkv = ATTEND_IN_QKV
    bn_qkv = bn(nqkv, H)
    if attend_in_qkv:  # a qkv tile within one head: it counts toward one KV group
        bn_qkv = math.gcd(bn_qkv, D)

    meta = dict(
        L=c.num_layers, H=H, I=I, V=V,
        HQ=c.num_heads, HKV=c.num_kv_heads, D=D, BLOCK_G=1 << (group - 1).bit_length(),
        BLOCK_S=1 << (S - 1).bit_length(), SRC_K=src_k, STRIDE_SRC=src.stride(0), BM=bm,
        BLOCK_K=256 if bm == 1 else 128,
        BN_PROJ=bn(H, src_k, src.element_size()), BN_QKV=bn_qkv, BN_O=bn(H, c.num_heads * D),
        BN_GU=bn(I, H, halves=2), BN_DOWN=bn(H, I),
        BN_HEAD=bn(V, H, 1 if head is None else head.weight.element_size()),
        HAS_PROJ=w.proj_weight is not None,
        HAS_PBIAS=w.proj_bias is not None, FP8=w.fp8,
        HEAD_FP8=head is not None and head.scale is not None,
        DOT_F32=interp or src.dtype == torch.float32, ATTEND_IN_QKV=attend_in_qkv,
    )  # fmt: skip
    if interp:  # programs run one after another: one launch per stage, no barrier
        for stage in range(last):
            cp_pass_kernel[(nprog,)](*args, stage, stage + 1, *rest, **meta, SYNC=False)
    else:
        sync = not race_stages
        weights = [st[name] for name in _DENSE] + [w.proj_weight]
        weights += [] if head is None else [head.weight]
        prefetch = PREFETCH and all(bulk_prefetchable(t) for t in weights if t is not None)
        cp_pass_kernel[(nprog,)](*args, 0, last, *rest, **meta, SYNC=sync, PREFETCH=prefetch,
                                 HAS_HEAD=head is not None, COUNT_BARRIER=COUNT_BARRIER,
                                 num_warps=num_warps)  # fmt: skip
    return bufs.x[:B], (None if head is None else bufs.logits[:B])


def _block_n(n: int, tile_row_bytes: int, bm: int, nprog: int, max_bytes: int = 65536) -> int:
    """Output columns per tile: about one tile per program (a power of two), at most
    max_bytes of weights per tile (they are all in flight at once: registers), at least 16
    where the tile is a tensor-core MMA (more than one row)."""
    least = 1 if bm == 1 else 16
    b = 1 << max(0, (-(-n // nprog) - 1).bit_length())
    while b > least and b * tile_row_bytes > max_bytes:
        b //= 2
    return max(b, least)


def _group_counters(device: torch.device, groups: int) -> torch.Tensor:
    """ATTEND_IN_QKV's tile counters, one per KV group, each reset by the program that
    completes its group (so zero between stages)."""
    t = _GROUP_COUNTERS.get(device)
    if t is None or t.numel() < groups:
        t = _GROUP_COUNTERS[device] = torch.zeros(max(groups, 64), dtype=torch.int32,
                                                  device=device)  # fmt: skip
    return t


def _barrier(device: torch.device) -> torch.Tensor:
    """The grid barrier's count (word 0) and generation (word 32, its own 128-byte line),
    never reset (see the kernel); the counting barrier's exit word (word 64, a third line).
    Both barriers leave the count at 0 when a launch ends."""
    if device not in _BARRIERS:
        _BARRIERS[device] = torch.zeros(96, dtype=torch.int32, device=device)
    return _BARRIERS[device]
