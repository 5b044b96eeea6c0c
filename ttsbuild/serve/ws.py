"""The WebSocket protocol: text streams in, audio streams out, in one or more contexts.

A context is one utterance (an agent's reply) with its own text, segments and audio; several can
share a socket, each named by a client-chosen `context_id` (messages without one address the
context "default", which is all that clients of the first protocol version use).

client -> server (JSON text messages)
  {"type": "session.config", "voice", "language", "instructions", "response_format",
   "sample_rate", "speed", "seed", sampling...}          first, once; defaults for every context
  {"type": "input.append", "text", "context_id"?}        text as an upstream LLM produces it
  {"type": "flush", "context_id"?}                       synthesize what is buffered now
  {"type": "input.done", "context_id"}                   no more text for this context
  {"type": "clear", "context_id"?}  /  {"type": "cancel", "context_id"}
                                 stop that context's audio at once (every context without an id)
  {"type": "close"}  or  {"type": "input.done"} without context_id
                                 no more text anywhere: finish every context, then close
  {"type": "cancel"} without context_id      stop everything and close (first-version cancel)
server -> client (every audio message and event names its context_id)
  {"type": "started", "sample_rate", "format", "channels": 1}
  {"type": "chunk", "context_id", "seq", "samples", "segment"} then that chunk as one binary
      message (s16le for pcm; the encoded stream's next bytes for other formats)
  {"type": "context.done", "context_id", "frames", "samples", "audio_seconds", "segments",
   "seeds", "ttfa_ms"}                                  a context's audio is all sent
  {"type": "cancelled", "context_id", "frames", "samples", "chunks", "audio_seconds"}
      the acknowledgement of clear/cancel: what was really sent before it stopped
  {"type": "done", ...the session's totals, "stop_reasons"}  then close 1000 (stop_reasons:
      why each segment's generation ended: eos, text_budget, repetition, silence, ...)
  {"type": "error", "message", ...}                    then close (1008/1003/1009; 1013 busy)

Synthesis starts before a context's text is complete: its Segmenter cuts appended text at
sentence or clause boundaries (or after N words, or when input stalls for ws_flush_after_s);
each segment is one engine request, submitted as soon as it is cut (at most two in flight per
session, so the next segment's first audio is ready when the current one ends), and a context's
audio is sent in order. Segment k of a context uses seed + k when a seed is given.

Admission: the session's first segment is admitted like any request; every later segment (of
any context) is a continuation the scheduler never refuses, so a session that was let in is
not cut between sentences.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import WebSocket

from ttsbuild.runtime.request import RequestError
from ttsbuild.serve.config import FRAME_SAMPLES
from ttsbuild.serve.formats import AudioPipeline
from ttsbuild.serve.schema import ApiError, SessionConfig, audio_format, to_request, validate
from ttsbuild.serve.segmenter import Segmenter
from ttsbuild.serve.service import SpeechService, StreamHandle

MAX_IN_FLIGHT = 2  # engine requests per session: its budget of slots
DEFAULT_CONTEXT = "default"
_MESSAGES = "input.append, flush, input.done, clear, cancel or close"


class ProtocolError(Exception):
    def __init__(self, message: str, close_code: int = 1008):
        super().__init__(message)
        self.message, self.close_code = message, close_code


class _Cancel(Exception):
    pass


class _Disconnected(Exception):
    pass


class _Context:
    """One utterance: its text, its segments in flight, what of its audio was really sent."""

    def __init__(self, context_id: str, pipeline: AudioPipeline):
        self.id = context_id
        self.pipeline = pipeline
        self.segmenter = Segmenter()
        self.texts: asyncio.Queue[str | None] = asyncio.Queue()
        self.handles: asyncio.Queue[StreamHandle | None] = asyncio.Queue()
        self.permits = 0  # of the session's in-flight budget, held by this context
        self.open_handles: set[StreamHandle] = set()
        self.tasks: list[asyncio.Task] = []
        self.input_done = False
        self.finished = False  # all its audio sent, or cleared
        self.segments = 0  # finished
        self.seeds: list[int] = []
        self.stop_reasons: list[str | None] = []  # why each segment's generation ended
        self.chunks = 0
        self.samples = 0  # sent, at the output rate
        self.engine_samples = 0  # sent, at the engine's rate before speed and resampling
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None

    def stats(self) -> dict:
        ttfa = None
        if self.first_audio_at is not None and self.first_text_at is not None:
            ttfa = 1000 * (self.first_audio_at - self.first_text_at)
        return {
            "frames": round(self.engine_samples / FRAME_SAMPLES),
            "samples": self.samples,
            "audio_seconds": self.samples / self.pipeline.rate,
            "chunks": self.chunks,
            "segments": self.segments,
            "seeds": self.seeds,
            "stop_reasons": self.stop_reasons,
            "ttfa_ms": ttfa,  # first input.append -> first audio sent
        }

    def close_handles(self) -> None:
        for handle in self.open_handles:
            handle.close()
        self.open_handles.clear()


class WsSession:
    def __init__(self, service: SpeechService, ws: WebSocket):
        self.service = service
        self.ws = ws
        self.config = service.config
        self.fields: SessionConfig | None = None
        self.contexts: dict[str, _Context] = {}  # live
        self.history: list[_Context] = []  # every context, for the session's totals
        self.text_chars = 0
        self.seq = 0
        # Segments in flight, all contexts together: a session holds at most this many slots,
        # so its continuations (never refused) stay within what it was admitted for.
        self.in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.send_lock = asyncio.Lock()  # a chunk event and its binary message stay adjacent
        self.admitted = asyncio.Event()  # the session's first segment holds a slot
        self.first: StreamHandle | None = None  # that segment (before it is admitted)
        self.closing = False
        self.finished = asyncio.Event()  # closing and every context finished
        self.failure: asyncio.Future | None = None

    async def run(self) -> str:
        """Serve one session; returns its outcome (for metrics)."""
        reader = None
        self.failure = asyncio.get_running_loop().create_future()
        try:
            await self._configure()
            reader = asyncio.create_task(self._read())
            finished = asyncio.create_task(self.finished.wait())
            try:
                await asyncio.wait({reader, self.failure, finished},
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                finished.cancel()
            if self.failure.done():
                raise self.failure.result()
            if reader.done():
                reader.result()  # raises what ended it
            await self._send({"type": "done", **self._totals()})
            await self._close(1000)
            return "ok"
        except _Cancel:
            async with self.send_lock:
                await self._cancel_tasks(list(self.contexts.values()))
            await self._send_quietly({"type": "done", "cancelled": True, **self._totals()})
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
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await self._cancel_tasks(list(self.contexts.values()))

    # -- reading -----------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            stalled = any(c.segmenter.buffer.strip() and not c.input_done
                          for c in self.contexts.values())  # fmt: skip
            try:
                msg = await asyncio.wait_for(
                    self._receive(), self.config.ws_flush_after_s if stalled else None
                )
            except TimeoutError:
                for ctx in self.contexts.values():
                    if not ctx.input_done:
                        await self._put(ctx, ctx.segmenter.flush())
                continue
            await self._dispatch(msg)

    async def _dispatch(self, msg: dict) -> None:
        kind = msg.get("type")
        cid = msg.get("context_id")
        if cid is not None and (not isinstance(cid, str) or not cid or len(cid) > 256):
            raise ProtocolError("context_id must be a non-empty string of at most 256 characters")
        if kind == "input.append":
            text = msg.get("text")
            if not isinstance(text, str):
                raise ProtocolError("input.append needs a string field 'text'")
            await self._append(self._context(cid or DEFAULT_CONTEXT, create=True), text)
        elif kind == "flush":
            ctx = self._context(cid or DEFAULT_CONTEXT)
            if ctx is not None and not ctx.input_done:
                await self._put(ctx, ctx.segmenter.flush())
        elif kind == "input.done" and cid is not None:
            ctx = self._context(cid, create=True)
            if ctx.input_done:
                raise ProtocolError(f"input.done sent twice for context {cid!r}")
            await self._end_input(ctx)
        elif kind in ("close", "input.done"):
            if self.closing:
                raise ProtocolError(f"{kind} after the session was closed for input")
            self.closing = True
            for ctx in list(self.contexts.values()):
                if not ctx.input_done:
                    await self._end_input(ctx)
            self._check_finished()
        elif kind == "cancel" and cid is None:
            raise _Cancel
        elif kind in ("cancel", "clear"):
            targets = [self.contexts[cid]] if cid in self.contexts else []
            if cid is None:
                targets = list(self.contexts.values())
            for ctx in targets:
                await self._clear(ctx)
            if not targets:  # nothing live by that name: acknowledge that nothing was stopped
                await self._send({"type": "cancelled", "context_id": cid, "frames": 0,
                                  "samples": 0, "chunks": 0, "audio_seconds": 0.0})  # fmt: skip
        elif kind == "session.config":
            raise ProtocolError("session.config may only be sent once, first")
        else:
            raise ProtocolError(f"unknown message type {kind!r}; expected {_MESSAGES}")

    async def _append(self, ctx: _Context, text: str) -> None:
        if ctx.input_done or self.closing:
            raise ProtocolError(f"input.append after input.done (context {ctx.id!r})")
        self.text_chars += len(text)
        if self.text_chars > self.config.ws_max_text_chars:
            raise ProtocolError(
                f"session text exceeds {self.config.ws_max_text_chars} characters", 1009
            )
        if ctx.first_text_at is None:
            ctx.first_text_at = time.perf_counter()
        for segment in ctx.segmenter.append(text):
            await self._put(ctx, segment)

    async def _end_input(self, ctx: _Context) -> None:
        ctx.input_done = True
        await self._put(ctx, ctx.segmenter.flush())
        await ctx.texts.put(None)

    def _context(self, cid: str, create: bool = False) -> _Context | None:
        ctx = self.contexts.get(cid)
        if ctx is None and create:
            if self.closing:
                raise ProtocolError(f"context {cid!r} opened after the session was closed")
            fmt, rate = audio_format(self.fields, "pcm")
            ctx = _Context(cid, AudioPipeline(fmt, rate, self.fields.speed))
            self.contexts[cid] = ctx
            self.history.append(ctx)
            ctx.tasks = [asyncio.create_task(self._guard(c)) for c in
                         (self._submit(ctx), self._speak(ctx))]  # fmt: skip
        return ctx

    # -- per context -------------------------------------------------------------------------
    async def _guard(self, coro) -> None:
        """Run a context task; its failure ends the session (run() re-raises it)."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self.failure.done():
                self.failure.set_result(exc)

    async def _submit(self, ctx: _Context) -> None:
        fields, svc = self.fields, self.service
        index = 0
        previous = None  # this context's last segment: the next one plays after its audio
        while (text := await ctx.texts.get()) is not None:
            await self.in_flight.acquire()
            ctx.permits += 1
            # One request at a time until the session is in: the rest are continuations.
            while not self.admitted.is_set() and self.first and not self.first.closed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.admitted.wait(), 0.05)
            continuation = self.admitted.is_set()
            seed = None if fields.seed is None else (fields.seed + index) % 2**63
            try:
                req = to_request(fields, text, svc.catalog, seed)
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
            handle = svc.submit(
                req, fields.chunk_schedule, follows=previous, continuation=continuation
            )
            previous = handle
            if not continuation:
                self.first = handle
            ctx.open_handles.add(handle)
            await ctx.handles.put(handle)
            index += 1
        await ctx.handles.put(None)

    async def _speak(self, ctx: _Context) -> None:
        while (handle := await ctx.handles.get()) is not None:
            try:
                await handle.admitted()
                self.admitted.set()
                ctx.seeds.append(handle.seed)
                async for data, engine_samples in handle.encoded(ctx.pipeline, finish=False):
                    await self._send_audio(ctx, data, engine_samples)
                ctx.segments += 1
                ctx.stop_reasons.append((handle.stats or {}).get("stopped_by"))
            finally:
                handle.close()
                ctx.open_handles.discard(handle)
                self._release(ctx)
        tail = await self.service.encoder(ctx.pipeline)(ctx.pipeline.finish)
        await self._send_audio(ctx, tail, 0)
        await self._send({"type": "context.done", "context_id": ctx.id, **ctx.stats()})
        self._retire(ctx)

    async def _send_audio(self, ctx: _Context, data: bytes, engine_samples: int) -> None:
        samples = ctx.pipeline.samples_out - ctx.samples
        if not data and not samples:
            return
        async with self.send_lock:  # counted under the lock: clear() reads exact counts
            await self.ws.send_json({"type": "chunk", "context_id": ctx.id, "seq": self.seq,
                                     "samples": samples, "segment": ctx.segments})  # fmt: skip
            await self.ws.send_bytes(data)
            self.seq += 1
            if ctx.first_audio_at is None:
                ctx.first_audio_at = time.perf_counter()
            ctx.chunks += 1
            ctx.samples += samples
            ctx.engine_samples += engine_samples

    async def _clear(self, ctx: _Context) -> None:
        """Stop a context's audio now; acknowledge with what was really sent before."""
        async with self.send_lock:  # no chunk is half sent while we stop its sender
            await self._cancel_tasks([ctx])
            self._retire(ctx)
            stats = ctx.stats()
            await self.ws.send_json({"type": "cancelled", "context_id": ctx.id,
                                     **{k: stats[k] for k in ("frames", "samples", "chunks",
                                                              "audio_seconds")}})  # fmt: skip

    def _retire(self, ctx: _Context) -> None:
        ctx.finished = True
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
        self._check_finished()

    def _check_finished(self) -> None:
        if self.closing and not self.contexts:
            self.finished.set()

    def _release(self, ctx: _Context) -> None:
        ctx.permits -= 1
        self.in_flight.release()

    async def _cancel_tasks(self, contexts: list[_Context]) -> None:
        tasks = [t for ctx in contexts for t in ctx.tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ctx in contexts:
            ctx.close_handles()
            while ctx.permits:  # segments submitted but never spoken: their budget returns
                self._release(ctx)

    # -- helpers -----------------------------------------------------------------------------
    async def _configure(self) -> None:
        msg = await self._receive()
        if msg.get("type") != "session.config":
            got = msg.get("type")
            raise ProtocolError(f"the first message must be session.config, got {got!r}")
        fields = validate(SessionConfig, msg)
        svc = self.service
        fmt, rate = audio_format(fields, "pcm")
        try:  # check voice, language and overrides now rather than at the first segment
            to_request(fields, ".", svc.catalog)
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        self.fields = fields
        await self._send({"type": "started", "sample_rate": rate, "channels": 1,
                          "format": "pcm_s16le" if fmt.name == "pcm" else fmt.name})  # fmt: skip

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
        except ValueError as exc:
            raise ProtocolError(f"message is not valid JSON: {exc}") from None
        except RecursionError:
            raise ProtocolError("message is nested too deeply") from None
        if not isinstance(data, dict):
            raise ProtocolError("message must be a JSON object with a 'type'")
        return data

    async def _put(self, ctx: _Context, segment: str | None) -> None:
        if segment is not None:
            await ctx.texts.put(segment)

    def _totals(self) -> dict:
        stats = [c.stats() for c in self.history]
        samples = sum(s["samples"] for s in stats)
        ttfas = [c.first_audio_at - c.first_text_at for c in self.history
                 if c.first_audio_at is not None and c.first_text_at is not None]  # fmt: skip
        return {
            "frames": sum(s["frames"] for s in stats),
            "samples": samples,
            "audio_seconds": sum(s["audio_seconds"] for s in stats),
            "chunks": sum(s["chunks"] for s in stats),
            "ttfa_ms": 1000 * ttfas[0] if ttfas else None,  # the first context's
            "segments": sum(s["segments"] for s in stats),
            "seeds": [seed for s in stats for seed in s["seeds"]],
            "contexts": len(stats),
            "stop_reasons": [r for s in stats for r in s["stop_reasons"]],  # per segment
        }

    async def _send(self, event: dict) -> None:
        async with self.send_lock:
            await self.ws.send_json(event)

    async def _send_quietly(self, event: dict) -> None:
        with contextlib.suppress(Exception):
            await self.ws.send_json(event)

    async def _close(self, code: int) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close(code)
