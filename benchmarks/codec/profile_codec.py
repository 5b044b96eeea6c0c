"""Where the codec step's GPU time goes: graph-replayed step times per cuDNN setting and conv
implementation, then the kernels of one eager step by total CUDA time.

    PYTHONPATH=. python3 benchmarks/codec/profile_codec.py [--batches 1,64] [--precision fp16]
        [--conv-impls cudnn,gemm,triton] [--cudnn-benchmark off,on] [--profile-batch 64]
        [--opt-in-kernels] [--channels-last] [--fused-output] [--profile-impls triton] [--top 25]

GPU only. The real codec config with random weights. For each conv implementation and
cudnn.benchmark off/on: the median graph-replay time of a one-frame step per batch, and the
graph's output against the cuDNN engine's eager step (relative max error). Then a
torch.profiler table of one eager step at --profile-batch for each implementation: kernels
grouped by name, total ms, calls, share.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_codec import spread_rows, time_graph  # noqa: E402
from precision_probe import real_codec  # noqa: E402

from ttsbuild.runtime.codec_engine import (  # noqa: E402
    CodecEngine,
    capture_step,
    codec_snr_db,
    random_codes,
)


def kernel_table(engine: CodecEngine, rows, codes, top: int, launches: str | None = None):
    """(top kernels as (name, ms, calls), total kernel ms, kernel count) of one eager step;
    with `launches` (a regex) each matching kernel's time is printed too, in launch order
    (which conv of which stage took what: the table sums them by name)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        engine.step(rows, codes)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step(rows, codes)
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    order = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:90]]
            a[0] += ev.time_range.elapsed_us() / 1e3
            a[1] += 1
            if launches and re.search(launches, ev.name):
                order.append((ev.time_range.start, ev.name[:40], ev.time_range.elapsed_us()))
    if order:
        order.sort()
        print(f"launches matching {launches!r}, in order (us): "
              + ", ".join(f"{i}:{name.strip('_')[:24]} {us:.1f}"
                          for i, (_, name, us) in enumerate(order)))
    rows_ = sorted(((k, v[0], v[1]) for k, v in agg.items()), key=lambda r: -r[1])
    return rows_[:top], sum(v[0] for v in agg.values()), sum(v[1] for v in agg.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--conv-impls", default="cudnn,gemm,triton")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cudnn-benchmark", default="off", help="off, on or off,on")
    ap.add_argument("--opt-in-kernels", action="store_true",
                    help="also time 'triton' with the opt-in fusions on (CodecEngine(fused=True): "
                         "overlap-add, ring attention, snake in the 1x1 convs; row 'triton+k')")
    ap.add_argument("--channels-last", action="store_true",
                    help="also time 'triton' (with the fusions when --opt-in-kernels) with the "
                         "convs' operands channels-last (CodecEngine(channels_last=True); rows "
                         "'triton+cl', 'triton+k+cl')")
    ap.add_argument("--fused-output", action="store_true",
                    help="also time the last of those rows with the output stage as one kernel "
                         "(CodecEngine(fused_output=True); row '...+o')")
    ap.add_argument("--fused-attention", action="store_true",
                    help="also time the last row before --fused-output with the pre-transformer's "
                         "attention steps as one kernel each (CodecEngine(fused_attention=True); "
                         "row '...+a', and '...+o+a' with --fused-output)")
    ap.add_argument("--state-channels-last", action="store_true",
                    help="also time the served row with its conv tails and spills stored along "
                         "channels (CodecEngine(state_channels_last=True); row '...+s')")
    ap.add_argument("--fused-only", action="store_true",
                    help="leave out the rows without the opt-in fusions ('+k')")
    ap.add_argument("--rows", default=None,
                    help="the rows to time, in place of the ones the flags above make: "
                         "comma-separated, each an implementation with its suffixes, e.g. "
                         "triton+k+cl,triton+k+cl+o+s+a")
    ap.add_argument("--fused-layers-max-rows", type=int, default=16,
                    help="rows with '+l': CodecEngine(fused_layers_max_rows=...), steps of at "
                         "most this many frames run the pre-transformer as fused_linear "
                         "launches (larger batches of the same row take the GEMMs)")
    ap.add_argument("--profile-impls", default=None,
                    help="implementations to profile (default: all of --conv-impls)")
    ap.add_argument("--launches", default=None,
                    help="a regex of kernel names whose every launch of the profiled step is "
                         "printed with its time, in order (e.g. 'conv|gemm|nvjet')")
    ap.add_argument("--nvtx-step", action="store_true",
                    help="after each row's timing, one eager step at --profile-batch rows "
                         "inside the NVTX range 'codec_step' (Nsight Compute: --nvtx "
                         "--nvtx-include codec_step/, gpu_session's codecncu)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_codec.py needs a CUDA GPU")
    dev = "cuda"
    torch.manual_seed(0)
    dec = real_codec(dev)
    batches = [int(b) for b in args.batches.split(",")]
    impls = args.conv_impls.split(",")
    if args.opt_in_kernels:
        impls.append("triton+k")
    if args.channels_last:
        impls += [i + "+cl" for i in impls if i.startswith("triton")]
    if args.fused_only:
        impls = [i for i in impls if "+k" in i]
    served = impls[-1]
    if args.fused_output:
        impls.append(served + "+o")
    if args.state_channels_last:
        impls.append(served + "+s")
    if args.fused_attention:
        impls.append(served + "+a")
        if args.fused_output:
            impls.append(served + "+o+a")
    if args.rows:
        impls = args.rows.split(",")
    slots = max(64, max(batches))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; precision {args.precision}")
    ref_engine = CodecEngine(dec, slots, args.precision, dev, max_chunk=4)
    print("| conv impl | cudnn.benchmark | batch | graph ms/step | rel err vs cudnn eager |")
    print("|---|---|---|---|---|")
    for impl in impls:
        engine = CodecEngine(dec, slots, args.precision, dev, max_chunk=4,
                             conv_impl=impl.split("+")[0], fused="+k" in impl,
                             channels_last="+cl" in impl, fused_output="+o" in impl,
                             fused_attention="+a" in impl, state_channels_last="+s" in impl,
                             fused_layers_max_rows=(args.fused_layers_max_rows
                                                    if "+l" in impl else 0))  # fmt: skip
        snr = codec_snr_db(engine, dec, random_codes(dec.config, 2, 24, seed=1))
        print(f"| {impl} | SNR vs fp32 decode: {snr:.1f} dB | | | |")
        for bench in [m == "on" for m in args.cudnn_benchmark.split(",")]:
            torch.backends.cudnn.benchmark = bench
            for b in batches:
                rows = spread_rows(b, slots, dev)
                codes = random_codes(dec.config, b, 1, seed=3).to(dev)
                static = codes.clone()  # the graph reads this buffer: keep it alive
                graph, pcm = capture_step(engine, rows, static)
                engine.reset(rows)
                ref_engine.reset(rows)
                graph.replay()
                want = ref_engine.step(rows, codes)
                torch.cuda.synchronize()
                err = ((pcm - want).abs().max() / want.abs().max()).item()
                ms = time_graph(graph)
                del graph, static
                print(f"| {impl} | {bench} | {b} | {ms:.3f} | {err:.1e} |", flush=True)
        if args.nvtx_step:  # the launches a profiler should catch, and only those
            rows = spread_rows(args.profile_batch, slots, dev)
            codes = random_codes(dec.config, args.profile_batch, 1, seed=4).to(dev)
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range("codec_step"):
                engine.step(rows, codes)
            torch.cuda.synchronize()
        if impl not in (args.profile_impls or args.conv_impls).split(","):
            del engine
            continue
        b = args.profile_batch
        rows = spread_rows(b, slots, dev)
        codes = random_codes(dec.config, b, 1, seed=4).to(dev)
        table, total, calls = kernel_table(engine, rows, codes, args.top, args.launches)
        print(f"\n{impl}, batch {b}, one eager step: {calls} kernels, {total:.3f} ms of kernel "
              "time")
        print("| kernel | ms | calls | share |\n|---|---|---|---|")
        for name, ms, n in table:
            print(f"| `{name}` | {ms:.3f} | {n} | {100 * ms / total:.1f}% |")
        print()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
