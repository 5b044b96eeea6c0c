"""Host time of the scheduler's `plan()` per call, on the real scheduler driven by
pacing_sim.py's fake engine (CPU only), by how many streams hold a slot.

On the H200 host `plan()` took 0.27 / 0.50 / 0.69 / 0.89 ms per call at 40 / 60 / 70 / 80
req/s on 128 slots (`tts_engine_host_seconds{part="plan"}`,
benchmarks/serve/2026-12-03-h200-sweep-128-host-cut): the largest engine-thread host part
at 80 req/s, growing with the streams in flight. This replays voice-agent arrivals at the
given rates and times every `plan()` call (perf_counter around it), so two trees can be
compared side by side on one machine:

    python benchmarks/serve/plan_cost.py --rates 40,80 [--tree /path/to/other/checkout]

`--tree` imports the scheduler (and pacing_sim.py, the fakes) from another checkout, e.g. a
`git worktree` of an older commit.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", default="40,80")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=1, help="runs per rate (the best is kept)")
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]))
    a = p.parse_args()
    tree = Path(a.tree).resolve()
    sys.path.insert(0, str(tree))
    path = tree / "benchmarks/serve/pacing_sim.py"
    spec = importlib.util.spec_from_file_location("pacing_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    scheduler_mod = sys.modules["ttsbuild.serve.scheduler"]
    if not scheduler_mod.__file__.startswith(str(tree)):
        raise SystemExit(f"imported the scheduler from {scheduler_mod.__file__}, not {tree}")
    original = scheduler_mod.Scheduler.plan
    calls: list[tuple[int, float]] = []

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        calls.append((len(self.by_slot), time.perf_counter() - t0))
        return out

    scheduler_mod.Scheduler.plan = timed
    costs = argparse.Namespace(slots=a.slots, duration=a.duration, frame_ms=3.2,
                               frame_row_ms=0.043, codec_ms=1.0, codec_row_ms=0.6,
                               prefill_ms=2.0)  # fmt: skip
    print(f"tree {tree}, {a.slots} slots, {a.duration:g} s of arrivals per rate")
    print("req/s | plan() calls | streams in slots (mean) | us per call: mean / p50 / p90 | "
          "us per stream in slots")
    for rate in (float(r) for r in a.rates.split(",")):
        best = None
        for _ in range(a.repeats):
            calls.clear()
            sim.simulate(rate, 0.0, costs)
            mean = statistics.mean(t for _, t in calls)
            if best is None or mean < best[0]:
                us = sorted(t * 1e6 for _, t in calls)
                streams = statistics.mean(n for n, _ in calls)
                best = (mean, len(calls), streams, us)
        mean, n, streams, us = best
        print(f"{rate:5g} | {n} | {streams:.1f} | {mean * 1e6:.1f} / {us[len(us) // 2]:.1f} / "
              f"{us[int(0.9 * (len(us) - 1))]:.1f} | {mean * 1e6 / max(streams, 1):.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
