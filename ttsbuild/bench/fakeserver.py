"""A scripted in-process speech server, for tests and `ttsbuild bench selftest`.

It speaks just enough HTTP/1.1 (keep-alive, chunked bodies) and our WebSocket protocol to
play back a `Reply` chosen per request by a script function: status, headers, and body chunks
each sent after a given delay, optionally dropping the connection mid-body. A hand-rolled HTTP
server gives exact control over chunk timing and disconnects, and costs little per request,
which matters when measuring the harness's own dispatch lag.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ttsbuild.bench.target import HTTP_PATH, WS_PATH

SAMPLE_RATE = 24_000


@dataclass
class Reply:
    status: int = 200
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (delay s, bytes) in order
    headers: dict[str, str] = field(default_factory=dict)
    disconnect: bool = False  # drop the connection after the chunks, before the body ends
    error_body: bytes = b'{"error": "scripted error"}'


# A script sees the parsed HTTP JSON body, or for WebSocket requests
# {"session": <session.config>, "input": <all appended text>}.
Script = Callable[[dict[str, Any]], Reply]


def silence(seconds: float, sample_rate: int = SAMPLE_RATE) -> bytes:
    return np.zeros(round(seconds * sample_rate), dtype="<i2").tobytes()


def tone(
    seconds: float, peak_dbfs: float = -20.0, hz: float = 440.0, sample_rate: int = SAMPLE_RATE
) -> bytes:
    """A sine whose peak is `peak_dbfs` (its RMS is 3 dB lower), as PCM16 bytes."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    amplitude = 32768.0 * 10 ** (peak_dbfs / 20)
    return np.round(amplitude * np.sin(2 * np.pi * hz * t)).astype("<i2").tobytes()


def wav_header(sample_rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """A 44-byte streaming WAV header: sizes set to 0xFFFFFFFF (length unknown), as streaming
    servers commonly send."""
    unknown = 0xFFFFFFFF
    byte_rate = sample_rate * channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, byte_rate, channels * 2, 16)
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", unknown)
    )  # fmt: skip


def instant_reply(_request: dict[str, Any]) -> Reply:
    """0.1 s of tone in one chunk, no delay: the cheapest possible server."""
    return Reply(chunks=[(0.0, _INSTANT_BODY)])


_INSTANT_BODY = tone(0.1)


class FakeSpeechServer:
    """Run with `with FakeSpeechServer(script) as server:`; then use server.http_url and
    server.ws_url. Serves on 127.0.0.1, ephemeral ports, in a background thread's own event
    loop. `requests` collects what the script was called with, in arrival order."""

    def __init__(self, script: Script = instant_reply) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []  # HTTP only, names lower-cased
        self.http_port = 0
        self.ws_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._startup_error: BaseException | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}"

    def __enter__(self) -> FakeSpeechServer:
        self._thread = threading.Thread(target=self._serve_forever, name="fake-tts", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=10) or self._startup_error is not None:
            raise RuntimeError(f"fake server did not start: {self._startup_error!r}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _serve_forever(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # surfaced to __enter__ rather than lost in the thread
            self._startup_error = err
            self._ready.set()

    async def _main(self) -> None:
        from websockets.asyncio.server import serve

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        http = await asyncio.start_server(self._handle_http, "127.0.0.1", 0, backlog=1024)
        self.http_port = http.sockets[0].getsockname()[1]
        async with serve(self._handle_ws, "127.0.0.1", 0, compression=None, max_size=None) as ws:
            self.ws_port = next(iter(ws.sockets)).getsockname()[1]
            self._ready.set()
            await self._stop.wait()
        http.close()
        await http.wait_closed()

    async def _handle_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while await self._serve_one_http(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: nothing to answer
        finally:
            writer.close()

    async def _serve_one_http(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection must close."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        _method, path, _version = head[0].split(" ", 2)
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if path == "/metrics":  # Prometheus text, like a real server's, for sweep scrapes
            _write_plain(writer, 200, f"fake_requests_total {len(self.requests)}\n".encode())
            return True
        if path != HTTP_PATH:
            _write_plain(writer, 404, b"not found")
            return True
        request = json.loads(body or b"{}")
        self.requests.append(request)
        self.request_headers.append(headers)
        reply = self.script(request)
        if reply.status != 200:
            _write_plain(writer, reply.status, reply.error_body)
            return True
        extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
        writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\n{extra}"
            "transfer-encoding: chunked\r\n\r\n".encode("latin-1")
        )
        for delay, data in reply.chunks:
            if delay > 0:
                await writer.drain()
                await asyncio.sleep(delay)
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        if reply.disconnect:
            await writer.drain()
            writer.transport.abort()  # no terminating chunk: the body is cut short
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def _handle_ws(self, ws: Any) -> None:
        if ws.request.path != WS_PATH:
            await ws.close(1008, "unknown path")
            return
        session: dict[str, Any] = {}
        parts: list[str] = []
        async for message in ws:
            event = json.loads(message)
            kind = event.get("type")
            if kind == "session.config":
                session = event
            elif kind == "input.append":
                parts.append(event.get("text", ""))
            elif kind == "input.done":
                break
            elif kind == "cancel":
                return
        request = {"session": session, "input": "".join(parts)}
        self.requests.append(request)
        reply = self.script(request)
        if reply.status != 200:
            await ws.send(json.dumps({"type": "error", "message": f"status {reply.status}"}))
            return
        await ws.send(json.dumps({"type": "started", "sample_rate": SAMPLE_RATE}))
        sent = 0
        for delay, data in reply.chunks:
            if delay > 0:
                await asyncio.sleep(delay)
            await ws.send(data)
            sent += len(data)
            await ws.send(json.dumps({"type": "chunk", "bytes": len(data)}))
        if reply.disconnect:
            return  # closing without "done" is a failed request for the client
        await ws.send(json.dumps({"type": "done", "audio_bytes": sent}))


def _write_plain(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 503: "Service Unavailable"}
    writer.write(
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode("latin-1")
        + body
    )


@contextmanager
def serve_in_subprocess(script: Script = instant_reply) -> Iterator[tuple[str, str]]:
    """Run a FakeSpeechServer in its own process and yield (http_url, ws_url). Used to measure
    the harness alone: an in-process server would share the client's GIL and its work would
    show up as client dispatch lag. `script` must be picklable (a module-level function)."""
    context = multiprocessing.get_context("spawn")  # no inherited event loop or threads
    ours, theirs = context.Pipe()
    process = context.Process(target=_subprocess_main, args=(script, theirs), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 30
        while not ours.poll(0.05):
            if not process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("fake server process did not start")
        yield ours.recv()
    finally:
        with suppress(OSError):  # the child may already be gone
            ours.send("stop")
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def _subprocess_main(script: Script, conn: Connection) -> None:
    with FakeSpeechServer(script) as server:
        conn.send((server.http_url, server.ws_url))
        conn.recv()
