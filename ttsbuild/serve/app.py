"""FastAPI routes: OpenAI-compatible speech over HTTP, the WebSocket protocol, voices, health,
readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ttsbuild.runtime.request import RequestError
from ttsbuild.serve.formats import FORMATS, AudioPipeline, whole_wav
from ttsbuild.serve.schema import (
    ApiError,
    SpeechBody,
    audio_format,
    parse_json,
    to_request,
    validate,
)
from ttsbuild.serve.service import SpeechService, StreamHandle
from ttsbuild.serve.voices import registered_voice_entries
from ttsbuild.serve.voices import router as voices_router
from ttsbuild.serve.ws import WsSession

log = logging.getLogger(__name__)


class AudioStreamResponse(StreamingResponse):
    """A streamed body that closes its engine stream however the response ends: finished,
    client gone before the first byte, or mid-body. The body is the encoded audio itself, or
    with stream_format "sse" OpenAI's events: speech.audio.delta (base64 audio) per chunk, then
    speech.audio.done with the token usage."""

    def __init__(self, handle: StreamHandle, pipeline: AudioPipeline, headers: dict[str, str],
                 sse_input_tokens: int | None = None):  # fmt: skip
        self.handle = handle
        body = self._audio(pipeline)
        media_type = pipeline.format.media_type
        if sse_input_tokens is not None:
            body, media_type = self._sse(body, sse_input_tokens), "text/event-stream"
        super().__init__(body, media_type=media_type, headers=headers)

    async def _audio(self, pipeline: AudioPipeline) -> AsyncIterator[bytes]:
        try:
            async for data, _ in self.handle.encoded(pipeline):
                if data:
                    yield data
        except ApiError as exc:  # headers are out: all we can do is end the body early
            log.warning("stream %s failed mid-body: %s", self.handle.stream_id, exc.message)

    async def _sse(self, audio: AsyncIterator[bytes], input_tokens: int) -> AsyncIterator[bytes]:
        async for data in audio:
            yield _sse_event({"type": "speech.audio.delta",
                              "audio": base64.b64encode(data).decode()})  # fmt: skip
        if self.handle.stats is None:
            return  # failed mid-body (logged): no done event
        frames = self.handle.stats["frames"]
        usage = {"input_tokens": input_tokens, "output_tokens": frames,
                 "total_tokens": input_tokens + frames}  # fmt: skip
        yield _sse_event({"type": "speech.audio.done", "usage": usage})

    async def __call__(self, scope, receive, send) -> None:
        service = self.handle.service
        service.metrics.streams.inc()
        try:
            await super().__call__(scope, receive, send)
        finally:
            service.metrics.streams.dec()
            self.handle.close()


def _sse_event(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def create_app(service: SpeechService, warm_up: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        warm = asyncio.create_task(service.warm_up() if warm_up else _mark_ready(service))
        try:
            yield
        finally:
            warm.cancel()
            service.stop()

    app = FastAPI(title="ttsbuild", lifespan=lifespan)
    app.state.service = service
    metrics = service.metrics

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        entered = time.perf_counter()
        try:
            body = validate(SpeechBody, parse_json(await _read_body(request, service), 1 << 62))
            fmt, rate = audio_format(body, "mp3")
            sse = body.stream_format == "sse"
            if sse and not body.stream:
                raise ApiError(400, "stream_format 'sse' streams: drop stream: false", "stream")
            req = to_request(body, body.input, service.catalog)
            metrics.http_phases.labels("receive").observe(time.perf_counter() - entered)
            handle = await service.open(req, body.chunk_schedule)
        except RequestError as exc:
            metrics.requests.labels("http", "invalid").inc()
            raise ApiError(400, str(exc)) from None
        except ApiError as exc:
            metrics.requests.labels("http", "rejected" if exc.status in (429, 503) else
                                    "invalid").inc()  # fmt: skip
            raise
        metrics.requests.labels("http", "ok").inc()
        headers = {"x-sample-rate": str(rate), "x-seed": str(handle.seed)}
        if body.stream:
            tokens = len(service.engine.models.tokenizer.encode(body.input)) if sse else None
            return AudioStreamResponse(handle, AudioPipeline(fmt, rate, body.speed), headers,
                                       tokens)  # fmt: skip
        # The whole file: a WAV gets its sizes filled in, so it is encoded as PCM first.
        pipeline = AudioPipeline(FORMATS["pcm"] if fmt.name == "wav" else fmt, rate, body.speed)
        try:
            data = b"".join([data async for data, _ in handle.encoded(pipeline)])
        finally:
            handle.close()
        if fmt.name == "wav":
            data = whole_wav(data, rate)
        headers["x-frames"] = str(handle.stats["frames"])
        # Why generation ended (guards.StopReason). A streamed body's headers leave before
        # that is known (uvicorn sends no HTTP trailers): /metrics counts it for every request.
        headers["x-stop-reason"] = str(handle.stats.get("stopped_by"))
        return Response(data, media_type=fmt.media_type, headers=headers)

    @app.websocket("/v1/audio/speech/ws")
    async def speech_ws(ws: WebSocket):
        await ws.accept()
        metrics.streams.inc()
        try:
            outcome = await WsSession(service, ws).run()
        finally:
            metrics.streams.dec()
        metrics.requests.labels("ws", outcome).inc()

    app.include_router(voices_router)  # POST /v1/audio/voices, DELETE .../{name}

    @app.get("/v1/audio/voices")
    @app.get("/v1/voices")
    async def voices():
        cat = service._catalog  # the model's own voices; registered ones follow
        listed = [{"id": v, "name": v, "speaker": v, "type": "builtin"} for v in cat.voices]
        listed += [
            {"id": a, "name": a, "speaker": v, "type": "alias"} for a, v in cat.aliases.items()
        ]
        listed += registered_voice_entries(service)
        return {"voices": listed, "aliases": cat.aliases, "languages": cat.languages,
                "model": service.config.model_name,
                "instructions": cat.supports_instruct}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": service.config.model_name, "object": "model", "created": 0,
             "owned_by": "ttsbuild"},
        ]}  # fmt: skip

    @app.get("/health")
    async def health():
        if service.loop.error is not None or (service.ready and not service.loop.alive):
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return JSONResponse({"ready": service.ready}, status_code=200 if service.ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_body(request: Request, service: SpeechService) -> bytes:
    limit = service.config.max_body_bytes
    too_large = ApiError(413, f"body is larger than {limit} bytes", code="too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _mark_ready(service: SpeechService) -> None:
    service.ready = True
