"""What exact-match verification would cost speculation: self-draft acceptance per drafted
depth under the standard rule (accept with min(1, p/q): expected acceptance sum_v min(p, q))
against drafts that must equal the target's own draw, where the draft proposes
argmax(log q + g) with the noise g of the target's draw argmax(log p + g) (shared Gumbel
noise; accept iff equal). The second keeps a request's sampled codes those of the plain
sampler whatever bucket its frames run in; the first does not (a frame drawn speculatively
has the target's distribution but not the plain sampler's sample).

    PYTHONPATH=. python3 benchmarks/spec/coupled_acceptance.py [--variant 1.7b-customvoice]
        [--peaked] [--texts 8] [--frames 12] [--draws 64]

Frames come from the target itself (`build.distill.record_frames`: the talker's hidden
states and sampled codes of Harvard sentences, the code predictor teacher-forced on them),
at the checkpoint's sampling settings (temperature 0.9, top-k 50). CPU; the 1.7B stand-in
takes ~3 min and ~8 GB.
"""

from __future__ import annotations

import argparse
import time

import torch

from ttsbuild.bench.schedule import load_prompts
from ttsbuild.build.distill import (
    DistillConfig,
    _sampling,
    draft_logits,
    record_frames,
    teacher_force,
)
from ttsbuild.runtime.cp_spec import target_probs
from ttsbuild.runtime.engine import random_models


def coupled_match(p: torch.Tensor, q: torch.Tensor, draws: int, gen: torch.Generator) -> float:
    """P(argmax(log p + g) == argmax(log q + g)) over shared Gumbel noise g, Monte Carlo."""
    neg = torch.tensor(-float("inf"))
    lp = torch.where(p > 0, p.clamp_min(1e-30).log(), neg)
    lq = torch.where(q > 0, q.clamp_min(1e-30).log(), neg)
    hits = 0.0
    for _ in range(draws):
        u = torch.rand(lp.shape, generator=gen).clamp(1e-12, 1 - 1e-7)
        g = -torch.log(-torch.log(u))
        hits += ((lp + g).argmax(-1) == (lq + g).argmax(-1)).float().mean().item()
    return hits / draws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="1.7b-customvoice")
    ap.add_argument("--peaked", action="store_true", help="the engine's peaked stand-in")
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--window", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    start = time.time()
    models = random_models(a.variant, device="cpu", peaked=a.peaked)
    data = record_frames(models, load_prompts("harvard")[: a.texts],
                         DistillConfig(num_texts=a.texts, max_frames=a.frames))  # fmt: skip
    h, logits = teacher_force(models, data, "cpu")
    n = h.shape[0]
    p = target_probs(logits, _sampling(models, n, "cpu"))
    heads = torch.stack([hd.weight.detach().float() for hd in models.code_predictor.lm_head])
    print(f"{a.variant} ({'peaked' if a.peaked else 'flat'}), torch {torch.__version__}: "
          f"{n} frames in {time.time() - start:.0f} s; self draft")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for t in range(1, a.window + 1):
        q = target_probs(draft_logits(heads, h, t), _sampling(models, n, "cpu"))
        standard = torch.minimum(p[:, t:], q).sum(-1).mean().item()
        exact = coupled_match(p[:, t:], q, a.draws, gen)
        print(f"  depth {t}: standard (sum min(p, q)) {standard:.3f}, exact match with shared "
              f"noise {exact:.3f} ({exact / standard:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
