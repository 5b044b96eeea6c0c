"""Test clips: synthetic voiced audio written in any format soundfile supports."""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf


def voiced(seconds: float, rate: int = 24000, seed: int = 0, level: float = 0.5) -> np.ndarray:
    """A fresh random vowel-like signal: a 100-200 Hz pulse train through two resonances,
    with a syllable-rate envelope (mono float32)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = rng.uniform(100, 200) * (1 + 0.05 * np.sin(2 * math.pi * 0.7 * t))
    phase = 2 * math.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 25))
    for formant in rng.uniform(300, 2500, size=2):
        x = x + 0.5 * np.sin(2 * math.pi * formant * t) * np.sin(phase) ** 2
    x = x * (0.6 + 0.4 * np.sin(2 * math.pi * 4 * t)) + 0.01 * rng.standard_normal(n)
    return (level * x / np.abs(x).max()).astype(np.float32)


def encode(audio: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format=fmt, subtype=subtype)
    return buf.getvalue()
