# ruff: noqa: B023  (the timed closures run before their loop variables change)
"""A config sweep of the code predictor's four fused linears (plugins/_tl/fused_linear.py) at
16-64 rows, against the per-shape `plan` the engine runs them with.

    PYTHONPATH=. python3 benchmarks/kernels/sweep_fused_cp.py [--ms 16,32,64] [--jobs 16]

GPU only. The fused code predictor (plan `fused_code_predictor`, buckets 1-16 by default) runs
each layer as norm + qkv, attention, o + residual, norm + gate/up + SiLU, down + residual. At
64 rows it was 0.9 ms a frame slower than the unfused path (H100,
`benchmarks/runtime/2026-12-07-h100-cp-bf16/`), whose weight-only FP8 tiles are autotuned;
the fused linears' tiles are `plan`'s (64 x 128, 4 warps, 3 stages, split-K to fill the SMs).
This times `sweep_fp8.configs`' grid for each linear with its epilogue, FP8 weights (the
served code predictor's), each result checked against the fp32 reference (relative error
<= 2e-2), median us per call over CUDA-graph replays with the weights rotated past L2.
Prints plan / best / the plain weight-only linear (`Dense`, autotuned) per shape and row
count; writes $OUT/sweep_fused_cp.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_fp8 import compile_in_processes, configs, fits, no_gpu, sweep_parser  # noqa: E402

# name: (K, N, mode), N the output columns (gate_up: the weight holds 2N rows)
SHAPES = {
    "qkv": (1024, 4096, "norm"),
    "o": (2048, 1024, "residual"),
    "gate_up": (1024, 3072, "gate_up"),
    "down": (3072, 1024, "residual"),
}


def _weights(K: int, N: int, mode: str, g=None):
    from ttsbuild.plugins.fp8_linear import quantize_weight_fp8

    rows = 2 * N if mode == "gate_up" else N
    return quantize_weight_fp8(torch.randn(rows, K, device="cuda", generator=g) * K**-0.5)


def _kwargs(mode: str, m: int, K: int, N: int, g=None) -> dict:
    if mode == "residual":
        return {"residual": torch.randn(m, N, device="cuda", generator=g).bfloat16()}
    norm = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    return {"norm_weight": norm, "eps": 1e-6, "gate_up": mode == "gate_up"}


def _block_m(m: int) -> int:
    return min(64, max(16, 1 << (m - 1).bit_length()))


def compile_slice(ms: list[int], part: int, parts: int) -> None:
    """Compile (by running once) each config of the slice for each epilogue and row tile."""
    from ttsbuild.plugins._tl.fused_linear import fused_linear_triton

    jobs = [(m, name, c) for m in ms for name, (K, N, _) in SHAPES.items()
            for c in configs(m) if fits(c, K, N)]  # fmt: skip
    done = set()
    for m, name, c in jobs[part::parts]:
        K, N, mode = SHAPES[name]
        key = (_block_m(m), mode, tuple(sorted(c.items())))
        if key in done:  # the same binary as another shape's (K, N are runtime values)
            continue
        done.add(key)
        q, s = _weights(K, N, mode)
        x = torch.randn(m, K, device="cuda").bfloat16()
        try:
            fused_linear_triton(x, q, s, config={**c, "BLOCK_M": _block_m(m)},
                                **_kwargs(mode, m, K, N))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"compile failed {m} {name} {c}: {exc!r}"[:200], flush=True)
    torch.cuda.synchronize()


def main() -> int:
    args = sweep_parser(__doc__, ms="16,32,64", jobs=16).parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if no_gpu():
        return 2
    if args.part >= 0:
        compile_slice(ms, args.part, args.jobs)
        return 0
    compile_in_processes([sys.executable, __file__, "--ms", args.ms, "--jobs", str(args.jobs)],
                         args.jobs)  # fmt: skip

    from bench_kernels import L2_DEFEAT_BYTES, graph_time_us

    from ttsbuild.plugins._tl.fused_linear import _num_sms, fused_linear_triton, plan
    from ttsbuild.plugins.fused_linear import fused_linear_reference
    from ttsbuild.runtime.fast_model import Dense

    g = torch.Generator(device="cuda").manual_seed(0)
    sms = _num_sms(torch.device("cuda"))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    print(f"{'shape':8s} {'M':>3s} {'plan us':>8s} {'best us':>8s} {'linear':>8s}  plan -> best")
    for name, (K, N, mode) in SHAPES.items():
        q0, s0 = _weights(K, N, mode, g)
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / q0.numel()))
        qs = [(q0.view(torch.uint8).roll(i, 0).view(q0.dtype), s0.roll(i, 0))
              for i in range(copies)]  # fmt: skip
        for m in ms:
            x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
            kw = _kwargs(mode, m, K, N, g)
            kw32 = {k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()}
            ref = fused_linear_reference(x.float(), q0, s0, **kw32).float()
            linear = graph_time_us([lambda d=Dense(q, s): d(x) for q, s in qs])

            def timed_config(c):
                out = fused_linear_triton(x, q0, s0, config=c, **kw).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if err > 2e-2:
                    raise AssertionError(f"rel err {err:.1e}")
                calls = [lambda q=q, s=s: fused_linear_triton(x, q, s, config=c, **kw)
                         for q, s in qs]  # fmt: skip
                return graph_time_us(calls, replays=5)

            p = plan(m, N, K, mode == "gate_up", sms)
            p_us = timed_config(p)
            timed = []
            for c in configs(m):
                if not fits(c, K, N):
                    continue
                c = {**c, "BLOCK_M": _block_m(m)}
                try:
                    timed.append((timed_config(c), c))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} M={m} {c}: {exc!r}"[:200], flush=True)
            timed.sort(key=lambda tc: tc[0])
            bt, bc = timed[0] if timed else (float("nan"), {})
            print(f"{name:8s} {m:3d} {p_us:8.2f} {bt:8.2f} {linear:8.2f}  {p} -> {bc}",
                  flush=True)  # fmt: skip
            report["results"].append({
                "shape": name, "K": K, "N": N, "mode": mode, "M": m, "plan_us": p_us,
                "plan": p, "linear_us": linear, "top": [{"us": t, **c} for t, c in timed[:5]],
            })  # fmt: skip
        qs = None  # (the copies freed before the next shape)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_fused_cp.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
