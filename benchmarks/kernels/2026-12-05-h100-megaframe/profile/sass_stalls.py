"""Stall samples of an ncu source export (`ncu -i REP --page source --csv --print-source sass`,
gzipped or not): the totals by reason, then the instructions with the most samples.

    python3 sass_stalls.py mf_served_sass.csv.gz [TOP]
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys

ALL = "Warp Stall Sampling (All Samples)"


def main() -> int:
    path, top_n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    ix = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    totals: collections.Counter[str] = collections.Counter()
    samples = 0
    for r in data:
        samples += int(r[ix[ALL]] or 0)
        for h in reasons:
            totals[h] += int(r[ix[h]] or 0)
    print(f"{path}: {len(data)} instructions, {samples} samples")
    for h, v in totals.most_common(12):
        print(f"  {h:28s} {v:8d} {100 * v / samples:5.1f}%")
    order = sorted(range(len(data)), key=lambda i: -int(data[i][ix[ALL]] or 0))[:top_n]
    for i in order:
        r = data[i]
        s = int(r[ix[ALL]] or 0)
        why = sorted(((int(r[ix[h]] or 0), h) for h in reasons), reverse=True)[:3]
        executed = r[ix["Instructions Executed"]]
        print(f"{i:6d} {s:7d} {100 * s / samples:5.1f}% executed {executed:>8s}"
              f" {r[1].strip()[:60]:60s} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
