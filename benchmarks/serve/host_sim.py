"""The server's host path on a CPU, in real time: `ttsbuild serve`'s app, scheduler and engine
loop (uvicorn, the event loop and the engine thread, as served) over a simulated GPU engine,
loaded by `ttsbuild bench sweep` from another process (Poisson arrivals, voice-agent prompts,
audible onset). What it is for: the host's share of time to first audio (the event loop and
the engine thread taking turns at the GIL, the loop's polls, handing chunks over), which the
engine microbenchmark does not see and a GPU run measures only through the whole server.

    python benchmarks/serve/host_sim.py run --out DIR [--rps 1,10,20] [--duration 30s]
        [--variant NAME=SETTINGS ...]

The simulated engine (`SimEngine`):
- device: tests/serve/fakes.FakeEngine in real time (a step occupies its lane, frame steps
  one, codec steps another, new rows' prefill, first frame and first codec step the
  admission lane; reading a step back waits for its end), with the H200's microbenchmark
  costs of the served FP8 engine (`../spec/2026-12-05-h200-tokens-parallel/call2`): prefill
  1.45 ms, a frame step 3.05 ms + 0.036 ms a row (5.34 at 64), a one-frame codec step 0.72 ms
  + 0.030 ms a row (2.62 at 64). Lanes do not slow each other (the H200's do: a first chunk
  beside stepping rows took 5.7 against 4.5 ms), so the GPU part is a floor.
- host: the request is resolved at the edge by the real `plan_admission` (the tiny stand-in's
  tokenizer, layout and length rule: voice-agent replies get their real frame counts); each
  engine call spends the host time the H200's engine thread spent on it, as Python work, and
  crosses the GIL as often as GraphEngine does there (every torch call from Python releases
  and retakes it: `--gil-ops`): a prefill ~0.15 ms with 8 crossings, a frame or codec launch
  ~0.06 ms (the C++ driver keeps the GIL), a read ~0.02 ms.
- PCM: noise, so the first sample is audible.

A variant is a name and comma-separated settings: `poll=sleep|wake` (the engine loop's poll:
a plain sleep, as before 2026-12-05, or a wait its `wake` event ends), `switch=SECONDS`
(sys.setswitchinterval in the server), `gil_ops=N` (GIL crossings per prefill). Each variant
gets its own server; the table gives the client's audible TTFA and the server's phases
(benchmarks/serve/first_audio_phases.py reads the same metrics).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.serve

from tests.serve.fakes import FakeEngine, FakeRequest, RealClock  # noqa: E402

# The H200's costs (ms) of the served FP8 engine, engine microbenchmark (module docstring).
PREFILL_MS = 1.45
FRAME_MS, FRAME_ROW_MS = 3.05, 0.036
CODEC_MS, CODEC_ROW_MS = 0.72, 0.030
# The engine thread's host time per call (ms) and its GIL crossings (torch calls).
HOST_MS = {"admit": 0.01, "prefill": 0.15, "frames": 0.06, "audio": 0.06, "read": 0.02}
VOICES = ("aiden", "eric", "ryan", "ono_anna")  # rotated by request, as the H200 sweeps
GIL_OPS = {"admit": 0, "prefill": 8, "frames": 1, "audio": 1, "read": 1}


class _Host:
    """Host work of `ms` with `ops` GIL crossings: torch calls on a small tensor (each
    releases and retakes the GIL), then Python until the time is spent."""

    def __init__(self, gil_ops: dict[str, int]):
        import torch

        self.gil_ops = gil_ops
        self.a, self.b = torch.zeros(64), torch.ones(64)

    def __call__(self, part: str) -> None:
        end = time.perf_counter() + HOST_MS[part] * 1e-3
        for _ in range(self.gil_ops[part]):
            self.a.copy_(self.b)
        while time.perf_counter() < end:
            pass


class _Backend:
    """What the service reads of GraphEngine's backend: the admission lane, switchable."""

    concurrent_admission = True

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.lane_codec_steps = 1

    @property
    def lane_on(self) -> bool:
        return self.engine.admission_lane

    @lane_on.setter
    def lane_on(self, on: bool) -> None:
        self.engine.admission_lane = on


class SimEngine(FakeEngine):
    """FakeEngine in real time with the H200's step costs, requests resolved by the tiny
    stand-in's real `plan_admission`, host work per call and noise PCM."""

    def __init__(self, num_slots: int, gil_ops: dict[str, int]):
        from ttsbuild.generation.guards import GuardConfig
        from ttsbuild.runtime.engine import random_models

        super().__init__(
            RealClock(), num_slots=num_slots,
            cost_s={"prefill": PREFILL_MS * 1e-3, "frames": FRAME_MS * 1e-3,
                    "audio": CODEC_MS * 1e-3},
            per_row_s={"frames": FRAME_ROW_MS * 1e-3, "audio": CODEC_ROW_MS * 1e-3},
            codec_lane=True, async_prefill=True, instant=False, admission_lane=True,
        )  # fmt: skip
        self.models = random_models("tiny", device="cpu")
        self.guards = GuardConfig()
        self.backend = _Backend(self)
        self.host = _Host(gil_ops)
        self.noise = np.random.default_rng(0).uniform(-0.3, 0.3, 1920 * 64).astype(np.float32)

    @functools.cached_property
    def plan(self):
        from ttsbuild.runtime.plan import EnginePlan

        return EnginePlan.default(num_slots=self.num_slots)

    def resolve(self, req):
        from ttsbuild.runtime.core import ResolvedRequest
        from ttsbuild.runtime.engine import plan_admission

        return ResolvedRequest(req, plan_admission(self.models, req, self.plan, self.guards))

    def admit(self, req) -> int:
        self.host("admit")
        if not isinstance(req, FakeRequest):
            resolved = req if hasattr(req, "plan") else self.resolve(req)
            req = FakeRequest(frames=resolved.plan.frame_limit)
        return super().admit(req)

    def prefill(self, slots):
        self.host("prefill")
        return super().prefill(slots)

    def launch_frames(self, slots):
        self.host("frames")
        return super().launch_frames(slots)

    def launch_audio(self, slots, max_frames=None):
        self.host("audio")
        ticket = super().launch_audio(slots, max_frames)
        for s, pcm in ticket.outputs.items():
            ticket.outputs[s] = self.noise[: len(pcm)].copy()
        return ticket

    def _read(self, ticket):
        self.host("read")
        return super()._read(ticket)


def serve(a) -> None:
    import uvicorn

    from ttsbuild.serve.app import create_app
    from ttsbuild.serve.config import ServeConfig
    from ttsbuild.serve.service import SpeechService

    settings = dict(kv.split("=", 1) for kv in a.settings.split(",") if kv)
    gil_ops = dict(GIL_OPS, prefill=int(settings.get("gil_ops", GIL_OPS["prefill"])))
    if "switch" in settings:
        sys.setswitchinterval(float(settings["switch"]))
    engine = SimEngine(a.slots, gil_ops)
    service = SpeechService(engine, ServeConfig())
    if settings.get("poll", "wake") == "sleep":
        service.loop.sleep = time.sleep  # the loop's poll before 2026-12-05
    if settings.get("trace") == "1":
        _trace(service, engine)
    uvicorn.run(create_app(service), host="127.0.0.1", port=a.port, log_level="warning")


def _trace(service, engine: SimEngine) -> None:
    """Per admission, when (ms after the stream was queued) the engine thread planned its
    express turn, entered and left admit, prefill and the first frame launch, and when the
    handler saw the admission; medians to stderr at exit."""
    import atexit
    import statistics

    marks: dict[str, list[float]] = {}
    current: dict[str, float] = {}

    def mark(key: str) -> None:
        if "queued" in current and key not in current:
            current[key] = time.perf_counter()

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def wrapped(*args, **kwargs):
            mark(key + " in")
            out = f(*args, **kwargs)
            mark(key + " out")
            return out

        setattr(obj, name, wrapped)

    submit, plan, open_ = service.scheduler.submit, service.loop._plan, service.open

    def queued(*args, **kwargs):
        for k, t in current.items():
            if k != "queued":
                marks.setdefault(k, []).append((t - current["queued"]) * 1e3)
        current.clear()
        current["queued"] = time.perf_counter()
        return submit(*args, **kwargs)

    def planned(only):
        mark("plan in")
        if only == "new":
            mark("plan new")
        out = plan(only)
        mark("plan out")
        return out

    async def opened(*args, **kwargs):
        handle = await open_(*args, **kwargs)
        mark("handler admitted")
        return handle

    service.scheduler.submit, service.loop._plan, service.open = queued, planned, opened
    arrival, poll = service.loop._arrival, service.loop.sleep

    def arrived():
        seen = arrival()
        if seen:
            mark("arrival seen")
        return seen

    def polled(seconds):
        mark("poll entered")
        poll(seconds)
        mark("poll woke")

    service.loop._arrival, service.loop.sleep = arrived, polled
    step = service.loop.step

    def stepped():
        mark("step start")
        return step()

    service.loop.step = stepped
    for name, key in (("admit", "admit"), ("prefill", "prefill"), ("launch_frames", "frames")):
        wrap(engine, name, key)

    def report() -> None:
        for k, v in sorted(marks.items(), key=lambda kv: statistics.median(kv[1])):
            print(f"trace: {k:18s} n {len(v):5d} median {statistics.median(v):.3f} ms, "
                  f"mean {statistics.mean(v):.3f}", file=sys.stderr, flush=True)

    atexit.register(report)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the simulated server on port {port} did not come up")


# The columns of the table: (title, metric, label), means in ms over the rate's window.
COLUMNS = (
    ("server", "tts_time_to_first_audio_seconds", ""),
    ("admit", "tts_first_audio_phase_seconds", 'phase="admit"'),
    ("read", "tts_first_audio_phase_seconds", 'phase="read"'),
    ("resolve", "tts_http_phase_seconds", 'phase="resolve"'),
    ("admitted", "tts_http_phase_seconds", 'phase="admitted"'),
    ("handoff", "tts_http_phase_seconds", 'phase="handoff"'),
    ("prefill host", "tts_engine_host_seconds", 'part="prefill"'),
)


def _metrics(port: int, path: Path) -> dict[str, float]:
    import httpx

    from benchmarks.serve.first_audio_phases import load

    path.write_text(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    return load(str(path))


def run(a) -> None:
    from benchmarks.serve.first_audio_phases import summary

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v.split("=", 1) if "=" in v else (v, "") for v in a.variant]
    rows = []
    order = [(r, v) for r in range(a.rounds) for v in variants]
    bench = str(Path(sys.executable).with_name("ttsbuild"))
    print("| variant | round | req/s | client p50 / p95 ms | "
          + " | ".join(f"{t} ms" for t, _, _ in COLUMNS) + " |", flush=True)  # fmt: skip
    for rnd, (name, settings) in order:
        port = _free_port()
        log = open(out / f"server_{name}_{rnd}.log", "w")
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", "--port", str(port), "--slots", str(a.slots),
             "--settings", settings], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            _wait_up(port)
            dest = out / f"{name}_{rnd}"
            before = _metrics(port, out / f"metrics_{name}_{rnd}_start.txt")
            for rps in a.rps.split(","):
                cmd = [bench, "bench", "sweep", "--url", f"http://127.0.0.1:{port}",
                       "--output", str(dest / f"rps-{rps}"), "--rps", rps,
                       "--duration", a.duration, "--warmup", a.warmup,
                       "--dataset", "voice-agent", "--seed", str(rnd),
                       *[x for v in VOICES for x in ("--voice", v)]]  # fmt: skip
                with open(out / f"bench_{name}_{rnd}_{rps}.log", "w") as blog:
                    subprocess.run(cmd, check=True, stdout=blog, stderr=subprocess.STDOUT)
                now = _metrics(port, out / f"metrics_{name}_{rnd}_{rps}.txt")
                row = json.loads((dest / f"rps-{rps}" / "sweep.json").read_text())["rows"][0]
                means = {t: summary(now, before, m, lab)[1] for t, m, lab in COLUMNS}
                before = now
                rows.append({"variant": name, "settings": settings, "round": rnd, **row,
                             "server_means_ms": means})  # fmt: skip
                print(f"| {name} | {rnd} | {float(rps):g} | {row['ttfa_p50_s'] * 1e3:.2f} / "
                      f"{row['ttfa_p95_s'] * 1e3:.2f} | "
                      + " | ".join(f"{means[t]:.2f}" for t, _, _ in COLUMNS) + " |",
                      flush=True)  # fmt: skip
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
    (out / "host_sim.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--slots", type=int, default=64)
    s.add_argument("--settings", default="")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rps", default="1,10,20")
    r.add_argument("--duration", default="30s")
    r.add_argument("--warmup", default="3s")
    r.add_argument("--slots", type=int, default=64)
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--variant", action="append", default=[],
                   help="NAME=SETTINGS, e.g. old=poll=sleep (repeat)")  # fmt: skip
    a = p.parse_args()
    if a.cmd == "serve":
        serve(a)
    else:
        a.variant = a.variant or ["wake=poll=wake", "sleep=poll=sleep"]
        run(a)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
