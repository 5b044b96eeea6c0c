"""Where the persistent code-predictor pass spends its time: grid barriers vs stage work.

    PYTHONPATH=. python3 benchmarks/kernels/bench_barrier.py

GPU only. (1) `barrier_bench_kernel`: n grid barriers and nothing else, for several program
counts and warps per program: us per barrier, the generation barrier (`_grid_sync`, served)
and the counting one (`_grid_sync_count`, TTSBUILD_CP_PASS_COUNT_BARRIER). (2) One pass of
the 1.7B CustomVoice code predictor (bf16, random weights, batch 1, projection + 5 layers +
head: 26 barriers) as a CUDA graph of 15 passes, with the barriers and with the stages racing
(no barriers: garbage results, the stages' own time), for the same program counts and warps.
"""

from __future__ import annotations

import sys

import torch

from ttsbuild.bench.engine_bench import _time_graph
from ttsbuild.runtime.graph_engine import _capture


def graph_of(fn, n: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of n calls of fn (graph_engine's capture: warm-up runs first)."""
    return _capture(lambda: [fn() for _ in range(n)], None)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "benchmarks/kernels")
    from bench_cp_fused import build

    from ttsbuild.convert.init_random import load_variant
    from ttsbuild.model.config import ModelConfig
    from ttsbuild.plugins._tl.cp_pass import barrier_bench_kernel
    from ttsbuild.plugins.cp_pass import _barrier, run_pass

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bar = _barrier(dev)
    n = 1000
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs")
    print("grid barrier alone: us per barrier (generation / counting)")
    for nprog in (sms, sms // 2, sms // 4):
        for warps in (4, 8):
            us = []
            for count in (False, True):
                g = graph_of(lambda p=nprog, w=warps, c=count: barrier_bench_kernel[(p,)](
                    bar, n, COUNT=c, num_warps=w))  # fmt: skip
                us.append(1e3 * _time_graph(g, 10) / n)
            print(f"  programs {nprog:4d} warps {warps}: {us[0]:7.3f} / {us[1]:7.3f} us")

    cfg = ModelConfig.from_official(load_variant("1.7b-customvoice")[0])
    fcp = build(cfg, torch.bfloat16, fp8=False)
    fcp.enable_persistent(8)
    c = fcp.stack.cfg
    B, G = 1, fcp.num_code_groups
    shape = (c.num_layers, B, c.num_kv_heads, G, c.head_dim)
    k = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    v = torch.zeros_like(k)
    slots = torch.arange(B, device=dev)
    idx = torch.zeros(B, dtype=torch.int64, device=dev)
    print("one pass (projection + 5 layers + head), batch 1 bf16: us per pass (15 per graph)")
    for nprog in (sms, sms // 2):
        for warps in (4, 8):
            row = []
            for race in (False, True):
                def one(p=nprog, w=warps, r=race):
                    run_pass(fcp.passes, fcp.pass_buffers, fcp.embeddings[0], idx, 3, k, v,
                             slots, fcp.heads[0], num_programs=p, num_warps=w, race_stages=r)
                g = graph_of(one, 15)
                row.append(1e3 * _time_graph(g, 10) / 15)
            print(f"  programs {nprog:4d} warps {warps}: with barriers {row[0]:7.1f}, "
                  f"stages racing {row[1]:7.1f} -> barriers {(row[0] - row[1]) / 26:5.2f} us each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
