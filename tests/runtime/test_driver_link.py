"""The step driver uses the process's C++ runtime even where the compiler would link a private
one. On the GPU image CXX is a g++ wrapper that adds -static-libstdc++: the driver built with
it carried its own libstdc++, formatted no numbers into its error messages and died with a
segmentation fault on every refusal (benchmarks/runtime/driver_errors_probe.py, 2026-12-02).
A plain -lstdc++ in setup.py fixed that here but not on the GPU image; setup.py now links the
process's own libstdc++ by its path (ttsbuild.runtime.link). This builds the CPU driver with a
wrapper that adds -static-libstdc++ and drops any -lstdc++ it is given (about a minute) and
checks the result."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttsbuild.runtime import link

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
    wrapper.write_text(  # drops -lstdc++ and -Wl,-lstdc++, adds -static-libstdc++ (and -O0)
        "#!/bin/bash\nargs=()\nfor a in \"$@\"; do\n"
        '  case "$a" in -lstdc++|-Wl,-lstdc++) ;; *) args+=("$a") ;; esac\ndone\n'
        f'exec {shutil.which("g++")} -static-libstdc++ "${{args[@]}}" -O0\n'
    )  # -O0 last: the link is what is tested, and code generation is most of the build time
    wrapper.chmod(0o755)
    tree = tmp_path / "src"
    (tree / "ttsbuild" / "csrc").mkdir(parents=True)
    shutil.copy(ROOT / "setup.py", tree / "setup.py")
    shutil.copy(ROOT / "ttsbuild" / "csrc" / "step_driver.cpp", tree / "ttsbuild" / "csrc")
    (tree / "ttsbuild" / "runtime").mkdir()
    shutil.copy(ROOT / "ttsbuild" / "runtime" / "link.py", tree / "ttsbuild" / "runtime")
    for package in ("ttsbuild", "ttsbuild/runtime"):
        (tree / package / "__init__.py").write_text("")
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


def test_the_link_argument_is_the_mapped_shared_library(tmp_path):
    lib = tmp_path / "libstdc++.so.6.0.33"
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 00:00 0 /usr/lib/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0\n"
        f"7f04-7f05 r-xp 00000000 00:00 0 {lib}\n"
    )
    assert link.mapped_libstdcxx(maps) == str(lib)
    maps.write_text("7f00-7f01 r--p 00000000 00:00 0 /usr/lib/libc.so.6\n")
    assert link.mapped_libstdcxx(maps) is None
    assert link.mapped_libstdcxx(tmp_path / "no-such-file") is None
