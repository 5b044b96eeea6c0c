"""The code predictor's four linears at many rows: weight-only FP8 tiles against cuBLAS on bf16.

    PYTHONPATH=. python3 benchmarks/kernels/cp_many_rows.py [--ms 64,128,256] [--tag wo64]
    TTSBUILD_FP8_WO_MAX_BLOCK_M=128 PYTHONPATH=. python3 benchmarks/kernels/cp_many_rows.py

GPU only. For the 1.7B code predictor's shapes (qkv, o, gate/up + SiLU, down) at each row
count: the weight-only FP8 linear as the runtime calls it (`Dense` with an FP8 weight:
`fp8_linear`, then `silu_mul` for gate/up as with TTSBUILD_GATE_UP_SILU off, the default;
autotuned, with the activation tile the environment allows: TTSBUILD_FP8_WO_MAX_BLOCK_M),
and the path of plan `cp_bf16_min_rows` (cuBLAS `F.linear` on the dequantised bf16 weight,
then `silu_mul` for gate/up). Median us per call over CUDA-graph replays with the weights
rotated over copies larger than L2 (`bench_kernels.graph_time_us`); each result is checked
against an fp32 product of the same dequantised weight on fresh random rows (relative error
<= 2e-2, else the run fails).
The last line sums a frame's worth: 5 layers x 15 passes of the four linears.
Appends to $OUT/cp_many_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import graph_time_us, rel_err  # noqa: E402

from ttsbuild.plugins._tl.fp8_linear import TUNE_BY_ROWS, WO_MAX_BLOCK_M  # noqa: E402
from ttsbuild.plugins.fp8_linear import (  # noqa: E402
    dequantize_weight_fp8,
    fp8_linear,
    quantize_weight_fp8,
)
from ttsbuild.plugins.norm_act import silu_mul  # noqa: E402

SHAPES = {  # name: (K, N), the 1.7B code predictor's linears (gate_up: gate rows then up rows)
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
}
LAYERS, PASSES = 5, 15


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,256")  # (the engine warms smallest first)
    ap.add_argument("--tag", default=f"wo{WO_MAX_BLOCK_M}{'-by-rows' if TUNE_BY_ROWS else ''}")
    ap.add_argument("--copies", type=int, default=8, help="weight copies rotated (past L2)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    total = {}
    for m in (int(v) for v in args.ms.split(",")):
        for name, (k, n) in SHAPES.items():
            gate_up = name == "gate_up"
            ws = [quantize_weight_fp8(torch.randn(n, k, device=dev) * k**-0.5)
                  for _ in range(args.copies)]  # fmt: skip
            w16 = [dequantize_weight_fp8(w, s, torch.bfloat16) for w, s in ws]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ dequantize_weight_fp8(*ws[0]).t()
            if gate_up:
                ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2 :]

            def wo(i, x=x, gate_up=gate_up, ws=ws):
                w, s = ws[i]
                y = fp8_linear(x, w, s)
                return silu_mul(y) if gate_up else y

            def bf16(i, x=x, gate_up=gate_up, w16=w16):
                y = F.linear(x, w16[i])
                return silu_mul(y) if gate_up else y

            res = {"tag": args.tag, "m": m, "name": name, "k": k, "n": n}
            for path, fn in (("wo", wo), ("bf16", bf16)):
                err = rel_err(fn(0).float(), ref)
                if not err <= 2e-2:
                    raise SystemExit(f"{path} {name} m={m}: relative error {err:.3g}")
                us = graph_time_us([lambda i=i, fn=fn: fn(i) for i in range(args.copies)])
                res[f"{path}_us"], res[f"{path}_err"] = us, err
                total[(m, path)] = total.get((m, path), 0.0) + us
            rows.append(res)
            print(f"{args.tag} m={m:4d} {name:8s} wo {res['wo_us']:7.1f} us  bf16 "
                  f"{res['bf16_us']:7.1f} us  (err {res['wo_err']:.1e} / {res['bf16_err']:.1e})",
                  flush=True)  # fmt: skip
    for (m, path), us in sorted(total.items()):
        print(
            f"{args.tag} m={m} {path}: four linears {us:.1f} us -> "
            f"{us * LAYERS * PASSES / 1e3:.2f} ms a frame"
        )
    out = Path(os.environ.get("OUT", ".")) / "cp_many_rows.json"
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
