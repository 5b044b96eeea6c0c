"""Typer command function for `ttsbuild serve`.

Register it on the main app:
    app.command("serve")(serve)
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

from ttsbuild.serve.config import PROFILES, ProfileName, SchedulerConfig

_err = Console(stderr=True, soft_wrap=True)


def serve(
    checkpoint: Path | None = typer.Argument(
        None, help="A `ttsbuild convert` checkpoint or a `ttsbuild compile` engine directory."
    ),
    random: str | None = typer.Option(
        None, help="Serve in-memory random weights of a variant (e.g. 1.7b-customvoice) "
        "instead of CHECKPOINT: load tests of the real shapes without writing files."
    ),  # fmt: skip
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: all)."),
    port: int = typer.Option(8000, help="TCP port (0: pick a free one)."),
    profile: ProfileName = typer.Option(
        ProfileName.low_latency, help="Chunk schedule and deadline margins: low-latency "
        "[1,1,2,4,8,12] frames, balanced [4,4,8,16,25], throughput [25]."
    ),  # fmt: skip
    chunk_schedule: str = typer.Option(
        None, "--chunk-schedule", help="Frames per audio chunk, e.g. 1,2,4,8 (the last entry "
        "repeats); default: the profile's. A request may still ask for its own."
    ),  # fmt: skip
    device: str | None = typer.Option(None, help="cpu, cuda, cuda:1 (default: cuda if any)."),
    slots: int | None = typer.Option(
        None, help="Engine slots: requests generating at once (default: a compiled engine's "
        "plan, else 256 on a GPU and 8 on a CPU; on a GPU fewer where their KV cache would "
        "not fit in its free memory)."
    ),  # fmt: skip
    max_len: int | None = typer.Option(
        None, help="Positions per slot, prompt + frames (default: the plan's, else 2048)."
    ),
    engine_kind: str = typer.Option(
        "auto", "--engine", help="graph (CUDA graphs), eager (reference), auto (graph on CUDA)."
    ),
    precision: str | None = typer.Option(
        None, help="Graph engine linears: bf16 or fp8 (default: the engine manifest's)."
    ),
    max_queue: int = typer.Option(64, help="Requests waiting for a slot; more get 429."),
    queue_timeout: float = typer.Option(
        SchedulerConfig.queue_timeout_s, min=0.0, help="Seconds a request may wait for a slot "
        "while queues come and go (then 429)."
    ),  # fmt: skip
    overload_wait: float | None = typer.Option(
        None, min=0.0, help="Seconds a request may wait for a slot once a queue stands (see "
        "--standing-queue): default the profile's: "
        + ", ".join(f"{n.value} {p.overload_wait_s:g}" for n, p in PROFILES.items()) + "."
    ),  # fmt: skip
    standing_queue: float = typer.Option(
        SchedulerConfig.standing_queue_s, min=0.0, help="Seconds the request at the head of "
        "the queue must be seen waiting longer than --overload-wait before the queue counts "
        "as standing (overload); it stands until nothing was refused for as long."
    ),  # fmt: skip
    refuse_long_waits: bool = typer.Option(
        True, "--refuse-long-waits/--queue-long-waits", help="A request that would wait "
        "for a slot longer than it may, by the rate slots were freed lately, gets 429 at "
        "once; else it queues and gets 429 when its wait is up."
    ),  # fmt: skip
    max_buffered: float = typer.Option(
        120.0, help="Seconds of produced-but-unsent audio, all streams, above which new "
        "requests get 503."
    ),  # fmt: skip
    admit_by_capacity: bool = typer.Option(
        True, help="Admit a new stream only while the engine, as measured, keeps every "
        "stream in real time with it (an idle engine always takes one); beyond that answer "
        "429 at once."
    ),  # fmt: skip
    capacity_margin: float = typer.Option(
        0.5, min=0.0, help="Headroom admission keeps: streams are admitted while they need "
        "at most 1 / (1 + this) of the engine's measured real-time throughput."
    ),  # fmt: skip
    admit_slack: float = typer.Option(
        0.0, "--admit-slack", min=0.0, help="Seconds: also refuse new streams (429) while an "
        "admitted stream's latest chunk came with less than this to spare before its "
        "playback ran dry (0: only once one came late). H200, 128 slots: 0.04 at 80 req/s kept "
        "p95 first audio at 35.8 ms (161 without) and underrun requests 25 (67), but refused "
        "6 at 40 req/s and 175 at 60 that 0 served (benchmarks/serve/"
        "2026-12-02-h200-admit-slack-128)."
    ),  # fmt: skip
    overload_slack: float = typer.Option(
        SchedulerConfig.overload_slack_s, "--overload-slack", min=0.0, help="Seconds: the "
        "admission slack (see --admit-slack) while requests are being refused (one was in the "
        "last --standing-queue seconds, other than by this slack alone): under overload "
        "admitted streams keep this margin."
    ),  # fmt: skip
    overload_admit_rate: float = typer.Option(
        SchedulerConfig.overload_admit_rate, "--overload-admit-rate", min=0.0, help="While "
        "requests are being refused (as for --overload-slack): accept new streams no faster "
        "than this many times the rate slots were freed over the last 2 s (plus one), so a "
        "burst of arrivals does not start a burst of streams; 0: off. CPU model at 200 req/s, "
        "256 slots, --overload-slack 0.06: late streams 24 -> 10 over 5 runs, as many "
        "admitted; not yet run on a GPU."
    ),  # fmt: skip
    drop_bootstrap_frame: bool | None = typer.Option(
        None, "--drop-bootstrap-frame/--keep-bootstrap-frame",
        help="Drop the silent first frame (default: drop for real checkpoints, keep stand-ins).",
    ),  # fmt: skip
    trim_onset: bool = typer.Option(
        False, help="Also trim leading audio below -45 dBFS (real checkpoints only)."
    ),
    voices_dir: Path | None = typer.Option(
        None, help="Base checkpoints: directory of registered voices (POST /v1/audio/voices), "
        "kept across restarts; without it registered voices live in memory only."
    ),  # fmt: skip
    voice_alias: list[str] = typer.Option(
        [], help="NAME=SPEAKER: OpenAI voice name -> model speaker, repeatable; replaces the "
        "default map (alloy=serena, ash=ryan, ... see README)."
    ),  # fmt: skip
    guards: str = typer.Option(
        "text_budget,repetition,silence", help="Stopping guards for real checkpoints, comma-"
        "separated (none: off): a frame budget from the text, codebook-0 loops, silence after "
        "speech. See README, Guards."
    ),  # fmt: skip
    budget_margin: float = typer.Option(
        2.5, help="Text budget: times the expected reading time (plus 1 s, at least 3 s)."
    ),
    silence_seconds: float = typer.Option(
        3.0, help="Silence guard: seconds of near-silent audio after speech that end a stream."
    ),
    prefill_batches: str = typer.Option(
        None, "--prefill-batches", help="Checkpoints: prompts per captured prefill step, e.g. "
        "1 (requests admitted together share a step; default 1,2,4 within the slots; a "
        "compiled engine keeps its own)."
    ),  # fmt: skip
    admission_lane: str = typer.Option(
        None, "--admission-lane", help="GPU: batch buckets of the admission lane, e.g. 1,2 (a "
        "new request's prefill and first frame on a CUDA stream of their own, beside the "
        "frame step of running streams; empty: off; default: the engine's plan)."
    ),  # fmt: skip
    lane_reserved_sms: int = typer.Option(
        None, "--lane-reserved-sms", min=0, help="GPU, with an admission lane: SMs kept free "
        "of running streams' steps for new requests' first chunks (the regular steps run in "
        "CUDA green contexts of the other SMs); 0: off; default: the engine's plan."
    ),  # fmt: skip
    fp8_code_predictor: bool = typer.Option(
        None, "--fp8-code-predictor/--no-fp8-code-predictor", help="Checkpoints and --random "
        "weights on an FP8 engine: the code predictor's linears in FP8 too (a compiled "
        "engine's are as compiled; default: FP8 with the lane kernel on a Hopper GPU, see "
        "--megaframe-code-predictor, else bf16)."
    ),  # fmt: skip
    megaframe_code_predictor: bool = typer.Option(
        None, "--megaframe-code-predictor/--no-megaframe-code-predictor", help="Hopper GPUs, "
        "FP8 code predictor: a lone stream's code predictor as one persistent kernel a frame "
        "(the shipped shapes); the admission lane then reserves no SMs. Default: a compiled "
        "engine's plan; for a checkpoint or --random weights at --precision fp8 on a Hopper "
        "GPU, on for new requests' first frames on the admission lane (the 'lane kernel': "
        "H200, voice-agent prompts, p95 first audio 7.4 / 10.3 / 12.2 / 17.3 ms at 1 / 10 / "
        "20 / 40 req/s, benchmarks/serve/2026-12-06-h200-lane-kernel) unless "
        "--fp8-code-predictor, --megaframe-code-predictor, --megaframe-regular / "
        "--megaframe-lane-only or --lane-reserved-sms is given; --no-megaframe-code-predictor: "
        "the fused kernels."
    ),  # fmt: skip
    megaframe_regular: bool = typer.Option(
        None, "--megaframe-regular/--megaframe-lane-only", help="With --megaframe-code-"
        "predictor: a lone stream's regular steps run the kernel too, or only new requests' "
        "first frames on the admission lane do (needs the lane on batch bucket 1; default: "
        "the plan's; the lane only where the kernel is on by default)."
    ),  # fmt: skip
    bf16_min_rows: int = typer.Option(
        None, "--bf16-min-rows", min=0, help="FP8 engines on a GPU: the talker's linears on "
        "bf16 copies of their weights (made at load, cuBLAS) from this many rows, e.g. 16 "
        "(0: never; costs the weights again; default: the engine's plan)."
    ),  # fmt: skip
    cp_bf16_min_rows: int = typer.Option(
        None, "--cp-bf16-min-rows", min=0, help="FP8 code predictors on a GPU: its linears "
        "on bf16 copies of their weights (made at load, cuBLAS) from this many rows on its "
        "unfused path (0: never; 157 MiB for 1.7B where a batch bucket reaches it; default: "
        "the engine's plan, 128 for FP8)."
    ),  # fmt: skip
    talker_kv_fp8: bool = typer.Option(
        None, "--talker-kv-fp8/--talker-kv-bf16", help="Graph engines: the talker's KV cache "
        "in FP8 (e4m3) with the engine's calibrated k/v scales: half the bytes decode "
        "attention reads and half the cache (a compiled engine needs --calib; default: the "
        "engine's plan, FP8 where compiled with --precision fp8 --calib; FP8 for --random "
        "weights at --precision fp8, their scales measured as a calibration's)."
    ),  # fmt: skip
    w8a8_min_rows: int = typer.Option(
        None, "--w8a8-min-rows", min=0, help="FP8 engines on a GPU: the talker's linears as "
        "W8A8 (activations quantised to FP8 per row, FP8 tensor-core tiles) from this many "
        "rows up to --bf16-min-rows, e.g. 16 (0: weight-only; default: the engine's plan)."
    ),  # fmt: skip
    pace_slack: float = typer.Option(
        0.0, "--pace-slack", min=0.0, help="Paced frame steps: a frame step runs only when a "
        "stream's slack (seconds before its client's buffer runs dry) falls below this, or a "
        "new stream waits for its first audio; every ready stream rides along. More streams "
        "then generate at once, each step carries more rows, and the GPU's fixed cost per "
        "step is spread further (give it slots: --slots, --max-batch). 0: off (every stream "
        "in back-to-back steps). Served on the H200 at 40 req/s, 0.2 changed nothing: some "
        "stream is always ramping, so steps stay due. Simulated with the H200's step costs, "
        "0.01 cut the engine's work by 30 percent at 40 req/s with no late chunk, 86 streams "
        "at once (benchmarks/serve/2026-12-02-cpu-pacing-sim); not yet served."
    ),  # fmt: skip
    lane_frames: int = typer.Option(
        None, "--lane-frames", min=1, max=2, help="GPU, with an admission lane: a new "
        "request's first frames there (2: a first chunk of two frames, as a real CustomVoice "
        "checkpoint's with its silent first frame dropped, made and decoded on the lane; "
        "default: the engine's plan, 1). H200, 20 req/s, with --drop-bootstrap-frame: p95 "
        "first audio 24.7 ms, no underrun (benchmarks/serve/2026-12-02-h200-real-first-chunk)."
    ),  # fmt: skip
    codec_channels_last: bool = typer.Option(
        None, "--codec-channels-last/--no-codec-channels-last", help="GPU: the codec's "
        "implicit-GEMM convolutions on channels-last operands (same audio, another layout); "
        "default: the engine's plan."
    ),  # fmt: skip
    codec_fused_output: bool = typer.Option(
        None, "--codec-fused-output/--no-codec-fused-output", help="GPU: the codec's output "
        "stage (SnakeBeta, context, the conv to one channel, clamp) as one kernel; default: "
        "the engine's plan."
    ),  # fmt: skip
    codec_fused_attention: bool = typer.Option(
        None, "--codec-fused-attention/--no-codec-fused-attention", help="GPU: each codec "
        "pre-transformer layer's RoPE, ring writes, window mask and attention as one kernel; "
        "default: the engine's plan."
    ),  # fmt: skip
    exact_chunks: bool = typer.Option(
        False, "--exact-chunks", help="A codec step decodes each stream's next chunk exactly "
        "(its schedule size), leaving frames made past it for the next one, so a step makes "
        "fewer codec launches (without it a chunk of 4 with one more frame is 4 + 1). See "
        "tts_codec_launches_per_step. Not yet served on a GPU."
    ),  # fmt: skip
    max_audio_in_flight: int = typer.Option(
        SchedulerConfig.max_audio_in_flight, "--max-audio-in-flight", min=1, max=8,
        help="Codec steps launched and not yet read back, at most (first chunks excepted): "
        "one more waits for a turn after the oldest is read, gathering more streams. H200, "
        "70 req/s, with batched prefill: 3 left 4 refused and 3 underrun requests a minute "
        "against 40 and 32 with 2 and one prompt per prefill step."
    ),  # fmt: skip
    codec_step_frames: int = typer.Option(
        SchedulerConfig.codec_step_frames, "--codec-step-frames", min=0,
        help="The most frames one codec step decodes over all its streams (0: no bound): "
        "streams join in urgency order while their chunks fit (the most urgent always), so "
        "a chunk due soon is not decoded beside the large chunks of streams far ahead of "
        "their playback. H200, 70 req/s: 96 left no underrun "
        "but refused 992 requests against 54 (less audio per GPU second): keep 0."
    ),  # fmt: skip
    lane_chunks: int = typer.Option(
        1, "--lane-chunks", min=1, max=4, help="GPU, with an admission lane: a stream's first "
        "chunks whose codec steps run on that lane when they are one frame (the first always), "
        "beside the regular codec lane's steps; 2 takes the low-latency ramp's second chunk "
        "there too (the one that ran late at 40 req/s on the H200). Measured worse on the "
        "H200 (2026-12-02: at 40 req/s p95 first audio 84.7 against 33.2 ms, 11 underrun "
        "requests against 0, the late chunks moved to the third): keep 1."
    ),  # fmt: skip
    lane_max_active: int = typer.Option(
        SchedulerConfig.lane_max_active, "--lane-max-active", min=0, help="GPU, with an "
        "admission lane: new streams take it only while fewer streams than this hold slots "
        "(then the regular steps, until fewer than 3/4 of it do); 0: always. H200 with the "
        "lane off: no refusal or underrun at 70 and 85 req/s (p95 first audio 50 / 61 ms), "
        "against 3 / 1 and 102 / 45 with it on."
    ),  # fmt: skip
    max_batch: int = typer.Option(
        None, "--max-batch", min=1, help="GPU: the largest batch bucket, rows per captured "
        "step (more rows split into several steps), at most the slots; default: the "
        "engine's plan (a checkpoint's: up to 256 rows, the slots)."
    ),  # fmt: skip
    express_admission: bool = typer.Option(
        True, help="With an admission lane on a GPU: admit a request that arrives while a "
        "frame step runs at once, and launch its first codec step right behind its first "
        "frame (--no-express-admission: at the next loop turn)."
    ),  # fmt: skip
    gc_freeze: bool = typer.Option(
        True, help="After the warm-up, keep the startup objects out of the cyclic garbage "
        "collector's scans (gc.freeze): a full collection of them pauses every thread for "
        "~0.1-0.2 s."
    ),  # fmt: skip
    gc_threshold: str = typer.Option(
        "10000,10,10", help="After the warm-up, the cyclic collector's thresholds "
        "(gc.set_threshold; 'python': the interpreter's 700,10,10). Serving makes no cyclic "
        "garbage, so at 700 a collection only scans the live requests' objects, every thread "
        "stopped: on the H200 at 70 req/s ~450 gen-0, ~40 gen-1 and 3 gen-2 pauses a minute "
        "at 700, 4-5 gen-0 ones at 10000 (2026-12-03)."
    ),  # fmt: skip
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve a checkpoint: OpenAI-compatible streaming speech over HTTP and WebSocket."""
    import uvicorn

    from ttsbuild.build.cli import parse_sizes
    from ttsbuild.runtime.loader import open_engine
    from ttsbuild.serve.app import create_app
    from ttsbuild.serve.config import ServeConfig
    from ttsbuild.serve.service import SpeechService

    if (checkpoint is None) == (random is None):
        _err.print("[red]error:[/] give exactly one of CHECKPOINT or --random VARIANT")
        raise typer.Exit(2)
    if checkpoint is not None and not checkpoint.is_dir():
        _err.print(f"[red]error:[/] {checkpoint} is not a directory")
        raise typer.Exit(2)
    chosen = PROFILES[profile]
    if chunk_schedule is not None:
        sizes = parse_sizes(chunk_schedule, "--chunk-schedule")
        if not sizes or min(sizes) < 1:
            _err.print(f"[red]error:[/] --chunk-schedule wants frame counts >= 1, got "
                       f"{chunk_schedule!r}")  # fmt: skip
            raise typer.Exit(2)
        chosen = replace(chosen, chunk_schedule=sizes)
    aliases = {} if voice_alias else None
    for item in voice_alias:
        name, _, speaker = item.partition("=")
        if not name.strip() or not speaker.strip():
            _err.print(f"[red]error:[/] --voice-alias wants NAME=SPEAKER, got {item!r}")
            raise typer.Exit(2)
        aliases[name] = speaker
    config = ServeConfig(
        voice_aliases=aliases,
        scheduler=SchedulerConfig(
            profile=chosen,
            num_slots=256,  # bounded by the engine's plan below
            max_batch=256,  # ditto: the plan's largest batch bucket
            max_queue=max_queue,
            queue_timeout_s=queue_timeout,
            overload_wait_s=overload_wait,
            standing_queue_s=standing_queue,
            refuse_long_waits=refuse_long_waits,
            max_buffered_s=max_buffered,
            admit_by_capacity=admit_by_capacity,
            capacity_margin=capacity_margin,
            admit_slack_s=admit_slack,
            overload_slack_s=overload_slack,
            overload_admit_rate=overload_admit_rate,
            pace_slack_s=pace_slack,
            lane_chunks=lane_chunks,
            lane_max_active=lane_max_active,
            exact_chunks=exact_chunks,
            codec_step_frames=codec_step_frames,
            max_audio_in_flight=max_audio_in_flight,
        ),
        drop_bootstrap_frame=drop_bootstrap_frame,
        trim_onset=trim_onset,
        voices_dir=str(voices_dir) if voices_dir is not None else None,
        express_admission=express_admission,
        gc_freeze=gc_freeze,
    )
    try:
        guard_config = parse_guards(guards, budget_margin, silence_seconds)
        config = replace(config, gc_threshold=parse_gc_threshold(gc_threshold))
    except ValueError as exc:
        _err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    batches = None if prefill_batches is None else parse_sizes(prefill_batches, "--prefill-batches")
    lane = None if admission_lane is None else parse_sizes(admission_lane, "--admission-lane")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    wanted = slots or _default_slots(checkpoint, device)
    started = time.perf_counter()
    try:
        engine = open_engine(
            checkpoint, device=device, num_slots=wanted, fit_slots=slots is None,
            max_len=max_len, kind=engine_kind,
            precision=precision, random_variant=random, guards=guard_config,
            prefill_batches=batches, admission_lane=lane, lane_reserved_sms=lane_reserved_sms,
            bf16_min_rows=bf16_min_rows, cp_bf16_min_rows=cp_bf16_min_rows,
            w8a8_min_rows=w8a8_min_rows, max_batch=max_batch,
            lane_frames=lane_frames,
            codec_channels_last=codec_channels_last, codec_fused_output=codec_fused_output,
            codec_fused_attention=codec_fused_attention, code_predictor_fp8=fp8_code_predictor,
            megaframe_code_predictor=megaframe_code_predictor,
            megaframe_regular=megaframe_regular, talker_kv_fp8=talker_kv_fp8,
        )
    except Exception as exc:  # a bad checkpoint is a message, not a traceback
        _err.print(f"[red]error:[/] cannot load {checkpoint or random}: {exc}")
        raise typer.Exit(1) from None
    manifest = engine.models.manifest
    _err.print(
        f"loaded {checkpoint or random} ({engine.models.cfg.tts_model_type}, "
        f"{'stand-in' if manifest.get('standin') else 'real weights'}) on {engine.device}; "
        f"{type(engine).__name__}; profile {profile.value}, {engine.num_slots} slots "
        f"({time.perf_counter() - started:.1f} s)"
    )
    captured = getattr(getattr(engine, "backend", None), "capture_summary", "")
    if captured:  # a cold start's time is mostly here (the first captures compile kernels)
        _err.print(f"  {captured}")
    plan = getattr(engine, "plan", None)
    if plan is not None and engine.device.type == "cuda":
        _err.print(f"  plan: {plan.summary()}", highlight=False)
    if slots is None and wanted is not None and engine.num_slots < wanted:
        _err.print(f"[yellow]note:[/] {wanted} slots' KV cache does not fit in the device's "
                   f"free memory: serving {engine.num_slots} (--slots, --max-len to choose)")
    try:
        service = SpeechService(engine, config)
    except ValueError as exc:  # a voice alias naming a speaker the model lacks
        _err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level)


def _default_slots(checkpoint: Path | None, device: str | None) -> int | None:
    """Slots when --slots is not given: a compiled engine's plan (None); otherwise 256 on a
    GPU, as `compile` makes by default (H200: README, "Serving"), and on a CPU 8 for a
    checkpoint, the loader's default (None) for --random weights."""
    if checkpoint is not None and _is_engine(checkpoint):
        return None
    import torch

    if device.startswith("cuda") if device else torch.cuda.is_available():
        return 256
    return None if checkpoint is None else 8


def _is_engine(path: Path) -> bool:
    from ttsbuild.build.engine_dir import ENGINE_FORMAT
    from ttsbuild.runtime.artifact import artifact_format

    return artifact_format(path) == ENGINE_FORMAT


def parse_gc_threshold(text: str) -> tuple[int, int, int] | None:
    """--gc-threshold: three counts for gc.set_threshold, or 'python' (None: leave them)."""
    if text.strip().lower() == "python":
        return None
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != 3 or min(counts) < 1:
        raise ValueError(f"--gc-threshold wants three counts >= 1 or 'python', got {text!r}")
    return counts


GUARD_NAMES = ("text_budget", "repetition", "silence")


def parse_guards(names: str, budget_margin: float, silence_seconds: float):
    """--guards (comma-separated names, or none) and the tuning flags -> a GuardConfig."""
    from ttsbuild.generation.guards import GuardConfig

    chosen = {n.strip() for n in names.split(",") if n.strip()} - {"none"}
    unknown = sorted(chosen - set(GUARD_NAMES))
    if unknown:
        raise ValueError(
            f"unknown guard(s) {', '.join(unknown)}; choose from {', '.join(GUARD_NAMES)} or none"
        )
    return GuardConfig(
        **{n: n in chosen for n in GUARD_NAMES},
        budget_margin=budget_margin,
        silence_s=silence_seconds,
    )
