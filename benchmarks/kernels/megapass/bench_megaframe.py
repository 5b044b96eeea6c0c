"""Feasibility prototype: the code predictor's frame at batch 1 as one persistent CUDA kernel
(ttsbuild/csrc/cp_megaframe.cu, wrapped by ttsbuild/runtime/cp_megaframe.py; not served).
Checks it against the module's float32 reference of the same math (itself checked against the
official code predictor on the CPU), then times it, in CUDA graphs, beside its own floors:

    PYTHONPATH=. python3 benchmarks/kernels/megapass/bench_megaframe.py [--ctas 132]

modes (one kernel each, 16 passes, 334 grid barriers a frame):
  full       the frame: weights of each stage copied to shared memory two stages ahead
  barriers   the barriers alone (no loads, no math): the structure's floor
  no-prefetch each stage copies its own weights when it starts and waits for them
  no-barrier the stages racing (garbage results): the stages' own time
and the barrier with full fences around it (cooperative groups' grid sync, the first run's),
and as a word per CTA with no atomic counter ("flags"). Then the ways a stage fetches (OPTS):
its weights as 16-byte cp.async by every thread or as TMA bulk copies, its activations read
before or after it issues the weight copy of the stage ahead, that copy one or two stages
ahead, or every copy issued by a producer warp of its own as soon as a buffer is free; each
checked (sampled; greedy too with TMA) and timed, and stage breakdowns.
Sampling: greedy, and the project's sampler (temperature 0.9, top-k 50: counter-based
Gumbel-max, `ttsbuild.generation.sampling.sample`) run by every CTA on the pass's logits.
GPU only (sm_90: cp.async, FP8 e4m3 conversions). 1.7B CustomVoice code-predictor shapes,
random FP8 weights with a float scale per row; the small_to_mtp_projection folded into the
codebook tables (a pass's input is a row lookup). Exit status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time

import torch

from ttsbuild.plugins.fp8_linear import quantize_weight_fp8
from ttsbuild.runtime import cp_megaframe as cpm

_S = cpm.SHAPE
H, NH, NKV, HD = _S["hidden"], _S["heads"], _S["kv_heads"], _S["head_dim"]
I, L, V, G = _S["intermediate"], _S["layers"], _S["vocab"], _S["groups"]
QKV = (NH + 2 * NKV) * HD
MODES = {"full": 0, "barriers": 1, "no-prefetch": 2, "no-barrier": 3}
STAGES = 20 + (G - 1) * 21
KINDS = "ABCDH"  # qkv, attention + o, gate/up, down, head (+ the sampler)
NSTAMP = 7
PACES = (500, 1000)  # producer pacing, clock64 ticks a 4 KB piece (~0.25, ~0.5 us at ~1.95 GHz)
READ_FIRST, TMA, DIST1, PRODUCER = cpm.READ_FIRST, cpm.TMA, cpm.DIST1, cpm.PRODUCER
OPTS = {
    "cp.async": 0, "cp.async, read first": READ_FIRST, "tma": TMA,
    "tma, read first": TMA | READ_FIRST, "cp.async, 1 ahead": DIST1,
    "cp.async, read first, 1 ahead": READ_FIRST | DIST1, "tma, 1 ahead": TMA | DIST1,
    "tma, read first, 1 ahead": TMA | READ_FIRST | DIST1,
    "tma, producer": TMA | PRODUCER, "tma, read first, producer": TMA | READ_FIRST | PRODUCER,
}


NO_STAMPS = None  # set in main: an empty int64 tensor on the GPU


def fp8_rows(n: int, k: int, gen: torch.Generator, gain: float = 1.0):
    """Random [n, k] weights (std gain/sqrt(k)) as FP8 e4m3 with a float scale per row."""
    return quantize_weight_fp8(torch.randn(n, k, generator=gen, device="cuda")
                               * (gain / math.sqrt(k)))


def make_model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m: dict[str, torch.Tensor] = {}

    def stack(n, k, count, gain=1.0):
        qs, ss = zip(*(fp8_rows(n, k, gen, gain) for _ in range(count)), strict=True)
        return torch.stack(qs), torch.stack(ss)

    m["wqkv"], m["sqkv"] = stack(QKV, H, L)
    m["wo"], m["so"] = stack(H, NH * HD, L, 0.5)
    m["wgu"], m["sgu"] = stack(2 * I, H, L)
    m["wd"], m["sd"] = stack(H, I, L, 0.5)
    m["whead"], m["shead"] = stack(V, H, G - 1, 4.0)  # logits of std ~4: peaked, as real heads

    def norm(*shape):
        return 1.0 + 0.1 * torch.randn(*shape, generator=gen, device="cuda")

    m["in_norm"], m["post_norm"] = norm(L, H), norm(L, H)
    m["q_norm"], m["k_norm"], m["final_norm"] = norm(L, HD), norm(L, HD), norm(H)
    m["tables"] = torch.randn(G - 2, V, H, generator=gen, device="cuda")
    m["x_in"] = torch.randn(2, H, generator=gen, device="cuda")
    m["rope_cos"], m["rope_sin"] = (t.contiguous() for t in cpm.rope_tables(G, HD, 1e6, "cuda"))
    return m


SAMPLED = dict(do_sample=1, top_k=50, temperature=0.9, seed=-1234567890123, frame=37)
GREEDY = dict(do_sample=0, top_k=0, temperature=1.0, seed=0, frame=0)
# top-p too (the kernel's bit-by-bit search over probability mass; top_p 1 elsewhere)
SAMPLED_P = dict(do_sample=1, top_k=50, top_p=0.8, temperature=0.9, seed=-1234567890123,
                 frame=37)


_SAMPLING: dict[int, tuple] = {}  # id(settings dict) -> its tensors (kept: graphs read them)


def sampling_tensors(s: dict) -> tuple:
    """Settings `s` as an engine holds them: a SamplingBatch of one row, the row's seed and
    frame index (int64)."""
    if id(s) not in _SAMPLING:
        from ttsbuild.generation.sampling import SamplingBatch, SamplingParams

        batch = SamplingBatch.from_params([SamplingParams(
            do_sample=bool(s["do_sample"]), temperature=s["temperature"], top_k=s["top_k"],
            top_p=s.get("top_p", 1.0))], device="cuda")
        seed = torch.tensor([s["seed"]], device="cuda", dtype=torch.int64)
        frame = torch.tensor([s["frame"]], device="cuda", dtype=torch.int64)
        _SAMPLING[id(s)] = (batch, seed, frame)
    return _SAMPLING[id(s)]


def call(ext, ws, mode: int, ctas: int, stamps, s: dict, barrier: int = 0, opts: int = 0,
         pace: int = 0) -> None:
    """barrier: 0 the counter (release add, acquire polls), 1 the same with full fences
    around it (the first run's), 2 a word per CTA, 3 eight striped counters. opts: OPTS bits.
    pace: with the producer, its weight copies in 4 KB pieces at least `pace` clock64 ticks
    apart (0: whole)."""
    batch, seed, frame = sampling_tensors(s)
    ext.run(ws, mode, ctas, stamps, batch.do_sample, batch.top_k, batch.temperature,
            batch.top_p, seed, frame, 0, 1e-6, barrier, opts, pace)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_graph(fn, replays: int) -> float:
    """Median ms of `replays` replays of fn captured in a CUDA graph (after a warm-up)."""
    from ttsbuild.bench.engine_bench import _time_graph

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    return _time_graph(g, replays)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctas", default="", help="CTAs (default: the SM count), comma-separated")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--newest", action="store_true",
                    help="only the newest options (NEWEST) beside the served ones")
    ap.add_argument("--only", default="", help="with --newest: these NEWEST names, "
                    f"comma-separated (default all: {', '.join(NEWEST)})")
    ap.add_argument("--threads-ab", action="store_true",
                    help="the served options, alone and with EARLY_FREE, with 256 stage "
                    "threads and with 512 (an extension each): checks, times side by side, a "
                    "stage breakdown each")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(NEWEST)
    unknown = set(names) - set(NEWEST)
    if unknown:  # before the GPU: a typo in a device call's options costs no device time
        print(f"--only: unknown {sorted(unknown)}; NEWEST has {list(NEWEST)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("GPU only", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    t0 = time.time()
    ext = cpm.extension()
    print(f"built in {time.time() - t0:.0f} s")
    global NO_STAMPS
    NO_STAMPS = torch.empty(0, dtype=torch.int64, device="cuda")
    m, b = make_model(args.seed), cpm.scratch("cuda")
    ws = cpm.kernel_tensors(m, b)
    ctas_list = [int(c) for c in args.ctas.split(",") if c] or [props.multi_processor_count]

    # the producer warp's variants last: a fault there (a context lost) leaves the rest printed
    plain = {k: v for k, v in OPTS.items() if not v & PRODUCER}
    produced = {k: v for k, v in OPTS.items() if v & PRODUCER}

    def checks_of(opts: dict[str, int]) -> list[tuple[str, dict, int, int]]:
        out = [(f"sampled, {name}", SAMPLED, 0, bits) for name, bits in opts.items() if bits]
        return out + [(f"greedy, {name}", GREEDY, 0, bits) for name, bits in opts.items()
                      if bits & TMA]

    fp8_bytes = sum(m[k].numel() for k in ("wqkv", "wo", "wgu", "wd")) * G + m["whead"].numel()
    header = ("| CTAs | mode | ms / frame | us / pass | us / barrier (334) | GB/s |\n"
              "|---|---|---|---|---|---|")
    best = cpm.FETCH

    def row(ctas: int, label: str, mode: int, smp: dict, flags: int = 0, opts: int = 0,
            pace: int = 0, ext=ext) -> None:
        ms = time_graph(lambda: call(ext, ws, mode, ctas, NO_STAMPS, smp, flags, opts, pace),
                        args.replays)
        print(f"| {ctas} | {label} | {ms:.3f} | {ms * 1e3 / G:.1f} | {ms * 1e3 / 334:.2f} | "
              f"{fp8_bytes / (ms * 1e-3) / 1e9:.0f} |", flush=True)

    if args.threads_ab:
        return 0 if threads_ab(ext, ws, m, b, ctas_list, row, header) else 1
    if args.newest:
        chosen = {n: NEWEST[n] for n in names}
        return 0 if newest_options(ext, ws, m, b, ctas_list, best, row, header, chosen) else 1
    ok = True
    first = [("greedy", GREEDY, 0, 0), ("sampled", SAMPLED, 0, 0),
             ("sampled, flag barrier", SAMPLED, 2, 0)] + checks_of(plain)
    for ctas, (label, smp, flags, opts) in itertools.product(ctas_list, first):
        ok &= check(ext, ws, m, b, ctas, label, smp, flags, opts)
    print(f"\nFP8 weight bytes a frame {fp8_bytes / 1e6:.0f} MB (16 passes; 15 heads)")
    print(header)
    for ctas in ctas_list:
        for mode, code in MODES.items():
            row(ctas, mode, code, GREEDY)
        for label, code, smp, flags in (("full, sampled", 0, SAMPLED, 0),
                                         ("barriers, fenced", 1, GREEDY, 1),
                                         ("full, sampled, fenced", 0, SAMPLED, 1),
                                         ("barriers, flags", 1, GREEDY, 2)):
            row(ctas, label, code, smp, flags)
        for name, bits in plain.items():
            if bits:
                row(ctas, f"full, {name}", 0, GREEDY, 0, bits)
        row(ctas, "no-barrier, tma, read first", 3, GREEDY, 0, TMA | READ_FIRST)
        row(ctas, "no-prefetch, tma", 2, GREEDY, 0, TMA)
        stage_breakdown(ext, ws, ctas, "tma, read first")
    print("\nthe producer warp's variants, the striped barrier, the paced copies")
    newest = [("sampled, tma, read first, producer, striped barrier", SAMPLED, 3, best, 0),
              ("greedy, tma, read first, producer, striped barrier", GREEDY, 3, best, 0)]
    newest += [(f"sampled, tma, read first, producer, paced {t} ticks", SAMPLED, 0, best, t)
               for t in PACES]
    newest += [("sampled, tma, read first, producer, cooperative launch", SAMPLED, 0,
                best | cpm.COOPERATIVE, 0),
               ("sampled with top-p 0.8, tma, read first, producer", SAMPLED_P, 0, best, 0)]
    for ctas, (label, smp, flags, opts) in itertools.product(ctas_list, checks_of(produced)):
        ok &= check(ext, ws, m, b, ctas, label, smp, flags, opts)
    for ctas, (label, smp, flags, opts, pace) in itertools.product(ctas_list, newest):
        ok &= check(ext, ws, m, b, ctas, label, smp, flags, opts, pace)
    print(header)
    for ctas in ctas_list:
        row(ctas, "full, tma, read first (again)", 0, GREEDY, 0, TMA | READ_FIRST)
        for name, bits in produced.items():
            row(ctas, f"full, {name}", 0, GREEDY, 0, bits)
        row(ctas, "no-barrier, tma, read first, producer", 3, GREEDY, 0, best)
        row(ctas, "barriers, striped", 1, GREEDY, 3)
        row(ctas, "full, tma, read first, producer, striped barrier", 0, GREEDY, 3, best)
        row(ctas, "full, tma, read first, producer, cooperative launch", 0, GREEDY, 0,
            best | cpm.COOPERATIVE)
        row(ctas, "full, sampled, tma, read first, producer", 0, SAMPLED, 0, best)
        row(ctas, "full, sampled with top-p 0.8, tma, read first, producer", 0, SAMPLED_P, 0,
            best)
        for t in PACES:
            row(ctas, f"full, tma, read first, producer, paced {t} ticks", 0, GREEDY, 0, best, t)
            row(ctas, f"full, tma, read first, producer, paced {t} ticks, striped", 0, GREEDY,
                3, best, t)
        for name in produced:
            stage_breakdown(ext, ws, ctas, name)
        stage_breakdown(ext, ws, ctas, "tma, read first, producer", flags=3, pace=PACES[0])
    ok &= newest_options(ext, ws, m, b, ctas_list, best, row, header)
    return 0 if ok else 1


# the newest options beside the served ones (`newest_options`)
NEWEST = {"two-token": cpm.TWO_TOKEN, "xreduce": cpm.XREDUCE, "kv-ahead": cpm.KV_AHEAD,
          "two-token+xreduce": cpm.TWO_TOKEN | cpm.XREDUCE,
          "split-down": cpm.SPLIT_DOWN, "split-down+two-token": cpm.SPLIT_DOWN | cpm.TWO_TOKEN,
          "all-four": cpm.TWO_TOKEN | cpm.XREDUCE | cpm.KV_AHEAD | cpm.SPLIT_DOWN,
          "two-token+xreduce+early-free": cpm.TWO_TOKEN | cpm.XREDUCE | cpm.EARLY_FREE,
          "two-token+xreduce+tagged": cpm.TWO_TOKEN | cpm.XREDUCE | cpm.TAGGED,
          "two-token+xreduce+tagged+qkv": cpm.TWO_TOKEN | cpm.XREDUCE | cpm.TAGGED | cpm.TAGGED_QKV,
          "two-token+xreduce+tagged+qkv+warp-qk": (cpm.TWO_TOKEN | cpm.XREDUCE | cpm.TAGGED
                                                   | cpm.TAGGED_QKV | cpm.WARP_QK),
          "two-token+xreduce+warp-qk": cpm.TWO_TOKEN | cpm.XREDUCE | cpm.WARP_QK,
          "tagged": cpm.TAGGED}


def newest_options(ext, ws, m, b, ctas_list, best: int, row, header: str,
              newest: dict[str, int] = NEWEST) -> bool:
    """cpm.TWO_TOKEN (the frame's two inputs as one pass of two tokens: 20 stages and
    19 barriers fewer), cpm.XREDUCE (a GEMV's row sums reduced together; B's o projection
    8 rows a warp), cpm.KV_AHEAD (B's past K/V rows copied by the producer) and
    cpm.SPLIT_DOWN (D split by input columns: no barrier after C), alone and together: checked
    greedy, sampled and with top-p, then timed beside the served options, with a stage
    breakdown each."""
    print("\nthe two-token first pass (TWO_TOKEN: 315 barriers a frame, not 334), the "
          "GEMVs' reductions together (XREDUCE), B's K/V rows copied ahead (KV_AHEAD), D split "
          "by input columns (SPLIT_DOWN: 254 barriers, 240 with TWO_TOKEN)")
    ok = True
    checked = {"fetch": 0, **newest}  # fetch: FETCH alone, in its own instance
    for ctas, (name, bits), (label, smp) in itertools.product(ctas_list, checked.items(), (
            ("greedy", GREEDY), ("sampled", SAMPLED), ("sampled with top-p 0.8", SAMPLED_P))):
        ok &= check(ext, ws, m, b, ctas, f"{label}, tma, read first, producer, {name}", smp,
                    0, best | bits)
    print(header)

    def kind(opts: int) -> str:  # which instance ran: one compiled for its options or not
        return "" if cpm.specialized(opts) else " (generic)"

    for ctas in ctas_list:
        for label, smp in (("greedy", GREEDY), ("sampled", SAMPLED)):
            row(ctas, f"full, {label}, tma, read first, producer{kind(best)}", 0, smp, 0, best)
            row(ctas, f"full, {label}, tma, read first, producer (generic)", 0, smp, 0,
                best | cpm.GENERIC)
            for name, bits in newest.items():
                row(ctas, f"full, {label}, tma, read first, producer, {name}{kind(best | bits)}",
                    0, smp, 0, best | bits)
        if "two-token" in newest:
            row(ctas, "barriers, two-token (315)", 1, GREEDY, 0, cpm.TWO_TOKEN)
        if "xreduce" in newest:
            row(ctas, "no-barrier, tma, read first, producer, xreduce", 3, GREEDY, 0,
                best | cpm.XREDUCE)
        if "two-token+xreduce" in newest:  # the served instance, its weights unconverted:
            # the FP8 conversion's share of the linears (timing only: its results are wrong)
            row(ctas, "full, greedy, served options, weights unconverted (timing only)", 0,
                GREEDY, 0, cpm.SERVED_OPTS | cpm.RAW)
        for name, bits in newest.items():
            stage_breakdown(ext, ws, ctas, f"tma, read first, producer, {name}", bits=best | bits)
        if "two-token+xreduce" in newest:
            stage_breakdown(ext, ws, ctas, "served options, weights unconverted (timing only)",
                            bits=cpm.SERVED_OPTS | cpm.RAW)
    return ok


def threads_ab(ext, ws, m, b, ctas_list, row, header: str) -> bool:
    """The served options (cpm.SERVED_OPTS, their own instance), alone and with
    cpm.EARLY_FREE (a stage's buffer back to the producer at its barrier arrival), each with
    256 stage threads a CTA (8 warps) and with 512 (16 warps: MEGAFRAME_THREADS=512, its own
    extension). Each new combination checked greedy, sampled and with top-p; then all four
    timed in turn, twice (alternated: a drift of the clocks shows as a difference of rounds),
    and a stage breakdown of each. The same weights and buffers serve both builds."""
    print("\nstage threads: 256 (8 warps) against 512 (16 warps; A 2 rows a warp, the head 1, "
          "D's K split over two warps); EARLY_FREE (the buffer back to the producer at the "
          "barrier's arrival) on each")
    t0 = time.time()
    ext512 = cpm.extension(threads=512)
    print(f"512-thread build in {time.time() - t0:.0f} s")
    builds = ((256, ext), (512, ext512))
    variants = (("served options", cpm.SERVED_OPTS),
                ("served options, early free", cpm.SERVED_OPTS | cpm.EARLY_FREE))
    ok = True
    for ctas, (threads, e), (name, bits), (label, smp) in itertools.product(
            ctas_list, builds, variants, (("greedy", GREEDY), ("sampled", SAMPLED),
                                          ("sampled with top-p 0.8", SAMPLED_P))):
        if threads == 256 and bits == cpm.SERVED_OPTS:
            continue  # checked by every other run of this bench and the GPU tests
        ok &= check(e, ws, m, b, ctas, f"{label}, {name}, {threads} threads", smp, 0, bits)
    print(header)
    for ctas in ctas_list:
        for rnd in (1, 2):
            for (threads, e), (name, bits) in itertools.product(builds, variants):
                for label, smp in (("greedy", GREEDY), ("sampled", SAMPLED)):
                    row(ctas, f"full, {label}, {name}, {threads} threads (round {rnd})", 0, smp,
                        0, bits, ext=e)
        for (threads, e), (name, bits) in itertools.product(builds, variants):
            stage_breakdown(e, ws, ctas, f"{name}, {threads} threads", bits=bits)
    return ok


def check(ext, ws, m, b, ctas: int, label: str, smp: dict, flags: int, opts: int,
          pace: int = 0) -> bool:
    """One frame against the float32 reference (logits, caches, tokens); prints its line."""
    for name in ("kcache", "vcache", "logits", "tokens"):
        b[name].zero_()
    call(ext, ws, 0, ctas, NO_STAMPS, smp, flags, opts, pace)
    torch.cuda.synchronize()
    tokens = b["tokens"].clone()
    ref_logits, kc, vc = cpm.reference(m, m["x_in"], tokens)
    errs = [rel(b["logits"][i], ref_logits[i]) for i in range(G - 1)]
    ref_tok = cpm.reference_draws(ref_logits, *sampling_tensors(smp))
    flips = [(i, int(tokens[i]), ref_tok[i]) for i in range(G - 1) if int(tokens[i]) != ref_tok[i]]
    err_k, err_v = rel(b["kcache"], kc), rel(b["vcache"], vc)
    # the kernel's sums run in another order than the reference's: a differing token is
    # allowed only where the reference's own choice is a near-tie
    near = [i for i, _, _ in flips if cpm.near_tie(ref_logits[i], *sampling_tensors(smp), i + 1)]
    good = max(errs) < 1e-4 and err_k < 1e-4 and err_v < 1e-4 and len(near) == len(flips)
    print(f"[{ctas} CTAs, {label}] check {'PASS' if good else 'FAIL'}: logits rel err "
          f"max {max(errs):.2e} (passes 1-15), k/v caches {err_k:.2e} / {err_v:.2e}; "
          f"tokens {tokens.tolist()}; differing from the reference {flips} (near-ties "
          f"{near}); logit std {float(ref_logits.std(dim=-1).mean()):.2f}", flush=True)
    return good


def stage_breakdown(ext, ws, ctas: int, opts_name: str, flags: int = 0, pace: int = 0,
                    bits: int | None = None) -> None:
    """Where a stage's time goes, from clock64 stamps of CTA 0 and the last CTA (one sampled
    frame, mode full, option bits `bits`, else OPTS[opts_name]), medians over passes and
    layers, us, each from the stage's top (after the previous barrier and a block sync): the
    weight copy of the stage ahead issued, its own weights ready (waited for), its activations
    read (their loads and a block sync: before the issue with "read first"); then from the
    later of the last two to its linear's start (norms, attention), to the barrier's arrival
    (the linear and its stores), the barrier, and from its release to the next top."""
    bits = OPTS[opts_name] if bits is None else bits
    stamps = torch.zeros(2, STAGES, NSTAMP, dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last run's stamps
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(ext, ws, 0, ctas, stamps, SAMPLED, flags, bits, pace)
        b.record()
        b.synchronize()
    st = stamps.cpu().double()
    first = 20 if bits & cpm.TWO_TOKEN else 0  # pass 0's stages not run there
    ticks_per_us = float(st[0, -1, 6] - st[0, first, 0]) / (a.elapsed_time(b) * 1e3)
    extra = (", striped barrier" if flags == 3 else "") + (f", paced {pace} ticks" if pace else "")
    print(f"\n[{ctas} CTAs, {opts_name}{extra}] stage breakdown (clock64, "
          f"~{ticks_per_us:.0f} ticks/us from the launch's event time; medians, us):")
    print("| CTA | kind | stages | top -> issued | top -> weights | top -> activations | "
          "norms, attention | linear | barrier | to next top |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for who, name in ((0, "0"), (1, str(ctas - 1))):
        rows: dict[str, list[tuple[float, ...]]] = {k: [] for k in KINDS}
        for sid in range(first, STAGES - 1):
            r = sid if sid < 20 else (sid - 20) % 21
            top, issued, weights, act, mid, arrive, release = (float(v) for v in st[who, sid])
            if arrive == 0:  # pass 0's last down: no barrier
                continue
            nxt = float(st[who, sid + 1, 0])
            rows[KINDS[4 if r == 20 else r % 4]].append(tuple(
                v / ticks_per_us for v in (issued - top, weights - top, act - top,
                                           mid - max(weights, act), arrive - mid,
                                           release - arrive,
                                           nxt - release)))
        for k, v in rows.items():
            if v:
                med = [statistics.median(x[i] for x in v) for i in range(7)]
                print(f"| {name} | {k} | {len(v)} | " + " | ".join(f"{m:.2f}" for m in med) + " |")


if __name__ == "__main__":
    sys.exit(main())
