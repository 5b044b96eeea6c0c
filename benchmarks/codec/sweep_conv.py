"""Tile configurations of the codec's implicit-GEMM conv (plugins.causal_conv) at the shapes a
one-frame codec step runs, channels-last operands (what is served), on the GPU.

    PYTHONPATH=. python3 benchmarks/codec/sweep_conv.py [--batches 64,256] [--quick]
        [--kinds k7,k7s,k7s128,k7stma,1x1next,1x1s,1x1,unit,tconv]

For each decoder stage (channels C, n samples per frame) and kind (--kinds: k7, the dilated
k = 7 conv with a bias; k7s, the same with a SnakeBeta in its epilogue, out_alpha; k7s128,
that with its registers capped at 128 a thread (maxnreg); k7stma, k7s on the TMA kernel
(causal_conv.CONV_TMA; its own grid, `tma_grid`); 1x1next, the 1x1 conv + snake_context
of its output against the conv writing that SnakeBeta itself + context_fill
(NEXT_ACT_FOLD); 1x1s, the residual unit's 1x1 conv
with SnakeBeta in its input load and the residual added; 1x1, the same without the
SnakeBeta, as it runs once k7s took it; unit, the whole residual unit after its first
SnakeBeta as one launch, `residual_unit`, at the stages of C <= 192, its grid (BLOCK_M,
BLOCK_CI, warps, stages) and, on a line below, the k7s + 1x1 launches it replaces, each at
its served config; tconv, the block's transposed conv as a k = 2 conv over its input
(TCONV_CONV) and, below, the GEMM + overlap-add it replaces), at each batch: the served
configuration (as the engine calls it: `_config`'s tile, 3 stages, for k7s the register
cap and flat K steps the kernel adds, and at batches of up to the engine's
CONV_SPLIT_MAX_STREAMS its split over K) and every config of the grid (BLOCK_M, BLOCK_CI,
BLOCK_O, warps, stages; at those batches 16- and 32-row tiles too, with the engine's split
count, then the best tile at each split count of `SPLITS`, a sixth field where one wins),
each timed as a CUDA graph of 20 launches (median of 5 runs of 5 replays), its output
checked against the served config's (a config that disagrees is reported, never chosen).
Prints one table row per shape: served ms and TFLOP/s, the best config, its ms and TFLOP/s.
GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_codec import time_graph  # noqa: E402

from ttsbuild.plugins._tl.fp8_linear import _num_sms  # noqa: E402
from ttsbuild.plugins.causal_conv import (  # noqa: E402
    _causal_conv_triton,
    _config,
    _few_tile,
    _tma_config,
    causal_conv,
)
from ttsbuild.plugins.codec_context import to_channels_last  # noqa: E402
from ttsbuild.runtime.codec_engine import CONV_SPLIT_MAX_STREAMS  # noqa: E402

KINDS = {"k7": "k7 d3", "k7s": "k7 d3 +out snake", "k7s128": "k7 d3 +out snake, maxnreg 128",
         "k7stma": "k7 d3 +out snake, TMA kernel (CONV_TMA)",
         "1x1next": "1x1 res + the next unit's act1 (NEXT_ACT_FOLD)",
         "1x1s": "1x1 snake+res", "1x1": "1x1 res", "unit": "unit (k7 d3, snake, 1x1, res)",
         "tconv": "block's transposed conv as k2 (TCONV_CONV)"}
# (C, n per frame) of the 12 Hz codec's decoder blocks (upsample rates 8, 5, 4, 3 after the
# 4 latent steps per frame); the dilated convs take dilations 1, 3, 9 (context 6, 18, 54)
STAGES = ((768, 32), (384, 160), (192, 640), (96, 1920))
RATES = {768: 8, 384: 5, 192: 4, 96: 3}  # each block's transposed conv: 2C -> C, kernel 2r


def grid(quick: bool, few_rows: bool = False):
    """(BLOCK_M, BLOCK_CI, BLOCK_O, warps, stages); few_rows (steps of at most
    CONV_SPLIT_MAX_STREAMS streams, whose convs the engine splits over K): 16- and 32-row
    tiles and 32-wide output blocks too; with quick, 24 of them (64-channel K steps, rows and
    outputs <= 64: a few-stream conv's M is 32-1920 a stream, and each config is a compile)."""
    if few_rows and quick:
        yield from itertools.product((16, 32, 64), (64,), (32, 64), (4, 8), (3, 4))
        return
    rows = (16, 32, 64, 128) if few_rows else (64, 128, 256)
    outs = (32, 64, 128) if few_rows else (64, 128)
    tiles = itertools.product(rows, (32, 64), outs, (4, 8), (2, 3, 4))
    for bm, bci, bo, warps, stages in tiles:
        if bm * bo >= 128 * 128 and warps == 4:
            continue  # a 128 x 128 (or larger) accumulator in one warpgroup spills
        if quick and (stages == 2 or bm == 256):
            continue
        yield bm, bci, bo, warps, stages


def sweep_next_act(B: int, C: int, n: int, dev, dt) -> None:
    """NEXT_ACT_FOLD's trade at a stage: the 1x1 conv + snake_context of its output (the next
    unit's act1 with a context of 18, dilation 3) against the 1x1 conv writing that SnakeBeta
    beside its output (next_act) + context_fill, each as served; outputs checked equal."""
    from ttsbuild.plugins.codec_context import context_fill, snake_context

    ctx, S = 18, B + 1
    h = to_channels_last(torch.randn(B, C, n, device=dev, dtype=dt))
    w = (torch.randn(1, C, C, device=dev) / C ** 0.5).to(dt)
    bias = torch.randn(C, device=dev, dtype=dt)
    res = to_channels_last(torch.randn(B, C, n, device=dev, dtype=dt))
    alpha = torch.rand(C, 1, device=dev) + 0.5
    inv_beta = torch.rand(C, 1, device=dev) + 0.5
    tail = torch.randn(S, ctx, C, device=dev, dtype=dt).transpose(1, 2)
    rows = torch.arange(B, device=dev)
    buf = torch.empty((B, ctx + n, C), device=dev, dtype=dt).transpose(1, 2)

    def before():
        y = causal_conv(h, w, bias, 1, res, channels_last=True)
        return snake_context(y, alpha, inv_beta, tail, rows, channels_last=True)

    def after():
        causal_conv(h, w, bias, 1, res, channels_last=True,
                    next_act=(alpha, inv_beta, buf[..., ctx:]))
        return context_fill(buf, tail, rows)

    t0 = tail.clone()
    want = before().float()
    tail.copy_(t0)
    err = ((after().float() - want).abs().max() / want.abs().max()).item()
    tail.copy_(t0)
    b_ms, a_ms = time_call(before), time_call(after)
    print(f"| {C} | {n} | {KINDS['1x1next']} | {B} | 1x1 + snake_context | {b_ms:.4f} | | "
          f"next_act + context_fill | {a_ms:.4f} | rel. diff {err:.1e} |", flush=True)


def tma_grid(quick: bool):
    """(BLOCK_M, BLOCK_CI, BLOCK_O, warps, stages) of the TMA kernel: 64-row tiles on one
    warpgroup, 128-row ones on two (a wgmma tile is 64 rows a warpgroup); 32-wide output
    blocks too (C = 96 as three, none masked)."""
    tiles = itertools.product((64, 128), (32, 64), (32, 64, 128), (4, 8), (3, 4))
    for bm, bci, bo, warps, stages in tiles:
        if (bm == 64) != (warps == 4) or (quick and bci == 32 and stages == 3):
            continue
        yield bm, bci, bo, warps, stages


def unit_grid(quick: bool, C: int):
    """(BLOCK_M, BLOCK_CI, warps, stages) of the fused unit; 256-channel blocks on 8 warps
    (4 spill), 128 on either."""
    for bm, bci, warps, stages in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3, 4)):
        if (C > 128 and warps == 4) or (quick and stages == 2):
            continue
        yield bm, bci, warps, stages


def sweep_unit(B: int, C: int, n: int, quick: bool, dev, dt) -> None:
    """The fused residual unit's row (see the module docstring), and the two launches'."""
    from ttsbuild.plugins.causal_conv import _residual_unit_triton, residual_unit

    d = 3
    xin = to_channels_last(torch.randn(B, C, 6 * d + n, device=dev, dtype=dt))
    w7 = (torch.randn(7, C, C, device=dev) / (7 * C) ** 0.5).to(dt)
    w1 = (torch.randn(1, C, C, device=dev) / C**0.5).to(dt)
    b7, b1 = (torch.randn(C, device=dev, dtype=dt) for _ in range(2))
    alpha, inv_beta = torch.rand(C, 1, device=dev) + 0.5, torch.rand(C, 1, device=dev) + 0.5
    res = to_channels_last(torch.randn(B, C, n, device=dev, dtype=dt))

    def run(cfg):
        return _residual_unit_triton(xin, w7, b7, d, alpha, inv_beta, w1, b1, res, True, cfg)

    def two():
        h = _causal_conv_triton(xin, w7, b7, d, None, None, None, True,
                                out_alpha=alpha, out_inv_beta=inv_beta)
        return _causal_conv_triton(h, w1, b1, 1, res, None, None, True)

    want = two().float()
    flop = 2.0 * B * n * C * C * 8
    served_ms = time_call(lambda: residual_unit(xin, w7, b7, d, alpha, inv_beta, w1, b1, res,
                                                channels_last=True))
    best, best_ms, bad = best_config(run, want, unit_grid(quick, C), "served", served_ms)
    print(f"| {C} | {n} | {KINDS['unit']} | {B} | served | {served_ms:.4f} | "
          f"{flop / served_ms / 1e9:.0f} | {best} | {best_ms:.4f} | "
          f"{flop / best_ms / 1e9:.0f} |", flush=True)
    two_ms = time_call(two)
    print(f"  the two launches it replaces (k7s + 1x1, served configs): {two_ms:.4f} ms")
    for line in bad[:5]:
        print(f"  skipped {line}")


def sweep_tconv(B: int, C: int, n: int, quick: bool, dev, dt) -> None:
    """The block's transposed conv (2C -> C, kernel 2r, stride r) as TCONV_CONV runs it: a
    k = 2 causal conv over its n / r input frames (one frame of context) with r x C output
    channels; its row, and on a line below the GEMM + overlap-add it replaces."""
    from ttsbuild.plugins.causal_conv import overlap_add, pack_tconv_as_conv

    r = RATES[C]
    cin, m = 2 * C, n // r
    weight = (torch.randn(cin, C, 2 * r, device=dev) / (2 * cin) ** 0.5).to(dt)
    bias = torch.randn(C, device=dev, dtype=dt)
    w, b = pack_tconv_as_conv(weight, bias, r)
    xin = to_channels_last(torch.randn(B, cin, 1 + m, device=dev, dtype=dt))
    xin[..., 0] = 0  # a new stream's context, as the GEMM path's zero spill below

    def run(cfg):
        return _causal_conv_triton(xin, w, b, 1, None, None, None, True, cfg)

    served = (*_config(B * m, cin, r * C, 2, in_snake=False, sms=_num_sms(xin.device)), 3)
    want = run(None).float()  # as served: the kernel's own choices
    flop = 2.0 * B * m * cin * r * C * 2
    served_ms = time_call(lambda: run(None))
    best, best_ms, bad = best_config(run, want, grid(quick), served, served_ms)
    print(f"| {C} | {n} | {KINDS['tconv']} | {B} | {served} | {served_ms:.4f} | "
          f"{flop / served_ms / 1e9:.0f} | {best} | {best_ms:.4f} | "
          f"{flop / best_ms / 1e9:.0f} |", flush=True)
    x = xin[..., 1:]  # the GEMM path: x^T @ [Cin, taps * r * C], then the overlap-add
    w_gemm = weight.permute(0, 2, 1).reshape(cin, -1).contiguous()
    spill, rows = torch.zeros(B, C, r, device=dev, dtype=dt), torch.arange(B, device=dev)

    def gemm():
        z = (x.transpose(1, 2).reshape(B * m, cin) @ w_gemm).view(B, m, 2, r, C)
        return overlap_add(z, spill, rows, bias, channels_last=True)

    other = gemm().float()  # the same map (its output a view of ours): a packing error shows
    ours = want.transpose(1, 2).reshape(B, m * r, C).transpose(1, 2)
    err = ((other - ours).abs().max() / ours.abs().max()).item()
    print(f"  the GEMM + overlap-add it replaces: {time_call(gemm):.4f} ms (rel. diff {err:.1e})")
    for line in bad[:5]:
        print(f"  skipped {line}")


SPLITS = (1, 2, 4, 8, 16)  # programs a tile tried at the best tile (few-stream steps)


def best_split(run, want, best, best_ms: float):
    """At the best tile of a few-stream step (the tile search ran with the engine's automatic
    split count), each split-K count of `SPLITS` (`best_config`'s checks and timing):
    (tile + (split,), ms) where one beats it, else (best, best_ms)."""
    split, ms, _ = best_config(lambda sk: run(best, split_k=sk), want, SPLITS, None, best_ms)
    return (best, best_ms) if split is None else ((*best, split), ms)


def best_config(run, want, configs, served, served_ms: float):
    """(best config, its ms, skipped configs) over `configs` against the served one: each
    run's output checked against `want` (a config that disagrees is reported, never chosen),
    then timed."""
    best, best_ms, bad = served, served_ms, []
    for cfg in configs:
        try:
            got = run(cfg).float()
        except Exception as exc:  # out of shared memory, etc.: not a candidate
            bad.append(f"{cfg}: {type(exc).__name__}")
            continue
        if ((got - want).abs().max() / want.abs().max()).item() > 1e-2:
            bad.append(f"{cfg}: disagrees")
            continue
        ms = time_call(lambda cfg=cfg: run(cfg))
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, bad


def time_call(fn, launches: int = 20) -> float:
    """ms per call: a CUDA graph of `launches` calls, timed by bench_codec.time_graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    return time_graph(g, replays=5, repeats=5) / launches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--quick", action="store_true", help="3 and 4 stages, BLOCK_M <= 128 only")
    ap.add_argument("--kinds", default="k7,1x1s", help=f"comma-separated, of {list(KINDS)}")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        sys.exit(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    if not torch.cuda.is_available():
        sys.exit("sweep_conv.py needs a CUDA GPU")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, channels-last")
    print("| C | n | kind | batch | served config | ms | TFLOP/s | best config | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B in (int(b) for b in args.batches.split(",")):
        few = 0 < B <= CONV_SPLIT_MAX_STREAMS  # the engine splits these steps' convs over K
        configs = list(grid(args.quick, few))
        for C, n in STAGES:
            for key in kinds:
                kind = KINDS[key]
                if key == "unit":
                    if C <= 192:
                        sweep_unit(B, C, n, args.quick, dev, dt)
                    continue
                if key == "tconv":
                    sweep_tconv(B, C, n, args.quick, dev, dt)
                    continue
                if key == "1x1next":
                    sweep_next_act(B, C, n, dev, dt)
                    continue
                k, d = (7, 3) if kind.startswith("k7") else (1, 1)
                ctx = (k - 1) * d
                xin = to_channels_last(torch.randn(B, C, ctx + n, device=dev, dtype=dt))
                w = (torch.randn(k, C, C, device=dev) / (k * C) ** 0.5).to(dt)
                bias = torch.randn(C, device=dev, dtype=dt)
                snake = "snake" in kind
                alpha = torch.rand(C, 1, device=dev) + 0.5 if snake else None
                inv_beta = torch.rand(C, 1, device=dev) + 0.5 if snake else None
                res = to_channels_last(torch.randn(B, C, n, device=dev, dtype=dt)) \
                    if kind.startswith("1x1") else None
                out_snake = "out snake" in kind
                a, ib = (None, None) if out_snake else (alpha, inv_beta)
                oa, oib = (alpha, inv_beta) if out_snake else (None, None)

                cap = 128 if "maxnreg 128" in kind else None
                tma = True if key == "k7stma" else None

                def run(cfg, xin=xin, w=w, bias=bias, d=d, res=res, a=a, ib=ib, oa=oa, oib=oib,
                        cap=cap, tma=tma, split_k=None, few=few):
                    # a grid config is this kernel's (not the TMA kernel's where that would
                    # take the conv as served)
                    return _causal_conv_triton(xin, w, bias, d, res, a, ib, True, cfg,
                                               out_alpha=oa, out_inv_beta=oib, maxnreg=cap,
                                               tma=tma if tma or cfg is None else False,
                                               split=False if tma else few, split_k=split_k)

                # timed as served (config None: the kernel's own choices, maxnreg and flat K
                # steps included), labelled by its few-stream tile (FEW_TILES) or `_config`'s
                few_tile = _few_tile(xin, C) if few and k > 1 and not tma else None
                served = (_tma_config(C) if tma else few_tile if few_tile is not None else
                          (*_config(B * n, C, C, k, in_snake=a is not None,
                                    sms=_num_sms(xin.device)), 3))
                want = run(None).float()
                flop = 2.0 * B * n * C * C * k
                served_ms = time_call(lambda: run(None))
                best, best_ms, bad = best_config(run, want, list(tma_grid(args.quick)) if tma
                                                 else configs, served, served_ms)
                if few and not tma:
                    best, best_ms = best_split(run, want, best, best_ms)
                print(f"| {C} | {n} | {kind} | {B} | {served} | {served_ms:.4f} | "
                      f"{flop / served_ms / 1e9:.0f} | {best} | {best_ms:.4f} | "
                      f"{flop / best_ms / 1e9:.0f} |", flush=True)
                if tma:  # side by side: the pointer-gather kernel as served
                    ptr_ms = time_call(lambda run=run: run(None, tma=False))
                    print(f"  the served pointer-gather kernel: {ptr_ms:.4f} ms "
                          f"({flop / ptr_ms / 1e9:.0f} TFLOP/s)", flush=True)
                for line in bad[:5]:
                    print(f"  skipped {line}")


if __name__ == "__main__":
    main()
