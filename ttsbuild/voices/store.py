"""Registered voices on disk: one directory per voice, written atomically.

    VOICES_DIR/<name>/voice.json          format, name, mode, transcript, clip facts, created
    VOICES_DIR/<name>/voice.safetensors   x_vector [hidden] f32, ref_codes [frames, 16] i64
    VOICES_DIR/<name>/clip.bin            the uploaded clip, only when asked to keep it

A voice is built in a hidden temp directory beside its final place and renamed into place in
one step, so a crash or a refused request never leaves a half-written voice, and two servers
sharing the directory cannot both register one name (the second rename fails). In one
process, a name is reserved before its clip is encoded, so a concurrent registration of the
same name is refused at once instead of encoding twice. Deletion renames the directory out
of the way first, so a voice is either listed whole or gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ttsbuild.voices.encoder import ClonedVoice

log = logging.getLogger(__name__)

FORMAT = "ttsbuild-voice"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_HIDDEN = (".tmp-", ".trash-")


class VoiceStoreError(ValueError):
    """A registration or deletion we refuse; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class VoiceRecord:
    name: str
    voice: ClonedVoice
    meta: dict  # voice.json

    def info(self) -> dict:
        m = self.meta
        return {"id": self.name, "name": self.name, "type": "cloned", "mode": m["mode"],
                "transcript": m["transcript"], "seconds": m["seconds"],
                "created": m["created"], "clip_kept": m["clip"] is not None}


def check_name(name: str) -> str:
    name = (name or "").strip().lower()
    if not NAME_RE.match(name):
        raise VoiceStoreError("voice name must be 1-64 characters of a-z, 0-9, '_', '-', '.', "
                              "starting with a letter or digit")
    return name


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


class VoiceStore:
    """Registered voices of one model (x-vector size `x_vector_size`); `root` None keeps them
    in memory only."""

    def __init__(self, root: str | Path | None, x_vector_size: int):
        self.root = Path(root) if root is not None else None
        self.x_vector_size = x_vector_size
        self._lock = threading.Lock()
        self._voices: dict[str, VoiceRecord] = {}
        self._pending: set[str] = set()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._load_all()

    # -- reading ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._voices)

    def __contains__(self, name: str) -> bool:
        return name in self._voices

    def get(self, name: str) -> VoiceRecord | None:
        return self._voices.get(name)

    def records(self) -> list[VoiceRecord]:
        return [self._voices[n] for n in self.names()]

    def _load_all(self) -> None:
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(_HIDDEN):  # a crash mid-write or mid-delete
                shutil.rmtree(entry, ignore_errors=True)
                continue
            if not entry.is_dir():
                continue
            try:
                self._voices[entry.name] = self._load(entry)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("skipping voice %s: %s", entry, exc)

    def _load(self, path: Path) -> VoiceRecord:
        meta = json.loads((path / "voice.json").read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError("not a ttsbuild voice (format / version)")
        if meta.get("name") != path.name:
            raise ValueError("voice.json names another voice")
        tensors = load_file(path / "voice.safetensors")
        x_vector, codes = tensors["x_vector"], tensors["ref_codes"]
        if tuple(x_vector.shape) != (self.x_vector_size,):
            raise ValueError(f"x-vector of size {tuple(x_vector.shape)} was made for another "
                             f"model (this one needs {self.x_vector_size})")
        if codes.dim() != 2 or codes.dtype != torch.int64:
            raise ValueError("ref_codes must be int64 [frames, groups]")
        voice = ClonedVoice(x_vector.float(), codes, meta.get("transcript"))
        return VoiceRecord(path.name, voice, meta)

    # -- writing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, name: str, reserved_names=()):
        """Claim `name` while its clip is encoded; refuses a taken or reserved name (409)."""
        name = check_name(name)
        with self._lock:
            if name in reserved_names:
                raise VoiceStoreError(f"{name!r} is a built-in voice", 409)
            if name in self._voices or name in self._pending:
                raise VoiceStoreError(f"a voice named {name!r} already exists", 409)
            self._pending.add(name)
        try:
            yield name
        finally:
            with self._lock:
                self._pending.discard(name)

    def add(self, name: str, voice: ClonedVoice, facts: dict, clip: bytes | None = None
            ) -> VoiceRecord:
        """Store a voice reserved with `reserve`; all or nothing."""
        if tuple(voice.x_vector.shape) != (self.x_vector_size,):
            raise VoiceStoreError("x-vector size does not match the model", 500)
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": name,
            "mode": "x-vector" if voice.transcript is None else "in-context",
            "transcript": voice.transcript, "frames": int(voice.ref_codes.shape[0]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "clip": "clip.bin" if clip is not None else None, **facts,
        }
        record = VoiceRecord(name, voice, meta)
        if self.root is not None:
            self._write(record, clip)
        with self._lock:
            self._voices[name] = record
        return record

    def _write(self, record: VoiceRecord, clip: bytes | None) -> None:
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            save_file({"x_vector": record.voice.x_vector.contiguous(),
                       "ref_codes": record.voice.ref_codes.contiguous()},
                      str(tmp / "voice.safetensors"))
            if clip is not None:
                (tmp / "clip.bin").write_bytes(clip)
            _write_json(tmp / "voice.json", record.meta)
            try:
                os.rename(tmp, self.root / record.name)  # fails if the name exists on disk
            except OSError:
                raise VoiceStoreError(f"a voice named {record.name!r} already exists",
                                      409) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def remove(self, name: str) -> VoiceRecord:
        name = (name or "").strip().lower()
        with self._lock:
            record = self._voices.pop(name, None)
            if record is None:
                raise VoiceStoreError(f"no registered voice named {name!r}", 404)
            if self.root is not None:
                trash = self.root / f".trash-{uuid.uuid4().hex}"
                try:
                    os.rename(self.root / name, trash)
                except OSError:
                    self._voices[name] = record
                    raise
        if self.root is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return record
