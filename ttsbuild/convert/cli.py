"""Typer command functions for `ttsbuild convert` and `ttsbuild init-random`.

Register them on the main app:
    app.command("convert")(convert)
    app.command("init-random")(init_random)
Errors are printed in plain words (no traceback) and exit with code 1 (2 for bad usage).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ttsbuild.convert.variants import VARIANTS

_err = Console(stderr=True, soft_wrap=True)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[label]}", style="dim"),
        console=_err,
        transient=False,
    )


def _runner(bar: Progress, description: str):
    tasks: list = []  # created on the first tensor, so validation errors print no bar

    def advance(nbytes: int, total: int, label: str) -> None:
        if not tasks:
            tasks.append(bar.add_task(description, total=total, label=""))
        bar.update(tasks[0], total=total, advance=nbytes, label=label[-60:])

    return advance


def convert(
    src: Path = typer.Argument(
        ..., help="Official Qwen3-TTS checkpoint directory (or, with only --draft, a converted "
        "ttsbuild checkpoint to attach the draft to)."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Converted checkpoint directory."),
    draft: Path = typer.Option(
        None, "--draft", help="Draft heads (`ttsbuild distill-draft`, or the documented "
        "safetensors layout) to validate against the target and ship in the checkpoint."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
) -> None:
    """Validate an official checkpoint and convert it to a ttsbuild checkpoint (with --draft:
    validate a speculative-decoding draft against it and ship it too)."""
    from ttsbuild.convert.convert import ConversionError, convert_checkpoint
    from ttsbuild.convert.io import OutputExistsError
    from ttsbuild.runtime.draft import DraftError, attach_draft, check_draft_for_config

    if output is None and draft is None:
        _err.print("[red]error:[/red] missing --output (-o): where to write the converted "
                   "checkpoint", highlight=False)
        raise typer.Exit(2)
    try:
        if output is None:  # attach a draft to a converted checkpoint
            meta = attach_draft(src, draft)
            _err.print(f"[green]attached[/green] draft {draft} to {src} (window "
                       f"{meta['window']})", highlight=False)
            return
        if draft is not None:  # refuse a draft that does not fit before writing anything
            check_draft_for_config(draft, src / "config.json")
        with _progress() as bar:
            manifest = convert_checkpoint(src, output, force=force,
                                          progress=_runner(bar, "converting"))
        if draft is not None:
            attach_draft(output, draft)
    except (ConversionError, OutputExistsError, DraftError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False, markup=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _err.print("[red]interrupted[/red]: nothing was written")
        raise typer.Exit(130) from None
    v = manifest["variant"]
    kind = " (random-weight stand-in)" if manifest["standin"] else ""
    shipped = ", with its draft" if draft is not None else ""
    _err.print(f"[green]wrote[/green] {output}: {v['tts_model_type']} {v['tts_model_size']}"
               f"{kind}, {len(manifest['speakers'])} speakers{shipped}", highlight=False)


def init_random(
    dst: Path = typer.Argument(..., help="Directory to write the stand-in checkpoint to."),
    variant: str = typer.Option("tiny", "--variant", help=f"One of: {', '.join(VARIANTS)}."),
    seed: int = typer.Option(0, "--seed", help="Random seed (output is deterministic)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty directory."),
    flat_logits: bool = typer.Option(
        False, "--flat-logits",
        help="Plain N(0, 0.02) weights (near-flat logits) instead of the peaked stand-in.",
    ),
    measure: bool = typer.Option(
        None, "--measure/--no-measure",
        help="Run the stand-in and record its sharpness (default: when a GPU is present).",
    ),
    device: str = typer.Option(None, "--device", help="cpu or cuda for --measure."),
) -> None:
    """Write a random-weight stand-in checkpoint in the official Qwen3-TTS layout."""
    from ttsbuild.convert.init_random import InitRandomError
    from ttsbuild.convert.init_random import init_random as run
    from ttsbuild.convert.io import OutputExistsError

    if variant not in VARIANTS:
        _err.print(f"[red]error:[/red] unknown variant {variant!r}; choose one of "
                   f"{', '.join(VARIANTS)}", highlight=False)
        raise typer.Exit(2)
    try:
        with _progress() as bar:
            standin = run(dst, variant, seed=seed, force=force,
                          progress=_runner(bar, f"init-random {variant}"),
                          peaked=not flat_logits, measure=measure, device=device)
    except (InitRandomError, OutputExistsError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _err.print("[red]interrupted[/red]: nothing was written")
        raise typer.Exit(130) from None
    rule = standin["length_rule"]
    _err.print(f"[green]wrote[/green] {dst} ({variant}, seed {seed}); length rule: "
               "the text's expected reading time (speaking rate), "
               f"{rule['min_frames']}..{rule['max_frames']} frames", highlight=False)
    logits = standin["logits"]
    for name, where in (("expected", "by construction"), ("measured", "measured")):
        if name in logits:
            s = {k: logits[name][k] for k in ("codebook0", "codebooks_1_15")}
            _err.print(f"  logits ({where}): " + "; ".join(
                f"{k} mean top-1 prob {v['mean_top1_prob']:.3f}, entropy "
                f"{v['mean_entropy_nats']:.2f} nats" for k, v in s.items()), highlight=False)
