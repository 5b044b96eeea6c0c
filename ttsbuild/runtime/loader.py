"""Open an engine for serving or synthesis from a checkpoint dir or a compiled engine dir."""

from __future__ import annotations

from pathlib import Path

import torch

from ttsbuild.generation.guards import GuardConfig
from ttsbuild.runtime.artifact import load_models
from ttsbuild.runtime.engine import EagerEngine

ENGINE_KINDS = ("auto", "graph", "eager")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on; a clear error for one this machine does not have."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but this machine has no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported (use cpu or cuda)")
    return dev


def open_engine(
    path: str | Path | None,
    device: str | torch.device | None = None,
    num_slots: int = 8,
    max_len: int = 2048,
    kind: str = "auto",
    precision: str | None = None,
    random_variant: str | None = None,
    guards: GuardConfig | None = None,
):
    """Load `path` into an engine with `num_slots` slots (or, for benchmarks, in-memory
    random weights of `random_variant`, e.g. "1.7b-customvoice", when path is None).

    kind: "graph" (slot buffers + CUDA graphs: the fast path), "eager" (the reference
    modules), or "auto" (graph on CUDA, eager on CPU). precision (graph engines): "bf16" or
    "fp8"; default: what a compiled engine's manifest says, bf16 for a checkpoint. guards:
    the stopping guards (default: all on, `GuardConfig()`)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    device = resolve_device(device)
    if (path is None) == (random_variant is None):
        raise ValueError("give exactly one of a path or a random variant")
    if random_variant is not None:
        from ttsbuild.runtime.engine import random_models

        models = random_models(random_variant, device=device)
    else:
        models = load_models(path, device=device)
    if kind == "auto":
        kind = "graph" if device.type == "cuda" else "eager"
    if kind == "eager":
        return EagerEngine(models, num_slots=num_slots, max_len=max_len, guards=guards)

    from ttsbuild.runtime.graph_engine import GraphEngine, RuntimeConfig

    if precision is None:
        precision = models.manifest.get("precision", "bf16")
    shapes = models.manifest.get("shapes")  # a compiled engine declares its static shapes
    if shapes:
        if num_slots > shapes["max_batch"] or max_len > shapes["max_len"]:
            raise ValueError(
                f"{path} was compiled for at most {shapes['max_batch']} streams and "
                f"{shapes['max_len']} positions; asked for {num_slots} and {max_len} "
                "(recompile with --max-batch/--max-len)"
            )
        buckets = tuple(b for b in shapes["batch_buckets"] if b < num_slots) + (num_slots,)
    else:
        buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < num_slots) + (num_slots,)
    rcfg = RuntimeConfig(
        num_slots=num_slots, max_len=max_len, batch_buckets=buckets, precision=precision
    )
    return GraphEngine(models, rcfg, guards)
