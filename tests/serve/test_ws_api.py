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
