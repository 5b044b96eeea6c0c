"""Kernel launches of a code-predictor frame, plain and speculative, counted on the CPU.

    TRITON_INTERPRET=1 python benchmarks/spec/count_launches.py [--batch 1] [--window 3]
    TRITON_INTERPRET=1 PYTHONPATH=/other/tree python benchmarks/spec/count_launches.py  # before

No GPU: the frames run their GPU code path (the Triton kernels under the interpreter) on a
small random code predictor (the tiny stand-in's widths, the 1.7B's 5 layers), and every
launch is counted: each Triton grid launch, and each torch op that would launch a kernel on
a GPU (any ATen op but views and uninitialised allocations; a copy or a fill counts). A
round of the speculative frame is counted as the calls between two rounds, so the table
shows the launches a frame spends before its rounds, per round, and after them. Launch
counts decide a small batch's time here (each launch is ~2-5 us on the H200, and the passes
are launch-bound); the counts do not depend on the model's width, only on its layer count
and the code path.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "kernels"))

NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
             "_local_scalar_dense", "lift_fresh", "promote_types", "_unsafe_view"}  # fmt: skip


class Launches(TorchDispatchMode):
    """Counts torch ops that would launch kernels; Triton launches come from `triton_hook`."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self.inside_kernel = False  # the interpreter's own tensor ops are not launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_kernel and not func.is_view and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())

    def snapshot(self) -> tuple[collections.Counter, collections.Counter]:
        return collections.Counter(self.ops), collections.Counter(self.triton)


def triton_hook(counter: Launches) -> None:
    from triton.runtime import interpreter

    original = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        counter.triton[self.fn.__name__] += 1
        counter.inside_kernel = True
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.inside_kernel = False

    interpreter.GridExecutor.__call__ = counted


def diff(after, before) -> collections.Counter:
    out = collections.Counter(after)
    out.subtract(before)
    return +out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels' code path on the CPU)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--layers", type=int, default=5,
                    help="code-predictor layers (the 1.7B's: 5; widths stay the tiny's)")
    args = ap.parse_args()

    from bench_cp_fused import build

    from ttsbuild.convert.init_random import load_variant
    from ttsbuild.generation.sampling import SamplingBatch
    from ttsbuild.model.config import ModelConfig
    from ttsbuild.runtime import cp_spec
    from ttsbuild.runtime.cp_spec import SpeculativeCodePredictor

    config, _, _ = load_variant("tiny")
    config["talker_config"]["code_predictor_config"]["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_official(config)
    fcp = build(cfg, torch.float32, fp8=False, device="cpu")
    B, G, c = args.batch, fcp.num_code_groups, fcp.stack.cfg
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, fcp.codec_embedding.shape[1], generator=g)
    c0 = torch.randint(0, fcp.codec_embedding.shape[0], (B,), generator=g)
    sampling = SamplingBatch(do_sample=torch.ones(B, dtype=torch.bool),
                             temperature=torch.full((B,), 0.9), top_k=torch.full((B,), 50),
                             top_p=torch.ones(B), repetition_penalty=torch.ones(B))  # fmt: skip
    seeds = torch.randint(0, 2**40, (B,), generator=g)
    frames = torch.zeros(B, dtype=torch.int64)
    shape = (c.num_layers, B, c.num_kv_heads, G, c.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    slots = torch.arange(B)
    positions = [torch.full((B,), i) for i in range(G)]
    # the heads' own drafts: every round runs on the CPU until its rows finish
    spec = SpeculativeCodePredictor(fcp, B, args.window, loop=False, conditional=False)
    spec.early_exit_on_cpu = False  # as under capture without WHILE nodes: count every round

    counter = Launches()
    triton_hook(counter)
    rounds: list[tuple] = []
    original_round = spec._round

    def counted_round(*a, **kw):
        before = counter.snapshot()
        original_round(*a, **kw)
        rounds.append((before, counter.snapshot()))

    spec._round = counted_round
    with counter:
        fcp.frame(hidden, c0, sampling, seeds, frames, k_cache, v_cache, slots, positions)
    plain = counter.total()
    plain_parts = counter.snapshot()
    counter.ops.clear()
    counter.triton.clear()
    with counter:
        spec.frame(hidden, c0, sampling, seeds, frames, "self", args.window)
    total = counter.total()
    per_round = [sum(diff(a[0], b[0]).values()) + sum(diff(a[1], b[1]).values())
                 for b, a in rounds]  # fmt: skip
    first_b, first_a = rounds[0]
    print(f"code predictor of {c.num_layers} layers (tiny widths), batch {B}, window "
          f"{args.window}; "
          f"fused verify {cp_spec.FUSED_VERIFY}, fused accept {cp_spec.FUSED_ACCEPT}")
    print(f"plain fused frame: {plain} launches ({plain / (G - 1):.1f} per codebook)")
    print(f"speculative frame: {total} launches: {len(per_round)} rounds of "
          f"{min(per_round)}-{max(per_round)}, {total - sum(per_round)} outside the rounds")
    print("one round:", dict(diff(first_a[0], first_b[0])), dict(diff(first_a[1], first_b[1])))
    outside_ops = diff(counter.ops, sum((diff(a[0], b[0]) for b, a in rounds),
                                        collections.Counter()))  # fmt: skip
    outside_tr = diff(counter.triton, sum((diff(a[1], b[1]) for b, a in rounds),
                                          collections.Counter()))  # fmt: skip
    print("outside the rounds:", dict(outside_ops), dict(outside_tr))
    print("plain frame:", dict(plain_parts[0]), dict(plain_parts[1]))


if __name__ == "__main__":
    main()
