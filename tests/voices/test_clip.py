"""Reference clips: decoded from any common format, resampled, and refused for clear reasons."""

from __future__ import annotations

import numpy as np
import pytest
import soxr
from audio_fixtures import encode, voiced

from ttsbuild.voices.clip import MAX_CLIP_BYTES, ClipError, decode_clip


def test_wav_at_24k_is_kept_sample_for_sample():
    audio = voiced(2.0, seed=1)
    clip = decode_clip(encode(audio, 24000, subtype="FLOAT"))
    assert clip.source_rate == 24000 and clip.channels == 1
    np.testing.assert_array_equal(clip.wav, audio)


@pytest.mark.parametrize("rate", [16000, 44100, 48000])
def test_other_rates_are_resampled_to_24k_like_the_official_code(rate):
    audio = voiced(2.0, rate=rate, seed=2)
    clip = decode_clip(encode(audio, rate, subtype="FLOAT"))
    assert clip.source_rate == rate
    assert abs(len(clip.wav) - 2.0 * 24000) <= 1
    # librosa.resample's default (soxr_hq) is what the official code applies.
    np.testing.assert_allclose(clip.wav, soxr.resample(audio, rate, 24000, quality="HQ"),
                               atol=1e-6)


def test_stereo_flac_is_mixed_down():
    left, right = voiced(1.5, seed=3), voiced(1.5, seed=4)
    clip = decode_clip(encode(np.stack([left, right], axis=1), 24000, fmt="FLAC"))
    assert clip.channels == 2
    np.testing.assert_allclose(clip.wav, (left + right) / 2, atol=2e-4)  # 16-bit FLAC


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (lambda: b"", "empty"),
        (lambda: b"this is not audio at all" * 10, "not an audio file"),
        (lambda: b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "not an audio file"),
        (lambda: encode(voiced(0.5), 24000), "at least 1 s"),
        (lambda: encode(voiced(31.0, rate=8000), 8000), "at most 30 s"),
        (lambda: encode(np.zeros(48000, np.float32), 24000), "silent"),
        (lambda: encode(1e-4 * voiced(2.0), 24000, subtype="FLOAT"), "silent"),
        (lambda: encode(np.clip(4 * voiced(2.0), -1, 1), 24000), "clipped"),
        (lambda: encode(voiced(2.0, rate=4000), 4000), "sample rate 4000"),
        (lambda: bytes(MAX_CLIP_BYTES + 1), "larger than"),
    ],
    ids=["empty", "text", "truncated-wav", "short", "long", "zeros", "quiet", "clipped",
         "low-rate", "huge"],
)
def test_bad_clips_are_refused_with_the_reason(data, message):
    with pytest.raises(ClipError, match=message):
        decode_clip(data())
