"""Response audio off the server: every format decodes with a real decoder (PyAV/FFmpeg) to the
right duration and content; resampling and time-scaling carry state across chunks."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soxr

from ttsbuild.serve.config import SAMPLE_RATE
from ttsbuild.serve.formats import FORMATS, PCM_RATES, AudioPipeline
from ttsbuild.serve.tsm import TimeStretch


def speechlike(rng: np.random.Generator, seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A voiced-speech stand-in: harmonics of a random pitch under a syllable-rate envelope."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(100, 220)
    x = sum(rng.uniform(0.2, 1) / k * np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 6))
            for k in range(1, 6))  # fmt: skip
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 5) * t)
    return (0.3 * x * envelope / np.abs(x).max()).astype(np.float32)


def random_chunks(rng, x: np.ndarray, most: int = 4000):
    i = 0
    while i < len(x):
        n = int(rng.integers(1, most))
        yield x[i : i + n]
        i += n


def run_pipeline(pipeline: AudioPipeline, chunks) -> tuple[bytes, list[bytes]]:
    parts = [pipeline.push(c) for c in chunks] + [pipeline.finish()]
    return b"".join(parts), parts


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Decode with FFmpeg (PyAV): G.711 and raw PCM through FFmpeg's raw demuxers."""
    raw = {"pcm": "s16le", "mulaw": "mulaw", "alaw": "alaw"}
    rate = {"pcm": SAMPLE_RATE}.get(fmt, 8000)
    opts = {"sample_rate": str(rate), "ch_layout": "mono"} if fmt in raw else {}
    with av.open(io.BytesIO(data), format=raw.get(fmt), options=opts) as c:
        stream = c.streams.audio[0]
        frames = [f.to_ndarray().astype(np.float32).reshape(-1) for f in c.decode(stream)]
        return np.concatenate(frames), stream.codec_context.sample_rate


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_streams_and_decodes_to_the_input(name):
    rng = np.random.default_rng()
    x = speechlike(rng, 1.5)
    fmt = FORMATS[name]
    data, parts = run_pipeline(AudioPipeline(fmt), random_chunks(rng, x))
    assert sum(map(len, parts[:-1])) > len(data) / 2  # most bytes leave with their chunk
    if name == "wav":
        assert data[:4] == b"RIFF"
    y, rate = decode(data, name)
    if y.dtype != np.float32 or np.abs(y).max() > 1.5:
        y = y / 32768.0
    seconds = len(y) / rate
    assert seconds == pytest.approx(1.5, abs=0.1)  # codecs pad to whole frames
    ref = soxr.resample(x, SAMPLE_RATE, rate) if rate != SAMPLE_RATE else x
    # Codecs delay the signal: align by cross-correlation, then compare spectra.
    n = min(len(ref), len(y))
    head, probe = y[: n // 2 + 4000].astype(np.float64), ref[: n // 2]
    sums = np.concatenate([[0.0], np.cumsum(head**2)])
    energy = sums[len(probe) :] - sums[: -len(probe)]  # for a normalized correlation
    size = len(head) + len(probe)
    corr = np.fft.irfft(np.fft.rfft(head, size) * np.conj(np.fft.rfft(probe, size)), size)
    corr = corr[: len(energy)]
    lag = int(np.argmax(corr / np.sqrt(energy + 1e-12)))
    aligned = y[lag : lag + len(ref)]
    m = min(len(aligned), len(ref))
    err = np.linalg.norm(aligned[:m] - ref[:m]) / np.linalg.norm(ref[:m])
    assert err < {"mp3": 0.35, "opus": 0.6, "aac": 0.35, "mulaw": 0.1, "alaw": 0.1}.get(
        name, 1e-3
    ), err


@pytest.mark.parametrize("rate", PCM_RATES)
def test_chunked_resampling_equals_one_shot_without_clicks(rate):
    rng = np.random.default_rng()
    x = speechlike(rng, 1.0)
    chunked, _ = run_pipeline(AudioPipeline(FORMATS["pcm"], rate), random_chunks(rng, x, 2000))
    whole, _ = run_pipeline(AudioPipeline(FORMATS["pcm"], rate), [x])
    a = np.frombuffer(chunked, "<i2").astype(np.float64)
    b = np.frombuffer(whole, "<i2").astype(np.float64)
    assert len(a) == len(b) == pytest.approx(rate, abs=2)
    assert np.abs(a - b).max() <= 1  # the same samples, to the rounding of s16
    ref = soxr.resample(x.astype(np.float64), SAMPLE_RATE, rate) * 32767
    assert np.linalg.norm(a - ref) / np.linalg.norm(ref) < 1e-3


def test_wav_at_a_chosen_rate_says_so_in_its_header():
    x = speechlike(np.random.default_rng(), 0.5)
    data, _ = run_pipeline(AudioPipeline(FORMATS["wav"], 16000), [x[:5000], x[5000:]])
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.audio[0].codec_context.sample_rate == 16000


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_time_stretch_keeps_pitch_scales_duration_and_ignores_chunking(speed):
    rng = np.random.default_rng()
    f0 = rng.uniform(150, 400)
    t = np.arange(int(1.2 * SAMPLE_RATE)) / SAMPLE_RATE
    x = (0.5 * np.sin(2 * np.pi * f0 * t)).astype(np.float32)
    x[-240:] *= np.linspace(1, 0, 240, dtype=np.float32)  # the input itself ends smoothly
    one = TimeStretch(speed, SAMPLE_RATE)
    whole = np.concatenate([one.push(x), one.flush()])
    stretch = TimeStretch(speed, SAMPLE_RATE)
    chunked = np.concatenate([*(stretch.push(c) for c in random_chunks(rng, x)), stretch.flush()])
    assert len(whole) == len(chunked) == round(len(x) / speed)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)  # chunk boundaries change nothing
    spectrum = np.abs(np.fft.rfft(whole * np.hanning(len(whole))))
    peak = np.fft.rfftfreq(len(whole), 1 / SAMPLE_RATE)[np.argmax(spectrum)]
    assert peak == pytest.approx(f0, rel=0.02)  # pitch kept
    # Continuity: no step larger than the sine's own steepest slope (a click would be).
    body = whole[SAMPLE_RATE // 50 : -SAMPLE_RATE // 50]
    assert np.abs(np.diff(body)).max() <= 1.1 * 0.5 * 2 * np.pi * f0 / SAMPLE_RATE


def test_time_stretch_of_speech_keeps_its_energy():
    rng = np.random.default_rng()
    x = speechlike(rng, 1.0)
    stretch = TimeStretch(1.5, SAMPLE_RATE)
    y = np.concatenate([*(stretch.push(c) for c in random_chunks(rng, x)), stretch.flush()])
    rms = lambda v: float(np.sqrt(np.mean(v.astype(np.float64) ** 2)))  # noqa: E731
    assert rms(y) == pytest.approx(rms(x), rel=0.15)
