"""Cost of turning one engine chunk into each response format (speed, resampling, encoding),
per chunk size of the low-latency schedule. CPU only: the encoders never touch the GPU, but run
this on the serving host (its CPU is what serving shares with the engine thread).

    python benchmarks/serve/encoder_cost.py [--seconds 10]

Prints, per format and chunk size (frames of 80 ms), the median and p95 milliseconds per chunk
and the real-time factor (seconds of encoding per second of audio).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ttsbuild.serve.config import FRAME_SAMPLES, SAMPLE_RATE
from ttsbuild.serve.formats import FORMATS, AudioPipeline

CASES = [(name, None, 1.0) for name in FORMATS] + [
    ("pcm", 8000, 1.0), ("pcm", 48000, 1.0), ("pcm", None, 1.5),
]  # fmt: skip


def measure(name: str, rate: int | None, speed: float, frames: int, seconds: float):
    rng = np.random.default_rng(0)
    n = frames * FRAME_SAMPLES
    chunks = int(seconds * SAMPLE_RATE / n) + 1
    audio = (0.3 * rng.standard_normal(chunks * n)).astype(np.float32)
    pipeline = AudioPipeline(FORMATS[name], rate, speed)
    times = []
    for i in range(chunks):
        start = time.perf_counter()
        pipeline.push(audio[i * n : (i + 1) * n])
        times.append(time.perf_counter() - start)
    pipeline.finish()
    ms = 1000 * np.array(times[1:])  # the first chunk opens the muxer
    return np.median(ms), np.percentile(ms, 95), ms.sum() / 1000 / ((chunks - 1) * n / SAMPLE_RATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per case")
    args = parser.parse_args()
    print(f"{'format':<16}{'frames/chunk':>13}{'median ms':>11}{'p95 ms':>9}{'RTF':>9}")
    for name, rate, speed in CASES:
        label = name + (f"@{rate}" if rate else "") + (f" x{speed}" if speed != 1 else "")
        for frames in (1, 4, 12):
            median, p95, rtf = measure(name, rate, speed, frames, args.seconds)
            print(f"{label:<16}{frames:>13}{median:>11.3f}{p95:>9.3f}{rtf:>9.4f}")


if __name__ == "__main__":
    main()
