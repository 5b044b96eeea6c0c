"""Real clients of the OpenAI speech API, unmodified, against `ttsbuild serve` on the tiny
stand-in: the OpenAI Python SDK, Pipecat's OpenAITTSService and the LiveKit Agents OpenAI TTS
plugin, each with its default voice and format. Each must get audio as it is generated (the
first audio well before the last) and audio that decodes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from .test_formats import decode

TEXT = "Hi there."  # 13 frames (1.04 s) of stand-in audio: a few seconds on a CPU


# Pipecat pushes audio in frames of 0.5 s (its chunk_size), LiveKit in 200 ms frames after an
# mp3 decoder: a streamed reply needs a few of them.
LONGER_TEXT = "Hello there, how are you doing today?"


def assert_streamed(start: float, arrivals: list[float]) -> None:
    assert len(arrivals) >= 3, arrivals
    first, last = arrivals[0] - start, arrivals[-1] - start
    assert first < 0.5 * last, (first, last)  # the first audio came well before the last


@pytest.mark.parametrize("fmt", [None, "opus", "aac", "flac", "wav", "pcm"])
def test_openai_sdk_streams_every_format(server, fmt):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed")
    kwargs = {} if fmt is None else {"response_format": fmt}
    start, arrivals, parts = time.perf_counter(), [], []
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TEXT, **kwargs
    ) as response:
        for part in response.iter_bytes():
            arrivals.append(time.perf_counter())
            parts.append(part)
    assert_streamed(start, arrivals)
    pcm, rate = decode(b"".join(parts), fmt or "mp3")
    assert 0.5 < len(pcm) / rate < 5 and np.abs(pcm).max() > 0


def test_pipecat_openai_tts_service(server):
    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSStartedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.tts import OpenAITTSService

    url, _ = server
    arrivals, audio, started = [], bytearray(), []

    class Collect(FrameProcessor):
        async def process_frame(self, frame, direction: FrameDirection):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSStartedFrame):  # the service starts its request
                started.append(time.perf_counter())
            if isinstance(frame, TTSAudioRawFrame):
                arrivals.append(time.perf_counter())
                audio.extend(frame.audio)
                assert frame.sample_rate == 24000 and frame.num_channels == 1
            await self.push_frame(frame, direction)

    async def main() -> None:
        tts = OpenAITTSService(api_key="not-needed", base_url=url + "/v1")
        task = PipelineTask(Pipeline([tts, Collect()]),
                            params=PipelineParams(audio_out_sample_rate=24000))  # fmt: skip
        await task.queue_frames([TTSSpeakFrame(LONGER_TEXT), EndFrame()])
        await PipelineRunner(handle_sigint=False).run(task)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert_streamed(started[0], arrivals)
    pcm = np.frombuffer(bytes(audio), "<i2")
    assert 0.5 < len(pcm) / 24000 < 5 and np.abs(pcm).max() > 0


def test_livekit_agents_openai_tts_plugin(server):
    from livekit.plugins import openai as livekit_openai

    url, _ = server
    arrivals, frames = [], []

    async def main() -> float:
        tts = livekit_openai.TTS(base_url=url + "/v1", api_key="not-needed")
        start = time.perf_counter()
        async with tts.synthesize(LONGER_TEXT) as stream:
            async for event in stream:
                arrivals.append(time.perf_counter())
                frames.append(event.frame)
        await tts.aclose()
        return start

    start = asyncio.run(asyncio.wait_for(main(), 60))
    assert_streamed(start, arrivals)
    assert {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
    pcm = np.concatenate([np.frombuffer(bytes(f.data), "<i2") for f in frames])
    assert 0.5 < len(pcm) / 24000 < 5 and np.abs(pcm).max() > 0
