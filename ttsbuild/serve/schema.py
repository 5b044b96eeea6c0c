"""Validation at the edge: HTTP bodies and WebSocket messages become SynthesisRequests here.

Known fields are strictly typed (a string where a number belongs is a 400 naming the field);
unknown fields are ignored so existing OpenAI clients and load tools work unchanged. Names of
voices and languages match case-insensitively; OpenAI voice names are aliases of the model's
speakers (Catalog). Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ttsbuild.runtime.request import MAX_TEXT_CHARS, SamplingOverrides, SynthesisRequest
from ttsbuild.serve.config import MAX_CHUNK_FRAMES
from ttsbuild.serve.formats import FORMATS, AudioFormat

M = TypeVar("M", bound=BaseModel)


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


class VoiceId(BaseModel):
    """OpenAI's custom-voice reference, {"id": "..."}: here the id names a speaker or alias."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str


@dataclass(frozen=True)
class Catalog:
    """What the loaded model offers, resolved once at startup: the edge checks against it."""

    voices: list[str]  # the model's speakers (empty: VoiceDesign, the instruction is the voice)
    aliases: dict[str, str]  # OpenAI voice name -> one of `voices`
    languages: list[str]
    needs_voice: bool  # CustomVoice: every request names a speaker
    supports_instruct: bool  # 1.7B CustomVoice and VoiceDesign follow an instruction


class SynthesisFields(BaseModel):
    """Fields shared by the HTTP body and the WebSocket session.config."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None  # accepted and ignored: one model per server
    voice: str | VoiceId | None = None
    language: str = "auto"
    instructions: str | None = None  # OpenAI's name for the instruct input
    instruct: str | None = None  # the same, by the model's name
    response_format: str | None = None
    sample_rate: int | None = None
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
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
    stream: bool = True  # False: the whole file, with its length
    stream_format: Literal["audio", "sse"] = "audio"


class SessionConfig(SynthesisFields):
    type: Literal["session.config"]


def parse_json(raw: bytes | str, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ApiError(413, f"body is larger than {max_bytes} bytes", code="too_large")
    try:
        body = json.loads(raw)
    except ValueError as exc:  # bad JSON or UTF-8, an integer of more than 4300 digits
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per nesting level
        raise ApiError(400, "body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None  # the body's field, as OpenAI's
        raise ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param) from None


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


def audio_format(fields: SynthesisFields, default: str) -> tuple[AudioFormat, int]:
    """The response's format and output sample rate."""
    name = (fields.response_format or default).lower()
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ApiError(400, f"response_format {fields.response_format!r} is not supported; "
                       f"supported: {', '.join(FORMATS)}", "response_format")  # fmt: skip
    rate = fmt.rates[0] if fields.sample_rate is None else fields.sample_rate
    if rate not in fmt.rates:
        rates = ", ".join(map(str, sorted(set(fmt.rates))))
        raise ApiError(400, f"sample_rate {rate} is not available for {name}; available: "
                       f"{rates}", "sample_rate")  # fmt: skip
    return fmt, rate


def _voice(fields: SynthesisFields, catalog: Catalog) -> str | None:
    raw = fields.voice.id if isinstance(fields.voice, VoiceId) else fields.voice
    if not catalog.voices:  # VoiceDesign: any voice name (clients must send one) is ignored
        return None
    if raw is None:
        if catalog.needs_voice:
            raise ApiError(400, f"voice is required; known: {', '.join(catalog.voices)}",
                           "voice")  # fmt: skip
        return None
    name = raw.strip().lower()
    name = catalog.aliases.get(name, name)
    if name not in catalog.voices:
        known = ", ".join([*catalog.voices, *catalog.aliases])
        raise ApiError(400, f"unknown voice {raw!r}; known: {known}", "voice")
    return name


def _instruct(fields: SynthesisFields, catalog: Catalog) -> str | None:
    if fields.instructions is not None and fields.instruct is not None:
        raise ApiError(400, "give instructions or instruct, not both", "instructions")
    param = "instructions" if fields.instructions is not None else "instruct"
    text = fields.instructions if fields.instructions is not None else fields.instruct
    if text is None or not text.strip():
        return None
    if not catalog.supports_instruct:
        raise ApiError(
            400, f"{param} is not supported by this model (only the 1.7B CustomVoice and "
            "VoiceDesign models follow instructions)", param,
        )  # fmt: skip
    return check_text(text, param)


def to_request(
    fields: SynthesisFields, text: str, catalog: Catalog, seed: int | None = None
) -> SynthesisRequest:
    voice = _voice(fields, catalog)
    language = fields.language.strip().lower()
    if language not in catalog.languages:
        raise ApiError(
            400, f"unknown language {fields.language!r}; known: {', '.join(catalog.languages)}",
            "language",
        )  # fmt: skip
    if fields.chunk_schedule and not all(1 <= n <= MAX_CHUNK_FRAMES for n in fields.chunk_schedule):
        raise ApiError(400, f"chunk_schedule entries must be 1..{MAX_CHUNK_FRAMES}",
                       "chunk_schedule")  # fmt: skip
    sampling = SamplingOverrides(
        **{k: getattr(fields, k) for k in SamplingOverrides.__dataclass_fields__}
    )
    return SynthesisRequest(
        text=check_text(text),
        voice=voice,
        language=language,
        instruct=_instruct(fields, catalog),
        non_streaming=fields.non_streaming_mode,
        seed=fields.seed if seed is None else seed,
        max_frames=fields.max_frames,
        sampling=sampling,
    )
