"""One engine core over two backends.

The core owns the host side of every request: the slot table (admission, frame counts, EOS
and frame limits, release) and the order of work. A backend owns the device side: per-slot
tensors and how a stage runs. `EagerBackend` runs the reference modules (any device; the
CPU path and the parity reference); `ttsbuild.runtime.graph_engine.GraphBackend` replays
CUDA graphs over slot-indexed buffers. The frame loop exists once, here.

Stages are launched and collected separately, so the next step can be on the device before
the host reads the last one:

    ticket = core.launch_frames(slots)   # returns at once (the GPU works on)
    ...                                  # launch more work, schedule, encode audio
    outputs = core.collect(ticket)       # codes of that step; EOS and limits decided here

EOS is decided on the host one step late: a row that sampled EOS at step t may already have
step t+1 in flight; its output is dropped when collected. Frames at which EOS cannot be
sampled (the first `min_new_tokens`, and every frame of a stand-in, which follows its length
rule) are known to be real as soon as they are launched, so the codec can decode a request's
first frame without waiting for the host to read its codes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from ttsbuild.generation.guards import (
    GuardConfig,
    GuardState,
    StopCode,
    frame_stop_codes,
    observe_audio,
)
from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.runtime.plan import EnginePlan

NEVER = 2**62  # an index no frame reaches: EOS never allowed (stand-ins)


class NoFreeSlot(RuntimeError):
    """Every slot is busy: the caller should queue or reject (429)."""


@dataclass(frozen=True)
class SlotPlan:
    """What admitting one request means for the engine, resolved once at the edge."""

    prompt: Any  # generation.prompt.Prompt: its layout (ids), embeddings on first use
    params: Any  # generation.generate.GenerationParams
    frame_limit: int  # stop after this many frames (EOS or a guard may stop sooner)
    by_length_rule: bool  # a stand-in: the limit is its length rule and EOS is never sampled
    seed: int
    limit_reason: str = "max_frames"  # what frame_limit is: text_budget, length_rule, ...
    guard_free: int = NEVER  # no guard (repetition, silence) can stop a frame before this
    # the backend's host-side preparation of the prompt (`Backend.prepare`, made when the
    # request is resolved at the edge; None: the backend prepares it at admission)
    staged: Any = field(default=None, compare=False, repr=False)

    @property
    def eos_from(self) -> int:
        """The first frame index at which EOS may be sampled."""
        return NEVER if self.by_length_rule else self.params.min_new_tokens


@dataclass(frozen=True)
class ResolvedRequest:
    """A request resolved at the edge (`EngineCore.resolve`): admitting it only claims a slot
    (the tokenizing and checking are not on the engine loop's path to the prefill)."""

    request: Any
    plan: SlotPlan


@dataclass
class SlotRecord:
    """The host's view of one admitted request."""

    plan: SlotPlan
    request: Any = None  # the SynthesisRequest, when admitted from one
    uid: int = 0  # distinguishes a slot's successive occupants (stale tickets)
    launched: int = 0  # frames launched on the device
    committed: int = 0  # frames whose codes the host has read (EOS frame excluded)
    decoded: int = 0  # frames handed to the codec
    finished: bool = False
    stopped_by: str | None = None
    codes: list[torch.Tensor] = field(default_factory=list)  # [groups] per frame, if kept

    @property
    def known_frames(self) -> int:
        """Frames certain to be real: committed ones, and launched ones EOS could not end."""
        if self.finished and self.stopped_by not in ("max_frames", "length_rule", "text_budget"):
            return self.committed  # stopped by its own frame (EOS, a guard): no more are real
        certain = min(self.launched, self.plan.eos_from, self.plan.guard_free)
        return max(self.committed, min(certain, self.plan.frame_limit))

    @property
    def can_launch(self) -> bool:
        return not self.finished and self.launched < self.plan.frame_limit


class SlotTable:
    """Which slot holds which request. Slots are claimed lowest-first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.records: dict[int, SlotRecord] = {}
        self._uids = itertools.count(1)

    def free_count(self) -> int:
        return self.num_slots - len(self.records)

    def claim(self, record: SlotRecord) -> int:
        slot = next((s for s in range(self.num_slots) if s not in self.records), None)
        if slot is None:
            raise NoFreeSlot(f"all {self.num_slots} slots are busy")
        record.uid = next(self._uids)
        self.records[slot] = record
        return slot

    def release(self, slot: int) -> None:
        self.records.pop(slot, None)

    def __getitem__(self, slot: int) -> SlotRecord:
        return self.records[slot]

    def commit(self, slot: int, stop: int, rows: torch.Tensor, j: int, keep: bool) -> FrameOutput:
        """Account one collected frame of `slot`: row j of a step's rows [B, groups codes +
        StopCode] (host), whose StopCode the caller read (`stop`)."""
        rec = self.records[slot]
        if stop != StopCode.CONTINUE:  # EOS or a guard: that frame itself is dropped
            rec.finished, rec.stopped_by = True, str(StopCode(stop).reason)
            return FrameOutput(slot, True)
        rec.committed += 1
        if keep:
            rec.codes.append(rows[j, :-1])
        if rec.committed >= rec.plan.frame_limit:
            rec.finished, rec.stopped_by = True, rec.plan.limit_reason
        return FrameOutput(slot, rec.finished, rows, j)


@dataclass(slots=True)
class FrameOutput:
    """One row of a collected frame step. Its codes are a view of the step's rows made when
    asked for: a tensor view costs microseconds of host time, and the server, which only
    counts frames, would otherwise pay it for every row of every step."""

    slot: int
    finished: bool
    rows: torch.Tensor | None = field(default=None, repr=False)  # the step's [B, groups + 1]
    row: int = 0

    @property
    def made(self) -> bool:
        """A frame was made (False: the request ended at this step, EOS or a guard)."""
        return self.rows is not None

    @property
    def codes(self) -> torch.Tensor | None:
        """[groups], None when the request just finished (EOS or a guard)."""
        return None if self.rows is None else self.rows[self.row, :-1]


@dataclass
class FrameTicket:
    """A launched frame step: which occupant of which slot produced which row."""

    rows: list[tuple[int, int]]  # (slot, uid) per row
    handle: Any  # the backend's


@dataclass
class AudioTicket:
    slots: list[int]
    launched: list[tuple[list[int], Any]]  # (slots of one codec call, the backend's handle)


class Backend(Protocol):
    """The device side of an engine. Every method takes slots the core validated."""

    num_code_groups: int
    eos_id: int

    # Host work on a request that needs no slot (e.g. its staged prompt rows), done when it is
    # resolved at the edge, off the engine loop; kept in SlotPlan.staged.
    def prepare(self, plan: SlotPlan) -> Any: ...
    def admit(self, slot: int, plan: SlotPlan) -> None: ...
    def release(self, slot: int) -> None: ...
    def prefill(self, slots: list[int]) -> None: ...
    def launch_frames(self, slots: list[int]) -> Any: ...
    def read_frames(self, handle: Any) -> torch.Tensor: ...  # [B, groups + 1] codes, StopCode
    def launch_codec(self, slots: list[int], n: int) -> Any: ...
    def read_codec(self, handle: Any) -> np.ndarray: ...  # [B, n * 1920] float32
    def ready(self, handle: Any) -> bool: ...  # a launched step's outputs are readable now


class EngineCore:
    """admit / prefill / frames / audio / release over one backend and one slot table."""

    def __init__(
        self, backend: Backend, plan: EnginePlan, models=None, keep_codes=False, guards=None
    ):
        self.backend, self.plan, self.models = backend, plan, models
        self.guards = guards or GuardConfig()
        self.num_slots = plan.num_slots
        self.max_len = plan.max_len
        self.table = SlotTable(plan.num_slots)
        self.keep_codes = keep_codes  # keep every frame's codes on the host (tests, corpus)

    # -- admission -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.table.free_count()

    def resolve(self, req) -> ResolvedRequest:
        """Validate and tokenize `req` now (at the edge, e.g. when the HTTP request arrives),
        so that admitting it later only claims a slot. Raises RequestError."""
        from ttsbuild.runtime.engine import plan_admission

        plan = plan_admission(self.models, req, self.plan, self.guards)
        staged = self.backend.prepare(plan)
        return ResolvedRequest(req, plan if staged is None else replace(plan, staged=staged))

    def admit(self, req) -> int:
        """Validate and tokenize `req` (unless it is a ResolvedRequest), claim a slot.
        Raises RequestError or NoFreeSlot."""
        if self.table.free_count() == 0:
            raise NoFreeSlot(f"all {self.num_slots} slots are busy")
        if not isinstance(req, ResolvedRequest):
            req = self.resolve(req)
        return self.admit_plan(req.plan, req.request)

    def admit_plan(self, plan: SlotPlan, request=None) -> int:
        slot = self.table.claim(SlotRecord(plan, request))
        try:
            self.backend.admit(slot, plan)
        except BaseException:
            self.table.release(slot)
            raise
        return slot

    def release(self, slot: int) -> None:
        if slot in self.table.records:
            self.table.release(slot)
            self.backend.release(slot)

    # -- stages ----------------------------------------------------------------------------
    def prefill(self, slots: list[int]) -> None:
        if slots:
            self.backend.prefill(slots)

    def launch_frames(self, slots: list[int]) -> FrameTicket:
        """Launch one frame for each slot (prefilled, not finished, under its limit)."""
        rows = []
        for s in slots:
            rec = self.table[s]
            if not rec.can_launch:
                raise RuntimeError(f"slot {s} is finished or at its frame limit")
            if rec.launched - rec.decoded >= self.plan.codec_ring:
                raise RuntimeError(
                    f"slot {s} has {rec.launched - rec.decoded} frames not yet decoded; the "
                    f"code ring holds {self.plan.codec_ring}: call audio() more often"
                )
            rec.launched += 1
            rows.append((s, rec.uid))
        handle = self.backend.launch_frames(slots) if slots else None
        return FrameTicket(rows, handle)

    def collect(self, ticket: FrameTicket) -> list[FrameOutput]:
        """The step's frames, committed in order; rows whose request ended meanwhile (EOS
        one step earlier, or released) are dropped."""
        if ticket.handle is None:
            return []
        codes = self.backend.read_frames(ticket.handle)
        stops = codes[:, -1].tolist()  # one read: indexing a tensor per row costs ~5 us a row
        out = []
        records = self.table.records
        for j, (slot, uid) in enumerate(ticket.rows):
            rec = records.get(slot)
            if rec is None or rec.uid != uid or rec.finished:
                continue
            out.append(self.table.commit(slot, stops[j], codes, j, self.keep_codes))
        return out

    def frames(self, slots: list[int]) -> list[FrameOutput]:
        """One frame for each slot, read back at once (launch + collect)."""
        return self.collect(self.launch_frames(slots))

    def launch_audio(
        self, slots: list[int], max_frames: int | Sequence[int | None] | None = None
    ) -> AudioTicket:
        """Launch the codec on each slot's frames known to be real and not yet decoded (at
        most max_frames: one cap for all, or one per slot, None for none), in the plan's
        codec chunk sizes, batching slots that need the same chunk. Returns at once;
        `collect_audio` reads the PCM."""
        caps = max_frames if isinstance(max_frames, Sequence) else [max_frames] * len(slots)
        if len(caps) != len(slots):
            raise ValueError(f"{len(caps)} frame caps for {len(slots)} slots")
        todo = {}
        for s, cap in zip(slots, caps, strict=True):
            rec = self.table[s]
            n = rec.known_frames - rec.decoded
            todo[s] = n if cap is None else min(n, cap)
        launched = []
        for chunk in reversed(self.plan.codec_chunks):
            ready = [s for s, n in todo.items() if n >= chunk]
            while ready:
                for i in range(0, len(ready), self.plan.max_batch):
                    group = ready[i : i + self.plan.max_batch]
                    launched.append((group, self.backend.launch_codec(group, chunk)))
                    for s in group:
                        todo[s] -= chunk
                        self.table[s].decoded += chunk
                ready = [s for s, n in todo.items() if n >= chunk]
        return AudioTicket(list(slots), launched)

    def collect_audio(self, ticket: AudioTicket) -> dict[int, np.ndarray]:
        """float32 PCM per slot of a launched codec step (empty where nothing was ready)."""
        pieces: dict[int, list[np.ndarray]] = {s: [] for s in ticket.slots}
        for group, handle in ticket.launched:
            pcm = self.backend.read_codec(handle)
            for j, s in enumerate(group):
                pieces[s].append(pcm[j])
        empty = np.zeros(0, dtype=np.float32)
        # one piece: the backend's read made it fresh (nothing else holds it): no second copy
        return {s: (p[0] if len(p) == 1 else np.concatenate(p)) if p else empty
                for s, p in pieces.items()}  # fmt: skip

    def audio(self, slots: list[int], max_frames: int | None = None) -> dict[int, np.ndarray]:
        """Decode and read back at once (launch_audio + collect_audio)."""
        return self.collect_audio(self.launch_audio(slots, max_frames))

    def ready(self, ticket: FrameTicket | AudioTicket) -> bool:
        """True once a launched step can be read back without waiting (never blocks)."""
        if isinstance(ticket, FrameTicket):
            return ticket.handle is None or self.backend.ready(ticket.handle)
        return all(self.backend.ready(handle) for _, handle in ticket.launched)

    # -- queries ---------------------------------------------------------------------------
    def can_launch(self, slot: int) -> bool:
        """The slot may get another frame (not finished, under its frame limit)."""
        return self.table[slot].can_launch

    def seed_of(self, slot: int) -> int:
        return self.table[slot].plan.seed

    def pending_frames(self, slot: int) -> int:
        rec = self.table[slot]
        return rec.known_frames - rec.decoded

    def is_finished(self, slot: int) -> bool:
        return self.table[slot].finished

    def frames_of(self, slot: int) -> int:
        return self.table[slot].committed

    def stopped_by(self, slot: int) -> str | None:
        return self.table[slot].stopped_by

    def codes_of(self, slot: int) -> torch.Tensor:
        """[frames, groups] codes collected so far (needs keep_codes)."""
        rec = self.table[slot]
        if not self.keep_codes:
            raise RuntimeError("codes are kept only with keep_codes=True")
        if not rec.codes:
            return torch.zeros(0, self.backend.num_code_groups, dtype=torch.int64)
        return torch.stack(rec.codes)


def run_to_completion(core: EngineCore, slots: list[int], on_step=None) -> None:
    """The frame loop: prefill `slots`, then launch step t+1 before collecting step t until
    every slot has finished. on_step(outputs) after each collected step."""
    core.prefill(slots)
    pending: FrameTicket | None = None
    while True:
        active = [s for s in slots if core.table[s].can_launch]
        ticket = core.launch_frames(active) if active else None
        if pending is not None:
            outputs = core.collect(pending)
            if on_step is not None:
                on_step(outputs)
        if ticket is None:
            return
        pending = ticket


# -- the eager backend ---------------------------------------------------------------------


@dataclass
class _EagerSlot:
    plan: SlotPlan
    position: int = 0
    frame_idx: int = 0
    hidden: torch.Tensor | None = None  # [hidden] talker state that produces the next c0
    logits: torch.Tensor | None = None  # [vocab]
    history: torch.Tensor | None = None  # [vocab] bool
    codes: list[torch.Tensor] = field(default_factory=list)  # every launched frame (device)
    decoded: int = 0
    codec_stream: Any = None


class EagerBackend:
    """The reference modules, eagerly, on any device (`generation.generate.ReferenceModel`)."""

    def __init__(self, ref, codec=None, guards: GuardConfig | None = None):
        self.ref, self.codec = ref, codec
        self.guards = guards or GuardConfig()
        self.guard_state = GuardState.zeros(ref.cache.num_slots, self.guards, ref.device)
        self.cfg = ref.cfg
        self.device = ref.device
        self.num_code_groups = self.cfg.num_code_groups
        self.eos_id = self.cfg.codec_ids.eos
        self.slots: dict[int, _EagerSlot] = {}

    def prepare(self, plan: SlotPlan) -> None:
        return None  # nothing to stage: each slot runs the reference modules on its own

    def admit(self, slot: int, plan: SlotPlan) -> None:
        from ttsbuild.model.codec import CodecStream

        stream = CodecStream(self.codec, 1) if self.codec is not None else None
        context = getattr(plan.prompt, "codec_context", None)
        if stream is not None and context is not None:
            # In-context clone: the reference frames condition the codec like the generated
            # ones will; their own audio is not part of the output.
            with torch.no_grad():
                stream.step(context.T[None].to(self.device))
        self.slots[slot] = _EagerSlot(plan, codec_stream=stream)
        self.guard_state.reset([slot])

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    @torch.no_grad()
    def prefill(self, slots: list[int]) -> None:
        for slot in slots:
            st = self.slots[slot]
            st.hidden, st.logits = self.ref.prefill(slot, st.plan.prompt)
            st.position = st.plan.prompt.num_positions
            st.history = torch.zeros(
                self.cfg.codec_vocab_size, dtype=torch.bool, device=self.device
            )

    @torch.no_grad()
    def launch_frames(self, slots: list[int]) -> torch.Tensor:
        """Runs the step at once; the handle is the codes [B, groups]."""
        ref, dev = self.ref, self.device
        states = [self.slots[s] for s in slots]
        if any(st.logits is None for st in states):
            raise RuntimeError("frames() on a slot that is not prefilled")
        batch = SamplingBatch
        seeds = torch.tensor([st.plan.seed for st in states], dtype=torch.int64, device=dev)
        frame_idx = torch.tensor([st.frame_idx for st in states], device=dev)
        eos_allowed = torch.tensor([st.frame_idx >= st.plan.eos_from for st in states], device=dev)
        c0 = ref.choose_codebook0(
            torch.stack([st.logits for st in states]),
            torch.stack([st.history for st in states]),
            eos_allowed,
            batch.from_params([st.plan.params.talker for st in states], dev),
            seeds,
            frame_idx,
        )
        codes = ref.complete_frames(
            torch.stack([st.hidden for st in states]),
            c0,
            batch.from_params([st.plan.params.code_predictor for st in states], dev),
            seeds,
            frame_idx,
        )
        rows = torch.tensor(slots, device=dev)
        stops = frame_stop_codes(self.guard_state, self.guards, rows, c0, self.eos_id)
        text = torch.stack([st.plan.prompt.text_track(st.frame_idx) for st in states])
        inputs = ref.next_inputs(codes, text.to(ref.dtype))
        positions = torch.tensor([st.position for st in states], device=dev)
        hidden, logits = ref.decode(rows, positions, inputs)
        for j, st in enumerate(states):
            st.history[c0[j]] = True
            st.codes.append(codes[j])
            st.hidden, st.logits = hidden[j], logits[j]
            st.position += 1
            st.frame_idx += 1
        return torch.cat([codes, stops[:, None]], dim=1)  # [B, groups + 1]

    def read_frames(self, handle: torch.Tensor) -> torch.Tensor:
        return handle.cpu()

    def ready(self, handle: Any) -> bool:
        return True  # every step ran when it was launched

    @torch.no_grad()
    def launch_codec(self, slots: list[int], n: int) -> list[np.ndarray]:
        out = []
        for slot in slots:
            st = self.slots[slot]
            codes = torch.stack(st.codes[st.decoded : st.decoded + n], dim=1)[None]  # [1, G, n]
            wav = st.codec_stream.step(codes.to(self.device))
            st.decoded += n
            if self.guards.silence:
                rows = torch.tensor([slot], device=self.device)
                observe_audio(self.guard_state, self.guards, rows, wav[:, 0])
            out.append(wav[0, 0].float().cpu().numpy())
        return out

    def read_codec(self, handle: list[np.ndarray]) -> list[np.ndarray]:
        return handle
