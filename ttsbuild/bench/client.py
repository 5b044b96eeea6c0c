"""One request, HTTP or WebSocket, turned into a timed trace of what arrived when.

Nothing here analyses audio: the hot path only timestamps chunks (time.perf_counter) and keeps
their bytes, so the analysis cost never delays a timestamp or another request's dispatch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

REJECTED_STATUSES = frozenset({429, 503})  # the server shed load: counted apart from failures
_ERROR_BODY_CHARS = 200


class HttpClient(StrEnum):
    """The library the harness sends HTTP requests with. aiohttp by default: against a local
    scripted server it measured ~1-2 ms less of its own time per request than httpx at the
    median and p95 (2-core CPU, 20 and 40 req/s); httpx stays for side-by-side runs."""

    aiohttp = "aiohttp"
    httpx = "httpx"


class Outcome(StrEnum):
    ok = "ok"
    failed = "failed"  # transport error, disconnect mid-stream, non-2xx, protocol error
    rejected = "rejected"  # HTTP 429 or 503
    timeout = "timeout"  # no bytes for the stall timeout, or over the total request timeout


@dataclass
class Trace:
    """Raw record of one request. Times are time.perf_counter() seconds."""

    sent_at: float  # when the request was handed to the transport
    outcome: Outcome = Outcome.ok
    http_status: int | None = None
    headers_at: float | None = None  # HTTP: the response's status line and headers arrived
    error: str | None = None
    sample_rate_header: int | None = None  # from x-sample-rate (HTTP) or the started event (WS)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each body chunk
    chunk_end_bytes: list[int] = field(default_factory=list)  # body bytes received so far
    body: bytearray = field(default_factory=bytearray)
    finished_at: float | None = None  # last byte (or the done event) received
    text_done_at: float | None = None  # WS: when input.done was sent (the last word)
    server_stats: dict[str, Any] | None = None  # WS: the done event, as sent

    def add_chunk(self, arrived: float, data: bytes) -> None:
        self.body += data
        self.chunk_times.append(arrived)
        self.chunk_end_bytes.append(len(self.body))

    def fail(self, outcome: Outcome, error: str) -> None:
        self.outcome, self.error = outcome, error


@dataclass(frozen=True)
class Timeouts:
    stall_s: float  # longest wait for the next bytes (also connect and pool waits)
    total_s: float  # whole request, from dispatch to the last byte


async def http_speech(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeouts: Timeouts,
) -> Trace:
    """POST a streaming speech request and record each body chunk's arrival."""
    import httpx

    trace = Trace(sent_at=time.perf_counter())
    try:
        async with asyncio.timeout(timeouts.total_s):
            async with client.stream("POST", url, json=body, headers=headers) as response:
                await _record(trace, response.status_code, response.headers,
                              response.aiter_raw(), response.aread)  # fmt: skip
    except (TimeoutError, httpx.TimeoutException) as err:
        trace.fail(Outcome.timeout, _describe(err) or "request timed out")
    except httpx.HTTPError as err:
        trace.fail(Outcome.failed, _describe(err))
    return trace


async def http_speech_aiohttp(
    session: Any,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeouts: Timeouts,
) -> Trace:
    """http_speech through an aiohttp.ClientSession (`open_session`): the same trace."""
    import aiohttp

    trace = Trace(sent_at=time.perf_counter())
    try:
        async with asyncio.timeout(timeouts.total_s):
            async with session.post(url, json=body, headers=headers) as response:
                await _record(trace, response.status, response.headers,
                              response.content.iter_any(),
                              lambda: response.content.read(_ERROR_BODY_CHARS))  # fmt: skip
    except TimeoutError as err:  # the total timeout, or no bytes for the stall timeout
        trace.fail(Outcome.timeout, _describe(err) if str(err) else "request timed out")
    except aiohttp.ClientError as err:
        trace.fail(Outcome.failed, _describe(err))
    return trace


async def _record(
    trace: Trace,
    status: int,
    headers: Any,
    body: AsyncIterator[bytes],
    read_error: Callable[[], Awaitable[bytes]],
) -> None:
    """A response into the trace, whichever client made it: the headers' arrival, the status
    (a non-2xx one with the start of its body), then each body chunk as it arrives."""
    trace.headers_at = time.perf_counter()
    trace.http_status = status
    if not 200 <= status < 300:
        outcome = Outcome.rejected if status in REJECTED_STATUSES else Outcome.failed
        detail = (await read_error())[:_ERROR_BODY_CHARS].decode("utf-8", "replace")
        trace.fail(outcome, f"HTTP {status}: {detail}".strip())
        return
    trace.sample_rate_header = _int_or_none(headers.get("x-sample-rate"))
    async for data in body:
        trace.add_chunk(time.perf_counter(), data)
    trace.finished_at = time.perf_counter()


def open_session(max_connections: int, timeouts: Timeouts) -> Any:
    """An aiohttp session as the harness uses it: a pool of max_connections, the body as sent
    (no decompression), the stall timeout on connecting and between reads. Call inside the
    event loop; close it when done."""
    try:
        import aiohttp
    except ImportError:
        raise RuntimeError("the harness's default HTTP client needs aiohttp (pip install "
                           "aiohttp), or run with --http-client httpx") from None  # fmt: skip

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.stall_s,
                                      sock_read=timeouts.stall_s),  # fmt: skip
        auto_decompress=False,
    )


async def ws_speech(
    url: str,
    session_config: dict[str, Any],
    words: list[str],
    word_interval_s: float,
    headers: dict[str, str],
    timeouts: Timeouts,
) -> Trace:
    """Stream text word by word over the WebSocket protocol and record audio frame arrivals.

    Protocol: send session.config, one input.append per word at a fixed cadence (scheduled by
    absolute time, so a slow send never shifts the later words), then input.done. The server
    answers with binary PCM16 frames and JSON events; "done" ends the request, "error" fails it.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    trace = Trace(sent_at=time.perf_counter())
    try:
        async with asyncio.timeout(timeouts.total_s):
            async with connect(
                url,
                additional_headers=headers,
                open_timeout=timeouts.stall_s,
                max_size=None,
                compression=None,
            ) as ws:
                await ws.send(json.dumps({"type": "session.config", **session_config}))
                sender = asyncio.create_task(_send_words(ws, words, word_interval_s, trace))
                try:
                    await _receive_audio(ws, trace, timeouts.stall_s)
                finally:
                    sender.cancel()
    except TimeoutError:
        trace.fail(Outcome.timeout, "request timed out")
    except (WebSocketException, OSError) as err:
        trace.fail(Outcome.failed, _describe(err))
    return trace


async def _send_words(ws: Any, words: list[str], interval_s: float, trace: Trace) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, word in enumerate(words):
        delay = start + i * interval_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await ws.send(json.dumps({"type": "input.append", "text": word}))
    await ws.send(json.dumps({"type": "input.done"}))
    trace.text_done_at = time.perf_counter()


async def _receive_audio(ws: Any, trace: Trace, stall_s: float) -> None:
    while True:
        try:
            message = await asyncio.wait_for(ws.recv(), stall_s)
        except TimeoutError:
            trace.fail(Outcome.timeout, f"no message for {stall_s:g} s")
            return
        arrived = time.perf_counter()
        if isinstance(message, bytes):
            trace.add_chunk(arrived, message)
            continue
        event = _json_object(message)
        kind = event.get("type")
        if kind == "started":
            trace.sample_rate_header = _int_or_none(event.get("sample_rate"))
        elif kind == "done":
            trace.finished_at = arrived
            trace.server_stats = event
            return
        elif kind == "error":
            trace.fail(Outcome.failed, f"server error: {event.get('message', event)}")
            return


def split_words(text: str) -> list[str]:
    """'a b c' -> ['a ', 'b ', 'c ']: each word keeps a trailing space, so the server can
    concatenate appends without guessing where words end."""
    return [word + " " for word in text.split()]


def _json_object(message: str) -> dict[str, Any]:
    try:
        event = json.loads(message)
    except json.JSONDecodeError:
        return {}
    return event if isinstance(event, dict) else {}


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _describe(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
