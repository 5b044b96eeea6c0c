"""The `ttsbuild` command: one verb per pipeline stage, each writing a named artifact.

init-random -> official-layout stand-in, convert -> checkpoint dir, calibrate -> calibration
file, compile -> engine dir, synth -> WAV, serve, bench. Each verb lives beside its stage;
heavy imports happen inside the commands so `ttsbuild --help` stays fast.
"""

from __future__ import annotations

import typer

from ttsbuild.bench.cli import app as bench_app
from ttsbuild.build.cli import compile_engine, distill_draft
from ttsbuild.calibration.cli import calibrate
from ttsbuild.convert.cli import convert, init_random
from ttsbuild.runtime.cli import synth
from ttsbuild.serve.cli import serve

app = typer.Typer(
    name="ttsbuild",
    help="Build, run and serve fast streaming Qwen3-TTS engines.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.command("init-random")(init_random)
app.command("convert")(convert)
app.command("calibrate")(calibrate)
app.command("compile")(compile_engine)
app.command("distill-draft")(distill_draft)
app.command("synth")(synth)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
