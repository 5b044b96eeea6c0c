"""Whether to run a Triton kernel or the eager reference."""

from __future__ import annotations

import contextlib
import contextvars
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


@functools.cache
def _hopper(index: int) -> bool:
    """Whether CUDA device `index` is sm_90 or newer."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _pdl_capable(index: int) -> bool:
    from ttsbuild.plugins._tl._math import HAS_GDC

    return HAS_GDC and _hopper(index)


@functools.cache
def _host_descriptors() -> bool:
    """Whether this Triton has host-side tensor descriptors (added after 3.3, which the
    package allows)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def on_hopper(t: torch.Tensor) -> bool:
    """Whether `t` is on a CUDA device of sm_90 or newer."""
    return t.is_cuda and _hopper(t.device.index if t.device.index is not None else 0)


def tma_capable(t: torch.Tensor) -> bool:
    """Whether kernels on host-side tensor descriptors (TMA loads) can take `t`: a Triton that
    has them and, for a CUDA tensor, sm_90 or newer (the interpreter runs them on the CPU)."""
    if not _host_descriptors():
        return False
    return not t.is_cuda or on_hopper(t)


def pdl_enabled(t: torch.Tensor) -> bool:
    """Launch the decode kernels with programmatic dependent launch (each kernel's programs
    start during the previous kernel and wait for it on the device: `_tl._math.pdl_prologue`).
    On for CUDA tensors on Hopper and later; TTSBUILD_PDL=0 turns it off (side-by-side
    measurements), and the interpreter never uses it."""
    if not t.is_cuda or interpret_mode() or os.environ.get("TTSBUILD_PDL", "1") == "0":
        return False
    return _pdl_capable(t.device.index if t.device.index is not None else 0)


def pdl_args(pdl: bool) -> dict:
    """A decode kernel's launch arguments for PDL: its PDL constexpr (`pdl_prologue`) and,
    only when on, Triton's launch_pdl option (a Triton without the option still launches the
    kernels with PDL off)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def pdl_early_reads() -> bool:
    """Inputs a caller vouches were written two or more launches back (`residual_ready`,
    `inputs_ready`) are read before the PDL wait; TTSBUILD_PDL_EARLY=0 reads them after it
    (side-by-side measurements)."""
    return os.environ.get("TTSBUILD_PDL_EARLY", "1") != "0"


def bulk_prefetchable(w: torch.Tensor) -> bool:
    """Whether `_tl._math.l2_prefetch_tile` takes w's row blocks: on the GPU (not the
    interpreter: inline PTX), rows contiguous, 16-byte aligned and a 16-byte multiple long."""
    return bool(
        w.is_cuda and not interpret_mode() and w.stride(-1) == 1
        and w.stride(-2) == w.shape[-1] and w.shape[-1] * w.element_size() % 16 == 0
        and w.data_ptr() % 16 == 0
    )  # fmt: skip


# Set while a codec step of few streams launches its kernels (`codec_pdl_scope`).
_CODEC_PDL_SCOPE: contextvars.ContextVar[bool] = contextvars.ContextVar("codec_pdl",
                                                                        default=False)


@contextlib.contextmanager
def codec_pdl_scope(on: bool):
    """Within it (on), the codec kernels launch with PDL (`codec_pdl_args`) as under
    TTSBUILD_CODEC_PDL=1: runtime.codec_engine wraps steps of at most CODEC_PDL_MAX_ROWS
    streams in it. Per thread (a context variable); a CUDA graph keeps what its capture
    launched."""
    token = _CODEC_PDL_SCOPE.set(on)
    try:
        yield
    finally:
        _CODEC_PDL_SCOPE.reset(token)


def codec_pdl_args(t: torch.Tensor) -> dict:
    """The codec kernels' PDL launch arguments (`pdl_args`): off unless TTSBUILD_CODEC_PDL=1
    or inside `codec_pdl_scope(True)` (and `pdl_enabled`). The kernels take it (each waits
    for the previous kernel before its first global access, as the decode kernels do), but on
    the H200 (2026-12-02, the served one-frame step) it was 0.856 -> 0.842 ms at batch 1 and
    slower from 8 rows on: 1.122 -> 1.185, 2.797 -> 2.868, 9.019 -> 9.076 ms at 8 / 64 / 256
    (benchmarks/codec/RESULTS.md)."""
    on = os.environ.get("TTSBUILD_CODEC_PDL", "0") == "1" or _CODEC_PDL_SCOPE.get()
    return pdl_args(pdl_enabled(t) and on)
