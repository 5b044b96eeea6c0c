"""Session fixtures: one tiny stand-in, its calibration, and its bf16 and FP8 engines."""

from __future__ import annotations

import pathlib

import pytest

QUICK = dict(quality_texts=2, quality_frames=6, max_batch=8, graph_batches=(1, 2, 4, 8),
             max_frames=256, max_len=512, codec_gate_rows=1, codec_gate_frames=4)


@pytest.fixture(scope="session")
def ckpt(tiny_checkpoint) -> pathlib.Path:
    return tiny_checkpoint  # the session's tiny stand-in (tests/conftest.py); read-only here


@pytest.fixture(scope="session")
def calib_file(ckpt, tmp_path_factory) -> pathlib.Path:
    from ttsbuild.calibration.calibrate import run_calibration, write_calibration
    from ttsbuild.calibration.corpus import load_texts

    path = tmp_path_factory.mktemp("calib") / "calib.json"
    write_calibration(path, run_calibration(ckpt, load_texts(None, 2), max_frames=3))
    return path


@pytest.fixture(scope="session")
def bf16_engine(ckpt, tmp_path_factory) -> pathlib.Path:
    from ttsbuild.build.compile import BuildConfig, compile_engine_dir

    out = tmp_path_factory.mktemp("engines") / "bf16"
    compile_engine_dir(ckpt, out, BuildConfig(precision="bf16", **QUICK))
    return out


@pytest.fixture(scope="session")
def fp8_engine(ckpt, calib_file, tmp_path_factory) -> pathlib.Path:
    from ttsbuild.build.compile import BuildConfig, compile_engine_dir

    out = tmp_path_factory.mktemp("engines") / "fp8"
    compile_engine_dir(ckpt, out, BuildConfig(precision="fp8", **QUICK), calib_file)
    return out
