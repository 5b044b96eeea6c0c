# ruff: noqa: B023  (the timed closures run before their loop variables change)
"""A wide config sweep of the weight-only FP8 linear at the talker's shapes.

    PYTHONPATH=. python3 benchmarks/kernels/sweep_fp8.py [--ms 1,8,32,64] [--jobs 8]

GPU only. The autotuner picks from a few configs (`_tl.fp8_linear.GEMV_CONFIGS` /
`GEMM_CONFIGS`); this times a few hundred, so the sets can be chosen by measurement. Kernels
are compiled first in --jobs processes (Triton's cache, shared), then timed one at a time in
this process: median us per call over CUDA-graph replays with the weights rotated over copies
that do not fit in L2 (`bench_kernels.graph_time_us`). Prints, per shape and M, the
autotuner's pick and the best config, cuBLAS W8A8 (`fp8_linear_w8a8`: the row quantisation
launch + torch._scaled_mm) and cuBLAS bf16 (twice the weight bytes).
Writes $OUT/sweep_fp8.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (K, N), the talker's linears (1.7B)
    "qkv": (2048, 4096),
    "o": (2048, 2048),
    "gate_up": (2048, 12288),
    "down": (6144, 2048),
}


def configs(m: int) -> list[dict]:
    if m == 1:
        space = itertools.product((8, 16, 32), (256, 512, 1024), (1, 2, 4), (2, 4, 8), (1, 3))
    else:
        space = itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4, 8), (3, 4, 6))
    return [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=w, num_stages=st)
            for n, k, s, w, st in space]  # fmt: skip


def fits(c: dict, K: int, N: int) -> bool:
    return c["BLOCK_K"] <= K and K % (c["BLOCK_K"] * c["SPLIT_K"]) == 0 and N % c["BLOCK_N"] == 0


def compile_slice(ms: list[int], part: int, parts: int) -> None:
    """Compile (by running once) every config of the slice at every M's tile width."""
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton
    from ttsbuild.plugins.fp8_linear import quantize_weight_fp8

    K, N = SHAPES["gate_up"]
    q, s = quantize_weight_fp8(torch.randn(N, K, device="cuda"))
    jobs = [(m, c) for m in ms for c in configs(m) if fits(c, K, N)]
    for m, c in jobs[part::parts]:
        x = torch.randn(m, K, device="cuda").bfloat16()
        try:
            fp8_linear_triton(x, q, s, config=c)
        except Exception as exc:  # noqa: BLE001
            print(f"compile failed {m} {c}: {exc!r}"[:200], flush=True)
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,32,64")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--part", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.part >= 0:
        compile_slice(ms, args.part, args.jobs)
        return 0
    cmd = [sys.executable, __file__, "--ms", args.ms, "--jobs", str(args.jobs), "--part"]
    procs = [subprocess.Popen([*cmd, str(i)]) for i in range(args.jobs)]
    for p in procs:
        p.wait()

    from benchmarks.kernels.bench_kernels import L2_DEFEAT_BYTES, graph_time_us
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8
    from ttsbuild.plugins.fp8_linear import fp8_linear, quantize_weight_fp8
    from ttsbuild.plugins.fp8_w8a8 import fp8_linear_w8a8, w8a8_supported

    g = torch.Generator(device="cuda").manual_seed(0)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    print(f"{'shape':8s} {'M':>3s} {'auto us':>8s} {'TB/s':>5s} {'best us':>8s} {'TB/s':>5s} "
          f"{'cublas8':>8s} {'bf16 us':>8s}  best config")  # fmt: skip
    run = tl_fp8.fp8_linear_triton
    for name, (K, N) in SHAPES.items():
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / (N * K)))
        w = torch.randn(N, K, device="cuda", generator=g).mul_(0.02)
        q, s = quantize_weight_fp8(w)
        qs = [(q.view(torch.uint8).roll(i, 0).view(q.dtype), s.roll(i, 0)) for i in range(copies)]
        wb = [w.bfloat16().roll(i, 0) for i in range(max(2, copies // 2))]
        tbs = lambda us: N * K / (us * 1e-6) / 1e12  # noqa: E731
        for m in ms:
            x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
            fp8_linear(x, q, s, use_triton=True)  # the autotuner's pick
            auto = graph_time_us([lambda q=q, s=s: fp8_linear(x, q, s) for q, s in qs])
            bf16 = graph_time_us([lambda w=w: F.linear(x, w) for w in wb])
            cublas8 = float("nan")
            if w8a8_supported(m, q):
                cublas8 = graph_time_us([lambda q=q, s=s: fp8_linear_w8a8(x, q, s) for q, s in qs])
            ref = x.float() @ (q.float() * s[:, None]).t()
            timed = []
            for c in configs(m):
                if not fits(c, K, N):
                    continue
                try:
                    o = run(x, q, s, config=c)
                    err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
                    if err > 2e-2:
                        print(f"  {name} M={m} {c}: rel err {err:.1e}", flush=True)
                        continue
                    calls = [lambda q=q, s=s, c=c: run(x, q, s, c) for q, s in qs]
                    timed.append((graph_time_us(calls, replays=5), c))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} M={m} {c}: {exc!r}"[:200], flush=True)
            timed.sort(key=lambda tc: tc[0])
            bt, bc = timed[0]
            print(f"{name:8s} {m:3d} {auto:8.2f} {tbs(auto):5.2f} {bt:8.2f} {tbs(bt):5.2f} "
                  f"{cublas8:8.2f} {bf16:8.2f}  {bc}", flush=True)  # fmt: skip
            report["results"].append({
                "shape": name, "K": K, "N": N, "M": m, "auto_us": auto, "bf16_us": bf16,
                "cublas_w8a8_us": cublas8, "auto_config": tl_fp8.best_config(m, N, K),
                "top": [{"us": t, **c} for t, c in timed[:5]],
            })  # fmt: skip
        del qs, wb
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_fp8.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
