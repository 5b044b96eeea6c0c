"""Checkpoint handling: the official layout (schema), conversion, stand-ins, loading."""

from ttsbuild.convert.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from ttsbuild.convert.convert import ConversionError, convert_checkpoint
from ttsbuild.convert.init_random import VARIANTS, write_random_checkpoint

__all__ = [
    "VARIANTS",
    "Checkpoint",
    "CheckpointError",
    "ConversionError",
    "convert_checkpoint",
    "load_checkpoint",
    "write_random_checkpoint",
]
