"""Requests are tokenized and checked as they arrive (`EngineCore.resolve`), so the engine
loop's admission only claims a slot; a request the engine refuses still gets its 400 through
the loop, unchanged."""

from __future__ import annotations

import httpx
import pytest

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.core import ResolvedRequest
from ttsbuild.runtime.engine import EagerEngine, Models, SynthesisRequest
from ttsbuild.runtime.request import RequestError

from .conftest import running_server

TEXT = "The birch canoe slid on the smooth planks."


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return EagerEngine(Models.load(load_checkpoint(tiny_ckpt), device="cpu"), num_slots=2,
                       max_len=256)  # fmt: skip


def test_resolve_then_admit_equals_admit(engine):
    req = SynthesisRequest(text=TEXT, voice="ryan", seed=3)
    resolved = engine.resolve(req)
    assert isinstance(resolved, ResolvedRequest) and resolved.request is req
    a = engine.admit(resolved)
    b = engine.admit(req)
    try:
        pa, pb = engine.table[a].plan, engine.table[b].plan
        assert (pa.frame_limit, pa.seed, pa.limit_reason) == (pb.frame_limit, pb.seed,
                                                              pb.limit_reason)  # fmt: skip
        assert pa.prompt.layout.rows.equal(pb.prompt.layout.rows)
        assert engine.table[a].request is req
    finally:
        engine.release(a)
        engine.release(b)
    with pytest.raises(RequestError, match="voice"):
        engine.resolve(SynthesisRequest(text=TEXT, voice=None))
    assert engine.free_slots() == 2


def test_served_requests_arrive_resolved_and_refusals_stay_400(engine):
    seen = []
    admit = engine.admit

    def spy(req):
        seen.append(type(req).__name__)
        return admit(req)

    engine.admit = spy
    try:
        with running_server(None, slots=2, engine=engine) as (url, service):
            seen.clear()  # the warm-up's requests
            body = {"input": TEXT, "voice": "ryan", "response_format": "pcm", "seed": 1,
                    "stream": False}  # fmt: skip
            r = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
            assert r.status_code == 200 and len(r.content) > 0
            assert seen == ["ResolvedRequest"]
            # too long for this engine's context (max_len 256): refused by the engine's plan
            long = dict(body, input=" ".join([TEXT] * 40))
            r = httpx.post(f"{url}/v1/audio/speech", json=long, timeout=60)
            assert r.status_code == 400, r.text
            assert seen[-1] == "SynthesisRequest"  # unresolved: the loop refused it
            assert service.loop.wait_idle()
            assert engine.free_slots() == 2
    finally:
        engine.admit = admit
