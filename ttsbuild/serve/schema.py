"""Validation at the edge: HTTP bodies and WebSocket messages become SynthesisRequests here.

Known fields are strictly typed (a string where a number belongs is a 400 naming the field);
unknown fields are ignored so existing OpenAI clients and load tools work unchanged. Names of
voices and languages match case-insensitively. Errors use OpenAI's body:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ttsbuild.runtime.request import MAX_TEXT_CHARS, SamplingOverrides, SynthesisRequest
from ttsbuild.serve.config import MAX_CHUNK_FRAMES

M = TypeVar("M", bound=BaseModel)
RESPONSE_FORMATS = ("pcm", "wav")
_UNSUPPORTED_FORMATS = ("mp3", "opus", "aac", "flac")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type, code,
        )  # fmt: skip

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param,
                "code": self.code,
            }
        }  # fmt: skip


class SynthesisFields(BaseModel):
    """Fields shared by the HTTP body and the WebSocket session.config."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # accepted and ignored: one model per server
    voice: str | None = None
    language: str = "auto"
    instruct: str | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_frames: int | None = Field(default=None, ge=1)
    non_streaming_mode: bool | None = None
    chunk_schedule: list[int] | None = Field(default=None, min_length=1, max_length=16)
    temperature: float | None = Field(default=None, gt=0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    do_sample: bool | None = None
    subtalker_temperature: float | None = Field(default=None, gt=0)
    subtalker_top_k: int | None = Field(default=None, ge=0)
    subtalker_top_p: float | None = Field(default=None, gt=0, le=1)
    subtalker_do_sample: bool | None = None


class SpeechBody(SynthesisFields):
    input: str
    response_format: str = "wav"
    stream: bool = False
    speed: float = 1.0


class SessionConfig(SynthesisFields):
    type: Literal["session.config"]


def parse_json(raw: bytes | str, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ApiError(413, f"body is larger than {max_bytes} bytes", code="too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None


def check_text(text: str, param: str = "input") -> str:
    """Reject text the tokenizer cannot take or that is surely a client bug."""
    if not text.strip():
        raise ApiError(400, f"{param} is empty", param)
    if len(text) > MAX_TEXT_CHARS:
        raise ApiError(400, f"{param} is longer than {MAX_TEXT_CHARS} characters", param)
    for i, ch in enumerate(text):
        cat = unicodedata.category(ch)
        if cat == "Cs":
            raise ApiError(400, f"{param} has an unpaired surrogate at index {i}", param)
        if cat == "Cc" and ch not in "\t\n\r":
            raise ApiError(400, f"{param} has control character U+{ord(ch):04X} at {i}", param)
    return text


def speech_format(body: SpeechBody) -> str:
    fmt = body.response_format.lower()
    if fmt not in RESPONSE_FORMATS:
        hint = " (not built in: no encoder dependency)" if fmt in _UNSUPPORTED_FORMATS else ""
        raise ApiError(
            400, f"response_format {body.response_format!r} is not supported{hint}; "
            f"supported: {', '.join(RESPONSE_FORMATS)}", "response_format",
        )  # fmt: skip
    if body.speed != 1.0:
        raise ApiError(400, "speed must be 1.0: this model has no speed control", "speed")
    return fmt


def to_request(
    fields: SynthesisFields, text: str, voices: list[str], languages: list[str],
    needs_voice: bool, seed: int | None = None,
) -> SynthesisRequest:  # fmt: skip
    voice = None
    if fields.voice is not None:
        voice = fields.voice.strip().lower()
        if voice not in voices:
            raise ApiError(
                400, f"unknown voice {fields.voice!r}; known: {', '.join(voices)}", "voice"
            )
    elif needs_voice:
        raise ApiError(400, f"voice is required; known: {', '.join(voices)}", "voice")
    language = fields.language.strip().lower()
    if language not in languages:
        raise ApiError(
            400, f"unknown language {fields.language!r}; known: {', '.join(languages)}",
            "language",
        )  # fmt: skip
    if fields.chunk_schedule and not all(1 <= n <= MAX_CHUNK_FRAMES for n in fields.chunk_schedule):
        raise ApiError(400, f"chunk_schedule entries must be 1..{MAX_CHUNK_FRAMES}",
                       "chunk_schedule")  # fmt: skip
    if fields.instruct is not None:
        check_text(fields.instruct, "instruct")
    sampling = SamplingOverrides(
        **{k: getattr(fields, k) for k in SamplingOverrides.__dataclass_fields__}
    )
    return SynthesisRequest(
        text=check_text(text),
        voice=voice,
        language=language,
        instruct=fields.instruct,
        non_streaming=fields.non_streaming_mode,
        seed=fields.seed if seed is None else seed,
        max_frames=fields.max_frames,
        sampling=sampling,
    )
