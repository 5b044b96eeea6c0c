"""Admission under load, on a CPU model of the pipelined server: the real scheduler and engine
loop (serve.loop.EngineLoop, express admission, capacity admission on) driving the GPU-like
fake engine (frame steps on one lane, codec steps on another, new rows' prefill, first frame
and first codec step on an admission lane), voice-agent prompts, Poisson arrivals. Per rate
and `admit_slack_s`: requests refused, admitted requests with a late chunk (an underrun at a
zero-buffer client), their first-audio p95, audio made per second.

    python benchmarks/serve/admission_sim.py [--rates 20,40,60,80] [--slacks 0,0.01,0.02]
        [--schedules 1,1,2,4,8,12/2,1,2,4,8,12 --lane-frames 2]

The fake's step costs grow with the batch as the H200's step spacing did *under load*, 2-3x
its microbenchmark times (benchmarks/serve/2026-12-02-h200-capacity-128): a frame step
4 ms + 0.14 ms per row (8 ms at 26 rows, 16 ms at 87: the H200 at 40 and 80 req/s), a codec
step 3 ms + 0.15 ms per frame it decodes (21 ms for 121 frames), a prefill 2 ms. The model
saturates at ~6,700 frames/s (the H200 at ~5,500), and, as on the H200, streams underrun at
their second chunk long before that. Read it for how a policy moves refusals and underruns,
not for absolute figures.

`--shared-gpu` (2026-12-03) models the GPU the lanes share instead (SharedGpu): steps cost what
they cost alone (the engine microbenchmark's figures) and slow each other down while they
run at once, the admission lane taking the largest share. Calibrated (`--overlap 0.1`, the
default) on the H200's defaults at 70 and 85 req/s, it ranks as the H200 did the policies
the plain model mis-ranked or missed (benchmarks/serve/2026-12-03-cpu-shared-gpu-model):

    python benchmarks/serve/admission_sim.py --shared-gpu --frame-ms 3.4 --frame-row-ms 0.038 \
        --codec-ms 0.7 --codec-frame-ms 0.032 --prefill-ms 2.0 --slacks 0 --rates 70,85

The admission lane follows the server's default switch (`--lane-max-active`, the lane only
while fewer streams hold slots); `--lane-max-active 0` keeps it on, `--no-lane` has none (as
`serve --admission-lane=`). The model ranks the three as the H200 did at 70 and 85 req/s.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.serve

from tests.serve.fakes import (  # noqa: E402
    FakeClock,
    FakeEngine,
    FakeRequest,
    FakeRequestError,
    FakeTicket,
)
from ttsbuild.bench.schedule import load_prompts  # noqa: E402
from ttsbuild.runtime.plan import default_prefill_batches  # noqa: E402
from ttsbuild.serve.config import SAMPLE_RATE, SchedulerConfig  # noqa: E402
from ttsbuild.serve.loop import EngineLoop, Runner  # noqa: E402
from ttsbuild.serve.scheduler import (  # noqa: E402
    Chunk,
    NullObserver,
    Rejected,
    Scheduler,
    Status,
)

CHARS_PER_S = 14.0  # the stand-ins' speaking rate (see pacing_sim.py)
FRAMES_PER_S = 12.5


class SharedGpu:
    """Steps on the engine's lanes (CUDA streams: "admit", "lm", "codec") sharing one GPU.
    Each lane runs its steps in order; a step also waits for the steps it depends on
    (another lane's frame it reads). Steps running at once share the GPU: n of them get
    1 + overlap * (n - 1) times one step's throughput together (small steps leave SMs free),
    split by their lanes' weights (CUDA stream priorities: the admission lane first), no
    step faster than alone. A step's end is known only once nothing else is launched before
    it: each launch re-plans every step not yet finished."""

    def __init__(self, weights: dict[str, float], overlap: float):
        self.weights, self.overlap = weights, overlap
        self.t = 0.0
        self.queues: dict[str, deque[int]] = {lane: deque() for lane in weights}
        self.remaining: dict[int, float] = {}
        self.deps: dict[int, tuple[int, ...]] = {}
        self.lane_of: dict[int, str] = {}
        self.ends: dict[int, float] = {}  # finished steps: when
        self.planned: dict[int, float] = {}  # every step's end as planned at the last launch
        self._ids = itertools.count()

    def launch(self, lane: str, work_s: float, deps, now: float) -> int:
        self._run(self.queues, self.remaining, self.ends, now)
        pid = next(self._ids)
        self.remaining[pid], self.lane_of[pid] = max(work_s, 1e-9), lane
        self.deps[pid] = tuple(d for d in deps if d in self.remaining)  # not finished yet
        self.queues[lane].append(pid)
        ends = dict(self.ends)
        queues = {lane: deque(q) for lane, q in self.queues.items()}
        self._run(queues, dict(self.remaining), ends, math.inf)
        self.planned = ends
        return pid

    def _run(self, queues, remaining, ends, until: float) -> None:
        """Advance the steps in `queues` from self.t (only for the real state) to `until`."""
        real = queues is self.queues
        t = self.t
        while True:
            active = [q[0] for q in queues.values()
                      if q and all(d in ends and ends[d] <= t for d in self.deps[q[0]])]
            if not active:
                break
            weights = [self.weights[self.lane_of[p]] for p in active]
            share = (1 + self.overlap * (len(active) - 1)) / sum(weights)
            rates = [min(1.0, share * w) for w in weights]
            dt = min(remaining[p] / r for p, r in zip(active, rates, strict=True))
            if t + dt > until:
                for p, r in zip(active, rates, strict=True):
                    remaining[p] -= r * (until - t)
                t = until
                break
            t += dt
            for p, r in zip(active, rates, strict=True):
                remaining[p] -= r * dt
                if remaining[p] <= 1e-12:
                    ends[p] = t
                    queues[self.lane_of[p]].popleft()
        if real:  # forget finished steps but those a queued step still waits for
            self.t = max(t, until)
            for p in [p for p in self.remaining if p in ends]:
                del self.remaining[p], self.lane_of[p]
            needed = {d for p in self.remaining for d in self.deps[p]}
            for p in [p for p in self.deps if p not in self.remaining]:
                del self.deps[p]
            self.ends = {p: e for p, e in ends.items() if p in needed}


class SharedGpuEngine(FakeEngine):
    """The fake engine with its steps on a SharedGpu instead of independent lanes: the
    admission lane's work slows the regular steps running beside it, as on the H200."""

    def __init__(self, *args, gpu: SharedGpu, prefill_batch: int = 1,
                 prefill_prompt_s: float = 0.0, **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.gpu = gpu
        # prompts per prefill step (EnginePlan.prefill_batches' largest): more take more steps
        # back to back, each costing one prompt's (their weights' read dominates) plus
        # prefill_prompt_s for every prompt after the first in the step
        self.prefill_batch = prefill_batch
        self.prefill_prompt_s = prefill_prompt_s
        self.made_by: dict[int, int] = {}  # slot -> the step that made its latest frame
        self.unread: list = []

    def release(self, slot: int) -> None:
        super().release(slot)
        self.made_by.pop(slot, None)

    def prefill(self, slots):
        self.calls.append(("prefill", list(slots)))
        lane = "admit" if self.admission_lane else "lm"
        steps = -(-len(slots) // self.prefill_batch)
        cost = steps * self.cost_s["prefill"] + (len(slots) - steps) * self.prefill_prompt_s
        pid = self.gpu.launch(lane, cost, [], self.clock.t)
        for s in slots:
            self.slots[s].prefilled = True
            self.made_by[s] = pid

    def _run(self, kind, parts, outputs, frames=None):
        pids, slots = [], []
        for lane, rows, _start in parts:
            cost = self.cost_s[kind] + self.per_row_s[kind] * len(rows)
            if frames is not None:
                cost += self.audio_frame_s * sum(frames[s] for s in rows)
            pid = self.gpu.launch(lane, cost, [self.made_by.get(s) for s in rows],
                                  self.clock.t)  # fmt: skip
            if kind == "frames":
                for s in rows:
                    self.made_by[s] = pid
            pids.append(pid)
            slots += list(rows)
        self.tickets += 1
        ticket = FakeTicket(kind, slots, 0.0, outputs, self.tickets)
        ticket.pids = pids
        self.unread.append(ticket)
        ticket.ends = {}
        for t in self.unread:  # every launch may move the ends of the steps in flight
            t.ends = {p: self.gpu.planned.get(p, t.ends.get(p, self.clock.t)) for p in t.pids}
            t.done_at = max(t.ends.values())
        self.log.append(("launch", kind, ticket.id, slots))
        return ticket

    def _read(self, ticket):
        if ticket in self.unread:
            self.unread.remove(ticket)
        return super()._read(ticket)


class Late(NullObserver):
    def __init__(self):
        self.late_chunks = 0

    def on_chunk(self, lateness_s: float, chunk: int = 0, played_s: float = 0.0) -> None:
        self.late_chunks += lateness_s > 0


def simulate(rate: float, slack: float, a, schedule=None, seed: int = 0) -> Outcome:
    rnd = random.Random(seed)
    prompts = load_prompts("voice-agent")
    clock = FakeClock()
    shared = {} if not a.shared_gpu else {"gpu": SharedGpu(
        {"admit": a.weight_admit, "lm": a.weight_lm, "codec": 1.0}, a.overlap),
        "prefill_batch": a.prefill_batch or max(default_prefill_batches(a.slots)),
        "prefill_prompt_s": a.prefill_prompt_ms / 1e3}
    engine = (SharedGpuEngine if a.shared_gpu else FakeEngine)(
        clock, num_slots=a.slots, codec_lane=True, async_prefill=True, instant=False,
        admission_lane=not a.no_lane, **shared,
        cost_s={"prefill": a.prefill_ms / 1e3, "frames": a.frame_ms / 1e3,
                "audio": a.codec_ms / 1e3},
        per_row_s={"frames": a.frame_row_ms / 1e3, "audio": 0.0},
        audio_frame_s=a.codec_frame_ms / 1e3, lane_frames=a.lane_frames,
        lane_codec_steps=a.lane_chunks,
    )  # fmt: skip
    observer = Late()
    config = SchedulerConfig(num_slots=a.slots, max_batch=a.slots, max_queue=256,
                             queue_timeout_s=a.queue_timeout, max_buffered_s=1e6,
                             refuse_long_waits=not a.queue_long_waits,
                             overload_wait_s=a.overload_wait,
                             standing_queue_s=a.standing_queue,
                             overload_slack_s=a.overload_slack,
                             overload_admit_rate=a.overload_admit_rate,
                             stream_buffer_s=1e6, admit_slack_s=slack,
                             lane_frames=a.lane_frames, lane_chunks=a.lane_chunks,
                             codec_step_frames=a.codec_step_frames,
                             lane_max_active=a.lane_max_active,
                             max_audio_in_flight=a.max_audio_in_flight,
                             capacity_margin=a.capacity_margin,
                             pace_slack_s=a.pace_slack)  # fmt: skip
    sched = Scheduler(config, clock, observer, initial_cost_s=0.01)
    loop = EngineLoop(sched, Runner(engine, FakeRequestError), clock=clock, sleep=clock.advance,
                      express=not a.no_lane, lane_switch=None if a.no_lane or a.lane_max_active <= 0
                      else lambda on: setattr(engine, "admission_lane", on))  # fmt: skip
    streams, refused, late_streams = [], 0, set()
    first: dict[int, float] = {}
    next_at, t_end = 0.0, a.duration
    while clock.t < t_end or any(s.status not in (Status.FINISHED, Status.FAILED)
                                 for s in streams):  # fmt: skip
        while clock.t >= next_at and next_at < t_end:
            frames = max(4, round(len(rnd.choice(prompts)) / CHARS_PER_S * FRAMES_PER_S))
            holder: list = []

            def sink(event, holder=holder):
                s = holder[0]
                if isinstance(event, Chunk):
                    first.setdefault(s.id, clock.t - s.arrived_at)
                    sched.ack(s.id, len(event.pcm))
                    # the audio sent before this chunk runs out at `due` (a zero-buffer client)
                    due = s.playback_start() + (s.samples_sent - len(event.pcm)) / SAMPLE_RATE
                    if event.seq and clock.t > due:
                        late_streams.add(s.id)

            try:
                holder.append(sched.submit(FakeRequest(frames), sink, schedule))
                streams.append(holder[0])
            except Rejected:
                refused += clock.t >= a.warmup  # as arrived_at below
            next_at += rnd.expovariate(rate)
        if not loop.step():
            clock.advance(min(0.001, loop.idle_s))
    measured = [s for s in streams if s.arrived_at >= a.warmup]  # as the bench's --warmup
    failed = sum(s.status is Status.FAILED for s in measured)
    admitted = [s for s in measured if s.status is Status.FINISHED]
    ttfa = sorted(first[s.id] * 1e3 for s in admitted if s.id in first)
    return Outcome(
        rate=rate, slack=slack, sent=len(measured) + refused, refused=refused + failed,
        refused_queued=failed, admitted=len(admitted),
        late=sum(s.id in late_streams for s in admitted), late_chunks=observer.late_chunks,
        ttfa_p50_ms=statistics.median(ttfa) if ttfa else float("nan"),
        ttfa_p95_ms=ttfa[int(0.95 * (len(ttfa) - 1))] if ttfa else float("nan"),
        audio_s_per_s=sum(s.samples_sent for s in admitted) / SAMPLE_RATE
        / (a.duration - a.warmup),
    )  # fmt: skip


@dataclass
class Outcome:
    rate: float
    slack: float
    sent: int
    refused: int  # at once, or after queueing for a slot (refused_queued)
    refused_queued: int
    admitted: int
    late: int  # admitted streams with a late chunk
    late_chunks: int
    ttfa_p50_ms: float
    ttfa_p95_ms: float
    audio_s_per_s: float

    def __str__(self) -> str:
        return (f"{self.rate:5g} req/s admit_slack {self.slack * 1e3:2.0f} ms: {self.sent:5d} "
                f"sent, {self.refused:4d} refused ({self.refused_queued} after queueing), "
                f"{self.late:4d} of {self.admitted} admitted with a late chunk "
                f"({self.late_chunks} late chunks), TTFA p50 {self.ttfa_p50_ms:6.1f} p95 "
                f"{self.ttfa_p95_ms:6.1f} ms, {self.audio_s_per_s:6.1f} audio-s per s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", default="20,40,60,80")
    p.add_argument("--slacks", default="0,0.01,0.02,0.03")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--schedules", default="1,1,2,4,8,12",
                   help="chunk schedules to compare, '/' between, e.g. 1,1,2,4,8,12/2,1,2,4,8")
    p.add_argument("--lane-frames", type=int, default=1,
                   help="a new row's first frames on the admission lane (2: serve --lane-frames 2)")
    p.add_argument("--lane-chunks", type=int, default=1,
                   help="a stream's first one-frame chunks decoded on the admission lane "
                   "(serve --lane-chunks)")
    p.add_argument("--no-lane", action="store_true",
                   help="no admission lane: new rows' prefill, first frame and first codec step "
                   "in the regular steps, express admission off (serve --admission-lane=)")
    p.add_argument("--lane-max-active", type=int, default=SchedulerConfig.lane_max_active,
                   help="the admission lane only while fewer streams hold slots (serve "
                   "--lane-max-active; 0: always)")
    p.add_argument("--codec-step-frames", type=int, default=SchedulerConfig.codec_step_frames,
                   help="a codec step's frames at most (serve --codec-step-frames; 0: no bound)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="lanes share one GPU (SharedGpu): give the step costs of one step "
                   "alone (the engine microbenchmark's), not the spacing under load")
    p.add_argument("--overlap", type=float, default=0.1,
                   help="--shared-gpu: extra throughput per step running beside another")
    p.add_argument("--weight-admit", type=float, default=3.0,
                   help="--shared-gpu: the admission lane's share weight (codec lane: 1)")
    p.add_argument("--weight-lm", type=float, default=1.5,
                   help="--shared-gpu: the frame lane's share weight")
    p.add_argument("--prefill-batch", type=int, default=0,
                   help="--shared-gpu: prompts per prefill step (serve --prefill-batches' "
                   "largest; 0: as served, runtime.plan.default_prefill_batches); the plain "
                   "model runs every turn's prompts as one step")
    p.add_argument("--prefill-prompt-ms", type=float, default=0.15,
                   help="--shared-gpu: a prefill step's cost for each prompt after its first "
                   "(H200, 32-token prompts: 1.97 / 2.11 / 2.54 ms for 1 / 2 / 4)")
    p.add_argument("--max-audio-in-flight", type=int,
                   default=SchedulerConfig.max_audio_in_flight)
    p.add_argument("--capacity-margin", type=float, default=SchedulerConfig.capacity_margin)
    p.add_argument("--pace-slack", type=float, default=SchedulerConfig.pace_slack_s)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of arrivals left out of the figures (the bench's --warmup)")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per setting, each with its own arrivals (seeds 0..N-1)")
    p.add_argument("--queue-timeout", type=float, default=SchedulerConfig.queue_timeout_s)
    p.add_argument("--overload-wait", type=float, default=None,
                   help="serve --overload-wait (default: the profile's)")
    p.add_argument("--standing-queue", type=float, default=SchedulerConfig.standing_queue_s)
    p.add_argument("--overload-slack", type=float, default=SchedulerConfig.overload_slack_s,
                   help="serve --overload-slack")
    p.add_argument("--overload-admit-rate", type=float,
                   default=SchedulerConfig.overload_admit_rate, help="serve --overload-admit-rate")
    p.add_argument("--queue-long-waits", action="store_true",
                   help="queue requests expected to wait longer than they may (serve "
                   "--queue-long-waits) instead of refusing them at once")
    p.add_argument("--frame-ms", type=float, default=4.0)
    p.add_argument("--frame-row-ms", type=float, default=0.14)
    p.add_argument("--codec-ms", type=float, default=3.0)
    p.add_argument("--codec-frame-ms", type=float, default=0.15)
    p.add_argument("--prefill-ms", type=float, default=2.0)
    return p.parse_args(argv)


def main() -> None:
    a = parse_args()
    for rate in (float(r) for r in a.rates.split(",")):
        for slack in (float(x) for x in a.slacks.split(",")):
            for sched in a.schedules.split("/"):
                schedule = tuple(int(x) for x in sched.split(","))
                for seed in range(a.seeds):  # arrivals drawn afresh per seed
                    tag = f"[{sched}]" + (f" seed {seed}" if a.seeds > 1 else "")
                    print(f"{tag} {simulate(rate, slack, a, schedule, seed)}", flush=True)


if __name__ == "__main__":
    main()
