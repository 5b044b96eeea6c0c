"""PCM16 and WAV encoding, and the trimmer that drops the silent bootstrap frame.

Real Qwen3-TTS checkpoints start every utterance with one near-silent frame (the codec's
bootstrap): decoding it is needed for the codec's state, sending it only delays audible audio by
80 ms. Stand-ins are random weights with no such frame, and their length rule already gives
realistic durations, so they keep everything.
"""

from __future__ import annotations

import struct

import numpy as np

from ttsbuild.serve.config import FRAME_SAMPLES, SAMPLE_RATE

WAV_HEADER_BYTES = 44
_UNKNOWN = 0xFFFFFFFF


def pcm16(pcm: np.ndarray) -> bytes:
    """float32 [-1, 1] -> little-endian int16 bytes."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(data_bytes: int | None = None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte PCM16 mono header; data_bytes None writes 0xFFFFFFFF sizes (length unknown,
    the convention for streamed WAV that players and the bench harness accept)."""
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN if data_bytes is None else data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", data)
    )  # fmt: skip


class SilenceTrimmer:
    """Drops the first `skip_samples`, then (when onset_dbfs is set) everything before the first
    10 ms window whose RMS reaches onset_dbfs and stays there for the next window too. Gives up
    trimming after max_trim_s of audio, so a quiet utterance is never swallowed whole."""

    WINDOW = SAMPLE_RATE // 100

    def __init__(
        self, skip_samples: int = FRAME_SAMPLES, onset_dbfs: float | None = None,
        max_trim_s: float = 1.0,
    ):  # fmt: skip
        self.skip = skip_samples
        self.threshold = None if onset_dbfs is None else 10 ** (onset_dbfs / 20)
        self.budget = int(max_trim_s * SAMPLE_RATE)
        self.onset_found = onset_dbfs is None

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        if self.skip:
            n = min(self.skip, len(pcm))
            pcm, self.skip = pcm[n:], self.skip - n
        if self.onset_found or not len(pcm):
            return pcm
        start = self._onset(pcm)
        if start is None:
            if len(pcm) > self.budget:  # trimmed enough: this is a quiet utterance, keep it
                self.onset_found = True
                return pcm
            self.budget -= len(pcm)
            return pcm[:0]
        self.onset_found = True
        return pcm[start:]

    def _onset(self, pcm: np.ndarray) -> int | None:
        w = self.WINDOW
        n = len(pcm) // w
        if n == 0:
            return None
        rms = np.sqrt(np.mean(pcm[: n * w].reshape(n, w).astype(np.float64) ** 2, axis=1))
        loud = rms >= self.threshold
        sustained = loud & np.append(loud[1:], True)  # the last window cannot look ahead
        hits = np.flatnonzero(sustained)
        return None if not hits.size else int(hits[0]) * w
