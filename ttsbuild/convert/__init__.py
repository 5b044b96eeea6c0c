"""Checkpoint handling: the official layout (schema), conversion, stand-ins, loading."""

from ttsbuild.convert.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from ttsbuild.convert.convert import ConversionError, convert_checkpoint
from ttsbuild.convert.init_random import VARIANTS, init_random

__all__ = [
    "VARIANTS",
    "Checkpoint",
    "CheckpointError",
    "ConversionError",
    "convert_checkpoint",
    "init_random",
    "load_checkpoint",
]
