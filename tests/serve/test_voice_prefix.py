"""Registered voices on an engine with a prefix cache (the graph backend, eagerly on CPU): the
prefix is prefilled at registration, requests reuse it, and deleting a voice mid-request
changes nothing of that request's audio."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.runtime.engine import Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.serve.config import FRAME_SAMPLES

from .conftest import NO_CAPACITY_ADMISSION, running_server
from .test_voice_registration import SPEECH, TRANSCRIPT, VOICES, register, speak


@pytest.fixture(scope="module")
def graph_server(tiny_base_checkpoint, tmp_path_factory):
    models = Models.load(load_checkpoint(tiny_base_checkpoint), device="cpu")
    plan = EnginePlan.default(num_slots=2, max_len=512, prefix_pool=4)
    engine = GraphEngine(models, plan, use_graphs=False)
    config = replace(NO_CAPACITY_ADMISSION, voices_dir=str(tmp_path_factory.mktemp("voices")))
    with running_server(None, config, engine=engine) as (url, service):
        yield url, engine.backend.prefix


def test_registration_prefills_the_voices_prefix(graph_server):
    url, pool = graph_server
    misses, hits = pool.misses, pool.hits
    assert register(url, "teller", transcript=TRANSCRIPT).status_code == 201
    assert (pool.misses, pool.hits) == (misses + 1, hits)  # computed at registration
    r = speak(url, "teller")
    assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2
    assert (pool.misses, pool.hits) == (misses + 1, hits + 1)  # and reused


def test_deleting_a_voice_mid_request_changes_nothing(graph_server):
    url, _ = graph_server
    assert register(url, "fleeting").status_code == 201
    body = {"input": "A longer line, so that the voice goes while it speaks.", "voice": "fleeting",
            "seed": 8, "max_frames": 24, "response_format": "pcm"}  # fmt: skip
    whole = httpx.post(url + SPEECH, json=body, timeout=120).content
    assert len(whole) == 24 * FRAME_SAMPLES * 2
    got, before_delete = b"", None
    with httpx.stream("POST", url + SPEECH, json=body, timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            got += chunk
            if before_delete is None:
                before_delete = len(got)
                assert httpx.delete(url + VOICES + "/fleeting").status_code == 200
    assert 0 < before_delete < len(whole)
    assert got == whole
    assert speak(url, "fleeting").status_code == 400
