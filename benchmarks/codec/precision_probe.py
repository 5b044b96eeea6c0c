"""Per-stage precision probe of the codec engine (CPU or GPU): which stages lose the most.

    PYTHONPATH=. python3 benchmarks/codec/precision_probe.py [--frames 4] [--rows 1]
        [--precisions fp16,bf16] [--device cpu] [--threads 2]

The real codec config with random weights (`random_codec_state`), random codes. For each
precision P it prints the SNR against the full fp32 decode of:
  all       every stage in P except the default fp32 stages, of which the default TF32
            stages use TF32 matmuls (what the engine runs)
  all, transformer strict fp32   the same with no TF32 stage (the engine before 2026-12-01)
  all+out   every stage in P, the output stage too
  only S    stage S alone in P, every other stage in fp32 (the loss S is responsible for)
With --fused-layers, two more rows per precision, streamed a frame a step (the served
batch-1 step: the pre-transformer as fused GEMV layers, fused_layers_max_rows 8, which read
fp32 weights with fp32 FMAs on the GPU, so here no TF32 stage: CPU emulation would round the
weights to TF32, which fp16 holds exactly):
  all, fused layers              as "all", the fused layers' fp32 weights
  all, fused layers, fp16 tr. weights   their weights in scaled fp16 (transformer_half_weights)
  all, fused layers, fp16 rings  the attention's key/value rings in fp16 (ring_half; not at
                                 fp32, which keeps its rings strict)
On CPU, fp16/bf16 run natively and TF32 is emulated by rounding (see runtime.codec_engine).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from ttsbuild.model.codec import CodecConfig, CodecDecoder, random_codec_state
from ttsbuild.runtime.codec_engine import (
    CodecEngine,
    _tf32_mode,
    decode_with,
    random_codes,
    snr_db,
    stage_names,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL = ROOT / "ttsbuild/convert/variants/speech_tokenizer-12hz.json"


def real_codec(device: str) -> CodecDecoder:
    cfg = CodecConfig.from_official(json.loads(REAL.read_text()))
    with torch.device("meta"):
        dec = CodecDecoder(cfg)
    dec.load_state_dict(random_codec_state(cfg, seed=0), assign=True)
    return dec.to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--precisions", default="fp16,bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fused-layers", action="store_true",
                    help="also the fused pre-transformer layers, fp32 and fp16 weights")
    ap.add_argument("--only-fused", action="store_true",
                    help="only the --fused-layers rows (and 'all')")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dec = real_codec(args.device)
    codes = random_codes(dec.config, args.rows, args.frames, seed=1)
    with _tf32_mode(False):
        ref = decode_with(dec, codes)
    stages = stage_names(dec)
    print(f"codec probe: {args.rows} x {args.frames} frames, device {args.device}")
    print("| precision | variant | SNR dB | s |\n|---|---|---|---|")
    for p in args.precisions.split(","):
        # name -> (fp32 stages or None: the default, TF32 stages or None: the default)
        variants = {"all": (None, None), "all, transformer strict fp32": (None, ()),
                    "all+out": ((), ())}
        variants.update({f"only {s}": (tuple(x for x in stages if x != s), ()) for s in stages})
        if args.only_fused:
            variants = {"all": (None, None)}
        for name, (fp32, tf32) in variants.items():
            t = time.time()
            kw = {} if fp32 is None else {"fp32_stages": fp32}
            if tf32 is not None:
                kw["tf32_stages"] = tf32
            eng = CodecEngine(dec, args.rows, p, **kw)
            snr = snr_db(ref, decode_with(eng, codes))
            print(f"| {p} | {name} | {snr:.1f} | {time.time() - t:.0f} |", flush=True)
        if args.fused_layers or args.only_fused:
            for name, half, ring in (("all, fused layers", False, False),
                                     ("all, fused layers, fp16 tr. weights", True, False),
                                     ("all, fused layers, fp16 rings", False, True)):
                if ring and p == "fp32":
                    continue
                t = time.time()
                eng = CodecEngine(dec, args.rows, p, conv_impl="triton", fused=True,
                                  fused_attention=True, fused_layers_max_rows=8,
                                  tf32_stages=(), transformer_half_weights=half,
                                  ring_half=ring)  # fmt: skip
                assert eng.fused_layers_max_rows >= args.rows and bool(eng._tr_half) == half
                assert eng.ring_half == ring
                snr = snr_db(ref, decode_with(eng, codes, chunk=1))
                print(f"| {p} | {name} | {snr:.1f} | {time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
