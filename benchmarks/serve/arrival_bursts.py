"""Underruns by how many other requests were sent close by: per run directory (requests.jsonl.gz
from `ttsbuild bench`), the share of completed requests with an underrun, grouped by the
number of other requests sent within +-30 ms of each (8+ pooled). At a steady rate the count
is Poisson around 2 x 0.03 x rate; a share that grows with it says local bursts of arrivals,
not the mean load alone, make streams late.

    python benchmarks/serve/arrival_bursts.py DIR [DIR ...]
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from pathlib import Path

WINDOW_S = 0.03
POOL = 8  # this many others or more: one group


def by_neighbours(records: list[dict]) -> dict[int, tuple[int, int]]:
    """Neighbours within WINDOW_S (POOL: that many or more) -> (requests, with an underrun),
    over the measured, completed requests."""
    rows = [r for r in records if not r.get("warmup") and r["outcome"] == "ok"]
    sent = sorted(r["scheduled_s"] for r in rows)
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        t = r["scheduled_s"]
        n = bisect.bisect_right(sent, t + WINDOW_S) - bisect.bisect_left(sent, t - WINDOW_S) - 1
        k = min(n, POOL)
        total, late = out.get(k, (0, 0))
        out[k] = (total + 1, late + bool(r["underruns"]))
    return dict(sorted(out.items()))


def main(argv: list[str]) -> None:
    for path in argv:
        with gzip.open(Path(path) / "requests.jsonl.gz", "rt") as f:
            groups = by_neighbours([json.loads(line) for line in f])
        print(f"{path}: underrun requests by others sent within {WINDOW_S * 1e3:g} ms")
        for k, (total, late) in groups.items():
            label = f"{k}+" if k == POOL else str(k)
            print(f"  {label:>3}: {late:4d} of {total:5d} ({100 * late / total:.1f} %)")


if __name__ == "__main__":
    main(sys.argv[1:])
