"""`ttsbuild bench selftest`: the harness measured against an instant local server.

The server (fakeserver.instant_reply: 0.1 s of audio, no delay) runs in its own process so
that its work never holds the benchmark process's GIL; what remains in the dispatch lag is the
harness and the OS scheduler.
"""

from __future__ import annotations

from ttsbuild.bench.audio import BodyFormat
from ttsbuild.bench.client import Timeouts
from ttsbuild.bench.fakeserver import serve_in_subprocess
from ttsbuild.bench.runner import RunResult, RunSettings, run_benchmark
from ttsbuild.bench.schedule import DEFAULT_DATASET, ArrivalProcess, load_prompts
from ttsbuild.bench.target import DEFAULT_SAMPLE_RATE, Mode, Target, endpoint_url


def run_selftest(
    rate: float, duration_s: float, warmup_s: float, mode: Mode = Mode.http, seed: int = 0
) -> RunResult:
    with serve_in_subprocess() as (http_url, ws_url):
        target = Target(
            url=endpoint_url(ws_url if mode is Mode.ws else http_url, mode),
            mode=mode,
            model="fake",
            language=None,
            body_format=BodyFormat.auto,
            sample_rate=DEFAULT_SAMPLE_RATE,
        )
        settings = RunSettings(
            target=target,
            rate=rate,
            duration_s=duration_s,
            warmup_s=warmup_s,
            seed=seed,
            arrival=ArrivalProcess.poisson,
            voices=("default",),
            word_interval_s=0.0,  # words back to back: the harness, not a typist, is measured
            timeouts=Timeouts(stall_s=5.0, total_s=10.0),
            max_connections=1024,
            gpu_hour_usd=None,
            gpus=1,
            dataset=f"{DEFAULT_DATASET} (built in)",
        )
        return run_benchmark(settings, load_prompts(None))


def lag_line(result: RunResult) -> str:
    lag = result.summary["timings"]["dispatch_lag_s"]
    return (
        f"dispatch lag over {lag['count']} requests at {result.settings.rate:g} req/s: "
        f"p50 {lag['p50'] * 1e3:.2f} ms, p99 {lag['p99'] * 1e3:.2f} ms, "
        f"max {lag['max'] * 1e3:.2f} ms"
    )
