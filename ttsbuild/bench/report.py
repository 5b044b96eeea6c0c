"""Terminal tables (rich) for one run and for a sweep, plus a live progress display."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ttsbuild.bench.runner import RunProgress

_POLL_S = 0.25  # progress refresh: often enough to look live, rare enough to cost nothing

# (summary timing key, column label, scale to display units)
_RUN_TIMINGS = (
    ("ttfa_s", "audible TTFA (ms)", 1e3),
    ("first_playable_s", "first playable (ms)", 1e3),
    ("ttfb_s", "first byte (ms)", 1e3),
    ("headers_s", "response headers (ms)", 1e3),
    ("leading_silence_s", "leading silence (ms)", 1e3),
    ("e2e_s", "end to end (ms)", 1e3),
    ("rtf", "real-time factor", 1.0),
    ("stall_s", "stall per request (ms)", 1e3),
    ("text_done_to_audio_s", "last word -> audio (ms)", 1e3),
    ("dispatch_lag_s", "dispatch lag (ms)", 1e3),
    ("rejected_s", "refusal 429/503 (ms)", 1e3),
)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def run_table(summary: dict[str, Any], title: str) -> Table:
    """p50/p95/p99 of each timing, then counts, underruns, throughput and cost."""
    table = Table(title=title, title_justify="left")
    table.add_column("metric", no_wrap=True)
    for column in ("p50", "p95", "p99", "max", "n"):
        table.add_column(column, justify="right")
    for key, label, scale in _RUN_TIMINGS:
        stats = summary["timings"].get(key)  # (summaries written before rejected_s lack it)
        if not stats or stats["count"] == 0:
            continue
        digits = 3 if scale == 1.0 else 1
        cells = [_fmt(stats[k], scale, digits) for k in ("p50", "p95", "p99", "max")]
        table.add_row(label, *cells, str(stats["count"]))
    requests, underruns = summary["requests"], summary["underruns"]
    throughput, cost = summary["throughput"], summary["cost"]
    table.add_section()
    table.add_row(
        "requests",
        f"sent {requests['sent']}",
        f"ok {requests['completed']}",
        f"failed {requests['failed']}",
        f"rejected {requests['rejected']}",
        f"timeout {requests['timed_out']}",
    )
    table.add_row(
        "underruns",
        f"total {underruns['total']}",
        f"requests {underruns['requests_with_underrun']}",
        f"rate {_fmt(underruns['rate'], 100)}%",
        # (summaries written before 2026-12-04 lack it)
        f"{underruns.get('beside_harness_stall', '-')} beside a harness stall",
        "",
    )
    table.add_row(
        "throughput",
        f"{throughput['chars_per_s']:.1f} chars/s",
        f"{throughput['audio_s_per_s']:.2f} audio s/s",
        "",
        "",
        "",
    )
    if cost is not None:
        table.add_row("cost", f"${_fmt(cost['usd_per_1m_chars'], 1, 2)} / 1M chars", "", "", "", "")
    harness = summary.get("harness")  # (summaries written before 2026-12-04 lack it)
    if harness and harness["loop_lag_s"]["count"]:
        # the harness's own pauses: chunks it read late through them look like underruns
        lag = harness["loop_lag_s"]
        stalls = harness.get("stall_count", len(harness["stalls"]))  # (before: the list only)
        table.add_row(
            "harness loop lag (ms)",
            *(_fmt(lag[k], 1e3, 1) for k in ("p50", "p95", "p99", "max")),
            f"{stalls} over {harness['stalls_over_s'] * 1e3:g} ms",
        )
    return table


def sweep_row(rate: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers a latency-vs-rate comparison needs, flat (also written to sweep.json)."""
    ttfa = summary["timings"]["ttfa_s"]
    requests = summary["requests"]
    cost = summary["cost"]
    return {
        "rps": rate,
        "sent": requests["sent"],
        "completed": requests["completed"],
        "failed": requests["failed"],
        "rejected": requests["rejected"],
        "timed_out": requests["timed_out"],
        "ttfa_p50_s": ttfa["p50"],
        "ttfa_p95_s": ttfa["p95"],
        "ttfa_p99_s": ttfa["p99"],
        "rejected_p95_s": summary["timings"].get("rejected_s", {}).get("p95"),
        "underrun_rate": summary["underruns"]["rate"],
        "rtf_p50": summary["timings"]["rtf"]["p50"],
        "dispatch_lag_p99_s": summary["timings"]["dispatch_lag_s"]["p99"],
        "chars_per_s": summary["throughput"]["chars_per_s"],
        "audio_s_per_s": summary["throughput"]["audio_s_per_s"],
        "usd_per_1m_chars": cost["usd_per_1m_chars"] if cost else None,
        # the harness's own longest pause (its loop late): an underrun beside one is suspect
        "harness_lag_max_s": (summary.get("harness") or {}).get("loop_lag_s", {}).get("max"),
    }


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="latency vs offered rate", title_justify="left")
    columns = (
        "RPS", "ok/sent", "rej", "rej p95 ms", "fail", "t/o", "TTFA p50 ms", "p95 ms", "p99 ms",
        "underrun %", "RTF p50", "chars/s", "audio s/s", "$/1M chars", "harness lag max ms",
        "SLO",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['rps']:g}",
            f"{row['completed']}/{row['sent']}",
            str(row["rejected"]),
            _fmt(row.get("rejected_p95_s"), 1e3),
            str(row["failed"]),
            str(row["timed_out"]),
            _fmt(row["ttfa_p50_s"], 1e3),
            _fmt(row["ttfa_p95_s"], 1e3),
            _fmt(row["ttfa_p99_s"], 1e3),
            _fmt(row["underrun_rate"], 100),
            _fmt(row["rtf_p50"], 1, 3),
            f"{row['chars_per_s']:.1f}",
            f"{row['audio_s_per_s']:.2f}",
            _fmt(row["usd_per_1m_chars"], 1, 2),
            _fmt(row.get("harness_lag_max_s"), 1e3),
            {True: "met", False: "missed"}.get(row.get("meets_slo"), "-"),
        )
    return table


def new_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} done"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


@contextmanager
def track(progress: Progress, description: str, counters: RunProgress) -> Iterator[None]:
    """Mirror `counters` into a progress bar from a side thread, so the benchmark's event loop
    never spends time drawing."""
    task = progress.add_task(description, total=counters.planned, status="")
    stop = threading.Event()

    def refresh() -> None:
        status = f"sent {counters.sent}, not ok {counters.not_ok}"
        progress.update(task, completed=counters.finished, status=status)

    def poll() -> None:
        refresh()
        while not stop.wait(_POLL_S):
            refresh()

    thread = threading.Thread(target=poll, name="bench-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        refresh()
