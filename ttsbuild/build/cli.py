"""Typer command function for `ttsbuild compile`.

Register it on the main app:
    app.command("compile")(compile_engine)
Errors are printed in plain words (no traceback) and exit with code 1 (2 for bad usage).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ttsbuild.runtime.plan import (
    DEFAULT_BF16_MIN_ROWS,
    DEFAULT_CP_BF16_MIN_ROWS,
    DEFAULT_CP_W8A8_MIN_ROWS,
    DEFAULT_FUSED_CP_MAX_BATCH,
    DEFAULT_LANE_RESERVED_SMS,
    DEFAULT_W8A8_MIN_ROWS,
)

_err = Console(stderr=True, soft_wrap=True)


def parse_sizes(value: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of integers from the flag `flag` (a usage error otherwise)."""
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {value!r}",
                                 param_hint=flag) from None


def _speculative(value: str) -> dict[int, tuple[str, int]]:
    """'1,2:draft:3;8:self:2' -> {1: ("draft", 3), 2: ("draft", 3), 8: ("self", 2)}."""
    plan: dict[int, tuple[str, int]] = {}
    for part in value.split(";"):
        fields = part.strip().split(":")
        if len(fields) != 3 or fields[1] not in ("self", "draft"):
            raise typer.BadParameter(f"expected BUCKETS:self|draft:WINDOW, got {part!r}",
                                     param_hint="--speculative")
        window = parse_sizes(fields[2], "--speculative")
        if len(window) != 1:
            raise typer.BadParameter(f"one window per part, got {fields[2]!r}",
                                     param_hint="--speculative")
        for bucket in parse_sizes(fields[0], "--speculative"):
            plan[bucket] = (fields[1], window[0])
    return plan


def compile_engine(
    checkpoint: Path = typer.Argument(..., help="Converted checkpoint directory."),
    output: Path = typer.Option(..., "--output", "-o", help="Engine directory to write."),
    precision: str = typer.Option("fp8", "--precision", help="fp8 or bf16 weights."),
    calib: Path = typer.Option(None, "--calib", help="Calibration file (`ttsbuild calibrate`)."),
    fp8_code_predictor: bool = typer.Option(
        False, "--fp8-code-predictor", help="FP8 code-predictor layers too (launch-bound)."
    ),
    fp8_code_predictor_heads: bool = typer.Option(
        False, "--fp8-code-predictor-heads/--bf16-code-predictor-heads",
        help="With --fp8-code-predictor: its 15 heads in FP8 too, or in bf16 (the default: "
        "codebooks 1-15's KL against bf16 0.021 -> 0.013 on the 1.7B stand-in, the gate "
        "being 0.02; 31 MiB more for 1.7B).",
    ),  # fmt: skip
    megaframe_code_predictor: bool = typer.Option(
        False, "--megaframe-code-predictor",
        help="Batch 1's code predictor as one persistent kernel a frame (Hopper GPUs; the "
        "shipped 0.6B / 1.7B code predictor's shapes; needs --fp8-code-predictor). The "
        "admission lane then reserves no SMs: the kernel needs every one.",
    ),  # fmt: skip
    megaframe_regular: bool = typer.Option(
        False, "--megaframe-regular/--megaframe-lane-only", help="With --megaframe-code-"
        "predictor: a lone stream's regular steps run the kernel too, or only new requests' "
        "first frames on the admission lane do (the default; needs the lane on batch bucket "
        "1). The lane only served voice-agent prompts on the H200 at p95 first audio 7.4 / "
        "10.3 / 12.2 / 17.3 ms at 1 / 10 / 20 / 40 req/s "
        "(benchmarks/serve/2026-12-06-h200-lane-kernel).",
    ),  # fmt: skip
    max_batch: int = typer.Option(
        256, "--max-batch", min=1, help="Streams per batch at most (and the default slot "
        "count). 256: on the H200 (1.7B CustomVoice, FP8, voice-agent prompts) 256 slots with "
        "a 256-row step served 100 req/s with no refusal or underrun (p95 first audio 80 ms) "
        "where 128 refused 18 %, and 64 fill up past ~40 req/s (benchmarks/serve/"
        "2026-12-03-h200-capacity-256); KV cache ~56 GiB at 2048 positions (give a smaller "
        "GPU --max-batch 64 or 128)."
    ),  # fmt: skip
    graph_batches: str = typer.Option(
        None, "--graph-batches",
        help="Captured batch sizes, ending at max batch (default: powers of 2, then max batch).",
    ),
    max_frames: int = typer.Option(1536, "--max-frames", min=1, help="Frames per request."),
    max_len: int = typer.Option(2048, "--max-len", min=2, help="Talker KV positions per slot."),
    slots: int = typer.Option(
        None, "--slots", min=1, max=256, help="Concurrent requests (default: the max batch)."
    ),
    prefill_buckets: str = typer.Option(
        None, "--prefill-buckets", help="Captured prompt lengths (default: 32..512 below max len)."
    ),
    prefill_batches: str = typer.Option(
        None, "--prefill-batches", help="Prompts per captured prefill step, e.g. 1 (one per "
        "step); requests admitted together share a step (default 1,2,4 within the slots: "
        "measured fewer refusals and underruns at 70 req/s)."
    ),
    admission_lane: str = typer.Option(
        None, "--admission-lane", help="Batch buckets of the admission lane (a new request's "
        "prefill, first frame and first codec step on a CUDA stream of their own, ahead of "
        "running streams; default 1,2: measured faster in serving; '' for off)."
    ),  # fmt: skip
    codec_chunks: str = typer.Option(
        "1,2,4,8", "--codec-chunks", help="Frames per captured codec step (must include 1)."
    ),
    codec_ring: int = typer.Option(64, "--codec-ring", min=1, help="Frames buffered per slot."),
    max_text: int = typer.Option(1024, "--max-text", min=1, help="Text positions per slot."),
    fused_cp_max_batch: int = typer.Option(
        DEFAULT_FUSED_CP_MAX_BATCH, "--fused-cp-max-batch", min=0,
        help="Fused code-predictor kernels for batch buckets up to this (0: never); "
        "measured faster up to 16 rows.",
    ),  # fmt: skip
    persistent_cp_max_batch: int = typer.Option(
        0, "--persistent-cp-max-batch", min=0,
        help="One persistent launch per code-predictor pass for batch buckets up to this "
        "(0: never); takes precedence over the fused kernels.",
    ),  # fmt: skip
    w8a8_min_rows: int = typer.Option(
        DEFAULT_W8A8_MIN_ROWS, "--w8a8-min-rows", min=0,
        help="FP8 engines: the talker's linears as W8A8 (FP8 activations scaled per row, "
        "FP8 tensor-core tiles) from this many rows up to --bf16-min-rows (0: weight-only).",
    ),  # fmt: skip
    cp_w8a8_min_rows: int = typer.Option(
        DEFAULT_CP_W8A8_MIN_ROWS, "--cp-w8a8-min-rows", min=0,
        help="FP8 engines: the code predictor's linears and heads as W8A8 from this many "
        "rows (its unfused path, buckets above --fused-cp-max-batch; 0: weight-only).",
    ),  # fmt: skip
    cp_bf16_min_rows: int = typer.Option(
        DEFAULT_CP_BF16_MIN_ROWS, "--cp-bf16-min-rows", min=0,
        help="FP8 engines: the code predictor's linears on bf16 copies of their weights "
        "(dequantised at load, cuBLAS) from this many rows on its unfused path (0: never; "
        "held only where a batch bucket reaches it).",
    ),  # fmt: skip
    talker_kv_fp8: bool = typer.Option(
        None, "--talker-kv-fp8/--talker-kv-bf16", help="The talker's KV cache in FP8 (e4m3) "
        "with the calibration's k/v scales (needs --calib; the quality gate measures the "
        "talker on it): half the bytes decode attention reads and half the cache's memory. "
        "Default: FP8 for --precision fp8 with --calib, else bf16.",
    ),  # fmt: skip
    bf16_min_rows: int = typer.Option(
        DEFAULT_BF16_MIN_ROWS, "--bf16-min-rows", min=0,
        help="FP8 engines: the talker's linears on bf16 copies of their weights (dequantised "
        "at load, cuBLAS) from this many rows (0: never; costs the weights again).",
    ),  # fmt: skip
    lane_reserved_sms: int = typer.Option(
        None, "--lane-reserved-sms", min=0,
        help="GPU SMs kept free of running streams' steps for new requests' first chunks "
        "(the admission lane; the regular steps run in CUDA green contexts of the other SMs); "
        f"0: off. Ignored without an admission lane. Default: {DEFAULT_LANE_RESERVED_SMS}, "
        "0 with --megaframe-code-predictor.",
    ),  # fmt: skip
    prefix_pool: int = typer.Option(
        16, "--prefix-pool", min=0,
        help="Prompt prefixes (voice, language, instruct) whose KV stays on the device for reuse "
        "(0: none).",
    ),  # fmt: skip
    max_prefix: int = typer.Option(128, "--max-prefix", min=1, help="Positions per prefix."),
    speculative: str = typer.Option(
        None, "--speculative",
        help="Speculative code predictor per batch bucket: BUCKETS:KIND:WINDOW[;...], KIND "
        "self (no new weights) or draft (the checkpoint's draft), e.g. '1,2,4:draft:3'; or "
        "auto: batch 1 only, decided from the acceptance the checkpoint's draft records "
        "(distill-draft) and the H200's measured round costs. Off by default.",
    ),
    speculative_exact: bool = typer.Option(
        False, "--speculative-exact",
        help="Verify drafts by exact match: every code is the plain sampler's draw, so a seeded "
        "request sounds the same at any load; drafts are accepted less often (~0.7x on the "
        "1.7B stand-in). Without it, speculation on some buckets only makes sampled codes "
        "depend on the load.",
    ),
    quality_texts: int = typer.Option(4, "--quality-texts", min=1, help="Texts for the gate."),
    quality_frames: int = typer.Option(32, "--quality-frames", min=2, help="Frames per text."),
    force_quality: bool = typer.Option(
        False, "--force-quality", help="Write the engine even below the FP8 or codec quality gate."
    ),
    codec_precision: str = typer.Option(
        "fp16", "--codec-precision",
        help="Codec compute precision: fp32, tf32, fp16 or bf16 (gated: SNR >= 45 dB vs fp32).",
    ),
    onnx: bool = typer.Option(True, "--onnx/--no-onnx", help="Export the codec step to ONNX."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda if present)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
) -> None:
    """Compile a checkpoint into a self-contained engine directory (FP8 or bf16)."""
    import torch

    from ttsbuild.build.compile import BuildConfig, QualityError, compile_engine_dir
    from ttsbuild.build.engine_dir import EngineError
    from ttsbuild.calibration.calibrate import CalibrationError
    from ttsbuild.convert.checkpoint import CheckpointError
    from ttsbuild.convert.io import OutputExistsError
    from ttsbuild.runtime.plan import power_of_two_buckets

    try:
        cfg = BuildConfig(
            precision=precision, fp8_code_predictor=fp8_code_predictor, max_batch=max_batch,
            fp8_code_predictor_heads=fp8_code_predictor_heads,
            megaframe_code_predictor=megaframe_code_predictor,
            megaframe_regular=megaframe_regular,
            graph_batches=(parse_sizes(graph_batches, "--graph-batches") if graph_batches
                           else power_of_two_buckets(max_batch)),
            max_frames=max_frames, max_len=max_len, num_slots=slots or max_batch,
            prefill_buckets=parse_sizes(prefill_buckets, "--prefill-buckets") if prefill_buckets
            else None, prefill_batches=parse_sizes(prefill_batches, "--prefill-batches")
            if prefill_batches else None,
            admission_lane=None if admission_lane is None
            else parse_sizes(admission_lane, "--admission-lane"),
            codec_chunks=parse_sizes(codec_chunks, "--codec-chunks"), codec_ring=codec_ring,
            max_text=max_text, fused_cp_max_batch=fused_cp_max_batch,
            persistent_cp_max_batch=persistent_cp_max_batch, w8a8_min_rows=w8a8_min_rows,
            cp_w8a8_min_rows=cp_w8a8_min_rows, cp_bf16_min_rows=cp_bf16_min_rows,
            bf16_min_rows=bf16_min_rows, lane_reserved_sms=lane_reserved_sms,
            talker_kv_fp8=talker_kv_fp8, prefix_pool=prefix_pool, max_prefix=max_prefix,
            quality_texts=quality_texts, quality_frames=quality_frames,
            force_quality=force_quality, onnx=onnx, codec_precision=codec_precision,
            speculative=_speculative(speculative) if speculative and speculative != "auto"
            else {}, speculative_auto=speculative == "auto",
            speculative_exact=speculative_exact,
        )
    except ValueError as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        with _err.status("compiling") as status:
            def log(msg: str) -> None:
                status.update(msg)
                _err.print(f"  {msg}", highlight=False)

            manifest = compile_engine_dir(checkpoint, output, cfg, calib, dev, force, log)
    except (QualityError, CalibrationError, CheckpointError, EngineError, OutputExistsError,
            ValueError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except ImportError as exc:
        _err.print(f"[red]error:[/red] {exc}; install the engine extra: "
                   "pip install 'ttsbuild[engine]'", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _err.print("[red]interrupted[/red]: nothing was written")
        raise typer.Exit(130) from None
    kind = " (random-weight stand-in)" if manifest["standin"] else ""
    q = manifest["quality"]
    verdict = "" if q is None else (" [green]quality pass[/green]" if q["passed"]
                                    else " [red]quality FAILED (forced)[/red]")
    cq = manifest["codec"]["quality"]
    codec = f", codec {manifest['codec']['precision']} ({cq['snr_db']:.1f} dB vs fp32)"
    _err.print(f"[green]wrote[/green] {output}{kind}: {manifest['precision']}{codec}, target "
               f"{manifest['target']['arch']}, {len(manifest['files'])} files{verdict}",
               highlight=False)


def distill_draft(
    checkpoint: Path = typer.Argument(..., help="Converted checkpoint (the target)."),
    output: Path = typer.Option(..., "--output", "-o", help="Draft file to write (.safetensors)."),
    texts: Path = typer.Option(None, "--texts", help="Text set, one per line (default: the "
                               "shipped Harvard sentences)."),
    num_texts: int = typer.Option(64, "--num-texts", min=1, help="Texts to generate from."),
    max_frames: int = typer.Option(64, "--max-frames", min=2, help="Frames per text."),
    window: int = typer.Option(4, "--window", min=1, max=8, help="Drafted depths to train for."),
    steps: int = typer.Option(2000, "--steps", min=1, help="Optimiser steps."),
    batch_frames: int = typer.Option(256, "--batch-frames", min=1, help="Frames per step."),
    lr: float = typer.Option(1e-4, "--lr", help="Adam learning rate."),
    eval_every: int = typer.Option(100, "--eval-every", min=1,
                                   help="Steps between acceptance evaluations and checkpoints."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUTPUT.state."),
    seed: int = typer.Option(0, "--seed", help="Generation and minibatch seed."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda if present)."),
) -> None:
    """Train draft heads for speculative decoding on the target's own outputs."""
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from ttsbuild.build.distill import DistillConfig
    from ttsbuild.build.distill import distill_draft as run
    from ttsbuild.calibration.corpus import load_texts
    from ttsbuild.convert.checkpoint import CheckpointError, load_checkpoint
    from ttsbuild.runtime.engine import Models

    try:
        cfg = DistillConfig(window=window, steps=steps, batch_frames=batch_frames, lr=lr,
                            eval_every=eval_every, num_texts=num_texts, max_frames=max_frames,
                            seed=seed)
        text_set = load_texts(texts, num_texts)
    except ValueError as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=_err)
    try:
        models = Models.load(load_checkpoint(checkpoint), device=dev)
        with bar:
            progress = _DistillProgress(bar)
            summary = run(models, output, cfg, text_set, dev, resume=resume, progress=progress)
    except (CheckpointError, ValueError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _err.print(f"[red]interrupted[/red]: resume with --resume (state in {output}.state)")
        raise typer.Exit(130) from None
    before = ", ".join(f"{a:.3f}" for a in summary["self_speculative"])
    after = ", ".join(f"{a:.3f}" for a in summary["acceptance"])
    _err.print(f"[green]wrote[/green] {output}: {summary['frames']} frames, {summary['steps']} "
               f"steps; expected acceptance per depth {after} (self-speculative: {before})",
               highlight=False)
    from ttsbuild.build.spec_choice import choose

    recorded = {"draft": summary["acceptance"], "self": summary["self_speculative"]}
    for flags, exact in (("", False), (" --speculative-exact", True)):
        choice = choose(recorded, max_window=window, exact=exact)
        verdict = (f"batch 1 {choice.kind}, window {choice.window}: expected "
                   f"{choice.expected_ms:.2f} ms a code-predictor frame against "
                   f"{choice.plain_ms:.2f} without" if choice.kind else
                   "off (no choice expected >= 5 % faster at batch 1 on the H200)")
        _err.print(f"compile --speculative auto{flags} would choose: {verdict}",
                   highlight=False)  # fmt: skip


class _DistillProgress:
    """Rich progress for distill-draft: frames generated, then optimiser steps."""

    def __init__(self, bar):
        self.bar, self.gen, self.train = bar, None, None

    def frames(self, n: int) -> None:
        if self.gen is None:
            self.gen = self.bar.add_task("generating", total=None, info="frames")
        self.bar.update(self.gen, advance=n)

    def start(self, total: int, done: int) -> None:
        self.train = self.bar.add_task("distilling", total=total, completed=done, info="")

    def step(self, loss: float, acceptance: list[float]) -> None:
        acc = " ".join(f"{a:.2f}" for a in acceptance)
        self.bar.update(self.train, advance=1, info=f"loss {loss:.4f}  acceptance {acc}")
