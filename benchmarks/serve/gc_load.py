"""The cyclic garbage collector under a steady request rate, on the real serving stack in this
process (CPU, the tiny random model): how often each generation is collected, how long each
pause is, and whether the objects the collector tracks grow with the requests served.

On the H200 host at 70 req/s `tts_gc_pause_seconds` showed, per minute, ~450 generation-0
collections of ~0.87 ms, ~40 of generation 1 (~5.5 ms) and 3 of generation 2 (~11 ms), at the
interpreter's thresholds; every pause stops the engine thread and the event loop. This replays
such load at a rate the CPU sustains and reports where the collector's work comes from:

    python benchmarks/serve/gc_load.py [--mode service|http] [--rate 20] [--duration 60]
        [--max-frames 6] [--rounds 3] [--gc-threshold 700,10,10] [--types]

--mode service: requests go to SpeechService.open / StreamHandle.encoded (what the HTTP handler
calls), consumed on this process's event loop. --mode http: a real uvicorn server in a
thread of this process and the client in a subprocess (its objects are not counted here).
The server is built as `ttsbuild serve --random tiny` builds it (ServeConfig defaults:
gc_freeze after the warm-up), capacity admission off (the tiny model on two shared cores
runs near real time, see tests/serve/conftest.py).

Reports, once per --every seconds: the objects tracked per generation (gc.get_objects(i)),
collections and their pauses per generation (gc.callbacks); at the end: collections per
minute and mean / p99 / max pause per generation, gc.get_stats() deltas, and the tracked
objects after a full collection before the load and after each --rounds (a leak: they grow
with the requests). --types: the types that survived the load (after gc.collect()) and the types
found in generations 1 and 2 at each report (what lives long enough to be promoted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque

from ttsbuild.bench.metrics import nearest_rank
from ttsbuild.serve.cli import parse_gc_threshold

TEXT = "Thanks, Hannah. Your flight boards at gate twelve. Would you prefer Friday?"


class GcWatch:
    """Every collection's generation and pause (gc.callbacks), from start() to stop()."""

    def __init__(self, sample_every: int = 0):
        self.pauses: list[tuple[int, float, int]] = []  # (generation, seconds, collected)
        self._t = 0.0
        # --types: every sample_every-th collection, the types it scans (before it starts)
        self.sample_every, self.scanned = sample_every, Counter()
        self.scanned_items = Counter()  # ...and their len() where they have one

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            g = info["generation"]
            if self.sample_every and len(self.pauses) % self.sample_every == 0:
                for o in (o for i in range(g + 1) for o in gc.get_objects(generation=i)):
                    name = f"{type(o).__module__}.{type(o).__qualname__}"
                    self.scanned[name] += 1
                    if isinstance(o, (dict, list, tuple, set, deque)):
                        self.scanned_items[name] += len(o)
            self._t = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t,
                                info.get("collected", 0)))  # fmt: skip

    def start(self) -> None:
        self.stats0 = gc.get_stats()
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)
        self.stats1 = gc.get_stats()

    def collect_unwatched(self) -> None:
        """A full collection that the report leaves out (its stats included)."""
        gc.callbacks.remove(self._on_gc)
        before = gc.get_stats()
        gc.collect()
        after = gc.get_stats()
        for s0, b, c in zip(self.stats0, before, after, strict=True):
            for k in s0:
                s0[k] += c[k] - b[k]
        gc.callbacks.append(self._on_gc)


def tracked() -> tuple[int, int, int]:
    return tuple(len(gc.get_objects(generation=g)) for g in range(3))


def type_counts(objs) -> Counter:
    return Counter(type(o).__qualname__ for o in objs)


def summary(watch: GcWatch, seconds: float) -> list[str]:
    lines = ["gen | collections/min | pause mean / p99 / max ms | collected/collection"]
    for g in range(3):
        ps = [p for p in watch.pauses if p[0] == g]
        if not ps:
            lines.append(f"  {g} | 0")
            continue
        ms = sorted(p[1] * 1e3 for p in ps)
        lines.append(f"  {g} | {len(ps) * 60 / seconds:8.1f} | {statistics.mean(ms):.3f} / "
                     f"{nearest_rank(ms, 99):.3f} / {ms[-1]:.3f} | "
                     f"{statistics.mean(p[2] for p in ps):.1f}")  # fmt: skip
    lines.append("gc.get_stats() deltas: " + ", ".join(
        f"gen{g} " + " ".join(f"{k}+{watch.stats1[g][k] - watch.stats0[g][k]}"
                              for k in watch.stats0[g]) for g in range(3)))  # fmt: skip
    return lines


def build_service(a):
    import torch

    from ttsbuild.runtime.loader import open_engine
    from ttsbuild.serve.config import SchedulerConfig, ServeConfig
    from ttsbuild.serve.service import SpeechService

    torch.set_num_threads(1)
    engine = open_engine(None, "cpu", num_slots=a.slots, max_len=512, random_variant=a.variant)
    config = ServeConfig(scheduler=SchedulerConfig(admit_by_capacity=False, max_queue=1000))
    return SpeechService(engine, config)


async def one_request(service, i: int, a, served: list) -> None:
    """What the streamed HTTP handler does: open, encode each chunk as PCM, close."""
    from ttsbuild.runtime.request import SynthesisRequest
    from ttsbuild.serve.formats import FORMATS, AudioPipeline

    request = SynthesisRequest(text=TEXT, voice="ryan", seed=i, max_frames=a.max_frames)
    try:
        handle = await service.open(request)
    except Exception as exc:  # refused: counted, the load goes on
        served.append(type(exc).__name__)
        return
    try:
        async for _ in handle.encoded(AudioPipeline(FORMATS["pcm"], 24000, 1.0)):
            pass
    finally:
        handle.close()
    served.append("ok")


async def steady_rate(a, request, on_tick=None) -> None:
    """request(i) for i = 0, 1, ... at a.rate per second (request i leaves at i / rate) for
    a.duration seconds, then waits for them all; on_tick(seconds since the start) between."""
    tasks, start, i = [], time.perf_counter(), 0
    while (now := time.perf_counter() - start) < a.duration:
        if i < now * a.rate:
            tasks.append(asyncio.create_task(request(i)))
            i += 1
        if on_tick is not None:
            on_tick(now)
        await asyncio.sleep(min(0.005, max(0.0, i / a.rate - now)))
    await asyncio.gather(*tasks)


async def drive_service(service, a, on_tick) -> list:
    served: list = []
    await steady_rate(a, lambda i: one_request(service, i, a, served), on_tick)
    return served


def client_main(url: str, a) -> None:
    """--client: the load's client in its own process (--mode http); prints a JSON summary."""
    import httpx

    body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "pcm",
            "stream": True, "max_frames": a.max_frames}  # fmt: skip

    async def run():
        outcome: Counter = Counter()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:

            async def one(i):
                try:
                    async with c.stream("POST", url + "/v1/audio/speech",
                                        json={**body, "seed": i}) as r:  # fmt: skip
                        async for _ in r.aiter_raw():
                            pass
                        outcome[r.status_code] += 1
                except httpx.HTTPError as exc:
                    outcome[type(exc).__name__] += 1

            await steady_rate(a, one)
        print(json.dumps({str(k): v for k, v in outcome.items()}))

    asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="service", choices=["service", "http"])
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-frames", type=int, default=6)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--variant", default="tiny")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the load; tracked objects (after gc.collect()) after each round")
    p.add_argument("--every", type=float, default=10.0, help="seconds between reports")
    p.add_argument("--gc-threshold", default=None,
                   help="gc.set_threshold after the warm-up, e.g. 700,10,10 or python (the "
                   "interpreter's); "
                   "default: the server's (ServeConfig.gc_threshold)")
    p.add_argument("--types", action="store_true", help="which types survive and get promoted")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the http client process
    a = p.parse_args()
    try:  # the server's own parser ('python': the interpreter's 700,10,10)
        threshold = a.gc_threshold and (parse_gc_threshold(a.gc_threshold) or (700, 10, 10))
    except ValueError as exc:
        p.error(str(exc))
    if a.client:
        return client_main(a.client, a)

    service = build_service(a)
    watch = GcWatch(sample_every=10 if a.types else 0)
    promoted: Counter = Counter()  # types seen in generations 1 and 2 at the reports
    state = {"next": 0.0}

    def ready_snapshot() -> None:
        """After the warm-up (and its gc.freeze): the baseline, after a full collection."""
        if threshold:
            gc.set_threshold(*threshold)
        gc.collect()
        state["base"] = tracked()
        state["modules"] = set(sys.modules)
        if a.types:
            state["base_types"] = type_counts(gc.get_objects())
        print(f"python {sys.version.split()[0]}, frozen {gc.get_freeze_count()}, threshold "
              f"{gc.get_threshold()}, tracked after warm-up + gc.collect(): {state['base']}")
        print(f"{a.mode}: {a.rate:g} req/s for {a.duration:g} s, {a.max_frames} frames each, "
              f"{a.slots} slots ({a.variant} on cpu)")
        print("   t s | tracked gen0 gen1 gen2 | collections gen0 gen1 gen2 | pause ms (sum)")
        watch.start()

    def on_tick(now: float) -> None:
        if now < state["next"]:
            return
        state["next"] += a.every
        counts = Counter(p[0] for p in watch.pauses)
        spent = sum(p[1] for p in watch.pauses) * 1e3
        t0, t1, t2 = tracked()
        print(f"{now:6.1f} | {t0:7d} {t1:7d} {t2:7d} | {counts[0]:6d} {counts[1]:5d} "
              f"{counts[2]:5d} | {spent:8.1f}", flush=True)  # fmt: skip
        if a.types:
            promoted.update(type_counts(gc.get_objects(generation=1)))
            promoted.update(type_counts(gc.get_objects(generation=2)))

    def after_round(r: int) -> None:
        """Idle again, still frozen (stop() unfreezes): what the load left behind."""
        service.loop.wait_idle()
        watch.collect_unwatched()
        state["after"] = tracked()
        print(f"round {r + 1}: tracked after gc.collect(): {state['after']}", flush=True)

    def after_load() -> None:
        watch.stop()
        if a.types:
            state["left"] = type_counts(gc.get_objects()) - state["base_types"]

    if a.mode == "service":

        async def run():
            service.start()
            await service.warm_up()
            ready_snapshot()
            served = []
            for r in range(a.rounds):
                state["next"] = 0.0
                served += await drive_service(service, a, on_tick)
                after_round(r)
            after_load()
            return served

        try:
            served = asyncio.run(run())
        finally:
            service.stop()
        outcome = dict(Counter(served))
    else:
        import uvicorn

        from ttsbuild.serve.app import create_app

        server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0,
                                               log_level="warning"))  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not (server.started and service.ready):
            time.sleep(0.01)
        ready_snapshot()
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        args = [sys.executable, __file__, "--client", url, "--rate", str(a.rate),
                "--duration", str(a.duration), "--max-frames", str(a.max_frames)]  # fmt: skip
        outcome = Counter()
        for r in range(a.rounds):
            client = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
            start, state["next"] = time.perf_counter(), 0.0
            while client.poll() is None:
                on_tick(time.perf_counter() - start)
                time.sleep(0.05)
            outcome.update(json.loads(client.stdout.read().strip().splitlines()[-1]))
            time.sleep(0.5)  # the server's side of the last responses
            after_round(r)
        after_load()
        server.should_exit = True
        thread.join(timeout=10)
    requests = sum(outcome.values())
    print(f"requests {requests}: {outcome}")
    print("\n".join(summary(watch, a.duration * a.rounds)))
    base, after = state["base"], state["after"]
    grown = sum(after) - sum(base)
    print(f"tracked after load + gc.collect(): {after} (baseline {base}): {grown:+d}, "
          f"{grown / max(1, requests):+.2f} per request")  # fmt: skip
    if new := sorted(set(sys.modules) - state["modules"]):
        print(f"modules imported during the load ({len(new)}):", ", ".join(new))
    if a.types:
        print("survived the load (after gc.collect(), not there before):",
              ", ".join(f"{k} {v}" for k, v in state["left"].most_common(15)))
        print("in generations 1/2 at the reports (summed):",
              ", ".join(f"{k} {v}" for k, v in promoted.most_common(25)))
        n = max(1, len(watch.pauses) // watch.sample_every)
        print(f"scanned per sampled collection ({n} sampled), type: objects (items):",
              ", ".join(f"{k} {v / n:.0f} ({watch.scanned_items[k] / n:.0f})"
                        for k, v in watch.scanned.most_common(25)))  # fmt: skip


if __name__ == "__main__":
    main()
