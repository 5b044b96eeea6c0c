"""The fast engine: every request's state lives in device buffers indexed by slot, and each
stage is one CUDA graph per batch bucket.

Per slot (slot `num_slots` is a scratch row that padding rows of a bucket point at):
  talker KV cache [L, slots, Hkv, max_len, D], next position, the talker hidden/logits that
  produce the next codebook 0, codebook-0 history (repetition penalty), frame counter,
  seed and sampling settings, the trailing text track, a ring of generated codes, the
  codec's incremental state, and the guards' state (recent codebook-0 codes, silence run).
Stages (graphs captured at load, replayed with the slots copied into a static index buffer):
  prefill  (one request, padded to a length bucket)
  frame    (codebook 0 sampling + the 15-step code predictor with on-device sampling + the
            next talker step, for B rows: one graph per batch bucket; codes go straight
            into the ring the codec reads)
  codec    (n frames for B rows: gathers the rows' codec state, steps, scatters it back)
The host reads back only the frame's codes with its stop code (EOS or a guard, see
`ttsbuild.generation.guards`) in one copy, and the PCM.
Without CUDA (or with use_graphs=False) the same functions run eagerly: that is the path
CI checks against the reference engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ttsbuild.generation.generate import codebook0_logits_mask
from ttsbuild.generation.guards import (
    GuardConfig,
    GuardState,
    StopCode,
    StopReason,
    frame_stop_codes,
    observe_audio,
)
from ttsbuild.generation.sampling import SamplingBatch, apply_repetition_penalty
from ttsbuild.model.codec import CodecStream
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.runtime.engine import FrameOutput, Models, NoFreeSlot, plan_admission
from ttsbuild.runtime.fast_model import Dense, PackedStack
from ttsbuild.runtime.request import RequestError, SynthesisRequest

log = logging.getLogger(__name__)

SAMPLES_PER_FRAME = 1920
NEVER = 2**62  # a frame count no request reaches: EOS is never allowed (stand-ins)


@dataclass(frozen=True)
class RuntimeConfig:
    """Static shapes of an engine: every captured graph is listed here."""

    num_slots: int = 32
    max_len: int = 2048  # talker positions per slot (prompt + frames)
    max_text: int = 1024  # trailing text positions per slot (streaming text mode)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    codec_chunks: tuple[int, ...] = (1, 2, 4, 8, 16)  # frames per codec step
    codec_ring: int = 64  # frames buffered per slot between frames() and audio()
    precision: str = "bf16"  # talker linears: "bf16" | "fp8" (weight-only e4m3)
    code_predictor_fp8: bool = False
    use_graphs: bool | None = None  # None: on CUDA

    def __post_init__(self):
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"precision must be bf16 or fp8, got {self.precision!r}")
        if max(self.batch_buckets) < 1 or sorted(self.batch_buckets) != list(self.batch_buckets):
            raise ValueError("batch_buckets must be ascending positive sizes")
        if max(self.codec_chunks) > self.codec_ring:
            raise ValueError("codec_ring must hold the largest codec chunk")

    def bucket(self, n: int) -> int:
        for b in self.batch_buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest bucket {self.batch_buckets[-1]}")


@dataclass
class HostSlot:
    """What the host keeps per slot: request bookkeeping, no tensors."""

    request: SynthesisRequest
    seed: int
    frame_limit: int
    limit_reason: StopReason  # why frame_limit ends the request when reached
    frames: int = 0
    decoded: int = 0
    finished: bool = False
    stopped_by: StopReason | None = None


class GraphEngine:
    """Engine API (admit / prefill / frames / audio / release) over slot-indexed buffers."""

    def __init__(
        self, models: Models, rcfg: RuntimeConfig | None = None, guards: GuardConfig | None = None
    ):
        rcfg = rcfg or RuntimeConfig()
        self.models, self.rcfg = models, rcfg
        self.guards = guards or GuardConfig()
        cfg = self.cfg = models.cfg
        talker, cp = models.talker, models.code_predictor
        dev = self.device = talker.codec_head.weight.device
        self.dtype = talker.codec_head.weight.dtype
        self.num_slots = rcfg.num_slots
        self.max_len = rcfg.max_len
        self.use_graphs = (dev.type == "cuda") if rcfg.use_graphs is None else rcfg.use_graphs
        fp8 = rcfg.precision == "fp8"
        G, V, H = cfg.num_code_groups, cfg.codec_vocab_size, cfg.talker.hidden_size
        S = rcfg.num_slots + 1  # + the scratch slot
        self.scratch = rcfg.num_slots

        # -- weights ----------------------------------------------------------------------
        packed = models.packed
        if packed is not None:
            # A compiled engine: its weights as compiled (the precision is the engine's).
            self.talker_stack = PackedStack.from_packed(cfg.talker, packed["talker"])
            self.cp_stack = PackedStack.from_packed(cfg.code_predictor, packed["code_predictor"])
        else:
            self.talker_stack = PackedStack.from_module(talker.model, fp8)
            self.cp_stack = PackedStack.from_module(cp.model, rcfg.code_predictor_fp8)
        self.codec_head = Dense(talker.codec_head.weight.detach())
        self.cp_heads = [Dense.make(h.weight.detach(), rcfg.code_predictor_fp8) for h in cp.lm_head]
        self.cp_proj = cp.small_to_mtp_projection
        self.codec_embedding = talker.model.codec_embedding.weight.detach()  # [V, H]
        # Codebooks 1..15 input embeddings stacked: [G - 1, codebook_size, H]
        self.cp_embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])

        # -- per-slot state ---------------------------------------------------------------
        t = cfg.talker
        kv_shape = (t.num_layers, S, t.num_kv_heads, rcfg.max_len, t.head_dim)
        self.kv_k = torch.zeros(kv_shape, dtype=self.dtype, device=dev)
        self.kv_v = torch.zeros(kv_shape, dtype=self.dtype, device=dev)
        c = cfg.code_predictor
        bmax = rcfg.batch_buckets[-1]
        cp_shape = (c.num_layers, bmax, c.num_kv_heads, G, c.head_dim)
        self.cp_k = torch.zeros(cp_shape, dtype=self.dtype, device=dev)
        self.cp_v = torch.zeros(cp_shape, dtype=self.dtype, device=dev)
        self.cp_slots = torch.arange(bmax, device=dev)
        self.cp_positions = [torch.full((bmax,), i, device=dev) for i in range(G)]

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.position = zeros(S, dtype=torch.int64)
        self.hidden = zeros(S, H, dtype=self.dtype)
        self.logits = zeros(S, V)
        self.history = zeros(S, V, dtype=torch.bool)
        self.frame_idx = zeros(S, dtype=torch.int64)
        self.eos_min_frames = zeros(S, dtype=torch.int64)
        self.seed = zeros(S, dtype=torch.int64)
        self.talker_sampling = _sampling_buffers(S, dev)
        self.cp_sampling = _sampling_buffers(S, dev)
        self.text_track = zeros(S, rcfg.max_text, H, dtype=self.dtype)
        self.text_len = zeros(S, dtype=torch.int64)
        self.codes = zeros(S, G, rcfg.codec_ring, dtype=torch.int64)
        self.decoded = zeros(S, dtype=torch.int64)
        self.guard_state = GuardState.zeros(S, self.guards, dev)
        self.suppressed = codebook0_logits_mask(cfg, V, dev)
        self.true = torch.ones((), dtype=torch.bool, device=dev)
        self.eos_onehot = torch.zeros(V, dtype=torch.bool, device=dev)
        self.eos_onehot[cfg.codec_ids.eos] = True
        with torch.no_grad():
            self.tts_pad = talker.embed_text(torch.tensor([cfg.text_ids.tts_pad], device=dev))[0]

        # The codec's incremental state for every slot, plus a work stream per batch bucket.
        self.codec_store = CodecStream(models.codec, S)
        self.codec_work = {b: CodecStream(models.codec, b) for b in rcfg.batch_buckets}

        # -- static I/O of the graphs -----------------------------------------------------
        self.rows_in = torch.full((bmax,), self.scratch, dtype=torch.int64, device=dev)
        self.frame_out = zeros(bmax, G + 1, dtype=torch.int64)  # codes, then the StopCode
        maxc = max(rcfg.codec_chunks)
        self.pcm_out = zeros(bmax, maxc * SAMPLES_PER_FRAME)
        pmax = rcfg.prefill_buckets[-1]
        self.prefill_embeds = zeros(1, pmax, H, dtype=self.dtype)
        self.prefill_slot = torch.full((1,), self.scratch, dtype=torch.int64, device=dev)
        self.prefill_last = zeros(1, dtype=torch.int64)

        self.host: dict[int, HostSlot] = {}
        self.pending_prompts: dict[int, torch.Tensor] = {}  # slot -> prompt embeds [T, H]
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self.capture()

    # -- stage bodies (fixed shapes, no host sync) -------------------------------------------
    def _embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the frame's 16 code embeddings: [B, G] -> [B, H]."""
        G = self.cfg.num_code_groups
        x = self.codec_embedding[codes[:, 0]]
        books = torch.arange(G - 1, device=codes.device)
        return x + self.cp_embeddings[books[None, :], codes[:, 1:]].sum(1)

    def _code_predictor(self, hidden, c0, sampling, seeds, frames) -> torch.Tensor:
        """Codebooks 1..15 for B rows with on-device sampling: [B, G]."""
        B, G = hidden.shape[0], self.cfg.num_code_groups
        slots = self.cp_slots[:B]
        x = torch.stack([hidden, self.codec_embedding[c0]], dim=1)  # [B, 2, H]
        h = self.cp_stack.prefill(self.cp_proj(x), self.cp_k, self.cp_v, slots)[:, -1]
        codes = [c0]
        for cb in range(1, G):
            logits = self.cp_heads[cb - 1](h).float()
            code = fused_sample(logits, sampling, seeds, frames * G + cb)
            codes.append(code)
            if cb + 1 < G:
                e = self.cp_proj(self.cp_embeddings[cb - 1][code])
                h = self.cp_stack.decode(
                    e, self.cp_k, self.cp_v, slots, self.cp_positions[cb + 1][:B]
                )
        return torch.stack(codes, dim=1)

    def _frame_body(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for `rows` (slots): returns the codes [B, G] (also left in the ring) and
        each row's StopCode [B]."""
        G = self.cfg.num_code_groups
        fi, seeds = self.frame_idx[rows], self.seed[rows]
        tsamp = self.talker_sampling.select(rows)
        logits = apply_repetition_penalty(
            self.logits[rows], self.history[rows], tsamp.repetition_penalty
        )
        eos_banned = (fi < self.eos_min_frames[rows])[:, None] & self.eos_onehot[None]
        logits = logits.masked_fill(self.suppressed[None] | eos_banned, float("-inf"))
        c0 = fused_sample(logits, tsamp, seeds, fi * G)
        codes = self._code_predictor(
            self.hidden[rows], c0, self.cp_sampling.select(rows), seeds, fi
        )
        self.history.index_put_((rows, c0), self.true)  # a device scalar: no host copy
        stop = frame_stop_codes(self.guard_state, self.guards, rows, c0, self.cfg.codec_ids.eos)
        self.codes[rows, :, fi % self.rcfg.codec_ring] = codes
        self.frame_idx[rows] = fi + 1

        text_pos = fi.clamp(max=self.rcfg.max_text - 1)
        text = torch.where(
            (fi < self.text_len[rows])[:, None], self.text_track[rows, text_pos], self.tts_pad
        )
        x = self._embed_frame(codes) + text
        pos = self.position[rows].clamp(max=self.max_len - 1)
        h = self.talker_stack.decode(x, self.kv_k, self.kv_v, rows, pos)
        self.hidden[rows] = h
        self.logits[rows] = self.codec_head(h).float()
        self.position[rows] = pos + 1
        return codes, stop

    def _prefill_body(self, length: int) -> None:
        slot = self.prefill_slot
        embeds = self.prefill_embeds[:, :length]
        h = self.talker_stack.prefill(embeds, self.kv_k, self.kv_v, slot)[0]  # [T, H]
        last = h.index_select(0, self.prefill_last)  # [1, H]
        self.hidden[slot] = last
        self.logits[slot] = self.codec_head(last).float()

    def _codec_body(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """n frames of audio for each of `rows`: [B, n * 1920] (fp32)."""
        work = self.codec_work[rows.shape[0]]
        store = self.codec_store
        for w, s in zip(work.tensors(), store.tensors(), strict=True):
            w.copy_(s[rows])
        ring = self.rcfg.codec_ring
        idx = (self.decoded[rows][:, None] + torch.arange(n, device=rows.device)) % ring
        groups = torch.arange(self.cfg.num_code_groups, device=rows.device)
        codes = self.codes[rows[:, None, None], groups[None, :, None], idx[:, None, :]]
        wav = work.step(codes)  # [B, 1, n * 1920]
        for w, s in zip(work.tensors(), store.tensors(), strict=True):
            s[rows] = w
        self.decoded[rows] += n
        if self.guards.silence:
            observe_audio(self.guard_state, self.guards, rows, wav[:, 0])
        return wav[:, 0]

    # -- graphs ----------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every graph listed in the RuntimeConfig (warm-up runs hit the scratch slot)."""
        pool = torch.cuda.graph_pool_handle()
        r = self.rcfg
        for b in r.batch_buckets:
            rows, out = self.rows_in[:b], self.frame_out[:b]
            self.graphs[("frame", b)] = _capture(
                lambda rows=rows, out=out: _write_frame(out, *self._frame_body(rows)), pool
            )
            for n in r.codec_chunks:
                pcm = self.pcm_out[:b, : n * SAMPLES_PER_FRAME]
                self.graphs[("codec", b, n)] = _capture(
                    lambda rows=rows, n=n, pcm=pcm: pcm.copy_(self._codec_body(rows, n)), pool
                )
        for t in r.prefill_buckets:
            self.graphs[("prefill", t)] = _capture(lambda t=t: self._prefill_body(t), pool)
        self._reset_scratch()
        log.info("captured %d CUDA graphs", len(self.graphs))

    def _reset_scratch(self) -> None:
        # Padding rows advance the scratch slot on every replay; its positions are clamped
        # (talker, text track) or wrap (code ring), so it never needs resetting for safety.
        s = self.scratch
        self.codec_store.reset([s])
        for buf in (self.position, self.frame_idx, self.decoded, self.text_len):
            buf[s] = 0

    # -- engine API --------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.num_slots - len(self.host)

    def admit(self, req: SynthesisRequest) -> int:
        plan = plan_admission(self.models, req, self.max_len, self.guards)
        prompt, params = plan.prompt, plan.params
        n_prompt, n_text = prompt.embeds.shape[0], prompt.trailing_text.shape[0]
        if n_text > self.rcfg.max_text:
            raise RequestError(
                f"text is too long for this engine ({n_text} > {self.rcfg.max_text} tokens)"
            )
        free = [s for s in range(self.num_slots) if s not in self.host]
        if not free:
            raise NoFreeSlot(f"all {self.num_slots} slots are busy")
        slot = free[0]
        seed = plan.seed
        self.host[slot] = HostSlot(req, seed, plan.frame_limit, plan.limit_reason)

        dev = self.device
        self.position[slot] = n_prompt
        self.frame_idx[slot] = 0
        self.decoded[slot] = 0
        self.history[slot] = False
        self.seed[slot] = seed
        self.eos_min_frames[slot] = NEVER if plan.by_length_rule else params.min_new_tokens
        _set_sampling(self.talker_sampling, slot, params.talker, dev)
        _set_sampling(self.cp_sampling, slot, params.code_predictor, dev)
        self.text_track[slot, :n_text] = prompt.trailing_text.to(self.dtype)
        self.text_len[slot] = n_text
        self.codec_store.reset([slot])
        self.guard_state.reset([slot])
        self.pending_prompts[slot] = prompt.embeds
        return slot

    def release(self, slot: int) -> None:
        self.host.pop(slot, None)
        self.pending_prompts.pop(slot, None)

    def seed_of(self, slot: int) -> int:
        return self.host[slot].seed

    @torch.no_grad()
    def prefill(self, slots: list[int]) -> None:
        for slot in slots:
            embeds = self.pending_prompts.pop(slot)
            n = embeds.shape[0]
            bucket = next((t for t in self.rcfg.prefill_buckets if t >= n), None)
            self.prefill_slot.fill_(slot)
            self.prefill_last.fill_(n - 1)
            if self.use_graphs and bucket is not None:
                self.prefill_embeds[0, :n] = embeds.to(self.dtype)
                self.prefill_embeds[0, n:bucket] = 0
                self.graphs[("prefill", bucket)].replay()
            else:
                self._prefill_eager(embeds[None].to(self.dtype))

    def _prefill_eager(self, embeds: torch.Tensor) -> None:
        h = self.talker_stack.prefill(embeds, self.kv_k, self.kv_v, self.prefill_slot)[0]
        last = h.index_select(0, self.prefill_last)
        self.hidden[self.prefill_slot] = last
        self.logits[self.prefill_slot] = self.codec_head(last).float()

    @torch.no_grad()
    def frames(self, slots: list[int]) -> list[FrameOutput]:
        if not slots:
            return []
        if any(self.host[s].finished for s in slots):
            raise RuntimeError("frames() on a finished slot")
        B = len(slots)
        if self.use_graphs:
            bucket = self.rcfg.bucket(B)
            self.rows_in[:B] = torch.tensor(slots, device=self.device)
            self.rows_in[B:bucket] = self.scratch
            self.graphs[("frame", bucket)].replay()
        else:
            rows = torch.tensor(slots, device=self.device)
            _write_frame(self.frame_out[:B], *self._frame_body(rows))
        # The step's only host copy (codes and stop codes); a copy on the CPU too, since the
        # rows handed out must outlive the buffer's next use.
        out = self.frame_out[:B].to("cpu", copy=True)
        return [self._commit_frame(slot, row) for slot, row in zip(slots, out, strict=True)]

    def _commit_frame(self, slot: int, row: torch.Tensor) -> FrameOutput:
        """Host bookkeeping of one row's frame: [G codes, StopCode]."""
        st = self.host[slot]
        stop = StopCode(int(row[-1]))
        if stop is not StopCode.CONTINUE:  # the stopping frame is dropped
            st.finished, st.stopped_by = True, stop.reason
            return FrameOutput(slot, None, True)
        st.frames += 1
        if st.frames >= st.frame_limit:
            st.finished, st.stopped_by = True, st.limit_reason
        return FrameOutput(slot, row[:-1], st.finished)

    @torch.no_grad()
    def audio(self, slots: list[int], max_frames: int | None = None) -> dict[int, np.ndarray]:
        """Decode each slot's pending frames (at most max_frames) in the chunk sizes listed
        in the RuntimeConfig, batching slots that need the same chunk."""
        pieces: dict[int, list[np.ndarray]] = {s: [] for s in slots}
        todo = {}
        for s in slots:
            st = self.host[s]
            n = st.frames - st.decoded
            if max_frames is not None:
                n = min(n, max_frames)
            if n > self.rcfg.codec_ring:
                raise RuntimeError(
                    f"slot {s} has {n} undecoded frames; the ring holds "
                    f"{self.rcfg.codec_ring}: call audio() more often"
                )
            todo[s] = n
        for chunk in sorted(self.rcfg.codec_chunks, reverse=True):
            while True:
                ready = [s for s, n in todo.items() if n >= chunk]
                if not ready:
                    break
                for i in range(0, len(ready), self.rcfg.batch_buckets[-1]):
                    group = ready[i : i + self.rcfg.batch_buckets[-1]]
                    pcm = self._run_codec(group, chunk)
                    for j, s in enumerate(group):
                        pieces[s].append(pcm[j])
                        todo[s] -= chunk
                        self.host[s].decoded += chunk
        return {
            s: np.concatenate(p) if p else np.zeros(0, dtype=np.float32) for s, p in pieces.items()
        }

    def _run_codec(self, slots: list[int], n: int) -> np.ndarray:
        B = len(slots)
        if self.use_graphs:
            bucket = self.rcfg.bucket(B)
            self.rows_in[:B] = torch.tensor(slots, device=self.device)
            self.rows_in[B:bucket] = self.scratch
            self.graphs[("codec", bucket, n)].replay()
            return self.pcm_out[:B, : n * SAMPLES_PER_FRAME].cpu().numpy()
        rows = torch.tensor(slots, device=self.device)
        if B not in self.codec_work:
            self.codec_work[B] = CodecStream(self.models.codec, B)
        return self._codec_body(rows, n).float().cpu().numpy()

    def pending_frames(self, slot: int) -> int:
        st = self.host[slot]
        return st.frames - st.decoded

    def is_finished(self, slot: int) -> bool:
        return self.host[slot].finished

    def frames_of(self, slot: int) -> int:
        return self.host[slot].frames

    def stopped_by(self, slot: int) -> str | None:
        return self.host[slot].stopped_by


# -- helpers -------------------------------------------------------------------------------


def _sampling_buffers(n: int, dev) -> SamplingBatch:
    return SamplingBatch(
        do_sample=torch.zeros(n, dtype=torch.bool, device=dev),
        temperature=torch.ones(n, device=dev),
        top_k=torch.zeros(n, dtype=torch.int64, device=dev),
        top_p=torch.ones(n, device=dev),
        repetition_penalty=torch.ones(n, device=dev),
    )


def _set_sampling(buf: SamplingBatch, slot: int, params, dev) -> None:
    buf.do_sample[slot] = params.do_sample
    buf.temperature[slot] = params.temperature
    buf.top_k[slot] = params.top_k
    buf.top_p[slot] = params.top_p
    buf.repetition_penalty[slot] = params.repetition_penalty


def _write_frame(out: torch.Tensor, codes: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """Pack a frame step's results into one buffer so the host copies them back at once."""
    out[:, :-1] = codes
    out[:, -1] = stop
    return out


def _capture(fn, pool) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: allocator, Triton autotuning, cuBLAS handles
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph
