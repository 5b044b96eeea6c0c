"""The WebSocket protocol: text streams in, audio streams out.

client -> server (JSON text messages)
  {"type": "session.config", "voice", "language", "instruct", "seed", sampling..., ...}  first
  {"type": "input.append", "text": "..."}   any number, as an upstream LLM produces text
  {"type": "input.done"}                     no more text
  {"type": "cancel"}                         stop now: every engine slot is freed at once
server -> client
  {"type": "started", "sample_rate": 24000, "format": "pcm_s16le", "channels": 1}
  {"type": "chunk", "seq", "samples", "segment"} followed by that chunk as a binary PCM16 message
  {"type": "done", "frames", "audio_seconds", "ttfa_ms", "segments", "seeds", "stop_reasons",
   ...}                                                                              then close
  {"type": "error", "message"}                                                      then close

Synthesis starts before the text is complete: the Segmenter cuts appended text at sentence or
clause boundaries (or after N words, or when input stalls for ws_flush_after_s); each segment
is one engine request, submitted as soon as it is cut (at most two in flight, so the next
segment's first audio is ready when the current one ends), and their audio is sent in order.
Segment k uses seed + k when a seed is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import WebSocket

from ttsbuild.runtime.request import RequestError
from ttsbuild.serve.config import SAMPLE_RATE
from ttsbuild.serve.schema import ApiError, SessionConfig, to_request, validate
from ttsbuild.serve.segmenter import Segmenter
from ttsbuild.serve.service import SpeechService, StreamHandle

MAX_IN_FLIGHT = 2


class ProtocolError(Exception):
    def __init__(self, message: str, close_code: int = 1008):
        super().__init__(message)
        self.message, self.close_code = message, close_code


class _Cancel(Exception):
    pass


class _Disconnected(Exception):
    pass


class WsSession:
    def __init__(self, service: SpeechService, ws: WebSocket):
        self.service = service
        self.ws = ws
        self.config = service.config
        self.fields: SessionConfig | None = None
        self.segmenter = Segmenter()
        self.texts: asyncio.Queue[str | None] = asyncio.Queue()
        self.handles: asyncio.Queue[StreamHandle | None] = asyncio.Queue()
        self.open_handles: set[StreamHandle] = set()
        self.in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.text_chars = 0
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.segment_stats: list[dict] = []

    async def run(self) -> str:
        """Serve one session; returns its outcome (for metrics)."""
        tasks: list[asyncio.Task] = []
        try:
            await self._configure()
            await self.ws.send_json(
                {"type": "started", "sample_rate": SAMPLE_RATE, "format": "pcm_s16le",
                 "channels": 1}
            )  # fmt: skip
            tasks = [asyncio.create_task(c) for c in (self._read(), self._submit(), self._speak())]
            speaker = tasks[2]
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                if speaker in done:
                    break
            await self.ws.send_json({"type": "done", **self._stats()})
            await self._close(1000)
            return "ok"
        except _Cancel:
            await self._send_quietly({"type": "done", "cancelled": True, **self._stats()})
            await self._close(1000)
            return "cancelled"
        except ProtocolError as exc:
            await self._send_quietly({"type": "error", "message": exc.message})
            await self._close(exc.close_code)
            return "invalid"
        except ApiError as exc:
            await self._send_quietly({"type": "error", "message": exc.message,
                                      "status": exc.status, "param": exc.param})  # fmt: skip
            await self._close(1013 if exc.status in (429, 503) else 1008)
            return "rejected" if exc.status in (429, 503) else "invalid"
        except _Disconnected:
            return "disconnected"
        except Exception as exc:  # a send to a socket the client just closed, mostly
            if self.ws.client_state.name == "CONNECTED":
                await self._send_quietly({"type": "error", "message": "internal error"})
                await self._close(1011)
            return f"failed:{type(exc).__name__}"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for handle in self.open_handles:
                handle.close()
            self.open_handles.clear()

    # -- the three tasks ---------------------------------------------------------------------
    async def _read(self) -> None:
        input_done = False
        while True:
            stalled = bool(self.segmenter.buffer.strip()) and not input_done
            try:
                msg = await asyncio.wait_for(
                    self._receive(), self.config.ws_flush_after_s if stalled else None
                )
            except TimeoutError:
                await self._put(self.segmenter.flush())
                continue
            kind = msg.get("type")
            if kind == "input.append":
                if input_done:
                    raise ProtocolError("input.append after input.done")
                text = msg.get("text")
                if not isinstance(text, str):
                    raise ProtocolError("input.append needs a string field 'text'")
                self.text_chars += len(text)
                if self.text_chars > self.config.ws_max_text_chars:
                    raise ProtocolError(
                        f"session text exceeds {self.config.ws_max_text_chars} characters", 1009
                    )
                if self.first_text_at is None:
                    self.first_text_at = time.perf_counter()
                for segment in self.segmenter.append(text):
                    await self._put(segment)
            elif kind == "input.done":
                if input_done:
                    raise ProtocolError("input.done sent twice")
                input_done = True
                await self._put(self.segmenter.flush())
                await self.texts.put(None)
            elif kind == "cancel":
                raise _Cancel
            elif kind == "session.config":
                raise ProtocolError("session.config may only be sent once, first")
            else:
                raise ProtocolError(
                    f"unknown message type {kind!r}; expected input.append, input.done or cancel"
                )

    async def _submit(self) -> None:
        fields, svc = self.fields, self.service
        index = 0
        while (text := await self.texts.get()) is not None:
            await self.in_flight.acquire()
            seed = None if fields.seed is None else (fields.seed + index) % 2**63
            try:
                req = to_request(fields, text, svc.voices, svc.languages, svc.needs_voice, seed)
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
            handle = svc.submit(req, fields.chunk_schedule)
            self.open_handles.add(handle)
            await self.handles.put(handle)
            index += 1
        await self.handles.put(None)

    async def _speak(self) -> None:
        seq = 0
        while (handle := await self.handles.get()) is not None:
            segment = len(self.segment_stats)
            try:
                await handle.admitted()
                async for pcm in handle.chunks():
                    if self.first_audio_at is None:
                        self.first_audio_at = time.perf_counter()
                    await self.ws.send_json(
                        {"type": "chunk", "seq": seq, "samples": len(pcm) // 2,
                         "segment": segment}
                    )  # fmt: skip
                    await self.ws.send_bytes(pcm)
                    seq += 1
                self.segment_stats.append(handle.stats)
            finally:
                handle.close()
                self.open_handles.discard(handle)
                self.in_flight.release()

    # -- helpers -----------------------------------------------------------------------------
    async def _configure(self) -> None:
        msg = await self._receive()
        if msg.get("type") != "session.config":
            got = msg.get("type")
            raise ProtocolError(f"the first message must be session.config, got {got!r}")
        fields = validate(SessionConfig, msg)
        svc = self.service
        try:  # check voice, language and overrides now rather than at the first segment
            to_request(fields, ".", svc.voices, svc.languages, svc.needs_voice)
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        self.fields = fields

    async def _receive(self) -> dict:
        msg = await self.ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise _Disconnected
        if msg.get("bytes") is not None:
            raise ProtocolError("binary messages are not accepted: send JSON text", 1003)
        text = msg.get("text") or ""
        if len(text) > self.config.max_body_bytes:
            raise ProtocolError(f"message larger than {self.config.max_body_bytes} bytes", 1009)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"message is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ProtocolError("message must be a JSON object with a 'type'")
        return data

    async def _put(self, segment: str | None) -> None:
        if segment is not None:
            await self.texts.put(segment)

    def _stats(self) -> dict:
        segs = self.segment_stats
        frames = sum(s["frames"] for s in segs)
        samples = sum(s["samples"] for s in segs)
        ttfa = None
        if self.first_audio_at is not None and self.first_text_at is not None:
            ttfa = 1000 * (self.first_audio_at - self.first_text_at)
        return {
            "frames": frames,
            "samples": samples,
            "audio_seconds": samples / SAMPLE_RATE,
            "ttfa_ms": ttfa,  # first input.append -> first audio sent
            "segments": len(segs),
            "seeds": [s["seed"] for s in segs],
            "stop_reasons": [s.get("stopped_by") for s in segs],  # per segment (guards)
        }

    async def _send_quietly(self, event: dict) -> None:
        with contextlib.suppress(Exception):
            await self.ws.send_json(event)

    async def _close(self, code: int) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close(code)
