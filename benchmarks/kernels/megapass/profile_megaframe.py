"""One frame of the one-kernel code predictor (served options, its own instance) for Nsight
Compute to profile: where the kernel's warps stall, by source line. Run under ncu (the
`mfprofile` step of benchmarks/runtime/gpu_session.sh):

    TTSBUILD_MEGAFRAME_LINEINFO=1 ncu --clock-control none -k regex:cp_megaframe_kernel \\
        --launch-skip 3 --launch-count 1 --set full --import-source yes -o OUT/mf \\
        python3 benchmarks/kernels/megapass/profile_megaframe.py

The first three launches warm up; the fourth is the profiled one. Each launch is checked
against the float32 reference first (a profile of a wrong kernel would mislead). --variant:
served (SERVED_OPTS, greedy), served512 (the same with 512 stage threads), sampled (the same,
sampled), tagged (with TAGGED), tagged_qkv (with TAGGED | TAGGED_QKV), warp_qk (with those and
WARP_QK: the engine's options), raw (SERVED_OPTS | RAW: timing only) or race (mode 3, no
barriers: the stages' own time; its results are garbage).
GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_megaframe as bm  # noqa: E402

from ttsbuild.runtime import cp_megaframe as cpm  # noqa: E402

VARIANTS = {  # name -> (mode, sampling, option bits, stage threads)
    "served": (0, bm.GREEDY, cpm.SERVED_OPTS, 256),
    "served512": (0, bm.GREEDY, cpm.SERVED_OPTS, 512),
    "sampled": (0, bm.SAMPLED, cpm.SERVED_OPTS, 256),
    "raw": (0, bm.GREEDY, cpm.SERVED_OPTS | cpm.RAW, 256),
    "race": (3, bm.GREEDY, cpm.SERVED_OPTS, 256),
    "tagged": (0, bm.GREEDY, cpm.SERVED_OPTS | cpm.TAGGED, 256),
    "tagged_qkv": (0, bm.GREEDY, cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV, 256),
    "warp_qk": (0, bm.GREEDY, cpm.SERVED_OPTS | cpm.TAGGED | cpm.TAGGED_QKV | cpm.WARP_QK, 256),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="served")
    ap.add_argument("--launches", type=int, default=4, help="launches in all (the profiler "
                    "picks one with --launch-skip / --launch-count)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("GPU only", file=sys.stderr)
        return 2
    mode, smp, opts, threads = VARIANTS[args.variant]
    ext = cpm.extension(threads)
    bm.NO_STAMPS = torch.empty(0, dtype=torch.int64, device="cuda")
    m, b = bm.make_model(args.seed), cpm.scratch("cuda")
    ws = cpm.kernel_tensors(m, b)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    if mode == 0 and not opts & cpm.RAW:  # the math this profile stands for is right
        if not bm.check(ext, ws, m, b, ctas, f"{args.variant} before the profile", smp, 0, opts):
            return 1
    for _ in range(args.launches):
        bm.call(ext, ws, mode, ctas, bm.NO_STAMPS, smp, 0, opts)
    torch.cuda.synchronize()
    print(f"{args.launches} launches of the {args.variant} variant (mode {mode}, opts {opts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
