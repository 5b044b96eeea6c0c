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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ttsbuild.runtime.loader import LANE_KERNEL_PLAN, lane_kernel_default
from ttsbuild.runtime.plan import (
    DEFAULT_BF16_MIN_ROWS,
    DEFAULT_CP_BF16_MIN_ROWS,
    DEFAULT_CP_W8A8_MIN_ROWS,
    DEFAULT_FUSED_CP_MAX_BATCH,
    DEFAULT_LANE_RESERVED_SMS,
    DEFAULT_W8A8_MIN_ROWS,
    EnginePlan,
    default_prefill_batches,
)

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
    # "BxT" -> ms of one prefill step of B prompts of bucket T (B > 1 where the plan has it)
    prefill_batch_ms: dict[str, float] = field(default_factory=dict)
    frame_ms: dict[int, float] = field(default_factory=dict)  # batch -> whole frame graph
    talker_ms: dict[int, float] = field(default_factory=dict)
    code_predictor_ms: dict[int, float] = field(default_factory=dict)
    codec_ms: dict[int, float] = field(default_factory=dict)  # one new frame per row
    frames_call_wall_ms: dict[int, float] = field(default_factory=dict)  # launch + read at once
    # Pipelined steps (launch t+1, then read t): wall per step, GPU per step, their difference.
    step_wall_ms: dict[int, float] = field(default_factory=dict)
    step_gpu_ms: dict[int, float] = field(default_factory=dict)
    host_overhead_ms: dict[int, float] = field(default_factory=dict)
    first_chunk_ms: float = 0.0  # new request -> first 1-frame PCM chunk in host memory
    first_chunk_p90_ms: float = 0.0
    first_chunk_gpu_ms: float = 0.0  # GPU time of its prefill + frame + codec
    first_chunk_host_ms: float = 0.0  # median of (wall - GPU) per request
    # ...with the request resolved (tokenized, its prompt laid out) before the clock starts,
    # as a server does at its edge before the engine sees it (host_resolve, timed apart)
    first_chunk_host_resolved_ms: float = 0.0
    # medians: host time resolving the request (tokenize, lay out the prompt; before
    # 2026-12-03 host_admit included it), in admit, in the launch calls (prefill, frames,
    # audio), in the read
    # (wait + copy); GPU time of the prefill, the frame and the codec step (events between)
    first_chunk_parts_ms: dict[str, float] = field(default_factory=dict)
    # engine.resolve of the same request back to back (caches warm), median: against
    # host_resolve above (each after a GPU round trip), what the host's cold start costs
    host_resolve_hot_ms: float = 0.0
    # engine.resolve of the shipped voice-agent prompts, each seen for the first time (after
    # the tokenizer's warm_words, as the server's warm-up does), median: new words and
    # lengths, as a harness's own prompts bring them
    host_resolve_fresh_ms: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)  # GiB by kind, measured
    # the weight-only FP8 kernel's autotuned picks in this process (`fp8_linear.autotuned`:
    # rows, N, K, gate_up, config), after the run: processes of one plan compared pick by pick
    autotuned: list[dict] = field(default_factory=list)
    # "B" (and "B lane": the admission lane on, where the plan has one; timed in the same
    # engine) -> median / max ms from a new request to its first 1-frame PCM chunk while B
    # other rows step (`first_chunk_under_load`): what serving adds to the above
    first_chunk_load_ms: dict[str, tuple[float, float]] = field(default_factory=dict)


FIRST_CHUNK_PARTS = ("host_resolve", "host_admit", "host_launch", "host_read",
                     "gpu_wait_staging", "gpu_prefill", "gpu_frame", "gpu_codec")


def _time_graph(graph, iters: int, before=None, stat=statistics.median) -> float:
    """`stat` (median) of `iters` replays' ms (CUDA events around each); before(i), where
    given, runs ahead of replay i's start event (untimed: e.g. new inputs)."""
    times = []
    for i in range(iters):
        if before is not None:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return stat(times)


def _pipelined_steps(engine, slots: list[int], steps: int) -> tuple[float, float]:
    """(wall ms per step, GPU ms per step) of `steps` frame steps launched one ahead of
    reading, with the codec keeping up every 8 steps (as serving does)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    pending = None
    for i in range(steps):
        ticket = engine.launch_frames(slots)
        if pending is not None:
            engine.collect(pending)
        pending = ticket
        if i % 8 == 7:
            engine.audio(slots)
    engine.collect(pending)
    end.record()
    wall = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return wall / steps, start.elapsed_time(end) / steps


def first_chunk_under_load(engine, load_req, new_req, load: int, n: int = 10,
                           steps_between: int = 3, first_frames: int = 1) -> list[float]:
    """ms from admitting `new_req` to its first PCM chunk of `first_frames` frames (2: a real
    CustomVoice checkpoint's, whose silent first frame is dropped; the second frame is a step
    of its own right after the first, as the server's express turn makes it, on the lane with
    plan.lane_frames 2) in host memory while `load`
    rows of `load_req` keep stepping, n times. As the serving loop does it: frame steps are
    launched one ahead of reading, so a step of the load is in flight when the request
    arrives; the request is prefilled and joins the next frame step (on the admission lane,
    where the plan has one, beside it), then gets a one-frame codec step. The load's audio is
    decoded between arrivals (not timed)."""
    load_slots = [engine.admit(load_req) for _ in range(load)]
    if load_slots:
        engine.prefill(load_slots)
    pending = engine.launch_frames(load_slots) if load_slots else None
    walls = []
    for i in range(n):
        if load_slots:
            for _ in range(steps_between):  # one step of the load stays in flight
                nxt = engine.launch_frames(load_slots)
                engine.collect(pending)
                pending = nxt
            engine.audio(load_slots)
        t0 = time.perf_counter()
        slot = engine.admit(replace(new_req, seed=i))
        engine.prefill([slot])
        ticket = engine.launch_frames(load_slots + [slot])
        second = engine.launch_frames([slot]) if first_frames > 1 else None
        # frames 0 and 1 are never EOS: known real at launch
        audio = engine.launch_audio([slot], max_frames=first_frames)
        pcm = engine.collect_audio(audio)[slot]
        walls.append((time.perf_counter() - t0) * 1e3)
        if pcm.shape != (1920 * first_frames,):
            raise RuntimeError(f"a first chunk of {pcm.shape[0]} samples, not {first_frames} "
                               "frames")  # fmt: skip
        if pending is not None:
            engine.collect(pending)
        pending = ticket
        if second is not None:  # read in launch order; the load's next step launched anew
            engine.collect(pending)
            engine.collect(second)
            pending = engine.launch_frames(load_slots) if load_slots else None
        engine.release(slot)  # its row of the step in flight is dropped when read
    if pending is not None:
        engine.collect(pending)
    for s in load_slots:
        engine.release(s)
    return walls


def bench_plan(
    precision: str, batches, fused_code_predictor: bool = True, persistent_cp_max_batch: int = 0,
    fused_talker_max_batch: int = 0, w8a8_min_rows: int | None = None, prefill_batches=None,
    bf16_min_rows: int | None = None, admission_lane: tuple[int, ...] = (1, 2),
    lane_reserved_sms: int | None = None,
    lane_frames: int = 1,
    plan_set: dict | None = None,
) -> EnginePlan:
    """The plan the benchmark runs random weights under: a bucket for every batch measured,
    the code predictor on the fused kernels up to DEFAULT_FUSED_CP_MAX_BATCH rows as
    `EnginePlan.default` and compile run it (fused_code_predictor=False: the unfused path
    everywhere); bf16_min_rows,
    w8a8_min_rows and lane_reserved_sms None: as served (DEFAULT_BF16_MIN_ROWS and
    DEFAULT_W8A8_MIN_ROWS for FP8, DEFAULT_LANE_RESERVED_SMS with a lane; the code
    predictor's W8A8 from DEFAULT_CP_W8A8_MIN_ROWS and its bf16 copies from
    DEFAULT_CP_BF16_MIN_ROWS for FP8), prefill_batches
    None: as served (`default_prefill_batches`). An FP8 plan has the talker's cache in FP8
    as compile gives a calibrated FP8 engine (not beside the one-kernel talker paths, which
    have none; {"talker_kv_fp8": False} in plan_set: bf16). plan_set: more EnginePlan fields,
    e.g. {"codec_fused_output": True}."""
    num_slots = max(batches)
    if prefill_batches is None:
        prefill_batches = default_prefill_batches(num_slots)
    if bf16_min_rows is None:
        bf16_min_rows = DEFAULT_BF16_MIN_ROWS if precision == "fp8" else 0
    if w8a8_min_rows is None:
        w8a8_min_rows = DEFAULT_W8A8_MIN_ROWS if precision == "fp8" else 0
    buckets = tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, *batches) if b <= num_slots}))
    fields = dict(
        num_slots=num_slots,
        max_len=1024,
        max_text=512,
        batch_buckets=buckets,
        prefill_buckets=(32, 64, 128, 256),
        precision=precision,
        codec_precision="fp16",
        fused_code_predictor=tuple(b for b in buckets if b <= DEFAULT_FUSED_CP_MAX_BATCH)
        if fused_code_predictor else (),
        persistent_code_predictor=tuple(b for b in buckets if b <= persistent_cp_max_batch),
        fused_talker=tuple(b for b in buckets if b <= fused_talker_max_batch),
        w8a8_min_rows=w8a8_min_rows,
        cp_w8a8_min_rows=DEFAULT_CP_W8A8_MIN_ROWS if precision == "fp8" else 0,
        cp_bf16_min_rows=DEFAULT_CP_BF16_MIN_ROWS if precision == "fp8" else 0,
        prefill_batches=tuple(prefill_batches),
        # (no lane under a persistent code predictor: it needs every SM, EnginePlan refuses both)
        admission_lane=(lane := tuple(b for b in buckets if b in admission_lane
                                      and not persistent_cp_max_batch)),
        # (none beside the one-kernel talker step: it needs every SM, EnginePlan refuses both)
        lane_reserved_sms=(DEFAULT_LANE_RESERVED_SMS
                           if lane and not (plan_set or {}).get("talker_megastep") else 0)
        if lane_reserved_sms is None else lane_reserved_sms,
        bf16_min_rows=bf16_min_rows,
        lane_frames=lane_frames if lane else 1,
        # the FP8 talker cache, as compile makes a calibrated FP8 engine (the stand-in's k/v
        # scales measured in `bench_precision`); the one-kernel talker step has none
        talker_kv_fp8=precision == "fp8" and not (plan_set or {}).get("talker_megastep"),
    )
    return EnginePlan(**{**fields, **(plan_set or {})})  # plan_set overrides any field


def _profile_host(engine, be, log, n: int = 10) -> None:
    """Where the host time of a new request's first chunk goes (admit, prefill and launches,
    the read excluded): cProfile over n requests, the top functions by own time. cProfile
    slows Python down, so read the shares, not the times."""
    import cProfile
    import io
    import pstats

    from ttsbuild.runtime.request import SynthesisRequest

    prof = cProfile.Profile()
    for i in range(n):
        torch.cuda.synchronize()
        prof.enable()
        slot = engine.admit(SynthesisRequest(text=TEXT[:60], voice="ryan", seed=1000 + i))
        engine.prefill([slot])
        ticket = engine.launch_frames([slot])
        audio = engine.launch_audio([slot], max_frames=1)
        prof.disable()
        engine.collect_audio(audio)
        engine.collect(ticket)
        engine.release(slot)
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = stats.total_tt / n * 1e3
    # microseconds per request (pstats prints seconds to 3 decimals: all zeros at this scale)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:16]
    lines = [f"{'own us':>8} {'total us':>9} {'calls':>6}  function"]
    for (path, line, name), (_, calls, own, cum, _) in rows:
        where = f"{path.rsplit('/', 2)[-1]}:{line}" if line else path
        lines.append(f"{own / n * 1e6:8.1f} {cum / n * 1e6:9.1f} {calls / n:6.1f}  {name} "
                     f"({where})")  # fmt: skip
    log(f"host profile of admit + prefill + launches ({total:.2f} ms per request under "
        f"cProfile, which slows Python ~2x), top functions by own time, per request:\n"
        + "\n".join(lines))


def bench_precision(models, plan: EnginePlan, batches, iters: int, log, release_modules=False,
                    first_frames: int = 1, context: int = 0):  # fmt: skip
    from ttsbuild.plugins._tl.fp8_linear import autotuned
    from ttsbuild.runtime.graph_engine import GraphEngine, _capture
    from ttsbuild.runtime.request import SynthesisRequest

    precision = plan.precision
    if not 0 <= context < plan.max_len:
        raise ValueError(f"--context {context}: a position of the plan's cache, 0 (after the "
                         f"prompt) to {plan.max_len - 1}")  # fmt: skip
    kv_scales = None
    if plan.talker_kv_fp8 and models.packed is None:
        # the stand-in's k/v scales as a calibration takes them (amax over a reference
        # generation, / 448), measured before the engine drops the decoder layers
        from ttsbuild.calibration.calibrate import kv_scales_range, measure_kv_scales

        kv_scales = measure_kv_scales(models, [TEXT, TEXT[:80]], max_frames=32)
        log(f"[{precision}] FP8 KV cache: k/v scales measured on the stand-in, "
            f"{kv_scales_range(kv_scales)}")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine = GraphEngine(models, plan, release_modules=release_modules, kv_scales=kv_scales)
    be = engine.backend
    ready_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    log(f"[{precision}] engine ready in {ready_s:.1f} s: {be.capture_summary}")
    log(f"[{precision}] plan: {plan.summary()}")
    gib = 2.0**30
    mem = be.memory_report()
    res = PrecisionResult(
        precision,
        talker_weight_bytes=be.talker_stack.read_bytes() + be.codec_head.nbytes(),
        # Each of the 15 passes reads the whole stack and one head.
        code_predictor_weight_bytes_per_frame=(models.cfg.num_code_groups - 1)
        * be.cp_stack.read_bytes()
        + sum(h.nbytes() for h in be.cp_heads),
        memory={
            **{k: v / gib for k, v in mem.items()},
            "engine_allocated": (torch.cuda.memory_allocated() - base) / gib,
            "process_allocated": torch.cuda.memory_allocated() / gib,
            "process_reserved": torch.cuda.memory_reserved() / gib,
        },
    )
    log(f"[{precision}] memory GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in res.memory.items()))
    pool = torch.cuda.graph_pool_handle()

    for t in plan.prefill_buckets:
        res.prefill_ms[t] = _time_graph(be.graphs[("prefill", 1, t)], iters)
        for b in plan.prefill_batches[1:]:
            res.prefill_batch_ms[f"{b}x{t}"] = _time_graph(be.graphs[("prefill", b, t)], iters)

    # A stand-in speaks 3.5 frames per text token: three times TEXT runs ~600 frames.
    req = SynthesisRequest(text=" ".join([TEXT] * 3), voice="ryan", language="english", seed=1,
                           max_frames=800)  # fmt: skip
    for b in batches:
        slots = [engine.admit(req) for _ in range(b)]
        engine.prefill(slots)
        if context:
            # mid-utterance: each row's next token at this position (the cache below it is
            # read whatever it holds: the attention's bytes are a real step's)
            be.position[slots] = context
        be.rows_in[:b] = torch.tensor(slots, device=be.device)
        be.codec_rows_in[:b] = be.rows_in[:b]
        rows = be.rows_in[:b]
        res.frame_ms[b] = _time_graph(be.graphs[("frame", b)], iters)
        talker = _capture(
            lambda rows=rows: be.talker_stack.decode(
                be.hidden[rows], be.kv_k, be.kv_v, rows, be.position[rows]
            ),
            pool,
        )
        res.talker_ms[b] = _time_graph(talker, iters)
        cp = _capture(
            lambda rows=rows: be._code_predictor(
                be.hidden[rows],
                be.codes[rows, 0, 0],
                be.cp_sampling.select(rows),
                be.seed[rows],
                be.frame_idx[rows],
            ),
            pool,
        )
        res.code_predictor_ms[b] = _time_graph(cp, iters)
        res.codec_ms[b] = _time_graph(be.graphs[("codec", b, 1)], iters)
        walls = []
        for _ in range(min(iters, 20)):
            t1 = time.perf_counter()
            engine.frames(slots)
            walls.append((time.perf_counter() - t1) * 1e3)
            engine.audio(slots)
        res.frames_call_wall_ms[b] = statistics.median(walls)
        pipelined = [_pipelined_steps(engine, slots, 40) for _ in range(5)]
        pipelined.sort(key=lambda wg: wg[0] - wg[1])
        wall, gpu = pipelined[len(pipelined) // 2]
        res.step_wall_ms[b], res.step_gpu_ms[b] = wall, gpu
        res.host_overhead_ms[b] = wall - gpu
        for s in slots:
            engine.release(s)
        log(
            f"[{precision}] batch {b}: frame {res.frame_ms[b]:.2f} ms "
            f"(talker {res.talker_ms[b]:.2f}, code predictor {res.code_predictor_ms[b]:.2f}), "
            f"codec {res.codec_ms[b]:.2f} ms, frames() wall {res.frames_call_wall_ms[b]:.2f} ms, "
            f"pipelined step wall {wall:.3f} / GPU {gpu:.3f} ms (host {wall - gpu:+.3f})"
        )

    firsts, gpus, hosts, resolved_hosts = [], [], [], []
    parts: dict[str, list[float]] = {k: [] for k in FIRST_CHUNK_PARTS}
    for i in range(20):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        t0 = time.perf_counter()
        resolved = engine.resolve(SynthesisRequest(text=TEXT[:60], voice="ryan", seed=i))
        t0r = time.perf_counter()
        slot = engine.admit(resolved)  # claims a slot: what the engine thread does in serving
        t1 = time.perf_counter()
        ev[0].record()
        be.trace = []
        engine.prefill([slot])
        # With the admission lane the prefill, frame and codec step run on its stream: the
        # current stream follows each (it runs nothing else) so the events split the parts.
        done = be.fresh.get(slot)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        ev[1].record()
        start = be.trace[0]  # the prefill's first kernel queued: its inputs are staged
        be.trace = None
        ticket = engine.launch_frames([slot])  # frame 0 cannot be EOS: the codec need not wait
        be.driver.device_wait([ticket.handle.ticket])  # one row: one step, on either lane
        ev[2].record()
        audio = engine.launch_audio([slot], max_frames=1)
        # The codec runs on its own lane: the current stream waits for it, so the last event
        # ends after the codec step (recorded right after launch_audio it would not).
        be.driver.device_wait([h.ticket for _, h in audio.launched])
        ev[3].record()
        t2 = time.perf_counter()
        pcm = engine.collect_audio(audio)[slot]  # in host memory on return
        t3 = time.perf_counter()
        ev[3].synchronize()
        assert pcm.shape == (1920,), pcm.shape
        engine.collect(ticket)
        # GPU time: from the prefill's first kernel, so the time the GPU waits while the host
        # stages the prompt counts as host time (gpu_wait_staging), not as prefill.
        wall, gpu = (t3 - t0) * 1e3, start.elapsed_time(ev[3])
        firsts.append(wall)
        gpus.append(gpu)
        hosts.append(wall - gpu)
        resolved_hosts.append((t3 - t0r) * 1e3 - gpu)
        for k, v in zip(FIRST_CHUNK_PARTS, (
                (t0r - t0) * 1e3, (t1 - t0r) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                ev[0].elapsed_time(start),
                start.elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), ev[2].elapsed_time(ev[3])),
                strict=True):
            parts[k].append(v)
        engine.release(slot)
    try:  # auxiliary: never lose the measurements above to it
        _profile_host(engine, be, log)
    except Exception as exc:  # noqa: BLE001
        log(f"host profile failed: {exc!r}")
    res.first_chunk_parts_ms = {k: statistics.median(v) for k, v in parts.items()}
    firsts.sort()
    res.first_chunk_ms = statistics.median(firsts)
    res.first_chunk_p90_ms = firsts[int(0.9 * (len(firsts) - 1))]
    res.first_chunk_gpu_ms = statistics.median(gpus)
    res.first_chunk_host_ms = statistics.median(hosts)
    res.first_chunk_host_resolved_ms = statistics.median(resolved_hosts)
    hot = []
    for i in range(200):
        t0 = time.perf_counter()
        engine.resolve(SynthesisRequest(text=TEXT[:60], voice="ryan", seed=i))
        hot.append((time.perf_counter() - t0) * 1e3)
    res.host_resolve_hot_ms = statistics.median(hot)
    res.host_resolve_fresh_ms = _resolve_fresh_ms(engine)
    new_req = SynthesisRequest(text=TEXT[:60], voice="ryan", seed=0)
    lanes = (False, True) if plan.admission_lane else (False,)
    for load in sorted({min(b, plan.max_batch - 1) for b in batches} - {0}):
        for lane in lanes:  # side by side in one engine: the lane switched off, then on
            engine.backend.lane_on = lane
            walls = first_chunk_under_load(engine, req, new_req, load, n=min(iters, 20),
                                           first_frames=first_frames)  # fmt: skip
            key = f"{load}{' lane' if lane else ''}"
            res.first_chunk_load_ms[key] = (statistics.median(walls), max(walls))
            log(f"[{precision}] first chunk beside {load} stepping rows"
                f"{', admission lane' if lane else ''}: median {statistics.median(walls):.2f} "
                f"ms, max {max(walls):.2f} ms")
    engine.backend.lane_on = bool(plan.admission_lane)
    res.autotuned = autotuned()
    if res.autotuned:
        log(f"[{precision}] weight-only FP8 autotuned picks (rows N x K: BLOCK_N x BLOCK_K "
            "split / warps / stages): " + "; ".join(_pick(e) for e in res.autotuned))
    return res


def _pick(e: dict) -> str:
    c = e["config"]
    return (f"{e['rows']} {e['N']}x{e['K']}{' gate_up' if e['gate_up'] else ''}"
            f"{' M ' + str(e['M']) if 'M' in e else ''}: {c['BLOCK_N']}x{c['BLOCK_K']} "
            f"s{c['SPLIT_K']} w{c['num_warps']} st{c['num_stages']}")


def _resolve_fresh_ms(engine, prompts: int = 200) -> float:
    """Median ms of engine.resolve over the shipped voice-agent prompts, each the first time
    (the tokenizer's word table warmed as the server's warm-up warms it)."""
    from ttsbuild.bench.schedule import load_prompts
    from ttsbuild.runtime.request import SynthesisRequest

    warm = getattr(engine.models.tokenizer, "warm_words", None)
    if warm is not None:
        warm()
    times = []
    for i, text in enumerate(load_prompts("voice-agent")[:prompts]):
        t0 = time.perf_counter()
        engine.resolve(SynthesisRequest(text=text, voice="ryan", seed=i))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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
    from ttsbuild.runtime.graph_engine import GraphEngine
    from ttsbuild.runtime.request import SynthesisRequest

    plan = bench_plan(precision, tuple(b for b in batches if b <= num_slots))
    engines = {"off": GraphEngine(models, plan, guards=GUARDS_OFF),
               "on": GraphEngine(models, plan, guards=GuardConfig())}  # fmt: skip
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
                be = engine.backend
                be.rows_in[:b] = torch.tensor(slots[name], device=be.device)
                be.codec_rows_in[:b] = be.rows_in[:b]
                frame[name].append(_time_graph(be.graphs[("frame", b)], per_round))
                codec[name].append(_time_graph(be.graphs[("codec", b, 1)], per_round))
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
    plan: EnginePlan | None = None,
    fused_code_predictor: bool = True,
    persistent_cp_max_batch: int = 0,
    fused_talker_max_batch: int = 0,
    w8a8_min_rows: int | None = None,
    prefill_batches=None,
    bf16_min_rows: int | None = None,
    admission_lane: tuple[int, ...] = (1, 2),
    lane_reserved_sms: int | None = None,
    first_frames: int = 1,
    plan_set: dict | None = None,
    context: int = 0,
) -> dict:
    """Random weights: one engine per precision, side by side. A compiled engine (`plan` from
    its manifest): that engine only, its weights as compiled and never kept twice."""
    if not torch.cuda.is_available():
        raise RuntimeError("the engine microbenchmark needs a CUDA GPU")
    results = []
    if plan is not None:
        batches = tuple(b for b in batches if b <= plan.max_batch)
        results.append(bench_precision(models, plan, batches, iters, log, release_modules=True,
                                       first_frames=first_frames, context=context))  # fmt: skip
    for p in precisions if plan is None else ():
        p_plan = bench_plan(
            p, batches, fused_code_predictor, persistent_cp_max_batch, fused_talker_max_batch,
            w8a8_min_rows, prefill_batches, bf16_min_rows, admission_lane, lane_reserved_sms,
            lane_frames=first_frames, plan_set=plan_set,
        )
        if lane_reserved_sms is None and not set(LANE_KERNEL_PLAN) & set(plan_set or {}):
            # as served: a checkpoint's FP8 plan on a Hopper GPU takes the lane kernel
            p_plan = lane_kernel_default(p_plan, models.cfg, torch.device("cuda"))
        # The last engine frees what it packed (the decoder layers; the checkpoint's codec
        # goes to host memory) as a served engine does, so its memory report is the served one.
        results.append(bench_precision(models, p_plan, batches, iters, log,
                                       release_modules=p == precisions[-1],
                                       first_frames=first_frames, context=context))  # fmt: skip
        torch.cuda.empty_cache()  # the engine (KV cache, graphs) is gone: return its memory
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "context": context or "after the prompt",
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
        "| frames() wall ms | pipelined step wall / GPU ms | host ms per step "
        "| weight GB/s (frame) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per_frame_bytes = r.talker_weight_bytes + r.code_predictor_weight_bytes_per_frame
        for b, ms in r.frame_ms.items():
            gbs = per_frame_bytes / (ms * 1e-3) / 1e9
            lines.append(
                f"| {r.precision} | {b} | {ms:.2f} | {r.talker_ms[b]:.2f} | "
                f"{r.code_predictor_ms[b]:.2f} | {r.codec_ms[b]:.2f} | "
                f"{r.frames_call_wall_ms[b]:.2f} | {r.step_wall_ms[b]:.3f} / "
                f"{r.step_gpu_ms[b]:.3f} | {r.host_overhead_ms[b]:+.3f} | {gbs:.0f} |"
            )
    lines.append("")
    for r in results:
        floor = (r.talker_weight_bytes + r.code_predictor_weight_bytes_per_frame) / HBM_BYTES_PER_S
        pre = ", ".join(f"{t}: {ms:.2f}" for t, ms in r.prefill_ms.items())
        load = ", ".join(f"{b}: {m:.2f} / {x:.2f}" for b, (m, x) in r.first_chunk_load_ms.items())
        if r.prefill_batch_ms:  # B prompts of bucket T in one step
            pre += "; " + ", ".join(f"{k}: {ms:.2f}" for k, ms in r.prefill_batch_ms.items())
        lines.append(
            f"{r.precision}: weight-read floor per frame {floor * 1e3:.2f} ms; prefill ms by "
            f"prompt bucket {{{pre}}}; new request -> first 1-frame PCM chunk "
            f"{r.first_chunk_ms:.2f} ms (p90 {r.first_chunk_p90_ms:.2f}; GPU "
            f"{r.first_chunk_gpu_ms:.2f}, host beyond GPU {r.first_chunk_host_ms:.2f}, "
            f"{r.first_chunk_host_resolved_ms:.2f} from a request resolved at the edge; medians "
            f"{', '.join(f'{k} {v:.2f}' for k, v in r.first_chunk_parts_ms.items())}; "
            f"host_resolve back to back {r.host_resolve_hot_ms:.3f}, first-seen voice-agent "
            f"prompts {r.host_resolve_fresh_ms:.3f}); "
            f"beside B stepping rows, median / max ms: {{{load}}}; "
            f"memory GiB {', '.join(f'{k} {v:.2f}' for k, v in r.memory.items())}"
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
    p.add_argument("--engine-dir", type=Path, default=None, help="a compiled engine instead")
    p.add_argument("--fused-code-predictor", action=argparse.BooleanOptionalAction, default=True,
                   help="the fused code predictor on buckets <= 8, as served (default on)")
    p.add_argument("--persistent-cp-max-batch", type=int, default=0,
                   help="buckets up to this run the persistent code-predictor pass")
    p.add_argument("--fused-talker-max-batch", type=int, default=0,
                   help="buckets up to this run the talker step on the fused kernels")
    p.add_argument("--w8a8-min-rows", type=int, default=None,
                   help="the talker's FP8 linears as W8A8 from this many rows (0: never; "
                   "default: the plan's)")
    p.add_argument("--bf16-min-rows", type=int, default=None,
                   help="the talker's FP8 linears on bf16 copies from this many rows "
                   "(0: never; default: the plan's)")
    p.add_argument("--prefill-batches", default=None,
                   help="prompts per captured prefill step, e.g. 1 (each timed; default: as "
                   "served, 1,2,4 within the slots)")
    p.add_argument("--admission-lane", default="1,2",
                   help="batch buckets of the admission lane, as served by default (1,2; '' "
                   "for off); the first chunk beside stepping rows is timed with it off and on")
    p.add_argument("--lane-reserved-sms", type=int, default=None,
                   help="SMs kept free of the regular steps for the admission lane (regular "
                   "steps in CUDA green contexts of the others; 0: off; default: as served)")
    p.add_argument("--first-frames", type=int, choices=(1, 2), default=1,
                   help="the first chunk beside stepping rows: 1 frame, or 2 (a real "
                   "CustomVoice checkpoint's, its silent first frame dropped; the plan's "
                   "admission lane then makes both, plan.lane_frames 2)")
    p.add_argument("--context", type=int, default=0,
                   help="time the frames with each row at this position (mid-utterance: the "
                        "talker attends to that many positions); 0: right after the prompt")
    p.add_argument("--plan-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an EnginePlan field for the random-weight engines, VALUE as JSON "
                        "(repeatable), e.g. codec_fused_attention=true")
    a = p.parse_args()
    if a.context < 0:
        p.error(f"--context must be a position >= 0, got {a.context}")
    t0 = time.perf_counter()
    plan = None
    if a.engine_dir is not None:
        from ttsbuild.runtime.artifact import load_models

        models = load_models(a.engine_dir, device="cuda", decoder_layers=False)
        plan = EnginePlan.model_validate(models.manifest["plan"])
    else:
        models = random_models(a.variant, device="cuda")
    print(f"weights on the GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    run_engine_bench(
        models,
        a.precisions.split(","),
        tuple(int(b) for b in a.batches.split(",")),
        a.iters,
        a.out,
        log=lambda s: print(s, flush=True),
        plan=plan,
        fused_code_predictor=a.fused_code_predictor,
        persistent_cp_max_batch=a.persistent_cp_max_batch,
        fused_talker_max_batch=a.fused_talker_max_batch,
        w8a8_min_rows=a.w8a8_min_rows,
        prefill_batches=None if a.prefill_batches is None
        else tuple(int(b) for b in a.prefill_batches.split(",")),
        bf16_min_rows=a.bf16_min_rows,
        admission_lane=tuple(int(b) for b in a.admission_lane.split(",") if b),
        lane_reserved_sms=a.lane_reserved_sms,
        first_frames=a.first_frames,
        plan_set=parse_plan_set(a.plan_set),
        context=a.context,
    )


def parse_plan_set(items: list[str]) -> dict:
    """--plan-set FIELD=VALUE (VALUE as JSON: true, 8, "fp16", [1, 2]) -> {field: value},
    checked against EnginePlan's fields."""
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or field not in EnginePlan.model_fields:
            raise SystemExit(f"--plan-set wants FIELD=VALUE with an EnginePlan field, got {item!r}")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            raise SystemExit(f"--plan-set {field}: {value!r} is not JSON") from None
    return out


if __name__ == "__main__":
    main()
