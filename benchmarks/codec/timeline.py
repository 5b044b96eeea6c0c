"""A timeline of frame steps and codec steps under a mixed load: does the codec overlap the
language models, and does it ever hold a language-model step back? (issue 10, item 3)

One GraphEngine (1.7B CustomVoice random-weight shapes by default), 32 streams kept active:
a frame step is launched for every active stream each iteration, one step ahead of reading
the last; each stream decodes its audio in the low-latency chunk sizes (1, 2, 4, 8, then 8)
as its frames arrive; a stream that finished is released and a new request (a voice-agent
prompt) is admitted and prefilled in its slot. Audio is read back only once its step is done
(polled), as a server that never blocks its frame loop on the codec would.

The same load runs twice on the same engine: the codec on its own stream (the default), and
both stages on one stream (the engine before issue 10 item 3: codec_stream=False). The step
driver records CUDA events around every step on its own stream (after the step's waits and
input copies). Printed per mode: wall time per iteration, the share of codec GPU time that
overlaps frame steps, frame step time with and without a codec step running beside it, and the
frame steps held back by a codec step: on one stream, a codec step ran between it and the
previous frame step; on two, it had to wait for a codec step (a ring entry it overwrites)
that ended after the previous frame step. Writes timeline.json and timeline.png under --out.

    python3 benchmarks/codec/timeline.py --out $OUT/timeline          # H200: ~1-2 min (est.)
    python3 benchmarks/codec/timeline.py --variant tiny --device cpu --iters 30   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CHUNKS = (1, 2, 4, 8)  # the low-latency profile's schedule (12 decodes as 8 + 4 here)


@dataclass
class Step:
    kind: str  # "frame" or "codec"
    ticket: int
    rows: int
    frames: int  # frames per row (1 for a frame step)
    start_ms: float = 0.0
    end_ms: float = 0.0
    after: list[int] = field(default_factory=list)  # steps of the other stream it waited for


class Recorder:
    """The engine's step driver with each launch's ticket, lane and `after` kept."""

    def __init__(self, driver):
        self.driver = driver
        self.after: dict[int, list[int]] = {}
        self.cpu_times: dict[int, tuple[float, float]] = {}
        self.t0 = time.perf_counter()

    def launch(self, step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane=0, after=()):
        t1 = time.perf_counter()
        ticket = self.driver.launch(step, h2d_src, h2d_dst, d2h_src, d2h_dst, lane, list(after))
        if not self.driver.cuda:  # CPU steps run inside launch()
            self.cpu_times[ticket] = ((t1 - self.t0) * 1e3, (time.perf_counter() - self.t0) * 1e3)
        self.after[ticket] = list(after)
        return ticket

    def times(self, ticket: int) -> tuple[float, float]:
        if self.driver.cuda:
            return tuple(self.driver.step_times(ticket))
        return self.cpu_times.pop(ticket)

    def __getattr__(self, name):
        return getattr(self.driver, name)


class Load:
    """32 streams (by default) kept active with voice-agent prompts; see the module doc."""

    def __init__(self, engine, streams: int, seed: int):
        from ttsbuild.bench.voice_agent_prompts import generate

        self.engine = engine
        self.prompts = [r["text"] for r in generate()]
        self.next_prompt = seed
        self.chunk_index: dict[int, int] = {}
        self.streams = streams
        self.admitted = 0

    def admit(self, count: int) -> list[int]:
        from ttsbuild.runtime.request import SynthesisRequest

        slots = []
        for _ in range(count):
            text = self.prompts[self.next_prompt % len(self.prompts)]
            self.next_prompt += 1
            req = SynthesisRequest(text=text, voice="ryan", language="english",
                                   seed=self.next_prompt)  # fmt: skip
            slot = self.engine.admit(req)
            self.chunk_index[slot] = 0
            slots.append(slot)
        self.admitted += len(slots)
        return slots

    def chunk(self, slot: int) -> int:
        return CHUNKS[min(self.chunk_index[slot], len(CHUNKS) - 1)]


def run_mode(engine, recorder: Recorder, two_streams: bool, iters: int, streams: int, seed: int):
    """Runs the load for `iters` frame steps; returns the timed steps and the wall time."""
    be = engine.backend
    if two_streams:
        be.codec_stream, be.lm_lane, be.codec_lane = True, recorder.lm_lane, recorder.codec_lane
    else:  # the old engine: both stages on the caller's stream, no events between them
        be.codec_stream, be.lm_lane, be.codec_lane = False, 0, 0
    load = Load(engine, streams, seed)
    engine.prefill(load.admit(streams))
    steps: list[Step] = []
    audio_in_flight: list = []  # AudioTickets, oldest first
    pending = None

    def collect_audio(force: bool):
        while audio_in_flight:
            ticket = audio_in_flight[0]
            done = all(be.driver.ready(h.ticket) for _, h in ticket.launched)
            if not (done or force):
                return
            engine.collect_audio(audio_in_flight.pop(0))
            force = False

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        active = [s for s in load.chunk_index if engine.table[s].can_launch]
        ticket = engine.launch_frames(active) if active else None
        if ticket is not None:
            steps.append(Step("frame", ticket.handle.ticket, len(active), 1))
        if pending is not None:
            engine.collect(pending)
        pending = ticket
        # Codec: each stream whose next chunk's frames are known real, grouped by chunk size.
        by_chunk: dict[int, list[int]] = {}
        for s in load.chunk_index:
            if engine.pending_frames(s) >= load.chunk(s) or (
                engine.is_finished(s) and engine.pending_frames(s) > 0
            ):
                by_chunk.setdefault(min(load.chunk(s), engine.pending_frames(s)), []).append(s)
        for n, group in sorted(by_chunk.items()):
            if sum(len(t.launched) for t in audio_in_flight) > 4:
                collect_audio(force=True)  # the staging ring holds 8 steps in flight
            audio = engine.launch_audio(group, max_frames=n)
            audio_in_flight.append(audio)
            for g, h in audio.launched:
                steps.append(Step("codec", h.ticket, len(g), n))
            for s in group:
                load.chunk_index[s] += 1
        collect_audio(force=False)
        # Finished, decoded and read: a new request takes the slot.
        reading = {s for t in audio_in_flight for s in t.slots}
        done = [s for s in load.chunk_index if engine.is_finished(s)
                and engine.pending_frames(s) == 0 and s not in reading]  # fmt: skip
        if done:
            for s in done:
                engine.release(s)
                del load.chunk_index[s]
            engine.prefill(load.admit(len(done)))
    if pending is not None:
        engine.collect(pending)
    while audio_in_flight:
        collect_audio(force=True)
    wall = time.perf_counter() - t0
    for s in list(load.chunk_index):
        engine.release(s)
    for st in steps:
        st.start_ms, st.end_ms = recorder.times(st.ticket)
        st.after = recorder.after.get(st.ticket, [])
    origin = min(st.start_ms for st in steps)
    for st in steps:
        st.start_ms -= origin
        st.end_ms -= origin
    return steps, wall, load.admitted


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyse(steps: list[Step], wall_s: float, iters: int, one_stream: bool) -> dict:
    frames = sorted((s for s in steps if s.kind == "frame"), key=lambda s: s.start_ms)
    codecs = sorted((s for s in steps if s.kind == "codec"), key=lambda s: s.start_ms)
    codec_spans = _union([(c.start_ms, c.end_ms) for c in codecs])
    frame_spans = _union([(f.start_ms, f.end_ms) for f in frames])
    codec_busy = sum(b - a for a, b in codec_spans)
    end_of = {s.ticket: s.end_ms for s in steps}
    alone, beside, gaps, held_back = [], [], [], []
    for k, f in enumerate(frames):
        d = f.end_ms - f.start_ms
        concurrent = _overlap([(f.start_ms, f.end_ms)], codec_spans) > 0
        (beside if concurrent else alone).append(d)
        if k == 0:
            continue
        prev_end = frames[k - 1].end_ms
        gaps.append(max(0.0, f.start_ms - prev_end))
        # One stream: a codec step ran between the previous frame step and this one.
        between = [c.ticket for c in codecs if one_stream and c.start_ms >= prev_end - 1e-3
                   and c.end_ms <= f.start_ms + 1e-3]  # fmt: skip
        # Two streams: it waited for a codec step that ended after the previous frame step.
        waited = [t for t in f.after if end_of.get(t, -1.0) > prev_end + 1e-3]
        if between or waited:
            held_back.append({"frame_ticket": f.ticket, "start_ms": f.start_ms,
                              "codec_tickets": between + waited})  # fmt: skip

    def stats(xs):
        if not xs:
            return None
        xs = sorted(xs)
        p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
        return {"n": len(xs), "median_ms": statistics.median(xs), "p95_ms": p95,
                "mean_ms": statistics.fmean(xs)}  # fmt: skip

    span = max(s.end_ms for s in steps) - min(s.start_ms for s in steps)
    return {
        "iterations": iters,
        "wall_ms_per_iteration": 1e3 * wall_s / iters,
        "gpu_span_ms": span,
        "frame_steps": len(frames),
        "codec_steps": len(codecs),
        "frame_busy_ms": sum(b - a for a, b in frame_spans),
        "codec_busy_ms": codec_busy,
        "codec_overlapped_fraction": _overlap(frame_spans, codec_spans) / codec_busy
        if codec_busy
        else 0.0,
        "frame_step_alone": stats(alone),
        "frame_step_beside_codec": stats(beside),
        "frame_stream_gap": stats(gaps),  # idle time between consecutive frame steps
        "frame_steps_held_back_by_codec": len(held_back),
        "held_back": held_back[:20],
        "codec_step": stats([c.end_ms - c.start_ms for c in codecs]),
    }


def plot(results: dict, path: Path, window_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 2.4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        steps = results[mode]["steps"]
        mid = results[mode]["summary"]["gpu_span_ms"] / 2
        lo, hi = mid - window_ms / 2, mid + window_ms / 2
        for y, kind, color in ((1, "frame", "tab:blue"), (0, "codec", "tab:orange")):
            bars = [(s["start_ms"], s["end_ms"] - s["start_ms"]) for s in steps
                    if s["kind"] == kind and s["end_ms"] >= lo and s["start_ms"] <= hi]  # fmt: skip
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolors="black",
                           linewidth=0.3)  # fmt: skip
        summ = results[mode]["summary"]
        ax.set_xlim(lo, hi)
        ax.set_yticks([0, 1], ["codec", "frame (LM)"])
        ax.set_title(f"{mode}: codec overlapped {summ['codec_overlapped_fraction']:.0%}, "
                     f"frame steps held back by codec: {summ['frame_steps_held_back_by_codec']}",
                     fontsize=10)  # fmt: skip
    axes[-1, 0].set_xlabel("GPU time (ms; a window from the middle of the run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variant", default="1.7b-customvoice")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--iters", type=int, default=400, help="frame steps per mode")
    p.add_argument("--precision", default="fp8", choices=["bf16", "fp8"])
    p.add_argument("--window-ms", type=float, default=120.0, help="span of the PNG")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "timeline")
    a = p.parse_args()

    from ttsbuild.runtime.engine import random_models
    from ttsbuild.runtime.graph_engine import GraphEngine
    from ttsbuild.runtime.plan import EnginePlan, power_of_two_buckets

    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    models = random_models(a.variant, device=a.device)
    cuda = a.device.startswith("cuda")
    buckets = power_of_two_buckets(a.streams)
    plan = EnginePlan(
        num_slots=a.streams, max_len=1024, max_text=512, batch_buckets=buckets,
        prefill_buckets=(32, 64, 128, 256), codec_chunks=CHUNKS, precision=a.precision,
        codec_precision="fp16" if cuda else "fp32",
        fused_code_predictor=tuple(b for b in buckets if b <= 8),
    )  # fmt: skip
    engine = GraphEngine(models, plan, codec_stream=True)
    be = engine.backend
    recorder = be.driver = Recorder(be.driver)
    recorder.lm_lane, recorder.codec_lane = be.lm_lane, be.codec_lane
    print(f"engine ready in {time.perf_counter() - t0:.1f} s ({len(be.graphs)} graphs)", flush=True)
    if cuda:
        recorder.enable_timing(True)
    run_mode(engine, recorder, True, min(20, a.iters), a.streams, seed=999)  # warm-up
    results = {}
    for mode, two in (("codec on its own stream", True), ("one stream (old)", False)):
        steps, wall, admitted = run_mode(engine, recorder, two, a.iters, a.streams, seed=0)
        summary = analyse(steps, wall, a.iters, one_stream=not two)
        summary["requests_admitted"] = admitted
        results[mode] = {"summary": summary, "steps": [asdict(s) for s in steps]}
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"variant": a.variant, "streams": a.streams, "iters": a.iters, "plan": plan.model_dump(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}  # fmt: skip
    (a.out / "timeline.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    plot(results, a.out / "timeline.png", a.window_ms)

    def ms(x, key="median_ms"):
        return "-" if x is None else f"{x[key]:.3f}"

    print(f"\n{a.streams} streams, {a.iters} frame steps per mode, {a.variant} {a.precision}")
    print(
        "| mode | wall ms/iter | codec overlapped | frame step alone (median / p95) | "
        "beside codec (median / p95) | codec step median | gap between frame steps (median / p95) "
        "| frame steps held back by codec |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        s = r["summary"]
        print(
            f"| {mode} | {s['wall_ms_per_iteration']:.2f} | {s['codec_overlapped_fraction']:.0%} | "
            f"{ms(s['frame_step_alone'])} / {ms(s['frame_step_alone'], 'p95_ms')} | "
            f"{ms(s['frame_step_beside_codec'])} / {ms(s['frame_step_beside_codec'], 'p95_ms')} | "
            f"{ms(s['codec_step'])} | {ms(s['frame_stream_gap'])} / "
            f"{ms(s['frame_stream_gap'], 'p95_ms')} | "
            f"{s['frame_steps_held_back_by_codec']} of {s['frame_steps']} |"
        )
    held = results["codec on its own stream"]["summary"]["frame_steps_held_back_by_codec"]
    print(f"\nany LM step delayed by a codec step (own stream): {'YES' if held else 'no'}")
    print(
        f"wrote {a.out / 'timeline.json'} and {a.out / 'timeline.png'}; "
        f"total {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
