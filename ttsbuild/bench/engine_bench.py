"""`ttsbuild bench engine`: where the time of a frame goes, on the GPU, at each batch size.

For each precision (bf16 and fp8 side by side in one process, same weights): prefill time
by prompt length; per-frame time of the whole frame graph and of its parts (talker step,
code predictor loop, codec step for one new frame) at batch 1, 8, 32, 64; time from a new
request to its first 1-frame PCM chunk; host time per `frames()` call; achieved weight-read
bandwidth against the card's HBM bandwidth. GPU times are CUDA-event medians of graph
replays; wall times include the host.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.0e12  # H200 weight-read floor used throughout GPU.md
TEXT = (
    "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background. "
    "It's easy to tell the depth of a well. These days a chicken leg is a rare dish."
)


@dataclass
class PrecisionResult:
    precision: str
    talker_weight_bytes: int
    code_predictor_weight_bytes_per_frame: int
    prefill_ms: dict[int, float] = field(default_factory=dict)  # prompt bucket -> ms
    frame_ms: dict[int, float] = field(default_factory=dict)  # batch -> whole frame graph
    talker_ms: dict[int, float] = field(default_factory=dict)
    code_predictor_ms: dict[int, float] = field(default_factory=dict)
    codec_ms: dict[int, float] = field(default_factory=dict)  # one new frame per row
    frames_call_wall_ms: dict[int, float] = field(default_factory=dict)
    first_chunk_ms: float = 0.0
    first_chunk_p90_ms: float = 0.0


def _time_graph(graph, iters: int) -> float:
    """Median ms of `iters` replays (CUDA events around each)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_precision(models, precision: str, batches, iters: int, num_slots: int, log):
    from ttsbuild.runtime.graph_engine import GraphEngine, RuntimeConfig, _capture
    from ttsbuild.runtime.request import SynthesisRequest

    buckets = tuple(sorted({1, 2, 4, 8, 16, 32, 64, *batches}))
    buckets = tuple(b for b in buckets if b <= num_slots)
    rcfg = RuntimeConfig(
        num_slots=num_slots,
        max_len=1024,
        max_text=512,
        batch_buckets=buckets,
        prefill_buckets=(32, 64, 128, 256),
        precision=precision,
    )
    t0 = time.perf_counter()
    engine = GraphEngine(models, rcfg)
    ready_s = time.perf_counter() - t0
    log(f"[{precision}] engine ready: {len(engine.graphs)} graphs in {ready_s:.1f} s")
    # Each of the 15 passes reads the whole stack and one head.
    cp_bytes = (models.cfg.num_code_groups - 1) * engine.cp_stack.weight_bytes() + sum(
        h.nbytes() for h in engine.cp_heads
    )
    res = PrecisionResult(
        precision,
        talker_weight_bytes=engine.talker_stack.weight_bytes() + engine.codec_head.nbytes(),
        code_predictor_weight_bytes_per_frame=cp_bytes,
    )
    pool = torch.cuda.graph_pool_handle()

    for t in rcfg.prefill_buckets:
        res.prefill_ms[t] = _time_graph(engine.graphs[("prefill", t)], iters)

    req = SynthesisRequest(text=TEXT, voice="ryan", language="english", seed=1, max_frames=400)
    for b in batches:
        slots = [engine.admit(req) for _ in range(b)]
        engine.prefill(slots)
        engine.rows_in[:b] = torch.tensor(slots, device=engine.device)
        rows = engine.rows_in[:b]
        res.frame_ms[b] = _time_graph(engine.graphs[("frame", b)], iters)
        talker = _capture(
            lambda rows=rows: engine.talker_stack.decode(
                engine.hidden[rows], engine.kv_k, engine.kv_v, rows, engine.position[rows]
            ),
            pool,
        )
        res.talker_ms[b] = _time_graph(talker, iters)
        cp = _capture(
            lambda rows=rows: engine._code_predictor(
                engine.hidden[rows],
                engine.codes[rows, 0, 0],
                engine.cp_sampling.select(rows),
                engine.seed[rows],
                engine.frame_idx[rows],
            ),
            pool,
        )
        res.code_predictor_ms[b] = _time_graph(cp, iters)
        res.codec_ms[b] = _time_graph(engine.graphs[("codec", b, 1)], iters)
        walls = []
        for _ in range(min(iters, 20)):
            t1 = time.perf_counter()
            engine.frames(slots)
            walls.append((time.perf_counter() - t1) * 1e3)
            engine.audio(slots)
        res.frames_call_wall_ms[b] = statistics.median(walls)
        for s in slots:
            engine.release(s)
        log(
            f"[{precision}] batch {b}: frame {res.frame_ms[b]:.2f} ms "
            f"(talker {res.talker_ms[b]:.2f}, code predictor {res.code_predictor_ms[b]:.2f}), "
            f"codec {res.codec_ms[b]:.2f} ms, frames() wall {res.frames_call_wall_ms[b]:.2f} ms"
        )

    firsts = []
    for i in range(20):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        slot = engine.admit(SynthesisRequest(text=TEXT[:60], voice="ryan", seed=i))
        engine.prefill([slot])
        engine.frames([slot])
        engine.audio([slot], max_frames=1)  # returns host PCM: synchronised
        firsts.append((time.perf_counter() - t1) * 1e3)
        engine.release(slot)
    firsts.sort()
    res.first_chunk_ms = statistics.median(firsts)
    res.first_chunk_p90_ms = firsts[int(0.9 * (len(firsts) - 1))]
    return res


@dataclass
class GuardTiming:
    """Frame and codec graph times with the guards off and on (same weights, same process)."""

    precision: str
    frame_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # "off"/"on" -> batch
    codec_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # one frame per row


def bench_guards(models, precision: str, batches, iters: int, num_slots: int, log, rounds=5):
    """Two engines, guards off (GUARDS_OFF: only the EOS stop code) and on (the defaults);
    their frame and 1-frame codec graphs replayed in alternating rounds so that clock and
    thermal drift hit both alike; medians of the round medians."""
    from ttsbuild.generation.guards import GUARDS_OFF, GuardConfig
    from ttsbuild.runtime.graph_engine import GraphEngine, RuntimeConfig
    from ttsbuild.runtime.request import SynthesisRequest

    buckets = tuple(b for b in sorted({1, 2, 4, 8, 16, 32, 64, *batches}) if b <= num_slots)
    rcfg = RuntimeConfig(num_slots=num_slots, max_len=1024, max_text=512, batch_buckets=buckets,
                         prefill_buckets=(32, 64, 128, 256), precision=precision)  # fmt: skip
    engines = {"off": GraphEngine(models, rcfg, GUARDS_OFF),
               "on": GraphEngine(models, rcfg, GuardConfig())}  # fmt: skip
    res = GuardTiming(precision, {k: {} for k in engines}, {k: {} for k in engines})
    req = SynthesisRequest(text=TEXT, voice="ryan", language="english", seed=1, max_frames=400)
    per_round = max(3, iters // rounds)
    for b in batches:
        slots = {}
        for name, engine in engines.items():
            slots[name] = [engine.admit(req) for _ in range(b)]
            engine.prefill(slots[name])
        frame, codec = {k: [] for k in engines}, {k: [] for k in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                engine.rows_in[:b] = torch.tensor(slots[name], device=engine.device)
                frame[name].append(_time_graph(engine.graphs[("frame", b)], per_round))
                codec[name].append(_time_graph(engine.graphs[("codec", b, 1)], per_round))
        for name, engine in engines.items():
            res.frame_ms[name][b] = statistics.median(frame[name])
            res.codec_ms[name][b] = statistics.median(codec[name])
            for s in slots[name]:
                engine.release(s)
        log(
            f"[{precision}] batch {b}: frame {res.frame_ms['off'][b]:.3f} ms off, "
            f"{res.frame_ms['on'][b]:.3f} ms on; codec {res.codec_ms['off'][b]:.3f} / "
            f"{res.codec_ms['on'][b]:.3f} ms"
        )
    return res


def format_guard_table(results: list[GuardTiming]) -> str:
    lines = [
        "| precision | batch | frame ms, guards off | on | diff | codec ms (1 frame), off | on "
        "| diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for b, off in r.frame_ms["off"].items():
            on, c_off, c_on = r.frame_ms["on"][b], r.codec_ms["off"][b], r.codec_ms["on"][b]
            lines.append(
                f"| {r.precision} | {b} | {off:.3f} | {on:.3f} | {on - off:+.3f} | "
                f"{c_off:.3f} | {c_on:.3f} | {c_on - c_off:+.3f} |"
            )
    return "\n".join(lines)


def run_guard_bench(
    models, precisions=("bf16", "fp8"), batches=(1, 8, 32, 64), iters: int = 50,
    out_dir: Path | None = None, log=print,
) -> dict:  # fmt: skip
    """`ttsbuild bench engine --compare-guards`: the guards' cost per frame on the GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("the engine microbenchmark needs a CUDA GPU")
    results = []
    for p in precisions:
        results.append(bench_guards(models, p, batches, iters, max(batches), log))
        torch.cuda.empty_cache()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "guards": [asdict(r) for r in results],
    }
    log(format_guard_table(results))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "guard_bench.json").write_text(json.dumps(report, indent=2))
    return report


def run_engine_bench(
    models,
    precisions=("bf16", "fp8"),
    batches=(1, 8, 32, 64),
    iters: int = 50,
    out_dir: Path | None = None,
    log=print,
) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("the engine microbenchmark needs a CUDA GPU")
    num_slots = max(batches)
    results = []
    for p in precisions:
        results.append(bench_precision(models, p, batches, iters, num_slots, log))
        torch.cuda.empty_cache()  # the engine (KV cache, graphs) is gone: return its memory
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "results": [asdict(r) for r in results],
    }
    log(format_table(results))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "engine_bench.json").write_text(json.dumps(report, indent=2))
    return report


def format_table(results: list[PrecisionResult]) -> str:
    lines = [
        "| precision | batch | frame ms | talker ms | code pred. ms | codec ms (1 frame) "
        "| frames() wall ms | weight GB/s (frame) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per_frame_bytes = r.talker_weight_bytes + r.code_predictor_weight_bytes_per_frame
        for b, ms in r.frame_ms.items():
            gbs = per_frame_bytes / (ms * 1e-3) / 1e9
            lines.append(
                f"| {r.precision} | {b} | {ms:.2f} | {r.talker_ms[b]:.2f} | "
                f"{r.code_predictor_ms[b]:.2f} | {r.codec_ms[b]:.2f} | "
                f"{r.frames_call_wall_ms[b]:.2f} | {gbs:.0f} |"
            )
    lines.append("")
    for r in results:
        floor = (r.talker_weight_bytes + r.code_predictor_weight_bytes_per_frame) / HBM_BYTES_PER_S
        pre = ", ".join(f"{t}: {ms:.2f}" for t, ms in r.prefill_ms.items())
        lines.append(
            f"{r.precision}: weight-read floor per frame {floor * 1e3:.2f} ms; prefill ms by "
            f"prompt bucket {{{pre}}}; new request -> first 1-frame PCM chunk "
            f"{r.first_chunk_ms:.2f} ms (p90 {r.first_chunk_p90_ms:.2f})"
        )
    return "\n".join(lines)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def main() -> None:
    import argparse
    import os

    from ttsbuild.runtime.engine import random_models

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variant", default="1.7b-customvoice")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--precisions", default="bf16,fp8")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--compare-guards", action="store_true",
                   help="only time the frame and codec graphs with the guards off and on")
    a = p.parse_args()
    t0 = time.perf_counter()
    models = random_models(a.variant, device="cuda")
    print(f"random {a.variant} weights on the GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    bench = run_guard_bench if a.compare_guards else run_engine_bench
    bench(
        models,
        a.precisions.split(","),
        tuple(int(b) for b in a.batches.split(",")),
        a.iters,
        a.out,
        log=lambda s: print(s, flush=True),
    )


if __name__ == "__main__":
    main()
