"""Where time to first audio goes, from `ttsbuild serve`'s /metrics saved after each rate of
a sweep (`rps-R/server_metrics.txt`): the histogram `tts_time_to_first_audio_seconds` and its
phases `tts_first_audio_phase_seconds{phase}` (admit: arrival -> admission launched; frame:
-> first frame step launched; codec: -> first codec step launched; read: -> audio handed
over); then what the engine thread and the event loop spent their time on, where the
server has those metrics: `tts_http_phase_seconds{phase}` (the event loop's share:
receive, resolve, admitted, handoff, send), `tts_engine_host_seconds{part}`,
`tts_event_loop_lag_seconds`, `tts_gc_pause_seconds{generation}`,
`tts_codec_launches_per_step`, and a stream's second chunk: `tts_second_chunk_gap_seconds`
(first chunk handed over -> second) and its phases `tts_second_chunk_phase_seconds{phase}`
(frames read back, codec step launched, audio handed over). The metrics are
cumulative per server: give the files of one server in the order of its rates, and each
rate is shown as the difference from the one before (the first from `--start FILE`, the
metrics saved before the first rate, if given).
Quantiles are the upper edges of the histogram buckets that hold them.

    python benchmarks/serve/first_audio_phases.py [--start DIR/server_metrics_start.txt] \
        DIR/rps-20/server_metrics.txt DIR/rps-40/...
"""

from __future__ import annotations

import re
import sys

from ttsbuild.serve.metrics import ENGINE_HOST_PARTS as HOST_PARTS
from ttsbuild.serve.metrics import HTTP_PHASES
from ttsbuild.serve.scheduler import FIRST_AUDIO_PHASES as PHASES
from ttsbuild.serve.scheduler import SECOND_CHUNK_PHASES as SECOND_PHASES

QUANTILES = (0.5, 0.9, 0.95, 0.99)


def load(path: str) -> dict[str, float]:
    samples = {}
    for line in open(path):
        m = re.match(r"(\S+?)(\{[^}]*\})? ([-\d.e+]+|[+-]Inf|NaN)$", line.strip())
        if m and not line.startswith("#"):
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def summary(now: dict, before: dict, name: str, label: str = "") -> tuple[int, float, list]:
    """(count, mean ms, bucket upper edges in ms holding each quantile) since `before`."""
    buckets = []
    for key, value in now.items():
        if key.startswith(name + "_bucket{") and label in key:
            le = re.search(r'le="([^"]+)"', key).group(1)
            edge = float("inf") if le == "+Inf" else float(le)
            buckets.append((edge, value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    sum_key = f"{name}_sum" + (f"{{{label}}}" if label else "")
    mean = (now.get(sum_key, 0) - before.get(sum_key, 0)) / total * 1e3 if total else 0.0
    if not total:
        return 0, mean, []
    edges = [next(e * 1e3 for e, c in buckets if c >= q * total) for q in QUANTILES]
    return int(total), mean, edges


def main(paths: list[str]) -> None:
    before: dict[str, float] = {}
    if paths[:1] == ["--start"]:
        before, paths = load(paths[1]), paths[2:]
    for path in paths:
        now = load(path)
        n, mean, edges = summary(now, before, "tts_time_to_first_audio_seconds")
        print(f"{path}: {n} first chunks, mean {mean:.2f} ms, p50/p90/p95/p99 <= {edges} ms")
        for phase in PHASES:
            _, mean, edges = summary(now, before, "tts_first_audio_phase_seconds",
                                     f'phase="{phase}"')  # fmt: skip
            print(f"  {phase:6s} mean {mean:6.2f} ms, p50/p90/p95/p99 <= {edges} ms")
        n, mean, edges = summary(now, before, "tts_second_chunk_gap_seconds")
        if n:  # servers since 2026-12-02 21:50
            print(f"  second chunk: n {n}, gap mean {mean:.2f} ms, p50/p90/p95/p99 <= {edges} ms")
            for phase in SECOND_PHASES:
                _, mean, edges = summary(now, before, "tts_second_chunk_phase_seconds",
                                         f'phase="{phase}"')  # fmt: skip
                print(f"    {phase:6s} mean {mean:6.2f} ms, p50/p90/p95/p99 <= {edges} ms")
        rows = [("http " + phase, "tts_http_phase_seconds", f'phase="{phase}"')
                for phase in HTTP_PHASES]  # fmt: skip
        rows += [("engine " + part, "tts_engine_host_seconds", f'part="{part}"')
                 for part in HOST_PARTS]  # fmt: skip
        rows += [("event-loop lag", "tts_event_loop_lag_seconds", "")]
        rows += [(f"gc gen {g}", "tts_gc_pause_seconds", f'generation="{g}"') for g in "012"]
        for title, name, label in rows:
            n, mean, edges = summary(now, before, name, label)
            if n:
                print(f"  {title:22s} n {n:7d}, mean {mean:6.3f} ms, p50/p90/p95/p99 <= "
                      f"{edges} ms, total {n * mean / 1e3:.2f} s")  # fmt: skip
        n, mean, edges = summary(now, before, "tts_codec_launches_per_step")
        if n:  # a count, not seconds: summary's ms scale undone
            print(f"  codec launches per step n {n:7d}, mean {mean / 1e3:.2f}, "
                  f"p50/p90/p95/p99 <= {[e / 1e3 for e in edges]}")  # fmt: skip
        before = now


if __name__ == "__main__":
    main(sys.argv[1:])
