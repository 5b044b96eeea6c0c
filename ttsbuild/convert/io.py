"""Streaming safetensors writing, hashing and all-or-nothing output directories."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ttsbuild.convert.schema import TensorSpec
from ttsbuild.validation import sha256_file  # noqa: F401  (re-exported: callers import it here)

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
ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in SAFETENSORS_DTYPES.items()}


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
        size = spec.numel * ITEMSIZE[spec.dtype]
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


class SafetensorsFormatError(ValueError):
    pass


class SafetensorsReader:
    """Reads a safetensors file's header eagerly and its tensors one at a time.

    Unlike a memory map, each tensor is read into its own buffer and dropped after use, so
    converting a checkpoint keeps one tensor in memory, not the whole file. The header is
    checked for consistency (offsets contiguous, sizes matching shape x dtype, file not
    truncated) and any problem raised as `SafetensorsFormatError` in plain words.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(f"{self.path} is truncated ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise SafetensorsFormatError(
                    f"{self.path} is corrupt or truncated (header length {n}, file {size} bytes)")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise SafetensorsFormatError(
                    f"{self.path} is corrupt (header is not valid JSON)") from None
        if not isinstance(header, dict):
            raise SafetensorsFormatError(f"{self.path} is corrupt (header is not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        end = 0
        for name, e in sorted(header.items(), key=lambda kv: _offsets(kv[1])):
            try:
                dtype, shape = e["dtype"], tuple(int(s) for s in e["shape"])
                start, stop = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsFormatError(
                    f"{self.path} is corrupt (bad header entry for {name})") from None
            if dtype not in ITEMSIZE:
                raise SafetensorsFormatError(f"{self.path}: {name} has unsupported dtype {dtype}")
            nbytes = ITEMSIZE[dtype]
            for s in shape:
                nbytes *= s
            if start != end or stop - start != nbytes:
                raise SafetensorsFormatError(
                    f"{self.path} is corrupt (data offsets of {name} are inconsistent)")
            end = stop
            self.entries[name] = (dtype, shape, start, stop)
        if self.data_start + end > size:
            raise SafetensorsFormatError(
                f"{self.path} is truncated: header describes {self.data_start + end} bytes, "
                f"file has {size}")
        if self.data_start + end < size:
            raise SafetensorsFormatError(
                f"{self.path} is corrupt: {size - self.data_start - end} trailing bytes")

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        dtype, shape, _, _ = self.entries[name]
        return dtype, shape

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, start, stop = self.entries[name]
        buf = bytearray(stop - start)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + start)
            got = f.readinto(buf)
        if got != len(buf):
            raise SafetensorsFormatError(f"{self.path} is truncated while reading {name}")
        if not buf:
            return torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])
        return torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[dtype]).reshape(shape)


def _offsets(entry: object) -> tuple[int, int]:
    try:
        a, b = entry["data_offsets"]  # type: ignore[index]
        return int(a), int(b)
    except (KeyError, TypeError, ValueError):
        return (-1, -1)
