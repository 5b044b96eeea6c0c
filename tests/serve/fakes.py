"""A pure-Python engine with the slot API and a fake clock that stage calls advance."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.serve.config import FRAME_SAMPLES


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class RealClock(FakeClock):
    """Real time for FakeEngine: reading `t` gives the seconds since creation; moving it on
    (a step read back) sleeps until then (benchmarks/serve/host_sim.py, real-time tests)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    @property
    def t(self) -> float:
        return time.perf_counter() - self.t0

    @t.setter
    def t(self, value: float) -> None:
        time.sleep(max(0.0, value - self.t))


class FakeRequestError(ValueError):
    pass


@dataclass
class FakeRequest:
    frames: int  # frames this request generates before finishing
    refuse: str | None = None  # admit raises FakeRequestError(refuse)


class FakeModels:
    voices = ["ryan"]
    languages = ["auto", "english"]
    manifest = {"standin": {"length_rule": {}}}
    cfg = type("Cfg", (), {"tts_model_type": "custom_voice", "supports_instruct": True})()
    voice_encoder = None  # not a Base model: no voice registration


@dataclass
class _Slot:
    request: FakeRequest
    prefilled: bool = False
    frames: int = 0  # launched (the fake has no EOS: every launched frame is real)
    decoded: int = 0
    audio_steps: int = 0  # codec steps that decoded something
    frames_ready_at: float = 0.0  # when the last launched frame exists on the "device"


@dataclass
class FakeTicket:
    kind: str  # "frames" or "audio"
    slots: list[int]
    done_at: float  # device time the step ends
    outputs: object  # what collect returns
    id: int = 0


@dataclass
class FakeEngine:
    """The slot API on a fake device: each step occupies a lane (frame steps the "lm" lane;
    codec steps the "codec" lane with `codec_lane`, else the same one) from launch, or when
    the lane and its input frames are free, for its cost; reading a step back advances the
    clock to its end. A prefill follows the lm lane and blocks the host until it is done, or,
    with `async_prefill` (a graph replay that does not sync the host), only occupies the lane.
    `instant`: a step counts as done (ready) as soon as it is launched, for loops driven by
    real time (the fake clock moves only when a step is read); otherwise when the fake clock
    reaches its end. `admission_lane`: a prefill, a frame step of rows not yet stepped and a
    codec step of rows not yet decoded take an "admit" lane of their own (the GPU engine's
    admission lane: beside the other steps; with `lane_codec_steps` > 1 also a row's next
    one-frame codec steps up to that many, as GraphBackend does). Launch and read
    calls are logged in order in `log`; `calls` keeps (stage, slots) per launch."""

    clock: FakeClock
    num_slots: int = 4
    cost_s: dict = field(default_factory=lambda: {"prefill": 0.01, "frames": 0.02, "audio": 0.01})
    per_row_s: dict = field(default_factory=lambda: {"frames": 0.0, "audio": 0.0})
    audio_frame_s: float = 0.0  # a codec step's cost per frame it decodes, on top
    codec_lane: bool = False
    async_prefill: bool = False
    instant: bool = True
    slots: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)  # (stage, slots)
    log: list = field(default_factory=list)  # ("launch" | "read", kind, ticket id, slots)
    models: object = field(default_factory=lambda: FakeModels())
    admission_lane: bool = False
    lane_free: dict = field(default_factory=lambda: {"lm": 0.0, "codec": 0.0, "admit": 0.0})
    tickets: int = 0
    lane_codec_steps: int = 1
    lane_frames: int = 1  # a row's first frames on the admission lane (GraphBackend's plan)

    @property
    def plan(self) -> EnginePlan:
        return EnginePlan.default(num_slots=self.num_slots)

    def free_slots(self) -> int:
        return self.num_slots - len(self.slots)

    def admit(self, req) -> int:
        if getattr(req, "refuse", None):
            raise FakeRequestError(req.refuse)
        if not isinstance(req, FakeRequest):  # a SynthesisRequest from the service
            req = FakeRequest(frames=req.max_frames or 10)
        free = [s for s in range(self.num_slots) if s not in self.slots]
        if not free:
            raise RuntimeError("no free slot: the scheduler over-admitted")
        self.slots[free[0]] = _Slot(req)
        return free[0]

    def seed_of(self, slot: int) -> int:
        return 1000 + slot

    def stopped_by(self, slot: int) -> str:
        return "length_rule"  # a stand-in: it runs to its frame count

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def prefill(self, slots):
        self.calls.append(("prefill", list(slots)))
        for s in slots:
            self.slots[s].prefilled = True
        lane = "admit" if self.admission_lane else "lm"
        self.lane_free[lane] = max(self.clock.t, self.lane_free[lane]) + self.cost_s["prefill"]
        for s in slots:  # a frame step on another lane follows it
            self.slots[s].frames_ready_at = self.lane_free[lane]
        if not self.async_prefill:
            self.clock.t = self.lane_free[lane]

    def can_launch(self, slot: int) -> bool:
        st = self.slots[slot]
        return st.frames < st.request.frames

    def pending_frames(self, slot: int) -> int:
        st = self.slots[slot]
        return st.frames - st.decoded

    def _run(self, kind: str, parts, outputs, frames=None) -> FakeTicket:
        """One step of `kind` in parts [(lane, slots, start)] (the admission lane's rows and
        the others): each occupies its lane from `start`; the step ends with the last.
        frames: slot -> frames it decodes (codec steps, for audio_frame_s)."""
        done_at, slots = 0.0, []
        for lane, rows, start in parts:
            cost = self.cost_s[kind] + self.per_row_s[kind] * len(rows)
            if frames is not None:
                cost += self.audio_frame_s * sum(frames[s] for s in rows)
            begin = max(start, self.clock.t, self.lane_free[lane])
            self.lane_free[lane] = begin + cost
            done_at, slots = max(done_at, begin + cost), slots + list(rows)
            if kind == "frames":  # the frames exist when their own part ends
                for s in rows:
                    self.slots[s].frames_ready_at = begin + cost
        self.tickets += 1
        ticket = FakeTicket(kind, slots, done_at, outputs, self.tickets)
        self.log.append(("launch", kind, ticket.id, slots))
        return ticket

    def _split(self, slots, first: bool, lane: str) -> list:
        """(lane, rows) parts: rows on their first step of a kind take the admission lane."""
        parts = [("admit", [s for s in slots if first(s)])] if self.admission_lane else []
        rest = [s for s in slots if not (self.admission_lane and first(s))]
        return [(ln, rows) for ln, rows in [*parts, (lane, rest)] if rows]

    def launch_frames(self, slots) -> FakeTicket:
        self.calls.append(("frames", list(slots)))
        parts = [(lane, rows, max(self.slots[s].frames_ready_at for s in rows))  # prefill
                 for lane, rows in self._split(slots, self._lane_frame_row, "lm")]
        outputs = []
        for s in slots:
            st = self.slots[s]
            assert st.prefilled and st.frames < st.request.frames
            st.frames += 1
            finished = st.frames >= st.request.frames
            outputs.append(SimpleNamespace(slot=s, made=True, finished=finished))
        return self._run("frames", parts, outputs)

    def launch_audio(self, slots, max_frames=None) -> FakeTicket:
        """Decode each slot's frames not yet decoded, at most max_frames (one cap for all, or
        one per slot, None: no cap)."""
        self.calls.append(("audio", list(slots)))
        caps = max_frames if isinstance(max_frames, list | tuple) else [max_frames] * len(slots)
        todo = {}
        for s, cap in zip(slots, caps, strict=True):
            n = self.slots[s].frames - self.slots[s].decoded
            todo[s] = n if cap is None else min(n, cap)
        lane = "codec" if self.codec_lane else "lm"
        parts = [
            (ln, rows, max(self.slots[s].frames_ready_at for s in rows))
            for ln, rows in self._split(slots, lambda s: self._lane_codec_row(s, todo[s]), lane)
        ]
        pcm = {}
        for s in slots:
            st = self.slots[s]
            pcm[s] = [0.0] * (todo[s] * FRAME_SAMPLES)
            st.audio_steps += todo[s] > 0
            st.decoded += todo[s]
        return self._run("audio", parts, pcm, todo)

    def _lane_frame_row(self, s: int) -> bool:
        st = self.slots[s]
        # as GraphBackend: a row's second frame goes there whether or not its first was
        # decoded yet (a first chunk of one frame, then its second on the lane)
        return st.frames < self.lane_frames

    def _lane_codec_row(self, s: int, n: int) -> bool:
        st = self.slots[s]
        return st.decoded == 0 or (st.audio_steps < self.lane_codec_steps and n == 1)

    def ready(self, ticket: FakeTicket) -> bool:
        return self.instant or self.clock.t >= ticket.done_at

    def _read(self, ticket: FakeTicket):
        self.clock.t = max(self.clock.t, ticket.done_at)
        self.log.append(("read", ticket.kind, ticket.id, ticket.slots))
        return ticket.outputs

    def collect(self, ticket: FakeTicket):
        return [o for o in self._read(ticket) if o.slot in self.slots]

    def collect_audio(self, ticket: FakeTicket):
        return self._read(ticket)

    def frames(self, slots):
        return self.collect(self.launch_frames(slots))

    def audio(self, slots, max_frames=None):
        return self.collect_audio(self.launch_audio(slots, max_frames))
