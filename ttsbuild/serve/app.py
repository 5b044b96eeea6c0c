"""FastAPI routes: OpenAI-compatible speech over HTTP, the WebSocket protocol, voices, health,
readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ttsbuild.runtime.request import RequestError
from ttsbuild.serve.audio import wav_header
from ttsbuild.serve.config import SAMPLE_RATE
from ttsbuild.serve.schema import (
    ApiError,
    SpeechBody,
    parse_json,
    speech_format,
    to_request,
    validate,
)
from ttsbuild.serve.service import SpeechService, StreamHandle
from ttsbuild.serve.ws import WsSession

log = logging.getLogger(__name__)
MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav"}


class AudioStreamResponse(StreamingResponse):
    """A streamed body that closes its engine stream however the response ends: finished,
    client gone before the first byte, or mid-body."""

    def __init__(self, handle: StreamHandle, fmt: str, headers: dict[str, str]):
        self.handle = handle
        super().__init__(self._body(fmt), media_type=MEDIA_TYPES[fmt], headers=headers)

    async def _body(self, fmt: str):
        if fmt == "wav":
            yield wav_header(None)
        try:
            async for pcm in self.handle.chunks():
                yield pcm
        except ApiError as exc:  # headers are out: all we can do is end the body early
            log.warning("stream %s failed mid-body: %s", self.handle.stream_id, exc.message)

    async def __call__(self, scope, receive, send) -> None:
        service = self.handle.service
        service.metrics.streams.inc()
        try:
            await super().__call__(scope, receive, send)
        finally:
            service.metrics.streams.dec()
            self.handle.close()


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
        try:
            body = validate(SpeechBody, parse_json(await _read_body(request, service), 1 << 62))
            fmt = speech_format(body)
            req = to_request(body, body.input, service.voices, service.languages,
                             service.needs_voice)  # fmt: skip
            handle = await service.open(req, body.chunk_schedule)
        except RequestError as exc:
            metrics.requests.labels("http", "invalid").inc()
            raise ApiError(400, str(exc)) from None
        except ApiError as exc:
            metrics.requests.labels("http", "rejected" if exc.status in (429, 503) else
                                    "invalid").inc()  # fmt: skip
            raise
        metrics.requests.labels("http", "ok").inc()
        headers = {"x-sample-rate": str(SAMPLE_RATE), "x-seed": str(handle.seed)}
        if body.stream:
            return AudioStreamResponse(handle, fmt, headers)
        try:
            pcm = b"".join([chunk async for chunk in handle.chunks()])
        finally:
            handle.close()
        headers["x-frames"] = str(handle.stats["frames"])
        # Why generation ended (guards.StopReason). A streamed body's headers leave before
        # that is known (uvicorn sends no HTTP trailers): /metrics counts it for every request.
        headers["x-stop-reason"] = str(handle.stats.get("stopped_by"))
        data = wav_header(len(pcm)) + pcm if fmt == "wav" else pcm
        return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)

    @app.websocket("/v1/audio/speech/ws")
    async def speech_ws(ws: WebSocket):
        await ws.accept()
        metrics.streams.inc()
        try:
            outcome = await WsSession(service, ws).run()
        finally:
            metrics.streams.dec()
        metrics.requests.labels("ws", outcome).inc()

    @app.get("/v1/voices")
    async def voices():
        return {"voices": service.voices, "languages": service.languages,
                "model": service.config.model_name}  # fmt: skip

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
