"""Response audio: the formats a client may ask for, and the streaming pipeline that turns the
engine's float32 24 kHz chunks into them (time-scale for `speed`, resampling, encoding).

Every stage keeps state across chunks, so a stream encoded chunk by chunk is the same audio as
the whole utterance encoded at once: soxr's ResampleStream carries its filter history, the
time-scaler its overlap, PyAV's encoders their frames and lookahead. Container formats (mp3,
ogg/opus, adts/aac, flac) are muxed by FFmpeg with packets flushed as soon as they are written,
so a chunk's bytes leave with the chunk rather than when an I/O buffer fills.

Encoding runs on the asyncio side (a worker thread for the codecs), never on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import soxr

from ttsbuild.serve.audio import pcm16, wav_header
from ttsbuild.serve.config import SAMPLE_RATE
from ttsbuild.serve.tsm import TimeStretch

if TYPE_CHECKING:
    import av

PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    codec: str  # FFmpeg encoder, or "s16le" for raw PCM written here
    container: str | None  # FFmpeg muxer; None: raw codec output, no container
    rates: tuple[int, ...]  # output sample rates allowed; the first is the default

    @property
    def is_codec(self) -> bool:
        """Worth a worker thread: an FFmpeg encoder, not a numpy cast."""
        return self.codec != "s16le"


FORMATS = {
    f.name: f
    for f in (
        AudioFormat("mp3", "audio/mpeg", "libmp3lame", "mp3", (SAMPLE_RATE,)),
        AudioFormat("opus", "audio/opus", "libopus", "ogg", (SAMPLE_RATE,)),  # Ogg Opus
        AudioFormat("aac", "audio/aac", "aac", "adts", (SAMPLE_RATE,)),
        AudioFormat("flac", "audio/flac", "flac", "flac", (SAMPLE_RATE,)),
        AudioFormat("wav", "audio/wav", "s16le", None, (SAMPLE_RATE, *PCM_RATES)),
        AudioFormat("pcm", "audio/pcm", "s16le", None, (SAMPLE_RATE, *PCM_RATES)),
        # G.711 for telephony: 8 kHz, one byte per sample, no header.
        AudioFormat("mulaw", "audio/basic", "pcm_mulaw", None, (8000,)),
        AudioFormat("alaw", "audio/x-alaw-basic", "pcm_alaw", None, (8000,)),
    )
}
# Muxer options: write each packet out at once; Ogg pages of at most 20 ms instead of 1 s.
_MUX_OPTIONS = {"flush_packets": "1"}
_OGG_OPTIONS = {"page_duration": "20000"}


class _Bytes:
    """A write-only, unseekable file for the muxer: what it writes is taken after each chunk."""

    def __init__(self):
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class _FFmpegEncoder:
    """float32 mono chunks -> bytes of an FFmpeg codec, muxed when the format has a container."""

    def __init__(self, fmt: AudioFormat, rate: int):
        import av  # here, not at import: a server streaming PCM alone never loads FFmpeg

        self.av = av
        self.rate = rate
        self.samples = 0
        self.out = _Bytes()
        if fmt.container is not None:
            opts = _MUX_OPTIONS | (_OGG_OPTIONS if fmt.container == "ogg" else {})
            self.mux = av.open(self.out, mode="w", format=fmt.container, options=opts)
            self.codec = self.mux.add_stream(fmt.codec, rate=rate, layout="mono")
        else:
            self.mux = None
            self.codec = av.CodecContext.create(fmt.codec, "w")
            self.codec.rate, self.codec.layout, self.codec.format = rate, "mono", "s16"

    def push(self, pcm: np.ndarray) -> bytes:
        if not len(pcm):
            return b""
        frame = self.av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate, frame.pts = self.rate, self.samples
        frame.time_base = Fraction(1, self.rate)
        self.samples += len(pcm)
        return self._write(frame)

    def finish(self) -> bytes:
        tail = self._write(None)
        if self.mux is not None:
            self.mux.close()  # the trailer
        return tail + self.out.take()

    def _write(self, frame: av.AudioFrame | None) -> bytes:
        packets = self.codec.encode(frame)
        if self.mux is None:
            return b"".join(bytes(p) for p in packets)
        self.mux.mux(packets)
        return self.out.take()


class _PcmEncoder:
    """float32 -> s16le, with a streaming WAV header first when `wav_header` is set."""

    def __init__(self, rate: int, header: bool):
        self.header = wav_header(None, rate) if header else b""

    def push(self, pcm: np.ndarray) -> bytes:
        out, self.header = self.header + pcm16(pcm), b""
        return out

    def finish(self) -> bytes:
        out, self.header = self.header, b""
        return out


class AudioPipeline:
    """One stream's audio path: speed (time-scale, pitch kept) -> resample -> encode.

    push() takes float32 samples at the engine's rate and returns the bytes ready to send
    (possibly none: encoders hold a frame's worth); finish() returns the rest. `samples_out`
    counts the samples encoded at the output rate."""

    def __init__(self, fmt: AudioFormat, sample_rate: int | None = None, speed: float = 1.0):
        self.format = fmt
        self.rate = sample_rate or fmt.rates[0]
        self.stretch = TimeStretch(speed, SAMPLE_RATE) if speed != 1.0 else None
        self.resampler = None
        if self.rate != SAMPLE_RATE:
            self.resampler = soxr.ResampleStream(SAMPLE_RATE, self.rate, 1, dtype="float32")
        if fmt.is_codec:
            self.encoder = _FFmpegEncoder(fmt, self.rate)
        else:
            self.encoder = _PcmEncoder(self.rate, header=fmt.name == "wav")
        self.samples_out = 0

    def push(self, pcm: np.ndarray) -> bytes:
        return self._encode(self._shape(np.asarray(pcm, dtype=np.float32), last=False))

    def finish(self) -> bytes:
        tail = self._shape(np.zeros(0, np.float32), last=True)
        return self._encode(tail) + self.encoder.finish()

    def _shape(self, pcm: np.ndarray, last: bool) -> np.ndarray:
        if self.stretch is not None:
            pcm = self.stretch.flush(pcm) if last else self.stretch.push(pcm)
        if self.resampler is not None:
            pcm = self.resampler.resample_chunk(pcm, last=last)
        return pcm

    def _encode(self, pcm: np.ndarray) -> bytes:
        self.samples_out += len(pcm)
        return self.encoder.push(pcm)


def whole_wav(pcm: bytes, rate: int) -> bytes:
    """A complete WAV file (sizes filled in) around s16le bytes."""
    return wav_header(len(pcm), rate) + pcm
