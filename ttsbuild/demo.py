"""`make demo`: the whole pipeline on the embedded default, a tiny random-weight stand-in.

init-random (official layout) -> convert -> calibrate (FP8, modelopt) -> compile (engine
dir) -> synth through the engine, each step through the real CLI verbs.
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
    for name in ("standin", "checkpoint", "engine"):
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run(["init-random", str(out / "standin"), "--variant", "tiny", "--seed", "0"])
    ckpt, engine, calib, wav = (out / n for n in ("checkpoint", "engine", "calib.json", "demo.wav"))
    run(["convert", str(out / "standin"), "-o", str(ckpt)])
    run(["calibrate", str(ckpt), "-o", str(calib), "--num-texts", "8", "--max-frames", "24"])
    run(["compile", str(ckpt), "-o", str(engine), "--precision", "fp8", "--calib", str(calib),
         "--max-batch", "8"])  # fmt: skip
    run(["synth", str(engine), DEMO_TEXT, "--voice", "ryan", "--language", "english",
         "--seed", "7", "-o", str(wav)])  # fmt: skip
    print(f"demo done in {time.perf_counter() - t0:.1f} s: {wav}")


if __name__ == "__main__":
    main()
