"""Open an engine for serving or synthesis from a converted checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import EagerEngine, Models


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_engine(
    path: str | Path,
    device: str | torch.device | None = None,
    num_slots: int = 8,
    max_len: int = 2048,
) -> EagerEngine:
    """Load `path` (a `ttsbuild convert` output) into an engine with `num_slots` slots."""
    device = torch.device(device) if device is not None else default_device()
    models = Models.load(load_checkpoint(path), device=device)
    return EagerEngine(models, num_slots=num_slots, max_len=max_len)
