"""Host time of the engine core's frame step bookkeeping, without a device (CPU only).

`EngineCore.frames(slots)` = `launch_frames` (per-row checks, the backend's launch) +
`collect` (the backend's read, then per row: stale-ticket check, StopCode, frame limit,
the row's FrameOutput). Here the backend is a stub whose launch and read cost nothing, so
what is timed is the core's own Python per step: on the GPU host it is part of "frames()
wall" minus the frame's GPU time in the engine microbenchmark (0.65 ms at 64 rows and 3.6 ms
at 256 on the H200, 2026-12-02). Run it against two trees for a before/after in one run:

    python benchmarks/runtime/host_step.py [--batches 1,64,128,256] [--reps 400]
    PYTHONPATH=/path/to/other/tree python benchmarks/runtime/host_step.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ttsbuild
from ttsbuild.runtime.core import EngineCore, SlotPlan
from ttsbuild.runtime.plan import EnginePlan

GROUPS = 16  # 12 Hz CustomVoice: 16 codebooks per frame


class StubBackend:
    """A backend whose steps are free: launch returns the step's rows, read returns them."""

    num_code_groups = GROUPS
    eos_id = 2150

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def admit(self, slot, plan) -> None:
        pass

    def release(self, slot) -> None:
        pass

    def launch_frames(self, slots):
        b = len(slots)
        if b not in self.rows:
            rows = torch.randint(0, 2048, (b, GROUPS + 1))
            rows[:, -1] = 0  # StopCode.CONTINUE: every request goes on
            self.rows[b] = rows
        return self.rows[b]

    def read_frames(self, handle):
        return handle.clone()  # as the graph backend hands over a fresh tensor

    def ready(self, handle) -> bool:
        return True


def time_step(batch: int, reps: int) -> float:
    plan = EnginePlan.default(num_slots=max(256, batch), max_len=4096)
    engine = EngineCore(StubBackend(), plan)
    slot_plan = SlotPlan(prompt=None, params=None, frame_limit=10**9, by_length_rule=True,
                         seed=0)  # fmt: skip
    slots = [engine.admit_plan(slot_plan) for _ in range(batch)]
    times = []
    for i in range(reps + 50):
        t0 = time.perf_counter()
        outs = engine.frames(slots)
        dt = time.perf_counter() - t0
        assert len(outs) == batch
        for s in slots:  # keep the ring check quiet: the codec took every frame
            engine.table[s].decoded = engine.table[s].launched
        if i >= 50:
            times.append(dt)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,128,256")
    p.add_argument("--reps", type=int, default=400)
    args = p.parse_args()
    print(f"tree {ttsbuild.__file__}; torch {torch.__version__}")
    for b in (int(x) for x in args.batches.split(",")):
        print(f"batch {b:4d}: frames() host bookkeeping {time_step(b, args.reps):.3f} ms")


if __name__ == "__main__":
    main()
