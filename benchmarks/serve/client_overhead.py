"""The load generator's own share of time to first audio, per HTTP client library: the
harness (`ttsbuild.bench.runner`) against a scripted local server in its own process whose
first chunk leaves 12 ms after a request arrives, then chunks of 2, 4, 8, 12 x 5 frames
(80 ms each, paced at 8 ms per frame), Poisson arrivals, the clients alternated in one run.

    python benchmarks/serve/client_overhead.py [--rates 20,40] [--duration 15] [--rounds 2]

Prints dispatch lag and TTFA p50 / p95 / p99 per client and rate; TTFA above ~13 ms (12 ms +
the server's 1 ms timer rounding) is the two processes' HTTP work and the harness's own.
"""

from __future__ import annotations

import argparse

from ttsbuild.bench.audio import BodyFormat
from ttsbuild.bench.client import HttpClient, Timeouts
from ttsbuild.bench.fakeserver import Reply, serve_in_subprocess, tone
from ttsbuild.bench.runner import RunSettings, run_benchmark
from ttsbuild.bench.schedule import DEFAULT_DATASET, ArrivalProcess, load_prompts
from ttsbuild.bench.target import Mode, Target, endpoint_url


def voice_agent_stream(_request) -> Reply:
    """A voice-agent reply as `ttsbuild serve` streams it (low-latency chunk schedule)."""
    sizes = [1, 2, 4, 8] + [12] * 5
    return Reply(chunks=[(0.012 if i == 0 else n * 0.008, tone(n * 0.08))
                         for i, n in enumerate(sizes)])  # fmt: skip


def run(url: str, rate: float, duration: float, client: HttpClient):
    settings = RunSettings(
        target=Target(url=endpoint_url(url, Mode.http), mode=Mode.http, model="fake",
                      language=None, body_format=BodyFormat.auto, sample_rate=24_000),
        rate=rate, duration_s=duration, warmup_s=1.0, seed=0, arrival=ArrivalProcess.poisson,
        voices=("default",), word_interval_s=0.0, timeouts=Timeouts(stall_s=5.0, total_s=30.0),
        max_connections=1024, gpu_hour_usd=None, gpus=1,
        dataset=f"{DEFAULT_DATASET} (built in)", http_client=client,
    )  # fmt: skip
    timings = run_benchmark(settings, load_prompts(None)).summary["timings"]
    lag, ttfa = timings["dispatch_lag_s"], timings["ttfa_s"]
    return (f"{client.value:8s} {rate:5g} req/s: dispatch lag p50 {lag['p50'] * 1e3:5.2f} "
            f"p99 {lag['p99'] * 1e3:5.2f}; TTFA p50 {ttfa['p50'] * 1e3:6.2f} "
            f"p95 {ttfa['p95'] * 1e3:6.2f} p99 {ttfa['p99'] * 1e3:6.2f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", default="20,40")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    with serve_in_subprocess(voice_agent_stream) as (http_url, _):
        for rate in (float(r) for r in a.rates.split(",")):
            for _ in range(a.rounds):
                for client in (HttpClient.httpx, HttpClient.aiohttp):
                    print(run(http_url, rate, a.duration, client), flush=True)


if __name__ == "__main__":
    main()
