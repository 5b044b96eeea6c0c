"""A compiled Base engine keeps its voice-clone encoders and clones like the checkpoint."""

from __future__ import annotations

import numpy as np
from audio_fixtures import voiced

from ttsbuild.build.compile import BuildConfig, compile_engine_dir
from ttsbuild.calibration.corpus import generate_corpus
from ttsbuild.runtime.artifact import load_models
from ttsbuild.runtime.engine import EagerEngine, synthesize
from ttsbuild.runtime.request import SynthesisRequest
from ttsbuild.voices.clip import check_clip

from .conftest import QUICK


def test_base_engine_clones_like_its_checkpoint(tiny_base_checkpoint, tmp_path):
    engine_dir = tmp_path / "engine"
    compile_engine_dir(tiny_base_checkpoint, engine_dir, BuildConfig(precision="bf16", **QUICK))
    assert (engine_dir / "speaker_encoder.safetensors").is_file()
    assert (engine_dir / "codec_encoder.safetensors").is_file()
    clip = check_clip(voiced(1.5, seed=7), 24000)
    pcm = []
    for path in (tiny_base_checkpoint, engine_dir):
        models = load_models(path)
        clone = models.voice_encoder.encode(clip, "Some words.").prompt_clone(models.tokenizer)
        req = SynthesisRequest("Hello there.", clone=clone, seed=2, max_frames=3)
        pcm.append(synthesize(EagerEngine(models, num_slots=1, max_len=256), req)[0])
    # The engine's codec is folded (same function, fp32 rounding of its own): equal to rounding.
    assert pcm[0].shape == pcm[1].shape and np.abs(pcm[0]).max() > 0.01
    np.testing.assert_allclose(pcm[0], pcm[1], rtol=0, atol=1e-5 * np.abs(pcm[0]).max())


def test_calibration_corpus_runs_on_a_base_model(tiny_base_checkpoint):
    items = generate_corpus(load_models(tiny_base_checkpoint), ["Hello there."], max_frames=3)
    assert items[0].codes.shape == (3, 16) and items[0].spec.clone is not None
