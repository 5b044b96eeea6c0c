"""Open either artifact the pipeline produces: a converted checkpoint or a compiled engine.

Which one it is comes from manifest.json's `format` field, never from a name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ttsbuild.runtime.engine import Models


def artifact_format(path: str | Path) -> str | None:
    """manifest.json's `format` ("ttsbuild-checkpoint", "ttsbuild-engine"), None if unreadable."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def load_models(path: str | Path, device: str | torch.device = "cpu") -> Models:
    """Models for the eager engine from a checkpoint dir or an engine dir (FP8 dequantised)."""
    from ttsbuild.build.engine_dir import ENGINE_FORMAT, load_engine_dir, models_from_engine
    from ttsbuild.convert.checkpoint import load_checkpoint

    if artifact_format(path) == ENGINE_FORMAT:
        return models_from_engine(load_engine_dir(path, device), device)
    return Models.load(load_checkpoint(path), device=device)
