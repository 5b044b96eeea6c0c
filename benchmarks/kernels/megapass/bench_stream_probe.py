"""How fast one CTA per SM streams chunks from HBM into shared memory (stream_probe.cu), by
copy kind (TMA bulk copies, split into `pieces` requests, or 16-byte cp.async), chunk size,
copies in flight, and with a grid barrier after every chunk or without:

    PYTHONPATH=. python3 benchmarks/kernels/megapass/bench_stream_probe.py

The megaframe's stages fetch 16-48 KB a CTA two stages ahead and reached ~7 GB/s an SM with
its barriers off (2026-12-05); this says whether that is the pattern's limit. GPU only (sm_90).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch


def build():
    from torch.utils.cpp_extension import load

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_probe.cu")
    return load(name="stream_probe", sources=[src], verbose=False,
                extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"])


def time_ms(fn, reps: int) -> float:
    """Median ms of `reps` calls of fn (CUDA events around each), after a warm-up call:
    engine_bench's graph timer, fn standing for the replay."""
    from ttsbuild.bench.engine_bench import _time_graph

    fn()
    return _time_graph(SimpleNamespace(replay=fn), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=128, help="chunks a CTA")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("GPU only", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    ctas = props.multi_processor_count
    print(f"device {props.name}, {ctas} SMs, torch {torch.__version__}")
    ext = build()
    chunks = (16 << 10, 32 << 10, 48 << 10)
    src = torch.randint(0, 256, (ctas * args.iters * max(chunks),), dtype=torch.uint8,
                        device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    ms = time_ms(lambda: src.view(torch.int32).sum(dtype=torch.int64), args.reps)
    print(f"torch sum over {src.numel() / 1e6:.0f} MB (read-bound): "
          f"{src.numel() / ms / 1e6:.0f} GB/s")
    print("| copy | chunk KB | in flight | barrier each chunk | GB/s | GB/s an SM | us a chunk |")
    print("|---|---|---|---|---|---|---|")
    for tma, pieces, label in ((1, 1, "tma"), (1, 8, "tma, 8 pieces"), (0, 1, "cp.async")):
        for chunk in chunks:
            for depth in (1, 2, 3):
                for sync in (0, 1):
                    t = time_ms(lambda c=chunk, d=depth, s=sync, tm=tma, p=pieces: ext.stream(
                        src, ctas, c, d, args.iters, p, s, tm, counter, sink), args.reps)
                    gbs = ctas * args.iters * chunk / t / 1e6
                    print(f"| {label} | {chunk >> 10} | {depth} | {'yes' if sync else 'no'} | "
                          f"{gbs:.0f} | {gbs / ctas:.1f} | {t * 1e3 / args.iters:.2f} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
