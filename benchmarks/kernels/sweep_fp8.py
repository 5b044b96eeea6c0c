# ruff: noqa: B023  (the timed closures run before their loop variables change)
"""A wide config sweep of the weight-only FP8 linear at the talker's (or code predictor's) shapes.

    PYTHONPATH=. python3 benchmarks/kernels/sweep_fp8.py [--ms 1,8,32,64] [--jobs 8] [--a8]
    PYTHONPATH=. python3 benchmarks/kernels/sweep_fp8.py --shapes cp --ms 16,32,64

GPU only. The autotuner picks from a few configs (`_tl.fp8_linear.GEMV_CONFIGS` /
`GEMM_CONFIGS`); this times a few hundred, so the sets can be chosen by measurement. Kernels
are compiled first in --jobs processes (Triton's cache, shared), then timed one at a time in
this process: median us per call over CUDA-graph replays with the weights rotated over copies
that do not fit in L2 (`bench_kernels.graph_time_us`). Prints, per shape and M, the
autotuner's pick and the best config, cuBLAS W8A8 (`fp8_linear_w8a8`: the row quantisation
launch + torch._scaled_mm) and cuBLAS bf16 (twice the weight bytes).
Writes $OUT/sweep_fp8.json.

--a8 sweeps the FP8 x FP8 tiles instead (`fp8_linear_a8_triton` on rows quantised once), and
adds the row quantisation alone ("quant") and the whole Triton W8A8 linear as served
("a8 auto": quantisation + the autotuned tiles); from 256 rows it also tries 256-row
activation tiles (`BLOCK_M`, 8 warps) beside the served 128. Writes $OUT/sweep_a8.json.

--table PATH (weight-only) also writes the winners as a config table
(`ttsbuild.plugins._tl.wo_table`: per row tile and shape, the best config at the most rows
swept in that tile), which TTSBUILD_FP8_WO_TABLE=PATH hands every launch of those shapes
on this GPU model. Sweep the row counts the engine's buckets fill (e.g. --ms 1,8,32,64;
2-16 rows share one tile) and both shape sets into two tables, or one `--shapes` at a time.
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
CP_SHAPES = {  # the code predictor's (1.7B; gate_up runs as one plain linear, then silu_mul)
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
}


def configs(m: int, a8: bool = False) -> list[dict]:
    if a8:
        space = itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (4, 8), (3, 4))
        cs = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=w, num_stages=st)
              for n, k, s, w, st in space]  # fmt: skip
        if m >= 256:  # the served row tile is 128 wide: also try 256 (two warpgroups' worth)
            wide = [c for c in cs if c["num_warps"] == 8 and c["SPLIT_K"] <= 2]
            cs += [dict(c, BLOCK_M=256) for c in wide if c["BLOCK_K"] == 128]
        return cs
    elif m == 1:
        space = itertools.product((8, 16, 32), (256, 512, 1024), (1, 2, 4), (2, 4, 8), (1, 3))
    else:  # (split 8 too: the code predictor's N of 1024 makes 8-32 tiles)
        space = itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 8), (3, 4))
    return [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=w, num_stages=st)
            for n, k, s, w, st in space]  # fmt: skip


def fits(c: dict, K: int, N: int) -> bool:
    return c["BLOCK_K"] <= K and K % (c["BLOCK_K"] * c["SPLIT_K"]) == 0 and N % c["BLOCK_N"] == 0


def _runner(a8: bool):
    """run(x, q, s, config) for the kernel swept: x bf16 (A8: quantised here, outside the
    timed call, by `prepare`)."""
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_a8_triton, fp8_linear_triton
    from ttsbuild.plugins.fp8_w8a8 import quantize_rows

    if not a8:
        return (lambda x: x), fp8_linear_triton
    return (lambda x: quantize_rows(x, use_triton=True),
            lambda xs, q, s, c=None: fp8_linear_a8_triton(xs[0], xs[1], q, s, c))  # fmt: skip


def compile_slice(ms: list[int], part: int, parts: int, a8: bool, shapes: dict) -> None:
    """Compile (by running once) every config of the slice at every M's tile width (every
    config that fits is EVEN at every shape, so one shape's compiles serve them all)."""
    from ttsbuild.plugins.fp8_linear import quantize_weight_fp8

    prepare, run = _runner(a8)
    weights = {KN: quantize_weight_fp8(torch.randn(KN[1], KN[0], device="cuda"))
               for KN in shapes.values()}  # fmt: skip
    jobs = []
    for m in ms:
        for c in configs(m, a8):
            KN = next((KN for KN in shapes.values() if fits(c, *KN)), None)
            if KN is not None:  # compiled at the first shape it fits
                jobs.append((m, c, KN))
    for m, c, (K, N) in jobs[part::parts]:
        q, s = weights[(K, N)]
        x = prepare(torch.randn(m, K, device="cuda").bfloat16())
        try:
            run(x, q, s, c)
        except Exception as exc:  # noqa: BLE001
            print(f"compile failed {m} {c}: {exc!r}"[:200], flush=True)
    torch.cuda.synchronize()


def compile_in_processes(argv: list[str], jobs: int) -> None:
    """Run `argv --part i` for each i < jobs side by side and wait: each process compiles its
    slice of a grid into Triton's (shared) cache, so the timing after compiles nothing."""
    procs = [subprocess.Popen([*argv, "--part", str(i)]) for i in range(jobs)]
    for p in procs:
        p.wait()


def sweep_parser(doc: str, ms: str, jobs: int) -> argparse.ArgumentParser:
    """A grid sweep's command line: --ms (row counts), --jobs (compile processes), --out, and
    the hidden --part that `compile_in_processes` hands each compile process."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ms", default=ms)
    ap.add_argument("--jobs", type=int, default=jobs)
    ap.add_argument("--part", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    return ap


def no_gpu() -> bool:
    """True (and says so) where there is no CUDA GPU to sweep on."""
    if torch.cuda.is_available():
        return False
    print("needs a CUDA GPU", file=sys.stderr)
    return True


def main() -> int:
    ap = sweep_parser(__doc__, ms="1,8,32,64", jobs=8)
    ap.add_argument("--a8", action="store_true", help="sweep the FP8 x FP8 (W8A8) tiles")
    ap.add_argument("--shapes", choices=("talker", "cp"), default="talker")
    ap.add_argument("--table", type=Path, default=None,
                    help="also write the winners as a weight-only config table (JSON)")
    args = ap.parse_args()
    if args.table is not None and args.a8:
        ap.error("--table is for the weight-only kernel (the A8 tiles take a rule)")
    ms = [int(m) for m in args.ms.split(",")]
    if no_gpu():
        return 2
    shapes = CP_SHAPES if args.shapes == "cp" else SHAPES
    if args.part >= 0:
        compile_slice(ms, args.part, args.jobs, args.a8, shapes)
        return 0
    compile_in_processes([sys.executable, __file__, "--ms", args.ms, "--jobs", str(args.jobs),
                          "--shapes", args.shapes, *(["--a8"] if args.a8 else [])],
                         args.jobs)  # fmt: skip

    from benchmarks.kernels.bench_kernels import L2_DEFEAT_BYTES, graph_time_us
    from ttsbuild.plugins import fp8_w8a8
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8
    from ttsbuild.plugins.fp8_linear import fp8_linear, quantize_weight_fp8
    from ttsbuild.plugins.fp8_w8a8 import fp8_linear_w8a8, quantize_rows, w8a8_supported

    g = torch.Generator(device="cuda").manual_seed(0)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shapes": args.shapes, "results": []}  # fmt: skip
    print(f"{'shape':8s} {'M':>3s} {'auto us':>8s} {'TB/s':>5s} {'best us':>8s} {'TB/s':>5s} "
          f"{'rule us':>8s} {'cublas8':>8s} {'bf16 us':>8s} {'quant':>6s} {'a8 auto':>8s}  "
          f"best config "
          f"({'A8 tiles, quantisation not included' if args.a8 else 'weight-only'})")  # fmt: skip
    prepare, run = _runner(args.a8)
    for name, (K, N) in shapes.items():
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
            cublas8 = quant = a8_auto = float("nan")
            # (each GEMM named: the module's choice, W8A8_GEMM, is restored after)
            served_gemm = fp8_w8a8.W8A8_GEMM
            try:
                fp8_w8a8.W8A8_GEMM = "cublas"
                if w8a8_supported(m, q):
                    cublas8 = graph_time_us([lambda q=q, s=s: fp8_linear_w8a8(x, q, s)
                                             for q, s in qs])  # fmt: skip
                if args.a8:
                    quant = graph_time_us([lambda: quantize_rows(x, use_triton=True)])
                    fp8_w8a8.W8A8_GEMM = "triton"
                    a8_auto = graph_time_us([lambda q=q, s=s: fp8_linear_w8a8(x, q, s)
                                             for q, s in qs])  # fmt: skip
            finally:
                fp8_w8a8.W8A8_GEMM = served_gemm
            ref = x.float() @ (q.float() * s[:, None]).t()
            if args.a8:  # the same quantised rows: A8 differs from weight-only by ~2-3 %
                ref = fp8_w8a8.fp8_linear_w8a8_reference(x, q, s).float()
            xs = prepare(x)
            timed = []
            for c in configs(m, args.a8):
                if not fits(c, K, N):
                    continue
                try:
                    o = run(xs, q, s, c)
                    err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
                    if err > 2e-2:
                        print(f"  {name} M={m} {c}: rel err {err:.1e}", flush=True)
                        continue
                    calls = [lambda q=q, s=s, c=c: run(xs, q, s, c) for q, s in qs]
                    timed.append((graph_time_us(calls, replays=5), c))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} M={m} {c}: {exc!r}"[:200], flush=True)
            timed.sort(key=lambda tc: tc[0])
            bt, bc = timed[0]
            rule = float("nan")  # the weight-only rule (TTSBUILD_FP8_WO_RULE): 1, 16-64 rows
            if not args.a8 and tl_fp8.wo_rule_rows(m):
                rc = tl_fp8.wo_config(m, N, K, tl_fp8._num_sms(x.device))
                rule = graph_time_us([lambda q=q, s=s: run(xs, q, s, rc) for q, s in qs],
                                     replays=5)  # fmt: skip
            print(f"{name:8s} {m:3d} {auto:8.2f} {tbs(auto):5.2f} {bt:8.2f} {tbs(bt):5.2f} "
                  f"{rule:8.2f} {cublas8:8.2f} {bf16:8.2f} {quant:6.2f} {a8_auto:8.2f}  {bc}",
                  flush=True)  # fmt: skip
            report["results"].append({
                "shape": name, "K": K, "N": N, "M": m, "auto_us": auto, "bf16_us": bf16,
                "cublas_w8a8_us": cublas8, "quantize_us": quant, "a8_auto_us": a8_auto,
                "rule_us": rule,
                "auto_config": tl_fp8.best_config(m, N, K, args.a8),
                "top": [{"us": t, **c} for t, c in timed[:5]],
            })  # fmt: skip
        del qs, wb
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    name = ("sweep_a8" if args.a8 else "sweep_fp8") + ("_cp" if args.shapes == "cp" else "")
    name += ".json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    if args.table is not None:
        from ttsbuild.plugins._tl import wo_table
        from ttsbuild.plugins._tl.fp8_linear import m_bucket

        table = wo_table.from_sweep(report, m_bucket)
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(table, indent=2))
        print(f"{len(table['configs'])} configs -> {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
