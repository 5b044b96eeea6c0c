"""Streaming time-scale modification (WSOLA): play speech faster or slower, pitch kept.

WSOLA (waveform-similarity overlap-add, Verhelst & Roelands 1993): output frames of N samples
are Hann-windowed and overlap-added every Hs = N/2 samples (a periodic Hann at 50 % overlap
sums to exactly 1, so no gain ripple). Frame k is read from the input near k * Ha with
Ha = Hs * speed; within +-tolerance it starts where the input best continues the previous
frame (the highest cross-correlation with the samples that followed it), so overlapping
frames are in phase and no click or warble appears where they join.

Streaming: a frame is built only once every input sample it may read has arrived, so the output
does not depend on how the input was cut into chunks; flush() pads the end with silence and
trims the total to round(input samples / speed).
"""

from __future__ import annotations

import numpy as np


class TimeStretch:
    def __init__(
        self, speed: float, sample_rate: int, frame_s: float = 0.04, tolerance_s: float = 0.01
    ):  # fmt: skip
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed {speed} outside 0.25..4.0")
        self.speed = speed
        self.n = 2 * round(frame_s * sample_rate / 2)  # frame length, even
        self.hs = self.n // 2  # synthesis hop
        self.tol = round(tolerance_s * sample_rate)
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.n) / self.n)).astype(
            np.float32
        )
        # The input is read as if it began with hs zeros, so the first frame's fade-in falls
        # on silence; the output's first hs samples (that silence) are skipped.
        self.buf = np.zeros(self.hs, np.float32)  # input from absolute index self.base
        self.base = 0
        self.end = self.hs  # absolute index one past the last input sample (padding included)
        self.k = 0  # next output frame
        self.prev: int | None = None  # where frame k-1 was read
        self.acc = np.zeros(self.n, np.float32)  # overlap-add accumulator at output k * hs
        self.skip = self.hs
        self.n_in = 0
        self.n_out = 0

    def push(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, np.float32)
        self.n_in += len(pcm)
        self._append(pcm)
        return self._run()

    def flush(self, pcm: np.ndarray | None = None) -> np.ndarray:
        """The last input (may be empty) and everything still held; the total output is then
        round(input samples / speed)."""
        head = self.push(pcm) if pcm is not None and len(pcm) else np.zeros(0, np.float32)
        target = round(self.n_in / self.speed)
        out = [head]
        produced = self.n_out
        while produced < target:
            self._append(np.zeros(self.n + 2 * self.tol, np.float32))
            piece = self._run()
            out.append(piece)
            produced += len(piece)
        tail = np.concatenate(out)
        keep = len(tail) - (produced - target)
        self.n_out = target
        return tail[:keep]

    def _append(self, pcm: np.ndarray) -> None:
        self.buf = np.concatenate([self.buf, pcm])
        self.end += len(pcm)

    def _x(self, start: int, length: int) -> np.ndarray:
        i = start - self.base
        return self.buf[i : i + length]

    def _run(self) -> np.ndarray:
        out = []
        n, hs, tol = self.n, self.hs, self.tol
        while True:
            nominal = round(self.k * hs * self.speed)
            if self.prev is None:
                if self.end < n:
                    break
                start = 0
            else:
                lo = max(nominal - tol, self.base)
                hi = nominal + tol  # candidate starts lo..hi
                natural = self.prev + hs  # where the previous frame's continuation starts
                if max(hi, natural) + n > self.end:
                    break
                region = self._x(lo, hi - lo + n)
                template = self._x(natural, n)
                start = lo + int(np.argmax(np.correlate(region, template, "valid")))
            self.acc += self.window * self._x(start, n)
            ready = self.acc[:hs].copy()
            self.acc = np.concatenate([self.acc[hs:], np.zeros(hs, np.float32)])
            self.prev, self.k = start, self.k + 1
            if self.skip:
                drop = min(self.skip, len(ready))
                ready, self.skip = ready[drop:], self.skip - drop
            out.append(ready)
            keep_from = min(self.prev + hs, round(self.k * hs * self.speed) - tol)
            if keep_from > self.base:
                self.buf = self.buf[keep_from - self.base :]
                self.base = keep_from
        pcm = np.concatenate(out) if out else np.zeros(0, np.float32)
        self.n_out += len(pcm)
        return pcm
