"""Time the slot-indexed codec engine's step, captured in a CUDA graph, per precision.

    PYTHONPATH=. python3 benchmarks/codec/bench_codec.py [--batches 1,8,64,256] [--chunks 1,4]
        [--precisions fp32,tf32,fp16,bf16] [--slots 256] [--out DIR]

GPU only. The real codec config with random weights (`random_codec_state`). For each
precision: the SNR of a 2 x 24-frame stream against the full fp32 decode (TF32 off), then for
each (batch, n): one graph of `CodecEngine.step` over `batch` slots spread over the slot table
(so the rows are not a contiguous block), checked against the same steps run eagerly (same
state, same codes: replay must equal eager), then timed (median of CUDA-event timed replays).
Prints a table (ms per step, streams x frames per second of audio-time, SNR) and writes
DIR/bench_codec.json (DIR: --out, else $OUT, else ./out).
Targets (issue 10): one-frame step <= 0.5 ms at batch 1, <= 1.5 ms at 64, <= 4 ms at 256;
SNR >= 45 dB.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from precision_probe import real_codec  # noqa: E402

from ttsbuild.runtime.codec_engine import (  # noqa: E402
    CodecEngine,
    capture_step,
    codec_snr_db,
    random_codes,
)

FRAME_S = 0.08  # audio seconds per frame


def spread_rows(batch: int, slots: int, device) -> torch.Tensor:
    """`batch` distinct slots spread over the table (a stride, not a block)."""
    stride = max(1, slots // batch)
    return (torch.arange(batch, device=device) * stride) % slots


def replay_equals_eager(engine: CodecEngine, rows, codes, steps: int = 3):
    """(max |graph - eager| / max |eager| over `steps` steps from one reset state, graph)."""
    static_codes = codes[0].clone()
    graph, pcm = capture_step(engine, rows, static_codes)
    engine.reset(rows)
    eager = [engine.step(rows, c).clone() for c in codes[:steps]]
    engine.reset(rows)
    worst = 0.0
    for c, e in zip(codes[:steps], eager, strict=True):
        static_codes.copy_(c)
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, ((pcm - e).abs().max() / e.abs().max().clamp(min=1e-12)).item())
    return worst, graph


def time_graph(graph: torch.cuda.CUDAGraph, replays: int = 50, repeats: int = 7) -> float:
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        e0.record()
        for _ in range(replays):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / replays)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--chunks", default="1,4")
    ap.add_argument("--precisions", default="fp32,tf32,fp16,bf16")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_codec.py needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(n) for n in args.chunks.split(",")]
    slots = max(args.slots, max(batches))
    dev = "cuda"
    torch.manual_seed(0)
    dec = real_codec(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; codec "
          f"{sum(p.numel() for p in dec.parameters()) / 1e6:.1f} M params, {slots} slots")
    results = []
    print("| precision | batch | n | graph ms/step | us per stream-frame | x real time "
          "| replay vs eager | SNR dB |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.precisions.split(","):
        engine = CodecEngine(dec, slots, p, dev, max_chunk=max(chunks))
        snr = codec_snr_db(engine, dec, random_codes(dec.config, 2, 24, seed=1))
        for b in batches:
            rows = spread_rows(b, slots, dev)
            for n in chunks:
                codes = [random_codes(dec.config, b, n, seed=10 + i).to(dev) for i in range(3)]
                diff, graph = replay_equals_eager(engine, rows, codes)
                ms = time_graph(graph)
                del graph
                rt = b * n * FRAME_S / (ms / 1e3)
                row = dict(precision=p, batch=b, n=n, ms=ms, us_per_stream_frame=ms * 1e3 / (b * n),
                           x_real_time=rt, replay_rel_diff=diff, snr_db=snr)
                results.append(row)
                print(f"| {p} | {b} | {n} | {ms:.3f} | {row['us_per_stream_frame']:.1f} "
                      f"| {rt:.0f} | {diff:.1e} | {snr:.1f} |", flush=True)
        del engine
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_codec.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "slots": slots,
         "results": results}, indent=1))
    bad = [r for r in results if r["replay_rel_diff"] > 1e-5]
    if bad:
        sys.exit(f"graph replay differs from eager: {bad}")


if __name__ == "__main__":
    main()
