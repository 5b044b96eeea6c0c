"""`ttsbuild bench run | sweep`: flag validation, result files, sweep table and plots."""

import json

import pytest
from typer.testing import CliRunner

from ttsbuild.bench.cli import app
from ttsbuild.bench.fakeserver import FakeSpeechServer, Reply, silence, tone
from ttsbuild.bench.units import parse_duration, parse_key_value, parse_rate_list

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def short_speech(_request):
    return Reply(chunks=[(0.0, silence(0.05)), (0.01, tone(0.2))])


def roomy_speech(_request):
    # audible at once, 0.3 s buffered before the next chunk is due 10 ms later: only a stall
    # of ~0.3 s (not a busy 2-core CI machine's event loop) can make the listener underrun
    return Reply(chunks=[(0.0, tone(0.3)), (0.01, tone(0.2))])


@pytest.fixture(scope="module")
def server():
    with FakeSpeechServer(short_speech) as running:
        yield running


@pytest.fixture(scope="module")
def roomy_server():
    with FakeSpeechServer(roomy_speech) as running:
        yield running


def invoke(*args):
    # wide enough that rich never wraps a message we look for
    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_duration_rate_and_field_parsing():
    assert parse_duration("500ms") == 0.5
    assert parse_duration("60s") == 60.0
    assert parse_duration("2m") == 120.0
    assert parse_duration("1.5") == 1.5
    assert parse_duration("0s", allow_zero=True) == 0.0
    for bad in ("60x", "", "-1s", "s", "1 m s"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="greater than zero"):
        parse_duration("0ms")
    assert parse_rate_list("1, 4,8.5") == [1.0, 4.0, 8.5]
    for bad in ("1,,4", "1,0", "a", "2,2", "inf"):
        with pytest.raises(ValueError):
            parse_rate_list(bad)
    assert parse_key_value("speed=1.5", json_values=True) == ("speed", 1.5)
    assert parse_key_value("stream=false", json_values=True) == ("stream", False)
    assert parse_key_value("format=pcm", json_values=True) == ("format", "pcm")
    assert parse_key_value('extra={"a": [1]}', json_values=True) == ("extra", {"a": [1]})
    assert parse_key_value("x-n=1", json_values=False) == ("x-n", "1")
    with pytest.raises(ValueError, match="key=value"):
        parse_key_value("novalue", json_values=True)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rps", "0"], "--rps"),
        (["--rps", "fast"], "--rps"),
        (["--duration", "60x"], "--duration"),
        (["--warmup", "2 minutes"], "--warmup"),
        (["--dataset", "/nonexistent/prompts.txt"], "does not exist"),
        (["--dataset", "EMPTY"], "no prompts"),
        (["--mode", "grpc"], "--mode"),
        (["--http-client", "curl"], "--http-client"),
        (["--arrival", "bursty"], "--arrival"),
        (["--field", "nokey"], "--field"),
        (["--body-format", "mp3"], "--body-format"),
        (["--url", "localhost:8000"], "--url"),
        (["--target-config", "/nonexistent.json"], "does not exist"),
        (["--workers", "0"], "--workers"),
    ],
)
def test_bad_flags_fail_cleanly_without_output(tmp_path, flags, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    flags = [str(empty) if f == "EMPTY" else f for f in flags]
    out = tmp_path / "out"
    args = ["run", "--url", "http://127.0.0.1:9", "--output", out, *flags]
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_bad_sweep_rates_fail_cleanly(tmp_path):
    result = invoke(
        "sweep", "--url", "http://127.0.0.1:9", "--output", tmp_path / "o", "--rps", "1,x"
    )
    assert result.exit_code == 2 and "--rps" in result.output
    assert not (tmp_path / "o").exists()


def test_run_writes_config_requests_and_summary(server, tmp_path):
    target_config = tmp_path / "target.json"
    target_config.write_text(json.dumps({"extra_fields": {"speed": 1.0}, "headers": {"x-a": "1"}}))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n')
    out = tmp_path / "run"
    result = invoke(
        "run", "--url", server.http_url, "--rps", "10", "--duration", "500ms",
        "--warmup", "200ms", "--arrival", "constant", "--seed", "3", "--dataset", dataset,
        "--target-config", target_config, "--field", "speed=2", "--header", "x-b=2",
        "--gpu-hour-usd", "2.5", "--output", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "audible TTFA" in result.output
    config = json.loads((out / "config.json").read_text())
    settings = config["settings"]
    assert settings["rate"] == 10.0 and settings["seed"] == 3
    assert settings["target"]["extra_fields"] == {"speed": 2}  # the flag overrides the file
    assert settings["target"]["headers"] == {"x-a": "1", "x-b": "2"}
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 7  # constant 10/s over 0.7 s
    assert [line["warmup"] for line in lines] == [True, True] + [False] * 5
    assert all(line["outcome"] == "ok" for line in lines)
    assert {line["text"] for line in lines} == {"alpha beta", "gamma"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["sent"] == 5 and summary["requests"]["completed"] == 5
    assert summary["timings"]["leading_silence_s"]["p50"] == pytest.approx(0.04)  # 20 ms grid
    assert summary["cost"]["usd_per_1m_chars"] > 0
    assert server.request_headers[-1]["x-a"] == "1"


def test_sweep_writes_table_summaries_and_plots(roomy_server, tmp_path):
    out = tmp_path / "sweep"
    result = invoke(
        "sweep", "--url", roomy_server.http_url, "--rps", "2,5", "--duration", "1s",
        "--warmup", "0s", "--output", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "latency vs offered rate" in result.output
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [row["rps"] for row in rows] == [2.0, 5.0]
    assert all(row["completed"] == row["sent"] > 0 for row in rows)
    assert all(row["ttfa_p50_s"] is not None and row["underrun_rate"] == 0 for row in rows)
    for rate in ("2", "5"):
        assert (out / f"rps-{rate}" / "summary.json").is_file()
        assert (out / f"rps-{rate}" / "requests.jsonl").is_file()
    for png in ("ttfa_vs_rps.png", "underrun_rate_vs_rps.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC


def test_sweep_reports_capacity_and_saves_server_metrics_after_each_rate(roomy_server, tmp_path):
    out = tmp_path / "sweep"
    result = invoke(
        "sweep", "--url", roomy_server.http_url, "--rps", "2,5", "--duration", "1s",
        "--warmup", "0s", "--dataset", "voice-agent", "--metrics-url", "auto",
        "--slo-ttfa-p95", "1s", "--output", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["slo"]["ttfa_p95_s"] == 1.0
    # the fake is audible within ~10 ms: a 1 s bound holds even on a loaded CI machine
    assert all(row["meets_slo"] for row in sweep["rows"]), sweep["rows"]
    assert sweep["capacity_rps"] == 5.0
    assert sweep["capacity_audio_s_per_s"] == sweep["rows"][1]["audio_s_per_s"] > 0
    assert "capacity: 5 req/s" in result.output and "audio s/s" in result.output
    assert sweep["dataset"] == "voice-agent (built in)"
    # counters scraped before the sweep and after each rate grow by that rate's requests
    scraped = [
        int((path).read_text().split()[-1])
        for path in (out / "server_metrics_start.txt", out / "rps-2" / "server_metrics.txt",
                     out / "rps-5" / "server_metrics.txt")
    ]  # fmt: skip
    sent = [row["sent"] for row in sweep["rows"]]
    assert scraped[1] - scraped[0] == sent[0] and scraped[2] - scraped[1] == sent[1]


def test_capacity_is_the_highest_rate_meeting_every_condition():
    from ttsbuild.bench.sweep import ServiceLevel, capacity

    def row(rps, p95, underrun=0.0, rejected=0):
        return {"rps": rps, "completed": 10, "failed": 0, "rejected": rejected, "timed_out": 0,
                "ttfa_p95_s": p95, "underrun_rate": underrun}  # fmt: skip

    slo = ServiceLevel(ttfa_p95_s=0.1)
    rows = [row(1, 0.03), row(10, 0.09), row(20, 0.12), row(40, 0.05, underrun=0.01),
            row(60, 0.05, rejected=1)]  # fmt: skip
    assert capacity(rows, slo)["rps"] == 10
    assert capacity([row(1, 0.2)], slo) is None


def test_sweep_with_an_unreachable_metrics_url_fails_before_any_run(server, tmp_path):
    out = tmp_path / "sweep"
    result = invoke(
        "sweep", "--url", server.http_url, "--rps", "2", "--duration", "1s",
        "--metrics-url", "http://127.0.0.1:9/metrics", "--output", out,
    )  # fmt: skip
    assert result.exit_code == 2 and "--metrics-url" in result.output
    assert not out.exists()
