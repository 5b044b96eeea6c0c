"""Guards in both engines, on stand-ins built to misbehave the way real checkpoints do (never
emitting EOS, looping on a short cycle of codes, going silent after speech; how they are
built: tests/misbehaving.py), and on normal stand-ins, which no guard may cut short."""

from __future__ import annotations

import itertools
import math
from importlib import resources

import pytest
from misbehaving import cycling, fading_codec, fading_codec_engine, make_engine, never_eos

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.generation.guards import GuardConfig, text_frame_budget
from ttsbuild.model.codec import CodecStream
from ttsbuild.runtime.codec_engine import CodecEngine
from ttsbuild.runtime.engine import EagerEngine, Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest

SENTENCE = "The birch canoe slid on the smooth planks."  # budget 8 s = 100 frames
# Small settings keep CPU runs short; the unit tests cover the detectors at any setting.
GUARDS = GuardConfig(repetition_window=12, repetition_max_period=6, silence_s=0.5,
                     budget_floor_s=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    m = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    m.length_rule = None  # a real checkpoint: EOS and the guards decide
    return m


def run(engine, req: SynthesisRequest, audio_every: int | None = None) -> tuple[int, str]:
    """Generate `req` to its end (pulling audio every `audio_every` frames); returns (frames,
    stop reason) and checks the slot is given back."""
    slot = engine.admit(req)
    engine.prefill([slot])
    while not engine.is_finished(slot):
        engine.frames([slot])
        if audio_every and engine.pending_frames(slot) >= audio_every:
            engine.audio([slot])
    result = engine.frames_of(slot), engine.stopped_by(slot)
    engine.release(slot)
    assert engine.free_slots() == 2
    return result


@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_a_model_that_never_stops_ends_at_its_text_budget(models, kind):
    engine = make_engine(kind, models, GUARDS, never_eos)
    req = SynthesisRequest(text="Hi.", voice="ryan", seed=3)
    budget = text_frame_budget("Hi.", "auto", GUARDS)
    assert budget == math.ceil(12.5 * (2.5 * 3 / 15 + 1))  # 3 characters, margin 2.5, pad 1 s
    assert run(engine, req) == (budget, "text_budget")
    # The request's own max_frames replaces the budget (up to the checkpoint's cap).
    longer = SynthesisRequest(text="Hi.", voice="ryan", seed=3, max_frames=budget + 4)
    assert run(engine, longer) == (budget + 4, "max_frames")


@pytest.mark.parametrize(("kind", "cycle"), [("eager", [7]), ("graph", [7, 300, 41])])
def test_a_looping_model_is_stopped_by_the_repetition_guard(models, kind, cycle):
    engine = make_engine(kind, models, GUARDS, cycling(cycle))
    frames, reason = run(engine, SynthesisRequest(text=SENTENCE, voice="vivian", seed=1))
    # The loop is certain once window + period codes are in: that frame is dropped.
    assert (frames, reason) == (GUARDS.repetition_window + len(cycle) - 1, "repetition")
    assert frames < text_frame_budget(SENTENCE, "auto", GUARDS)


@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_a_model_that_goes_silent_is_stopped_by_the_silence_guard(models, kind, monkeypatch):
    speech_frames = 4
    monkeypatch.setattr(CodecStream, "step", fading_codec(speech_frames))
    monkeypatch.setattr(CodecEngine, "step", fading_codec_engine(speech_frames))
    engine = make_engine(kind, models, GUARDS, never_eos)
    chunk = 2
    frames, reason = run(engine, SynthesisRequest(text=SENTENCE, voice="eric", seed=2), chunk)
    assert reason == "silence"
    # Stopped once silence_s of decoded audio is silent, at most one audio chunk later.
    silent_after = speech_frames + GUARDS.silence_frames
    assert silent_after <= frames <= silent_after + chunk
    assert frames < text_frame_budget(SENTENCE, "auto", GUARDS)


@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_a_normal_standin_is_never_cut_short(tiny_checkpoint, kind):
    """Stand-ins at their length rule, every guard at its default and audio decoded as a server
    does, over prompts spread across the shipped Harvard set (the length rule against the text
    budget is checked for every prompt in tests/generation/test_guards.py)."""
    standin = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    prompts = (resources.files("ttsbuild.data") / "harvard720.txt").read_text().splitlines()
    texts = prompts[(kind == "graph") * 22 :: 45]  # 16 prompts per engine, 32 in all
    if kind == "eager":
        engine = EagerEngine(standin, num_slots=16, max_len=256)
    else:
        plan = EnginePlan(num_slots=16, max_len=256, max_text=64, batch_buckets=(16,),
                          prefill_buckets=(32, 64, 128), codec_chunks=(1, 2, 4, 8),
                          codec_ring=16)  # fmt: skip
        engine = GraphEngine(standin, plan, use_graphs=False)
    voices = itertools.cycle(["ryan", "vivian", "eric", "aiden"])
    slots = {engine.admit(SynthesisRequest(text=t, voice=next(voices), seed=i)): t
             for i, t in enumerate(texts)}  # fmt: skip
    engine.prefill(list(slots))
    active = list(slots)
    while active:
        engine.frames(active)
        engine.audio([s for s in active if engine.pending_frames(s) >= 8])
        active = [s for s in active if not engine.is_finished(s)]
    for slot, text in slots.items():
        expected = standin.length_rule.frames_for(text)
        assert (engine.frames_of(slot), engine.stopped_by(slot)) == (expected, "length_rule")
