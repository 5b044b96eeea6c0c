"""Where and when a sweep's playback underruns happened, from the client's records
(`rps-R/requests.jsonl` or `.jsonl.gz` of `ttsbuild bench`): per rate, the requests with an
underrun and the playback time of their first one (0.08 s: the second chunk of a ramp that
starts with one-frame chunks), the gap between a stream's first two chunks (p50 / p95 / p99 /
max: what a zero-buffer client must beat, 80 ms after a one-frame first chunk), and the
underrun requests grouped by when they were sent: many in one short window point at a stall
that held every stream (a collector pause, a burst of arrivals), a spread at a steady
shortfall; and the share of requests that underran by how many others were sent within
+-30 ms of each (8+ pooled): at a steady rate that count is Poisson around 2 x 0.03 x rate,
and a share growing with it says local bursts of arrivals, not the mean load alone, make
streams late.

    python benchmarks/serve/underruns.py DIR/rps-60 DIR/rps-70 [--window 0.5]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter
from pathlib import Path

from ttsbuild.bench.metrics import nearest_rank


def load(run: Path) -> list[dict]:
    """The measured (not warm-up) records of a run directory."""
    path = run / "requests.jsonl"
    if not path.exists():
        path = run / "requests.jsonl.gz"
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [r for r in map(json.loads, f) if not r.get("warmup")]


def clusters(times: list[float], window: float) -> list[tuple[float, int]]:
    """(first send time, count) of runs of sorted times each within `window` of the last."""
    out: list[tuple[float, int]] = []
    last = None
    for t in sorted(times):
        if last is not None and t - last <= window:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((t, 1))
        last = t
    return out


NEIGHBOUR_WINDOW_S = 0.03
NEIGHBOUR_POOL = 8  # this many others or more: one group


def by_neighbours(records: list[dict]) -> dict[int, tuple[int, int]]:
    """Others sent within NEIGHBOUR_WINDOW_S of each record (NEIGHBOUR_POOL: that many or
    more) -> (records, of which with an underrun)."""
    sent = sorted(r["scheduled_s"] for r in records)
    out: dict[int, tuple[int, int]] = {}
    for r in records:
        t = r["scheduled_s"]
        n = (bisect.bisect_right(sent, t + NEIGHBOUR_WINDOW_S)
             - bisect.bisect_left(sent, t - NEIGHBOUR_WINDOW_S) - 1)  # fmt: skip
        k = min(n, NEIGHBOUR_POOL)
        total, late = out.get(k, (0, 0))
        out[k] = (total + 1, late + bool(r.get("underruns")))
    return dict(sorted(out.items()))


def report(run: Path, window: float) -> str:
    records = [r for r in load(run) if r.get("outcome") == "ok"]
    late = [r for r in records if r.get("underruns")]
    where = Counter(round(r["underrun_at_s"][0], 2) for r in late if r.get("underrun_at_s"))
    gaps = [1e3 * (a[1] - a[0]) for r in records if len(a := r.get("audio_arrival_s") or []) > 1]
    groups = clusters([r["scheduled_s"] for r in late], window)
    big = sorted(groups, key=lambda g: -g[1])[:3]
    return "\n".join([
        f"{run.name}: {len(late)} of {len(records)} completed requests underran; first underrun "
        f"at playback s: {dict(sorted(where.items())) or '-'}",
        "  first -> second chunk gap ms: " + " ".join(
            f"{name} {nearest_rank(gaps, p) if gaps else float('nan'):.1f}"
            for name, p in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))),
        f"  underrun requests in {len(groups)} groups sent within {window:g} s of each other; "
        f"largest: " + (", ".join(f"{n} from {t:.2f} s" for t, n in big) or "-"),
        f"  underrun requests by others sent within {NEIGHBOUR_WINDOW_S * 1e3:g} ms: " + ", ".join(
            f"{k}{'+' if k == NEIGHBOUR_POOL else ''}: {n_late} of {total}"
            for k, (total, n_late) in by_neighbours(records).items()),
    ])  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (rps-R)")
    p.add_argument("--window", type=float, default=0.5, help="seconds between sends in a group")
    args = p.parse_args(argv)
    for run in args.runs:
        print(report(run, args.window))


if __name__ == "__main__":
    main()
