"""One run per offered rate, then a latency-vs-rate table and plots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from ttsbuild.bench.report import new_progress, sweep_row, sweep_table, track
from ttsbuild.bench.runner import RunProgress, RunSettings, plan, run_benchmark, write_outputs


def rate_dir(out_dir: Path, rate: float) -> Path:
    return out_dir / f"rps-{rate:g}"


def run_sweep(
    base: RunSettings, rates: list[float], prompts: list[str], out_dir: Path, console: Console
) -> list[dict[str, Any]]:
    """Run each rate in turn (same seed, so the same prompt order at every rate), write each
    run's files under DIR/rps-R/, then sweep.json, the table and the plots."""
    rows = []
    with new_progress(console) as progress:
        for rate in rates:
            settings = dataclasses.replace(base, rate=rate)
            counters = RunProgress(planned=len(plan(settings, prompts)))
            with track(progress, f"{rate:g} req/s", counters):
                result = run_benchmark(settings, prompts, counters)
            write_outputs(rate_dir(out_dir, rate), result)
            rows.append(sweep_row(rate, result.summary))
    (out_dir / "sweep.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    console.print(sweep_table(rows))
    for path in plot_sweep(rows, out_dir):
        console.print(f"wrote {path}")
    return rows


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
