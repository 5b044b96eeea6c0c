"""benchmarks/serve/admission_sim.py: the CPU model of the server under load that the
admission slack (SchedulerConfig.admit_slack_s) was chosen on. Short runs of it check the
behaviour its README reports: light load is never refused, and at a load where admitted
streams underrun the slack keeps more of them on time by refusing more."""

from __future__ import annotations

import pytest
from helpers_scripts import script_fixture

sim = script_fixture("benchmarks/serve/admission_sim.py")


def test_light_load_is_never_refused_and_never_late(sim):
    a = sim.parse_args(["--duration", "5"])
    out = sim.simulate(20, 0.04, a, (1, 1, 2, 4, 8, 12))
    assert out.sent > 60 and out.refused == 0 and out.late == 0
    assert out.admitted == out.sent and out.ttfa_p95_ms < 40


def test_a_warmup_leaves_the_first_arrivals_out_as_the_bench_does(sim):
    whole = sim.simulate(20, 0.0, sim.parse_args(["--duration", "5"]), (1, 1, 2, 4, 8, 12))
    a = sim.parse_args(["--duration", "5", "--warmup", "2"])
    later = sim.simulate(20, 0.0, a, (1, 1, 2, 4, 8, 12))  # the same arrivals (seeded)
    assert 0.45 * whole.sent < later.sent < 0.75 * whole.sent  # ~3 of 5 s
    assert later.admitted == later.sent and later.refused == 0
    assert 0.45 * whole.audio_s_per_s < later.audio_s_per_s < 1.5 * whole.audio_s_per_s


def test_the_admission_slack_trades_refusals_for_streams_on_time(sim):
    a = sim.parse_args(["--duration", "8"])
    plain = sim.simulate(60, 0.0, a, (1, 1, 2, 4, 8, 12))
    slack = sim.simulate(60, 0.04, a, (1, 1, 2, 4, 8, 12))
    assert plain.sent == slack.sent  # the same arrivals (seeded)
    assert plain.late >= 10  # the model's overload: admitted streams underrun...
    assert slack.late <= plain.late / 3  # ...far fewer with the slack,
    assert slack.refused > plain.refused  # for more refusals


def test_shared_gpu_steps_share_the_device_by_lane_weight_and_wait_for_their_inputs(sim):
    """The --shared-gpu model: a step alone takes its cost; two at once share the device
    (1 + overlap times one step's throughput, split by lane weight); a step launched later
    moves the end of one already running; a step waits for the one that makes its input."""
    gpu = sim.SharedGpu({"admit": 2.0, "lm": 1.0, "codec": 1.0}, overlap=0.5)
    a = gpu.launch("lm", 1.0, [], now=0.0)
    assert gpu.planned[a] == pytest.approx(1.0)  # alone
    b = gpu.launch("codec", 0.25, [], now=0.5)  # beside it: 0.75 each (1.5 / 2)
    assert gpu.planned[b] == pytest.approx(0.5 + 0.25 / 0.75)
    assert gpu.planned[a] == pytest.approx(0.5 + 0.25 / 0.75 + (0.5 - 0.25) / 1.0)
    c = gpu.launch("admit", 0.3, [a], now=0.6)  # waits for a, then runs at its own speed
    assert gpu.planned[c] > gpu.planned[a]
    d = gpu.launch("admit", 0.1, [], now=2.0)  # the device idle since: alone again
    assert gpu.planned[d] == pytest.approx(2.1)
    assert not gpu.deps.get(a) and a not in gpu.remaining  # finished ones are forgotten


def test_shared_gpu_admission_lane_work_slows_the_regular_lanes(sim):
    """On the shared device an admission-lane step (weight 3 to the frame lane's 1.5) takes
    most of it: a frame step running beside it ends later than alone."""
    alone = sim.SharedGpu({"admit": 3.0, "lm": 1.5, "codec": 1.0}, overlap=0.3)
    frame = alone.launch("lm", 0.005, [], now=0.0)
    shared = sim.SharedGpu({"admit": 3.0, "lm": 1.5, "codec": 1.0}, overlap=0.3)
    frame2 = shared.launch("lm", 0.005, [], now=0.0)
    shared.launch("admit", 0.004, [], now=0.0)
    assert shared.planned[frame2] > alone.planned[frame] * 1.3


@pytest.mark.parametrize("batch, steps", [(1, 3), (2, 2), (4, 1)])
def test_shared_gpu_prompts_admitted_together_take_one_prefill_step_per_batch(sim, batch, steps):
    from tests.serve.fakes import FakeClock, FakeRequest

    gpu = sim.SharedGpu({"admit": 3.0, "lm": 1.5, "codec": 1.0}, overlap=0.1)
    engine = sim.SharedGpuEngine(FakeClock(), num_slots=4, admission_lane=True, gpu=gpu,
                                 prefill_batch=batch, cost_s={"prefill": 0.002, "frames": 0.004,
                                                              "audio": 0.001})  # fmt: skip
    slots = [engine.admit(FakeRequest(8)) for _ in range(3)]
    engine.prefill(slots)
    ticket = engine.launch_frames(slots)  # on the admission lane, after the prompts
    assert ticket.done_at == pytest.approx(steps * 0.002 + 0.004)
