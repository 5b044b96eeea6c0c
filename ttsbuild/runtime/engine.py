"""The engine API: requests live in slots; the caller decides which slots run which stage.

Stages (each batched over the slots given):
  prefill(slots)       prompt -> talker KV cache, codebook-0 logits ready
  frames(slots)        codebook 0 + code predictor (codebooks 1..15) + the talker step on the
                       new frame (the graph backend runs it at the start of the next step,
                       so a first frame waits for no talker step); returns each slot's new
                       frame, or marks it finished
  audio(slots)         the codec on every frame not yet decoded -> PCM for each slot
A request's frames never leave the engine between stages: `audio` reads them where
`frames` wrote them. Both engines are one `runtime.core.EngineCore` (slot table, EOS and
limits, the frame loop; `launch_frames` + `collect` for pipelined steps) over a backend:
`EagerEngine` runs the reference modules eagerly on any device, `GraphEngine`
(`runtime.graph_engine`) replays CUDA graphs. A request is resolved once, here, by
`plan_admission` into a `SlotPlan` the engines trust.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ttsbuild.convert.checkpoint import Checkpoint
from ttsbuild.generation.generate import GenerationParams, LengthRule, ReferenceModel
from ttsbuild.generation.guards import GuardConfig, StopReason, text_frame_budget
from ttsbuild.generation.prompt import (
    PromptError,
    PromptSpec,
    assistant_text,
    build_prompt,
    instruct_text,
)
from ttsbuild.generation.sampling import SamplingParams
from ttsbuild.model.codec import CodecConfig, CodecDecoder
from ttsbuild.model.config import ModelConfig
from ttsbuild.model.talker import CodePredictor, Talker
from ttsbuild.runtime.core import (  # noqa: F401  (re-exported: the engine API)
    EagerBackend,
    EngineCore,
    FrameOutput,
    NoFreeSlot,
    SlotPlan,
    run_to_completion,
)
from ttsbuild.runtime.draft import load_attached_draft
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import RequestError, SamplingOverrides, SynthesisRequest
from ttsbuild.text.tokenizer import TextTokenizer
from ttsbuild.voices.encoder import VoiceEncoder

SAMPLE_RATE = 24000
_NO_OVERRIDES = SamplingOverrides()  # a request that keeps the checkpoint's sampling


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
    # Base checkpoints: speaker encoder + codec encoder, to turn reference clips into voices.
    voice_encoder: VoiceEncoder | None = None
    # Trained draft heads [G - 1, codebook_size, code-predictor hidden] for speculative
    # decoding of the code predictor (runtime.draft), when the checkpoint ships one.
    draft_heads: torch.Tensor | None = None
    _base_params: tuple | None = field(default=None, init=False, repr=False, compare=False)

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
        voice_encoder = None
        if cfg.tts_model_type == "base":
            voice_encoder = VoiceEncoder.from_tensors(
                ckpt.config, ckpt.codec_config, ckpt.tensors("speaker_encoder"),
                ckpt.tensors("codec_encoder"), device,
            )
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
            voice_encoder=voice_encoder,
            draft_heads=load_attached_draft(ckpt.path, ckpt.manifest["files"], cfg, device, dtype),
        )

    def offload_codec_decoder(self) -> None:
        """Move the checkpoint's codec decoder to host memory: a backend that built its own
        codec engine from it (runtime.codec_engine) holds the only device copy from here on.
        Host memory, not freed: anything still using the module runs, on the CPU."""
        self.codec = self.codec.to("cpu")

    def drop_decoder_layers(self) -> None:
        """Free the talker's and code predictor's decoder layers (a fast backend that packed
        them keeps the only copy); the embeddings, text projection and heads stay."""
        for module in (self.talker, self.code_predictor):
            module.model.layers = torch.nn.ModuleList()

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
        # the checkpoint's defaults, parsed once per generation_config (on the admission path)
        cached = self._base_params
        if cached is None or cached[0] is not self.generation_config:
            cached = (self.generation_config,
                      GenerationParams.from_generation_config(self.generation_config))
            self._base_params = cached
        base = cached[1]
        s = req.sampling
        if s == _NO_OVERRIDES and req.max_frames is None:
            return base

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
        if self.cfg.tts_model_type == "base":
            if req.clone is None:
                raise RequestError("this is a voice-clone (Base) model: give a reference clip "
                                   "or a registered voice")
            if req.instruct:
                raise RequestError("Base (voice-clone) models take no instruction")
            voice = None
        elif req.clone is not None:
            raise RequestError("voice cloning needs a Base checkpoint")
        instruct = req.instruct.strip() if req.instruct else None
        return PromptSpec(
            text_ids=self.tokenizer.encode(assistant_text(req.text)),
            speaker=voice,
            language=req.language,
            instruct_ids=self.tokenizer.encode(instruct_text(instruct)) if instruct else None,
            non_streaming=(
                self.default_non_streaming() if req.non_streaming is None else req.non_streaming
            ),
            clone=req.clone,
        )


def plan_admission(
    models: Models, req: SynthesisRequest, plan: EnginePlan, guards: GuardConfig = GuardConfig()
) -> SlotPlan:
    """Resolve a request once, at the edge: tokenize and lay out the prompt, resolve
    sampling, fix how many frames it may generate (and what that limit is: see
    `resolve_frame_limit`), and check it fits the engine's plan. Every refusal is a
    RequestError (a 400 with this message)."""
    spec = models.prompt_spec(req)
    params = models.generation_params(req)
    try:
        prompt = build_prompt(models.talker, spec, models.code_predictor)
    except PromptError as exc:
        raise RequestError(str(exc)) from None
    n_prompt, n_text = prompt.num_positions, prompt.num_trailing  # host only: no embedding here
    rule = models.length_rule
    if req.max_frames is not None and req.max_frames > plan.max_frames:
        raise RequestError(
            f"max_frames {req.max_frames} exceeds this engine's limit of {plan.max_frames}"
        )
    limit, reason = resolve_frame_limit(models, req, params, guards)
    if limit > plan.max_frames:
        limit, reason = plan.max_frames, StopReason.MAX_FRAMES
    if n_prompt + limit > plan.max_len and rule is None and req.max_frames is None:
        # a real checkpoint: stop at the context if EOS is late
        limit, reason = plan.max_len - n_prompt, StopReason.MAX_FRAMES
    try:
        plan.check_prompt(n_prompt, n_text, max(limit, 1))
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return SlotPlan(
        prompt, replace(params, max_frames=limit), limit, rule is not None, seed,
        limit_reason=str(reason), guard_free=guards.earliest_stop_frame(),
    )  # fmt: skip


def resolve_frame_limit(
    models: Models, req: SynthesisRequest, params: GenerationParams, guards: GuardConfig
) -> tuple[int, StopReason]:
    """The request's frame limit and what it is, before the engine's context is considered.

    A stand-in speaks for its length rule. A request's own max_frames replaces the text budget
    (the client's override, capped by the checkpoint's max_new_tokens in `params`); otherwise
    the text budget applies when it is below that cap."""
    rule = models.length_rule
    cap = params.max_frames if req.max_frames is None else min(params.max_frames, req.max_frames)
    candidates = [(cap, StopReason.MAX_FRAMES)]
    if guards.text_budget and (rule is not None or req.max_frames is None):
        budget = text_frame_budget(req.text, req.language, guards)
        candidates.append((budget, StopReason.TEXT_BUDGET))
    if rule is not None:
        candidates.append((rule.frames_for(req.text, req.language), StopReason.LENGTH_RULE))
    # On a tie the later (more specific) reason wins: the length rule, then the budget.
    return min(reversed(candidates), key=lambda c: c[0])


class EagerEngine(EngineCore):
    """The reference implementation of the engine API (eager PyTorch, CPU or GPU)."""

    def __init__(
        self,
        models: Models,
        num_slots: int = 8,
        max_len: int = 2048,
        plan: EnginePlan | None = None,
        keep_codes: bool = False,
        guards: GuardConfig | None = None,
    ):
        plan = plan or EnginePlan.default(num_slots=num_slots, max_len=max_len)
        if plan.talker_kv_fp8:
            raise ValueError("an FP8 talker KV cache is the graph engine's: the eager engine "
                             "keeps the reference model's cache")  # fmt: skip
        guards = guards or GuardConfig()
        ref = ReferenceModel(models.talker, models.code_predictor, plan.num_slots, plan.max_len)
        backend = EagerBackend(ref, models.codec, guards)
        super().__init__(backend, plan, models, keep_codes, guards)
        self.device = ref.device


def synthesize(
    engine: EngineCore, req: SynthesisRequest, on_frames=None, chunk_frames: int = 16
) -> tuple[np.ndarray, dict]:
    """Run one request to completion on a free slot. Returns (float32 PCM, stats).

    Audio is decoded every `chunk_frames` frames (the codec is exact for any split);
    on_frames(total_frames) is called after each frame. An engine that keeps codes adds them
    to the stats.
    """
    slot = engine.admit(req)
    chunks = []

    def on_step(outputs) -> None:
        if on_frames is not None:
            on_frames(engine.frames_of(slot))
        if engine.pending_frames(slot) >= chunk_frames:
            chunks.append(engine.audio([slot])[slot])

    try:
        run_to_completion(engine, [slot], on_step)
        chunks.append(engine.audio([slot])[slot])
        stats = {
            "frames": engine.frames_of(slot),
            "stopped_by": engine.stopped_by(slot),
            "seed": engine.seed_of(slot),
        }
        if engine.keep_codes:
            stats["codes"] = engine.codes_of(slot)  # [frames, groups]
        return np.concatenate(chunks), stats
    finally:
        engine.release(slot)


def random_models(
    variant: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    peaked: bool = True,
) -> Models:
    """A random-weight stand-in of a shipped variant built directly in memory (no files).

    For benchmarks: the real shapes, the stand-in tokenizer and length rule, weights drawn on
    the target device (std 0.02 as `init-random`, then peaked as `init-random` peaks them:
    `model.standin.peak_logits`; with the audible codec init)."""
    import tempfile

    from ttsbuild.convert.init_random import LENGTH_RULE, load_variant
    from ttsbuild.model.codec import random_codec_state
    from ttsbuild.model.standin import peak_logits
    from ttsbuild.model.standin import record as standin_record
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
    models = Models(
        cfg=cfg,
        talker=talker.to(dtype).eval(),
        code_predictor=cp.to(dtype).eval(),
        codec=codec.float().eval(),
        codec_cfg=codec_cfg,
        tokenizer=tokenizer,
        generation_config=gen_config,
        length_rule=LengthRule.from_standin(standin),
        manifest={"standin": standin, "variant": {"name": variant}},
        voice_encoder=(
            VoiceEncoder.random(config, st_config, device, seed)
            if cfg.tts_model_type == "base" else None
        ),
    )
    standin["logits"] = peak_logits(models) if peaked else standin_record(False)
    return models
