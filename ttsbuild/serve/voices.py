"""Voice routes: list voices, register a cloned voice from a clip (Base checkpoints), delete it.

    GET    /v1/audio/voices          {"voices": [built-in entries..., registered entries...]}
    POST   /v1/audio/voices          multipart: file (the clip), name, transcript (optional;
                                     with it the voice clones in context), keep_clip (optional,
                                     default false: only the x-vector and codes are kept)
                                     -> 201 with the voice's entry
    DELETE /v1/audio/voices/{name}   -> 200 {"id": name, "deleted": true}

A registered voice is then named like a built-in one: `voice=<name>` on speech requests and
in a WebSocket session.config. On an engine with a prefix cache (runtime.prefix_cache) the
voice's prompt prefix is prefilled before the 201, so its first request costs what a built-in
voice's does. The body is read with a size cap before it is parsed, so a
huge upload costs at most that much memory; the clip is encoded off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from ttsbuild.runtime.request import SynthesisRequest
from ttsbuild.serve.schema import ApiError
from ttsbuild.voices.clip import MAX_CLIP_BYTES, ClipError, decode_clip
from ttsbuild.voices.encoder import check_transcript
from ttsbuild.voices.store import VoiceStoreError

MAX_FORM_BYTES = MAX_CLIP_BYTES + 64 * 1024  # the clip plus the other fields and boundaries
FORM_FIELDS = ("file", "name", "transcript", "keep_clip")
TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

log = logging.getLogger(__name__)
router = APIRouter()
# Clip encoding runs beside the engine thread: one at a time bounds its memory and CPU share.
_encoding = threading.Lock()


def registered_voice_entries(service) -> list[dict]:
    store = service.voice_store
    return [r.info() for r in store.records()] if store is not None else []


@router.post("/v1/audio/voices")
async def register_voice(request: Request):
    service = request.app.state.service
    store = _store_of(service)
    form = await _read_form(request)
    clip = form.get("file")
    if not isinstance(clip, UploadFile):
        raise ApiError(400, "send the reference clip as the multipart file field 'file'", "file")
    name = _text_field(form, "name")
    if name is None:
        raise ApiError(400, "a voice name is required (field 'name')", "name")
    keep = (_text_field(form, "keep_clip") or "").lower()
    if keep not in TRUE + FALSE:
        raise ApiError(400, "keep_clip must be true or false", "keep_clip")
    try:
        transcript = check_transcript(_text_field(form, "transcript"))
    except ValueError as exc:
        raise ApiError(400, str(exc), "transcript") from None
    try:
        with store.reserve(name, reserved_names=service.builtin_voices) as name:
            data = await clip.read()
            voice, facts = await asyncio.to_thread(_encode, service, data, transcript)
            record = await asyncio.to_thread(store.add, name, voice, facts,
                                             data if keep in TRUE else None)  # fmt: skip
    except ClipError as exc:
        raise ApiError(400, str(exc), "file", code="invalid_clip") from None
    except VoiceStoreError as exc:
        code = "voice_exists" if exc.status == 409 else None
        raise ApiError(exc.status, str(exc), "name", code=code) from None
    await _prefill_voice(service, record.name)
    return JSONResponse(record.info(), status_code=201)


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request):
    store = _store_of(request.app.state.service)
    try:
        record = store.remove(name)
    except VoiceStoreError as exc:
        raise ApiError(exc.status, str(exc), "name", code="voice_not_found") from None
    return {"id": record.name, "deleted": True}


async def _prefill_voice(service, name: str) -> None:
    """One frame in the new voice (default language and text mode), so the engine computes
    and keeps its prompt prefix now instead of at its first request. Best effort: refused
    (a busy server) or failed, the first request computes it."""
    if not getattr(service.engine, "caches_prefixes", False):
        return
    request = SynthesisRequest(text=service.config.warmup_text, voice=name, seed=0, max_frames=1)
    try:
        handle = await service.open(request)
    except ApiError as exc:
        log.info("voice %s: prefix not prefilled at registration (%s)", name, exc)
        return
    try:
        async for _ in handle.chunks():
            pass
    except ApiError as exc:
        log.warning("voice %s: prefilling its prefix failed (%s)", name, exc)
    finally:
        handle.close()


def _store_of(service):
    if service.voice_store is None:
        raise ApiError(400, "voice registration needs a Base (voice-clone) checkpoint; this "
                       f"server runs a {service.engine.models.cfg.tts_model_type} model")
    return service.voice_store


def _encode(service, data: bytes, transcript: str | None):
    clip = decode_clip(data)
    with _encoding:
        voice = service.engine.models.voice_encoder.encode(clip, transcript)
    facts = {"seconds": round(clip.seconds, 3), "source_sample_rate": clip.source_rate,
             "channels": clip.channels}
    return voice, facts


def _text_field(form, key: str) -> str | None:
    value = form.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"field '{key}' must be text", key)
    return value


async def _read_form(request: Request):
    """The multipart form, its body read with a cap first (413 beyond MAX_FORM_BYTES)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(415, "send multipart/form-data (fields: file, name, transcript)")
    too_large = ApiError(413, f"the upload is larger than {MAX_FORM_BYTES} bytes",
                         code="too_large")  # fmt: skip
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FORM_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_FORM_BYTES:
            raise too_large

    async def replay():
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=8)
    except Exception as exc:  # malformed multipart: starlette raises several kinds
        raise ApiError(400, f"malformed multipart body: {exc}") from None
    unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
    if unknown:
        raise ApiError(400, f"unknown form fields {unknown}; known: {', '.join(FORM_FIELDS)}")
    return form
