"""One run per offered rate, then a latency-vs-rate table, the capacity and plots.

Capacity is the highest offered rate that meets the service level: p95 audible TTFA within
the bound, no playback underrun, and no request that failed, was refused or timed out. It is
a rate the sweep measured, not an interpolation, so it is only as fine as the rates given.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from ttsbuild.bench.report import new_progress, sweep_row, sweep_table, track
from ttsbuild.bench.runner import RunProgress, RunSettings, plan, run_benchmark, write_outputs

MIN_CAPACITY_DURATION_S = 60.0  # shorter runs per rate can miss a slow queue build-up
METRICS_FILE = "server_metrics.txt"  # in each rate's directory, scraped after its run
METRICS_START_FILE = "server_metrics_start.txt"  # in the sweep directory, before the first


@dataclasses.dataclass(frozen=True)
class ServiceLevel:
    ttfa_p95_s: float = 0.1  # audible time to first audio, 95th percentile

    def met_by(self, row: dict[str, Any]) -> bool:
        not_ok = row["failed"] + row["rejected"] + row["timed_out"]
        return (
            row["completed"] > 0
            and not_ok == 0
            and row["ttfa_p95_s"] is not None
            and row["ttfa_p95_s"] <= self.ttfa_p95_s
            and row["underrun_rate"] == 0
        )


def capacity(rows: list[dict[str, Any]], slo: ServiceLevel) -> dict[str, Any] | None:
    """The row of the highest rate that meets `slo`; None when no rate does."""
    meeting = [row for row in rows if slo.met_by(row)]
    return max(meeting, key=lambda row: row["rps"]) if meeting else None


def rate_dir(out_dir: Path, rate: float) -> Path:
    return out_dir / f"rps-{rate:g}"


def scrape(metrics_url: str) -> str:
    """The server's Prometheus text; raises ValueError with a one-line reason."""
    import httpx

    try:
        response = httpx.get(metrics_url, timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError as err:
        raise ValueError(f"cannot scrape {metrics_url}: {err}") from None
    return response.text


def run_sweep(
    base: RunSettings,
    rates: list[float],
    prompts: list[str],
    out_dir: Path,
    console: Console,
    slo: ServiceLevel = ServiceLevel(),
    metrics_url: str | None = None,
) -> dict[str, Any]:
    """Run each rate in turn (same seed, so the same prompt order at every rate), write each
    run's files under DIR/rps-R/ (with the server's metrics scraped right after the run when
    `metrics_url` is given), then sweep.json, the table with the capacity, and the plots."""
    rows = []
    with new_progress(console) as progress:
        for rate in rates:
            settings = dataclasses.replace(base, rate=rate)
            counters = RunProgress(planned=len(plan(settings, prompts)))
            with track(progress, f"{rate:g} req/s", counters):
                result = run_benchmark(settings, prompts, counters)
            write_outputs(rate_dir(out_dir, rate), result)
            if metrics_url is not None:
                _save_metrics(metrics_url, rate_dir(out_dir, rate) / METRICS_FILE, console)
            row = sweep_row(rate, result.summary)
            rows.append({**row, "meets_slo": slo.met_by(row)})
    best = capacity(rows, slo)
    sweep = {
        "slo": {**dataclasses.asdict(slo), "underruns": 0, "failures": 0},
        "duration_s": base.duration_s,
        "dataset": base.dataset,
        "capacity_rps": best["rps"] if best else None,
        "capacity_audio_s_per_s": best["audio_s_per_s"] if best else None,
        "rows": rows,
    }
    (out_dir / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    console.print(sweep_table(rows))
    console.print(capacity_line(sweep))
    if base.duration_s < MIN_CAPACITY_DURATION_S:
        console.print(
            f"[yellow]note: {base.duration_s:g} s per rate; a capacity figure needs "
            f">= {MIN_CAPACITY_DURATION_S:g} s per rate[/yellow]"
        )
    for path in plot_sweep(rows, out_dir):
        console.print(f"wrote {path}")
    return sweep


def capacity_line(sweep: dict[str, Any]) -> str:
    slo = f"p95 audible TTFA <= {1e3 * sweep['slo']['ttfa_p95_s']:g} ms, 0 underruns, 0 failures"
    if sweep["capacity_rps"] is None:
        return f"capacity: no rate met the service level ({slo})"
    return (
        f"capacity: {sweep['capacity_rps']:g} req/s ({slo}), "
        f"{sweep['capacity_audio_s_per_s']:.2f} audio s/s"
    )


def _save_metrics(metrics_url: str, path: Path, console: Console) -> None:
    """A scrape that fails after a run costs that file only, never the sweep's results."""
    try:
        path.write_text(scrape(metrics_url))
    except ValueError as err:
        console.print(f"[yellow]warning: {err}[/yellow]")


def plot_sweep(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """ttfa_vs_rps.png (p50/p95/p99 audible TTFA) and underrun_rate_vs_rps.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    rates = [row["rps"] for row in rows]

    def ms(key: str) -> list[float]:
        return [float("nan") if row[key] is None else row[key] * 1e3 for row in rows]

    ttfa_path = out_dir / "ttfa_vs_rps.png"
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for key, label in (("ttfa_p50_s", "p50"), ("ttfa_p95_s", "p95"), ("ttfa_p99_s", "p99")):
        ax.plot(rates, ms(key), marker="o", label=label)
    ax.set(xlabel="offered load (requests/s)", ylabel="audible TTFA (ms)")
    ax.set_title("Audible time to first audio vs rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ttfa_path)
    plt.close(fig)

    underrun_path = out_dir / "underrun_rate_vs_rps.png"
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    rates_pct = [
        float("nan") if r["underrun_rate"] is None else 100 * r["underrun_rate"] for r in rows
    ]
    ax.plot(rates, rates_pct, marker="o", color="tab:red")
    ax.set(xlabel="offered load (requests/s)", ylabel="requests with >= 1 underrun (%)")
    ax.set_title("Playback underrun rate vs rate")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(underrun_path)
    plt.close(fig)
    return [ttfa_path, underrun_path]
