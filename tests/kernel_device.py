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
