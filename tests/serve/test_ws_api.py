"""The WebSocket protocol: text in pieces, audio out in order; violations end the session
cleanly and the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from ttsbuild.serve.config import FRAME_SAMPLES

CONFIG = {"type": "session.config", "voice": "Ryan", "language": "english", "seed": 3,
          "max_frames": 5}  # fmt: skip


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/audio/speech/ws"


async def session(url, messages, delay_s=0.0):
    """Send `messages` (dicts as JSON, bytes/str raw), collect everything until close."""
    events, audio = [], bytearray()
    async with connect(ws_url(url), max_size=None) as ws:
        with contextlib.suppress(ConnectionClosed):  # the server may close before the last send
            for m in messages:
                await ws.send(m if isinstance(m, bytes | str) else json.dumps(m))
                if delay_s:
                    await asyncio.sleep(delay_s)
        with contextlib.suppress(ConnectionClosed):  # raised for close codes other than 1000
            async for msg in ws:
                if isinstance(msg, bytes):
                    audio += msg
                else:
                    events.append(json.loads(msg))
        code = ws.close_code
    return events, bytes(audio), code


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_text_in_pieces_gives_segments_of_audio_in_order(server):
    url, _ = server
    pieces = ["Hello ", "there, ", "how ", "are ", "you? ", "I am ", "fine."]
    messages = [CONFIG, *({"type": "input.append", "text": p} for p in pieces),
                {"type": "input.done"}]  # fmt: skip
    events, audio, code = run(session(url, messages))
    assert code == 1000
    assert events[0]["type"] == "started" and events[0]["sample_rate"] == 24000
    chunks = [e for e in events if e["type"] == "chunk"]
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    done = events[-1]
    # segments: "Hello there, how are you?" and "I am fine."
    assert done["type"] == "done" and done["segments"] == 2
    assert done["seeds"] == [3, 4]
    assert done["stop_reasons"] == ["max_frames", "max_frames"]
    assert done["frames"] == 10 and len(audio) == 10 * FRAME_SAMPLES * 2
    assert sum(c["samples"] for c in chunks) * 2 == len(audio)
    assert done["ttfa_ms"] is not None and done["audio_seconds"] == pytest.approx(0.8)


def test_stalled_input_is_flushed_before_input_done(server):
    url, _ = server

    async def stalled():
        async with connect(ws_url(url)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.append", "text": "no boundary here"}))
            first = None
            while first is None:  # audio arrives though the text never ended
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    first = msg
            await ws.send(json.dumps({"type": "input.done"}))
            events = [json.loads(m) async for m in ws if isinstance(m, str)]
            return events[-1]

    assert run(stalled())["type"] == "done"


def test_cancel_ends_the_session_and_frees_slots(server):
    url, service = server
    messages = [CONFIG | {"max_frames": 200},
                {"type": "input.append", "text": "A long sentence to speak. "}]  # fmt: skip

    async def cancel_midway():
        async with connect(ws_url(url)) as ws:
            for m in messages:
                await ws.send(json.dumps(m))
            while not isinstance(await ws.recv(), bytes):
                pass
            await ws.send(json.dumps({"type": "cancel"}))
            events = [json.loads(m) async for m in ws if isinstance(m, str)]
            return events[-1], ws.close_code

    last, code = run(cancel_midway())
    assert last["type"] == "done" and last["cancelled"] and code == 1000
    assert service.loop.wait_idle(10) and service.engine.free_slots() == 4


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([b"\x00binary"], "binary"),
        (["{not json"], "JSON"),
        (["[1]"], "object"),
        ([{"type": "input.append", "text": "before config"}], "session.config"),
        ([CONFIG, {"type": "bogus"}], "unknown message type"),
        ([CONFIG, {"type": "input.append", "text": 5}], "string"),
        ([CONFIG, CONFIG], "once"),
        ([CONFIG, "x" * 100_000], "larger"),
        ([CONFIG, '{"type": "input.append", "text": ' + "[" * 20_000 + "]" * 20_000 + "}"],
         "nested"),
        ([CONFIG, {"type": "input.append", "text": "hi", "context_id": 5}], "context_id"),
        ([CONFIG | {"voice": "nobody"}], "unknown voice"),
        ([CONFIG | {"seed": "three"}], "seed"),
        ([CONFIG, {"type": "input.append", "text": "bad \x00 char. "}], "control character"),
        ([CONFIG, {"type": "input.done"}, {"type": "input.append", "text": "late"}], None),
    ],
)
def test_protocol_violations_get_an_error_event_and_a_clean_close(server, messages, fragment):
    url, _ = server
    events, _audio, code = run(session(url, messages, delay_s=0.05))
    if fragment is None:  # input.done with no text: an empty, successful session
        assert events[-1]["type"] in {"done", "error"}
    else:
        assert events[-1]["type"] == "error", events
        assert fragment in events[-1]["message"]
        assert code in {1003, 1008, 1009}
    ok_events, audio, ok_code = run(
        session(url, [CONFIG, {"type": "input.append", "text": "Still here."},
                      {"type": "input.done"}])  # fmt: skip
    )
    assert ok_code == 1000 and ok_events[-1]["type"] == "done" and len(audio) > 0


def test_contexts_share_a_socket_and_every_message_names_its_context(server):
    url, _ = server

    async def two_contexts():
        events, audio = [], {}
        async with connect(ws_url(url), max_size=None) as ws:
            await ws.send(json.dumps(CONFIG | {"response_format": "pcm", "sample_rate": 16000}))
            for cid, text in (("a", "First reply. "), ("b", "Second reply.")):
                await ws.send(json.dumps({"type": "input.append", "text": text,
                                          "context_id": cid}))  # fmt: skip
                await ws.send(json.dumps({"type": "flush", "context_id": cid}))
                await ws.send(json.dumps({"type": "input.done", "context_id": cid}))
            header = None
            while len([e for e in events if e["type"] == "context.done"]) < 2:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    audio[header["context_id"]] = audio.get(header["context_id"], b"") + msg
                else:
                    events.append(json.loads(msg))
                    header = events[-1]
            await ws.send(json.dumps({"type": "close"}))
            events += [json.loads(m) async for m in ws]
            return events, audio, ws.close_code

    events, audio, code = run(two_contexts())
    assert code == 1000 and events[0]["sample_rate"] == 16000 and events[-1]["type"] == "done"
    for e in events[1:-1]:
        assert e["context_id"] in {"a", "b"}, e
    done = {e["context_id"]: e for e in events if e["type"] == "context.done"}
    for cid in "ab":
        assert done[cid]["frames"] == 5 and done[cid]["samples"] * 2 == len(audio[cid])
        assert done[cid]["samples"] == pytest.approx(5 * 0.08 * 16000, abs=2)
    assert events[-1]["contexts"] == 2 and events[-1]["frames"] == 10


async def start_long_speech(ws, **context_id) -> int:
    """Configure, append two sentences that speak for a while (two segments in flight: the
    session's whole budget), return the first audio's bytes."""
    await ws.send(json.dumps(CONFIG | {"max_frames": 200}))
    await ws.send(json.dumps({"type": "input.append", "text": "A long sentence to speak. "
                              "And a second one. ", **context_id}))  # fmt: skip
    while not isinstance(msg := await ws.recv(), bytes):
        pass
    return len(msg)


def test_clear_stops_a_context_at_once_and_counts_what_was_sent(server):
    url, service = server

    async def clear_midway():
        async with connect(ws_url(url), max_size=None) as ws:
            audio = await start_long_speech(ws, context_id="x")
            await ws.send(json.dumps({"type": "clear", "context_id": "x"}))
            while True:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    audio += len(msg)
                elif (event := json.loads(msg))["type"] == "cancelled":
                    break
            # the socket stays open and the cleared segments' budget is back: a new context speaks
            await ws.send(json.dumps({"type": "input.append", "context_id": "y",
                                      "text": "Next."}))  # fmt: skip
            await ws.send(json.dumps({"type": "input.done"}))
            rest = [json.loads(m) async for m in ws if isinstance(m, str)]
            return event, audio, rest, ws.close_code

    ack, audio, rest, code = run(clear_midway())
    assert ack["context_id"] == "x" and ack["samples"] > 0 and ack["samples"] * 2 == audio
    assert ack["frames"] == ack["samples"] // FRAME_SAMPLES and ack["chunks"] >= 1
    assert rest[-1]["type"] == "done" and code == 1000
    assert service.loop.wait_idle(10) and service.engine.free_slots() == 4


def test_cancel_reports_the_audio_really_sent(server):
    url, _ = server

    async def cancel_after_audio():
        async with connect(ws_url(url), max_size=None) as ws:
            audio = await start_long_speech(ws)
            await ws.send(json.dumps({"type": "cancel"}))
            async for m in ws:
                if isinstance(m, bytes):
                    audio += len(m)
                else:
                    last = json.loads(m)
            return last, audio

    last, audio = run(cancel_after_audio())
    assert last["cancelled"] and last["samples"] * 2 == audio > 0 and last["frames"] >= 1


def test_a_three_segment_session_on_an_idle_server_is_never_cut(tiny_ckpt):
    """Default admission (by measured capacity) on a shared 2-core CPU: the session is admitted
    once; its later segments are continuations and are not refused."""
    from ttsbuild.serve.config import ServeConfig

    from .conftest import running_server

    text = "One short sentence. Another short sentence. And a third one."
    with running_server(tiny_ckpt, ServeConfig(), slots=2) as (url, _):
        messages = [CONFIG | {"max_frames": 10}, {"type": "input.append", "text": text},
                    {"type": "input.done"}]  # fmt: skip
        events, audio, code = run(session(url, messages))
    assert code == 1000 and events[-1]["type"] == "done", [e.get("segment", e) for e in events]
    assert events[-1]["segments"] == 3 and len(audio) == events[-1]["samples"] * 2


def test_a_session_in_mulaw_for_telephony(server):
    url, _ = server
    messages = [CONFIG | {"response_format": "mulaw"},
                {"type": "input.append", "text": "Hello caller."},
                {"type": "input.done"}]  # fmt: skip
    events, audio, code = run(session(url, messages))
    assert code == 1000 and events[0]["sample_rate"] == 8000 and events[0]["format"] == "mulaw"
    from .test_formats import decode

    pcm, rate = decode(audio, "mulaw")
    assert rate == 8000 and len(pcm) == events[-1]["samples"] == pytest.approx(5 * 640, abs=2)
