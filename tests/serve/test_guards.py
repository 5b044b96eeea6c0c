"""Stop reasons reach clients and operators: a served model that loops is stopped by the
repetition guard on every API, the reason is in the response / final event and in
/metrics, and every slot is free afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from misbehaving import cycling, wrap_codebook0_logits

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.generation.guards import GuardConfig
from ttsbuild.runtime.engine import EagerEngine, Models
from ttsbuild.serve.config import FRAME_SAMPLES

from .conftest import running_server
from .test_ws_api import run, session

GUARDS = GuardConfig(repetition_window=8, repetition_max_period=4)
# One code over and over: any interleaving of streams over the shared hook still loops.
LOOP = [5]
TEXT = "The birch canoe slid on the smooth planks."


@pytest.fixture(scope="module")
def looping_server(tiny_ckpt):
    models = Models.load(load_checkpoint(tiny_ckpt), device="cpu")
    models.length_rule = None  # a real checkpoint: EOS and the guards decide
    wrap_codebook0_logits(models, cycling(LOOP))
    engine = EagerEngine(models, num_slots=2, max_len=512, guards=GUARDS)
    with running_server(None, slots=2, engine=engine) as (url, service):
        yield url, service


def stop_count(url: str, reason: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'tts_stop_reasons_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no tts_stop_reasons_total series for {reason}")


def test_stop_reasons_in_responses_events_and_metrics(looping_server):
    url, service = looping_server
    before = stop_count(url, "repetition")
    body = {"input": TEXT, "voice": "ryan", "response_format": "pcm", "seed": 1, "stream": False}
    r = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["x-stop-reason"] == "repetition"
    # window + period codes in, the looping frame dropped (and the bootstrap frame's audio,
    # where the service drops it).
    frames = GUARDS.repetition_window + len(LOOP) - 1
    assert r.headers["x-frames"] == str(frames)
    assert len(r.content) == (frames - service.drop_bootstrap) * FRAME_SAMPLES * 2

    messages = [{"type": "session.config", "voice": "ryan", "seed": 2},
                {"type": "input.append", "text": "One sentence here. And another one."},
                {"type": "input.done"}]  # fmt: skip
    events, _, code = run(session(url, messages))
    done = events[-1]
    assert code == 1000 and done["type"] == "done"
    assert done["stop_reasons"] == ["repetition", "repetition"]
    assert stop_count(url, "repetition") == before + 3
    assert service.loop.wait_idle() and service.engine.free_slots() == 2


def test_a_cancelled_session_counts_as_cancel(looping_server):
    url, service = looping_server
    before = stop_count(url, "cancel")

    async def cancel_after_first_chunk():
        from websockets.asyncio.client import connect

        async with connect(url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "ryan"}))
            await ws.send(json.dumps({"type": "input.append", "text": TEXT}))
            async for msg in ws:
                if isinstance(msg, bytes):
                    await ws.send(json.dumps({"type": "cancel"}))
                    break
            return [json.loads(m) async for m in ws if isinstance(m, str)]

    events = run(cancel_after_first_chunk())
    assert events[-1]["type"] == "done" and events[-1]["cancelled"]
    assert service.loop.wait_idle() and service.engine.free_slots() == 2
    assert stop_count(url, "cancel") == before + 1


def test_serve_guard_flags():
    from ttsbuild.serve.cli import parse_guards

    assert parse_guards("text_budget,repetition,silence", 2.5, 3.0) == GuardConfig()
    off = parse_guards("none", 2.5, 3.0)
    assert not (off.text_budget or off.repetition or off.silence)
    some = parse_guards(" silence ,text_budget", 3.0, 5.0)
    assert (some.text_budget, some.repetition, some.silence) == (True, False, True)
    assert (some.budget_margin, some.silence_s) == (3.0, 5.0)
    with pytest.raises(ValueError, match="unknown guard"):
        parse_guards("text_budget,loops", 2.5, 3.0)
    with pytest.raises(ValueError, match="budget_margin"):
        parse_guards("none", 0.5, 3.0)
