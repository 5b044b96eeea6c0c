"""Streaming safetensors writing, hashing and all-or-nothing output directories."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ttsbuild.convert.schema import TensorSpec

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in SAFETENSORS_DTYPES.items()}


class OutputExistsError(FileExistsError):
    pass


def write_safetensors(
    path: Path,
    specs: Iterable[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    on_tensor=None,
) -> None:
    """Write a safetensors file one tensor at a time.

    The header is computed up front from `specs`; `tensors` must then yield exactly those
    tensors in that order (checked), so only one tensor needs to be in memory at once.
    `on_tensor(spec)` is called after each tensor is written (for progress bars).
    """
    specs = list(specs)
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        size = spec.numel * _ITEMSIZE[spec.dtype]
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        it = iter(tensors)
        for spec in specs:
            try:
                name, tensor = next(it)
            except StopIteration:
                raise ValueError(f"{path.name}: tensor {spec.name} was never produced") from None
            if name != spec.name or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{path.name}: expected {spec.name} {spec.shape}, "
                                 f"got {name} {tuple(tensor.shape)}")
            if TORCH_TO_SAFETENSORS.get(tensor.dtype) != spec.dtype:
                raise ValueError(f"{path.name}: {name} is {tensor.dtype}, expected {spec.dtype}")
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                f.write(data.view(torch.uint8).numpy().data)
            del tensor, data
            if on_tensor is not None:
                on_tensor(spec)
        if next(it, None) is not None:
            raise ValueError(f"{path.name}: more tensors produced than declared")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextlib.contextmanager
def atomic_output_dir(dst: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temp dir beside `dst`; on success it becomes `dst`, on any failure
    (including KeyboardInterrupt) it is removed and nothing is left behind.

    An existing non-empty `dst` is refused unless `force`; with `force` it is replaced only
    after the new output is complete.
    """
    dst = Path(dst).absolute()
    if dst.exists() and not dst.is_dir():
        raise OutputExistsError(f"output {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise OutputExistsError(f"output directory {dst} exists and is not empty "
                                "(use --force to replace it)")
    created: list[Path] = []
    parent = dst.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    tag = uuid.uuid4().hex[:8]
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{tag}"
    try:
        for p in reversed(created):
            p.mkdir()
        tmp.mkdir()
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{os.getpid()}-{tag}"
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
