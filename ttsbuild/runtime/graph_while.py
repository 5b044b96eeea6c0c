"""WHILE nodes in a CUDA graph being captured (the step driver's `csrc/graph_while.cu`).

A loop whose trip count is decided on the device (the speculative code predictor's rounds:
a frame needs as many rounds as its rows take to accept 15 codebooks) is captured as a body
graph of its own, then added to the graph being captured as a WHILE node that runs the body
again while an int32 flag in device memory is non-zero, at most `max_iterations` times. The
body sets the flag itself. torch 2.11 has no conditional nodes in Python (2.13's C++
`begin_capture_to_if_node` captures the body on a second stream with the allocator routed to
it); here the body's memory is its own graph pool, kept by its `torch.cuda.CUDAGraph`, which
must outlive every graph that holds the node (`WhileBody` keeps both together).

    body = WhileBody.capture(step, flag)         # outside any capture; step() sets flag
    with torch.cuda.graph(frame_graph):          # the graph that holds the loop
        ...                                      # work before the loop
        body.run(max_iterations=14)              # the loop, decided on the device

Programmatic edges (kernels captured with programmatic dependent launch: the Triton kernels
on Hopper) in the body: CUDA documents which node types a conditional body may hold, not
which edges. `full_edges()` decides once per process: TTSBUILD_WHILE_EDGES=keep keeps them,
=full makes each a full dependency in the node's copy of the body (the kernels' dependency
waits then return at once), =auto (default) keeps them where a probe graph with one runs on
this device (`while_keeps_programmatic_edges` in the step driver).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from ttsbuild.runtime.driver import DriverUnavailable, driver_module


def while_nodes_available() -> bool:
    """Whether the step driver was built with graph_while.cu (CUDA >= 12.4, setup.py) and
    torch hands out a captured graph's cudaGraph_t (`keep_graph`, `raw_cuda_graph`)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        return False
    try:
        return hasattr(driver_module(True), "capture_while")
    except DriverUnavailable:
        return False


@functools.cache
def full_edges() -> bool:
    """Whether WHILE bodies get their programmatic edges made full (see the module doc)."""
    mode = os.environ.get("TTSBUILD_WHILE_EDGES", "auto")
    if mode not in ("auto", "keep", "full"):
        raise ValueError(f"TTSBUILD_WHILE_EDGES must be auto, keep or full, got {mode!r}")
    if mode != "auto":
        return mode == "full"
    return not driver_module(True).while_keeps_programmatic_edges()


class WhileBody:
    """A captured loop body and the device words its WHILE nodes read: `flag` (int32 [1],
    set by the body: run again while non-zero) and a counter of iterations (int32 [1])."""

    def __init__(self, graph: torch.cuda.CUDAGraph, flag: torch.Tensor):
        if flag.dtype != torch.int32 or flag.numel() != 1 or not flag.is_cuda:
            raise ValueError("the WHILE flag must be one int32 on the GPU")
        self.graph = graph
        self.flag = flag
        self.counter = torch.zeros(1, dtype=torch.int32, device=flag.device)
        self.full_edges = full_edges()  # probed here, outside any capture

    @classmethod
    def capture(cls, step: Callable[[], None], flag: torch.Tensor, pool=None,
                warmup: int = 2) -> WhileBody:  # fmt: skip
        """Capture step() (which must leave the loop's condition in `flag`) as a body graph.
        Not under another capture: the body is its own graph (its own pool unless `pool`)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("capture the WHILE body before the graph that holds it")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # allocator, Triton autotuning, cuBLAS handles
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            step()
        return cls(graph, flag)

    def run(self, max_iterations: int) -> None:
        """Add the loop at the current stream's position in the graph being captured: the
        body runs while `flag` is non-zero (checked before each iteration), at most
        max_iterations times."""
        if not torch.cuda.is_current_stream_capturing():
            raise RuntimeError("WhileBody.run adds a node to a graph being captured")
        driver_module(True).capture_while(
            torch.cuda.current_stream().cuda_stream, self.graph.raw_cuda_graph(),
            self.flag.data_ptr(), self.counter.data_ptr(), int(max_iterations),
            full_edges=self.full_edges,
        )  # fmt: skip

    def iterations(self) -> int:
        """Iterations the last loop ran (reads the device: not for the hot path)."""
        return int(self.counter.item())
