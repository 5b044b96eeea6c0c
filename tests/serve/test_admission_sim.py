"""benchmarks/serve/admission_sim.py: the CPU model of the server under load that the
admission slack (SchedulerConfig.admit_slack_s) was chosen on. Short runs of it check the
behaviour its README reports: light load is never refused, and at a load where admitted
streams underrun the slack keeps more of them on time by refusing more."""

from __future__ import annotations

from helpers_scripts import script_fixture

sim = script_fixture("benchmarks/serve/admission_sim.py")


def test_light_load_is_never_refused_and_never_late(sim):
    a = sim.parse_args(["--duration", "5"])
    out = sim.simulate(20, 0.04, a, (1, 1, 2, 4, 8, 12))
    assert out.sent > 60 and out.refused == 0 and out.late == 0
    assert out.admitted == out.sent and out.ttfa_p95_ms < 40


def test_the_admission_slack_trades_refusals_for_streams_on_time(sim):
    a = sim.parse_args(["--duration", "8"])
    plain = sim.simulate(60, 0.0, a, (1, 1, 2, 4, 8, 12))
    slack = sim.simulate(60, 0.04, a, (1, 1, 2, 4, 8, 12))
    assert plain.sent == slack.sent  # the same arrivals (seeded)
    assert plain.late >= 10  # the model's overload: admitted streams underrun...
    assert slack.late <= plain.late / 3  # ...far fewer with the slack,
    assert slack.refused > plain.refused  # for more refusals
