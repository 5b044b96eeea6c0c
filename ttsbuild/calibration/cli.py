"""Typer command function for `ttsbuild calibrate`.

Register it on the main app:
    app.command("calibrate")(calibrate)
Errors are printed in plain words (no traceback) and exit with code 1.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

_err = Console(stderr=True, soft_wrap=True)


def calibrate(
    checkpoint: Path = typer.Argument(..., help="Converted checkpoint directory."),
    output: Path = typer.Option(..., "--output", "-o", help="Calibration JSON file to write."),
    texts: Path = typer.Option(
        None, "--texts", help="Calibration texts, one per line (default: shipped Harvard set)."
    ),
    num_texts: int = typer.Option(32, "--num-texts", min=1, help="Use the first N texts."),
    max_frames: int = typer.Option(64, "--max-frames", min=1, help="Frames per text at most."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Texts generated together."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda if present)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed of the generation run."),
) -> None:
    """FP8 calibration (NVIDIA modelopt, max) of the talker, code predictor and KV cache.

    The scales are written into an engine by `compile --calib`; no runtime path uses them yet
    (weight-only FP8 linears, bf16 KV cache), so they do not change what an engine computes.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ttsbuild.calibration.calibrate import (
        CalibrationError,
        run_calibration,
        write_calibration,
    )
    from ttsbuild.calibration.corpus import load_texts
    from ttsbuild.convert.checkpoint import CheckpointError

    if output.is_dir():
        raise typer.BadParameter(f"{output} is a directory", param_hint="--output")
    try:
        corpus = load_texts(texts, num_texts)
        import torch

        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            console=_err,
        ) as bar:
            tasks: dict[str, int] = {}

            def progress(stage: str, advance: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], advance=advance)

            doc = run_calibration(
                checkpoint, corpus, device=dev, seed=seed, max_frames=max_frames,
                batch_size=batch_size, progress=progress,
                texts_source=str(texts) if texts else "ttsbuild/data/harvard720.txt",
            )
        write_calibration(output, doc)
    except (CalibrationError, CheckpointError, ValueError) as exc:
        _err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except ImportError as exc:
        _err.print(f"[red]error:[/red] {exc}; install the engine extra: "
                   "pip install 'ttsbuild[engine]'", highlight=False)
        raise typer.Exit(1) from None
    run = doc["run"]
    n_lin = sum(len(m["linears"]) for m in doc["modules"].values())
    kind = " (random-weight stand-in)" if doc["checkpoint"]["standin"] else ""
    _err.print(
        f"[green]wrote[/green] {output}{kind}: {len(corpus)} texts, {sum(run['frames'])} frames, "
        f"{n_lin} linears + KV of {len(doc['modules'])} modules, modelopt "
        f"{doc['method']['modelopt_version']} on {run['device']}",
        highlight=False,
    )
