"""The FP8 quality gate on one model, for the engine as compiled and for deliberately broken
ones: does the gate pass what is right and refuse what is wrong?

The gate of `ttsbuild compile` (`build.quality`: the runtime's kernels on the packed FP8
weights against the eager bf16 model, teacher forced) is run on
  correct              the talker's FP8 layers as `compile` quantises them;
  L.<linear> x4        one packed linear (qkv, o, gate_up, down) of layer L with its
                       per-channel weight_scale multiplied by 4 (layers first, middle, last);
  L.down ch0 zeroed    one output channel of layer L's down projection zeroed (scale 0);
with --kv-fp8 also
  FP8 KV cache         the correct engine with the talker's cache in FP8 (plan talker_kv_fp8),
                       its k/v scales measured as a calibration takes them (measure_kv_scales);
  FP8 KV, k / 16       the same with every k scale 16x too small (most keys clamped);
  FP8 KV, v / 16       the same for the v scales (a scale too large costs only precision:
                       the cache is written and read with the same one).
Prints a table and writes gate_sensitivity.json to --out.

    python benchmarks/quality/gate_sensitivity.py CKPT --out out        # a converted checkpoint
    python benchmarks/quality/gate_sensitivity.py --random 1.7b-customvoice --flat --only-correct
    python benchmarks/quality/gate_sensitivity.py CKPT --only-correct --kv-fp8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ttsbuild.build.compile import BuildConfig, code_predictor_paths, talker_decode_paths
from ttsbuild.build.quality import RuntimeLM, measure_quality, pack_models, teacher_forced_logits
from ttsbuild.calibration.corpus import generate_corpus, load_texts

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def load(args, device):
    from ttsbuild.runtime.engine import Models, random_models

    dtype = {"fp32": torch.float32, "bf16": None}[args.reference]
    if args.random:  # bf16 weights, as a checkpoint stores them
        models = random_models(args.random, device=device, dtype=torch.bfloat16,
                               peaked=not args.flat)
        if args.gain is not None:
            from ttsbuild.model.standin import peak_logits

            peak_logits(models, residual_gain=args.gain)
        if dtype is not None:
            models.talker.to(dtype), models.code_predictor.to(dtype)
        return models
    from ttsbuild.convert.checkpoint import load_checkpoint

    return Models.load(load_checkpoint(args.checkpoint), device=device, dtype=dtype)


def variants(num_layers: int, only_correct: bool, kv_fp8: bool):
    """(name, what breaks the packed tensors or None for bf16 weights, the talker's FP8 KV
    cache scales from the measured ones or None for a bf16 cache)."""
    yield "correct", lambda packed: None, None
    yield "bf16 weights", None, None  # no FP8 at all: the kernels' and bf16's own share
    if kv_fp8:
        yield "FP8 KV cache", lambda packed: None, lambda scales: scales
        yield "FP8 KV, k / 16", lambda packed: None, lambda scales: [(k / 16, v)
                                                                     for k, v in scales]
        yield "FP8 KV, v / 16", lambda packed: None, lambda scales: [(k, v / 16)
                                                                     for k, v in scales]
    if only_correct:
        return
    for layer in sorted({0, num_layers // 2, num_layers - 1}):
        for lin in LINEARS:
            name = f"model.layers.{layer}.{lin}.weight_scale"

            def times4(packed, name=name):
                packed["talker"][name] = packed["talker"][name] * 4

            yield f"{layer}.{lin.split('.')[1]} x4", times4, None
    mid = num_layers // 2
    name = f"model.layers.{mid}.mlp.down_proj.weight_scale"

    def zero_channel(packed, name=name):
        packed["talker"][name] = packed["talker"][name].clone()
        packed["talker"][name][0] = 0

    yield f"{mid}.down ch0 zeroed", zero_channel, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--random", help="in-memory random stand-in of this variant instead")
    ap.add_argument("--flat", action="store_true", help="with --random: not peaked")
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--only-correct", action="store_true")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="also the talker's FP8 KV cache, with its scales and broken ones")
    ap.add_argument("--reference", choices=("bf16", "fp32"), default="bf16",
                    help="the reference's compute dtype on a GPU (compile: bf16)")
    ap.add_argument("--gain", type=float, help="with --random: this residual gain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.checkpoint and not args.random:
        ap.error("give a checkpoint or --random VARIANT")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = BuildConfig()
    t0 = time.perf_counter()
    ref = load(args, device)
    base, sizes, unquantised = pack_models(ref, cfg.fp8_groups(), device)
    items = generate_corpus(ref, load_texts(None, args.texts), seed=cfg.seed,
                            max_frames=args.frames)
    ref_logits = teacher_forced_logits(ref, items)
    plan = cfg.runtime_plan()
    paths = code_predictor_paths(plan)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the runtime's
    print(f"model ready in {time.perf_counter() - t0:.1f} s: {args.checkpoint or args.random}"
          f"{' (flat)' if args.flat else ''}{f', gain {args.gain}' if args.gain else ''}, "
          f"reference {args.reference}, {len(items)} texts, "
          f"{sum(int(i.codes.shape[0]) for i in items)} frames, cp paths {paths}", flush=True)
    kv_scales = None
    if args.kv_fp8:
        from ttsbuild.calibration.calibrate import kv_scales_range, measure_kv_scales

        # calibration texts apart from the gate's corpus, as `ttsbuild calibrate` takes them
        kv_scales = measure_kv_scales(ref, load_texts(None, args.texts + 4)[args.texts:],
                                      max_frames=args.frames)  # fmt: skip
        print(f"k/v scales measured: {kv_scales_range(kv_scales)}", flush=True)
    rows = []
    print("| engine | c0 top-1 | c0 mean KL | cb1-15 top-1 | cb1-15 mean KL | gate |")
    print("|---|---|---|---|---|---|")
    for name, breaks, kv in variants(ref.cfg.talker.num_layers, args.only_correct, args.kv_fp8):
        packed = {m: dict(t) for m, t in (base if breaks else unquantised).items()}
        if breaks:
            breaks(packed)
        t = time.perf_counter()
        runtime = RuntimeLM.from_packed(ref.cfg, packed, sizes, dtype, device,
                                        plan.cp_heads_are_fp8)
        # the linears by rows as the plan serves them, as compile's gate runs them (until
        # 2026-12-04 this script ran every FP8 linear weight-only)
        runtime.talker.set_linear_paths(plan, runtime.code_predictor.stack,
                                        runtime.code_predictor.heads)  # fmt: skip
        if kv is not None:
            runtime.kv_fp8, runtime.talker.kv_scales = True, kv(kv_scales)
        r = measure_quality(ref, runtime, items, paths, reference_logits=ref_logits,
                            talker_paths=talker_decode_paths(plan))
        rows.append({"engine": name, "seconds": round(time.perf_counter() - t, 2),
                     **r.to_dict()})
        print(f"| {name} | {r.codebook0_top1_agreement:.4f} | {r.codebook0_mean_kl:.5f} | "
              f"{r.code_predictor_top1_agreement:.4f} | {r.code_predictor_mean_kl:.5f} | "
              f"{'pass' if r.passed else 'FAIL'} |", flush=True)
    s = rows[0]["reference_sharpness"]
    for group, v in s.items():
        print(f"reference {group}: mean top-1 prob {v['mean_top1_prob']:.3f}, entropy "
              f"{v['mean_entropy_nats']:.2f} nats, top-1 prob p10/p50/p90 "
              f"{v['top1_prob_p10_p50_p90']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "gate_sensitivity" + (f"_{args.random}{'_flat' if args.flat else ''}"
                                     if args.random else "") + f"_{args.reference}"
        if args.gain is not None:
            name += f"_gain{args.gain}"
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
