"""The C++ step driver (`ttsbuild/csrc/step_driver.cpp`), built by the package's install.

`make install` (pip) builds it from source; a source tree used without installing (e.g.
`PYTHONPATH=.` on a GPU host) builds it once with `python setup.py build_ext --inplace`, or
just-in-time here through torch's extension loader when `TTSBUILD_JIT_DRIVER=1`.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from ttsbuild.runtime.link import cxx_runtime_link_args

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "step_driver.cpp"
WHILE_SOURCE = SOURCE.with_name("graph_while.cu")  # with CUDA (setup.py's graph_while_wanted)


class DriverUnavailable(ImportError):
    pass


@functools.cache
def driver_module(cuda: bool):
    """The compiled extension; with cuda=True it must have been built with CUDA."""
    try:
        from ttsbuild import _driver
    except ImportError:
        _driver = None
    if _driver is not None and (_driver.built_with_cuda() or not cuda):
        return _driver
    if os.environ.get("TTSBUILD_JIT_DRIVER") == "1":
        from torch.utils.cpp_extension import load

        log.info("building the step driver just in time (cuda=%s)", cuda)
        flags = ["-DTTSBUILD_WITH_CUDA", "-DTTSBUILD_GRAPH_WHILE"] if cuda else []
        return load(
            name="ttsbuild_driver_cuda" if cuda else "ttsbuild_driver",
            sources=[str(SOURCE)] + ([str(WHILE_SOURCE)] if cuda else []),
            extra_cflags=["-O2", "-std=c++17"] + flags,
            extra_cuda_cflags=["-O2", "-std=c++17"],
            extra_ldflags=cxx_runtime_link_args(),  # the process's libstdc++ (setup.py)
            with_cuda=cuda,
        )
    what = "a CUDA build of " if cuda else ""
    raise DriverUnavailable(
        f"{what}the step driver (ttsbuild._driver) is not built: install the package "
        "(`make install`) or run `python setup.py build_ext --inplace` in the source tree"
    )


def make_driver(device: torch.device):
    """A StepDriver for `device` (a CUDA device: graphs + copy stream; CPU: eager steps).

    Its launches keep the GIL (a launch queues work in microseconds; giving the GIL up and
    taking it back can cost the interpreter's switch interval, 5 ms, while the server's event
    loop thread runs). `TTSBUILD_LAUNCH_RELEASES_GIL=1` releases it during launches, as
    before, for side-by-side timing."""
    cuda = device.type == "cuda"
    driver = driver_module(cuda).StepDriver(cuda)
    driver.launch_releases_gil = os.environ.get("TTSBUILD_LAUNCH_RELEASES_GIL") == "1"
    return driver
