"""What the HTTP layer adds to time-to-first-audio: sequential streamed requests against a
real `ttsbuild serve` app in this process, each request's time to its first body byte at
the client against the server's own time to first audio (arrival in the scheduler -> first
chunk handed over: the /metrics histogram's sum, read before and after each request).
The difference is request parsing and validation, resolving the request (tokenizing),
handing the chunk from the engine thread to the event loop, writing it, and reading it.

    python benchmarks/serve/http_overhead.py [--loop asyncio|uvloop] [--http h11|httptools]
        [--requests 60] [--variant tiny] [--device cpu]

Prints mean / p50 / p95 of the client TTFB, the server TTFA and their difference (ms).
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time

import httpx
import torch

TEXT = "Thanks, Hannah. Your flight boards at gate twelve. Would you prefer Friday?"


def ttfa_sum(client: httpx.Client, url: str) -> float:
    m = re.search(r"^tts_time_to_first_audio_seconds_sum (\S+)$", client.get(url + "/metrics").text,
                  re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


def main() -> None:
    import uvicorn

    from ttsbuild.runtime.loader import open_engine
    from ttsbuild.serve.app import create_app
    from ttsbuild.serve.config import SchedulerConfig, ServeConfig
    from ttsbuild.serve.metrics import HTTP_PHASES
    from ttsbuild.serve.service import SpeechService

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    ap.add_argument("--http", default="h11", choices=["h11", "httptools"])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--variant", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-frames", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = open_engine(None, a.device, num_slots=4, max_len=512, random_variant=a.variant)
    service = SpeechService(engine, ServeConfig(scheduler=SchedulerConfig(admit_by_capacity=False)))
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0,
                                           log_level="warning", loop=a.loop, http=a.http))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "pcm",
            "stream": True, "max_frames": a.max_frames}  # fmt: skip
    ttfb, ttfa, headers = [], [], []
    with httpx.Client(timeout=60) as client:
        for i in range(a.requests + 5):  # 5 warm-up requests
            before = ttfa_sum(client, url)
            t0 = time.perf_counter()
            with client.stream("POST", url + "/v1/audio/speech", json=body) as r:
                got_headers = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                it = r.iter_raw()
                next(it)
                first = time.perf_counter() - t0
                for _ in it:
                    pass
            if i >= 5:
                headers.append(got_headers * 1e3)
                ttfb.append(first * 1e3)
                ttfa.append((ttfa_sum(client, url) - before) * 1e3)
        text = client.get(url + "/metrics").text
    server.should_exit = True
    gap = [b - s for b, s in zip(ttfb, ttfa, strict=True)]
    # the server's own split of its HTTP side (tts_http_phase_seconds), warm-up included
    phases = {}
    for phase in HTTP_PHASES:
        total, count = (
            float(re.search(rf'^tts_http_phase_seconds_{k}{{phase="{phase}"}} (\S+)$', text,
                            re.M).group(1)) for k in ("sum", "count"))  # fmt: skip
        phases[phase] = total / count * 1e3 if count else 0.0

    def row(name, xs):
        xs = sorted(xs)
        return (f"{name:<22} mean {statistics.mean(xs):6.2f}  p50 {xs[len(xs) // 2]:6.2f}  "
                f"p95 {xs[int(0.95 * (len(xs) - 1))]:6.2f} ms")  # fmt: skip

    print(f"uvicorn loop={a.loop} http={a.http}, {a.requests} sequential requests "
          f"({a.variant} on {a.device}, {a.max_frames} frames each)")
    print(row("client headers", headers))
    print(row("client first byte", ttfb))
    print(row("server first audio", ttfa))
    print(row("HTTP layer (diff)", gap))
    print("server means (admitted overlaps the server's first audio; the others add to it): "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in phases.items()))


if __name__ == "__main__":
    main()
