"""The composition root: engine + scheduler + engine thread + metrics + encoder threads, and the
async handle through which a request handler receives its stream's events and audio."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from ttsbuild.generation.prompt import VoiceClone
from ttsbuild.runtime.request import RequestError, SynthesisRequest
from ttsbuild.serve.audio import SilenceTrimmer
from ttsbuild.serve.config import DEFAULT_VOICE_ALIASES, FRAME_SAMPLES, ServeConfig
from ttsbuild.serve.formats import AudioPipeline
from ttsbuild.serve.loop import Engine, EngineLoop, Runner
from ttsbuild.serve.metrics import ServeMetrics
from ttsbuild.serve.scheduler import Admitted, Chunk, Done, Event, Failed, Rejected, Scheduler
from ttsbuild.serve.schema import ApiError, Catalog
from ttsbuild.voices.store import VoiceStore

log = logging.getLogger(__name__)


class StreamHandle:
    """One engine request seen from asyncio: events arrive on `queue` from the engine thread."""

    def __init__(self, service: SpeechService, loop: asyncio.AbstractEventLoop):
        self.service = service
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.stream_id: int | None = None
        self.seed: int | None = None
        self.stats: dict | None = None
        self.closed = False
        self.first_chunk_at: float | None = None  # when the engine thread handed it over

    def sink(self, event: Event) -> None:
        """Called on the engine thread: only hand over (encoding is the consumer's work)."""
        if self.first_chunk_at is None and isinstance(event, Chunk):
            self.first_chunk_at = time.perf_counter()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def admitted(self) -> None:
        event = await self.queue.get()
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message, code=event.reason,
                           type=_error_type(event.status))  # fmt: skip
        assert isinstance(event, Admitted), event
        self.seed = event.seed

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        """float32 24 kHz chunks until the stream ends; each one acked once the caller resumes
        us (it has been sent)."""
        phases = self.service.metrics.http_phases
        while True:
            event = await self.queue.get()
            if isinstance(event, Chunk):
                got = time.perf_counter()
                yield event.pcm
                self.service.loop.ack(self.stream_id, len(event.pcm))
                if event.seq == 0 and self.first_chunk_at is not None:
                    phases.labels("handoff").observe(got - self.first_chunk_at)
                    phases.labels("send").observe(time.perf_counter() - got)
            elif isinstance(event, Done):
                self.stats = event.stats
                return
            elif isinstance(event, Failed):
                raise ApiError(event.status, event.message, code=event.reason)

    async def encoded(
        self, pipeline: AudioPipeline, finish: bool = True
    ) -> AsyncIterator[tuple[bytes, int]]:
        """(bytes to send, engine samples they came from) per chunk, then (finish) the
        encoder's tail with 0 samples. Codecs run on the service's encoder threads."""
        encode = self.service.encoder(pipeline)
        async for pcm in self.chunks():
            data = await encode(pipeline.push, pcm)
            yield data, len(pcm)
        if finish:
            yield await encode(pipeline.finish), 0

    def close(self) -> None:
        if not self.closed and self.stream_id is not None:
            self.closed = True
            self.service.loop.close(self.stream_id)


def freeze_startup_objects() -> None:
    """Move every object alive now (the models, torch, the web stack: ~350 k objects) out of
    the cyclic collector's reach, so a full collection scans only what serving creates: on a
    CPU core here a full collection of the startup heap takes ~190 ms, every thread stopped.
    Garbage first, so nothing collectable is kept."""
    gc.collect()
    gc.freeze()


class SpeechService:
    def __init__(
        self,
        engine: Engine,
        config: ServeConfig = ServeConfig(),
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.engine = engine
        self.config = config
        self.metrics = ServeMetrics()
        models = engine.models
        self.builtin_voices: list[str] = list(models.voices)
        self.languages: list[str] = list(models.languages)
        self.needs_voice = models.cfg.tts_model_type in ("custom_voice", "base")
        # Base checkpoints: cloned voices, registered over HTTP (serve/voices.py).
        self.voice_store: VoiceStore | None = None
        if models.voice_encoder is not None:
            self.voice_store = VoiceStore(config.voices_dir, models.voice_encoder.x_vector_size)
        self._catalog = _catalog(models, config.voice_aliases)
        self.standin = models.manifest.get("standin") is not None
        drop = config.drop_bootstrap_frame
        self.drop_bootstrap = (not self.standin) if drop is None else drop
        self.trim_onset = config.trim_onset and not self.standin
        # The engine's plan bounds the slots, the rows per stage call and the chunk sizes.
        self.plan = engine.plan
        sched_cfg = replace(
            config.scheduler,
            num_slots=min(config.scheduler.num_slots, engine.free_slots()),
            max_batch=min(config.scheduler.max_batch, self.plan.max_batch),
        )
        # Frames a stream may have launched but not decoded stay below the code ring: one
        # chunk, the bootstrap frame it may carry, and the step launched before it is read.
        self.max_chunk_frames = self.plan.codec_ring - 2
        default = config.scheduler.profile.chunk_schedule
        if problem := self._schedule_problem(default):
            raise ValueError(f"chunk schedule {list(default)}: {problem}")
        # Express admission pays only where the lane's work runs beside the steps in flight.
        lane = bool(getattr(getattr(engine, "backend", None), "concurrent_admission", False))
        if sched_cfg.lane_chunks < 1:
            raise ValueError(f"lane_chunks must be >= 1, got {sched_cfg.lane_chunks}")
        if lane:  # the engine's lane takes the one-frame codec steps the scheduler sends it
            engine.backend.lane_codec_steps = sched_cfg.lane_chunks
            sched_cfg = replace(sched_cfg, lane_frames=self.plan.lane_frames)
        else:
            sched_cfg = replace(sched_cfg, lane_chunks=1, lane_frames=1)
        self.scheduler = Scheduler(sched_cfg, clock, self.metrics)
        runner = Runner(engine, RequestError, timer=self.metrics.on_host,
                        codec_launches=self.metrics.on_codec_launches)  # fmt: skip
        lane_switch = None
        if lane and sched_cfg.lane_max_active > 0:  # the lane by load (lane_max_active)
            backend = engine.backend

            def lane_switch(on: bool) -> None:
                backend.lane_on = on
                self.metrics.on_lane(on)

        self.metrics.lane.set(int(lane))
        self.loop = EngineLoop(self.scheduler, runner, express=config.express_admission and lane,
                               lane_switch=lane_switch)  # fmt: skip
        self.lag_probe: asyncio.Task | None = None
        self._gc_callback: Callable | None = None  # watch_gc's, while started
        self._gc_threshold: tuple[int, int, int] | None = None  # the interpreter's, while tuned
        self.ready = False
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.encode_pool = ThreadPoolExecutor(config.encode_workers, "encode")

    @property
    def voices(self) -> list[str]:
        """Every voice a request may name: the model's own, then the registered ones."""
        registered = self.voice_store.names() if self.voice_store is not None else []
        return [*self.builtin_voices, *registered]

    @property
    def catalog(self) -> Catalog:
        """What requests are checked against: the startup catalog, plus registered voices."""
        registered = self.voice_store.names() if self.voice_store is not None else []
        if not registered:
            return self._catalog
        return replace(self._catalog, voices=[*self._catalog.voices, *registered])

    def _resolve(self, request: SynthesisRequest):
        """Tokenize and check the request here, as it arrives, so the engine loop's admission
        only claims a slot (`EngineCore.resolve`). A request the engine refuses goes on as it
        is: the loop refuses it again, through the one path that reports refusals."""
        resolve = getattr(self.engine, "resolve", None)
        if resolve is None:
            return request
        try:
            return resolve(request)
        except RequestError:
            return request

    def with_clone(self, request: SynthesisRequest) -> SynthesisRequest:
        """A request naming a registered voice, with that voice's prompt attached."""
        if self.voice_store is None or request.clone is not None or request.voice is None:
            return request
        record = self.voice_store.get(request.voice)
        if record is None:
            return request
        return replace(request, clone=record.voice.prompt_clone(self.engine.models.tokenizer))

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will serve requests."""
        self.event_loop = asyncio.get_running_loop()
        self.watch_gc()
        self.loop.start()
        self.lag_probe = self.event_loop.create_task(self._probe_event_loop_lag())

    async def _probe_event_loop_lag(self, period_s: float = 0.01) -> None:
        """Every period, how late the event loop wakes (tts_event_loop_lag_seconds)."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(period_s)
            self.metrics.on_event_loop_lag(max(0.0, time.perf_counter() - start - period_s))

    def stop(self) -> None:
        probe, loop = self.lag_probe, self.event_loop
        if probe is not None and loop is not None and not loop.is_closed():
            try:
                same_thread = asyncio.get_running_loop() is loop
            except RuntimeError:
                same_thread = False
            probe.cancel() if same_thread else loop.call_soon_threadsafe(probe.cancel)
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        self._gc_callback = None
        self.loop.stop()
        if self.config.gc_freeze:
            gc.unfreeze()  # the interpreter's own clean-up at exit sees everything again
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            self._gc_threshold = None
        self.encode_pool.shutdown(wait=False, cancel_futures=True)

    def encoder(self, pipeline: AudioPipeline):
        """How to run one pipeline step: in place for PCM (a cast), on an encoder thread for a
        codec (milliseconds: the event loop must not stall every other stream meanwhile)."""
        if not pipeline.format.is_codec:

            async def inline(fn, *args):
                return fn(*args)

            return inline

        async def threaded(fn, *args):
            return await asyncio.get_running_loop().run_in_executor(self.encode_pool, fn, *args)

        return threaded

    def _schedule_problem(self, schedule) -> str | None:
        """Why this engine cannot run a chunk schedule (None: it can)."""
        if max(schedule) > self.max_chunk_frames:
            return f"entries must be at most {self.max_chunk_frames} frames for this engine"
        return None

    def chunk_schedule(self, requested: list[int] | None) -> tuple[int, ...]:
        schedule = tuple(requested or self.config.scheduler.profile.chunk_schedule)
        if problem := self._schedule_problem(schedule):
            raise ApiError(400, f"chunk_schedule {problem}", param="chunk_schedule")
        if self.drop_bootstrap:  # the first chunk carries the dropped frame too
            schedule = (schedule[0] + 1, *schedule[1:])
        return schedule

    def _trimmer(self) -> SilenceTrimmer | None:
        if not (self.drop_bootstrap or self.trim_onset):
            return None
        onset = self.config.onset_dbfs if self.trim_onset else None
        return SilenceTrimmer(FRAME_SAMPLES if self.drop_bootstrap else 0, onset)

    def submit(
        self,
        request: SynthesisRequest,
        chunk_schedule: list[int] | None = None,
        follows: StreamHandle | None = None,
        continuation: bool = False,
    ) -> StreamHandle:
        """Queue a request without waiting; events (Admitted first) arrive on the handle.
        `follows`: the handle whose audio the client plays before this one's (the previous
        segment of a session): this one's chunks are due by that playback, not by their own.
        `continuation`: a later segment of an admitted WebSocket session (never refused)."""
        handle = StreamHandle(self, asyncio.get_running_loop())
        start = time.perf_counter()
        resolved = self._resolve(self.with_clone(request))
        self.metrics.http_phases.labels("resolve").observe(time.perf_counter() - start)
        try:
            stream = self.loop.submit(
                resolved, handle.sink,
                self.chunk_schedule(chunk_schedule),
                self._trimmer(), follows.stream_id if follows is not None else None,
                continuation,
            )  # fmt: skip
        except Rejected as exc:
            raise ApiError(exc.status, exc.message, code=exc.reason,
                           type=_error_type(exc.status)) from None  # fmt: skip
        handle.stream_id = stream.id
        return handle

    async def open(self, request: SynthesisRequest, chunk_schedule: list[int] | None = None):
        """Queue a request and wait until it holds an engine slot (or is refused)."""
        handle = self.submit(request, chunk_schedule)
        submitted = time.perf_counter()
        try:
            await handle.admitted()
            self.metrics.http_phases.labels("admitted").observe(time.perf_counter() - submitted)
        except BaseException:
            handle.close()
            raise
        return handle

    def watch_gc(self) -> None:
        """Time the collector's pauses (tts_gc_pause_seconds{generation}): they stop every
        thread, the engine loop and the event loop alike."""
        started: dict[str, float] = {}

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started["t"] = time.perf_counter()
            elif "t" in started:
                self.metrics.on_gc_pause(info["generation"], time.perf_counter() - started.pop("t"),
                                         info.get("collected", 0))  # fmt: skip

        if self._gc_callback is None:
            gc.callbacks.append(on_gc)
            self._gc_callback = on_gc

    async def warm_up(self) -> None:
        """Two short requests, one twice as long, through the whole path (at once where two
        slots allow); /ready turns true only after them. Steps of one and two rows show the
        scheduler how a step's cost grows with the batch before real load arrives (see
        scheduler.RowCost)."""
        models = self.engine.models
        warm_words = getattr(getattr(models, "tokenizer", None), "warm_words", None)
        if warm_words is not None:  # a request's new words cost it no BPE call (text.tokenizer)
            words = await asyncio.to_thread(warm_words)
            log.info("tokenizer word table: %d vocabulary words encoded ahead", words)
        clone = None
        if self.voice_store is not None:  # no voice need be registered yet: a neutral one
            clone = VoiceClone(torch.zeros(models.voice_encoder.x_vector_size))
        catalog = self.catalog

        async def one(max_frames: int) -> dict | None:
            request = SynthesisRequest(
                text=self.config.warmup_text,
                voice=catalog.voices[0] if catalog.voices and catalog.needs_voice else None,
                seed=0,
                max_frames=max_frames,
                clone=clone,
            )
            handle = await self.open(request)
            try:
                async for _ in handle.chunks():
                    pass
            finally:
                handle.close()
            return handle.stats

        if self.scheduler.config.num_slots >= 2:
            stats = await asyncio.gather(one(4), one(8))
        else:  # one at a time: the second would find the slot held, and 429
            stats = [await one(4), await one(8)]
        if self.config.gc_freeze:
            freeze_startup_objects()
        if self.config.gc_threshold is not None and self._gc_threshold is None:
            # collections of the live requests' objects, rarer (ServeConfig.gc_threshold)
            self._gc_threshold = gc.get_threshold()
            gc.set_threshold(*self.config.gc_threshold)
        self.ready = True
        log.info("warm-up done: %s", stats)


def _catalog(models, aliases: dict[str, str] | None) -> Catalog:
    cfg = models.cfg
    voices = [] if cfg.tts_model_type == "voice_design" else list(models.voices)
    if aliases is None:
        aliases = {k: v for k, v in DEFAULT_VOICE_ALIASES.items() if v in voices}
    else:
        aliases = {k.strip().lower(): v.strip().lower() for k, v in aliases.items()}
        if voices and (bad := sorted(v for v in aliases.values() if v not in voices)):
            raise ValueError(f"voice aliases name unknown speakers {bad}; known: {voices}")
        if clash := sorted(set(aliases) & set(voices)):
            raise ValueError(f"voice aliases shadow the model's speakers {clash}")
    return Catalog(
        voices=voices,
        aliases=aliases if voices else {},
        languages=list(models.languages),
        needs_voice=cfg.tts_model_type in ("custom_voice", "base"),
        supports_instruct=cfg.supports_instruct and cfg.tts_model_type != "base",
    )


def _error_type(status: int) -> str:
    return {429: "rate_limit_error", 503: "server_overloaded"}.get(status, "invalid_request_error")
