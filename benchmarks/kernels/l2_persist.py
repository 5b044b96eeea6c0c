"""Does an L2 set-aside for the code predictor's weights shorten its frame? (issue 9)

    PYTHONPATH=. python3 benchmarks/kernels/l2_persist.py [--batches 1,16] [--replays 40]

GPU only. The 1.7B CustomVoice code predictor (random FP8 weights, peaked stand-in), its
linears and heads copied into one allocation (`runtime.l2_persist.arena`), the served fused
frame (15 passes, sampling on) captured as graph_engine does. Each frame graph starts with a
1.4 GB read standing in for the talker step between frames (it evicts every normal line), so
the frame is timed as the engine runs it: t(read + frame) - t(read alone), medians of graph
replays, sides alternated over rounds. Sides:
  base     no set-aside, no window
  nodeS    set-aside of the device's maximum, the window on every kernel node of the graph
           (keep_graph capture), hitRatio S x set-aside / window (S = 1, 0.75, 0.5)
  normal   as node1 with missProp normal instead of streaming
  stream   the window set on the capture stream before capture: whether a capture records
           it is printed (the nodes' windows read back) beside its time
Prints the device's L2 size, largest set-aside and window; greedy codes of each side against
base (they must be equal: a cache policy changes no result; exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cp_fused import Frame  # noqa: E402

from ttsbuild.bench.engine_bench import _time_graph  # noqa: E402
from ttsbuild.convert.init_random import load_variant  # noqa: E402
from ttsbuild.model.config import ModelConfig  # noqa: E402
from ttsbuild.model.standin import peak_code_predictor  # noqa: E402
from ttsbuild.model.talker import CodePredictor  # noqa: E402
from ttsbuild.runtime import l2_persist as l2  # noqa: E402
from ttsbuild.runtime.cp_fused import FusedCodePredictor  # noqa: E402
from ttsbuild.runtime.fast_model import Dense, PackedStack  # noqa: E402

EVICT_BYTES = 1_400_000_000  # the 1.7B talker's FP8 weights, read once a frame


def build(cfg: ModelConfig) -> tuple[FusedCodePredictor, list[torch.Tensor]]:
    """The fused code predictor with its FP8 linears and heads in one allocation; the views."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        cp = CodePredictor(cfg)
    with torch.no_grad():
        for name, p in cp.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") \
                else p.normal_(0.0, 0.02)  # fmt: skip
        peak_code_predictor(cp, cfg)
        codec_embedding = torch.randn(cfg.codec_vocab_size, cfg.talker.hidden_size,
                                      device="cuda")  # fmt: skip
    cp = cp.to(torch.bfloat16)
    stack = PackedStack.from_module(cp.model, True)
    heads = [Dense.make(h.weight.detach(), True) for h in cp.lm_head]
    denses = [d for layer in stack.layers for d in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    denses += heads
    views = l2.arena([d.weight for d in denses])
    for d, v in zip(denses, views, strict=True):
        d.weight = v
    torch.cuda.empty_cache()
    embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
    fcp = FusedCodePredictor(stack, heads, cp.small_to_mtp_projection,
                             codec_embedding.to(torch.bfloat16), embeddings)  # fmt: skip
    return fcp, views


def capture(fn, stream: torch.cuda.Stream, keep: bool) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=keep) if keep else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    rt = l2.CudaRuntime()
    dev = torch.cuda.current_device()
    max_aside, max_window = rt.limits(dev)
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}  torch {torch.__version__}  L2 {props.L2_cache_size / 2**20:.1f}"
          f" MiB, largest set-aside {max_aside / 2**20:.1f} MiB, largest window "
          f"{max_window / 2**20:.1f} MiB")  # fmt: skip
    cfg = ModelConfig.from_official(load_variant("1.7b-customvoice")[0])
    fcp, views = build(cfg)
    _, span = l2.span(views)
    print(f"code predictor linears + heads: {span / 2**20:.1f} MiB in one window")
    evict = torch.empty(EVICT_BYTES // 4, dtype=torch.int32, device="cuda").fill_(1)
    sink = torch.zeros((), dtype=torch.int64, device="cuda")

    def read():
        sink.copy_(evict.sum(dtype=torch.int64))

    def side(frame, aside, share=1.0, miss=l2.STREAMING, on_stream=False) -> tuple:
        """(set-aside, graph of read + frame, graph of read alone, what was done)."""
        rt.reset_persisting()
        got = rt.set_aside(aside)
        stream = torch.cuda.Stream()
        w = l2.window_for(views, got, max_window, share, miss) if aside else None
        if on_stream and w is not None:
            rt.set_stream_window(stream, w)
        both = capture(lambda: (read(), frame()), stream, keep=w is not None)
        alone = capture(read, torch.cuda.Stream(), keep=False)
        note = ""
        if w is not None and on_stream:
            seen = rt.node_windows(both.raw_cuda_graph())
            kept = sum(1 for b, n, _ in seen if n == w.num_bytes and b == w.base)
            note = f"capture recorded the stream's window on {kept}/{len(seen)} kernel nodes"
        elif w is not None:
            n = rt.apply_to_graph(both, w)
            note = f"window on {n} kernel nodes, hitRatio {w.hit_ratio:.3f}"
        if w is not None:
            both.instantiate()
        return got, both, alone, note

    ok = True
    for B in [int(b) for b in args.batches.split(",")]:
        frame = Frame(fcp, B, "fused")
        frame.sampling.do_sample.fill_(False)
        sides = {"base": side(frame, 0)}
        ref = frame.codes.clone()
        tries = {f"node{s:g}": (max_aside, s) for s in (1.0, 0.75, 0.5)}
        tries["normal"] = (max_aside, 1.0, l2.NORMAL)
        tries["stream"] = (max_aside, 1.0, l2.STREAMING, True)
        for name, how in tries.items():
            try:
                sides[name] = side(frame, *how)
            except (RuntimeError, TypeError) as exc:  # a side the runtime refuses: said, skipped
                print(f"B={B} {name}: skipped: {exc}")
        for name, (got, both, _, note) in sides.items():
            rt.reset_persisting()
            rt.set_aside(got)
            both.replay()
            torch.cuda.synchronize()
            differ = int((frame.codes != ref).sum())
            ok &= differ == 0
            print(f"B={B} {name}: set-aside {got / 2**20:.1f} MiB; {note or '-'}; greedy codes "
                  f"differing from base {differ}/{ref.numel()}")  # fmt: skip
        frame.sampling.do_sample.fill_(True)
        times: dict[str, list[float]] = {k: [] for k in sides}
        alone_t: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for name, (got, both, alone, _) in sides.items():
                rt.reset_persisting()
                rt.set_aside(got)
                for _ in range(5):
                    both.replay()
                times[name].append(_time_graph(both, args.replays))
                alone_t[name].append(_time_graph(alone, args.replays))
        base = statistics.median(times["base"]) - statistics.median(alone_t["base"])
        print(f"B={B}: frame ms (read+frame minus read alone; medians over "
              f"{args.rounds} rounds of {args.replays} replays)")  # fmt: skip
        for name in sides:
            f = statistics.median(times[name]) - statistics.median(alone_t[name])
            print(f"  {name:8s} {f:7.3f}  ({base / f:5.2f}x base)  read alone "
                  f"{statistics.median(alone_t[name]):.3f}  rounds "
                  + " ".join(f"{t:.3f}" for t in times[name]))  # fmt: skip
        sides.clear()
        rt.reset_persisting()
        rt.set_aside(0)
    print(f"total {time.time() - t0:.0f} s; greedy codes {'equal' if ok else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
