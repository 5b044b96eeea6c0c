"""`ttsbuild bench run | sweep | selftest`.

Imports here stay light (typer only at module level) so `ttsbuild --help` is fast; numpy,
httpx, rich and matplotlib load inside the commands. Every flag is validated before anything
is written, so a bad flag leaves no partial output directory behind.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from ttsbuild.bench.runner import RunSettings

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)

app = typer.Typer(
    help="Open-loop load generation against a streaming speech endpoint, measuring what a "
    "listener hears: audible time to first audio and playback underruns.",
    no_args_is_help=True,
)

# Options shared by `run` and `sweep`.
Url = Annotated[
    str,
    typer.Option(
        help="Server base URL (the standard path is added) or a full endpoint URL.",
        show_default=False,
    ),
]
Duration = Annotated[str, typer.Option(help="Measured window after warmup: 500ms, 60s, 2m, 1h.")]
Warmup = Annotated[str, typer.Option(help="Requests sent first and left out of summaries.")]
Seed = Annotated[int, typer.Option(help="Fixes arrival gaps and the prompt order.")]
Dataset = Annotated[
    str,
    typer.Option(help="A shipped prompt set: harvard (720 Harvard sentences, ~39 chars) or "
    "voice-agent (720 voice-agent replies, 15-250 chars, mean ~90); or a file: .txt (one "
    "prompt a line) or .jsonl ({\"text\": ...})."),
]  # fmt: skip
Voice = Annotated[list[str], typer.Option(help="Voice(s); repeat to rotate voices by request.")]
Model = Annotated[str, typer.Option(help='The "model" field of the request.')]
Language = Annotated[
    str | None, typer.Option(help="Sent in the WebSocket session.config (HTTP: use --field).")
]
ModeOpt = Annotated[str, typer.Option("--mode", help="http (POST, streamed body) or ws.")]
Arrival = Annotated[str, typer.Option(help="poisson or constant inter-arrival gaps.")]
WordInterval = Annotated[str, typer.Option(help="WebSocket mode: one word every this long.")]
Field = Annotated[
    list[str] | None,
    typer.Option(
        "--field",
        help="Extra body field key=value (value JSON-parsed when valid JSON); repeatable.",
    ),
]
Header = Annotated[
    list[str] | None, typer.Option("--header", help="Request header key=value; repeatable.")
]
TargetConfig = Annotated[
    Path | None,
    typer.Option(help='JSON: {"extra_fields": {}, "headers": {}, "body_format": "pcm|wav|auto", '
    '"sample_rate": 24000}. Flags override it.'),
]  # fmt: skip
BodyFormatOpt = Annotated[
    str | None,
    typer.Option("--body-format", help="pcm, wav or auto (sniff the RIFF header; the default)."),
]
SampleRate = Annotated[
    int | None, typer.Option(help="Raw PCM rate used when no x-sample-rate header (default 24000).")
]
RequestTimeout = Annotated[str, typer.Option(help="Whole-request limit.")]
StallTimeout = Annotated[str, typer.Option(help="Longest wait for the next bytes.")]
MaxConnections = Annotated[int, typer.Option(help="HTTP connection pool size.")]
Workers = Annotated[
    int,
    typer.Option(
        help="Processes sending the schedule, each on its own event loop (request i from "
        "worker i % N): one loop reading ~100 streams at 100 req/s runs a few ms late itself "
        "(see the run's 'harness loop lag'), and chunks it reads late look like the server's."
    ),
]
HttpClientOpt = Annotated[
    str, typer.Option(help="HTTP client library: aiohttp (less of the harness's own time per "
                      "request) or httpx.")
]
GpuHourUsd = Annotated[
    float | None, typer.Option(help="$ per GPU-hour, for cost per 1M characters.")
]
Gpus = Annotated[int, typer.Option(help="GPUs behind the endpoint, for the cost figure.")]
Output = Annotated[Path, typer.Option(help="Directory for the result files.", show_default=False)]


def _wide_console() -> Any:
    """The console for result tables: the terminal's width, or 200 columns where the output is
    a file or a pipe (rich's default 80 would cut a sweep table's cells to '…' in a log)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _bad(flag: str, message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=f"'{flag}'")


def _parse(flag: str, parser: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a value parser, turning its ValueError into a one-line CLI error."""
    try:
        return parser(*args, **kwargs)
    except ValueError as err:
        raise _bad(flag, str(err)) from None


def _choice(flag: str, choices: type[E], value: str) -> E:
    """An enum member by value, or a one-line error naming the valid values."""
    try:
        return choices(value)
    except ValueError:
        valid = ", ".join(member.value for member in choices)
        raise _bad(flag, f"{value!r} is not one of: {valid}") from None


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise _bad("--output", f"{str(output)!r} exists and is not a directory")


def _settings(
    *,
    url: str,
    rate: float,
    duration: str,
    warmup: str,
    seed: int,
    dataset: str,
    voice: list[str],
    model: str,
    language: str | None,
    mode: str,
    arrival: str,
    word_interval: str,
    field: list[str] | None,
    header: list[str] | None,
    target_config: Path | None,
    body_format: str | None,
    sample_rate: int | None,
    request_timeout: str,
    stall_timeout: str,
    max_connections: int,
    gpu_hour_usd: float | None,
    gpus: int,
    http_client: str = "aiohttp",
    workers: int = 1,
) -> tuple[RunSettings, list[str]]:
    """Validate every flag and build the run settings and prompt list (no side effects)."""
    from ttsbuild.bench.audio import BodyFormat
    from ttsbuild.bench.client import HttpClient, Timeouts
    from ttsbuild.bench.runner import RunSettings
    from ttsbuild.bench.schedule import BUILTIN_DATASETS, ArrivalProcess, load_prompts
    from ttsbuild.bench.target import (
        DEFAULT_SAMPLE_RATE,
        Mode,
        Target,
        TargetConfigFile,
        endpoint_url,
        load_target_config,
    )
    from ttsbuild.bench.units import parse_duration, parse_key_value

    mode_value = _choice("--mode", Mode, mode)
    client_value = _choice("--http-client", HttpClient, http_client)
    arrival_value = _choice("--arrival", ArrivalProcess, arrival)
    endpoint = _parse("--url", endpoint_url, url, mode_value)
    file_config = (
        _parse("--target-config", load_target_config, target_config)
        if target_config is not None
        else TargetConfigFile()
    )
    extra_fields = dict(file_config.extra_fields)
    for item in field or []:
        key, value = _parse("--field", parse_key_value, item, json_values=True)
        extra_fields[key] = value
    headers = dict(file_config.headers)
    for item in header or []:
        key, value = _parse("--header", parse_key_value, item, json_values=False)
        headers[key] = str(value)
    if body_format is not None:
        body_format_value = _choice("--body-format", BodyFormat, body_format)
    else:
        body_format_value = file_config.body_format or BodyFormat.auto
    rate_hz = sample_rate or file_config.sample_rate or DEFAULT_SAMPLE_RATE
    if rate_hz <= 0:
        raise _bad("--sample-rate", "must be a positive number of samples per second")
    if max_connections < 1:
        raise _bad("--max-connections", "must be at least 1")
    if gpus < 1:
        raise _bad("--gpus", "must be at least 1")
    if workers < 1:
        raise _bad("--workers", "must be at least 1")
    if gpu_hour_usd is not None and gpu_hour_usd < 0:
        raise _bad("--gpu-hour-usd", "must not be negative")
    if not voice or any(not v.strip() for v in voice):
        raise _bad("--voice", "voices must be non-empty")
    settings = RunSettings(
        target=Target(
            url=endpoint,
            mode=mode_value,
            model=model,
            language=language,
            body_format=body_format_value,
            sample_rate=rate_hz,
            extra_fields=extra_fields,
            headers=headers,
        ),
        rate=rate,
        duration_s=_parse("--duration", parse_duration, duration),
        warmup_s=_parse("--warmup", parse_duration, warmup, allow_zero=True),
        seed=seed,
        arrival=arrival_value,
        voices=tuple(voice),
        word_interval_s=_parse("--word-interval", parse_duration, word_interval, allow_zero=True),
        timeouts=Timeouts(
            stall_s=_parse("--stall-timeout", parse_duration, stall_timeout),
            total_s=_parse("--request-timeout", parse_duration, request_timeout),
        ),
        max_connections=max_connections,
        gpu_hour_usd=gpu_hour_usd,
        gpus=gpus,
        dataset=f"{dataset} (built in)" if dataset in BUILTIN_DATASETS else dataset,
        http_client=client_value,
        workers=workers,
    )
    prompts = _parse("--dataset", load_prompts, dataset)
    return settings, prompts


@app.command()
def run(
    url: Url,
    output: Output,
    rps: Annotated[str, typer.Option(help="Offered load, requests/second.")] = "1",
    duration: Duration = "60s",
    warmup: Warmup = "10s",
    seed: Seed = 0,
    dataset: Dataset = "harvard",
    voice: Voice = ["default"],  # noqa: B006 (typer reads, never mutates, the default)
    model: Model = "qwen3-tts",
    language: Language = None,
    mode: ModeOpt = "http",
    arrival: Arrival = "poisson",
    word_interval: WordInterval = "10ms",
    field: Field = None,
    header: Header = None,
    target_config: TargetConfig = None,
    body_format: BodyFormatOpt = None,
    sample_rate: SampleRate = None,
    request_timeout: RequestTimeout = "60s",
    stall_timeout: StallTimeout = "10s",
    max_connections: MaxConnections = 1024,
    gpu_hour_usd: GpuHourUsd = None,
    gpus: Gpus = 1,
    http_client: HttpClientOpt = "aiohttp",
    workers: Workers = 1,
) -> None:
    """One open-loop run at a fixed rate; writes config.json, requests.jsonl, summary.json."""
    from ttsbuild.bench.units import parse_rate

    _check_output(output)
    settings, prompts = _settings(
        url=url, rate=_parse("--rps", parse_rate, rps), duration=duration, warmup=warmup,
        seed=seed, dataset=dataset, voice=voice, model=model, language=language, mode=mode,
        arrival=arrival, word_interval=word_interval, field=field, header=header,
        target_config=target_config, body_format=body_format, sample_rate=sample_rate,
        request_timeout=request_timeout, stall_timeout=stall_timeout,
        max_connections=max_connections, gpu_hour_usd=gpu_hour_usd, gpus=gpus,
        http_client=http_client, workers=workers,
    )  # fmt: skip
    from rich.console import Console

    from ttsbuild.bench.report import new_progress, run_table, track
    from ttsbuild.bench.runner import RunProgress, plan, run_benchmark, write_outputs

    console = Console(stderr=True)
    counters = RunProgress(planned=len(plan(settings, prompts)))
    with new_progress(console) as progress, track(progress, f"{settings.rate:g} req/s", counters):
        result = run_benchmark(settings, prompts, counters)
    paths = write_outputs(output, result)
    title = f"{settings.target.url} at {settings.rate:g} req/s"
    _wide_console().print(run_table(result.summary, title))
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}")


@app.command()
def sweep(
    url: Url,
    output: Output,
    rps: Annotated[
        str, typer.Option(help="Comma-separated rates, one run each.")
    ] = "1,4,8,10,12,16,20",
    duration: Duration = "60s",
    warmup: Warmup = "10s",
    seed: Seed = 0,
    dataset: Dataset = "harvard",
    voice: Voice = ["default"],  # noqa: B006
    model: Model = "qwen3-tts",
    language: Language = None,
    mode: ModeOpt = "http",
    arrival: Arrival = "poisson",
    word_interval: WordInterval = "10ms",
    field: Field = None,
    header: Header = None,
    target_config: TargetConfig = None,
    body_format: BodyFormatOpt = None,
    sample_rate: SampleRate = None,
    request_timeout: RequestTimeout = "60s",
    stall_timeout: StallTimeout = "10s",
    max_connections: MaxConnections = 1024,
    gpu_hour_usd: GpuHourUsd = None,
    gpus: Gpus = 1,
    http_client: HttpClientOpt = "aiohttp",
    workers: Workers = 1,
    slo_ttfa_p95: Annotated[
        str, typer.Option(help="Capacity = the highest rate with p95 audible TTFA within this, "
                          "no underrun and no failed, refused or timed-out request.")
    ] = "100ms",
    metrics_url: Annotated[
        str | None,
        typer.Option(help="The server's Prometheus endpoint, scraped before the sweep and after "
                     "each rate (DIR/server_metrics_start.txt, DIR/rps-R/server_metrics.txt); "
                     "'auto': /metrics on the --url host."),
    ] = None,
) -> None:
    """One run per rate; a latency-vs-rate table with the capacity, sweep.json and PNG plots."""
    from ttsbuild.bench.units import parse_duration, parse_rate_list

    _check_output(output)
    rates = _parse("--rps", parse_rate_list, rps)
    slo_s = _parse("--slo-ttfa-p95", parse_duration, slo_ttfa_p95)
    settings, prompts = _settings(
        url=url, rate=rates[0], duration=duration, warmup=warmup,
        seed=seed, dataset=dataset, voice=voice, model=model, language=language, mode=mode,
        arrival=arrival, word_interval=word_interval, field=field, header=header,
        target_config=target_config, body_format=body_format, sample_rate=sample_rate,
        request_timeout=request_timeout, stall_timeout=stall_timeout,
        max_connections=max_connections, gpu_hour_usd=gpu_hour_usd, gpus=gpus,
        http_client=http_client, workers=workers,
    )  # fmt: skip
    from ttsbuild.bench.sweep import METRICS_START_FILE, ServiceLevel, run_sweep, scrape
    from ttsbuild.bench.target import metrics_endpoint

    scrape_url = None
    if metrics_url is not None:
        scrape_url = _parse("--metrics-url", metrics_endpoint, metrics_url, settings.target.url)
        baseline = _parse("--metrics-url", scrape, scrape_url)  # a wrong URL fails before runs
    output.mkdir(parents=True, exist_ok=True)
    if scrape_url is not None:
        (output / METRICS_START_FILE).write_text(baseline)
    run_sweep(settings, rates, prompts, output, _wide_console(), ServiceLevel(slo_s), scrape_url)


@app.command()
def selftest(
    rps: Annotated[str, typer.Option(help="Offered load, requests/second.")] = "50",
    duration: Duration = "3s",
    warmup: Warmup = "1s",
    seed: Seed = 0,
    mode: ModeOpt = "http",
    max_p99_lag_ms: Annotated[
        float | None, typer.Option(help="Exit 1 if dispatch-lag p99 exceeds this.")
    ] = None,
) -> None:
    """Measure the harness itself: run against a local fake server (its own process) that
    answers instantly with 0.1 s of audio; report dispatch lag (actual - scheduled send)."""
    from ttsbuild.bench.target import Mode
    from ttsbuild.bench.units import parse_duration, parse_rate

    rate = _parse("--rps", parse_rate, rps)
    duration_s = _parse("--duration", parse_duration, duration)
    warmup_s = _parse("--warmup", parse_duration, warmup, allow_zero=True)
    mode_value = _choice("--mode", Mode, mode)
    from rich.console import Console

    from ttsbuild.bench.report import run_table
    from ttsbuild.bench.selftest import lag_line, run_selftest

    result = run_selftest(rate, duration_s, warmup_s, mode_value, seed)
    console = Console()
    console.print(run_table(result.summary, f"selftest: instant fake server at {rate:g} req/s"))
    console.print(lag_line(result))
    lag = result.summary["timings"]["dispatch_lag_s"]
    requests = result.summary["requests"]
    if requests["completed"] != requests["sent"]:
        console.print("[red]some requests against the instant server did not complete[/red]")
        raise typer.Exit(1)
    if max_p99_lag_ms is not None and lag["p99"] * 1e3 > max_p99_lag_ms:
        console.print(f"[red]dispatch-lag p99 is over {max_p99_lag_ms:g} ms[/red]")
        raise typer.Exit(1)


@app.command()
def engine(
    path: Annotated[
        Path | None,
        typer.Argument(help="Checkpoint or compiled engine dir (omit with --random)."),
    ] = None,
    random: Annotated[
        str | None,
        typer.Option(help="Benchmark in-memory random weights of a variant instead of PATH, "
                     "e.g. 1.7b-customvoice."),
    ] = None,
    batches: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,8,32,64",
    precisions: Annotated[str, typer.Option(help="bf16,fp8 side by side.")] = "bf16,fp8",
    iters: Annotated[int, typer.Option(min=3, help="Graph replays per measurement.")] = 50,
    output: Annotated[Path | None, typer.Option(help="Directory for engine_bench.json.")] = None,
    compare_guards: Annotated[
        bool,
        typer.Option(help="Instead: time the frame and codec graphs with the stopping guards "
                     "off and on, side by side (guard_bench.json)."),
    ] = False,
) -> None:
    """Microbenchmark an engine on the GPU: prefill, per-frame time split into talker, code
    predictor and codec per batch size, first-chunk latency, weight-read bandwidth."""
    if (path is None) == (random is None):
        raise _bad("PATH/--random", "give exactly one of PATH or --random VARIANT")
    batch_list = _parse("--batches", lambda s: tuple(int(b) for b in s.split(",")), batches)
    if not batch_list or min(batch_list) < 1:
        raise _bad("--batches", "batch sizes must be positive integers")
    precision_list = tuple(p.strip() for p in precisions.split(","))
    if not set(precision_list) <= {"bf16", "fp8"}:
        raise _bad("--precisions", "choose from bf16, fp8")
    import torch

    if not torch.cuda.is_available():
        typer.echo("error: the engine microbenchmark needs a CUDA GPU", err=True)
        raise typer.Exit(1)
    from ttsbuild.bench.engine_bench import run_engine_bench, run_guard_bench

    plan = None
    if random is not None:
        from ttsbuild.runtime.engine import random_models

        models = random_models(random, device="cuda")
    else:
        from ttsbuild.runtime.artifact import load_models
        from ttsbuild.runtime.plan import EnginePlan

        models = load_models(path, device="cuda", decoder_layers=False)
        plan = EnginePlan.model_validate(models.manifest["plan"])
    if compare_guards:
        run_guard_bench(models, precision_list, batch_list, iters, output)
    else:
        run_engine_bench(models, precision_list, batch_list, iters, output, plan=plan)
