"""Audio-side analysis of a streamed response: body format, audible onset, playback stalls.

All functions are pure (no clocks, no I/O) so tests can give exact answers. Times are in
seconds on whatever clock the caller used for chunk arrivals; sample indices count frames
(one frame = one sample per channel).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

PCM16_BYTES = 2
FULL_SCALE = 32768.0  # dBFS reference: RMS of 32768 is 0 dBFS (a full-scale sine is -3 dBFS)
ONSET_WINDOW_S = 0.020
ONSET_THRESHOLD_DBFS = -45.0
ONSET_WINDOWS_NEEDED = 2  # consecutive loud windows; one loud 20 ms click is not speech
# Arrivals within this much of their due time are on time: float noise is not an underrun.
_DUE_TOLERANCE_S = 1e-9


class BodyFormat(StrEnum):
    pcm = "pcm"  # raw little-endian PCM16, no header
    wav = "wav"  # a RIFF/WAVE header (often with a placeholder size when streamed), then PCM16
    auto = "auto"  # WAV if the body starts with b"RIFF", raw PCM otherwise


@dataclass(frozen=True)
class AudioFormat:
    sample_rate: int  # frames per second
    channels: int
    header_bytes: int  # bytes of the body before the first PCM sample

    @property
    def frame_bytes(self) -> int:
        return PCM16_BYTES * self.channels


class IncompleteHeader(ValueError):
    """The body ended (or has not yet arrived) before the WAV header was complete."""


def parse_wav_header(body: bytes) -> AudioFormat:
    """Walk the RIFF chunks up to the start of "data". Only PCM16 is accepted. The declared
    sizes of RIFF and data are ignored: streaming servers write placeholders (0 or 0xFFFFFFFF)
    because they do not know the length in advance."""
    if len(body) < 12:
        raise IncompleteHeader("body shorter than a RIFF header")
    if body[:4] != b"RIFF" or body[8:12] != b"WAVE":
        raise ValueError("body is not a RIFF/WAVE stream")
    offset, fmt = 12, None
    while True:
        if len(body) < offset + 8:
            raise IncompleteHeader("body ended inside the WAV header")
        chunk_id, chunk_size = struct.unpack_from("<4sI", body, offset)
        payload = offset + 8
        if chunk_id == b"data":
            if fmt is None:
                raise ValueError('WAV "data" chunk before "fmt "')
            sample_rate, channels = fmt
            return AudioFormat(sample_rate, channels, header_bytes=payload)
        if chunk_id == b"fmt ":
            if len(body) < payload + 16:
                raise IncompleteHeader('body ended inside the WAV "fmt " chunk')
            tag, channels, sample_rate, _, _, bits = struct.unpack_from("<HHIIHH", body, payload)
            # 0xFFFE is WAVE_FORMAT_EXTENSIBLE; we trust bits-per-sample for it.
            if tag not in (1, 0xFFFE) or bits != 16:
                raise ValueError(f"WAV is not PCM16 (format tag {tag}, {bits} bits)")
            fmt = (sample_rate, channels)
        offset = payload + chunk_size + (chunk_size & 1)  # RIFF chunks are word-aligned


def detect_format(body: bytes, body_format: BodyFormat, sample_rate: int) -> AudioFormat:
    """The layout of a response body. `sample_rate` (from the x-sample-rate header or config)
    applies to raw PCM; a WAV header's own rate wins."""
    is_wav = body_format is BodyFormat.wav or (
        body_format is BodyFormat.auto and body[:4] == b"RIFF"
    )
    if is_wav:
        return parse_wav_header(body)
    return AudioFormat(sample_rate, channels=1, header_bytes=0)


def decode_mono(body: bytes, fmt: AudioFormat) -> np.ndarray:
    """Body -> float64 samples in PCM16 units, shape (frames,); channels are averaged and a
    trailing partial frame is dropped."""
    usable = (len(body) - fmt.header_bytes) // fmt.frame_bytes * fmt.frame_bytes
    pcm = np.frombuffer(body, dtype="<i2", count=usable // PCM16_BYTES, offset=fmt.header_bytes)
    return pcm.reshape(-1, fmt.channels).mean(axis=1, dtype=np.float64)


def chunk_end_frames(chunk_end_bytes: np.ndarray, fmt: AudioFormat) -> np.ndarray:
    """Cumulative body bytes after each chunk, shape (n,) -> complete audio frames available
    after each chunk, shape (n,). A frame split across two chunks counts when its last byte
    arrives."""
    audio_bytes = np.maximum(np.asarray(chunk_end_bytes, dtype=np.int64) - fmt.header_bytes, 0)
    return audio_bytes // fmt.frame_bytes


def frame_arrival_time(frame: int, chunk_times: np.ndarray, end_frames: np.ndarray) -> float:
    """Arrival time of the chunk that completed `frame` (0-based)."""
    chunk = int(np.searchsorted(end_frames, frame, side="right"))
    return float(chunk_times[chunk])


def window_levels_dbfs(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """DC-removed RMS level of consecutive non-overlapping 20 ms windows aligned to sample 0,
    shape (n_windows,), dBFS. A trailing partial window is ignored. Removing each window's mean
    keeps a constant offset (a DC bias, a stuck sample) from passing as sound."""
    window = round(ONSET_WINDOW_S * sample_rate)
    n_windows = len(samples) // window
    frames = np.asarray(samples[: n_windows * window], dtype=np.float64).reshape(n_windows, window)
    frames = frames - frames.mean(axis=1, keepdims=True)
    rms = np.sqrt(np.mean(frames * frames, axis=1))
    with np.errstate(divide="ignore"):
        return 20.0 * np.log10(rms / FULL_SCALE)


def audible_onset(samples: np.ndarray, sample_rate: int) -> int | None:
    """Frame index where the first sustained sound starts: the first of two consecutive 20 ms
    windows both at >= -45 dBFS. None when the audio never gets there. Resolution: 20 ms.

    Levels are computed block by block from the start (blocks of 16 windows, doubling), so
    the usual onset near the start costs a fraction of the whole utterance's levels: the
    load generator runs this on its event loop as each request ends (1.3 ms for 6.5 s of
    audio on every window, during which other streams' chunks would wait for a timestamp)."""
    assert ONSET_WINDOWS_NEEDED == 2  # pairs of windows below
    window = round(ONSET_WINDOW_S * sample_rate)
    n_windows = len(samples) // window
    first, block = 0, 16
    while first < n_windows - 1:
        last = min(n_windows, first + block)
        part = samples[first * window : last * window]
        loud = window_levels_dbfs(part, sample_rate) >= ONSET_THRESHOLD_DBFS
        hits = np.flatnonzero(loud[:-1] & loud[1:])
        if len(hits):
            return (first + int(hits[0])) * window
        first, block = last - 1, block * 2  # the block's last window pairs with the next's first
    return None


@dataclass(frozen=True)
class PlaybackResult:
    start_s: float  # arrival of the first playable frame: playback begins there
    underruns: int  # times the player ran dry after starting
    stall_s: float  # total seconds spent waiting for late audio
    # where in the audio each underrun happened (seconds of audio played before it): which
    # chunk ran late, e.g. the ramp's second one at 0.08 s or a steady-state one later
    underrun_at_s: tuple[float, ...] = ()


def simulate_playback(
    chunk_times: np.ndarray, end_frames: np.ndarray, sample_rate: int
) -> PlaybackResult | None:
    """A zero-buffer player. Playback starts when the first frame arrives; frame i is due at
    start + i/sample_rate + (stall so far). A frame that arrives after it is due is one
    underrun: the player waits for it (adding the wait to the stall) and resumes from there.
    All frames of a chunk arrive together, so only each chunk's first new frame can be late.

    chunk_times: arrival of each chunk, shape (n,), seconds, non-decreasing.
    end_frames: cumulative complete frames after each chunk, shape (n,).
    None if no frame ever arrived.
    """
    start = None
    stall, at = 0.0, []
    frames_before = 0
    for arrived, frames_after in zip(chunk_times, end_frames, strict=True):
        if frames_after <= frames_before:
            continue  # header bytes or a partial frame: nothing new to play
        if start is None:
            start = float(arrived)
        else:
            due = start + frames_before / sample_rate + stall
            if arrived > due + _DUE_TOLERANCE_S:
                at.append(frames_before / sample_rate)
                stall += float(arrived) - due
        frames_before = int(frames_after)
    if start is None:
        return None
    return PlaybackResult(start_s=start, underruns=len(at), stall_s=stall, underrun_at_s=tuple(at))
