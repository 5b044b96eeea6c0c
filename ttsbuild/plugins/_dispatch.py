"""Whether to run a Triton kernel or the eager reference."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors (slow; for checking only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def want_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    """None: Triton for CUDA tensors when it imports. True: Triton or an error."""
    if use_triton is None:
        return triton_available() and (t.is_cuda or (interpret_mode() and t.device.type == "cpu"))
    if use_triton:
        if not triton_available():
            raise RuntimeError("use_triton=True but triton is not installed")
        if not (t.is_cuda or interpret_mode()):
            raise RuntimeError("use_triton=True needs CUDA tensors (or TRITON_INTERPRET=1)")
    return bool(use_triton)
