"""Stand-ins built to misbehave the way real checkpoints do (tests/runtime/test_engine_guards.py,
tests/serve/test_guards.py).

How they are made: the tiny stand-in is run as a real checkpoint (its
length rule removed, so EOS and the guards decide) and its codebook-0 logits are wrapped:
  - never emits EOS: the EOS logit is pushed to -1e9 (random weights alone emit EOS now and
    then, so this makes "never" exact);
  - repeats a short cycle: one code of a fixed cycle (length 1 or 3) gets +1e4 at each talker
    call, so codebook 0 loops while codebooks 1..15 stay sampled (a frozen or looping model);
  - goes silent: the codec's output is scaled by 1e-4 (-80 dB) from a given frame on, for
    every row (a model that keeps generating near-silent frames after speech).
The wrap is a forward hook on the talker's codec head (eager engine) or a wrapper around the
graph engine's packed head (its CPU path runs the same functions as its CUDA graphs); the
silence, a wrapper around `CodecStream.step` that both engines use.
"""

from __future__ import annotations

import copy
import itertools

import torch

from ttsbuild.generation.guards import GuardConfig
from ttsbuild.model.codec import CodecStream
from ttsbuild.runtime.codec_engine import CodecEngine
from ttsbuild.runtime.engine import EagerEngine, Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan

EOS = 2150


def make_engine(kind: str, models: Models, guards: GuardConfig, logits_fn):
    models = copy.deepcopy(models)  # the hooks must not leak into other tests
    if kind == "eager":
        engine = EagerEngine(models, num_slots=2, max_len=256, guards=guards)
        wrap_codebook0_logits(models, logits_fn)
    else:
        plan = EnginePlan(num_slots=2, max_len=256, max_text=64, batch_buckets=(1, 2),
                          prefill_buckets=(32, 64, 128), codec_chunks=(1, 2, 4),
                          codec_ring=64)  # fmt: skip
        engine = GraphEngine(models, plan, use_graphs=False, guards=guards)
        head = engine.backend.codec_head
        engine.backend.codec_head = lambda h: logits_fn(head(h))
    return engine


def never_eos(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.clone()
    logits[..., EOS] = -1e9
    return logits


def cycling(codes: list[int]):
    """Codebook-0 logits that pick the next code of `codes` at every talker call."""
    turn = itertools.count()

    def fn(logits):
        logits = never_eos(logits)
        logits[..., codes[next(turn) % len(codes)]] += 1e4
        return logits

    return fn


def wrap_codebook0_logits(models, fn) -> None:
    """Every codebook-0 logit the eager engine computes goes through fn (models is changed)."""
    models.talker.codec_head.register_forward_hook(lambda _m, _i, out: fn(out))


def fading_codec(speech_frames: int):
    """A CodecStream.step whose audio drops by 80 dB from frame `speech_frames` of each row."""
    step = CodecStream.step

    def fading_step(self, codes):
        start = self.pos.clone()  # frames each row had decoded before this step
        wav = step(self, codes)
        frame = start[:, None] + torch.arange(wav.shape[-1], device=wav.device) // 1920
        return wav * torch.where(frame >= speech_frames, 1e-4, 1.0)[:, None]

    return fading_step


def fading_codec_engine(speech_frames: int):
    """The same for the graph backend's slot-indexed `CodecEngine.step`."""
    step = CodecEngine.step

    def fading_step(self, rows, codes):
        start = self.pos[rows].clone()  # frames each row had decoded before this step
        wav = step(self, rows, codes)
        frame = start[:, None] + torch.arange(wav.shape[-1], device=wav.device) // 1920
        return wav * torch.where(frame >= speech_frames, 1e-4, 1.0)

    return fading_step
