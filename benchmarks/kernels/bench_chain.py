"""What one dependent kernel costs in a captured chain: the floor under the code predictor's
~420 launches per frame.

    PYTHONPATH=. python3 benchmarks/kernels/bench_chain.py [--launches 420] [--out chain.json]

GPU only (`--check`: the chains once each on the CPU under TRITON_INTERPRET=1, nothing timed).
Each row is one CUDA graph of `--launches` kernels, each reading what the one before wrote,
replayed; us per launch = replay time / launches, with programmatic dependent launch (PDL,
as served) and without:
- `empty`: a kernel that only waits for the one before (PDL) and returns: the launch floor;
- `hop P`: P programs, each reads the previous kernel's whole 1024-element bf16 vector, sums
  it (a cross-warp reduction, as a GEMV's dot) and writes its 1024 / P elements: the floor of
  a dependent stage that hands a small activation on through memory;
- `cp.<linear>`: the code predictor's own linears at one row (bf16 weights as served,
  `plugins.fused_linear` with its served tiles, PDL early weight loads included), in pairs
  that chain (down-like then up-like, so each reads the other's output).
The served frame at batch 1 runs ~420 launches in 2.04 ms (4.9 us each, 2026-12-04): if
`hop` is near that, a frame of this structure cannot get much faster and only fewer
dependent stages can; if it is far below, the linears' own latency is what to cut.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args
from ttsbuild.plugins._tl._math import pdl_prologue

N = 1024  # the code predictor's hidden size


@triton.jit
def _empty_kernel(PDL: tl.constexpr):
    pdl_prologue(PDL)


@triton.jit
def _hop_kernel(x_ptr, y_ptr, N: tl.constexpr, PER: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    total = tl.sum(x * x, axis=0)  # a dot over the whole input, as a GEMV's
    mine = pid * PER + tl.arange(0, PER)
    xm = tl.load(x_ptr + mine).to(tl.float32)
    # the same values come back (scaled by ~1; total is finite), so a long chain stays finite
    y = xm * (1.0 + 0.0 * total)
    tl.store(y_ptr + mine, y.to(y_ptr.dtype.element_ty))


def chains(device, launches: int, pdl: bool) -> dict:
    """name -> a function running one chain of `launches` dependent kernels."""
    from ttsbuild.plugins.fused_linear import fused_linear

    out = {}
    args = pdl_args(pdl)
    out["empty"] = lambda: [_empty_kernel[(1,)](num_warps=1, **args) for _ in range(launches)]
    bufs = [torch.randn(N, device=device).to(torch.bfloat16) for _ in range(2)]
    for programs in (1, 8, 64, 128):

        def hop(p=programs):
            for i in range(launches):
                _hop_kernel[(p,)](bufs[i % 2], bufs[(i + 1) % 2], N=N, PER=N // p,
                                  num_warps=4, **args)  # fmt: skip

        out[f"hop {programs}"] = hop
    g = torch.Generator().manual_seed(0)

    def weight(n_out, n_in):
        return (torch.randn(n_out, n_in, generator=g) * n_in**-0.5).to(device, torch.bfloat16)

    x0 = torch.randn(1, N, generator=g).to(device, torch.bfloat16)
    for name, wide in (("cp.down+up 3072", 3072), ("cp.o+in 2048", 2048)):
        w_in, w_out = weight(N, wide), weight(wide, N)  # wide -> 1024, then 1024 -> wide

        def pair(w_in=w_in, w_out=w_out):
            x = x0
            for _ in range(launches // 2):
                x = fused_linear(fused_linear(x, w_out), w_in)
            return x

        out[name] = pair
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=420)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--check", action="store_true",
                    help="run each chain once on the CPU under TRITON_INTERPRET=1")  # fmt: skip
    args = ap.parse_args(argv)
    if args.launches < 2 or args.launches % 2 or args.replays < 1:
        print("error: --launches must be even and >= 2, --replays >= 1", file=sys.stderr)
        return 2
    if args.check:
        if not interpret_mode():
            print("error: --check needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        for name, run in chains("cpu", args.launches, pdl=False).items():
            run()
            print(f"{name}: ran {args.launches} launches")
        return 0
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (or --check)", file=sys.stderr)
        return 2
    from ttsbuild.bench.engine_bench import _time_graph
    from ttsbuild.runtime.graph_engine import _capture

    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}; {args.launches} dependent launches per graph")  # fmt: skip
    print(f"{'chain':18s} {'PDL us/launch':>14s} {'no PDL':>8s}")
    rows = []
    dev = torch.device("cuda")
    per_pdl = {pdl: chains(dev, args.launches, pdl) for pdl in (True, False)}
    for name in per_pdl[True]:
        us = {}
        for pdl in (True, False):
            # the linears read TTSBUILD_PDL when they launch (plugins._dispatch.pdl_enabled)
            old = os.environ.get("TTSBUILD_PDL")
            os.environ["TTSBUILD_PDL"] = "1" if pdl else "0"
            try:
                graph = _capture(per_pdl[pdl][name], None)
            finally:
                if old is None:
                    del os.environ["TTSBUILD_PDL"]
                else:
                    os.environ["TTSBUILD_PDL"] = old
            us[pdl] = 1e3 * _time_graph(graph, args.replays) / args.launches
            del graph
        rows.append({"chain": name, "us_per_launch_pdl": us[True], "us_per_launch": us[False]})
        print(f"{name:18s} {us[True]:14.2f} {us[False]:8.2f}")
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
