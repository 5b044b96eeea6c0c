"""Where the time of the engine's captured steps goes: kernels, their count and the gaps.

    PYTHONPATH=. python3 benchmarks/kernels/profile_graphs.py [--batches 1,8,64] [--top 12]

GPU only. Random 1.7B CustomVoice weights, FP8, the served plan (`engine_bench.bench_plan`).
For each graph (frame at each batch, prefill of one 32/64-token prompt, one codec frame) it
replays the graph under torch.profiler and prints: replay wall time (CUDA events), kernels
per replay, the sum of their durations, and the kernels by total time. Run it with
TTSBUILD_PDL=0 to read each kernel's own time: with programmatic dependent launch a kernel
becomes resident early and its duration includes its wait for the one before.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch


def profile_graph(graph, replays: int):
    """(kernels per replay, kernel ms per replay, [(name, calls per replay, ms per replay)])."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if name.startswith(("Memcpy", "Memset")) or "cudaGraph" in name:
            key = name.split(" ")[0]
        else:
            key = name[:70]
        totals[key] += ev.device_time / 1e3  # us -> ms
        counts[key] += 1
    rows = sorted(((k, counts[k] / replays, totals[k] / replays) for k in totals),
                  key=lambda r: -r[2])  # fmt: skip
    n = sum(counts.values()) / replays
    return n, sum(totals.values()) / replays, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from ttsbuild.bench.engine_bench import TEXT, _time_graph, bench_plan
    from ttsbuild.runtime.engine import random_models
    from ttsbuild.runtime.graph_engine import GraphEngine
    from ttsbuild.runtime.request import SynthesisRequest

    batches = [int(b) for b in args.batches.split(",")]
    models = random_models("1.7b-customvoice", device="cuda")
    plan = bench_plan("fp8", batches)
    engine = GraphEngine(models, plan)
    be = engine.backend
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"TTSBUILD_PDL={os.environ.get('TTSBUILD_PDL', '(default)')}")  # fmt: skip
    req = SynthesisRequest(text=" ".join([TEXT] * 3), voice="ryan", language="english", seed=1,
                           max_frames=800)  # fmt: skip
    work = [(f"prefill 1x{t}", be.graphs[("prefill", 1, t)], None) for t in (32, 64)]
    for b in batches:
        work.append((f"frame b{b}", be.graphs[("frame", b)], b))
        work.append((f"codec b{b}", be.graphs[("codec", b, 1)], b))
    summary = []
    for name, graph, b in work:
        slots = []
        if b is not None:  # real rows: positions and codes as a running stream's
            slots = [engine.admit(req) for _ in range(b)]
            engine.prefill(slots)
            be.rows_in[:b] = torch.tensor(slots, device=be.device)
            be.codec_rows_in[:b] = be.rows_in[:b]
        wall = _time_graph(graph, 30)
        n, kernel_ms, rows = profile_graph(graph, args.replays)
        summary.append((name, wall, n, kernel_ms))
        print(f"\n## {name}: replay {wall:.3f} ms, {n:.0f} kernels, kernel time {kernel_ms:.3f} ms")
        print(f"{'kernel':70s} {'calls':>6s} {'ms':>8s} {'us/call':>8s}")
        for k, calls, ms in rows[: args.top]:
            print(f"{k:70s} {calls:6.0f} {ms:8.3f} {ms / calls * 1e3:8.1f}")
        for s in slots:
            engine.release(s)
    print("\n| graph | replay ms | kernels | kernel ms | kernel / replay |")
    print("|---|---|---|---|---|")
    for name, wall, n, kernel_ms in summary:
        print(f"| {name} | {wall:.3f} | {n:.0f} | {kernel_ms:.3f} | {kernel_ms / wall:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
