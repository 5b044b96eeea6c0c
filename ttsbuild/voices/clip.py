"""Decode and check a reference clip: every reason to refuse one, in one place.

A clip is decoded by libsndfile (WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF, ...), mixed down to
mono, resampled to 24 kHz by libsoxr at its high-quality setting (the resampler the official
code uses, through librosa) and refused, with a message safe to show the client, when it
cannot clone well: too short or too long, silent, clipped, not audio, or too large.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24000
MAX_CLIP_BYTES = 16 * 1024 * 1024  # a 30 s 48 kHz stereo 32-bit float WAV is 11.5 MB
MIN_SECONDS = 1.0  # the speaker encoder needs some phonetic variety
MAX_SECONDS = 30.0  # reference codes go into every prompt: keep them short
MIN_SOURCE_RATE, MAX_SOURCE_RATE = 8000, 192000
SILENCE_DBFS = -50.0  # RMS below this: nothing to clone
CLIP_LEVEL = 0.999  # |x| at or above this counts as a clipped sample
MAX_CLIPPED_FRACTION = 0.001  # more clipped samples than this: distorted


class ClipError(ValueError):
    """A reference clip we refuse; the message says why and what to send instead."""


@dataclass(frozen=True)
class Clip:
    wav: np.ndarray  # [N] float32 mono at 24 kHz
    source_rate: int  # the file's own sample rate
    channels: int

    @property
    def seconds(self) -> float:
        return len(self.wav) / SAMPLE_RATE


def decode_clip(data: bytes) -> Clip:
    """Decode and check an uploaded clip. Raises ClipError."""
    import soundfile as sf

    if len(data) > MAX_CLIP_BYTES:
        raise ClipError(f"the clip is larger than {MAX_CLIP_BYTES // (1024 * 1024)} MiB")
    if not data:
        raise ClipError("the clip is empty")
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        raise ClipError(
            "the clip is not an audio file we can read (send WAV, FLAC, OGG or MP3)"
        ) from None
    return check_clip(audio, int(rate))


def check_clip(audio: np.ndarray, rate: int) -> Clip:
    """audio [N, channels] (or [N]) float at `rate` -> a checked 24 kHz mono Clip."""
    import soxr

    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim == 1:
        audio = audio[:, None]
    if not MIN_SOURCE_RATE <= rate <= MAX_SOURCE_RATE:
        raise ClipError(f"sample rate {rate} Hz is not supported "
                        f"({MIN_SOURCE_RATE}..{MAX_SOURCE_RATE} Hz)")
    seconds = audio.shape[0] / rate
    if seconds < MIN_SECONDS:
        raise ClipError(f"the clip is {seconds:.2f} s long; send at least {MIN_SECONDS:g} s of "
                        "speech (3-10 s works best)")
    if seconds > MAX_SECONDS:
        raise ClipError(f"the clip is {seconds:.1f} s long; send at most {MAX_SECONDS:g} s "
                        "(3-10 s works best)")
    if not np.isfinite(audio).all():
        raise ClipError("the clip contains NaN or infinite samples")
    mono = audio.mean(axis=1)
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
    if rms <= 10 ** (SILENCE_DBFS / 20):
        raise ClipError(f"the clip is silent (RMS below {SILENCE_DBFS:g} dBFS)")
    clipped = float(np.mean(np.abs(audio) >= CLIP_LEVEL))
    if clipped > MAX_CLIPPED_FRACTION:
        raise ClipError(f"the clip is clipped ({100 * clipped:.2f}% of samples at full scale); "
                        "record it at a lower level")
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return Clip(np.ascontiguousarray(mono, dtype=np.float32), rate, audio.shape[1])
