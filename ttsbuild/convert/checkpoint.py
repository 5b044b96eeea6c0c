"""Reading a converted ttsbuild checkpoint (the output of `ttsbuild convert`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ttsbuild.convert.convert import MANIFEST_FORMAT, MANIFEST_VERSION, MODULE_NAMES
from ttsbuild.validation import damaged_files, read_json_object


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, malformed or altered since conversion."""


@dataclass
class Checkpoint:
    path: Path
    manifest: dict
    config: dict
    codec_config: dict
    generation_config: dict

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def is_standin(self) -> bool:
        return self.manifest.get("standin") is not None

    @property
    def standin(self) -> dict | None:
        return self.manifest.get("standin")

    @property
    def modules(self) -> list[str]:
        return [m for m, f in MODULE_NAMES.items() if f in self.manifest["files"]]

    def tensors(self, module: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """All tensors of one module: talker, code_predictor, speaker_encoder, codec,
        codec_encoder (names without the official prefix, dtypes as stored)."""
        if module not in MODULE_NAMES:
            raise KeyError(f"unknown module {module!r}; known: {', '.join(MODULE_NAMES)}")
        fname = MODULE_NAMES[module]
        if fname not in self.manifest["files"]:
            raise KeyError(f"checkpoint {self.path} has no {module} module")
        return load_file(self.path / fname, device=str(device))


def _load_json(path: Path, what: str) -> dict:
    return read_json_object(path, what, CheckpointError)


def load_checkpoint(path: str | Path, verify_hashes: bool = True) -> Checkpoint:
    """Open a converted checkpoint, checking the manifest and (by default) every file hash."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    manifest = _load_json(root / "manifest.json", "manifest.json")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{root} is not a ttsbuild checkpoint (manifest format is "
                              f"{manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}); "
                              "convert an official checkpoint with `ttsbuild convert`")
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{root}: checkpoint format version "
                              f"{manifest.get('format_version')!r} is not supported "
                              f"(this ttsbuild reads version {MANIFEST_VERSION}); re-convert it")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{root}: manifest.json lists no files")
    problems = damaged_files(root, files, verify_hashes)
    if problems:
        raise CheckpointError(f"checkpoint {root} is damaged: " + "; ".join(problems))
    return Checkpoint(
        path=root,
        manifest=manifest,
        config=_load_json(root / "config.json", "config.json"),
        codec_config=_load_json(root / "speech_tokenizer_config.json",
                                "speech_tokenizer_config.json"),
        generation_config=_load_json(root / "generation_config.json", "generation_config.json"),
    )
