"""A pure-Python engine with the slot API and a fake clock that stage calls advance."""

from __future__ import annotations

from dataclasses import dataclass, field

from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.serve.config import FRAME_SAMPLES


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


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
    frames: int = 0
    decoded: int = 0


@dataclass
class FakeEngine:
    clock: FakeClock
    num_slots: int = 4
    cost_s: dict = field(default_factory=lambda: {"prefill": 0.01, "frames": 0.02, "audio": 0.01})
    slots: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)  # (stage, slots)
    models: object = field(default_factory=lambda: FakeModels())

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
        self.clock.advance(self.cost_s["prefill"])

    def frames(self, slots):
        from types import SimpleNamespace

        self.calls.append(("frames", list(slots)))
        out = []
        for s in slots:
            st = self.slots[s]
            assert st.prefilled and st.frames < st.request.frames
            st.frames += 1
            out.append(SimpleNamespace(slot=s, codes=1, finished=st.frames >= st.request.frames))
        self.clock.advance(self.cost_s["frames"])
        return out

    def audio(self, slots, max_frames=None):
        self.calls.append(("audio", list(slots)))
        pcm = {}
        for s in slots:
            st = self.slots[s]
            pcm[s] = [0.0] * ((st.frames - st.decoded) * FRAME_SAMPLES)
            st.decoded = st.frames
        self.clock.advance(self.cost_s["audio"])
        return pcm
