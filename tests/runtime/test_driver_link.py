"""The step driver uses the process's C++ runtime even where the compiler would link a private
one. On the GPU image CXX is a g++ wrapper that adds -static-libstdc++: the driver built with
it carried its own libstdc++, formatted no numbers into its error messages and died with a
segmentation fault on every refusal (benchmarks/runtime/driver_errors_probe.py, 2026-12-02).
setup.py links -lstdc++ explicitly; this builds the CPU driver with such a wrapper (about a
minute) and checks the result."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import torch
from ttsbuild import _driver
try:
    _driver.StepDriver(False).wait(12345)
except RuntimeError as exc:
    print("raised:", exc)
"""


@pytest.mark.skipif(shutil.which("g++") is None or sys.platform != "linux",
                    reason="needs g++ on Linux")  # fmt: skip
def test_a_compiler_that_links_libstdcxx_statically_still_gives_a_working_driver(tmp_path):
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    tree = tmp_path / "src"
    (tree / "ttsbuild" / "csrc").mkdir(parents=True)
    shutil.copy(ROOT / "setup.py", tree / "setup.py")
    shutil.copy(ROOT / "ttsbuild" / "csrc" / "step_driver.cpp", tree / "ttsbuild" / "csrc")
    (tree / "ttsbuild" / "__init__.py").write_text("")
    env = {**os.environ, "CXX": str(wrapper), "TTSBUILD_DRIVER_CUDA": "0"}
    # setup.py alone: the tree has no pyproject.toml, so setuptools builds only the extension
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    build = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    built = next((tree / "ttsbuild").glob("_driver*.so"))
    if shutil.which("ldd"):
        needed = subprocess.run(["ldd", str(built)], capture_output=True, text=True).stdout
        assert "libstdc++" in needed, needed
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "raised: unknown ticket 12345" in run.stdout, run.stdout
