"""Decode with five fused launches per layer, and the code predictor's frame built on it.

`decode_fused` is `PackedStack.decode` (same arguments, same result) with each layer as
  norm_linear (input norm + qkv) -> qk_norm_rope_attend (q/k norm + RoPE + KV write +
  attention; caches of more than MAX_POSITIONS positions, the talker's, keep qk_norm_rope
  + decode_attention) -> linear_residual (o + add) -> norm_gate_up_silu (post norm + gate/up
  + silu * up) -> linear_residual (down + add)
instead of ~9 launches (`plugins.fused_linear`, `plugins.qk_norm_rope_attend`).
TTSBUILD_CP_ATTEND_IN_QKV=1 makes the first two one launch for the code predictor's caches
(`norm_linear_attend`): four per layer. TTSBUILD_CP_ATTEND_O=1 makes the second and third
one launch instead (`attend_o_residual`: each program attends its KV group itself and
multiplies it by its share of the o projection): four per layer.

`FusedCodePredictor.frame` is one frame of the code predictor (codebooks 1..15 of B rows)
with those layers: the final norm rides in the head GEMV's prologue (logits in fp32 straight
to the fused sampler), the next code's embedding lookup in the projection's prologue, and
the two-token prefill [h_t, E0(c0)] runs as two single-token passes (the same causal
attention, written to the same cache positions, in fewer launches), or with PAIR_PREFILL as
one pass of both tokens. `frame_unfused` is the unfused path, which graph_engine runs where
the plan picks no fused choice.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ttsbuild.generation.sampling import SamplingBatch, draw_counter
from ttsbuild.plugins.attend_o import attend_o_residual
from ttsbuild.plugins.cp_pass import PassBuffers, PassWeights, run_pass
from ttsbuild.plugins.decode_attention import decode_attention
from ttsbuild.plugins.fused_linear import (
    fused_linear,
    linear_residual,
    norm_gate_up_silu,
    norm_linear,
    norm_linear_attend,
    norm_linear_sample,
)
from ttsbuild.plugins.norm_act import rms_norm
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, qk_norm_rope
from ttsbuild.plugins.qk_norm_rope_attend import MAX_POSITIONS, qk_norm_rope_attend
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.runtime.fast_model import Dense, PackedStack

# qkv and attention in one launch (`norm_linear_attend`) for caches of at most MAX_POSITIONS
# positions and batches of at most ATTEND_IN_QKV_MAX_ROWS rows (one program per KV head
# attends every row in turn). Off (TTSBUILD_CP_ATTEND_IN_QKV=0) until timed on the GPU.
ATTEND_IN_QKV = os.environ.get("TTSBUILD_CP_ATTEND_IN_QKV", "0") == "1"
ATTEND_IN_QKV_MAX_ROWS = 8
# Each codebook's head GEMV and its sampler in one launch (`norm_linear_sample`: the program
# that writes the last logits tile samples every row in turn), for batches of at most
# SAMPLE_IN_HEAD_MAX_ROWS rows: 15 launches fewer per frame. Off
# (TTSBUILD_CP_SAMPLE_IN_HEAD=0) until timed on the GPU.
SAMPLE_IN_HEAD = os.environ.get("TTSBUILD_CP_SAMPLE_IN_HEAD", "0") == "1"
SAMPLE_IN_HEAD_MAX_ROWS = 1
# The frame's two-token prefill [h_t, E0(c0)] as one pass of 2B rows (qk_norm_rope_attend
# with tokens=2: the program of a row's KV head runs both tokens in turn) instead of two
# single-token passes: 26 launches fewer per frame, of a chain of ~446 (2.05 ms at batch 1 on
# the H200, 2026-12-04). The same causal attention; the linears run 2B-row tiles. On by
# default since timed on the H200 (bench_switches.py, one process: the frame at 1 / 8 rows
# 2.053 / 2.643 -> 1.986 / 2.530 ms, -3.2 / -4.3 %, the same codes, 2026-12-04);
# TTSBUILD_CP_PAIR_PREFILL=0 turns it off.
PAIR_PREFILL = os.environ.get("TTSBUILD_CP_PAIR_PREFILL", "1") != "0"
# A layer's attention and its o projection + residual add in one launch
# (`plugins.attend_o.attend_o_residual`: split-K over the KV groups, each group's attention
# recomputed by every program of its N tiles) for one-token passes over caches of at most
# MAX_POSITIONS positions and batches of at most ATTEND_O_MAX_ROWS rows: 5 launches (and
# dependent hops) fewer per pass, 70 per frame (14 one-token passes beside the pair pass).
# Off: slower on the H200 (2026-12-04, one process: the frame at 1 / 8 rows +3 / +33 %, the
# attention recomputed in every N tile costing more than the launches it saves;
# benchmarks/kernels/2026-12-04-h200-first-try/). TTSBUILD_CP_ATTEND_O=1 turns it on.
ATTEND_O = os.environ.get("TTSBUILD_CP_ATTEND_O", "0") == "1"
ATTEND_O_MAX_ROWS = 8


def decode_fused(
    stack: PackedStack,
    x: torch.Tensor,  # [B, hidden] one token per row
    k_cache: torch.Tensor,  # [L, slots, Hkv, S, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B]
    *,
    final_norm: bool = True,
    inputs_ready: bool = False,
    tokens: int = 1,
) -> torch.Tensor:
    """PackedStack.decode in five launches per layer. final_norm=False returns the residual
    stream before the final norm (for a consumer that fuses the norm: `norm_linear`).
    inputs_ready: positions and slots were written two or more launches before x's
    projection (qk_norm_rope_attend may then read them, and the cache, early).
    tokens: x holds that many consecutive tokens of the B rows of slots / positions, token by
    token ([tokens * B, hidden], token t of row i at position positions[i] + t), run as one
    pass (`qk_norm_rope_attend(tokens=)`; short caches only).
    An FP8 cache (the talker's under EnginePlan.talker_kv_fp8) takes the long-cache path with
    the stack's k/v scales, as `PackedStack.decode` does; the short-cache kernels read bf16
    caches only."""
    c = stack.cfg
    eps = c.rms_norm_eps
    heads = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, eps=eps, theta=c.rope_theta)
    max_len = k_cache.shape[3]
    if k_cache.dtype == KV_FP8_DTYPE and max_len <= MAX_POSITIONS:
        raise ValueError(f"an FP8 cache takes decode_fused's long-cache path: more than "
                         f"{MAX_POSITIONS} positions, not {max_len}")  # fmt: skip
    if tokens > 1 and max_len > MAX_POSITIONS:
        raise ValueError(f"several tokens per row in one pass need a cache of at most "
                         f"{MAX_POSITIONS} positions, not {max_len}")  # fmt: skip
    attend_in_qkv = (
        ATTEND_IN_QKV and max_len <= MAX_POSITIONS and x.shape[0] <= ATTEND_IN_QKV_MAX_ROWS
        and tokens == 1
    )
    attend_o = (
        ATTEND_O and not attend_in_qkv and max_len <= MAX_POSITIONS and tokens == 1
        and x.shape[0] <= ATTEND_O_MAX_ROWS
    )
    residual = x
    for i, p in enumerate(stack.layers):
        kc, vc = k_cache[i], v_cache[i]
        if attend_o:
            qkv = norm_linear(residual, p.input_norm, p.qkv.weight, p.qkv.scale, eps=eps)
            # the residual was written before the qkv projection: read early under PDL
            residual = attend_o_residual(qkv, p.q_norm, p.k_norm, positions, slots, kc, vc,
                                         p.o.weight, p.o.scale, residual,
                                         inputs_ready=inputs_ready, residual_ready=True,
                                         **heads)  # fmt: skip
        elif attend_in_qkv:
            attn = norm_linear_attend(residual, p.input_norm, p.qkv.weight, p.qkv.scale,
                                      p.q_norm, p.k_norm, positions, slots, kc, vc,
                                      **heads)  # fmt: skip
        else:
            qkv = norm_linear(residual, p.input_norm, p.qkv.weight, p.qkv.scale, eps=eps)
            if max_len <= MAX_POSITIONS:
                attn = qk_norm_rope_attend(qkv, p.q_norm, p.k_norm, positions, slots, kc, vc,
                                           inputs_ready=inputs_ready, tokens=tokens,
                                           **heads)  # fmt: skip
            else:
                kv = stack.kv_cache_args(i, kc)  # ({} for a bf16 cache)
                q = qk_norm_rope(qkv, p.q_norm, p.k_norm, positions, slots, kc, vc, **heads,
                                 **kv)  # fmt: skip
                attn = decode_attention(q, kc, vc, slots, positions + 1, max_len, **kv)
                attn = attn.reshape(x.shape[0], -1)
        if not attend_o:
            # Both residuals were written two or more launches back (the layer input before
            # qkv and attention; o's output before gate/up): read early under PDL.
            residual = linear_residual(attn, p.o.weight, p.o.scale, residual,
                                       residual_ready=True)  # fmt: skip
        act = norm_gate_up_silu(residual, p.post_norm, p.gate_up.weight, p.gate_up.scale, eps=eps)
        residual = linear_residual(act, p.down.weight, p.down.scale, residual,
                                   residual_ready=True)  # fmt: skip
    return rms_norm(residual, stack.norm, eps) if final_norm else residual


def _counters(frames: torch.Tensor, G: int) -> torch.Tensor:
    """[B, G] the sampler's counters of a frame's codebooks (`draw_counter`), made before
    the passes: no small kernel between a head and its sampler."""
    return draw_counter(frames[:, None], G, torch.arange(G, device=frames.device))


class FusedCodePredictor:
    """The code predictor's weights as one frame needs them, and the frame (fused or not)."""

    def __init__(
        self,
        stack: PackedStack,
        heads: list[Dense],  # lm heads of codebooks 1..G-1
        proj: nn.Module,  # small_to_mtp_projection: Linear (with bias) or Identity
        codec_embedding: torch.Tensor,  # [V, talker hidden]: codebook 0's input embedding
        embeddings: torch.Tensor,  # [G - 1, codebook_size, talker hidden]: codebooks 1..G-1
    ):
        self.stack, self.heads, self.proj = stack, heads, proj
        self.codec_embedding, self.embeddings = codec_embedding, embeddings
        self._streams: list[torch.cuda.Stream] = []  # frame_split's, made when first used
        if isinstance(proj, nn.Linear):
            self.proj_weight = proj.weight.detach()
            self.proj_bias = None if proj.bias is None else proj.bias.detach()
        elif isinstance(proj, nn.Identity):
            self.proj_weight = self.proj_bias = None
        else:
            raise TypeError(f"small_to_mtp_projection must be Linear or Identity, got {proj}")

    def enable_persistent(self, max_rows: int) -> None:
        """Make `frame_persistent` available for batches up to max_rows: stacks the layers'
        weights (the stack's layers become views of the stacks: nothing is held twice) and
        allocates the pass kernel's buffers."""
        self.passes = PassWeights.from_stack(self.stack, self.proj_weight, self.proj_bias)
        ref = self.embeddings
        vocab = self.heads[0].weight.shape[0]
        self.pass_buffers = PassBuffers(self.passes, max_rows, vocab, ref.dtype, ref.device)

    @property
    def num_code_groups(self) -> int:
        return len(self.heads) + 1

    def _project(self, table: torch.Tensor, index: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """small_to_mtp_projection(table[index]) (or of table itself), one launch; into out
        where given."""
        if self.proj_weight is None:
            y = table if index is None else table[index]
            return y if out is None else out.copy_(y)
        return fused_linear(table, self.proj_weight, index=index, bias=self.proj_bias, out=out)

    def frame(
        self,
        hidden: torch.Tensor,  # [B, talker hidden]: the talker's last hidden state
        c0: torch.Tensor,  # [B] codebook-0 codes
        sampling: SamplingBatch,
        seeds: torch.Tensor,  # [B]
        frames: torch.Tensor,  # [B] frame index (the sampler's counter base)
        k_cache: torch.Tensor,  # [L, >= slots, Hkv, G, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: list[torch.Tensor],  # G tensors [>= B], positions[i] all i
    ) -> torch.Tensor:
        """Codes [B, G] (codebook 0 = c0), fused kernels throughout."""
        B, G = hidden.shape[0], self.num_code_groups
        eps = self.stack.cfg.rms_norm_eps

        def step(x: torch.Tensor, position: int) -> torch.Tensor:
            pos = positions[position][:B]
            # positions are constants and slots the frame's staged rows: both old
            return decode_fused(self.stack, x, k_cache, v_cache, slots, pos, final_norm=False,
                                inputs_ready=True)  # fmt: skip

        counters = _counters(frames, G)
        if PAIR_PREFILL:  # [h_t, E0(c0)] as one pass of 2B rows, token by token
            x = torch.empty((2 * B, self.stack.cfg.hidden_size), dtype=hidden.dtype,
                            device=hidden.device)  # fmt: skip
            self._project(hidden, None, out=x[:B])
            self._project(self.codec_embedding, c0, out=x[B:])
            residual = decode_fused(self.stack, x, k_cache, v_cache, slots, positions[0][:B],
                                    final_norm=False, inputs_ready=True, tokens=2)[B:]
        else:
            step(self._project(hidden, None), 0)
            residual = step(self._project(self.codec_embedding, c0), 1)
        codes = [c0]
        sample_in_head = SAMPLE_IN_HEAD and B <= SAMPLE_IN_HEAD_MAX_ROWS
        for cb in range(1, G):
            head = self.heads[cb - 1]
            if sample_in_head:
                code = norm_linear_sample(residual, self.stack.norm, head.weight, head.scale,
                                          sampling, seeds, counters[:, cb], eps=eps)  # fmt: skip
            else:
                logits = norm_linear(
                    residual, self.stack.norm, head.weight, head.scale, eps=eps,
                    out_dtype=torch.float32,
                )  # fmt: skip
                code = fused_sample(logits, sampling, seeds, counters[:, cb])
            codes.append(code)
            if cb + 1 < G:
                residual = step(self._project(self.embeddings[cb - 1], code), cb + 1)
        return torch.stack(codes, dim=1)

    def frame_split(
        self, hidden, c0, sampling, seeds, frames, k_cache, v_cache, slots, positions, *,
        rows: int, fused: tuple[int, ...] = (),
    ) -> torch.Tensor:  # fmt: skip
        """The same frame as independent frames of at most `rows` rows each (a row's passes
        read and write only its own cache slot and sampler counters), each part on a CUDA
        stream of its own, forked from the current stream and joined back: inside a graph
        capture, parallel branches. The frame is a chain of ~420 dependent launches whose
        time hardly grows with the rows (latency, not bandwidth), so parts run side by side
        instead of one wide chain. A part takes the fused path where its size is in `fused`,
        the unfused one otherwise. On the CPU the parts run in turn. Not served: on the H200
        (2026-12-04) only two parts gain (16 rows as 2 x 8 fused: 3.31 -> 2.98 ms); from four
        the branches queue behind each other (64 rows as 8 x 8: 7.6 ms against 3.6 unfused;
        benchmarks/kernels/2026-12-04-h200-cp-split/)."""
        B = hidden.shape[0]
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        parts = [slice(i, min(B, i + rows)) for i in range(0, B, rows)]
        codes = torch.empty((B, self.num_code_groups), dtype=torch.int64, device=hidden.device)
        main = torch.cuda.current_stream(hidden.device) if hidden.is_cuda else None
        streams = self._side_streams(len(parts), hidden.device) if main is not None else None
        for i, part in enumerate(parts):
            run = self.frame if part.stop - part.start in fused else self.frame_unfused
            args = (hidden[part], c0[part], sampling.select(part), seeds[part], frames[part],
                    k_cache, v_cache, slots[part], positions)  # fmt: skip
            if streams is None:
                codes[part] = run(*args)
                continue
            streams[i].wait_stream(main)
            with torch.cuda.stream(streams[i]):
                codes[part] = run(*args)
        for stream in streams or ():
            main.wait_stream(stream)
        return codes

    def _side_streams(self, n: int, device: torch.device) -> list[torch.cuda.Stream]:
        """n CUDA streams kept for `frame_split` (made once, reused by every capture)."""
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device))
        return self._streams[:n]

    def frame_persistent(
        self, hidden, c0, sampling, seeds, frames, k_cache, v_cache, slots, positions
    ) -> torch.Tensor:
        """The same frame with each pass (projection + layers + head) one persistent launch
        (plugins.cp_pass) and the sampler one more: 2 launches per codebook. `positions` is
        accepted for the common signature: pass i writes cache position i for every row."""
        B, G = hidden.shape[0], self.num_code_groups
        w, bufs = self.passes, self.pass_buffers

        def step(table, index, position, head=None):
            return run_pass(w, bufs, table, index, position, k_cache, v_cache, slots[:B], head)[1]

        counters = _counters(frames, G)
        step(hidden, None, 0)
        logits = step(self.codec_embedding, c0, 1, self.heads[0])
        codes = [c0]
        for cb in range(1, G):
            code = fused_sample(logits, sampling, seeds, counters[:, cb])
            codes.append(code)
            if cb + 1 < G:
                logits = step(self.embeddings[cb - 1], code, cb + 1, self.heads[cb])
        return torch.stack(codes, dim=1)

    def frame_unfused(
        self, hidden, c0, sampling, seeds, frames, k_cache, v_cache, slots, positions
    ) -> torch.Tensor:
        """The same frame on the unfused kernels (PackedStack.prefill/decode, Dense heads):
        the graph backend's path for buckets without a fused choice."""
        B, G = hidden.shape[0], self.num_code_groups
        counters = _counters(frames, G)
        x = torch.stack([hidden, self.codec_embedding[c0]], dim=1)  # [B, 2, H]
        h = self.stack.prefill(self.proj(x), k_cache, v_cache, slots)[:, -1]
        codes = [c0]
        for cb in range(1, G):
            logits = self.heads[cb - 1](h).float()
            code = fused_sample(logits, sampling, seeds, counters[:, cb])
            codes.append(code)
            if cb + 1 < G:
                e = self.proj(self.embeddings[cb - 1][code])
                h = self.stack.decode(e, k_cache, v_cache, slots, positions[cb + 1][:B])
        return torch.stack(codes, dim=1)

    def frame_logits(
        self,
        hidden: torch.Tensor,  # [B, talker hidden]
        codes: torch.Tensor,  # [B, G]: the frame's codes (codebook 0 and the teacher's 1..G-1)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: list[torch.Tensor],
        fused: bool = True,
    ) -> torch.Tensor:
        """The logits [B, G - 1, codebook_size] (fp32) that `frame` (fused=True) or
        `frame_unfused` samples codebooks 1..G-1 from, each pass fed the given codes instead of
        its own samples (teacher forcing: the FP8 quality gate, `build.quality`). The same
        launches as the frame minus the sampler."""
        B, G = hidden.shape[0], self.num_code_groups
        out = []
        if fused:
            eps = self.stack.cfg.rms_norm_eps

            def step(x: torch.Tensor, position: int) -> torch.Tensor:
                pos = positions[position][:B]
                return decode_fused(self.stack, x, k_cache, v_cache, slots, pos,
                                    final_norm=False, inputs_ready=True)  # fmt: skip

            step(self._project(hidden, None), 0)
            residual = step(self._project(self.codec_embedding, codes[:, 0]), 1)
            for cb in range(1, G):
                head = self.heads[cb - 1]
                out.append(
                    norm_linear(
                        residual,
                        self.stack.norm,
                        head.weight,
                        head.scale,
                        eps=eps,
                        out_dtype=torch.float32,
                    )
                )
                if cb + 1 < G:
                    residual = step(self._project(self.embeddings[cb - 1], codes[:, cb]), cb + 1)
            return torch.stack(out, dim=1)
        x = torch.stack([hidden, self.codec_embedding[codes[:, 0]]], dim=1)  # [B, 2, H]
        h = self.stack.prefill(self.proj(x), k_cache, v_cache, slots)[:, -1]
        for cb in range(1, G):
            out.append(self.heads[cb - 1](h).float())
            if cb + 1 < G:
                e = self.proj(self.embeddings[cb - 1][codes[:, cb]])
                h = self.stack.decode(e, k_cache, v_cache, slots, positions[cb + 1][:B])
        return torch.stack(out, dim=1)
