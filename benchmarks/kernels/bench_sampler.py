"""The fused sampler's latency by warps per row and top-k search: the code predictor's and the
talker's shapes.

    PYTHONPATH=. python3 benchmarks/kernels/bench_sampler.py [--warps 1,2,4,8] [--batches 1,64]

GPU only. One program per row searches the top-k threshold bit by bit: 32 dependent block
reductions, each a cross-warp round trip through shared memory at 8 warps; with fewer warps a
reduction is mostly warp shuffles and each thread walks more of the vocabulary. The early
exit (`topk_threshold_early`, TTSBUILD_SAMPLE_EARLY_EXIT) stops the search once decided; the
first try (TTSBUILD_SAMPLE_FIRST_TRY) takes the unrestricted Gumbel-max winner when it is in
the top k, with no search (the search after it where not). For
each (vocabulary, batch, search, warps): us per call, from a CUDA graph of 16 calls (a
frame's samplers) replayed; and the tokens against the reference sampler (exact: the same
threshold, noise and tie-breaks; top-p is 1.0 here as in the 12 Hz models' config). Logits
are drawn with a spread like a trained model's (normal, scale 4), fresh per shape: fp32 for
the code predictor (its head writes fp32), bf16 values for the talker (its head runs in bf16
and is cast), whose ties at the k-th value end the early search only at its tie check.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from ttsbuild.generation.sampling import SamplingBatch, SamplingParams
    from ttsbuild.plugins._tl.sampling import _RADIX_BITS, _warps, sample_triton
    from ttsbuild.plugins.sampling import fused_sample_reference

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"radix bits {_RADIX_BITS}")  # fmt: skip
    print("| vocab (who) | batch | top-k search | warps | us per call | tokens equal to the "
          "reference |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for V, who, penalty in ((2048, "code predictor", None), (3072, "talker", 1.05)):
        for B in (int(b) for b in args.batches.split(",")):
            logits = torch.randn(B, V, device=dev, generator=gen) * 4.0
            if who == "talker":
                logits = logits.to(torch.bfloat16).float()
            params = SamplingParams(repetition_penalty=penalty or 1.0)
            batch = SamplingBatch.from_params([params] * B, device=dev)
            seeds = torch.randint(0, 2**62, (B,), device=dev, generator=gen)
            counters = torch.randint(0, 2**20, (B,), device=dev, generator=gen)
            history = None
            if penalty is not None:
                history = torch.rand(B, V, device=dev, generator=gen) < 0.05
            ref = fused_sample_reference(logits, batch, seeds, counters, history)
            default = _warps(1 << (V - 1).bit_length(), _RADIX_BITS)
            searches = [(False, False), (True, False), (True, True)]  # (early exit, first try)
            for (early, first), w in ((e, int(x)) for e in searches for x in args.warps.split(",")):
                kw = dict(num_warps=w, early_exit=early, first_try=first)
                out = sample_triton(logits, batch, seeds, counters, history, **kw)
                equal = int((out == ref).sum())
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        sample_triton(logits, batch, seeds, counters, history, **kw)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(16):
                        sample_triton(logits, batch, seeds, counters, history, **kw)
                for _ in range(5):
                    g.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)  # fmt: skip
                start.record()
                for _ in range(args.replays):
                    g.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3 / (args.replays * 16)
                mark = " (default)" if w == default and early and not first else ""
                search = ("first try, then early exit" if first else "early exit" if early
                          else "32 bits")  # fmt: skip
                print(f"| {V} ({who}) | {B} | {search} | {w}{mark} | {us:.2f} | {equal}/{B} |",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
