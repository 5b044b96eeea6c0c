"""Cloning from real human speech (a LibriVox clip, tests/data/README.md): the clip passes the
checks, and the mel / x-vector / codes match the official code on it too."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from test_clone_encoders import (
    build_codec_pair,
    build_speaker_pair,
    official_encode,
    official_models,
    rel_err,
    small_tokenizer_config,
)

from ttsbuild.voices.clip import decode_clip

CLIP = pathlib.Path(__file__).parents[1] / "data" / "librivox-0880.wav"
TRANSCRIPT = "He was not an ill disposed young man."


@pytest.fixture(scope="module")
def clip():
    return decode_clip(CLIP.read_bytes())


def test_real_speech_passes_the_clip_checks(clip):
    assert clip.source_rate == 16000 and clip.channels == 1
    assert abs(clip.seconds - 2.99) < 0.01


def test_resampling_matches_the_official_loader(clip):
    import librosa
    import soundfile as sf

    audio, rate = sf.read(CLIP, dtype="float32")  # librosa.load reads WAV through soundfile
    expected = librosa.resample(audio, orig_sr=rate, target_sr=24000)  # the official resampler
    np.testing.assert_allclose(clip.wav, expected, atol=1e-6)


def test_x_vector_of_real_speech_matches_official(clip):
    models, _ = official_models()
    ref, ours = build_speaker_pair(seed=21, dtype=torch.float32)

    class Host:
        speaker_encoder, device, dtype = ref, torch.device("cpu"), torch.float32

    expected = models.Qwen3TTSForConditionalGeneration.extract_speaker_embedding(
        Host(), clip.wav, 24000
    )
    assert rel_err(ours.embed(torch.from_numpy(clip.wav)[None])[0], expected) < 1e-4


def test_codes_of_real_speech_match_official(clip):
    ref, ours = build_codec_pair(small_tokenizer_config(), seed=22, dtype=torch.float64)
    wav = torch.from_numpy(clip.wav)[None]
    expected = official_encode(ref, wav.double())[0]
    assert expected.shape == (38, 16)  # ceil(2.99 s * 12.5)
    assert len(set(expected.flatten().tolist())) > 20
    assert torch.equal(ours(wav)[0], expected)
