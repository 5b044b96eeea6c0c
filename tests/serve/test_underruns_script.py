"""benchmarks/serve/underruns.py: underruns by where in playback and by when sent, the gap
between the first two chunks, read from a run's records (plain or gzipped)."""

from __future__ import annotations

import gzip
import json
import random

from helpers_scripts import script_fixture

underruns = script_fixture("benchmarks/serve/underruns.py")


def record(sent: float, gap: float, late: bool, warmup: bool = False) -> dict:
    first = 0.01 + random.random() * 0.02
    return {"warmup": warmup, "outcome": "ok", "scheduled_s": sent,
            "underruns": int(late), "underrun_at_s": [0.08] if late else [],
            "audio_arrival_s": [first, first + gap, first + gap + 0.05]}  # fmt: skip


def test_reports_underruns_gaps_and_groups(underruns, tmp_path):
    gaps = [random.uniform(0.01, 0.05) for _ in range(97)]
    records = [record(1.0 + i * 0.1, g, False) for i, g in enumerate(gaps)]
    late = [record(t, 0.09, True) for t in (5.0, 5.2, 5.3, 9.0)]  # a group of three, one alone
    records += late + [record(0.0, 0.5, True, warmup=True)]  # warm-up: left out
    run = tmp_path / "rps-60"
    run.mkdir()
    with gzip.open(run / "requests.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    text = underruns.report(run, window=0.5)
    assert "4 of 101 completed requests underran" in text
    assert "{0.08: 4}" in text
    assert "2 groups" in text and "3 from 5.00 s" in text and "1 from 9.00 s" in text
    all_gaps = sorted(1e3 * g for g in [*gaps, 0.09, 0.09, 0.09, 0.09])
    assert f"max {all_gaps[-1]:.1f}" in text
    assert f"p50 {all_gaps[50]:.1f}" in text  # nearest ranks of 101: 51st, 100th
    assert f"p99 {all_gaps[99]:.1f}" in text



def test_underruns_are_grouped_by_neighbours_sent_close_by(underruns, tmp_path):
    base = random.uniform(0, 5)
    lone = [record(base + i, 0.02, False) for i in range(1, 4)]  # a second apart: no others
    burst = [record(base + 10 + 0.002 * i, 0.09, i % 2 == 0) for i in range(10)]  # 9 others
    pair = [record(base + 20, 0.02, True), record(base + 20.02, 0.02, False)]  # one other
    groups = underruns.by_neighbours(lone + burst + pair)
    assert groups == {0: (3, 0), 1: (2, 1), underruns.NEIGHBOUR_POOL: (10, 5)}
    run = tmp_path / "rps-70"
    run.mkdir()
    late_warmup = record(base + 30, 0.5, True, warmup=True)  # left out by the report
    with gzip.open(run / "requests.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in lone + burst + pair + [late_warmup])
    assert "within 30 ms: 0: 0 of 3, 1: 1 of 2, 8+: 5 of 10" in underruns.report(run, 0.5)
