"""The talker's decode step at batch 1: the one-kernel step (runtime/talker_megastep.py,
csrc/talker_step.cu) against its float32 reference and against the served step
(PackedStack.decode, the FP8 weight-only kernels), then both timed as CUDA graphs.

    PYTHONPATH=. python3 benchmarks/kernels/megatalker/bench_talker_step.py \
        [--dists 0,1,2,3] [--positions 100,600,1000] [--replays 200]

GPU only (Hopper: sm_90a). 1.7B CustomVoice talker shapes (28 layers, hidden 2048, 16/8
heads x 128, intermediate 6144), random FP8 weights (bench_talker.random_talker), a bf16
cache of 1024 positions filled with N(0, 1) values, slot 1 of 2. Prints one line per
check (PASS/FAIL with the relative error) and a table: ms per step (median of graph
replays) for each prefetch distance and the served step, the weight-read floor at 4.8 TB/s.
Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_talker

PEAK_BW = 4.8e12
TOL_REF = 2e-3  # kernel vs the fp32 reference: summation order only (28 layers)
TOL_SERVED = 0.1  # the served step rounds every activation to bf16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dists", default="0,1,2,3")
    ap.add_argument("--positions", default="100,600,1000")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--cache", type=int, default=1024)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench_talker import random_talker

    from ttsbuild.bench.engine_bench import _time_graph
    from ttsbuild.runtime import talker_megastep as tm
    from ttsbuild.runtime.fast_model import PackedStack
    from ttsbuild.runtime.graph_engine import _capture

    dev = "cuda"
    cfg, module = random_talker("1.7b-customvoice", dev)
    stack = PackedStack.from_module(module.bfloat16(), True)
    del module
    torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, args.cache, cfg.head_dim)
    k0 = torch.randn(shape, device=dev, generator=g).bfloat16()
    v0 = torch.randn(shape, device=dev, generator=g).bfloat16()
    slot = torch.tensor([1], device=dev)
    dists = [int(d) for d in args.dists.split(",")]
    steps = {d: tm.TalkerStep(stack, args.cache, dev, dist=d) for d in dists}
    ok = True
    positions = [int(p) for p in args.positions.split(",")]
    for pos in positions:
        x = torch.randn(1, cfg.hidden_size, device=dev, generator=g).bfloat16()
        kr, vr = k0.clone(), v0.clone()
        ref = tm.reference(stack, x[0], kr, vr, 1, pos)
        ks, vs = k0.clone(), v0.clone()
        served = stack.decode(x, ks, vs, slot, torch.tensor([pos], device=dev))[0]
        e = rel(served, ref)
        line = f"pos {pos:5d}: served vs ref {e:.2e}"
        ok &= e < TOL_SERVED
        for d, step in steps.items():
            kk, vv = k0.clone(), v0.clone()
            for _ in range(2):  # twice: the barrier's count is reset for the next launch
                out = step(x, kk, vv, slot, torch.tensor([pos], device=dev))[0].clone()
            torch.cuda.synchronize()
            e = rel(out, ref)
            ek = rel(kk[:, 1, :, pos], kr[:, 1, :, pos])
            ev = rel(vv[:, 1, :, pos], vr[:, 1, :, pos])
            kk[:, 1, :, pos] = kr[:, 1, :, pos]
            vv[:, 1, :, pos] = vr[:, 1, :, pos]
            same_rest = torch.equal(kk, kr) and torch.equal(vv, vr)
            good = e < TOL_REF and ek < 1e-2 and ev < 1e-2 and same_rest
            ok &= good
            line += (f" | dist {d}: {'PASS' if good else 'FAIL'} out {e:.2e} k {ek:.1e} "
                     f"v {ev:.1e}{'' if same_rest else ' OTHER CACHE ROWS CHANGED'}")  # fmt: skip
        print(line, flush=True)
    # timing: one graph per path, the position mid-cache
    x = torch.randn(1, cfg.hidden_size, device=dev, generator=g).bfloat16()
    kk, vv = k0.clone(), v0.clone()
    print(f"{'pos':>5s} " + " ".join(f"{'dist ' + str(d):>9s}" for d in dists)
          + f" {'served':>9s} {'floor':>7s}  (ms per step)")  # fmt: skip
    floor = stack.read_bytes() / PEAK_BW * 1e3
    for pos in positions:
        p = torch.tensor([pos], device=dev)
        ms = []
        for d in dists:
            graph = _capture(lambda d=d, p=p: steps[d](x, kk, vv, slot, p), None)
            ms.append(_time_graph(graph, args.replays))
        graph = _capture(lambda p=p: stack.decode(x, kk, vv, slot, p), None)
        served = _time_graph(graph, args.replays)
        print(f"{pos:5d} " + " ".join(f"{m:9.4f}" for m in ms) + f" {served:9.4f} {floor:7.4f}",
              flush=True)  # fmt: skip
    print("ALL PASS" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
