"""Parsing of human-friendly CLI values (durations, rate lists, key=value pairs).

Each parser raises ValueError with a message meant for the user; the CLI wraps it in
typer.BadParameter so a bad flag prints one line, not a traceback.
"""

from __future__ import annotations

import json
import math
import re

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """'500ms' | '60s' | '2m' | '1h' | '1.5' (bare number = seconds) -> seconds."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration; use e.g. 500ms, 60s, 2m, 1h")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds == 0 and not allow_zero:
        raise ValueError(f"{text!r}: duration must be greater than zero")
    return seconds


def parse_rate(text: str) -> float:
    """A request rate in requests/second: a finite number > 0."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of requests per second") from None
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"{text!r}: the request rate must be a finite number > 0")
    return rate


def parse_rate_list(text: str) -> list[float]:
    """'1,4,8' -> [1.0, 4.0, 8.0]; rejects empties and duplicates."""
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(part == "" for part in parts):
        raise ValueError(f"{text!r}: give comma-separated rates, e.g. 1,4,8")
    rates = [parse_rate(part) for part in parts]
    if len(set(rates)) != len(rates):
        raise ValueError(f"{text!r}: each rate may appear once")
    return rates


def parse_key_value(text: str, *, json_values: bool) -> tuple[str, object]:
    """'key=value' -> (key, value). With json_values, the value is JSON-parsed when it is valid
    JSON (so `stream=false` is a bool and `speed=1.2` a number) and kept as a string otherwise."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{text!r} is not of the form key=value")
    if not json_values:
        return key, raw
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
