"""Voice cloning through the engine: a Base stand-in, both modes, the reference cut, the CLI."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import soundfile as sf
import torch
from audio_fixtures import voiced
from typer.testing import CliRunner

from ttsbuild.cli import app
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import EagerEngine, Models, synthesize
from ttsbuild.runtime.request import RequestError, SynthesisRequest
from ttsbuild.voices.clip import check_clip

TEXT = "The birch canoe slid on the smooth planks."


@pytest.fixture(scope="module")
def models(tiny_base_checkpoint):
    return Models.load(load_checkpoint(tiny_base_checkpoint), device="cpu")


_CLONES: dict = {}


def clone_of(models, transcript: str | None, seconds: float = 2.0, seed: int = 0):
    """Encoding is the slow part on CPU: each distinct clip is encoded once per module."""
    key = (id(models), transcript, seconds, seed)
    if key not in _CLONES:
        clip = check_clip(voiced(seconds, seed=seed), 24000)
        voice = models.voice_encoder.encode(clip, transcript)
        _CLONES[key] = voice.prompt_clone(models.tokenizer)
    return _CLONES[key]


def test_base_checkpoint_loads_its_encoders(models, tiny_base_checkpoint):
    assert models.voice_encoder is not None
    assert models.voice_encoder.x_vector_size == models.cfg.talker.hidden_size
    clone = clone_of(models, "hello")
    assert clone.ref_codes.shape == (25, 16)  # 2 s at 12.5 frames/s
    assert clone.x_vector.shape == (models.cfg.talker.hidden_size,)


@pytest.mark.parametrize("transcript", [None, "A reference transcript."])
def test_both_clone_modes_synthesize(models, transcript):
    req = SynthesisRequest(TEXT, clone=clone_of(models, transcript), seed=3, max_frames=8)
    pcm, stats = synthesize(EagerEngine(models, num_slots=1, max_len=512), req)
    assert stats["frames"] == 8 and pcm.shape == (8 * 1920,)
    assert np.isfinite(pcm).all() and np.abs(pcm).max() > 0


def test_the_voice_changes_the_logits(models):
    """The x-vector reaches the model. Logits, not codes: the peaked stand-in's codes follow
    its inputs' embeddings closely (model.standin), so a voice moves its logits only a little
    (~0.4 % on the tiny stand-in) and the same seed can sample the same first codes."""
    from ttsbuild.generation.generate import ReferenceModel
    from ttsbuild.generation.prompt import build_prompt

    def logits(clone):
        spec = models.prompt_spec(SynthesisRequest(TEXT, clone=clone, seed=3))
        prompt = build_prompt(models.talker, spec, models.code_predictor)
        ref = ReferenceModel(models.talker, models.code_predictor, 1, 512)
        return ref.prefill(0, prompt)[1]

    a, b = logits(clone_of(models, None, seed=1)), logits(clone_of(models, None, seed=2))
    assert (a - b).abs().max() > 1e-3 * a.abs().max()


def test_in_context_audio_continues_the_reference(models):
    """The codec decodes reference + generated frames; the output is the generated part."""
    clone = clone_of(models, "A reference transcript.", seconds=1.5)
    engine = EagerEngine(models, num_slots=1, max_len=512)
    slot = engine.admit(SynthesisRequest(TEXT, clone=clone, seed=4, max_frames=7))
    engine.prefill([slot])
    frames, audio = [], []
    while not engine.is_finished(slot):
        frames.append(engine.frames([slot])[0].codes)
        if len(frames) % 3 == 0:
            audio.append(engine.audio([slot])[slot])
    audio.append(engine.audio([slot])[slot])
    got = np.concatenate(audio)
    codes = torch.cat([clone.ref_codes, torch.stack(frames)])  # [F + 7, 16]
    with torch.no_grad():
        full = models.codec(codes.T[None])[0, 0].numpy()
    expected = full[clone.ref_codes.shape[0] * 1920:]
    assert got.shape == expected.shape == (7 * 1920,)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    # Without the reference as context the first samples differ: the priming matters.
    with torch.no_grad():
        alone = models.codec(torch.stack(frames).T[None])[0, 0].numpy()
    assert np.abs(alone - expected).max() > 1e-3 * np.abs(expected).max()


def test_requests_the_model_cannot_serve_are_refused(models, tiny_checkpoint):
    engine = EagerEngine(models, num_slots=1, max_len=512)
    with pytest.raises(RequestError, match="reference clip or a registered voice"):
        engine.admit(SynthesisRequest(TEXT))
    with pytest.raises(RequestError, match="no instruction"):
        engine.admit(SynthesisRequest(TEXT, instruct="whisper", clone=clone_of(models, None)))
    other = Models.load(load_checkpoint(tiny_checkpoint), device="cpu")
    with pytest.raises(RequestError, match="needs a Base checkpoint"):
        EagerEngine(other, num_slots=1).admit(
            SynthesisRequest(TEXT, voice="ryan", clone=clone_of(models, None)))
    assert engine.free_slots() == 1


def test_cli_synth_clones_from_a_clip(tiny_base_checkpoint, tiny_checkpoint, tmp_path):
    clip = pathlib.Path(__file__).parents[1] / "data" / "librivox-0880.wav"  # real speech
    out = tmp_path / "out.wav"
    runner = CliRunner()
    args = ["synth", str(tiny_base_checkpoint), TEXT, "-o", str(out), "--max-frames", "5",
            "--seed", "1", "--device", "cpu", "--ref-audio", str(clip)]
    result = runner.invoke(app, [*args, "--ref-text", "He was not an ill disposed young man."])
    assert result.exit_code == 0, result.output
    pcm, rate = sf.read(out)
    assert rate == 24000 and len(pcm) == 5 * 1920

    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF....WAVEjunk")
    result = runner.invoke(app, [*args[:-1], str(bad)])
    assert result.exit_code == 1 and "not an audio file" in result.output
    result = runner.invoke(app, ["synth", str(tiny_checkpoint), TEXT, "-o", str(out),
                                 "--voice", "ryan", "--ref-audio", str(clip), "--device", "cpu"])
    assert result.exit_code == 1 and "needs a Base" in result.output


def test_graph_engine_primes_a_voice_once(models):
    """In-context clones on the graph backend (CPU): the codec state after the reference
    frames is kept per voice, so a second request copies it instead of priming again; its
    audio equals the first request's and the eager engine's."""
    from ttsbuild.runtime.graph_engine import GraphEngine
    from ttsbuild.runtime.plan import EnginePlan

    clone = clone_of(models, "A reference transcript.", seconds=1.5)
    req = SynthesisRequest(TEXT, clone=clone, seed=4, max_frames=6)
    plan = EnginePlan(num_slots=2, max_len=512, max_text=64, batch_buckets=(1, 2),
                      prefill_buckets=(128,), codec_chunks=(1, 2), codec_ring=8)  # fmt: skip
    engine = GraphEngine(models, plan, use_graphs=False)
    first, stats = synthesize(engine, req)
    assert engine.backend.primed_hits == 0 and len(engine.backend.primed) == 1
    assert engine.backend.memory_report()["primed_codec_states"] > 0
    second, _ = synthesize(engine, req)
    assert engine.backend.primed_hits == 1
    eager, _ = synthesize(EagerEngine(models, num_slots=1, max_len=512), req)
    assert stats["frames"] == 6 and np.abs(first).max() > 0
    assert np.abs(second - first).max() <= 1e-6 * np.abs(first).max()
    assert np.abs(first - eager).max() <= 1e-5 * np.abs(eager).max()
