"""Builds ttsbuild's C++ step driver (ttsbuild._driver) with torch's extension API.

With a CUDA build of torch and a CUDA toolkit the driver replays CUDA graphs and copies on
its own stream; elsewhere (CPU-only machines, CI) the same source builds without CUDA.
Everything else about the package is in pyproject.toml.
"""

import os
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# the source tree's own helper (PEP 517 builds do not put the tree on sys.path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttsbuild.runtime.link import cxx_runtime_link_args  # noqa: E402

SOURCES = ["ttsbuild/csrc/step_driver.cpp"]
# WHILE nodes for CUDA graphs (the speculative code predictor's rounds): CUDA >= 12.4, nvcc
WHILE_SOURCE = "ttsbuild/csrc/graph_while.cu"
ARGS = {"cxx": ["-O2", "-std=c++17"], "nvcc": ["-O2", "-std=c++17"]}
# Link the C++ runtime the process already has (torch's), never a private copy: a compiler
# wrapper that links libstdc++ statically (the GPU image's CXX=/opt/gcc/bin/g++ does) gave the
# driver its own libstdc++, whose streams formatted no numbers and whose exceptions killed
# the process with a segmentation fault (benchmarks/runtime/driver_errors_probe.py). A plain
# -lstdc++ did not help there (2026-12-02; the wrapper's link line was not logged: a g++
# with -static-libstdc++ may link a plain -lstdc++ statically too). The shared library's own
# path is an input file that any compiler driver hands to the linker as it is.
LINK = cxx_runtime_link_args()


def driver_extension():
    want_cuda = os.environ.get("TTSBUILD_DRIVER_CUDA", "auto")
    has_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if want_cuda == "1" or (want_cuda == "auto" and has_cuda):
        sources, macros = list(SOURCES), [("TTSBUILD_WITH_CUDA", None)]
        if graph_while_wanted():
            sources.append(WHILE_SOURCE)
            macros.append(("TTSBUILD_GRAPH_WHILE", None))
        return CUDAExtension(
            "ttsbuild._driver", sources, extra_compile_args=ARGS, extra_link_args=LINK,
            define_macros=macros,
        )  # fmt: skip
    cxx = {"cxx": ARGS["cxx"]}
    return CppExtension("ttsbuild._driver", SOURCES, extra_compile_args=cxx, extra_link_args=LINK)


def graph_while_wanted() -> bool:
    """graph_while.cu with the driver: CUDA >= 12.4 (conditional nodes), unless
    TTSBUILD_GRAPH_WHILE=0."""
    if os.environ.get("TTSBUILD_GRAPH_WHILE", "1") == "0":
        return False
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 4)


setup(ext_modules=[driver_extension()], cmdclass={"build_ext": BuildExtension})
