"""Which chunk runs late, on the pipelined loop (serve.loop.EngineLoop, express admission)
driving the GPU-like fake engine of the loop's tests (frame steps on one lane, codec steps on
another, new rows' prefill, first frame and first codec step on an admission lane), with
Poisson arrivals; per chunk schedule and `lane_chunks`, the late chunks (ms late, chunk index).

    python benchmarks/serve/late_chunks_sim.py [--rate 40] [--requests 200] [--audio-mult 1,2]

The fake's steps cost the same whatever their rows and lane (prefill 4 ms, frame 8 ms, codec
4 ms x --audio-mult): its admission lane is far busier than the H200's (a first chunk there is
~5 ms of GPU at one row), so read it for which chunk runs late and how a policy moves that,
not for absolute figures. On the H200 at 40 req/s every underrun was chunk 1, the second
(benchmarks/serve/2026-12-02-h200-ramp-ab); this reproduces that pattern on the CPU.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.serve

from tests.serve.test_pipelined_loop import Harness  # noqa: E402
from ttsbuild.serve.scheduler import NullObserver, Status  # noqa: E402


class Late(NullObserver):
    def __init__(self):
        self.late: list[tuple[float, int]] = []
        self.chunks = 0

    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None:
        self.chunks += 1
        if lateness_s > 0:
            self.late.append((lateness_s * 1e3, chunk))


def simulate(schedule, lane_chunks: int, rate: float, requests: int, audio_mult: float,
             seed: int = 0) -> Late:  # fmt: skip
    rnd = random.Random(seed)
    h = Harness(num_slots=64, express=True, admission_lane=True, lane_chunks=lane_chunks)
    h.engine.lane_codec_steps = lane_chunks
    h.engine.cost_s["audio"] *= audio_mult
    h.sched.observer = late = Late()
    streams, next_at = [], 0.0
    while len(streams) < requests or not all(s.status is Status.FINISHED for s in streams):
        if len(streams) < requests and h.clock.t >= next_at:
            streams.append(h.submit(frames=rnd.randint(20, 100), schedule=schedule))
            next_at += rnd.expovariate(rate)
        if not h.step():
            h.clock.advance(min(0.001, h.loop.idle_s))
    return late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--audio-mult", default="1,2")
    a = p.parse_args()
    for schedule in ((1, 2, 4, 8, 12), (1, 1, 2, 4, 8, 12)):
        for lane_chunks in (1, 2):
            for mult in (float(m) for m in a.audio_mult.split(",")):
                r = simulate(schedule, lane_chunks, a.rate, a.requests, mult)
                by_chunk: dict[int, int] = {}
                for _, c in r.late:
                    by_chunk[c] = by_chunk.get(c, 0) + 1
                worst = max((ms for ms, _ in r.late), default=0.0)
                print(f"schedule {','.join(map(str, schedule)):12s} lane_chunks {lane_chunks} "
                      f"codec x{mult:g}: {len(r.late):4d} late of {r.chunks} chunks, by chunk "
                      f"index {dict(sorted(by_chunk.items()))}, worst {worst:.1f} ms",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
