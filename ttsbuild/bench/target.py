"""Where and how to talk to the server under test.

Everything target-specific is data (extra body fields, headers, body format), never a code
branch, so any OpenAI-compatible speech endpoint can be benchmarked by configuration alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ttsbuild.bench.audio import BodyFormat

HTTP_PATH = "/v1/audio/speech"
WS_PATH = "/v1/audio/speech/ws"
DEFAULT_SAMPLE_RATE = 24_000
_TARGET_CONFIG_KEYS = {"extra_fields", "headers", "body_format", "sample_rate"}


class Mode(StrEnum):
    http = "http"  # one POST per request, whole text up front, streamed audio body
    ws = "ws"  # text streamed word by word over a WebSocket


@dataclass(frozen=True)
class Target:
    url: str  # the endpoint actually requested (path filled in)
    mode: Mode
    model: str
    language: str | None
    body_format: BodyFormat
    sample_rate: int  # for raw PCM without an x-sample-rate header
    extra_fields: dict[str, Any] = field(default_factory=dict)  # merged over the default body
    headers: dict[str, str] = field(default_factory=dict)

    def http_body(self, text: str, voice: str) -> dict[str, Any]:
        body = {
            "model": self.model,
            "input": text,
            "voice": voice,
            "response_format": "pcm",
            "stream": True,
        }
        return {**body, **self.extra_fields}

    def ws_session_config(self, voice: str) -> dict[str, Any]:
        config: dict[str, Any] = {"model": self.model, "voice": voice}
        if self.language is not None:
            config["language"] = self.language
        return {**config, **self.extra_fields}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def endpoint_url(url: str, mode: Mode) -> str:
    """A bare server URL gets the standard path for the mode (http -> ws scheme for WS); a URL
    that already has a path is used as given."""
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https", "ws", "wss"} or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s):// or ws(s):// URL with a host")
    scheme = parts.scheme
    if mode is Mode.ws:
        scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    elif scheme in {"ws", "wss"}:
        raise ValueError(f"{url!r}: HTTP mode needs an http(s):// URL")
    path = (
        parts.path if parts.path not in {"", "/"} else (WS_PATH if mode is Mode.ws else HTTP_PATH)
    )
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def metrics_endpoint(value: str, endpoint: str) -> str:
    """'auto': /metrics on the speech endpoint's host (ws -> http); else an http(s) URL."""
    if value != "auto":
        parts = urlsplit(value)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise ValueError(f"{value!r} is not an http(s):// URL with a host (or 'auto')")
        return value
    parts = urlsplit(endpoint)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "/metrics", "", ""))


@dataclass
class TargetConfigFile:
    """The optional --target-config JSON; CLI flags override it."""

    extra_fields: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body_format: BodyFormat | None = None
    sample_rate: int | None = None


def load_target_config(path: Path) -> TargetConfigFile:
    if not path.is_file():
        raise ValueError(f"target config {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    unknown = set(raw) - _TARGET_CONFIG_KEYS
    if unknown:
        raise ValueError(
            f"{path}: unknown keys {sorted(unknown)}; allowed {sorted(_TARGET_CONFIG_KEYS)}"
        )
    config = TargetConfigFile()
    if "extra_fields" in raw:
        config.extra_fields = _object(raw["extra_fields"], path, "extra_fields")
    if "headers" in raw:
        config.headers = {k: str(v) for k, v in _object(raw["headers"], path, "headers").items()}
    if "body_format" in raw:
        try:
            config.body_format = BodyFormat(raw["body_format"])
        except ValueError:
            raise ValueError(f"{path}: body_format must be one of pcm, wav, auto") from None
    if "sample_rate" in raw:
        rate = raw["sample_rate"]
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise ValueError(f"{path}: sample_rate must be a positive integer")
        config.sample_rate = rate
    return config


def _object(value: Any, path: Path, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {key} must be a JSON object")
    return value
