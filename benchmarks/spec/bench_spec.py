"""Speculative decoding of the code predictor (runtime.cp_spec) against speculation off.

    PYTHONPATH=. python3 benchmarks/spec/bench_spec.py [--peaked 8] [--batches 1,8,32,64]
        [--windows 1,2,3,4,5,6] [--out DIR]

GPU only. 1.7B CustomVoice code-predictor shapes, random weights (benchmarks/kernels/
bench_cp_fused.py's `build`), sampled codebooks (temperature 0.9, top-k 50: the published
code-predictor settings). For each target, batch, draft kind and window it captures one CUDA
graph of the speculative frame (as graph_engine would) and prints ms per frame next to
speculation off (the unfused and the fused frame), then the acceptance per drafted depth
and the passes per frame of eager runs with the same inputs (stats on). Times are means over
--frames distinct frames (talker states, codebook-0 codes and draws; default 16), so a
speculative frame's time is the average its acceptance gives (before 2026-12-05 evening one
frame's draws were replayed: the tables of that day and earlier are single frames).

Targets (--targets): "flat" = the random weights as drawn (near-uniform logits: acceptance is
close to chance, an honest floor); with --peaked F also "peaked" = the same weights with the code
predictor's lm heads scaled by F, so each head's logits are as sharp as a trained model's
(a stand-in for sharpness only: random heads still disagree with each other, so the
self-speculative draft stays near chance; what a trained model's heads share is not
modelled); "standin" = the code predictor of the engine's stand-ins (`random_models`,
`init-random`): heads at logit std 6 and residual branches scaled down
(`model.standin.peak_code_predictor`), what the engine benchmarks run. Draft kinds: "self"
(the target's own heads) and "draft" (heads distilled here, in a few hundred steps, on the
target's own sampled frames from random talker states: the
`ttsbuild distill-draft` objective, runtime/draft.py layout).
The rounds are one WHILE node of the graph when the step driver has them
(`runtime.graph_while`, --loop), else IF nodes when torch has conditional nodes in Python
(`CUDAGraph.begin_capture_to_if_node`, --conditional); the table says which ran. At batch 1,
window 3 it also times the same frame with every round run (what the loop saves). With
--profile N it then replays the plain fused frame and the speculative frame (batch 1, window 3,
both kinds) under torch.profiler and prints each one's kernels: count, kernel time, the top N
by total time (run it with TTSBUILD_PDL=0 for each kernel's own time). Writes spec.json (and
the table) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "kernels"))

from bench_cp_fused import Frame, build, time_graph_ms  # noqa: E402

from ttsbuild.bench.engine_bench import _time_graph  # noqa: E402
from ttsbuild.build.distill import acceptance, draft_logits  # noqa: E402
from ttsbuild.convert.init_random import load_variant  # noqa: E402
from ttsbuild.generation.sampling import SamplingBatch  # noqa: E402
from ttsbuild.model.config import ModelConfig  # noqa: E402
from ttsbuild.runtime.cp_spec import (  # noqa: E402
    SpeculativeCodePredictor,
    conditional_nodes_available,
    target_probs,
)
from ttsbuild.runtime.fast_model import Dense  # noqa: E402
from ttsbuild.runtime.graph_engine import _capture  # noqa: E402
from ttsbuild.runtime.graph_while import full_edges, while_nodes_available  # noqa: E402

DEV = "cuda"


def sampled(B: int) -> SamplingBatch:
    return SamplingBatch(
        do_sample=torch.ones(B, dtype=torch.bool, device=DEV),
        temperature=torch.full((B,), 0.9, device=DEV),
        top_k=torch.full((B,), 50, dtype=torch.int64, device=DEV),
        top_p=torch.ones(B, device=DEV),
        repetition_penalty=torch.ones(B, device=DEV),
    )


def peak(fcp, factor: float) -> None:
    """Scale the lm heads in place: logits `factor` times sharper (bf16 heads)."""
    for h in fcp.heads:
        h.weight.mul_(factor)


@torch.no_grad()
def record(fcp, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced final-norm hidden [n, G, H] and head logits [n, G - 1, V] of the
    target's own sampled frames (random talker states and codebook-0 codes)."""
    G = fcp.num_code_groups
    hs, logits = [], []
    for start in range(0, n, 512):
        B = min(512, n - start)
        frame = Frame(fcp, B, "unfused", seed=seed + start)
        frame.sampling = sampled(B)
        frame()
        codes = frame.codes
        x = [frame.hidden, fcp.codec_embedding[codes[:, 0]]]
        x += [fcp.embeddings[c - 1][codes[:, c]] for c in range(1, G - 1)]
        c = fcp.stack.cfg
        cache = torch.zeros(c.num_layers, B, c.num_kv_heads, G, c.head_dim,
                            dtype=frame.hidden.dtype, device=DEV)  # fmt: skip
        h = fcp.stack.prefill(fcp.proj(torch.stack(x, 1)), cache, cache.clone(),
                              torch.arange(B, device=DEV))  # fmt: skip
        hs.append(h.float())
        logits.append(torch.stack([fcp.heads[i](h[:, i + 1]).float() for i in range(G - 1)], 1))
    return torch.cat(hs), torch.cat(logits)


def distill(fcp, frames: int, steps: int, window: int, lr: float) -> tuple[torch.Tensor, dict]:
    """Draft heads distilled on the target's frames (ttsbuild.build.distill's objective)."""
    h, logits = record(fcp, frames, seed=100)
    held = frames // 10
    p = target_probs(logits, sampled(frames))
    heads = torch.nn.Parameter(torch.stack([d.weight.float() for d in fcp.heads]))
    init = heads.detach().clone()
    opt = torch.optim.Adam([heads], lr=lr)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.enable_grad():
        train(heads, opt, h, p, held, steps, window, g)
    with torch.no_grad():
        ev = (h[:held], p[:held])
        report = {
            "self_expected_acceptance": acceptance(init, *ev, sampled, window),
            "draft_expected_acceptance": acceptance(heads.detach(), *ev, sampled, window),
            "frames": frames, "steps": steps,
        }  # fmt: skip
    return heads.detach().to(fcp.embeddings.dtype), report


def train(heads, opt, h, p, held, steps, window, g) -> None:
    for _ in range(steps):
        rows = torch.randint(held, h.shape[0], (256,), device=DEV, generator=g)
        loss = 0.0
        for t in range(1, window + 1):
            logq = torch.log_softmax(draft_logits(heads, h[rows], t) / 0.9, -1)
            target = p[rows][:, t:]
            loss = loss + (target * (torch.log(target.clamp(min=1e-12)) - logq)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def input_pool(frame: Frame, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n frames' inputs for `frame`'s rows (talker hidden states and codebook-0 codes drawn as
    Frame draws its own; the first is the frame's own), so a speculative frame is timed and
    counted over n frames' draws, not one frame's."""
    g = torch.Generator(device=DEV).manual_seed(1234)
    hidden = torch.randn((n, *frame.hidden.shape), device=DEV, generator=g).to(frame.hidden.dtype)
    c0 = torch.randint(0, frame.fcp.codec_embedding.shape[0], (n, frame.B), device=DEV,
                       generator=g)  # fmt: skip
    hidden[0], c0[0] = frame.hidden, frame.c0
    return hidden, c0


def use_inputs(frame: Frame, pool, i: int) -> None:
    """Frame i of the pool into the frame's static inputs (the frame index too: new draws)."""
    frame.hidden.copy_(pool[0][i % len(pool[0])])
    frame.c0.copy_(pool[1][i % len(pool[1])])
    frame.frames.fill_(i)


def time_frames_ms(graph, frame: Frame, pool, replays: int) -> float:
    """Mean ms of `replays` replays, each on the next frame of the pool (the inputs are
    written before the start event: untimed). The mean: a speculative frame's time varies
    with its draws, and what a stream pays is the average."""
    for i in range(3):  # warm-up replays
        use_inputs(frame, pool, i)
        graph.replay()
    ms = _time_graph(graph, replays, before=lambda i: use_inputs(frame, pool, i),
                     stat=statistics.fmean)  # fmt: skip
    use_inputs(frame, pool, 0)
    return ms


def capture_spec(spec, fn) -> torch.cuda.CUDAGraph:
    """Capture with the WHILE node (or IF nodes); if the capture refuses it, say so and
    capture all rounds from here on."""
    try:
        return _capture(fn, None)
    except RuntimeError as exc:
        if not (spec.loop or spec.conditional):
            raise
        print(f"{rounds_of(spec).upper()}-node capture failed "
              f"({str(exc).splitlines()[0][:200]}); all rounds from here on", flush=True)
        spec.loop = spec.conditional = False
        return _capture(fn, None)


def bench_target(fcp, name, args, results) -> None:
    t0 = time.time()
    draft, distilled = distill(fcp, args.distill_frames, args.distill_steps, max(args.windows),
                               args.lr)  # fmt: skip
    print(f"\n[{name}] distilled draft in {time.time() - t0:.1f} s: expected acceptance per "
          f"depth (held-out) self {fmt(distilled['self_expected_acceptance'])} -> draft "
          f"{fmt(distilled['draft_expected_acceptance'])}")  # fmt: skip
    results[name] = {"distilled": distilled, "rows": []}
    spec = SpeculativeCodePredictor(fcp, max(args.batches), max(args.windows), draft,
                                    conditional=args.conditional, loop=args.loop,
                                    exact=args.exact)  # fmt: skip
    paths = args.paths
    print(f"{'B':>3s} " + " ".join(f"{'off ' + p:>14s}" for p in paths)
          + f" {'kind':>5s} {'k':>2s} {'spec ms':>8s} {'x best':>6s} {'passes/row':>10s} "
          f"{'/batch':>6s}  acceptance per drafted depth")  # fmt: skip
    for B in args.batches:
        base = {}
        for path in paths:
            frame = Frame(fcp, B, path)
            frame.sampling = sampled(B)
            base[path] = time_frames_ms(_capture(frame, None), frame,
                                        input_pool(frame, args.frames), args.replays)
        best = min(base.values())
        frame = Frame(fcp, B, "unfused")
        frame.sampling = sampled(B)
        inputs = (frame.hidden, frame.c0, frame.sampling, frame.seeds, frame.frames)
        pool = input_pool(frame, args.frames)
        for kind in ("self", "draft"):
            for k in args.windows:
                spec.stats = True
                spec.reset_stats()
                for i in range(args.frames):  # the frames the graph is timed on, counted
                    use_inputs(frame, pool, i)
                    spec.frame(*inputs, kind, k)
                stats = spec.report()
                spec.stats = False
                out = torch.zeros(B, fcp.num_code_groups, dtype=torch.int64, device=DEV)
                def run(k=k, kind=kind, out=out, inputs=inputs):
                    out.copy_(spec.frame(*inputs, kind, k))

                prepare(spec, B, k, kind)
                graph = capture_spec(spec, run)
                ms = time_frames_ms(graph, frame, pool, args.replays)
                del graph
                row = {"batch": B, "kind": kind, "window": k, "ms": ms, "rounds": rounds_of(spec),
                       "conditional": spec.conditional, "off_ms": base, **stats}
                results[name]["rows"].append(row)  # fmt: skip
                acc = stats["acceptance_per_depth"]
                print(f"{B:3d} " + " ".join(f"{base[p]:14.3f}" for p in paths)
                      + f" {kind:>5s} {k:2d} {ms:8.3f} {best / ms:6.2f} "
                      f"{stats['passes_per_row_frame']:10.2f} "
                      f"{stats['passes_per_batch_frame']:6.2f}  "
                      f"{' '.join(f'{acc[t]:.2f}' for t in sorted(acc))}", flush=True)
    conditional_saving(spec, fcp, args, results, name)
    if args.profile:
        profile_b1(spec, fcp, args, results, name)


def time_spec(spec, fcp, B: int, kind: str, k: int, replays: int) -> float:
    frame = Frame(fcp, B, "unfused")
    frame.sampling = sampled(B)
    inputs = (frame.hidden, frame.c0, frame.sampling, frame.seeds, frame.frames)
    out = torch.zeros(B, fcp.num_code_groups, dtype=torch.int64, device=DEV)
    prepare(spec, B, k, kind)
    graph = capture_spec(spec, lambda: out.copy_(spec.frame(*inputs, kind, k)))
    return time_graph_ms(graph, replays)


def prepare(spec, B: int, k: int, kind: str) -> None:
    """The WHILE body of (B, k, kind); if its capture fails, say so and run every round."""
    try:
        spec.prepare(B, k, kind)
    except Exception as exc:  # noqa: BLE001 (a first run on a GPU: report, go on without)
        if not spec.loop:
            raise
        print(f"WHILE body capture failed ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:200]}); all rounds from here on", flush=True)
        spec.loop = False


def rounds_of(spec) -> str:
    """How the rounds of the frame just captured ran."""
    if spec.loop:
        return "while"
    return "if" if spec.conditional else "all"


def conditional_saving(spec, fcp, args, results, name) -> None:
    """Batch 1, window 3: the graph with the loop (WHILE or IF nodes) vs every round run."""
    if not (spec.loop or spec.conditional):
        return
    loop, conditional = spec.loop, spec.conditional
    for kind in ("self", "draft"):
        how = rounds_of(spec)
        looped = time_spec(spec, fcp, 1, kind, 3, args.replays)
        spec.loop = spec.conditional = False
        every = time_spec(spec, fcp, 1, kind, 3, args.replays)
        spec.loop, spec.conditional = loop, conditional
        results[name][f"loop_b1_k3_{kind}"] = {"rounds": how, "loop_ms": looped,
                                               "all_rounds_ms": every}  # fmt: skip
        print(f"batch 1, {kind}, window 3: {looped:.3f} ms with the rounds as {how} nodes, "
              f"{every:.3f} ms with every round run")  # fmt: skip


def profile_b1(spec, fcp, args, results, name) -> None:
    """Batch 1, window 3: where the plain fused frame's and the speculative frame's GPU time
    goes, kernel by kernel (`profile_graphs.profile_graph`; the WHILE body's kernels count
    once per round run)."""
    from profile_graphs import profile_graph

    frame = Frame(fcp, 1, "fused")
    frame.sampling = sampled(1)
    graphs = {"plain fused": _capture(frame, None)}
    inputs = (frame.hidden, frame.c0, frame.sampling, frame.seeds, frame.frames)
    out = torch.zeros(1, fcp.num_code_groups, dtype=torch.int64, device=DEV)
    for kind in ("self", "draft"):
        prepare(spec, 1, 3, kind)
        graphs[f"spec {kind} k3 ({rounds_of(spec)})"] = capture_spec(
            spec, lambda kind=kind: out.copy_(spec.frame(*inputs, kind, 3)))
    profiles = results[name].setdefault("profile_b1_k3", {})
    # one profile of a looped frame thrown away first: the process's first such profile lost
    # the WHILE body's kernels (2026-12-05, the flat target: 68 kernels a frame where ~230
    # ran; the peaked target's, profiled later in the same process, were whole)
    profile_graph(graphs[next(k for k in graphs if k.startswith("spec"))], 2)
    for label, graph in graphs.items():
        n, ms, rows = profile_graph(graph, args.replays)
        profiles[label] = {"kernels": n, "kernel_ms": ms, "top": rows[: args.profile]}
        print(f"[{name}] {label}: {n:.1f} kernels, {ms:.3f} ms of kernel time per frame")
        for key, calls, t in rows[: args.profile]:
            print(f"  {t * 1e3:8.1f} us {calls:6.1f}x {t * 1e3 / calls:6.1f} us each  {key}")


@torch.no_grad()
def greedy_check(cfg, windows, exact: bool = False) -> int:
    """fp32 weights and activations: speculative greedy codes must equal the target's (else
    exit status 1); bf16 differences (near-ties of flat logits) are counted only."""
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        fcp = build(cfg, dtype, fp8=False, seed=3)
        B = 8
        frame = Frame(fcp, B, "unfused", seed=4)  # greedy sampling settings
        frame()
        ref = frame.codes.clone()
        noisy = torch.stack([h.weight for h in fcp.heads])
        noisy = noisy + 0.01 * torch.randn_like(noisy)
        spec = SpeculativeCodePredictor(fcp, B, max(windows), noisy, exact=exact)
        inputs = (frame.hidden, frame.c0, frame.sampling, frame.seeds, frame.frames)
        differ = {
            (kind, k): int((spec.frame(*inputs, kind, k) != ref).sum())
            for kind in ("self", "draft") for k in windows
        }  # fmt: skip
        total = sum(differ.values())
        print(f"greedy codes vs speculation off, {str(dtype)[6:]}, batch {B}: {total} of "
              f"{len(differ) * ref.numel()} differ", flush=True)  # fmt: skip
        if dtype == torch.float32 and total:
            print(f"FAIL: fp32 greedy codes differ: {differ}")
            bad = 1
    return bad


def fmt(xs) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--windows", default="1,2,3,4,5,6")
    ap.add_argument("--peaked", type=float, default=None,
                    help="also a target with lm heads scaled by this factor (sharp logits)")
    ap.add_argument("--targets", default="flat,peaked",
                    help="comma list: flat (the random weights as drawn), peaked (flat with the "
                    "heads x --peaked, where given), standin (heads and residual branches as "
                    "the engine's stand-ins: model.standin.peak_code_predictor, logit std 6)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--frames", type=int, default=16,
                    help="distinct frames (talker states, codebook 0, draws) a speculative frame "
                    "is timed (mean over --replays replays, cycling) and counted on; 1: one "
                    "frame's draws replayed (before 2026-12-05: what the tables gave)")
    ap.add_argument("--paths", default="unfused,fused,persistent",
                    help="speculation-off frames to time (bench_cp_fused's paths)")
    ap.add_argument("--distill-frames", type=int, default=4096)
    ap.add_argument("--distill-steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--conditional", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--loop", choices=["auto", "on", "off"], default="auto",
                    help="the rounds as one WHILE node (the step driver's graph_while.cu)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile batch 1, window 3 (plain and speculative), top N kernels")
    ap.add_argument("--no-greedy-check", dest="greedy_check", action="store_false",
                    help="skip the lossless check (fp32 greedy codes against speculation off)")
    ap.add_argument("--exact", action="store_true",
                    help="verify by exact match (EnginePlan.speculative_exact): every code the "
                    "plain sampler's draw; acceptance is that of matching draws")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.frames < 1:
        ap.error(f"--frames must be >= 1, got {args.frames}")
    if args.profile < 0:
        ap.error(f"--profile wants a count of kernels (0: off), got {args.profile}")
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(args.targets) - {"flat", "peaked", "standin"})
    if unknown or not args.targets:
        ap.error(f"--targets: unknown {unknown} (flat, peaked, standin)" if unknown
                 else "--targets names no target")
    if not torch.cuda.is_available():
        print("bench_spec needs a CUDA GPU", file=sys.stderr)
        return 2
    args.batches = [int(b) for b in args.batches.split(",")]
    args.windows = [int(w) for w in args.windows.split(",")]
    args.paths = [p for p in args.paths.split(",") if p]
    args.conditional = {"auto": None, "on": True, "off": False}[args.conditional]
    args.loop = {"auto": None, "on": True, "off": False}[args.loop]
    torch.backends.cuda.matmul.allow_tf32 = False
    config, _, _ = load_variant("1.7b-customvoice")
    cfg = ModelConfig.from_official(config)
    ifnodes = conditional_nodes_available() if args.conditional is None else args.conditional
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; conditional IF nodes: "
          f"{'available' if conditional_nodes_available() else 'NOT available'}, "
          f"{'used' if ifnodes else 'not used'} (rounds after all rows finish "
          f"{'are skipped' if ifnodes else 'run in full'}); WHILE nodes (step driver): "
          f"{'available' if while_nodes_available() else 'NOT available'}")  # fmt: skip
    if while_nodes_available():  # the probe (TTSBUILD_WHILE_EDGES=auto) or the forced mode
        print(f"WHILE bodies: programmatic edges {'made full' if full_edges() else 'kept'}")
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "conditional_nodes": ifnodes, "args": {k: v for k, v in vars(args).items()}}
    t0 = time.time()
    status = greedy_check(cfg, args.windows, args.exact) if args.greedy_check else 0
    def target(standin: bool = False):
        fcp = build(cfg, torch.bfloat16, fp8=False, standin=standin)
        assert all(isinstance(h, Dense) for h in fcp.heads)
        if "persistent" in args.paths:
            fcp.enable_persistent(max(args.batches))
        return fcp

    with torch.no_grad():
        if "flat" in args.targets or "peaked" in args.targets:
            fcp = target()
            if "flat" in args.targets:
                bench_target(fcp, "flat", args, results)
            if "peaked" in args.targets and args.peaked:
                peak(fcp, args.peaked)
                bench_target(fcp, f"peaked x{args.peaked:g}", args, results)
            del fcp
        if "standin" in args.targets:
            bench_target(target(standin=True), "standin", args, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'spec.json'} in {time.time() - t0:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
