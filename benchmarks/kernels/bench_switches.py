"""The talker's and the code predictor's kernel switches timed side by side in ONE process.

Separate processes drift by more than these switches change: on 2026-12-04 the talker's
one-row step read 1.00-1.21 ms across seven engine-bench processes that all ran the same code
for it (`2026-12-04-h200-a8-sides/`). Here each variant (a set of `fast_model` switches, read
when a graph is captured) gets its own CUDA graph per shape, and the variants' graphs are
replayed in rounds, interleaved, the order rotated every round. Per shape and variant: the
median ms over rounds, the median of its per-round ratio to the baseline (the switches as
served: their values when this script starts, i.e. the defaults or the environment's; a ratio
taken within one round cancels drift between rounds) with the spread of those ratios, and the
relative difference of its output to the baseline's (0: the same bits).

Shapes: `decode:B` (PackedStack.decode, B rows at positions ~600 of a 1024-position cache),
`prefill:BxT` (PackedStack.prefill, B prompts of T tokens): the 1.7B CustomVoice talker (random
weights, FP8, the plan's default linear paths: W8A8 from 16 rows, bf16 copies from 128); and
`cp:B` (FusedCodePredictor.frame, the code predictor's 15 passes for B rows, greedy: bf16 as
served, `bench_cp_fused.build`) and `cpp:B` (the same frame on the persistent pass,
`frame_persistent`: one launch per pass) and `cpunf:B` (`frame_unfused`, the served path of
batches past the fused code predictor's), where the output compared is the codes (the
fraction that differ).

    PYTHONPATH=. python3 benchmarks/kernels/bench_switches.py [--out bench_switches.json] \
        [--variants="-A8_NORM_QUANT;A8_SILU_QUANT;-A8_NORM_QUANT,-A8_GATE_UP_SILU"] \
        [--shapes decode:1,decode:64,prefill:1x32,prefill:1x64,prefill:4x64,cp:1,cpp:1] [--rounds 9]

(--variants: ';' between variants, ',' between the switches of one; NAME turns a switch on,
-NAME off, the others stay as served. The default: the sampler's unrestricted draw tried first
off (-SAMPLE_FIRST_TRY, served since 2026-12-04), the short-cache attention in one launch on the
unfused code predictor (SHORT_ATTEND_FUSED, built 2026-12-04), the code predictor's attention
and o projection in one launch (CP_ATTEND_O, 2026-12-04: +3 % at 1 row, +33 % at 8), its two-
token prefill pass off (-CP_PAIR_PREFILL, served since 2026-12-04), the served A8 switches off
one by one and together, A8_SILU_QUANT on, then the code predictor's attention-in-qkv and
sampler-in-head, the persistent pass's L2 prefetch, attention in its qkv stage and counting
barrier, one by one and together, and the fused linears' and the FP8 tiles' weights into L2
before their PDL wait (both TTSBUILD_PDL_L2_AHEAD). A variant runs on the shapes its switches
act on: the talker's and the FP8 tiles' on decode and prefill, the code predictor's and the
fused linears' and the sampler's on cp, the persistent pass's on cpp, the short-cache attention
on cpunf.)

`--tiny`: the tiny model on the CPU, eager calls timed by the host clock: checks the script
and the switches' bit-equality on the CPU references (tests/runtime/test_bench_switches.py),
times nothing that matters.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ttsbuild.plugins import cp_pass
from ttsbuild.plugins._tl import fp8_linear as tl_fp8_linear
from ttsbuild.plugins._tl import fused_linear as tl_fused_linear
from ttsbuild.plugins._tl import qk_norm_rope_attend as tl_attend
from ttsbuild.plugins._tl import sampling as tl_sampling
from ttsbuild.runtime import cp_fused, fast_model

# The switches a variant may turn on or off: name -> (module, attribute), each read when a
# kernel path is chosen. The baseline has them as served (`SERVED`, read at import).
# Which shape kinds each module's switches act on: a variant runs on a shape where one of its
# switches acts (the baseline everywhere).
ACTS_ON = {fast_model: ("decode", "prefill"), cp_fused: ("cp",), cp_pass: ("cpp",),
           tl_fused_linear: ("cp",), tl_fp8_linear: ("decode", "prefill"),
           tl_sampling: ("cp",), tl_attend: ("cp",)}  # fmt: skip
# switches acting elsewhere than their module's others
ACTS_ON_SWITCH = {"SHORT_ATTEND_FUSED": ("cpunf",)}
SWITCHES = {
    "A8_NORM_QUANT": (fast_model, "A8_NORM_QUANT"),
    "A8_SILU_QUANT": (fast_model, "A8_SILU_QUANT"),
    "A8_GATE_UP_SILU": (fast_model, "A8_GATE_UP_SILU"),
    "GATE_UP_SILU": (fast_model, "GATE_UP_SILU"),
    "TALKER_ATTEND_FUSED": (fast_model, "TALKER_ATTEND_FUSED"),
    "SHORT_ATTEND_FUSED": (fast_model, "SHORT_ATTEND_FUSED"),
    "CP_ATTEND_IN_QKV": (cp_fused, "ATTEND_IN_QKV"),
    "CP_SAMPLE_IN_HEAD": (cp_fused, "SAMPLE_IN_HEAD"),
    "CP_PAIR_PREFILL": (cp_fused, "PAIR_PREFILL"),
    "CP_ATTEND_O": (cp_fused, "ATTEND_O"),
    "SAMPLE_FIRST_TRY": (tl_sampling, "FIRST_TRY"),
    "CP_PASS_PREFETCH": (cp_pass, "PREFETCH"),
    "CP_PASS_ATTEND_IN_QKV": (cp_pass, "ATTEND_IN_QKV"),
    "CP_PASS_COUNT_BARRIER": (cp_pass, "COUNT_BARRIER"),
    "PDL_L2_AHEAD": (tl_fused_linear, "L2_AHEAD"),
    "FP8_L2_AHEAD": (tl_fp8_linear, "L2_AHEAD"),
    "ATTEND_TOKENS_PARALLEL": (tl_attend, "TOKENS_PARALLEL"),
    "GEMV_FEW_ROWS": (tl_fused_linear, "GEMV_FEW_ROWS"),
}
SERVED = {n: bool(getattr(*SWITCHES[n])) for n in SWITCHES}  # the switches as served
DEFAULT_VARIANTS = (
    "-SAMPLE_FIRST_TRY;SHORT_ATTEND_FUSED;CP_ATTEND_O;-CP_PAIR_PREFILL;-A8_NORM_QUANT;-A8_GATE_UP_SILU;-A8_NORM_QUANT,-A8_GATE_UP_SILU;A8_SILU_QUANT;"
    "CP_ATTEND_IN_QKV;CP_SAMPLE_IN_HEAD;CP_PASS_PREFETCH;CP_PASS_ATTEND_IN_QKV;"
    "CP_PASS_COUNT_BARRIER;CP_PASS_PREFETCH,CP_PASS_ATTEND_IN_QKV,CP_PASS_COUNT_BARRIER;"
    "PDL_L2_AHEAD;FP8_L2_AHEAD"
)
# the code predictor's first (most at stake at batch 1, and last to compile)
DEFAULT_SHAPES = ("cpp:1,cp:1,cp:8,cpunf:64,decode:1,prefill:1x32,prefill:1x64,decode:64,"
                  "prefill:4x64")
CACHE_POSITIONS = 1024


def parse_variants(text: str) -> list[tuple[str, dict[str, bool]]]:
    """'A;B,-C' -> [('base', {}), ('A', {A: on}), ('B+-C', {B: on, C: off})]: the baseline
    (every switch as served) first. A variant that sets nothing differently from the baseline
    is refused: it would time the baseline against itself."""
    variants = [("base", {})]
    for item in text.split(";"):
        names = [n.strip() for n in item.split(",") if n.strip()]
        if not names:
            continue
        flags = {n.removeprefix("-"): not n.startswith("-") for n in names}
        unknown = [n for n in flags if n not in SWITCHES]
        if unknown:
            raise ValueError(f"unknown switch {unknown[0]!r}; known: {', '.join(SWITCHES)}")
        if len(flags) < len(names):
            raise ValueError(f"variant {item.strip()!r} names a switch twice")
        if all(SERVED[n] == on for n, on in flags.items()):
            raise ValueError(f"variant {item.strip()!r} is the baseline (every switch in it "
                             "is already served that way)")  # fmt: skip
        variants.append(("+".join(names), flags))
    return variants


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """'decode:64,prefill:4x32,cp:1' -> [('decode', 64, 1), ('prefill', 4, 32), ('cp', 1, 1)]."""
    shapes = []
    for item in text.split(","):
        kind, _, size = item.strip().partition(":")
        try:
            if kind in ("decode", "cp", "cpp", "cpunf"):
                shapes.append((kind, int(size), 1))
            elif kind == "prefill":
                b, _, t = size.partition("x")
                shapes.append((kind, int(b), int(t)))
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(f"bad shape {item!r}: decode:B, prefill:BxT, cp:B, cpp:B or "
                             "cpunf:B") from None  # fmt: skip
        if min(shapes[-1][1:]) < 1:
            raise ValueError(f"bad shape {item!r}: sizes must be positive")
    return shapes


@contextlib.contextmanager
def switched(flags: dict[str, bool]):
    """The switches as `flags` says (the rest as served) for the block, restored after."""
    old = {n: getattr(*SWITCHES[n]) for n in SWITCHES}
    try:
        for n, (module, attr) in SWITCHES.items():
            setattr(module, attr, flags.get(n, SERVED[n]))
        yield
    finally:
        for n, v in old.items():
            setattr(*SWITCHES[n], v)


def model_config(variant: str):
    from ttsbuild.convert.init_random import load_variant
    from ttsbuild.model.config import ModelConfig

    return ModelConfig.from_official(load_variant(variant)[0])


def _sibling(name: str):
    """A script beside this one (bench_cp_fused, bench_talker), imported as a module."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def make_stack(variant: str, device: str, dtype: torch.dtype):
    """(talker config, FP8 PackedStack on the plan's default linear paths) of random weights."""
    from ttsbuild.runtime.plan import DEFAULT_BF16_MIN_ROWS, DEFAULT_W8A8_MIN_ROWS

    cfg, module = _sibling("bench_talker").random_talker(variant, device)
    stack = fast_model.PackedStack.from_module(module.to(dtype), True)
    stack.set_w8a8_min_rows(DEFAULT_W8A8_MIN_ROWS)
    stack.set_bf16_min_rows(DEFAULT_BF16_MIN_ROWS)
    return cfg, stack


def cp_call(variant: str, B: int, device: str, dtype: torch.dtype, path: str = "fused"):
    """The code predictor's frame for B rows on `path` (fused, persistent, unfused: the
    served path of buckets past fused_code_predictor's; bench_cp_fused's
    model and buffers; bf16 weights as served): a call returning the frame's codes [B, G]."""
    bench_cp_fused = _sibling("bench_cp_fused")
    fcp = bench_cp_fused.build(model_config(variant), dtype, fp8=False, device=device)
    if path == "persistent":
        fcp.enable_persistent(B)
    frame = bench_cp_fused.Frame(fcp, B, path, device=device)

    def call():
        frame()
        return frame.codes

    return call


def shape_call(stack, cfg, shape: tuple[str, int, int], device: str, dtype: torch.dtype,
               variant: str):  # fmt: skip
    """A call running `shape` on fresh random inputs (its output returned); the same inputs
    and caches for every variant. Each call writes the same cache entries it then reads."""
    kind, B, T = shape
    if kind in ("cp", "cpp", "cpunf"):
        path = {"cp": "fused", "cpp": "persistent", "cpunf": "unfused"}[kind]
        return cp_call(variant, B, device, dtype, path)
    g = torch.Generator(device=device).manual_seed(B * 1000 + T)
    cache = (cfg.num_layers, B, cfg.num_kv_heads, CACHE_POSITIONS, cfg.head_dim)
    k = torch.randn(cache, device=device, generator=g).to(dtype)
    v = torch.randn(cache, device=device, generator=g).to(dtype)
    slots = torch.arange(B, device=device)
    if kind == "decode":
        x = torch.randn(B, cfg.hidden_size, device=device, generator=g).to(dtype)
        pos = torch.randint(CACHE_POSITIONS // 2, CACHE_POSITIONS * 5 // 8, (B,), device=device,
                            generator=g)  # fmt: skip
        return lambda: stack.decode(x, k, v, slots, pos)
    x = torch.randn(B, T, cfg.hidden_size, device=device, generator=g).to(dtype)
    return lambda: stack.prefill(x, k, v, slots)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of b to a; for codes, the fraction of entries that differ."""
    if not a.is_floating_point():
        return (a != b).double().mean().item()
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm()).item()


class Runner:
    """One variant's call at one shape: a CUDA graph on the GPU (replayed, timed by events),
    the eager call on the CPU (timed by the host clock). `output` after a run is the call's."""

    def __init__(self, call, flags: dict[str, bool], cuda: bool):
        from ttsbuild.runtime.graph_engine import _capture

        self.cuda, self.flags, self.output = cuda, flags, None

        def step():
            self.output = call()

        self._step, self.graph = step, None
        if cuda:
            with switched(flags):  # read while the graph is captured: its kernels keep them
                self.graph = _capture(step, None)  # the captured output: the graph's own

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with switched(self.flags):  # the eager call reads them as it runs
                self._step()

    def time_ms(self, replays: int) -> float:
        """Median ms of `replays` runs."""
        times = []
        for _ in range(replays):
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                self.run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                self.run()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def bench_shape(runners: dict[str, Runner], rounds: int, replays: int) -> dict[str, dict]:
    """Interleaved rounds over the variants (order rotated each round) -> per variant: median
    ms, median / min / max of the per-round ratio to 'base'."""
    names = list(runners)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            per_round[n].append(runners[n].time_ms(replays))
    out = {}
    for n in names:
        ratios = [t / b for t, b in zip(per_round[n], per_round["base"], strict=True)]
        out[n] = {"ms": statistics.median(per_round[n]), "ratio": statistics.median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios),
                  "rounds_ms": per_round[n]}  # fmt: skip
    return out


def acts(flags: dict[str, bool], kind: str) -> bool:
    """Whether a variant runs on a shape kind: the baseline (as served) everywhere, the others
    where one of their switches acts."""
    return not flags or any(kind in ACTS_ON_SWITCH.get(n, ACTS_ON[SWITCHES[n][0]])
                            for n in flags)  # fmt: skip


def run(variants, shapes, rounds: int, replays: int, tiny: bool, log=print,
        out: str | None = None) -> list[dict]:  # fmt: skip
    """Every shape's rows (also written to `out` as JSON after each shape: a run cut by its
    time limit keeps what it measured)."""
    cuda = not tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    variant = "tiny" if tiny else "1.7b-customvoice"
    cfg, stack = make_stack(variant, device, dtype)
    rows = []
    log(f"{'shape':14s} {'variant':52s} {'ms':>8s} {'ratio':>7s} {'ratio range':>15s} "
        f"{'rel diff':>9s}")  # fmt: skip
    for shape in shapes:
        call = shape_call(stack, cfg, shape, device, dtype, variant)
        runners = {name: Runner(call, flags, cuda) for name, flags in variants
                   if acts(flags, shape[0])}  # fmt: skip
        # outputs once more, one variant after another (each writes what it then reads)
        outputs = {}
        for name, runner in runners.items():
            runner.run()
            outputs[name] = runner.output.detach().clone()
        if cuda:
            torch.cuda.synchronize()
        timed = bench_shape(runners, rounds, replays)
        label = f"{shape[0]} {shape[1]}" + (f"x{shape[2]}" if shape[0] == "prefill" else "")
        for name, t in timed.items():
            diff = rel_diff(outputs["base"], outputs[name])
            rows.append({"shape": label, "variant": name, "rel_diff": diff, **t})
            log(f"{label:14s} {name:52s} {t['ms']:8.3f} {t['ratio']:7.3f} "
                f"{t['ratio_min']:7.3f}-{t['ratio_max']:.3f} {diff:9.2e}")  # fmt: skip
        del runners, call
        if cuda:
            torch.cuda.empty_cache()
        if out:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="';'-separated variants, each a ','-separated set of switches, "
                         f"NAME on or -NAME off ({', '.join(SWITCHES)}), the rest as "
                         "served; the baseline (as served) always runs")  # fmt: skip
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (a check)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        variants, shapes = parse_variants(args.variants), parse_shapes(args.shapes)
        if args.rounds < 1 or args.replays < 1:
            raise ValueError("--rounds and --replays must be at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.tiny and not torch.cuda.is_available():
        print("error: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    if not args.tiny:
        print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    run(variants, shapes, args.rounds, args.replays, args.tiny, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
