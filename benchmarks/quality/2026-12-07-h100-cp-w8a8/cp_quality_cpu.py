"""Teacher-forced quality against the bf16 model (compile's gate measure: 4 texts x 32 frames,
the code predictor's unfused path in calls of 16 rows) of the FP8 choices, on the development
CPU (the references; the GPU's kernels agree with them: graph_vs_eager.py --cp-w8a8-only).

heads:  which part of an FP8 code predictor costs its quality (codebooks 1-15): its layers
        weight-only or W8A8, its heads FP8 weight-only, FP8 W8A8 or bf16;
talker: the talker's W8A8 in its decode steps (served from 16 rows; compile's gate decodes a
        few rows weight-only, so no gate measures it): codebook 0 with the talker's linears
        weight-only, then W8A8 from 1 row (per-row scales: the row count changes no value).

    python benchmarks/quality/2026-12-07-h100-cp-w8a8/cp_quality_cpu.py heads [tiny]
    python benchmarks/quality/2026-12-07-h100-cp-w8a8/cp_quality_cpu.py talker [tiny]
(1.7B, the default variant, on 2 CPU cores: ~5 min a configuration.)
"""

import sys
import time

import torch

from ttsbuild.build.compile import BuildConfig
from ttsbuild.build.quality import RuntimeLM, measure_quality, pack_models, teacher_forced_logits
from ttsbuild.calibration.corpus import generate_corpus, load_texts
from ttsbuild.runtime.engine import random_models
from ttsbuild.runtime.fast_model import Dense
from ttsbuild.runtime.plan import EnginePlan

mode = sys.argv[1] if len(sys.argv) > 1 else "heads"
variant = sys.argv[2] if len(sys.argv) > 2 else "1.7b-customvoice"
dev = "cuda" if torch.cuda.is_available() else "cpu"
t = time.time()
models = random_models(variant, device=dev, dtype=torch.bfloat16)
cfg = BuildConfig(fp8_code_predictor=True)
packed, sizes, _ = pack_models(models, cfg.fp8_groups(), torch.device(dev))
items = generate_corpus(models, load_texts(None, 4), seed=cfg.seed, max_frames=32)
ref = teacher_forced_logits(models, items)
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
bf16_heads = [h.weight.detach() for h in models.code_predictor.lm_head]


def runtime(talker_rows: int = 0, stack_rows: int = 0, heads: str = "fp8 wo") -> RuntimeLM:
    plan = EnginePlan(num_slots=16, batch_buckets=(16,), max_len=512, max_text=256,
                      prefill_buckets=(64, 128), codec_chunks=(1, 2), codec_ring=16,
                      precision="fp8", code_predictor_fp8=True, w8a8_min_rows=talker_rows,
                      cp_heads_fp8=heads != "bf16")
    rt = RuntimeLM.from_packed(models.cfg, {m: dict(v) for m, v in packed.items()}, sizes,
                               dtype, dev, heads != "bf16")
    cp = rt.code_predictor
    rt.talker.set_linear_paths(plan, cp.stack, cp.heads)
    cp.stack.set_w8a8_min_rows(stack_rows)
    if heads == "bf16":
        cp.heads[:] = [Dense(w.to(dtype)) for w in bf16_heads]
    for h in cp.heads:
        h.w8a8_min_rows = 1 if heads == "fp8 w8a8" else 0
    return rt


if mode == "heads":
    configs = [(0, "bf16"), (1, "bf16"), (1, "fp8 wo")] if variant != "tiny" else [
        (r, h) for r in (0, 1) for h in ("fp8 wo", "fp8 w8a8", "bf16")]
    runs = [(f"stack {'W8A8' if r else 'WO'}, heads {h}", dict(stack_rows=r, heads=h))
            for r, h in configs]
else:
    runs = [("weight-only everywhere", {}), ("talker W8A8 decode", dict(talker_rows=1))]
for name, kw in runs:
    r = measure_quality(models, runtime(**kw), items, {"unfused": 16}, reference_logits=ref)
    print(f"{name}: c0 top-1 {r.codebook0_top1_agreement:.4f} KL {r.codebook0_mean_kl:.5f}; "
          f"cb1-15 top-1 {r.code_predictor_top1_agreement:.4f} KL "
          f"{r.code_predictor_mean_kl:.5f} ({round(time.time() - t)} s)", flush=True)
