"""L2 residency for weights a frame reads many times (issue 9).

The code predictor streams its whole stack (1.7B: ~79 MB of FP8 linears) once per pass, 15
passes a frame. That is more than the H100's and H200's L2 (50 MB), and a cyclic stream over a
working set larger than an LRU cache hits almost never: every pass reads all of it from HBM.
CUDA can set a part of L2 aside for "persisting" accesses (`cudaLimitPersistingL2CacheSize`)
and mark a kernel's accesses to one address window as persisting with a probability
(`cudaAccessPolicyWindow.hitRatio`): with the ratio at set-aside / window bytes, a fixed share of
the weights stays in L2 across passes and frames (the talker's streaming reads, which are
normal accesses, cannot evict persisting lines from the set-aside), and each pass reads only
the rest from HBM.

A window is one contiguous range, so the weights it covers must lie in one allocation:
`arena` copies tensors into one and hands back views. `GraphEngine` puts the window on the
kernel nodes of its captured graphs (`apply_to_graph`, on a graph captured with
`keep_graph=True`, before it is instantiated); the access property of an address outside the
window is unchanged, so every kernel node may carry it.

The CUDA runtime calls go through ctypes to the libcudart torch has loaded; off CUDA nothing
here is called (`window_for` and `arena` are plain tensor arithmetic, tested on the CPU).

Measured on an H100 (benchmarks/runtime/2026-12-08-h100-l2): no gain in the engine's frame at
1 / 16 / 64 rows, while the set-aside (31.2 MiB there) slowed what streams past it (the codec
at 64 streams 2.20 -> 2.96 ms, a 4 x 256-token prefill 7.72 -> 9.04): off by default
(TTSBUILD_CP_L2_PERSIST, `env_share`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

# cudaLimitPersistingL2CacheSize; cudaLaunchAttributeAccessPolicyWindow (the stream and
# kernel-node attribute ids are the launch attribute's); cudaGraphNodeTypeKernel;
# cudaAccessPropertyNormal / Streaming / Persisting; cudaDevAttrMaxPersistingL2CacheSize /
# MaxAccessPolicyWindowSize
_LIMIT_PERSISTING_L2 = 0x06
_ATTR_ACCESS_POLICY_WINDOW = 1
_NODE_KERNEL = 0
NORMAL, STREAMING, PERSISTING = 0, 1, 2
_DEV_MAX_PERSISTING_L2, _DEV_MAX_WINDOW = 108, 109


class _Window(ctypes.Structure):  # struct cudaAccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hitRatio", ctypes.c_float), ("hitProp", ctypes.c_int),
                ("missProp", ctypes.c_int)]  # fmt: skip


class _AttrValue(ctypes.Union):  # union cudaLaunchAttributeValue (64 bytes)
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


@dataclass(frozen=True)
class Window:
    """An access-policy window: `num_bytes` from address `base`, a `hit_ratio` share of its
    accesses persisting (the rest `miss_prop`)."""

    base: int
    num_bytes: int
    hit_ratio: float
    miss_prop: int = STREAMING

    def value(self) -> _AttrValue:
        v = _AttrValue()
        v.window = _Window(self.base, self.num_bytes, self.hit_ratio, PERSISTING, self.miss_prop)
        return v


def span(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(first address, bytes to the end of the last) of the tensors' data."""
    lo = min(t.data_ptr() for t in tensors)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    return lo, hi - lo


def window_for(tensors: list[torch.Tensor], set_aside: int, max_window: int,
               share: float = 1.0, miss_prop: int = STREAMING) -> Window | None:  # fmt: skip
    """The window over `tensors` (which must lie in one span of about their own size: from
    `arena`), persisting `share` x set_aside / span of its accesses (at most all). None where
    nothing can persist or the span exceeds the device's largest window."""
    if not tensors or set_aside <= 0 or share <= 0:
        return None
    base, size = span(tensors)
    held = sum(t.numel() * t.element_size() for t in tensors)
    if size > max_window or size > 2 * held:  # another allocation's data between them
        return None
    return Window(base, size, min(1.0, share * set_aside / size), miss_prop)


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied into one allocation, each at a 256-byte aligned offset, as views of
    the same dtypes and shapes (in order). The originals are left as they are: callers point
    their references at the views and drop the originals."""
    align = 256
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // align) * align
    device = tensors[0].device if tensors else "cpu"
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    views = []
    for t, off in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        v = buf[off : off + n].view(t.dtype).view(t.shape)
        v.copy_(t)
        views.append(v)
    return views


def env_share() -> float:
    """TTSBUILD_CP_L2_PERSIST: the share of the L2 set-aside the code predictor's window asks
    for (0, the default: off; 1: all of it)."""
    raw = os.environ.get("TTSBUILD_CP_L2_PERSIST", "0")
    try:
        share = float(raw)
    except ValueError:
        raise ValueError(f"TTSBUILD_CP_L2_PERSIST={raw!r}: a number from 0 to 1") from None
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"TTSBUILD_CP_L2_PERSIST={raw!r}: a number from 0 to 1")
    return share


class CudaRuntime:
    """The few CUDA runtime calls L2 persistence needs, through ctypes."""

    def __init__(self):
        self.lib = _load_cudart()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = self.lib.cudaGetErrorString
            name.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: CUDA error {rc} ({name(rc).decode()})")

    def device_attr(self, attr: int, device: int) -> int:
        v = ctypes.c_int()
        self._check(self.lib.cudaDeviceGetAttribute(ctypes.byref(v), attr, device),
                    "cudaDeviceGetAttribute")  # fmt: skip
        return v.value

    def limits(self, device: int) -> tuple[int, int]:
        """(largest L2 set-aside, largest access-policy window) in bytes."""
        return self.device_attr(_DEV_MAX_PERSISTING_L2, device), \
            self.device_attr(_DEV_MAX_WINDOW, device)  # fmt: skip

    def set_aside(self, nbytes: int) -> int:
        """Set the persisting L2 set-aside (on the current device); returns what it is now."""
        self._check(self.lib.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(nbytes)),
                    "cudaDeviceSetLimit(persisting L2)")  # fmt: skip
        v = ctypes.c_size_t()
        self._check(self.lib.cudaDeviceGetLimit(ctypes.byref(v), _LIMIT_PERSISTING_L2),
                    "cudaDeviceGetLimit(persisting L2)")  # fmt: skip
        return v.value

    def reset_persisting(self) -> None:
        """Every persisting line in L2 back to normal."""
        self._check(self.lib.cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")

    def set_stream_window(self, stream: torch.cuda.Stream, window: Window) -> None:
        v = window.value()
        self._check(self.lib.cudaStreamSetAttribute(
            ctypes.c_void_p(stream.cuda_stream), _ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(v)),
            "cudaStreamSetAttribute(access policy window)")  # fmt: skip

    def _kernel_nodes(self, graph: int) -> list[ctypes.c_void_p]:
        n = ctypes.c_size_t()
        self._check(self.lib.cudaGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)),
                    "cudaGraphGetNodes")  # fmt: skip
        nodes = (ctypes.c_void_p * n.value)()
        self._check(self.lib.cudaGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n)),
                    "cudaGraphGetNodes")  # fmt: skip
        kernels = []
        for node in nodes[: n.value]:
            kind = ctypes.c_int()
            self._check(self.lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)),
                        "cudaGraphNodeGetType")  # fmt: skip
            if kind.value == _NODE_KERNEL:
                kernels.append(ctypes.c_void_p(node))
        return kernels

    def node_windows(self, graph: int) -> list[tuple[int, int, float]]:
        """Each kernel node's window (base, bytes, hit ratio): what a capture recorded."""
        out = []
        for node in self._kernel_nodes(graph):
            v = _AttrValue()
            self._check(self.lib.cudaGraphKernelNodeGetAttribute(
                node, _ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(v)),
                "cudaGraphKernelNodeGetAttribute")  # fmt: skip
            w = v.window
            out.append((w.base_ptr or 0, w.num_bytes, w.hitRatio))
        return out

    def apply_to_graph(self, graph: torch.cuda.CUDAGraph, window: Window) -> int:
        """Put `window` on every kernel node of `graph` (captured with keep_graph=True, not yet
        instantiated); returns the number of nodes."""
        v = window.value()
        nodes = self._kernel_nodes(graph.raw_cuda_graph())
        for node in nodes:
            self._check(self.lib.cudaGraphKernelNodeSetAttribute(
                node, _ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(v)),
                "cudaGraphKernelNodeSetAttribute(access policy window)")  # fmt: skip
        return len(nodes)


def _load_cudart() -> ctypes.CDLL:
    """The libcudart this process has loaded (torch's), else one by its usual names."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for name in sorted(paths) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("L2 persistence needs the CUDA runtime (libcudart): none found")
