"""Validation helpers shared by every stage that reads files: written once, used everywhere."""

from __future__ import annotations

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
