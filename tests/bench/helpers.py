"""Shared helpers: run one request through the whole runner against a scripted server."""

from __future__ import annotations

from ttsbuild.bench.audio import BodyFormat
from ttsbuild.bench.client import Timeouts
from ttsbuild.bench.metrics import RequestRecord
from ttsbuild.bench.runner import RunSettings, run_benchmark
from ttsbuild.bench.schedule import ArrivalProcess
from ttsbuild.bench.target import Mode, Target, endpoint_url


def settings_for(
    url: str,
    *,
    mode: Mode = Mode.http,
    rate: float = 1.0,
    duration_s: float = 1.0,
    warmup_s: float = 0.0,
    arrival: ArrivalProcess = ArrivalProcess.constant,
    stall_s: float = 2.0,
    total_s: float = 5.0,
    body_format: BodyFormat = BodyFormat.auto,
    extra_fields: dict | None = None,
    headers: dict | None = None,
    word_interval_s: float = 0.01,
    http_client: str = "aiohttp",
) -> RunSettings:
    return RunSettings(
        target=Target(
            url=endpoint_url(url, mode),
            mode=mode,
            model="test-model",
            language="en",
            body_format=body_format,
            sample_rate=24_000,
            extra_fields=extra_fields or {},
            headers=headers or {},
        ),
        rate=rate,
        duration_s=duration_s,
        warmup_s=warmup_s,
        seed=0,
        arrival=arrival,
        voices=("alice",),
        word_interval_s=word_interval_s,
        timeouts=Timeouts(stall_s=stall_s, total_s=total_s),
        max_connections=64,
        gpu_hour_usd=None,
        gpus=1,
        dataset="test",
        http_client=http_client,
    )


def one_request(url: str, text: str = "hello world", **kwargs) -> RequestRecord:
    """Constant arrivals at 1 req/s over 1 s: exactly one request, sent at t=0."""
    result = run_benchmark(settings_for(url, **kwargs), [text])
    assert len(result.records) == 1
    return result.records[0]
