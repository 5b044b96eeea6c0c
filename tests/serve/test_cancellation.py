"""Cancelled and disconnected requests leave no slot, scheduler entry, buffer or task behind."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from ttsbuild.runtime.request import SynthesisRequest
from ttsbuild.serve.config import SchedulerConfig, ServeConfig
from ttsbuild.serve.scheduler import Chunk
from ttsbuild.serve.service import SpeechService

from .conftest import running_server
from .fakes import FakeClock, FakeEngine


def assert_nothing_left(service: SpeechService) -> None:
    assert service.loop.wait_idle(10)
    s = service.scheduler
    assert not (s.streams or s.queue or s.by_slot or s.to_release), vars(s)
    assert s.unsent_samples() == 0


def test_a_thousand_cancellations_through_the_service_leave_nothing_behind():
    engine = FakeEngine(FakeClock(), num_slots=8, cost_s={"prefill": 0, "frames": 0, "audio": 0})
    # 100 requests at a time queue for 8 slots: admission by capacity, or by the expected
    # wait for a slot, would refuse most of them, and this test is about cancellation in
    # every state. The overload wait too: a stall of the loop thread longer than
    # standing_queue_s (a 1.2 s generation-2 collection of the whole suite's objects, on a
    # 2-core CI machine) made the queue "stand" and refused requests waiting over 20 ms.
    # And the unsent-audio limit: the engine costs nothing, so while a collection stalls the
    # event loop the loop thread generates whole streams (4 s each) that no consumer reads;
    # a 0.8 s pause in CI left over 120 s unsent and refused request 872 (503).
    config = ServeConfig(
        scheduler=SchedulerConfig(
            num_slots=8, max_queue=2000, queue_timeout_s=60, overload_wait_s=60,
            admit_by_capacity=False, refuse_long_waits=False, max_buffered_s=1e6,
        )
    )
    service = SpeechService(engine, config)
    rng = random.Random(0)

    async def one(i: int) -> None:
        req = SynthesisRequest(text=f"request {i}", voice="ryan", seed=i, max_frames=50)
        handle = service.submit(req)
        try:
            when = rng.choice(["queued", "admitted", "first-chunk", "mid-stream"])
            if when == "queued":
                return
            await handle.admitted()
            if when == "admitted":
                return
            seen = 0
            async for _ in handle.chunks():
                seen += 1
                if when == "first-chunk" or seen == 3:
                    return
        finally:
            handle.close()

    async def main() -> None:
        baseline = asyncio.all_tasks()
        service.start()
        try:
            for wave in range(10):
                await asyncio.gather(*(one(wave * 100 + i) for i in range(100)))
            await asyncio.sleep(0.05)  # let the last call_soon_threadsafe callbacks land
            assert service.loop.wait_idle(10)
            assert asyncio.all_tasks() - {service.lag_probe} == baseline  # the service's own probe
        finally:
            service.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert_nothing_left(service)
    assert engine.free_slots() == 8 and not engine.slots and service.loop.error is None


def test_a_request_no_slot_would_take_in_time_is_refused_at_once_and_nothing_leaks():
    """One slot, held by a stream nobody reads (paused by backpressure), no slot freed within
    the release window: the next request is answered 429 `no_slot` at once, as the API
    error users get; once the held stream is closed its slot frees and the next is served."""
    from ttsbuild.serve.schema import ApiError

    engine = FakeEngine(FakeClock(), num_slots=1, cost_s={"prefill": 0, "frames": 0, "audio": 0})
    config = ServeConfig(scheduler=SchedulerConfig(num_slots=1, admit_by_capacity=False,
                                                   stream_buffer_s=1.0, release_window_s=0.5))
    service = SpeechService(engine, config)

    async def main() -> None:
        service.start()
        try:
            await asyncio.sleep(0.6)  # the warm-up's slot releases leave the window
            held = service.submit(SynthesisRequest(text="held", voice="ryan", seed=1,
                                                   max_frames=10_000))  # fmt: skip
            await held.admitted()
            with pytest.raises(ApiError) as err:
                service.submit(SynthesisRequest(text="next", voice="ryan", seed=2, max_frames=5))
            assert err.value.status == 429 and err.value.code == "no_slot"
            assert err.value.type == "rate_limit_error"
            assert "all 1 engine slots held" in err.value.message
            assert "no slot freed in the last 0.5 s" in err.value.message
            held.close()  # its slot is freed by the next turn: a request now queues for it
            after = service.submit(SynthesisRequest(text="after", voice="ryan", seed=3,
                                                    max_frames=5))  # fmt: skip
            try:
                chunks = [c async for c in after.chunks()]
            finally:
                after.close()
            assert chunks
            assert service.loop.wait_idle(10)
        finally:
            service.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert_nothing_left(service)
    assert service.metrics.rejections.labels("no_slot")._value.get() == 1


def test_http_clients_that_disconnect_free_their_slots(tiny_ckpt):
    # Queued requests wait for the slots the disconnects free: a generous queue timeout, and
    # the same wait once a queue stands (the profile's overload wait, 0.25 s, turned that
    # wait into a 429 on a loaded 2-core machine, 2026-12-04), keep a slow machine from
    # refusing; admission is tested in test_scheduler.
    config = ServeConfig(
        scheduler=SchedulerConfig(num_slots=4, queue_timeout_s=120.0, overload_wait_s=120.0,
                                  admit_by_capacity=False, refuse_long_waits=False)
    )
    with running_server(tiny_ckpt, config) as (url, service):
        _disconnect_and_check(url, service)


def _disconnect_and_check(url: str, service: SpeechService) -> None:
    body = {"input": "A sentence long enough to still be speaking.", "voice": "ryan",
            "response_format": "pcm", "stream": True, "max_frames": 200}  # fmt: skip

    async def tasks_on_server() -> int:
        return len(asyncio.all_tasks())

    def server_tasks() -> int:
        future = asyncio.run_coroutine_threadsafe(tasks_on_server(), service.event_loop)
        return future.result(5)

    baseline = server_tasks()

    async def disconnect_after(chunks: int) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for _ in r.aiter_raw():
                    seen += 1
                    if seen >= chunks:
                        break

    async def main() -> None:
        await asyncio.gather(*(disconnect_after(1 + i % 3) for i in range(12)))

    asyncio.run(asyncio.wait_for(main(), 90))
    assert_nothing_left(service)
    assert service.engine.free_slots() == 4
    for _ in range(100):  # connection tasks wind down once uvicorn notices the closed sockets
        if server_tasks() <= baseline:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert server_tasks() <= baseline
    r = httpx.post(url + "/v1/audio/speech", json=body | {"stream": False, "max_frames": 3})
    assert r.status_code == 200 and len(r.content) == 3 * 1920 * 2


def test_the_engine_thread_hands_raw_samples_over_and_codecs_run_on_encoder_threads():
    import threading

    import numpy as np

    from ttsbuild.serve.formats import FORMATS, AudioPipeline

    engine = FakeEngine(FakeClock(), num_slots=1)
    service = SpeechService(engine)
    threads = set()

    class Recording(AudioPipeline):
        def push(self, pcm):
            threads.add(threading.current_thread().name)
            return super().push(pcm)

    async def main():
        service.start()
        try:
            req = SynthesisRequest(text="x", voice="ryan", max_frames=3)
            handle = await service.open(req)
            event = await handle.queue.get()  # straight from the engine thread's sink
            assert isinstance(event, Chunk) and len(event.pcm) == 1920
            assert not isinstance(event.pcm, bytes | np.ndarray)  # the engine's own list
            handle.close()
            handle = await service.open(req)
            data = [d async for d, _ in handle.encoded(Recording(FORMATS["mp3"]))]
            handle.close()
            return b"".join(data)
        finally:
            service.stop()

    assert len(asyncio.run(main())) > 0
    assert threads and all(name.startswith("encode") for name in threads), threads


def test_an_engine_crash_fails_open_streams_instead_of_hanging_them():
    import pytest

    from ttsbuild.serve.schema import ApiError

    engine = FakeEngine(FakeClock(), num_slots=2)

    def broken(slots):
        raise RuntimeError("device lost")

    engine.launch_frames = broken
    service = SpeechService(engine)

    async def main():
        service.start()
        try:
            # admission, prefill and the first frame step share one turn: the crash reaches
            # the request before or after its admission event, as a 500 either way
            with pytest.raises(ApiError) as err:
                handle = await service.open(SynthesisRequest(text="x", voice="ryan", max_frames=2))
                try:
                    async for _ in handle.chunks():
                        pass
                finally:
                    handle.close()
            assert err.value.status == 500
            with pytest.raises(ApiError) as err:
                service.submit(SynthesisRequest(text="x", voice="ryan"))
            assert err.value.status == 503
        finally:
            service.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert isinstance(service.loop.error, RuntimeError)
