"""benchmarks/runtime/host_step.py (the frame step's host bookkeeping) keeps running, and
the core's collected rows are what the backend returned: made frames carry their codes."""

import torch
from helpers_scripts import script_fixture

host_step = script_fixture("benchmarks/runtime/host_step.py")


def test_host_step_times_a_step_of_every_row(host_step):
    assert host_step.time_step(5, reps=3) > 0


def test_collected_rows_carry_the_backends_codes_and_stops(host_step):
    from ttsbuild.runtime.core import EngineCore, SlotPlan
    from ttsbuild.runtime.plan import EnginePlan

    backend = host_step.StubBackend()
    engine = EngineCore(backend, EnginePlan.default(num_slots=8, max_len=64))
    plan = SlotPlan(prompt=None, params=None, frame_limit=2, by_length_rule=True, seed=0)
    slots = [engine.admit_plan(plan) for _ in range(3)]
    rows = torch.randint(0, 2048, (3, host_step.GROUPS + 1))
    rows[:, -1] = torch.tensor([0, 1, 0])  # the middle row's request ends (EOS)
    backend.rows[3] = rows
    outs = engine.frames(slots)
    assert [o.slot for o in outs] == slots
    assert [o.made for o in outs] == [True, False, True]
    assert torch.equal(outs[0].codes, rows[0, :-1]) and outs[1].codes is None
    assert torch.equal(outs[2].codes, rows[2, :-1])
    assert [o.finished for o in outs] == [False, True, False]
    assert engine.stopped_by(slots[1]) == "eos"
    for s in (slots[0], slots[2]):
        engine.table[s].decoded = engine.table[s].launched
    second = engine.frames([slots[0], slots[2]])  # the frame limit (2) ends both
    assert [o.finished for o in second] == [True, True] and all(o.made for o in second)
