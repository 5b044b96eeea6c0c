"""PCM conversion and WAV files (24 kHz mono PCM16)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> little-endian PCM16 bytes (clipped, rounded)."""
    clipped = np.clip(samples, -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2").tobytes()


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int = 24000) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(to_pcm16(samples))
