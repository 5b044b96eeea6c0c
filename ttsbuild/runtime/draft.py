"""Trained draft heads for speculative decoding of the code predictor (`runtime.cp_spec`).

A draft is one safetensors file (`draft.safetensors` once attached to a checkpoint):
  tensor    heads.weight  [G - 1, codebook_size, code-predictor hidden], fp32 / bf16 / fp16:
            row c - 1 drafts codebook c from the target's final-norm code-predictor hidden
            state at a depth d < c (the position whose own head gives codebook d)
  metadata  format "ttsbuild-draft", format_version "1", kind "heads", num_code_groups,
            codebook_size, hidden_size (the target it fits), window (the largest drafting
            window it was trained for); anything else is kept as information.
Why heads and not a 1-2 layer draft code predictor: all k drafts of a round come from one
hidden state in one batched GEMV (no sequential draft passes, which at batch 1 cost launches
like the target's own passes), the self-speculative draft is the same thing with the
target's heads (so a trained draft starts from it and can only improve on it), and
training touches only G - 1 linear maps on frozen hidden states. Its limit: a head cannot
see the codes sampled between depth d and c; a draft that must is a draft code predictor.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ttsbuild.model.config import ModelConfig
from ttsbuild.validation import sha256_file

DRAFT_FILE = "draft.safetensors"
DRAFT_FORMAT, DRAFT_VERSION = "ttsbuild-draft", "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DraftError(ValueError):
    """A draft file that is malformed or does not fit its target."""


def draft_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.num_code_groups - 1, cfg.codebook_size, cfg.code_predictor.hidden_size


def draft_metadata(cfg: ModelConfig, window: int, **info: str) -> dict[str, str]:
    G, V, H = draft_shape(cfg)
    meta = {"format": DRAFT_FORMAT, "format_version": DRAFT_VERSION, "kind": "heads",
            "num_code_groups": str(G + 1), "codebook_size": str(V), "hidden_size": str(H),
            "window": str(window)}  # fmt: skip
    return {**{k: str(v) for k, v in info.items()}, **meta}


def write_draft(path: str | Path, heads: torch.Tensor, cfg: ModelConfig, window: int,
                **info: str) -> None:  # fmt: skip
    """Write draft heads [G - 1, V, H] in the documented layout (checked on the way out)."""
    _check_tensor(heads.shape, heads.dtype, cfg, str(path))
    save_file({"heads.weight": heads.detach().contiguous().cpu()}, str(path),
              metadata=draft_metadata(cfg, window, **info))  # fmt: skip


def read_draft(path: str | Path, cfg: ModelConfig) -> tuple[torch.Tensor, dict[str, str]]:
    """The draft heads and metadata of `path`, or a DraftError saying why they do not fit."""
    path = Path(path)
    if not path.is_file():
        raise DraftError(f"draft {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
            _check_metadata(meta, cfg, path)
            if keys != ["heads.weight"]:
                raise DraftError(
                    f"draft {path} must hold exactly one tensor 'heads.weight', found {keys}"
                )
            heads = f.get_tensor("heads.weight")
    except SafetensorError as exc:
        raise DraftError(f"draft {path} is not a readable safetensors file: {exc}") from None
    _check_tensor(heads.shape, heads.dtype, cfg, str(path))
    if not torch.isfinite(heads).all():
        raise DraftError(f"draft {path}: heads.weight has non-finite values")
    return heads, meta


def _check_metadata(meta: dict[str, str], cfg: ModelConfig, path: Path) -> None:
    if meta.get("format") != DRAFT_FORMAT:
        raise DraftError(f"{path} is not a ttsbuild draft (metadata format is "
                         f"{meta.get('format')!r}, expected {DRAFT_FORMAT!r})")  # fmt: skip
    if meta.get("format_version") != DRAFT_VERSION:
        raise DraftError(f"draft {path}: format version {meta.get('format_version')!r} is not "
                         f"supported (this ttsbuild reads {DRAFT_VERSION})")  # fmt: skip
    if meta.get("kind") != "heads":
        raise DraftError(f"draft {path}: kind {meta.get('kind')!r} is not supported ('heads')")
    G, V, H = draft_shape(cfg)
    expected = {"num_code_groups": G + 1, "codebook_size": V, "hidden_size": H}
    for key, want in expected.items():
        if meta.get(key) != str(want):
            raise DraftError(f"draft {path} was made for {key} {meta.get(key)}, but the target "
                             f"has {want}")  # fmt: skip
    window = meta.get("window", "")
    if not window.isdigit() or int(window) < 1:
        raise DraftError(f"draft {path}: window {window!r} must be a positive integer")


def _check_tensor(shape, dtype, cfg: ModelConfig, where: str) -> None:
    G, V, H = draft_shape(cfg)
    if tuple(shape) != (G, V, H):
        raise DraftError(
            f"draft {where}: heads.weight has shape {tuple(shape)}, but this target needs "
            f"({G}, {V}, {H}) ({G} codebooks x {V} codes x {H} code-predictor hidden)"
        )
    if dtype not in DTYPES:
        raise DraftError(f"draft {where}: heads.weight dtype {dtype} is not one of {DTYPES}")


def check_draft_for_config(draft: str | Path, config_json: str | Path) -> dict[str, str]:
    """Validate a draft against the target an official / converted config.json describes."""
    from ttsbuild.model.config import ConfigError
    from ttsbuild.validation import read_json_object

    try:
        cfg = ModelConfig.from_official(read_json_object(config_json, "config.json", DraftError))
    except ConfigError as exc:
        raise DraftError(f"cannot check the draft: the target's config is invalid: {exc}") from None
    return read_draft(draft, cfg)[1]


def attach_draft(checkpoint: str | Path, draft: str | Path) -> dict[str, str]:
    """Validate `draft` against a converted checkpoint and ship it inside it (listed, with
    its sha256, in the checkpoint's manifest). Nothing is changed when the draft is refused."""
    import json

    from ttsbuild.convert.checkpoint import CheckpointError, load_checkpoint

    try:
        ckpt = load_checkpoint(checkpoint, verify_hashes=False)
    except CheckpointError as exc:
        raise DraftError(str(exc)) from None
    _, meta = read_draft(draft, ModelConfig.from_official(ckpt.config))
    target = ckpt.path / DRAFT_FILE
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(draft, tmp)
    tmp.replace(target)
    manifest = dict(ckpt.manifest)
    manifest["files"] = {**manifest["files"], DRAFT_FILE: sha256_file(target)}
    manifest["draft"] = meta
    tmp_manifest = ckpt.path / "manifest.json.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp_manifest.replace(ckpt.path / "manifest.json")
    return meta


def load_attached_draft(root: Path, files: dict, cfg: ModelConfig, device, dtype):
    """The draft heads a checkpoint or engine ships (None without one), on device; `files`
    is its manifest's file list."""
    if DRAFT_FILE not in files:
        return None
    heads, _ = read_draft(Path(root) / DRAFT_FILE, cfg)
    return heads.to(device=device, dtype=dtype)
