"""The load generator's own pauses under a voice-agent load, against a scripted server (CPU).

A local `FakeSpeechServer` in its own process streams replies of voice-agent length (the
prompt's characters at ~14 per second of audio, chunks of the low-latency ramp 1, 1, 2, 4, 8,
12 frames, one frame every --frame-ms after a first chunk at 2x that), so the harness reads
what it reads from `ttsbuild serve` at the same rate, without a GPU. Prints the run's
`summary["harness"]` (loop lag, collector pauses, pauses of 10 ms or more with their time),
dispatch lag, TTFA and underruns.

    python benchmarks/serve/harness_stalls.py [--rate 100] [--duration 60] [--workers 1]
        [--frame-ms 12] [--no-freeze]

--no-freeze (one worker only): the harness's collector as before 2026-12-04 (nothing frozen
during the run), for the comparison in
benchmarks/serve/2026-12-04-h200-sweep-harness-watch/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from ttsbuild.bench import runner
from ttsbuild.bench.audio import BodyFormat
from ttsbuild.bench.client import Timeouts
from ttsbuild.bench.fakeserver import Reply, serve_in_subprocess, tone
from ttsbuild.bench.schedule import DEFAULT_DATASET, ArrivalProcess, load_prompts
from ttsbuild.bench.target import Mode, Target, endpoint_url

FRAME_BYTES = 1920 * 2  # one 80 ms frame of 24 kHz PCM16
CHARS_PER_S = 14.0  # ~165 words a minute
RAMP = (1, 1, 2, 4, 8, 12)
_TONE = tone(20.0)


def voice_agent_reply(request: dict) -> Reply:
    """The scripted server's reply (module level: it is pickled into the server process)."""
    frame_s = float(request.get("frame_s", 0.012))
    frames = max(4, round(len(request.get("input", "")) / CHARS_PER_S / 0.08))
    chunks, done, i = [], 0, 0
    while done < frames:
        n = min(RAMP[min(i, len(RAMP) - 1)], frames - done)
        delay = frame_s * (2 if i == 0 else n)
        chunks.append((delay, _TONE[done * FRAME_BYTES : (done + n) * FRAME_BYTES]))
        done, i = done + n, i + 1
    return Reply(chunks=chunks, headers={"content-type": "audio/pcm", "x-sample-rate": "24000"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--frame-ms", type=float, default=12.0)
    p.add_argument("--no-freeze", action="store_true")
    a = p.parse_args()
    if a.no_freeze:
        if a.workers > 1:
            p.error("--no-freeze patches this process only: use it with --workers 1")
        runner._FREEZE_EVERY_S = float("inf")
        runner.gc.freeze = lambda: None  # gc.freeze itself: nothing else in this process calls it
    with serve_in_subprocess(voice_agent_reply) as (http_url, _ws_url):
        target = Target(
            url=endpoint_url(http_url, Mode.http),
            mode=Mode.http,
            model="fake",
            language=None,
            body_format=BodyFormat.auto,
            sample_rate=24000,
            extra_fields={"frame_s": a.frame_ms / 1e3},
        )
        settings = runner.RunSettings(
            target=target,
            rate=a.rate,
            duration_s=a.duration,
            warmup_s=1.0,
            seed=0,
            arrival=ArrivalProcess.poisson,
            voices=("default",),
            word_interval_s=0.0,
            timeouts=Timeouts(stall_s=5.0, total_s=60.0),
            max_connections=1024,
            gpu_hour_usd=None,
            gpus=1,
            dataset=DEFAULT_DATASET,
            workers=a.workers,
        )
        result = runner.run_benchmark(settings, load_prompts(None))
    s = result.summary
    ms = {k: round(v * 1e3, 2) for k, v in s["harness"]["loop_lag_s"].items()
          if isinstance(v, float)}  # fmt: skip
    gc_max = s["harness"]["gc_pause_s"]["max"]
    t = s["timings"]
    collector = "as before" if a.no_freeze else "frozen every 0.5 s"
    print(f"python {sys.version.split()[0]}, {a.rate:g} req/s for {a.duration:g} s, workers "
          f"{a.workers}, collector {collector}")  # fmt: skip
    print(f"harness loop lag ms: {json.dumps(ms)}; collector pause max "
          f"{(gc_max or 0) * 1e3:.1f} ms")  # fmt: skip
    print(f"pauses >= 10 ms (what, s since origin, s): {s['harness']['stalls'][:20]}")
    print(f"requests {s['requests']['sent']}, dispatch lag p99 "
          f"{t['dispatch_lag_s']['p99'] * 1e3:.2f} ms, TTFA p50 / p95 "
          f"{t['ttfa_s']['p50'] * 1e3:.1f} / {t['ttfa_s']['p95'] * 1e3:.1f} ms, underrun "
          f"requests {s['underruns']['requests_with_underrun']}")  # fmt: skip


if __name__ == "__main__":
    main()
