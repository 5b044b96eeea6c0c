"""The `ttsbuild` command: one verb per pipeline stage, each writing a named artifact.

convert -> checkpoint dir, calibrate -> calibration file, compile -> engine dir, serve, bench.
Each verb lives beside its stage and is only imported here, so `ttsbuild --help` stays fast.
"""

from __future__ import annotations

import typer

from ttsbuild.bench.cli import app as bench_app

app = typer.Typer(
    name="ttsbuild",
    help="Build, run and serve fast streaming Qwen3-TTS engines.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
