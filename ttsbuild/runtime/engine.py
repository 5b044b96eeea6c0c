"""The engine API: requests live in slots; the caller decides which slots run which stage.

Stages (each batched over the slots given):
  prefill(slots)       prompt -> talker KV cache, codebook-0 logits ready
  frames(slots)        codebook 0 + code predictor (codebooks 1..15) + the next talker step;
                       returns each slot's new frame, or marks it finished
  audio(slots)         the codec on every frame not yet decoded -> PCM for each slot
A request's frames never leave the engine between stages: `audio` reads them where
`frames` wrote them. `EagerEngine` runs the reference modules eagerly on any device; the GPU
runtime implements the same API with captured graphs.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ttsbuild.convert.checkpoint import Checkpoint
from ttsbuild.generation.generate import GenerationParams, LengthRule, ReferenceModel
from ttsbuild.generation.guards import (
    GuardConfig,
    GuardState,
    StopCode,
    StopReason,
    frame_stop_codes,
    observe_audio,
    text_frame_budget,
)
from ttsbuild.generation.prompt import (
    Prompt,
    PromptError,
    PromptSpec,
    assistant_text,
    build_prompt,
    instruct_text,
)
from ttsbuild.generation.sampling import SamplingBatch, SamplingParams
from ttsbuild.model.codec import CodecConfig, CodecDecoder, CodecStream
from ttsbuild.model.config import ModelConfig
from ttsbuild.model.talker import CodePredictor, Talker
from ttsbuild.runtime.request import RequestError, SynthesisRequest
from ttsbuild.text.tokenizer import TextTokenizer

SAMPLE_RATE = 24000


class NoFreeSlot(RuntimeError):
    """Every slot is busy: the caller should queue or reject (429)."""


@dataclass
class Models:
    """Everything loaded from a checkpoint, on one device."""

    cfg: ModelConfig
    talker: Talker
    code_predictor: CodePredictor
    codec: CodecDecoder
    codec_cfg: CodecConfig
    tokenizer: TextTokenizer
    generation_config: dict
    length_rule: LengthRule | None
    manifest: dict
    # A compiled engine's talker / code-predictor tensors as stored (fused projections, FP8
    # weights with their scales), for the graph engine; None for a checkpoint.
    packed: dict[str, dict[str, torch.Tensor]] | None = None

    @classmethod
    def load(
        cls, ckpt: Checkpoint, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Models:
        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cfg = ModelConfig.from_official(ckpt.config)
        codec_cfg = CodecConfig.from_official(ckpt.codec_config)
        with torch.device("meta"):
            talker, cp, codec = Talker(cfg), CodePredictor(cfg), CodecDecoder(codec_cfg)
        talker.load_state_dict(ckpt.tensors("talker"), strict=True, assign=True)
        cp.load_state_dict(ckpt.tensors("code_predictor"), strict=True, assign=True)
        codec.load_state_dict(ckpt.tensors("codec"), strict=True, assign=True)
        return cls(
            cfg=cfg,
            talker=talker.to(device=device, dtype=dtype).eval(),
            code_predictor=cp.to(device=device, dtype=dtype).eval(),
            # The codec runs in fp32: its conv stacks are sensitive and cheap next to the LM.
            codec=codec.to(device=device, dtype=torch.float32).eval(),
            codec_cfg=codec_cfg,
            tokenizer=TextTokenizer.from_dir(ckpt.tokenizer_dir),
            generation_config=ckpt.generation_config,
            length_rule=LengthRule.from_standin(ckpt.standin),
            manifest=ckpt.manifest,
        )

    @property
    def voices(self) -> list[str]:
        return sorted(self.cfg.speakers)

    @property
    def languages(self) -> list[str]:
        return ["auto", *sorted(k for k in self.cfg.languages if "dialect" not in k)]

    def default_non_streaming(self) -> bool:
        # CustomVoice and VoiceDesign default to the non-streaming text mode; Base streams.
        return self.cfg.tts_model_type != "base"

    def generation_params(self, req: SynthesisRequest) -> GenerationParams:
        base = GenerationParams.from_generation_config(self.generation_config)
        s = req.sampling

        def pick(value, default):
            return default if value is None else value

        try:
            talker = SamplingParams(
                do_sample=pick(s.do_sample, base.talker.do_sample),
                temperature=pick(s.temperature, base.talker.temperature),
                top_k=pick(s.top_k, base.talker.top_k),
                top_p=pick(s.top_p, base.talker.top_p),
                repetition_penalty=pick(s.repetition_penalty, base.talker.repetition_penalty),
            )
            cp = SamplingParams(
                do_sample=pick(s.subtalker_do_sample, base.code_predictor.do_sample),
                temperature=pick(s.subtalker_temperature, base.code_predictor.temperature),
                top_k=pick(s.subtalker_top_k, base.code_predictor.top_k),
                top_p=pick(s.subtalker_top_p, base.code_predictor.top_p),
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        max_frames = min(base.max_frames, req.max_frames or base.max_frames)
        return replace(base, talker=talker, code_predictor=cp, max_frames=max_frames)

    def prompt_spec(self, req: SynthesisRequest) -> PromptSpec:
        voice = req.voice.lower() if req.voice else None
        if self.cfg.tts_model_type == "voice_design":
            voice = None  # VoiceDesign has no preset voices: the instruction describes one
        elif self.cfg.tts_model_type == "custom_voice" and voice is None:
            raise RequestError(f"a voice is required; known: {', '.join(self.voices)}")
        elif self.cfg.tts_model_type == "base":
            raise RequestError("voice cloning (Base checkpoints) is not supported yet")
        instruct = req.instruct.strip() if req.instruct else None
        return PromptSpec(
            text_ids=self.tokenizer.encode(assistant_text(req.text)),
            speaker=voice,
            language=req.language,
            instruct_ids=self.tokenizer.encode(instruct_text(instruct)) if instruct else None,
            non_streaming=(
                self.default_non_streaming() if req.non_streaming is None else req.non_streaming
            ),
        )


@dataclass
class AdmissionPlan:
    """What admitting a request means, decided once for every engine."""

    prompt: Prompt
    params: GenerationParams
    frame_limit: int  # stop after this many frames (EOS or a guard may stop sooner)
    limit_reason: StopReason  # what frame_limit is: text budget, length rule or max frames
    by_length_rule: bool  # a stand-in: the limit is its length rule and EOS is never sampled
    seed: int


def plan_admission(
    models: Models, req: SynthesisRequest, max_len: int, guards: GuardConfig = GuardConfig()
) -> AdmissionPlan:
    """Tokenize and lay out the prompt, resolve sampling, and fix how many frames the request
    may generate within `max_len` positions. Raises RequestError (the client's fault)."""
    spec = models.prompt_spec(req)
    params = models.generation_params(req)
    try:
        prompt = build_prompt(models.talker, spec)
    except PromptError as exc:
        raise RequestError(str(exc)) from None
    n_prompt = prompt.embeds.shape[0]
    rule = models.length_rule
    limit, reason = resolve_frame_limit(models, req, params, guards)
    if n_prompt + limit > max_len:
        if rule is not None or req.max_frames is not None:
            raise RequestError(
                f"prompt ({n_prompt} positions) + {limit} frames exceeds the engine's "
                f"context of {max_len}"
            )
        # a real checkpoint: stop at the context if EOS is late
        limit, reason = max_len - n_prompt, StopReason.MAX_FRAMES
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return AdmissionPlan(prompt, params, limit, reason, rule is not None, seed)


def resolve_frame_limit(
    models: Models, req: SynthesisRequest, params: GenerationParams, guards: GuardConfig
) -> tuple[int, StopReason]:
    """The request's frame limit and what it is, before the engine's context is considered.

    A stand-in speaks for its length rule. A request's own max_frames replaces the text budget
    (the client's override, capped by the checkpoint's max_new_tokens in `params`); otherwise
    the text budget applies when it is below that cap."""
    rule = models.length_rule
    candidates = [(params.max_frames, StopReason.MAX_FRAMES)]
    if guards.text_budget and (rule is not None or req.max_frames is None):
        budget = text_frame_budget(req.text, req.language, guards)
        candidates.append((budget, StopReason.TEXT_BUDGET))
    if rule is not None:
        candidates.append((rule.frames_for(req.text, req.language), StopReason.LENGTH_RULE))
    # On a tie the later (more specific) reason wins: the length rule, then the budget.
    return min(reversed(candidates), key=lambda c: c[0])


@dataclass
class SlotState:
    request: SynthesisRequest
    prompt: Prompt
    params: GenerationParams
    seed: int
    limit_reason: StopReason  # why params.max_frames ends the request when reached
    eos_banned: bool  # a stand-in: its length rule decides, EOS is never sampled
    position: int = 0  # next talker position
    frames: list[torch.Tensor] = field(default_factory=list)  # [groups] each
    decoded_frames: int = 0  # frames already turned into audio
    finished: bool = False
    stopped_by: str | None = None
    hidden: torch.Tensor | None = None  # [hidden] talker state that produces the next c0
    logits: torch.Tensor | None = None  # [vocab]
    history: torch.Tensor | None = None  # [vocab] bool


@dataclass
class FrameOutput:
    slot: int
    codes: torch.Tensor | None  # [groups], None when the request just finished (EOS)
    finished: bool


class EagerEngine:
    """The reference implementation of the engine API (eager PyTorch, CPU or GPU)."""

    def __init__(
        self,
        models: Models,
        num_slots: int = 8,
        max_len: int = 2048,
        guards: GuardConfig | None = None,
    ):
        self.models = models
        self.num_slots = num_slots
        self.max_len = max_len
        self.guards = guards or GuardConfig()
        self.ref = ReferenceModel(models.talker, models.code_predictor, num_slots, max_len)
        self.device = self.ref.device
        self.guard_state = GuardState.zeros(num_slots, self.guards, self.device)
        self.slots: dict[int, SlotState] = {}
        self._codec_streams: dict[int, CodecStream] = {}

    # -- admission -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.num_slots - len(self.slots)

    def admit(self, req: SynthesisRequest) -> int:
        """Validate and tokenize `req`, claim a slot. Raises RequestError or NoFreeSlot."""
        plan = plan_admission(self.models, req, self.max_len, self.guards)
        free = [s for s in range(self.num_slots) if s not in self.slots]
        if not free:
            raise NoFreeSlot(f"all {self.num_slots} slots are busy")
        slot = free[0]
        params = replace(plan.params, max_frames=plan.frame_limit)
        self.slots[slot] = SlotState(
            req, plan.prompt, params, plan.seed, plan.limit_reason, plan.by_length_rule
        )
        self._codec_streams[slot] = CodecStream(self.models.codec, 1)
        self.guard_state.reset([slot])
        return slot

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self._codec_streams.pop(slot, None)

    def seed_of(self, slot: int) -> int:
        return self.slots[slot].seed

    # -- stages ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slots: list[int]) -> None:
        for slot in slots:
            st = self.slots[slot]
            st.hidden, st.logits = self.ref.prefill(slot, st.prompt)
            st.position = st.prompt.embeds.shape[0]
            st.history = torch.zeros(
                self.models.cfg.codec_vocab_size, dtype=torch.bool, device=self.device
            )

    @torch.no_grad()
    def frames(self, slots: list[int]) -> list[FrameOutput]:
        """One frame for each slot (which must be prefilled and not finished)."""
        if not slots:
            return []
        ref, cfg, dev = self.ref, self.models.cfg, self.device
        states = [self.slots[s] for s in slots]
        if any(st.finished or st.logits is None for st in states):
            raise RuntimeError("frames() on a slot that is finished or not prefilled")
        rows = torch.tensor(slots, device=dev)
        seeds = torch.tensor([st.seed for st in states], dtype=torch.int64, device=dev)
        frame_idx = torch.tensor([len(st.frames) for st in states], device=dev)
        eos_allowed = torch.tensor(
            [len(st.frames) >= st.params.min_new_tokens and not st.eos_banned for st in states],
            device=dev,
        )
        talker_sampling = SamplingBatch.from_params([st.params.talker for st in states], dev)
        cp_sampling = SamplingBatch.from_params([st.params.code_predictor for st in states], dev)
        history = torch.stack([st.history for st in states])
        c0 = ref.choose_codebook0(
            torch.stack([st.logits for st in states]),
            history,
            eos_allowed,
            talker_sampling,
            seeds,
            frame_idx,
        )
        codes = ref.complete_frames(
            torch.stack([st.hidden for st in states]), c0, cp_sampling, seeds, frame_idx
        )
        stops = frame_stop_codes(self.guard_state, self.guards, rows, c0, cfg.codec_ids.eos)
        out, continuing = [], []
        for j, (slot, st, stop) in enumerate(zip(slots, states, stops.tolist(), strict=True)):
            st.history[c0[j]] = True
            if stop != StopCode.CONTINUE:  # the stopping frame is dropped
                st.finished, st.stopped_by = True, StopCode(stop).reason
                out.append(FrameOutput(slot, None, True))
                continue
            st.frames.append(codes[j])
            if len(st.frames) >= st.params.max_frames:
                st.finished, st.stopped_by = True, st.limit_reason
            else:
                continuing.append(j)
            out.append(FrameOutput(slot, codes[j], st.finished))
        if continuing:
            idx = torch.tensor(continuing, device=dev)
            text = torch.stack(
                [states[j].prompt.text_track(len(states[j].frames) - 1) for j in continuing]
            )
            inputs = ref.next_inputs(codes[idx], text.to(ref.dtype))
            positions = torch.tensor([states[j].position for j in continuing], device=dev)
            hidden, logits = ref.decode(rows[idx], positions, inputs)
            for k, j in enumerate(continuing):
                states[j].hidden, states[j].logits = hidden[k], logits[k]
                states[j].position += 1
        return out

    @torch.no_grad()
    def audio(self, slots: list[int], max_frames: int | None = None) -> dict[int, np.ndarray]:
        """Decode each slot's frames not yet decoded (at most max_frames). float32 PCM."""
        pcm = {}
        for slot in slots:
            st = self.slots[slot]
            end = len(st.frames)
            if max_frames is not None:
                end = min(end, st.decoded_frames + max_frames)
            if end <= st.decoded_frames:
                pcm[slot] = np.zeros(0, dtype=np.float32)
                continue
            codes = torch.stack(st.frames[st.decoded_frames : end], dim=1)[None]  # [1, G, n]
            wav = self._codec_streams[slot].step(codes.to(self.device))
            st.decoded_frames = end
            if self.guards.silence:
                rows = torch.tensor([slot], device=self.device)
                observe_audio(self.guard_state, self.guards, rows, wav[:, 0])
            pcm[slot] = wav[0, 0].float().cpu().numpy()
        return pcm

    def pending_frames(self, slot: int) -> int:
        st = self.slots[slot]
        return len(st.frames) - st.decoded_frames

    def is_finished(self, slot: int) -> bool:
        return self.slots[slot].finished

    def frames_of(self, slot: int) -> int:
        return len(self.slots[slot].frames)

    def stopped_by(self, slot: int) -> str | None:
        return self.slots[slot].stopped_by


def synthesize(
    engine, req: SynthesisRequest, on_frames=None, chunk_frames: int = 16
) -> tuple[np.ndarray, dict]:
    """Run one request to completion on a free slot. Returns (float32 PCM, stats).

    Audio is decoded every `chunk_frames` frames (the codec is exact for any split);
    on_frames(total_frames) is called after each frame.
    """
    slot = engine.admit(req)
    try:
        engine.prefill([slot])
        chunks = []
        while not engine.is_finished(slot):
            engine.frames([slot])
            if on_frames is not None:
                on_frames(engine.frames_of(slot))
            if engine.pending_frames(slot) >= chunk_frames:
                chunks.append(engine.audio([slot])[slot])
        chunks.append(engine.audio([slot])[slot])
        stats = {
            "frames": engine.frames_of(slot),
            "stopped_by": engine.stopped_by(slot),
            "seed": engine.seed_of(slot),
        }
        return np.concatenate(chunks), stats
    finally:
        engine.release(slot)


def random_models(
    variant: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Models:
    """A random-weight stand-in of a shipped variant built directly in memory (no files).

    For benchmarks: the real shapes, the stand-in tokenizer and length rule, weights drawn on
    the target device (std 0.02 as `init-random`, with the audible codec init)."""
    import tempfile

    from ttsbuild.convert.init_random import LENGTH_RULE, load_variant
    from ttsbuild.model.codec import random_codec_state
    from ttsbuild.text.standin import write_standin_tokenizer

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config, st_config, gen_config = load_variant(variant)
    cfg, codec_cfg = ModelConfig.from_official(config), CodecConfig.from_official(st_config)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        talker, cp, codec = Talker(cfg), CodePredictor(cfg), CodecDecoder(codec_cfg)
    with torch.no_grad():
        for module in (talker, cp):
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    codec.load_state_dict(random_codec_state(codec_cfg, seed))
    with tempfile.TemporaryDirectory() as tok_dir:
        write_standin_tokenizer(tok_dir)
        tokenizer = TextTokenizer.from_dir(tok_dir)
    standin = {
        "kind": "random-weight stand-in (in memory)",
        "variant": variant,
        "length_rule": dict(LENGTH_RULE),
    }
    return Models(
        cfg=cfg,
        talker=talker.to(dtype).eval(),
        code_predictor=cp.to(dtype).eval(),
        codec=codec.float().eval(),
        codec_cfg=codec_cfg,
        tokenizer=tokenizer,
        generation_config=gen_config,
        length_rule=LengthRule.from_standin(standin),
        manifest={"standin": standin, "variant": {"name": variant}},
    )
