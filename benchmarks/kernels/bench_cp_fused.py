"""The code predictor's frame (15 passes): unfused kernels vs runtime.cp_fused (fused layer
kernels) vs the persistent pass (plugins.cp_pass: one launch per pass).

    PYTHONPATH=. python3 benchmarks/kernels/bench_cp_fused.py [--batches 1,8,32,64]
        [--paths unfused,fused,persistent,split8]

(splitN: `frame_split`, parts of N rows side by side on their own streams, parts of up to 8
rows on the fused path.)

GPU only. 1.7B CustomVoice code-predictor shapes (5 layers, hidden 1024, 16/8 heads x 128,
intermediate 3072, heads 1024 -> 2048, projection 2048 -> 1024), random weights. For each
batch and weight precision (bf16, FP8 weight-only) it captures one CUDA graph of the whole
frame per path, as graph_engine does, and prints ms per frame (median of graph replays,
sampling on) next to the weight-read floor, and the number of greedy codes that differ
--kernels adds a table of each fused linear alone (CUDA-graph replays, weights rotated past
the L2) with its per-shape plan and a few neighbouring configs, next to the plain linear, to
tune `plugins._tl.fused_linear.plan`.
Checks: with fp32 weights and activations every path must give the unfused greedy codes
(exit status 1 otherwise); in bf16 / FP8 near-ties can flip a code, so they are counted.
The first run compiles the Triton kernels (about a minute: one variant per mode, dtype and
batch bucket); later runs hit Triton's cache. --fp32-batches sets the batches of the fp32
check (fp32 kernels are compiled for them only).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

from ttsbuild.bench.engine_bench import _time_graph

# fp32 tl.dot defaults to TF32; the fp32 check needs IEEE products in both paths' kernels
# (the unfused decode_attention's too). Set before any kernel compiles.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from ttsbuild.convert.init_random import load_variant
from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.model.config import ModelConfig
from ttsbuild.model.standin import peak_code_predictor
from ttsbuild.model.talker import CodePredictor
from ttsbuild.runtime.cp_fused import FusedCodePredictor
from ttsbuild.runtime.fast_model import Dense, PackedStack
from ttsbuild.runtime.graph_engine import _capture

PEAK_BW = 4.0e12  # bytes/s, as bench_kernels.py
DEV = "cuda"


def build(cfg: ModelConfig, dtype: torch.dtype, fp8: bool, seed: int = 0,
          device: str = DEV, standin: bool = False) -> FusedCodePredictor:  # fmt: skip
    """Random weights (N(0, 0.02)); with `standin`, heads and residual branches then rescaled
    as the engine's stand-ins are (`model.standin.peak_code_predictor`: logit std 6)."""
    torch.manual_seed(seed)
    with torch.device(device):
        cp = CodePredictor(cfg)
    with torch.no_grad():
        for name, p in cp.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
        if standin:
            peak_code_predictor(cp, cfg)
        # codebook-0 input embeddings (the talker's table; random at talker width)
        codec_embedding = torch.randn(cfg.codec_vocab_size, cfg.talker.hidden_size, device=device)
    cp = cp.to(dtype)
    embeddings = torch.stack([e.weight.detach() for e in cp.model.codec_embedding])
    return FusedCodePredictor(
        PackedStack.from_module(cp.model, fp8),
        [Dense.make(h.weight.detach(), fp8) for h in cp.lm_head],
        cp.small_to_mtp_projection,
        codec_embedding.to(dtype),
        embeddings,
    )


class Frame:
    """Static buffers of one batch and the frame of one path over them."""

    def __init__(self, fcp: FusedCodePredictor, B: int, path: str, seed: int = 1,
                 device: str = DEV):  # fmt: skip
        c = fcp.stack.cfg
        G = fcp.num_code_groups
        dtype = fcp.embeddings.dtype
        g = torch.Generator(device=device).manual_seed(seed)
        self.fcp, self.path, self.B = fcp, path, B
        self.hidden = torch.randn(B, fcp.embeddings.shape[-1], device=device, generator=g).to(dtype)
        self.c0 = torch.randint(0, fcp.codec_embedding.shape[0], (B,), device=device, generator=g)
        self.seeds = torch.randint(0, 2**40, (B,), device=device, generator=g)
        self.frames = torch.zeros(B, dtype=torch.int64, device=device)
        self.sampling = SamplingBatch(
            do_sample=torch.zeros(B, dtype=torch.bool, device=device),
            temperature=torch.full((B,), 0.9, device=device),
            top_k=torch.full((B,), 50, dtype=torch.int64, device=device),
            top_p=torch.full((B,), 1.0, device=device),
            repetition_penalty=torch.ones(B, device=device),
        )
        shape = (c.num_layers, B, c.num_kv_heads, G, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = torch.arange(B, device=device)
        self.positions = [torch.full((B,), i, device=device) for i in range(G)]
        self.codes = torch.zeros(B, G, dtype=torch.int64, device=device)

    def __call__(self) -> None:
        if self.path.startswith("split"):  # splitN: parts of N rows, fused up to 8 rows
            run = functools.partial(self.fcp.frame_split, rows=int(self.path[5:]),
                                    fused=(1, 2, 4, 8))  # fmt: skip
        else:
            run = {"unfused": self.fcp.frame_unfused, "fused": self.fcp.frame,
                   "persistent": self.fcp.frame_persistent}[self.path]  # fmt: skip
        args = (self.hidden, self.c0, self.sampling, self.seeds, self.frames, self.k, self.v)
        self.codes.copy_(run(*args, self.slots, self.positions))

    def capture(self) -> torch.cuda.CUDAGraph:
        return _capture(self, None)  # warm-up runs, then the capture, as graph_engine does


def time_graph_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    for _ in range(3):  # warm-up replays
        graph.replay()
    return _time_graph(graph, replays)


def frame_bytes(fcp: FusedCodePredictor) -> int:
    head = fcp.heads[0].nbytes()
    proj = (
        0 if fcp.proj_weight is None else fcp.proj_weight.numel() * fcp.proj_weight.element_size()
    )
    G = fcp.num_code_groups
    # G passes through the stack (two for [h, E0(c0)]), G - 1 heads, G projections
    return G * fcp.stack.read_bytes() + (G - 1) * head + G * proj


# name: (K, N, mode) of the code predictor's fused linears; gate_up N = intermediate size
KERNEL_SHAPES = {
    "qkv (norm)": (1024, 4096, "norm"),
    "o (+res)": (2048, 1024, "residual"),
    "gate_up (norm,silu)": (1024, 3072, "gate_up"),
    "down (+res)": (3072, 1024, "residual"),
    "head (norm,f32)": (1024, 2048, "head"),
    "proj (gather,bias)": (2048, 1024, "gather"),
}


def _neighbours(plan: dict) -> list[dict]:
    out = [plan, {**plan, "SPLIT_K": max(1, plan["SPLIT_K"] // 2)}]
    out.append({**plan, "SPLIT_K": min(8, plan["SPLIT_K"] * 2)})
    wider = 32 if plan["BLOCK_M"] == 1 else 128
    out.append({**plan, "BLOCK_N": wider})
    unique = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


def bench_kernels(batches: list[int]) -> None:
    import math

    from bench_kernels import L2_DEFEAT_BYTES, graph_time_us

    from ttsbuild.plugins._tl.fused_linear import _num_sms, plan
    from ttsbuild.plugins.fp8_linear import quantize_weight_fp8
    from ttsbuild.plugins.fused_linear import fused_linear

    g = torch.Generator(device=DEV).manual_seed(0)
    sms = _num_sms(torch.device(DEV))
    print(f"{'kernel':20s} {'prec':4s} {'B':>3s} {'linear us':>9s} {'plan us':>8s}  plan"
          f"{'':28s} {'best us':>8s}  best")  # fmt: skip
    for name, (K, N, mode) in KERNEL_SHAPES.items():
        rows = 2 * N if mode == "gate_up" else N
        for prec in ("bf16", "fp8"):
            w0 = (torch.randn(rows, K, device=DEV, generator=g) * K**-0.5).bfloat16()
            copies = max(2, math.ceil(L2_DEFEAT_BYTES / w0.numel() / w0.element_size()))
            ws = [w0.roll(i, 0) for i in range(copies)]  # distinct memory, same values
            ws = [quantize_weight_fp8(w) if prec == "fp8" else (w, None) for w in ws]
            for B in batches:
                x = torch.randn(B, K, device=DEV, generator=g).bfloat16()
                kw = {}
                if mode in ("norm", "gate_up", "head"):
                    kw = dict(norm_weight=torch.ones(K, device=DEV).bfloat16(), eps=1e-6)
                    kw["gate_up"] = mode == "gate_up"
                    if mode == "head":
                        kw["out_dtype"] = torch.float32
                elif mode == "residual":
                    kw = dict(residual=torch.randn(B, N, device=DEV).bfloat16())
                else:
                    x = torch.randn(100, K, device=DEV, generator=g).bfloat16()
                    kw = dict(index=torch.randint(0, 100, (B,), device=DEV, generator=g),
                              bias=torch.randn(N, device=DEV).bfloat16())  # fmt: skip
                xin = torch.randn(B, K, device=DEV, generator=g).bfloat16()
                # the plain linear: cuBLAS for bf16, the unfused fp8_linear kernel for FP8
                linear = [lambda d=Dense(w, sc), xin=xin: d(xin) for w, sc in ws]
                base = graph_time_us(linear)
                p = plan(B, N, K, mode == "gate_up", sms)
                timed = []
                for cfg in _neighbours(p):
                    calls = [
                        lambda w=w, sc=sc, x=x, kw=kw, cfg=cfg: fused_linear(
                            x, w, sc, config=cfg, **kw
                        )
                        for w, sc in ws
                    ]
                    timed.append((graph_time_us(calls), cfg))
                best = min(timed, key=lambda t: t[0])

                def fmt(c):
                    return f"M{c['BLOCK_M']} N{c['BLOCK_N']} K{c['BLOCK_K']} S{c['SPLIT_K']}"

                print(f"{name:20s} {prec:4s} {B:3d} {base:9.2f} {timed[0][0]:8.2f}  "
                      f"{fmt(p):32s} {best[0]:8.2f}  {fmt(best[1])}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--fp32-batches", default="1,64", help="batches of the fp32 code check")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--paths", default="unfused,fused,persistent",
                    help="frames to compare, the first is the reference")
    ap.add_argument("--kernels", action="store_true", help="also time each fused linear alone")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    cfg = ModelConfig.from_official(load_variant("1.7b-customvoice")[0])
    batches = [int(b) for b in args.batches.split(",")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = True

    paths = args.paths.split(",")
    # fp32 check: every path gives the unfused path's greedy codes (exit status), no timing
    fcp32 = build(cfg, torch.float32, fp8=False)
    fcp32.enable_persistent(max(batches + [int(b) for b in args.fp32_batches.split(",") if b]))
    for B in [int(b) for b in args.fp32_batches.split(",") if b]:
        ref = Frame(fcp32, B, "unfused")
        ref()
        for path in paths[1:]:
            f = Frame(fcp32, B, path)
            f()
            diff = int((ref.codes != f.codes).sum())
            ok &= diff == 0
            print(f"fp32 B={B:3d} {path}: greedy codes differing from unfused "
                  f"{diff}/{ref.codes.numel()}")  # fmt: skip
    del fcp32
    torch.cuda.empty_cache()

    header = f"{'prec':5s} {'B':>3s} " + " ".join(f"{p + ' ms':>14s}" for p in paths)
    header += f" {'speedup':>8s} {'floor ms':>9s} {'best %bw':>9s} {'codes!=':>8s}"
    print(header)
    for prec in args.precisions.split(","):
        fcp = build(cfg, torch.bfloat16, fp8=prec == "fp8")
        fcp.enable_persistent(max(batches))
        floor_ms = frame_bytes(fcp) / PEAK_BW * 1e3
        for B in batches:
            frames = [Frame(fcp, B, p) for p in paths]
            graphs = [f.capture() for f in frames]
            for g in graphs:
                g.replay()
            torch.cuda.synchronize()
            differ = max(int((frames[0].codes != f.codes).sum()) for f in frames)  # near-ties
            for f in frames:
                f.sampling.do_sample.fill_(True)  # timing with sampling on, as served
            ms = [time_graph_ms(g, args.replays) for g in graphs]
            best = min(ms)
            print(
                f"{prec:5s} {B:3d} " + " ".join(f"{m:14.3f}" for m in ms)
                + f" {ms[0] / best:7.2f}x {floor_ms:9.3f} {100 * floor_ms / best:8.1f}% "
                f"{differ:4d}/{frames[0].codes.numel()}"
            )
            del graphs
        del fcp
        torch.cuda.empty_cache()
    if args.kernels:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        bench_kernels(batches)
    print(f"total {time.time() - t0:.0f} s; fp32 greedy codes {'equal' if ok else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
