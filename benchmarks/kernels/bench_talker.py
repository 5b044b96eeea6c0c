"""The talker's decode step on the unfused kernels (PackedStack.decode) vs decode_fused.

    PYTHONPATH=. python3 benchmarks/kernels/bench_talker.py [--batches 1,8,64]

GPU only. 1.7B CustomVoice talker shapes (28 layers, hidden 2048, 16/8 heads x 128,
intermediate 6144), random weights, FP8 weight-only and bf16, a KV cache of 1024 positions
with rows at position ~600. One CUDA graph per path and batch; ms per step (median of graph
replays) side by side, the weight-read floor, and the relative difference of the outputs.
It decides EnginePlan.fused_talker (the buckets where the fused step is faster).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ttsbuild.bench.engine_bench import _time_graph
from ttsbuild.runtime.graph_engine import _capture

PEAK_BW = 4.0e12


def time_batch(stack, cfg, B: int, replays: int) -> tuple[dict, float]:
    """({path: ms per step}, relative difference of the two paths' outputs) at batch B."""
    from ttsbuild.runtime.cp_fused import decode_fused

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(B)
    shape = (cfg.num_layers, B, cfg.num_kv_heads, 1024, cfg.head_dim)
    k = torch.randn(shape, device=dev, generator=g).bfloat16()
    v = torch.randn(shape, device=dev, generator=g).bfloat16()
    x = torch.randn(B, cfg.hidden_size, device=dev, generator=g).bfloat16()
    slots = torch.arange(B, device=dev)
    pos = torch.randint(550, 650, (B,), device=dev, generator=g)
    paths = {"unfused": stack.decode, "fused": lambda *a: decode_fused(stack, *a)}
    outs, graphs = {}, {}
    for name, fn in paths.items():

        def step(name=name, fn=fn):  # the captured call's output is the graph's static output
            outs[name] = fn(x, k, v, slots, pos)

        graphs[name] = _capture(step, None)
    ms = {name: _time_graph(gr, replays) for name, gr in graphs.items()}
    a, b = outs["unfused"].double(), outs["fused"].double()
    return ms, ((a - b).norm() / a.norm()).item()


def random_talker(variant: str, device: str):
    """(talker config, its DecoderStack) of a shipped variant's shapes, random weights: norms
    near 1, the rest N(0, 0.02), seed 0."""
    from ttsbuild.convert.init_random import load_variant
    from ttsbuild.model.config import ModelConfig
    from ttsbuild.model.layers import DecoderStack

    cfg = ModelConfig.from_official(load_variant(variant)[0]).talker
    torch.manual_seed(0)
    with torch.device(device):
        module = DecoderStack(cfg)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return cfg, module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--precisions", default="fp8,bf16")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from ttsbuild.runtime.fast_model import PackedStack

    cfg, module = random_talker("1.7b-customvoice", "cuda")
    module = module.bfloat16()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'prec':5s} {'B':>3s} {'unfused ms':>11s} {'fused ms':>9s} {'speedup':>8s} "
          f"{'floor ms':>9s} {'rel diff':>9s}")  # fmt: skip
    for prec in args.precisions.split(","):
        stack = PackedStack.from_module(module, prec == "fp8")
        floor = stack.read_bytes() / PEAK_BW * 1e3
        for B in [int(b) for b in args.batches.split(",")]:
            ms, rel = time_batch(stack, cfg, B, args.replays)
            print(f"{prec:5s} {B:3d} {ms['unfused']:11.3f} {ms['fused']:9.3f} "
                  f"{ms['unfused'] / ms['fused']:7.2f}x {floor:9.3f} {rel:9.2e}")  # fmt: skip
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
