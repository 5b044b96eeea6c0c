"""benchmarks/serve/host_sim.py: the server's host path on a CPU over a simulated engine. What
its measurements depend on is checked here: the served app runs on it end to end, requests
get the frame counts the stand-in's length rule gives them (realistic utterance lengths),
the audio is audible from its first sample (the bench's onset), a step's audio arrives no
sooner than the GPU costs it models, and the engine calls spend their host time."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from helpers_scripts import script_fixture

from ttsbuild.runtime.request import SynthesisRequest
from ttsbuild.serve.config import FRAME_SAMPLES, ServeConfig

sim = script_fixture("benchmarks/serve/host_sim.py")

TEXT = "Sure, I can help with that. Your order ships tomorrow morning."


def test_a_request_streams_its_length_rules_frames_as_audible_audio_after_the_gpu_floor(sim):
    from ttsbuild.serve.service import SpeechService

    engine = sim.SimEngine(4, dict(sim.GIL_OPS))
    frames = engine.resolve(SynthesisRequest(text=TEXT, voice="ryan")).plan.frame_limit
    assert 40 < frames < 120  # ~4-5 s of speech at a real speaking rate, not the cap
    service = SpeechService(engine, ServeConfig())
    assert service.loop.express  # the admission lane and express admission, as served

    async def run():
        service.start()
        try:
            start = time.perf_counter()
            handle = await service.open(SynthesisRequest(text=TEXT, voice="ryan", seed=1))
            chunks, first_at = [], None
            async for pcm in handle.chunks():
                first_at = first_at or time.perf_counter()
                chunks.append(np.asarray(pcm))
            return chunks, first_at - start
        finally:
            service.loop.stop()

    chunks, ttfa = asyncio.run(run())
    audio = np.concatenate(chunks)
    assert len(audio) == frames * FRAME_SAMPLES
    assert np.abs(chunks[0][:FRAME_SAMPLES]).max() > 0.1  # audible from the first chunk
    floor = (sim.PREFILL_MS + sim.FRAME_MS + sim.FRAME_ROW_MS + sim.CODEC_MS
             + sim.CODEC_ROW_MS) * 1e-3  # fmt: skip
    assert ttfa >= floor


def test_host_work_takes_its_time_and_crosses_the_gil(sim, monkeypatch):
    host = sim._Host({"prefill": 3, "read": 0})
    calls = []
    real_copy = host.a.copy_
    monkeypatch.setattr(host, "a", type("T", (), {"copy_": lambda self, b: calls.append(1)
                                                   or real_copy(b)})())  # fmt: skip
    start = time.perf_counter()
    host("prefill")
    assert time.perf_counter() - start >= sim.HOST_MS["prefill"] * 1e-3
    assert len(calls) == 3
