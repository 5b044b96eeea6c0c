"""Validation helpers shared by every stage that reads files: written once, used everywhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def read_json_object(path: str | Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object stored at `path`. Raises `error` with a message naming `what` when the
    file is missing, is not valid JSON (or UTF-8), or holds something other than an object."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} is missing ({path})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({path}: {exc})") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a JSON object ({path})")
    return value


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def damaged_files(root: Path, files: dict[str, str], verify_hashes: bool = True) -> list[str]:
    """What is wrong with the files a manifest lists (relative path -> sha256), in words."""
    problems = []
    for rel, digest in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif verify_hashes and sha256_file(p) != digest:
            problems.append(f"{rel} does not match its sha256 in manifest.json "
                            "(modified or corrupted)")
    return problems
