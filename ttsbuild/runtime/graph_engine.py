"""The fast backend: every request's state lives in device buffers indexed by slot, and each
stage is one CUDA graph per bucket of the engine's plan (`runtime.plan.EnginePlan`).

Per slot (slot `num_slots` is a scratch row that padding rows of a bucket point at):
  talker KV cache [L, slots, Hkv, max_len, D], next position, the talker hidden/logits that
  produce the next codebook 0, codebook-0 history (repetition penalty), frame counter,
  seed, EOS gate and sampling settings, the trailing text track, a ring of generated codes,
  and the codec's incremental state.
Stages (graphs captured at load):
  text     (a request's trailing text track from its staged text ids, per length bucket)
  prefill  (one request, padded to a length bucket: its prompt embeddings built from staged
            ids, its cached prefix KV copied in (runtime.prefix_cache), the rest prefilled)
  frame    (the talker step on each row's previous frame, codebook 0 sampling + the 15-step
            code predictor with on-device sampling, for B rows: one graph per batch bucket;
            codes go straight into the ring the codec reads; a new row's first frame skips
            the talker: its prefill left the logits)
  codec    (n frames for B rows: gathers the rows' codec state, steps, scatters it back)
Each step goes through the C++ step driver: the slot ids are staged in pinned host memory,
the graph is replayed, and the step's codes / PCM are copied into pinned host memory on a
copy stream behind an event, so the host can launch the next step before reading this one.

Two streams (codec_stream=True, the default on CUDA): frame steps run on a high-priority
stream joined to the caller's current stream (prefill and everything else stay in order with
them), codec steps on their own stream, so neither waits behind the other. They share data
only through the code ring and the codec's per-slot state, and are ordered by CUDA events
exactly there (`_RingOrder`):
  - a codec step waits for the frame step that wrote the last frame it decodes (earlier
    frames were written before it on the same stream);
  - a frame step that overwrites a ring entry waits for the codec step that read it (the core
    refuses a frame more than `codec_ring` ahead of decoding, so that step was launched; it is
    long finished in practice and the wait costs nothing);
  - a slot's next occupant is prefilled (which resets the slot's codec state, decode counter
    and guards) only after its previous occupant's last codec step (only a cancelled request
    can still have one in flight).
The admission lane (plan.admission_lane; compile and EnginePlan.default put buckets 1, 2 on
it): a new request's prefill, first frame and first one-frame codec step run on a third
stream, of the highest priority (frame steps of running streams come next, the codec last),
with their own graphs, memory pool, I/O rows and code-predictor cache, so its first audio
waits behind no step of other streams; `_RingOrder` names one step per lane, and a row's next
regular steps follow its steps there. A prompt prefix seen for the first time is prefilled in
the request's own slot, never the scratch slot (padding rows of steps on other lanes write
that one meanwhile).
The silence guard's state is written by codec steps and read by frame steps without an event
(a stop may come one chunk later; see generation.guards). Codec graphs have their own memory
pool and their own input rows: graphs sharing a pool may reuse each other's intermediates and
must never run concurrently. codec_stream=False runs both on the current stream (the old
single-stream engine, for side-by-side measurements).
Weights are the packed (bf16 or FP8) tensors only: the decoder layers are never kept twice.
Without CUDA (or with use_graphs=False) the same bodies run eagerly through the same driver:
that is the path CI checks against the reference backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ttsbuild.generation.generate import codebook0_logits_mask
from ttsbuild.generation.guards import GuardConfig, GuardState, frame_stop_codes, observe_audio
from ttsbuild.generation.prompt import CODES, NO_CODE, PromptEmbedder
from ttsbuild.generation.sampling import SamplingBatch, apply_repetition_penalty, draw_counter
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE
from ttsbuild.plugins.sampling import fused_sample
from ttsbuild.plugins.slot_writes import SlotWrites
from ttsbuild.runtime import l2_persist
from ttsbuild.runtime.codec_engine import CodecEngine
from ttsbuild.runtime.core import EngineCore, SlotPlan
from ttsbuild.runtime.cp_fused import FusedCodePredictor, decode_fused
from ttsbuild.runtime.cp_spec import SpeculativeCodePredictor
from ttsbuild.runtime.driver import make_driver
from ttsbuild.runtime.engine import Models
from ttsbuild.runtime.fast_model import Dense, PackedStack
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.prefix_cache import PrefixPool

# The prefill step's admission work (the new rows' settings, counters, text tracks, codec and
# guard state resets: ~64 small kernels on the 1.7B, 0.19 ms of the 1x32 prefill's 1.85 ms of
# kernel time in the 2026-12-03 profile) on a stream forked inside the captured graph, beside
# the talker's layers, which read none of it; joined before the step ends. Off until timed
# on the GPU (TTSBUILD_PREFILL_FORK=1 turns it on).
PREFILL_FORK = os.environ.get("TTSBUILD_PREFILL_FORK", "0") == "1"
# The same admission work as one launch (plugins.slot_writes: zero the slots' rows of every
# state tensor, write their staged settings) instead of ~60 index_fill_ / index_copy_
# kernels on the prefill's critical path. The same writes. On since 2026-12-04: with the
# prefix copy kernel, the prefill 1x32 / 1x64 1.57 / 1.71 -> 1.40 / 1.55 ms and the idle
# first chunk 5.00 -> 4.70 ms on the H200 (benchmarks/runtime/2026-12-04-h200-admit-fused);
# TTSBUILD_ADMIT_FUSED=0 turns it off.
ADMIT_FUSED = os.environ.get("TTSBUILD_ADMIT_FUSED", "1") == "1"

log = logging.getLogger(__name__)

SAMPLES_PER_FRAME = 1920
STAGING_DEPTH = 8  # steps that may be in flight (launched, not yet read) per stage


@dataclass
class _Staged:
    """One in-flight step: its driver ticket and where its outputs land on the host."""

    ticket: int
    out: torch.Tensor  # host view of the outputs
    index: int  # staging ring entry
    read: bool = False


@dataclass
class _Split:
    """A frame or codec step run as several (admission lane + regular): each part's row
    indices in the step's order, and its step."""

    parts: list[tuple[list[int], _Staged]]
    rows: int


class GreenContextsUnavailable(RuntimeError):
    """This torch or CUDA driver cannot make green contexts (EnginePlan.lane_reserved_sms)."""


class _StagingRing:
    """Host buffers (pinned on CUDA) for the inputs and outputs of in-flight steps, one pair
    per entry: an entry is reused only after its step was read, so an asynchronous copy never
    sees it change. The ring starts with STAGING_DEPTH entries and grows by one when every
    entry belongs to a step not yet read (a codec call can launch one step per chunk size and
    more, and the loop may run several calls ahead): a new entry costs a pinned allocation,
    once; running out would have failed the whole engine."""

    def __init__(self, inputs: tuple, outputs: tuple, pinned: bool):
        self.shapes, self.pinned = (inputs, outputs), pinned
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.inputs_np: list[np.ndarray] = []  # the same memory: numpy writes cost ~1 us
        self.owner: list[_Staged | None] = []
        for _ in range(STAGING_DEPTH):
            self._add()
        self.next = 0
        self._views: dict[tuple, torch.Tensor] = {}  # the launches' views, made once

    def _add(self) -> int:
        def alloc(shape_dtype):
            shape, dtype = shape_dtype
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if self.pinned else t

        self.inputs.append(alloc(self.shapes[0]))
        self.outputs.append(alloc(self.shapes[1]))
        self.inputs_np.append(self.inputs[-1].numpy())
        self.owner.append(None)
        return len(self.owner) - 1

    def input_rows(self, k: int, rows: int) -> torch.Tensor:
        """inputs[k][:rows], one view object per (k, rows)."""
        view = self._views.get((k, rows))
        if view is None:
            view = self._views[(k, rows)] = self.inputs[k][:rows]
        return view

    def output_rows(self, k: int, rows: int, width: int) -> torch.Tensor:
        """The first rows * width values of entry k as a contiguous [rows, width] (one view
        object per (k, rows, width)). Not outputs[k][:rows, :width]: a device-to-host copy into
        a strided view goes through a pageable temporary, and such a copy waits for the step
        on the host (on the H200, codec steps of several rows and fewer frames than the
        widest chunk blocked `launch_audio` 6 ms on average at 20 req/s)."""
        view = self._views.get((k, rows, width))
        if view is None:
            flat = self.outputs[k].view(-1)[: rows * width]
            view = self._views[(k, rows, width)] = flat.view(rows, width)
        return view

    def take(self) -> int:
        """An entry whose step was read (or that never had one), the oldest first."""
        n = len(self.owner)
        for i in range(n):
            k = (self.next + i) % n
            prev = self.owner[k]
            if prev is None or prev.read:
                self.next = (k + 1) % n
                return k
        k = self._add()
        log.info("staging ring grown to %d entries (steps launched and not yet read)", k + 1)
        self.next = 0
        return k


class _AdmitStaging:
    """The inputs of one prefill step of up to `batch` prompts in one int64 block: per row the
    settings (_ADMIT_INTS, then _ADMIT_FLOATS bit-cast as fp32 pairs), then the rows' trailing
    text ids packed [B, Lt] and their prompt rows packed [B, L, width] for the step's (B, L).
    On the device it holds the views the prefill and text graphs read; on the host a ring of
    pinned copies, so staging a step is numpy writes and one asynchronous copy of the block's
    used part. Entry k is rewritten only after its copy ran (an event per entry: waits only
    if the GPU is `depth` prefill steps behind)."""

    def __init__(self, batch: int, max_text: int, max_len: int, width: int,
                 device: torch.device, depth: int = STAGING_DEPTH):  # fmt: skip
        ni, nf = len(_ADMIT_INTS), len(_ADMIT_FLOATS)
        self.batch, self.width, self.ni, self.nf = batch, width, ni, nf
        self.nf64 = (nf + 1) // 2
        self.f0 = batch * ni
        self.t0 = self.f0 + batch * self.nf64
        self.r0 = self.t0 + batch * max_text
        size = self.r0 + batch * max_len * width
        self.block = torch.zeros(size, dtype=torch.int64, device=device)
        self.ints = self.block[: self.f0].view(batch, ni)
        self.floats = self.block[self.f0 : self.t0].view(batch, self.nf64).view(torch.float32)
        self.floats = self.floats[:, :nf]
        self.pinned = device.type == "cuda"
        host = torch.zeros(depth, size, dtype=torch.int64)
        self.host = host.pin_memory() if self.pinned else host
        self.np = self.host.numpy()
        self.events = [torch.cuda.Event() for _ in range(depth)] if self.pinned else None
        self.used = [False] * depth
        self.next = 0

    def trailing_ids(self, b: int, length: int) -> torch.Tensor:
        """The device view [b, length] of the trailing text ids of a (b, length) text step."""
        return self.block[self.t0 : self.t0 + b * length].view(b, length)

    def prompt_rows(self, b: int, length: int) -> torch.Tensor:
        """The device view [b, length, width] of the prompt rows of a (b, length) step."""
        return self.block[self.r0 : self.r0 + b * length * self.width].view(b, length, self.width)

    def stage(self, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]],
              length: int, text_length: int = 0, stream=None) -> None:  # fmt: skip
        """Stage one step: per row (settings: ints [len(_ADMIT_INTS)] and floats
        [len(_ADMIT_FLOATS)], prompt rows [n, width], trailing ids or None), rows padded to
        `length` (text id 0, no x-vector, no codes) and trailing ids zero-padded to
        `text_length`; copy them to the device block on `stream` (the current stream)."""
        k = self.next
        self.next = (k + 1) % len(self.used)
        if self.pinned and self.used[k]:
            self.events[k].synchronize()
        h = self.np[k]
        ints = h[: self.f0].reshape(self.batch, self.ni)
        floats = h[self.f0 : self.t0].view(np.float32).reshape(self.batch, 2 * self.nf64)
        trailing = h[self.t0 : self.t0 + len(rows) * text_length].reshape(len(rows), text_length)
        end = self.r0 + len(rows) * length * self.width
        prompt = h[self.r0 : end].reshape(len(rows), length, self.width)
        for b, (row_ints, row_floats, row_ids, text) in enumerate(rows):
            ints[b] = row_ints
            floats[b, : self.nf] = row_floats
            if text_length:
                n = 0 if text is None else text.shape[0]
                trailing[b, :n] = text if n else 0
                trailing[b, n:] = 0
            n = row_ids.shape[0]
            prompt[b, :n] = row_ids
            prompt[b, n:, :CODES] = 0
            prompt[b, n:, CODES:] = NO_CODE
        self.block[:end].copy_(self.host[k, :end], non_blocking=self.pinned)
        if self.pinned:
            self.events[k].record(stream)  # an explicit stream: no device lookup on this path
            self.used[k] = True


@dataclass(frozen=True)
class _Prepared:
    """A prompt's staging made once, when its request is resolved (`GraphBackend.prepare`):
    the prefill step's inputs but for what depends on the slot and the prefix entry."""

    ids: np.ndarray  # int64 [n, width] prompt rows
    trailing: np.ndarray  # int64 [Lt] trailing text ids
    ints: np.ndarray  # int64 [len(_ADMIT_INTS)]; slot, last, start, prefix entry set at staging
    floats: np.ndarray  # float32 [len(_ADMIT_FLOATS)]
    prefix_len: int = 0  # positions a prefix-pool entry would hold (0: no prefix pool)
    prefix_key: bytes | None = None  # their content (PromptLayout.prefix_key)


@dataclass
class _Admission:
    """A slot admitted and not yet prefilled: its plan and the prefix entry it holds."""

    plan: SlotPlan
    prepared: _Prepared
    prefix_len: int = 0  # positions copied from the prefix pool (0: none)
    entry: object = None  # prefix_cache._Entry held until the prefill is launched
    follow: tuple[int, ...] = ()  # steps its prefill waits for (the slot's last occupant's)


class GraphBackend:
    """The device side of the fast engine (see the module doc)."""

    def __init__(
        self,
        models: Models,
        plan: EnginePlan,
        use_graphs: bool | None = None,
        release_modules: bool = False,
        guards: GuardConfig | None = None,
        codec_stream: bool | None = None,
        kv_scales: list[tuple[float, float]] | None = None,
    ):
        """kv_scales: each talker layer's (k_scale, v_scale) for plan.talker_kv_fp8 where the
        models carry no calibrated ones (a stand-in built in memory; `calibration.calibrate.
        measure_kv_scales`); a compiled engine's own come first."""
        self.models, self.plan = models, plan
        self.guards = guards or GuardConfig()
        cfg = self.cfg = models.cfg
        talker, cp = models.talker, models.code_predictor
        dev = self.device = talker.codec_head.weight.device
        # torch.cuda.current_stream by int index: with a torch.device each call resolves the
        # index first (cProfile on the H200: ~25 us a call on the launch path).
        self._cuda_index = (dev.index if dev.index is not None else torch.cuda.current_device()
                            ) if dev.type == "cuda" else None  # fmt: skip
        self._fork_streams: dict[int, torch.cuda.Stream] = {}  # by the forking stream
        self.dtype = talker.codec_head.weight.dtype
        self.num_slots = plan.num_slots
        self.max_len = plan.max_len
        self.use_graphs = (dev.type == "cuda") if use_graphs is None else use_graphs
        self.num_code_groups = cfg.num_code_groups
        self.eos_id = cfg.codec_ids.eos
        fp8 = plan.precision == "fp8"
        G, V, H = cfg.num_code_groups, cfg.codec_vocab_size, cfg.talker.hidden_size
        S = plan.num_slots + 1  # + the scratch slot
        self.scratch = plan.num_slots
        self._pad_settings = _settings(slot=self.scratch)  # a prefill step's padding rows

        # -- weights ----------------------------------------------------------------------
        packed = models.packed
        if packed is not None:
            # A compiled engine: its weights as compiled (the precision is the engine's).
            self.talker_stack = PackedStack.from_packed(cfg.talker, packed["talker"])
            self.cp_stack = PackedStack.from_packed(cfg.code_predictor, packed["code_predictor"])
        else:
            self.talker_stack = PackedStack.from_module(talker.model, fp8)
            self.cp_stack = PackedStack.from_module(cp.model, plan.code_predictor_fp8)
        if release_modules:
            models.drop_decoder_layers()  # the packed stacks are the only copy from here on
        if plan.talker_kv_fp8:
            if self.talker_stack.kv_scales is None:
                self.talker_stack.kv_scales = kv_scales
            scales = self.talker_stack.kv_scales
            if scales is None or len(scales) != cfg.talker.num_layers:
                raise ValueError("plan.talker_kv_fp8 needs each talker layer's k/v scales: "
                                 "compile the engine with a calibration (--calib)")
        self.codec_head = Dense(talker.codec_head.weight.detach())
        heads_fp8 = plan.cp_heads_are_fp8
        self.cp_heads = [Dense.make(h.weight.detach(), heads_fp8) for h in cp.lm_head]
        self.talker_stack.set_linear_paths(plan, self.cp_stack, self.cp_heads)
        self.cp_proj = cp.small_to_mtp_projection
        self.codec_embedding = talker.model.codec_embedding.weight.detach()  # [V, H]
        # Codebooks 1..15 input embeddings stacked: [G - 1, codebook_size, H]
        self.cp_embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
        if release_modules:
            # the modules' embeddings become views of the stack, and FP8 heads leave no bf16
            # original behind (the module cannot run without its dropped layers anyway): each
            # weight held once
            for i, e in enumerate(cp.model.codec_embedding):
                e.weight = torch.nn.Parameter(self.cp_embeddings[i], requires_grad=False)
            for h, dense in zip(cp.lm_head, self.cp_heads, strict=True):
                if dense.is_fp8:
                    h.weight = torch.nn.Parameter(h.weight.new_empty(0), requires_grad=False)
        # TTSBUILD_CP_L2_PERSIST: the code predictor's linears, read 15 times a frame, partly
        # held in an L2 set-aside (runtime.l2_persist); a window covers one allocation, which
        # cp_megaframe.pack makes where the kernel runs, else an arena made here
        l2_share = l2_persist.env_share() if dev.type == "cuda" else 0.0
        if l2_share and not plan.megaframe_code_predictor:
            linears = _cp_linears(self.cp_stack)
            for d, v in zip(linears, l2_persist.arena([d.weight for d in linears]), strict=True):
                d.weight = v
        self.cp_fused = FusedCodePredictor(
            self.cp_stack, self.cp_heads, self.cp_proj, self.codec_embedding, self.cp_embeddings
        )
        if plan.persistent_code_predictor:
            self.cp_fused.enable_persistent(max(plan.persistent_code_predictor))
        # plan.megaframe_code_predictor: bucket 1's code predictor as one kernel a frame, an
        # instance (its own buffers) for the regular step (unless plan.megaframe_regular is
        # off) and one for the admission lane where it has bucket 1: their steps may run at once
        self.cp_mega: dict[bool, object] = {}
        if plan.megaframe_code_predictor:
            from ttsbuild.runtime import cp_megaframe

            # the kernel reads the engine's own heads, FP8 or bf16 (plan.cp_heads_fp8 off, a
            # bf16 engine's); an fp32 engine's (tests) it takes as a bf16 copy (counted in
            # memory_report's weights)
            own = all(d.weight.dtype in cp_megaframe.HEAD_DTYPES for d in self.cp_heads)
            mega_heads = self.cp_heads if own else [Dense(d.weight.to(torch.bfloat16))
                                                    for d in self.cp_heads]  # fmt: skip
            packed = cp_megaframe.pack(self.cp_stack, mega_heads,
                                       lambda t: self.cp_fused._project(t, None),
                                       self.cp_embeddings, one_allocation=bool(l2_share))
            cp_megaframe.share_weights(packed, self.cp_stack, mega_heads)  # held once
            if own:  # the modules' bf16 heads: the same views
                for h, dense in zip(cp.lm_head, mega_heads, strict=True):
                    if not dense.is_fp8:
                        h.weight = torch.nn.Parameter(dense.weight, requires_grad=False)
            eps = self.cp_stack.cfg.rms_norm_eps
            opts = cp_megaframe.engine_opts()
            first = None  # the instances share their re-laid-out weights
            lanes = (([False] if plan.megaframe_regular else [])
                     + ([True] if 1 in plan.admission_lane else []))
            for lane in lanes:
                first = self.cp_mega[lane] = cp_megaframe.Megaframe(packed, eps, opts=opts,
                                                                    like=first)
        # With the kernel on both paths, a bucket-1 step never starts it while the other
        # path's may still run (each instance takes every SM, so the second would wait for
        # the first: a new request's first chunk beside one stepping row took 6.53 ms against
        # 5.54 without the kernel and 5.08 with it on the lane only, H100,
        # benchmarks/runtime/2026-12-05-h100-megaframe-served): it takes the fused path then,
        # a graph captured beside (an "alternate"). path -> the last step that ran the kernel.
        self.mega_alternates = len(self.cp_mega) == 2
        # (runtime, window) every captured graph's kernel nodes take (TTSBUILD_CP_L2_PERSIST)
        self.l2: tuple[l2_persist.CudaRuntime, l2_persist.Window] | None = None
        if l2_share:
            rt = l2_persist.CudaRuntime()
            most, max_window = rt.limits(dev.index if dev.index is not None
                                         else torch.cuda.current_device())  # fmt: skip
            window = l2_persist.window_for([d.weight for d in _cp_linears(self.cp_stack)],
                                           rt.set_aside(most), max_window, l2_share)  # fmt: skip
            if window is None:
                log.warning("TTSBUILD_CP_L2_PERSIST: no window (no L2 set-aside here, or the "
                            "code predictor's linears are not in one allocation)")
            else:
                self.l2 = (rt, window)
                log.info("code predictor linears persisting in L2: %.1f MiB window, hit ratio "
                         "%.3f", window.num_bytes / 2**20, window.hit_ratio)
        # plan.talker_megastep: the regular step's talker at bucket 1 as one kernel (the
        # lane's steps run no talker but a second frame's, which keeps the kernels)
        self.talker_mega = None
        if plan.talker_megastep:
            from ttsbuild.runtime import talker_megastep

            why = talker_megastep.unsupported(self.talker_stack)
            if why is None and (dev.type != "cuda"
                                or torch.cuda.get_device_capability(dev) != (9, 0)):
                why = "the kernel is built for sm_90a (a Hopper GPU)"
            if why:
                raise ValueError(f"plan.talker_megastep: {why}")
            self.talker_mega = talker_megastep.TalkerStep(self.talker_stack, self.max_len, dev)
        self.mega_tickets: dict[bool, int | None] = {False: None, True: None}
        # Prompt rows -> embeddings, the same function the reference prompt uses.
        proj = talker.text_projection
        self.embedder = PromptEmbedder(
            talker.embed_text, [self.codec_embedding, *self.cp_embeddings],
            stacked_rest=self.cp_embeddings,
            text_mlp=(talker.model.text_embedding.weight, proj.linear_fc1, proj.linear_fc2),
        )
        self.cp_spec = _speculative(self.cp_fused, plan, models.draft_heads)
        if plan.load_dependent_samples:
            log.warning(plan.speculation_note())

        # -- per-slot state ---------------------------------------------------------------
        t = cfg.talker
        kv_shape = (t.num_layers, S, t.num_kv_heads, plan.max_len, t.head_dim)
        self.kv_dtype = KV_FP8_DTYPE if plan.talker_kv_fp8 else self.dtype
        self.kv_k = torch.zeros(kv_shape, dtype=self.kv_dtype, device=dev)
        self.kv_v = torch.zeros(kv_shape, dtype=self.kv_dtype, device=dev)
        c = cfg.code_predictor
        bmax = plan.max_batch
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
        self.text_track = zeros(S, plan.max_text, H, dtype=self.dtype)
        self.text_len = zeros(S, dtype=torch.int64)
        self.codes = zeros(S, G, plan.codec_ring, dtype=torch.int64)
        self.decoded = zeros(S, dtype=torch.int64)
        self.guard_state = GuardState.zeros(S, self.guards, dev)
        self.suppressed = codebook0_logits_mask(cfg, V, dev)
        self.true = torch.ones((), dtype=torch.bool, device=dev)
        self.eos_onehot = torch.zeros(V, dtype=torch.bool, device=dev)
        self.eos_onehot[cfg.codec_ids.eos] = True
        with torch.no_grad():
            self.tts_pad = talker.embed_text(torch.tensor([cfg.text_ids.tts_pad], device=dev))[0]

        # The codec's incremental state for every slot, plus a work stream per batch bucket.
        # The codec's streaming state, indexed by slot like the KV cache (runtime.codec_engine),
        # in the plan's precision.
        self.codec_engine = CodecEngine(models.codec, plan.num_slots, plan.codec_precision, dev,
                                        **plan.codec_engine_kwargs(dev))  # fmt: skip
        if release_modules:
            models.offload_codec_decoder()  # the codec engine holds its own copy

        # -- static I/O of the graphs, and host staging ---------------------------------------
        self.rows_in = torch.full((bmax,), self.scratch, dtype=torch.int64, device=dev)
        self.codec_rows_in = self.rows_in.clone()  # the codec lane's own (it runs concurrently)
        self.frame_out = zeros(bmax, G + 1, dtype=torch.int64)  # codes, then the StopCode
        maxc = plan.max_chunk
        self.pcm_out = zeros(bmax, maxc * SAMPLES_PER_FRAME)
        # The prompt as staged ids (generation.prompt.PromptLayout rows), embedded in the
        # prefill graph; max_len rows so a prompt beyond the buckets runs from it uncaptured.
        # With the per-slot settings (admit_ints, admit_floats: written into the slots by the
        # prefill step itself, no per-field kernels at admission), one staging block for a
        # prefill step of up to max(plan.prefill_batches) prompts.
        pb = plan.prefill_batches[-1]
        self.staging = _AdmitStaging(pb, plan.max_text, plan.max_len, 2 + G, dev)
        self.admit_xvec = zeros(pb, H, dtype=self.dtype)
        self.text_buckets = tuple(
            sorted({*(t for t in plan.prefill_buckets if t < plan.max_text), plan.max_text})
        )
        self.prefix = (
            PrefixPool(
                cfg.talker, plan.prefix_pool, min(plan.max_prefix, plan.max_len), self.kv_dtype,
                dev,
            )
            if plan.prefix_pool
            else None
        )
        # In-context clones: the codec state after a voice's reference frames, per voice (the
        # codec half of a prompt prefix), so priming runs once per voice, not per request.
        self.primed: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.primed_hits = 0
        self.admit_ints = self.staging.ints  # [prefill batch, len(_ADMIT_INTS)]
        self.admit_floats = self.staging.floats
        # The admission writes (one launch with ADMIT_FUSED), over the state tensors as they
        # stay for the engine's life.
        self.slot_writes = self._slot_writes(ADMIT_FUSED)
        # views per row: the slot, the last prompt row, its first position, the prefix entry
        i = _ADMIT_INT_INDEX
        self.prefill_slot = self.admit_ints[:, i["slot"]]
        self.prefill_last = self.admit_ints[:, i["last"]]
        self.prefill_start = self.admit_ints[:, i["start"]]
        self.prefix_entry = self.admit_ints[:, i["prefix_entry"]]
        self.prefill_slot.fill_(self.scratch)  # capture warm-ups write the scratch slot
        pinned = dev.type == "cuda"
        self.frame_staging = _StagingRing(
            ((bmax,), torch.int64), ((bmax, G + 1), torch.int64), pinned
        )
        self.codec_staging = _StagingRing(
            ((bmax,), torch.int64), ((bmax, maxc * SAMPLES_PER_FRAME), torch.float32), pinned
        )
        self.driver = make_driver(dev)
        self.codec_stream = (dev.type == "cuda") if codec_stream is None else codec_stream
        self._green: list = []  # green contexts of the regular steps (lane_reserved_sms)
        green_streams = None
        if self.codec_stream and plan.lane_reserved_sms and dev.type == "cuda":
            # The regular steps on the SMs left after the lane's reserve (see the plan field);
            # the lane below stays on the whole device, at the highest priority.
            try:
                green_streams = self._green_streams(dev, plan.lane_reserved_sms)
            except GreenContextsUnavailable as exc:
                log.warning("the plan keeps %d SMs for the admission lane; running without "
                            "the reserve: %s", plan.lane_reserved_sms, exc)  # fmt: skip
        if green_streams:
            lm_stream, codec_stream = green_streams
            self.lm_lane = self.driver.add_external_lane(lm_stream.cuda_stream, join=True)
            self.codec_lane = self.driver.add_external_lane(codec_stream.cuda_stream, join=False)
        elif self.codec_stream:
            # Three ranks of CUDA stream priority: the admission lane (below) first, then the
            # frame steps of running streams, then the codec.
            self.lm_lane = self.driver.add_lane(high_priority=True, join=True,
                                                priority=-1 if plan.admission_lane else 0)
            self.codec_lane = self.driver.add_lane(high_priority=False, join=False)
        else:
            self.lm_lane = self.codec_lane = 0  # the caller's current stream for both
        self.ring_order = _RingOrder(S, plan.codec_ring)
        # The admission lane (plan.admission_lane): prefill steps and new rows' first frame and
        # first codec step on a stream of their own with their own graphs, pool, I/O rows and
        # code-predictor cache (everything else they touch is indexed by slot), beside the
        # regular steps.
        self.lane_buckets = plan.admission_lane
        # Whether new requests take the lane (a switch between steps, for side-by-side
        # measurements and for a server that turns it off under load; rows already prefilled
        # there keep their order either way).
        self.lane_on = bool(self.lane_buckets)
        self.admit_lane, self._admit_stream = 0, None
        self.fresh: dict[int, torch.cuda.Event | None] = {}  # prefilled there, no frame yet
        self.lane_frames: dict[int, int] = {}  # slot -> its last frame's step there (ticket)
        # plan.lane_frames 2: rows whose first frame ran there and whose second may too
        self.second: set[int] = set()
        # A row whose first frame ran there also has its first `lane_codec_steps` one-frame
        # codec steps there while every codec step before them did (the ramp's one-frame
        # chunks: with the regular codec lane busy, the second chunk was the one that ran
        # late, benchmarks/serve/2026-12-02-h200-ramp-ab); a codec step on the regular lane
        # ends that. Set between steps (serve sets it with the scheduler's lane_chunks).
        self.lane_codec_steps = 1
        self.codec_fresh: dict[int, int] = {}  # slot -> lane codec steps it may still take
        self.lane_codecs: dict[int, int] = {}  # slot -> its last codec step's there (ticket)
        self.first_codec: dict[int, int] = {}  # ...until the slot's next regular frame step
        if self.lane_buckets:
            nb = self.lane_buckets[-1]
            lane_cp = (c.num_layers, nb, c.num_kv_heads, G, c.head_dim)
            self.lane_cp_k = torch.zeros(lane_cp, dtype=self.dtype, device=dev)
            self.lane_cp_v = torch.zeros(lane_cp, dtype=self.dtype, device=dev)
            self.lane_rows_in = torch.full((nb,), self.scratch, dtype=torch.int64, device=dev)
            self.lane_out = zeros(nb, G + 1, dtype=torch.int64)
            self.lane_staging = _StagingRing(
                ((nb,), torch.int64), ((nb, G + 1), torch.int64), pinned
            )
            # and the first one-frame codec step of those rows
            self.lane_codec_rows_in = self.lane_rows_in.clone()
            lane_width = plan.lane_frames * SAMPLES_PER_FRAME
            self.lane_pcm = zeros(nb, lane_width)
            self.lane_codec_staging = _StagingRing(
                ((nb,), torch.int64), ((nb, lane_width), torch.float32), pinned
            )
            if self.codec_stream:
                self.admit_lane = self.driver.add_lane(high_priority=True, join=False)
                ptr = self.driver.lane_stream(self.admit_lane)  # 0: no CUDA (steps in order)
                if ptr:
                    self._admit_stream = torch.cuda.ExternalStream(ptr, device=dev)

        self.pending: dict[int, _Admission] = {}  # admitted, not yet prefilled
        self._views: dict[tuple, torch.Tensor] = {}  # _rows_view's views of kept buffers
        # A list (benchmarks only, CUDA): each prefill step appends an event recorded after its
        # inputs are staged, right before its first kernel is queued.
        self.trace: list | None = None
        self.capture_summary = ""  # what capture() took, by graph kind (serve prints it)
        self.prefill_steps = 0  # prefill steps run (a step takes up to max(prefill_batches))
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_pool_bytes = 0
        if self.use_graphs:
            before = torch.cuda.memory_allocated(dev)
            self.capture()
            self.graph_pool_bytes = torch.cuda.memory_allocated(dev) - before

    # -- stage bodies (fixed shapes, no host sync) -------------------------------------------
    def _embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the frame's 16 code embeddings: [B, G] -> [B, H]."""
        G = self.cfg.num_code_groups
        x = self.codec_embedding[codes[:, 0]]
        books = torch.arange(G - 1, device=codes.device)
        return x + self.cp_embeddings[books[None, :], codes[:, 1:]].sum(1)

    def _code_predictor(self, hidden, c0, sampling, seeds, frames, lane=False,
                        mega=True) -> torch.Tensor:
        """Codebooks 1..15 for B rows with on-device sampling: [B, G]. lane: the admission
        lane's step (its own cache; the fused or unfused path, which keep no other state).
        mega: batch 1 as one kernel where this path has one (plan.megaframe_code_predictor);
        False: the fused path (the step's alternate, see `_megaframe_turn`)."""
        B = hidden.shape[0]
        slots = self.cp_slots[:B]
        if B == 1 and mega and lane in self.cp_mega:
            # the talker's hidden state and codebook 0's embedding, projected, then one launch
            x = self.cp_fused._project(torch.cat([hidden, self.codec_embedding[c0]]), None)
            codes = self.cp_mega[lane].run(x, sampling, seeds, frames)
            return torch.cat([c0[:, None], codes[None].to(c0.dtype)], 1)
        if lane:
            args = (hidden, c0, sampling, seeds, frames, self.lane_cp_k, self.lane_cp_v, slots)
            if B in self.plan.fused_code_predictor:
                return self.cp_fused.frame(*args, self.cp_positions)
            return self.cp_fused.frame_unfused(*args, self.cp_positions)
        args = (hidden, c0, sampling, seeds, frames, self.cp_k, self.cp_v, slots)
        if B in self.plan.speculative:
            kind, window = self.plan.speculative[B]
            return self.cp_spec.frame(hidden, c0, sampling, seeds, frames, kind, window)
        if B in self.plan.persistent_code_predictor:
            return self.cp_fused.frame_persistent(*args, self.cp_positions)
        if B in self.plan.fused_code_predictor:
            return self.cp_fused.frame(*args, self.cp_positions)
        return self.cp_fused.frame_unfused(*args, self.cp_positions)

    def _frame_body(
        self, rows: torch.Tensor, lane: bool = False, talker: bool | None = None,
        mega: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for `rows` (slots): returns the codes [B, G] (also left in the ring) and
        each row's StopCode [B].

        Talker first: the step runs the talker on each row's previous frame (its codes in the
        ring) to get this frame's codebook-0 logits, then samples the frame. A fresh row (no
        frame yet) has those logits from its prefill: its talker outputs are discarded and its
        position stays (the cache entry it wrote is written again by its next step), so a
        new request's first frame costs no talker step, and no talker step runs after a
        stream's last frame. lane: the admission lane's step (see _code_predictor for its
        code-predictor cache), which holds fresh rows only and runs no talker, unless `talker`
        (its second frame step, plan.lane_frames 2). mega: see _code_predictor."""
        G = self.cfg.num_code_groups
        fi, seeds = self.frame_idx[rows], self.seed[rows]
        if (not lane) if talker is None else talker:
            self._talker_step(rows, fi, lane)
        tsamp = self.talker_sampling.select(rows)
        logits = apply_repetition_penalty(
            self.logits[rows], self.history[rows], tsamp.repetition_penalty
        )
        eos_banned = (fi < self.eos_min_frames[rows])[:, None] & self.eos_onehot[None]
        logits = logits.masked_fill(self.suppressed[None] | eos_banned, float("-inf"))
        c0 = fused_sample(logits, tsamp, seeds, draw_counter(fi, G))
        codes = self._code_predictor(
            self.hidden[rows], c0, self.cp_sampling.select(rows), seeds, fi, lane, mega
        )
        self.history.index_put_((rows, c0), self.true)  # a device scalar: no host copy
        stop = frame_stop_codes(self.guard_state, self.guards, rows, c0, self.cfg.codec_ids.eos)
        self.codes[rows, :, fi % self.plan.codec_ring] = codes
        self.frame_idx[rows] = fi + 1
        return codes, stop

    def _talker_step(self, rows: torch.Tensor, fi: torch.Tensor, lane: bool = False) -> None:
        """The talker over each row's frame fi - 1 (its codes + that frame's text) -> the
        hidden state and codebook-0 logits of frame fi; rows with fi == 0 keep theirs.
        lane: the admission lane's step (never the one-kernel talker: one instance, the
        regular step's)."""
        prev = fi - 1
        codes = self.codes[rows, :, prev % self.plan.codec_ring]  # fresh rows: any old entry
        text_pos = prev.clamp(min=0, max=self.plan.max_text - 1)
        text = torch.where(
            (prev < self.text_len[rows])[:, None], self.text_track[rows, text_pos], self.tts_pad
        )
        x = self._embed_frame(codes) + text
        pos = self.position[rows].clamp(max=self.max_len - 1)
        if rows.shape[0] == 1 and self.talker_mega is not None and not lane:
            h = self.talker_mega(x, self.kv_k, self.kv_v, rows, pos)
        elif rows.shape[0] in self.plan.fused_talker:
            h = decode_fused(self.talker_stack, x, self.kv_k, self.kv_v, rows, pos)
        else:
            h = self.talker_stack.decode(x, self.kv_k, self.kv_v, rows, pos)
        stepped = (fi > 0)[:, None]
        self.hidden[rows] = torch.where(stepped, h, self.hidden[rows])
        self.logits[rows] = torch.where(stepped, self.codec_head(h).float(), self.logits[rows])
        self.position[rows] = pos + (fi > 0).to(pos.dtype)

    def _slot_writes(self, kernel: bool) -> SlotWrites:
        """What `_admit_body` writes: the slots' settings from the staged rows, and their
        generation state (counters, history, codec state, guards) zeroed. kernel: as one
        launch on the GPU (ADMIT_FUSED); else the per-tensor ops."""
        zero = [self.frame_idx, self.decoded, self.history, *self.codec_engine.tensors(),
                *self.guard_state.tensors()]  # fmt: skip
        # (not the slot, the last row, the start or the prefix entry: no per-slot tensor)
        settings = [(_ADMIT_TARGETS[name](self), "int", i)
                    for name, i in _ADMIT_INT_INDEX.items() if name in _ADMIT_TARGETS]
        for name, i in _ADMIT_FLOAT_INDEX.items():
            target = _ADMIT_TARGETS[name](self)
            settings.append((target, "bool" if target.dtype == torch.bool else "float", i))
        return SlotWrites(zero, settings, kernel=kernel)

    def _admit_body(self, b: int) -> None:
        """Write the staged settings of the b requests being prefilled into their slots and
        reset the slots' generation state (codec state, history, counters)."""
        self.slot_writes(self.prefill_slot[:b], self.admit_ints[:b], self.admit_floats[:b])

    def _text_body(self, b: int, length: int) -> None:
        """The staged trailing text ids of b rows -> the first `length` positions of their
        slots' text tracks (a row reads its track from its second frame on, never beyond its
        own text: what lies past `length` may be an earlier request's)."""
        ids = self.staging.trailing_ids(b, length)
        emb = self.embedder.text(ids).to(self.text_track.dtype)  # (a no-op as served)
        self.text_track[:, :length].index_copy_(0, self.prefill_slot[:b], emb)

    def _prefill_body(self, b: int, length: int) -> None:
        """Admit b requests, copy their staged prefix entries into their slots, embed their
        staged prompt rows and prefill them from their staged start positions."""
        join = None
        if PREFILL_FORK:
            join = self._beside(lambda: self._admit_body(b))
        else:
            self._admit_body(b)
        slots = self.prefill_slot[:b]
        start = keys = None
        if self.prefix is not None:
            self.prefix.copy_into(self.kv_k, self.kv_v, slots, self.prefix_entry[:b],
                                  self.prefill_start[:b])  # fmt: skip
            start, keys = self.prefill_start[:b], self.prefix.max_prefix + length
        rows = self.staging.prompt_rows(b, length).reshape(b * length, -1)
        # each token's voice (one prompt: its x-vector broadcasts; no copy, no extra launch)
        xvec = self.admit_xvec[0] if b == 1 else self.admit_xvec[:b].repeat_interleave(length, 0)
        embeds = self.embedder.rows(rows, xvec).reshape(b, length, -1)
        h = self.talker_stack.prefill(embeds, self.kv_k, self.kv_v, slots, start, keys)
        last_row = self.prefill_last[:b]
        if b > 1:
            last_row = last_row + torch.arange(b, device=h.device) * length
        last = h.reshape(b * length, -1).index_select(0, last_row)  # [b, H]
        self.hidden.index_copy_(0, slots, last)
        self.logits.index_copy_(0, slots, self.codec_head(last).float())
        if join is not None:
            join()

    def _beside(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run fn on a stream forked from the current one (a branch of the graph being
        captured, or a stream of its own when run eagerly); returns the join, which makes the
        current stream wait for it. Without CUDA fn runs in order and the join is nothing."""
        if self.device.type != "cuda":
            fn()
            return lambda: None
        main = torch.cuda.current_stream(self._cuda_index)
        side = self._fork_streams.get(main.cuda_stream)
        if side is None:
            side = self._fork_streams[main.cuda_stream] = torch.cuda.Stream(self._cuda_index)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fn()
        return lambda: main.wait_stream(side)

    def _codec_body(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """n frames of audio for each of `rows`: [B, n * 1920] (fp32)."""
        ring = self.plan.codec_ring
        idx = (self.decoded[rows][:, None] + torch.arange(n, device=rows.device)) % ring
        groups = torch.arange(self.cfg.num_code_groups, device=rows.device)
        codes = self.codes[rows[:, None, None], groups[None, :, None], idx[:, None, :]]
        pcm = self.codec_engine.step(rows, codes)  # [B, n * 1920]
        self.decoded[rows] += n
        if self.guards.silence:
            observe_audio(self.guard_state, self.guards, rows, pcm)
        return pcm

    # -- graphs ----------------------------------------------------------------------------
    def graph_bodies(self) -> list[tuple[tuple, Callable[[], object], str]]:
        """(key, body, lane) of every graph the plan lists: what `capture` captures, and what
        the capture-safety test runs on CPU (tests/runtime/test_capture_safety.py)."""
        r, bodies = self.plan, []
        for b in r.batch_buckets:
            rows, out = self.rows_in[:b], self.frame_out[:b]
            bodies.append((("frame", b),
                           lambda rows=rows, out=out: _write_frame(out, *self._frame_body(rows)),
                           "lm"))  # fmt: skip
            if b == 1 and self.mega_alternates:
                bodies.append((("frame", b, "fused"),
                               lambda rows=rows, out=out: _write_frame(
                                   out, *self._frame_body(rows, mega=False)),
                               "lm"))  # fmt: skip
            codec_rows = self.codec_rows_in[:b]
            for n in r.codec_chunks:
                pcm = self.pcm_out[:b, : n * SAMPLES_PER_FRAME]
                bodies.append((("codec", b, n),
                               lambda rows=codec_rows, n=n, pcm=pcm: pcm.copy_(
                                   self._codec_body(rows, n)),
                               "codec"))  # fmt: skip
        admit = "admit" if self.lane_buckets else "lm"  # where prefill steps run
        for b in r.prefill_batches:
            for t in r.prefill_buckets:
                bodies.append((("prefill", b, t), lambda b=b, t=t: self._prefill_body(b, t),
                               admit))  # fmt: skip
            for t in self.text_buckets:
                bodies.append((("text", b, t), lambda b=b, t=t: self._text_body(b, t), admit))
        for b in self.lane_buckets:
            rows, out = self.lane_rows_in[:b], self.lane_out[:b]
            for mega in (True, False) if b == 1 and self.mega_alternates else (True,):
                bodies.append((("first", b) + (() if mega else ("fused",)),
                               lambda rows=rows, out=out, mega=mega: _write_frame(
                                   out, *self._frame_body(rows, lane=True, mega=mega)),
                               "admit"))  # fmt: skip
            rows, pcm = self.lane_codec_rows_in[:b], self.lane_pcm[:b, :SAMPLES_PER_FRAME]
            bodies.append((("first_codec", b),
                           lambda rows=rows, pcm=pcm: pcm.copy_(self._codec_body(rows, 1)),
                           "admit"))  # fmt: skip
            if r.lane_frames > 1:  # the second frame there, and a first codec step of both
                rows, out = self.lane_rows_in[:b], self.lane_out[:b]
                for mega in (True, False) if b == 1 and self.mega_alternates else (True,):
                    bodies.append((("second", b) + (() if mega else ("fused",)),
                                   lambda rows=rows, out=out, mega=mega: _write_frame(
                                       out, *self._frame_body(rows, lane=True, talker=True,
                                                              mega=mega)),
                                   "admit"))  # fmt: skip
                n = r.lane_frames
                rows, pcm = self.lane_codec_rows_in[:b], self.lane_pcm[:b]
                bodies.append((("first_codec", b, n),
                               lambda rows=rows, pcm=pcm, n=n: pcm.copy_(
                                   self._codec_body(rows, n)),
                               "admit"))  # fmt: skip
        return bodies

    def capture(self) -> None:
        """Capture every graph listed in the plan (warm-up runs hit the scratch slot)."""
        pool = torch.cuda.graph_pool_handle()
        codec_pool = torch.cuda.graph_pool_handle() if self.codec_stream else pool
        # One capture stream per lane: cuBLAS keeps a workspace per (handle, stream), and a
        # graph replays with the workspace of the stream it was captured on, so graphs that
        # may run concurrently must not have been captured on the same stream.
        lm_capture, codec_capture = torch.cuda.Stream(), torch.cuda.Stream()
        assert lm_capture.cuda_stream != codec_capture.cuda_stream
        # the admission lane's graphs run beside the frame graphs: a pool and stream of theirs
        admit_pool = torch.cuda.graph_pool_handle() if self.lane_buckets else pool
        admit_capture = torch.cuda.Stream() if self.lane_buckets else lm_capture
        where = {"lm": (pool, lm_capture), "codec": (codec_pool, codec_capture),
                 "admit": (admit_pool, admit_capture)}  # fmt: skip
        if self.cp_spec is not None:  # speculative rounds: WHILE bodies, captured first
            for B, (kind, window) in sorted(self.plan.speculative.items()):
                self.cp_spec.prepare(B, window, kind)
        spent: dict[str, list] = {}  # graph kind -> [count, seconds]: where a cold start goes
        t0 = time.perf_counter()
        for key, body, lane in self.graph_bodies():
            t = time.perf_counter()
            # (first captures JIT-compile kernels)
            self.graphs[key] = _capture(body, *where[lane], l2=self.l2)
            kind = spent.setdefault(key[0], [0, 0.0])
            kind[0], kind[1] = kind[0] + 1, kind[1] + time.perf_counter() - t
        self._reset_scratch()
        # The codec lane's stream does not follow the current stream: let these land first.
        torch.cuda.synchronize(self.device)
        self.capture_summary = (f"{len(self.graphs)} CUDA graphs captured in "
                                f"{time.perf_counter() - t0:.1f} s ("
                                + ", ".join(f"{k} {n}: {sec:.1f} s"
                                            for k, (n, sec) in spent.items()) + ")")
        log.info("%s", self.capture_summary)

    def _reset_scratch(self) -> None:
        # Padding rows advance the scratch slot on every replay; its positions are clamped
        # (talker, text track) or wrap (code ring), so it never needs resetting for safety.
        s = self.scratch
        self.codec_engine.reset([s])
        for buf in (self.position, self.frame_idx, self.decoded, self.text_len):
            buf[s] = 0

    # -- backend API (runtime.core.Backend) ---------------------------------------------------
    def prepare(self, plan: SlotPlan) -> _Prepared:
        """The request's prefill inputs as numpy rows and its prefix key, made when it is
        resolved at the edge, so admitting and staging it is a few row copies."""
        layout, params = plan.prompt.layout, plan.params
        t, c = params.talker, params.code_predictor
        ids = layout.rows.numpy()
        trailing = layout.trailing_ids.numpy()
        ints, floats = _settings(
            position=layout.num_positions, seed=plan.seed, eos_min_frames=plan.eos_from,
            text_len=trailing.shape[0], talker_top_k=t.top_k, cp_top_k=c.top_k,
            talker_do_sample=t.do_sample, cp_do_sample=c.do_sample,
            talker_temperature=t.temperature, talker_top_p=t.top_p,
            talker_repetition_penalty=t.repetition_penalty, cp_temperature=c.temperature,
            cp_top_p=c.top_p, cp_repetition_penalty=c.repetition_penalty)  # fmt: skip
        n, key = 0, None
        if self.prefix is not None:
            n = min(layout.shared_prefix_len, layout.num_positions - 1, self.prefix.max_prefix)
            key = layout.prefix_key(n)
        return _Prepared(ids, trailing, ints, floats, n, key)

    def admit(self, slot: int, plan: SlotPlan) -> None:
        """Host-side only: the slot's settings are written by its prefill step (which, on the
        current stream, follows the slot's previous occupant's last codec step). A prompt
        prefix shared with other requests holds its prefix-pool entry until then."""
        prepared = plan.staged if isinstance(plan.staged, _Prepared) else self.prepare(plan)
        admission = _Admission(plan, prepared)
        if prepared.prefix_key is not None:
            admission.entry = self.prefix.acquire(prepared.prefix_key)
            admission.prefix_len = prepared.prefix_len if admission.entry is not None else 0
        self.pending[slot] = admission
        admission.follow = tuple(self.ring_order.admit(slot))  # its prefill waits for them

    def release(self, slot: int) -> None:
        self.fresh.pop(slot, None)
        self.second.discard(slot)
        self.lane_frames.pop(slot, None)
        self.codec_fresh.pop(slot, None)
        self.lane_codecs.pop(slot, None)
        self.first_codec.pop(slot, None)
        admission = self.pending.pop(slot, None)
        if admission is not None and admission.entry is not None:
            self.prefix.release(admission.entry)

    @torch.no_grad()
    def prefill(self, slots: list[int]) -> None:
        """Prefill the admitted `slots`: up to max(plan.prefill_batches) prompts of the same
        length bucket per step (a longer prompt than every bucket runs alone, uncaptured),
        after the steps the slots' previous occupants left in flight.
        With the admission lane, on its stream: beside other steps (an event marks the end
        for frame steps of other lanes), or, with the lane switched off, fenced in order with
        the current stream (the lane's graphs share a memory pool: they run on its stream
        only)."""
        follow = sorted({t for s in slots for t in self.pending[s].follow})
        if not self.lane_buckets:
            self._follow(follow)
            return self._prefill(slots)
        stream = self._admit_stream
        current = self._current() if stream is not None else None
        # torch.cuda.set_stream, not torch.cuda.stream(): its context looks the device up
        # (torch.cuda.current_device) on entry and exit, ~30 us a time on the H200's host
        with self._on_stream(stream, current):
            if stream is not None and not self.lane_on:
                stream.wait_stream(current)
            self._follow(follow)
            self._prefill(slots)
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
        if not self.lane_on:
            if done is not None:
                current.wait_event(done)
            return
        for slot in slots:
            self.fresh[slot] = done

    def _prefill(self, slots: list[int]) -> None:
        admissions = [(slot, self.pending.pop(slot)) for slot in slots]
        try:
            groups: dict[int | None, list] = {}
            for slot, admission in admissions:
                n = admission.plan.prompt.layout.num_positions - admission.prefix_len
                groups.setdefault(self.plan.prefill_bucket(n), []).append((slot, admission))
            most = self.plan.prefill_batches[-1]
            for bucket, members in groups.items():
                size = 1 if bucket is None else most
                for i in range(0, len(members), size):
                    self._prefill_group(members[i : i + size])
        finally:
            for _, admission in admissions:
                if admission.entry is not None:
                    self.prefix.release(admission.entry)  # its copy is queued: stream order
        for slot, admission in admissions:
            context = admission.plan.prompt.codec_context
            if context is not None:
                self._prime_codec(slot, context)

    def _prefill_group(self, members: list[tuple[int, _Admission]]) -> None:
        """One prefill step for prompts of one length bucket (padded to a prefill batch)."""
        rows = []
        for slot, admission in members:
            prep, x_vector = admission.prepared, admission.plan.prompt.layout.x_vector
            n, start, entry = prep.ids.shape[0], admission.prefix_len, admission.entry
            if entry is not None and not entry.ready:
                # First use of this prefix: prefill it alone into the request's own slot
                # with the same step, and keep its KV (the request's prefill below copies it
                # back and overwrites the rest). Not the scratch slot: the padding rows of a
                # frame step on another lane may write the scratch slot's cache meanwhile.
                self._run_prefill([(*_settings(slot=slot, last=start - 1, position=start,
                                               prefix_entry=entry.index),
                                    prep.ids[:start], None, x_vector)])  # fmt: skip
                self.prefix.store(self.kv_k, self.kv_v, slot, entry)
            ints = prep.ints.copy()
            ints[_SLOT], ints[_LAST], ints[_START] = slot, n - start - 1, start
            ints[_ENTRY] = entry.index if entry is not None else 0
            rows.append((ints, prep.floats, prep.ids[start:], prep.trailing, x_vector))
        self._run_prefill(rows)

    def _run_prefill(self, rows: list[tuple]) -> None:
        """Stage the inputs (`_stage`), run the prefill step, then embed the trailing text into
        the rows' text tracks (where given): the captured graphs, or the same bodies eagerly.
        The text after the prefill: its graph's launch (~20-40 us of host time on the H200)
        then overlaps the prefill on the GPU instead of holding up its first kernel, and
        nothing reads a text track before the row's second frame (its first frame runs no
        talker step), which stream order puts after the text step."""
        b, length, text_length = self._stage(rows)
        self.prefill_steps += 1
        if self.trace is not None:  # benchmarks: when the GPU work of a prefill starts
            self.trace.append(torch.cuda.Event(enable_timing=True))
            self.trace[-1].record(self._current())
        if self.use_graphs and length in self.plan.prefill_buckets:
            self.graphs[("prefill", b, length)].replay()
        else:
            self._prefill_body(b, length)
        if text_length:
            self._embed_text(b, text_length)

    def _stage(self, rows: list[tuple]) -> tuple[int, int, int]:
        """Rows (settings as `_settings` gives them: ints and floats; prompt rows [T, 2 + G];
        trailing ids or None; x-vector or None), padded to a prefill batch with rows for the
        scratch slot: prompt rows padded to the longest one's length bucket (its own length
        beyond the buckets), trailing ids to their text bucket, in one copy; x-vectors in
        another where a row has one.
        Returns (batch, length, text length; 0: no text)."""
        b = next(p for p in self.plan.prefill_batches if p >= len(rows))
        n = max(r[2].shape[0] for r in rows)
        length = self.plan.prefill_bucket(n) or n
        texts = [r[3].shape[0] for r in rows if r[3] is not None]
        text_length = self._text_bucket(max(texts)) if texts else 0
        pad = (*self._pad_settings, rows[0][2][:0], None, None)
        rows = rows + [pad] * (b - len(rows))
        self.staging.stage([r[:4] for r in rows], length, text_length, self._current())
        if any(r[4] is not None for r in rows):
            xv = torch.zeros(b, self.admit_xvec.shape[1], dtype=self.dtype)
            for i, r in enumerate(rows):
                if r[4] is not None:
                    xv[i] = r[4].detach().to("cpu", self.dtype)
            # non-blocking from pinned memory: the host allocator keeps it until its copy ran
            self.admit_xvec[:b].copy_(self._pinned(xv), True)
        return b, length, text_length

    def _text_bucket(self, n: int) -> int:
        return next(b for b in self.text_buckets if b >= n)  # n <= max_text (plan_admission)

    def _embed_text(self, b: int, length: int) -> None:
        """The staged trailing text ids -> the text tracks the prefill step copies in."""
        if self.use_graphs:
            self.graphs[("text", b, length)].replay()
        else:
            self._text_body(b, length)

    def _prime_codec(self, slot: int, context: torch.Tensor) -> None:
        """In-context clone: the reference frames [F, groups] condition the slot's codec state
        as generated ones will (their audio is not output). Uncaptured, once per voice: the
        state after priming is kept (up to plan.prefix_pool voices, least recently used out)
        and copied into the slot for the voice's later requests."""
        key = context.to("cpu", torch.int64).contiguous().numpy().tobytes()
        state = self.codec_engine.tensors()
        cached = self.primed.get(key)
        if cached is not None:
            self.primed.move_to_end(key)
            self.primed_hits += 1
            for t, row in zip(state, cached, strict=True):
                t[slot].copy_(row)
            return
        rows = torch.tensor([slot], device=self.device)
        codes = context.to(self.device).T[None]  # [1, groups, F]
        for start in range(0, codes.shape[-1], self.plan.max_chunk):
            self.codec_engine.step(rows, codes[..., start : start + self.plan.max_chunk])
        if self.plan.prefix_pool:
            self.primed[key] = [t[slot].clone() for t in state]
            while len(self.primed) > self.plan.prefix_pool:
                self.primed.popitem(last=False)

    def _current(self) -> torch.cuda.Stream | None:
        """The caller's current stream (None off CUDA), looked up by `_cuda_index`."""
        return torch.cuda.current_stream(self._cuda_index) if self._cuda_index is not None \
            else None  # fmt: skip

    @staticmethod
    @contextlib.contextmanager
    def _on_stream(stream: torch.cuda.Stream | None, current: torch.cuda.Stream | None):
        """Make `stream` current (no-op for None), then `current` again."""
        if stream is None:
            yield
            return
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(current)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.device.type == "cuda" else t  # copied non-blocking

    def _follow(self, tickets: list[int]) -> None:
        if self.codec_stream and tickets:
            self.driver.device_wait(tickets)

    def _launch(self, ring: _StagingRing, slots: list[int], step, outputs: torch.Tensor,
                width: int, rows_in: torch.Tensor, lane: int, after: list[int],
                buckets: tuple[int, ...] | None = None) -> _Staged:  # fmt: skip
        """Stage the slot ids, run `step` for the padded rows on `lane` after the steps
        `after`, copy the B rows' outputs out. buckets: the step's batch sizes (default: the
        plan's batch buckets)."""
        B = len(slots)
        rows = B
        if self.use_graphs:
            rows = next(b for b in buckets if b >= B) if buckets else self.plan.bucket(B)
        k = ring.take()
        ring.inputs_np[k][:B] = slots
        ring.inputs_np[k][B:rows] = self.scratch
        host_out = ring.output_rows(k, B, width)
        ticket = self.driver.launch(
            step(rows), [ring.input_rows(k, rows)], [self._rows_view(rows_in, rows)],
            [self._rows_view(outputs, B, width)], [host_out], lane,
            after if self.codec_stream else [],
        )
        staged = _Staged(ticket, host_out, k)
        ring.owner[k] = staged
        return staged

    def _green_streams(self, dev: torch.device, reserved: int) -> list[torch.cuda.Stream]:
        """Two streams (frame steps, codec steps) in green contexts of all but `reserved` SMs
        (torch.cuda.green_contexts; both contexts take the same SMs, which is what the two
        regular lanes share anyway). The contexts are kept for as long as the backend."""
        try:
            from torch.cuda.green_contexts import GreenContext
        except ImportError as exc:
            raise GreenContextsUnavailable(f"torch {torch.__version__} has no CUDA green "
                                           f"contexts ({exc})") from None  # fmt: skip
        total = torch.cuda.get_device_properties(dev).multi_processor_count
        if not 0 < reserved <= total // 2:  # a plan's default made for a bigger GPU, say
            raise GreenContextsUnavailable(f"{reserved} SMs would leave the running streams "
                                           f"too few of this GPU's {total} (at most "
                                           f"{total // 2} can be kept)")  # fmt: skip
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            self._green = [GreenContext.create(num_sms=total - reserved, device_id=index)
                           for _ in range(2)]  # fmt: skip
        except (RuntimeError, AttributeError, NotImplementedError) as exc:  # e.g. CUDA < 12.4
            raise GreenContextsUnavailable(f"cannot create green contexts: {exc}") from None
        log.info("regular steps on %d of %d SMs; %d kept for the admission lane",
                 total - reserved, total, reserved)  # fmt: skip
        return [g.Stream() for g in self._green]

    def _rows_view(self, t: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
        """t[:rows] (or t[:rows, :width]) of a buffer the backend keeps: one view object per
        shape, made once (a launch's views cost microseconds of Python each otherwise)."""
        key = (id(t), rows, width)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = t[:rows] if width is None else t[:rows, :width]
        return view

    def _read(self, staged: _Staged) -> torch.Tensor:
        self.driver.wait(staged.ticket)
        staged.read = True
        return staged.out

    @torch.no_grad()
    def launch_frames(self, slots: list[int]) -> _Staged | _Split:
        """One frame step for `slots`. With the admission lane, rows prefilled there and not
        yet stepped (up to its largest bucket) take their first frame on it (and, with
        plan.lane_frames 2, their second), beside the regular step of the others: several
        steps, read back as one."""
        lanes = [(self.fresh, self._lane_frames),
                 (self.second, lambda rows: self._lane_frames(rows, second=True))]
        was_second = self.second.intersection(slots)
        staged = self._split(slots, lanes if self.lane_on else [], self._regular_frames)
        for s in slots:
            self.fresh.pop(s, None)
        self.second -= was_second
        return staged

    def _split(self, slots: list[int], lanes, regular) -> _Staged | _Split:
        """Launch the rows of `slots` in each lane group's rows with its launcher ([(rows,
        launcher)], in order; a group runs when the lane's largest bucket holds all of its
        rows here, else they join the regular step), the others with regular: one step, or
        several read back as one."""
        taken: dict[int, int] = {}
        for g, (eligible, _) in enumerate(lanes):
            rows = [s for s in slots if s in eligible and s not in taken]
            if rows and len(rows) <= self.lane_buckets[-1]:
                taken.update(dict.fromkeys(rows, g))
        groups = [(launch, g) for g, (_, launch) in enumerate(lanes)] + [(regular, None)]
        parts = []
        for launch, g in groups:
            index = [i for i, s in enumerate(slots) if taken.get(s) == g]
            if index:
                parts.append((index, launch([slots[i] for i in index])))
        return parts[0][1] if len(parts) == 1 else _Split(parts, len(slots))

    def _regular_frames(self, slots: list[int]) -> _Staged:
        G = self.cfg.num_code_groups
        mega = self._megaframe_turn(False, len(slots))

        def step(rows: int):
            if self.use_graphs:
                return self.graphs[("frame", rows) + (() if mega else ("fused",))]
            out = self.frame_out[:rows]
            return lambda: _write_frame(out, *self._frame_body(self.rows_in[:rows], mega=mega))

        # Rows prefilled on the admission lane follow its prefill (the caller's stream waits
        # for it; this lane forks from that stream), or their first frame there.
        for done in {id(e): e for s in slots if (e := self.fresh.get(s)) is not None}.values():
            self._current().wait_event(done)
        after = self.ring_order.before_frames(slots)
        after += [self.lane_frames.pop(s) for s in slots if s in self.lane_frames]
        # A step of only rows whose first codec step went to the admission lane (a stream on
        # its own, at low load) waits for that step: the first chunk then has the device to
        # itself, and no other stream's rows are held back.
        firsts = [self.first_codec.pop(s, None) for s in slots]
        if None not in firsts:
            after += firsts
        staged = self._launch(self.frame_staging, slots, step, self.frame_out, G + 1,
                              self.rows_in, self.lm_lane, sorted(set(after)))  # fmt: skip
        self.ring_order.frames_launched(slots, staged.ticket, self.lm_lane)
        self._megaframe_ran(False, len(slots), mega, staged.ticket)
        return staged

    def _megaframe_turn(self, lane: bool, rows: int) -> bool:
        """Whether a step of `rows` rows on the admission lane (`lane`) or the regular path
        may run its one-kernel code predictor: not while the other path's last such step may
        still run (`megaframe_free`); always where only one path has the kernel."""
        if not self.mega_alternates or rows != 1:
            return True
        return megaframe_free(lane, self.mega_tickets, self.driver.ready)

    def _megaframe_ran(self, lane: bool, rows: int, mega: bool, ticket: int) -> None:
        if self.mega_alternates and rows == 1 and mega:
            self.mega_tickets[lane] = ticket

    def _lane_frames(self, slots: list[int], second: bool = False) -> _Staged:
        """New rows' first frame on the admission lane (after their prefill, on its stream),
        or, `second` (plan.lane_frames 2), their second right after it there: the talker on
        the first, then the code predictor."""
        G = self.cfg.num_code_groups
        mega = self._megaframe_turn(True, len(slots))

        def step(rows: int):
            if self.use_graphs:
                return self.graphs[("second" if second else "first", rows)
                                   + (() if mega else ("fused",))]
            out = self.lane_out[:rows]
            return lambda: _write_frame(out, *self._frame_body(
                self.lane_rows_in[:rows], lane=True, talker=second, mega=mega))

        staged = self._launch(self.lane_staging, slots, step, self.lane_out, G + 1,
                              self.lane_rows_in, self.admit_lane,
                              self.ring_order.before_frames(slots), self.lane_buckets)  # fmt: skip
        self.ring_order.frames_launched(slots, staged.ticket, self.admit_lane)
        self._megaframe_ran(True, len(slots), mega, staged.ticket)
        for s in slots:
            self.lane_frames[s] = staged.ticket
        if not second:
            self.codec_fresh.update(dict.fromkeys(slots, self.lane_codec_steps))
            if self.plan.lane_frames > 1:
                self.second.update(slots)
        return staged

    def read_frames(self, staged: _Staged | _Split) -> torch.Tensor:
        if isinstance(staged, _Split):
            return torch.from_numpy(self._read_split(staged))
        return self._read(staged).clone()

    def _read_split(self, staged: _Split) -> np.ndarray:
        """A step run as two: each part's rows into their places, one array."""
        out = None
        for index, part in staged.parts:
            rows = self._read(part).numpy()
            if out is None:
                out = np.empty((staged.rows, rows.shape[1]), dtype=rows.dtype)
            out[index] = rows
        return out

    @torch.no_grad()
    def launch_codec(self, slots: list[int], n: int) -> _Staged | _Split:
        """One codec step of n frames for `slots`. With the admission lane, a one-frame step
        of rows whose first frame ran there (up to its largest bucket; their first
        `lane_codec_steps` such steps) runs there too, at its priority, beside a regular codec
        step of the others: two steps, read back as one."""
        on_lane = self.lane_on and n in (1, self.plan.lane_frames)
        lanes = [(self.codec_fresh, lambda rows: self._lane_codec(rows, n))] if on_lane else []
        return self._split(slots, lanes, lambda rows: self._regular_codec(rows, n))

    def _regular_codec(self, slots: list[int], n: int) -> _Staged:
        width = n * SAMPLES_PER_FRAME

        def step(rows: int):
            if self.use_graphs:
                return self.graphs[("codec", rows, n)]
            pcm = self.pcm_out[:rows, :width]
            return lambda: pcm.copy_(self._codec_body(self.codec_rows_in[:rows], n))

        # after the frames it decodes, and after a first codec step on the admission lane
        # (the codec state and decode counter it carries on)
        after = self.ring_order.before_codec(slots, n)
        after += [self.lane_codecs.pop(s) for s in slots if s in self.lane_codecs]
        for s in slots:  # its codec state now follows this lane: no more lane steps
            self.codec_fresh.pop(s, None)
        staged = self._launch(self.codec_staging, slots, step, self.pcm_out, width,
                              self.codec_rows_in, self.codec_lane, sorted(set(after)))  # fmt: skip
        self.ring_order.codec_launched(slots, n, staged.ticket, self.codec_lane)
        return staged

    def _lane_codec(self, slots: list[int], n: int = 1) -> _Staged:
        """New rows' first one-frame codec steps on the admission lane (after their frames,
        wherever those ran, and after their codec steps before, all there: its stream's
        order)."""
        def step(rows: int):
            if self.use_graphs:
                return self.graphs[("first_codec", rows) if n == 1 else ("first_codec", rows, n)]
            pcm = self.lane_pcm[:rows, : n * SAMPLES_PER_FRAME]
            return lambda: pcm.copy_(self._codec_body(self.lane_codec_rows_in[:rows], n))

        after = self.ring_order.before_codec(slots, n)
        staged = self._launch(self.lane_codec_staging, slots, step, self.lane_pcm,
                              n * SAMPLES_PER_FRAME, self.lane_codec_rows_in, self.admit_lane,
                              after, self.lane_buckets)  # fmt: skip
        self.ring_order.codec_launched(slots, n, staged.ticket, self.admit_lane)
        for s in slots:
            if self.codec_fresh[s] == self.lane_codec_steps:  # its first codec step
                self.first_codec[s] = staged.ticket
            self.lane_codecs[s] = staged.ticket
            if (left := self.codec_fresh.pop(s) - 1) > 0:
                self.codec_fresh[s] = left
        return staged

    def read_codec(self, staged: _Staged | _Split) -> np.ndarray:
        if isinstance(staged, _Split):
            return self._read_split(staged)
        return self._read(staged).numpy().copy()

    @property
    def concurrent_admission(self) -> bool:
        """New rows' prefill, first frame and first codec step run on the admission lane's
        own stream, beside the steps in flight (a GPU with the lane on)."""
        return self._admit_stream is not None and self.lane_on

    def ready(self, staged: _Staged | _Split) -> bool:
        if isinstance(staged, _Split):
            return all(self.ready(part) for _, part in staged.parts)
        return staged.read or self.driver.ready(staged.ticket)

    def memory_report(self) -> dict[str, int]:
        """Bytes on the device by kind (weights as stored, KV cache, per-slot state)."""
        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        m = self.models
        denses = [*self.talker_stack.linears(), *self.cp_stack.linears(), *self.cp_heads,
                  self.codec_head]  # fmt: skip
        # Every storage of weights once, however many tensors view it: the packed stacks
        # (bf16 copies included), the heads, the module parameters still on the device
        # (embeddings, text projection, heads; the decoder layers too unless they were
        # dropped: then they count twice, truthfully), the code predictor's stacked input
        # embeddings, and the one-kernel code predictor's weights (views of the stack's,
        # its re-laid-out W_o and its projected embedding tables).
        weights = [t for d in denses for t in (d.weight, d.scale, d.bf16_weight)]
        weights += [*m.talker.parameters(), *m.code_predictor.parameters(), self.cp_embeddings]
        for mega in self.cp_mega.values():
            weights += mega.weight_tensors()
        state = [self.cp_k, self.cp_v, self.position, self.hidden, self.logits, self.history,
                 self.frame_idx, self.eos_min_frames, self.seed, self.text_track, self.text_len,
                 self.codes, self.decoded, self.codec_engine.tensors(),
                 self.staging.block, self.admit_xvec, self.pcm_out, self.frame_out, self.rows_in,
                 self.codec_rows_in]  # fmt: skip
        if self.lane_buckets:  # the admission lane's code-predictor cache and I/O
            state += [self.lane_cp_k, self.lane_cp_v, self.lane_rows_in, self.lane_out,
                      self.lane_codec_rows_in, self.lane_pcm]  # fmt: skip
        flat = [t for x in state for t in (x if isinstance(x, list) else [x])]
        spec = self.cp_spec
        spec_tensors = [] if spec is None else [spec.heads, spec.k_cache, spec.v_cache]
        if spec is not None and spec.draft_heads is not None:
            spec_tensors.append(spec.draft_heads)
        bufs = getattr(self.cp_fused, "pass_buffers", None)
        if bufs is not None:
            flat += [bufs.x, bufs.qkv, bufs.attn, bufs.act, bufs.logits]
        return {
            "weights_lm": _storage_bytes(weights, self.device),
            # the checkpoint's codec as loaded (fp32; moved to host memory with
            # release_modules) and the codec engine's own copy in its precision
            "weights_codec": nbytes(p for p in m.codec.parameters() if p.device == self.device),
            "weights_codec_engine": self.codec_engine.weight_bytes(),
            "kv_cache": 2 * nbytes([self.kv_k]),
            "prefix_pool": self.prefix.nbytes() if self.prefix is not None else 0,
            "slot_state_and_io": nbytes(flat),
            # the speculative code predictor's stacked (dequantised) target heads, draft
            # heads and scratch caches; the codec states of primed in-context voices
            "speculation": nbytes(spec_tensors),
            "primed_codec_states": nbytes([t for row in self.primed.values() for t in row]),
            "graph_pools": self.graph_pool_bytes,
        }


def _storage_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages on `device` under `tensors` (None and empty ones
    skipped): a storage that several tensors view counts once, and whole."""
    storages = {}
    for t in tensors:
        if t is not None and t.numel() and t.device == device:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


class GraphEngine(EngineCore):
    """The engine API over `GraphBackend` (CUDA graphs on a GPU; the same code eagerly on CPU)."""

    def __init__(
        self,
        models: Models,
        plan: EnginePlan | None = None,
        use_graphs: bool | None = None,
        release_modules: bool = False,
        keep_codes: bool = False,
        guards: GuardConfig | None = None,
        codec_stream: bool | None = None,
        kv_scales: list[tuple[float, float]] | None = None,
    ):
        plan = plan or EnginePlan.default()
        guards = guards or GuardConfig()
        backend = GraphBackend(models, plan, use_graphs, release_modules, guards, codec_stream,
                               kv_scales)  # fmt: skip
        super().__init__(backend, plan, models, keep_codes, guards)
        self.device = backend.device

    @property
    def caches_prefixes(self) -> bool:
        """Prompt prefixes are prefilled once and reused (runtime.prefix_cache)."""
        return self.backend.prefix is not None


# -- helpers -------------------------------------------------------------------------------


class _RingOrder:
    """Which step wrote and which step read each slot's code-ring entries (host side), to
    name the steps of other streams that a step must follow (see the module doc). A frame
    step's dependencies are codec steps and a codec step's are frame steps; each kind runs on
    one lane, or two with the admission lane. Steps of one lane run in launch order, so the
    latest dependency per lane covers the others: one step is named per lane."""

    def __init__(self, num_slots: int, ring: int):
        self.ring = ring
        self.frames = [0] * num_slots  # frames launched for the slot's occupant
        self.decoded = [0] * num_slots  # frames handed to codec steps
        # (frames after a step, its ticket, its lane), (decoded after a step, ticket, lane)
        self.written = [deque() for _ in range(num_slots)]
        self.read = [deque() for _ in range(num_slots)]
        self.last_read: list[int | None] = [None] * num_slots  # survives release
        self.last_written: list[int | None] = [None] * num_slots  # survives release

    def admit(self, slot: int) -> list[int]:
        """A new occupant: the previous one's last codec step and last frame step, which its
        prefill follows (a prefill in order with frame steps follows the latter anyway)."""
        self.frames[slot] = self.decoded[slot] = 0
        self.written[slot].clear()
        self.read[slot].clear()
        last = [self.last_read[slot], self.last_written[slot]]
        self.last_read[slot] = self.last_written[slot] = None
        return sorted(t for t in last if t is not None)

    def before_frames(self, slots: list[int]) -> list[int]:
        """The codec steps that read the ring entries this frame step overwrites (if any)."""
        deps: dict[int, int] = {}  # lane -> latest ticket
        for s in slots:
            old = self.frames[s] - self.ring  # the frame now in the entry to be written
            if old < 0:
                continue
            read = self.read[s]
            while read and read[0][0] <= old:
                read.popleft()
            if read:
                _, ticket, lane = read[0]
                deps[lane] = max(ticket, deps.get(lane, ticket))
        return sorted(deps.values())

    def frames_launched(self, slots: list[int], ticket: int, lane: int = 0) -> None:
        for s in slots:
            self.frames[s] += 1
            self.written[s].append((self.frames[s], ticket, lane))
            self.last_written[s] = ticket

    def before_codec(self, slots: list[int], n: int) -> list[int]:
        """The frame steps that wrote the last of the n frames each slot decodes next."""
        deps: dict[int, int] = {}
        for s in slots:
            need = self.decoded[s] + n
            written = self.written[s]
            while written and written[0][0] < need:
                written.popleft()
            if written:
                _, ticket, lane = written[0]
                deps[lane] = max(ticket, deps.get(lane, ticket))
        return sorted(deps.values())

    def codec_launched(self, slots: list[int], n: int, ticket: int, lane: int = 0) -> None:
        for s in slots:
            self.decoded[s] += n
            self.read[s].append((self.decoded[s], ticket, lane))
            self.last_read[s] = ticket


# Per-slot settings staged at admission: name -> where it lands (see GraphBackend._admit_body).
_ADMIT_INTS = ("slot", "last", "position", "seed", "eos_min_frames", "text_len",
               "talker_top_k", "cp_top_k", "start", "prefix_entry")  # fmt: skip
_ADMIT_FLOATS = ("talker_do_sample", "cp_do_sample", "talker_temperature", "talker_top_p",
                 "talker_repetition_penalty", "cp_temperature", "cp_top_p",
                 "cp_repetition_penalty")  # fmt: skip
_ADMIT_INT_INDEX = {k: i for i, k in enumerate(_ADMIT_INTS)}
# Settings of a prefix prefilled alone (greedy; nothing reads them) and of padding rows.
_SCRATCH_VALUES = dict.fromkeys(_ADMIT_INTS + _ADMIT_FLOATS, 0) | {
    "talker_temperature": 1.0, "talker_top_p": 1.0, "talker_repetition_penalty": 1.0,
    "cp_temperature": 1.0, "cp_top_p": 1.0, "cp_repetition_penalty": 1.0}  # fmt: skip
_ADMIT_FLOAT_INDEX = {k: i for i, k in enumerate(_ADMIT_FLOATS)}
_SLOT, _LAST, _START, _ENTRY = (_ADMIT_INT_INDEX[k] for k in ("slot", "last", "start",
                                                               "prefix_entry"))  # fmt: skip


def _settings(**values) -> tuple[np.ndarray, np.ndarray]:
    """A prefill row's settings (`_SCRATCH_VALUES` but for `values`) as staged: int64
    [len(_ADMIT_INTS)] and float32 [len(_ADMIT_FLOATS)]."""
    unknown = values.keys() - _SCRATCH_VALUES.keys()
    if unknown:
        raise KeyError(f"not a prefill setting: {sorted(unknown)}")
    values = _SCRATCH_VALUES | values
    return (np.array([values[k] for k in _ADMIT_INTS], dtype=np.int64),
            np.array([values[k] for k in _ADMIT_FLOATS], dtype=np.float32))  # fmt: skip


_ADMIT_TARGETS = {
    "position": lambda b: b.position,
    "seed": lambda b: b.seed,
    "eos_min_frames": lambda b: b.eos_min_frames,
    "text_len": lambda b: b.text_len,
    "talker_top_k": lambda b: b.talker_sampling.top_k,
    "cp_top_k": lambda b: b.cp_sampling.top_k,
    "talker_do_sample": lambda b: b.talker_sampling.do_sample,
    "cp_do_sample": lambda b: b.cp_sampling.do_sample,
    "talker_temperature": lambda b: b.talker_sampling.temperature,
    "talker_top_p": lambda b: b.talker_sampling.top_p,
    "talker_repetition_penalty": lambda b: b.talker_sampling.repetition_penalty,
    "cp_temperature": lambda b: b.cp_sampling.temperature,
    "cp_top_p": lambda b: b.cp_sampling.top_p,
    "cp_repetition_penalty": lambda b: b.cp_sampling.repetition_penalty,
}


def _speculative(cp: FusedCodePredictor, plan: EnginePlan, draft_heads):
    """The speculative code predictor the plan asks for (None: speculation off)."""
    if not plan.speculative:
        return None
    kinds = {kind for kind, _ in plan.speculative.values()}
    if "draft" in kinds and draft_heads is None:
        raise ValueError(
            "the plan decodes with a trained draft but the model has none: attach one with "
            "`ttsbuild convert CKPT --draft DRAFT` (or use the self-speculative kind)"
        )
    window = max(w for _, w in plan.speculative.values())
    return SpeculativeCodePredictor(cp, plan.max_batch, window, draft_heads,
                                    exact=plan.speculative_exact)


def _sampling_buffers(n: int, dev) -> SamplingBatch:
    return SamplingBatch(
        do_sample=torch.zeros(n, dtype=torch.bool, device=dev),
        temperature=torch.ones(n, device=dev),
        top_k=torch.zeros(n, dtype=torch.int64, device=dev),
        top_p=torch.ones(n, device=dev),
        repetition_penalty=torch.ones(n, device=dev),
    )


def _write_frame(out: torch.Tensor, codes: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """Pack a frame step's results into one buffer so the host copies them back at once."""
    out[:, :-1] = codes
    out[:, -1] = stop
    return out


def megaframe_free(lane: bool, tickets: dict[bool, int | None], ready) -> bool:
    """Whether a bucket-1 step on the admission lane (`lane`) or the regular path may start
    the one-kernel code predictor: only once the other path's last step that ran it
    (`tickets[not lane]`, a step driver ticket; None: none yet) is done (`ready(ticket)`, a
    query that never blocks)."""
    other = tickets[not lane]
    return other is None or bool(ready(other))


def _capture(fn, pool, stream: torch.cuda.Stream | None = None,
             l2: tuple | None = None) -> torch.cuda.CUDAGraph:  # fmt: skip
    """fn's work as a CUDA graph on `stream` (after two warm-up runs); l2: (runtime, window),
    the access-policy window put on every kernel node before the graph is instantiated."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: allocator, Triton autotuning, cuBLAS handles
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True) if l2 else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):  # (not torch's one shared stream)
        fn()
    if l2:
        rt, window = l2
        rt.apply_to_graph(graph, window)
        graph.instantiate()
    return graph


def _cp_linears(stack: PackedStack) -> list[Dense]:
    """The code predictor's linears, layer by layer (what its L2 window covers)."""
    return [d for layer in stack.layers for d in (layer.qkv, layer.o, layer.gate_up, layer.down)]
