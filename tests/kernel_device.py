"""Where the Triton kernel tests run: CUDA when there is a GPU, the CPU under
TRITON_INTERPRET=1, else nowhere (the tests that need a kernel skip)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ttsbuild.plugins._dispatch import interpret_mode

HAS_TRITON = importlib.util.find_spec("triton") is not None
if torch.cuda.is_available() and HAS_TRITON:
    KDEV = "cuda"
elif interpret_mode() and HAS_TRITON:
    KDEV = "cpu"
else:
    KDEV = None
needs_kernel = pytest.mark.skipif(KDEV is None, reason="needs CUDA + Triton (or the interpreter)")


def kernel_cases(full: list, interpreted: list) -> list:
    """A kernel test's parameter cases: all of `full` on a GPU; under TRITON_INTERPRET (CPU
    CI, where one case costs seconds) `interpreted`, a cover of them chosen so that every value
    of every parameter still appears."""
    missing = [case for case in interpreted if case not in full]
    if missing:
        raise ValueError(f"interpreted cases {missing} are not among the full cases")
    return interpreted if KDEV == "cpu" else full


def record_fp8_launches(monkeypatch) -> list:
    """The weight-only FP8 kernel's launches recorded instead of run (the GPU path's choice of
    kernel and config, without a GPU): a list that each launch appends (kernel name: _heur for
    a given config, _gemv / _gemm for the autotuners; its keyword arguments) to."""
    from ttsbuild.plugins._tl import fp8_linear as tl_fp8

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, kw))

    monkeypatch.setattr(tl_fp8, "interpret_mode", lambda: False)
    for name in ("_heur", "_gemv", "_gemm"):
        monkeypatch.setattr(tl_fp8, name, Recorder(name))
    return launched
