"""`make demo`: the whole pipeline on the embedded default, a tiny random-weight stand-in.

init-random (official layout) -> convert -> synth, each step through the real CLI verbs.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from typer.testing import CliRunner

DEMO_TEXT = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."


def run(argv: list[str]) -> None:
    from ttsbuild.cli import app

    print(f"$ ttsbuild {' '.join(argv)}", flush=True)
    result = CliRunner().invoke(app, argv)
    print(result.output, end="", flush=True)
    if result.exit_code != 0:
        raise SystemExit(f"demo step failed (exit {result.exit_code}): ttsbuild {' '.join(argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out"), help="Working directory.")
    args = parser.parse_args()
    out: Path = args.out
    for name in ("standin", "checkpoint"):
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run(["init-random", str(out / "standin"), "--variant", "tiny", "--seed", "0"])
    run(["convert", str(out / "standin"), "-o", str(out / "checkpoint")])
    wav = out / "demo.wav"
    run(
        [
            "synth",
            str(out / "checkpoint"),
            DEMO_TEXT,
            "--voice",
            "ryan",
            "--language",
            "english",
            "--seed",
            "7",
            "--device",
            "cpu",
            "-o",
            str(wav),
        ]
    )
    print(f"demo done in {time.perf_counter() - t0:.1f} s: {wav}")


if __name__ == "__main__":
    main()
