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


def load_models(
    path: str | Path, device: str | torch.device = "cpu", decoder_layers: bool = True
) -> Models:
    """Models from a checkpoint dir or an engine dir. decoder_layers=False (the graph engine,
    engine dirs only): the packed tensors as compiled, no dequantised layer modules."""
    from ttsbuild.build.engine_dir import ENGINE_FORMAT, load_engine_dir, models_from_engine
    from ttsbuild.convert.checkpoint import load_checkpoint

    if artifact_format(path) == ENGINE_FORMAT:
        return models_from_engine(
            load_engine_dir(path, device), device, decoder_layers=decoder_layers
        )
    return Models.load(load_checkpoint(path), device=device)
