"""Paced frame steps (SchedulerConfig.pace_slack_s) against back-to-back ones, on the real
scheduler driving a fake serial engine with the H200's measured step costs (CPU only).

A frame step costs about the same for 1 row as for 64 (3.2 ms + 0.043 ms per row, FP8 1.7B
stand-in, engine microbenchmark), so a step's fixed cost spread over more rows is the
throughput lever. Back-to-back steps run every stream at ~10x real time: each finishes fast,
few generate at once, steps are small and many. Paced, a stream gets frames only as its
deadlines need them (about the ramp's 2x real time), more streams generate at once, and each
step carries more of them. This prints, per rate and pacing, frame steps and engine work per
second of arrivals (all requests run to the end), rows per step, time to first audio and
late chunks.

    python benchmarks/serve/pacing_sim.py [--rates 20,40,80] [--paces 0,0.3,1.0] [--slots 256]

Costs (`--frame-ms 3.2 --frame-row-ms 0.043 --codec-ms 1.0 --codec-row-ms 0.6
--prefill-ms 2.0`): the codec's per-row cost stands for a chunk of ~8-12 frames. The engine
is serial (one lane): the GPU overlaps codec and frame steps, so absolute figures are not the
server's; compare pacing on and off.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.serve.fakes

from tests.serve.fakes import FakeClock, FakeEngine, FakeRequest, FakeRequestError  # noqa: E402
from ttsbuild.bench.schedule import load_prompts  # noqa: E402
from ttsbuild.serve.config import SchedulerConfig  # noqa: E402
from ttsbuild.serve.loop import Runner  # noqa: E402
from ttsbuild.serve.scheduler import Chunk, NullObserver, Rejected, Scheduler  # noqa: E402

CHARS_PER_S = 14.0  # English speaking rate used by the stand-ins' length rule (~168 wpm)
FRAMES_PER_S = 12.5


class Counts(NullObserver):
    def __init__(self):
        self.late = 0
        self.chunks = 0

    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None:
        self.chunks += 1
        self.late += lateness_s > 0


def simulate(rate: float, pace: float, a, seed: int = 0) -> str:
    rnd = random.Random(seed)
    prompts = load_prompts("voice-agent")
    t, arrivals = 0.0, []
    while t < a.duration:
        t += rnd.expovariate(rate)
        frames = max(4, round(len(rnd.choice(prompts)) / CHARS_PER_S * FRAMES_PER_S))
        arrivals.append((t, frames))
    clock = FakeClock()
    engine = FakeEngine(
        clock, num_slots=a.slots, instant=False,
        cost_s={"prefill": a.prefill_ms / 1e3, "frames": a.frame_ms / 1e3,
                "audio": a.codec_ms / 1e3},
        per_row_s={"frames": a.frame_row_ms / 1e3, "audio": a.codec_row_ms / 1e3},
    )  # fmt: skip
    counts = Counts()
    config = SchedulerConfig(num_slots=a.slots, max_batch=a.slots, admit_by_capacity=False,
                             max_queue=10_000, pace_slack_s=pace)  # fmt: skip
    sched = Scheduler(config, clock, counts, initial_cost_s=0.005)
    runner = Runner(engine, FakeRequestError)
    streams, refused, i = [], 0, 0
    while clock.t < a.duration + 20 and (i < len(arrivals) or sched.by_slot or sched.queue):
        while i < len(arrivals) and arrivals[i][0] <= clock.t:
            holder: list = []

            def sink(event, holder=holder):  # the client takes every chunk at once
                if isinstance(event, Chunk):
                    sched.ack(holder[0].id, len(event.pcm))

            try:
                holder.append(sched.submit(FakeRequest(arrivals[i][1]), sink, None))
                streams.append(holder[0])
            except Rejected:
                refused += 1
            i += 1
        plan = sched.plan()
        if plan.is_empty:
            waits = [arrivals[i][0] - clock.t if i < len(arrivals) else math.inf,
                     plan.frames_due_in if plan.frames_due_in is not None else math.inf]
            clock.advance(max(min(waits), 1e-4) if min(waits) < math.inf else 0.005)
            continue
        result = runner.execute(plan, clock=clock)
        for sink, event in sched.commit(plan, result):
            sink(event)
    frames = [c for c in engine.calls if c[0] == "frames"]
    audio = [c for c in engine.calls if c[0] == "audio"]
    prefills = [c for c in engine.calls if c[0] == "prefill"]
    busy = (len(frames) * a.frame_ms + sum(len(c[1]) for c in frames) * a.frame_row_ms
            + len(audio) * a.codec_ms + sum(len(c[1]) for c in audio) * a.codec_row_ms
            + len(prefills) * a.prefill_ms) / 1e3  # fmt: skip
    span = clock.t
    ttfa = sorted((s.first_audio_at - s.arrived_at) * 1e3 for s in streams
                  if s.first_audio_at is not None)  # fmt: skip
    rows = statistics.mean(len(c[1]) for c in frames) if frames else 0.0
    p95 = ttfa[int(0.95 * (len(ttfa) - 1))] if ttfa else float("nan")
    # per second of arrivals (a paced run drains later: its span is longer for the same work)
    return (f"{rate:5g} req/s pace {pace:4.2f} s: {len(frames) / a.duration:6.1f} frame steps "
            f"per s of arrivals, {rows:5.1f} rows each, engine work {busy / a.duration:5.2f} s "
            f"per s (drained {span - a.duration:4.1f} s after), TTFA p50 "
            f"{ttfa[len(ttfa) // 2]:6.1f} p95 {p95:6.1f} ms, late chunks {counts.late} of "
            f"{counts.chunks}, refused {refused}, peak streams "
            f"{max(len(c[1]) for c in frames) if frames else 0}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", default="20,40,80")
    p.add_argument("--paces", default="0,0.3,1.0")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--frame-ms", type=float, default=3.2)
    p.add_argument("--frame-row-ms", type=float, default=0.043)
    p.add_argument("--codec-ms", type=float, default=1.0)
    p.add_argument("--codec-row-ms", type=float, default=0.6)
    p.add_argument("--prefill-ms", type=float, default=2.0)
    a = p.parse_args()
    for rate in (float(r) for r in a.rates.split(",")):
        for pace in (float(x) for x in a.paces.split(",")):
            print(simulate(rate, pace, a), flush=True)


if __name__ == "__main__":
    main()
