"""Self-draft acceptance of the 1.7B CustomVoice code predictor's random stand-ins, on the CPU.

    PYTHONPATH=. python3 benchmarks/spec/acceptance_cpu.py [--batch 16] [--frames 4] [--window 3]

What speculation can win depends on acceptance, and acceptance on the weights: this counts it
for the two random code predictors the benchmarks use (fp32, the eager path of
`runtime.cp_spec` with its stats on, sampled codebooks at temperature 0.9 and top-k 50):
"flat" (bench_spec.py's: N(0, 0.02) weights as drawn) and "standin" (the engine's stand-ins:
heads at logit std 6, residual branches scaled down, `model.standin.peak_code_predictor`).
No GPU needed; ~1 min on two cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

from bench_cp_fused import Frame, build  # noqa: E402

from ttsbuild.convert.init_random import load_variant  # noqa: E402
from ttsbuild.generation.sampling import SamplingBatch  # noqa: E402
from ttsbuild.model.config import ModelConfig  # noqa: E402
from ttsbuild.runtime.cp_spec import SpeculativeCodePredictor  # noqa: E402


def sampled(B: int) -> SamplingBatch:
    return SamplingBatch(
        do_sample=torch.ones(B, dtype=torch.bool), temperature=torch.full((B,), 0.9),
        top_k=torch.full((B,), 50, dtype=torch.int64), top_p=torch.ones(B),
        repetition_penalty=torch.ones(B),
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--frames", type=int, default=4, help="frames per row (fresh seeds each)")
    ap.add_argument("--window", type=int, default=3)
    args = ap.parse_args()
    if min(args.batch, args.frames, args.window) < 1:
        ap.error("--batch, --frames and --window must be >= 1")
    config, _, _ = load_variant("1.7b-customvoice")
    cfg = ModelConfig.from_official(config)
    print(f"torch {torch.__version__}, CPU; batch {args.batch} x {args.frames} frames, "
          f"self draft, window {args.window}")
    for name in ("flat", "standin"):
        fcp = build(cfg, torch.float32, fp8=False, device="cpu", standin=name == "standin")
        spec = SpeculativeCodePredictor(fcp, args.batch, args.window, stats=True)
        frame = Frame(fcp, args.batch, "unfused", device="cpu")
        spec.reset_stats()
        with torch.no_grad():
            for f in range(args.frames):
                spec.frame(frame.hidden, frame.c0, sampled(args.batch),
                           frame.seeds + 1000 * f, frame.frames, "self", args.window)  # fmt: skip
        r = spec.report()
        acc = " ".join(f"{a:.2f}" for _, a in sorted(r["acceptance_per_depth"].items()))
        print(f"{name:8s} acceptance per drafted depth {acc}; passes per row-frame "
              f"{r['passes_per_row_frame']:.2f}, per batch-frame {r['passes_per_batch_frame']:.2f} "
              f"(15 without speculation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
