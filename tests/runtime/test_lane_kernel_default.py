"""The lane kernel as a checkpoint's default on a Hopper GPU (runtime.loader.lane_kernel_default):
when it applies, what it sets, and every reason it stays off (CPU: the GPU's capability and
the kernel's build are stand-ins here; the kernel itself is tested on the GPU)."""

import pytest
import torch

from ttsbuild.convert.init_random import load_variant
from ttsbuild.model.config import ModelConfig
from ttsbuild.runtime import cp_megaframe, loader
from ttsbuild.runtime.plan import DEFAULT_LANE_RESERVED_SMS, EnginePlan

CUDA = torch.device("cuda")


def _cfg(variant: str) -> ModelConfig:
    return ModelConfig.from_official(load_variant(variant)[0])


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 (settable) whose kernel build succeeds."""
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    monkeypatch.setattr(cp_megaframe, "extension", lambda threads=256: object())
    return cap


def test_an_fp8_plan_of_the_shipped_shapes_on_hopper_takes_the_lane_kernel(hopper):
    plan = EnginePlan.default(num_slots=64, precision="fp8")
    assert plan.lane_reserved_sms == DEFAULT_LANE_RESERVED_SMS  # what it had
    got = loader.lane_kernel_default(plan, _cfg("1.7b-customvoice"), CUDA)
    assert {k: getattr(got, k) for k in loader.LANE_KERNEL_PLAN} == loader.LANE_KERNEL_PLAN
    assert got.admission_lane == plan.admission_lane and got.batch_buckets == plan.batch_buckets
    # the 0.6B code predictor has the same shapes
    assert loader.lane_kernel_why_not(plan, _cfg("0.6b-customvoice"), CUDA) is None


@pytest.mark.parametrize("case, expect", [
    ("bf16", "bf16 engine"),
    ("ampere", "needs a Hopper GPU (CUDA compute capability 9.0"),
    ("blackwell", "needs a Hopper GPU (CUDA compute capability 9.0"),
    ("cpu", "needs a Hopper GPU (CUDA compute capability 9.0"),
    ("no lane", "no admission lane on batch bucket 1"),
    ("lane on 2", "no admission lane on batch bucket 1"),
    ("spec", "speculative"),
    ("tiny", "shipped 12 Hz code predictor's shapes"),
    ("no nvcc", "extension did not build (OSError: nvcc not found)"),
])  # fmt: skip
def test_the_lane_kernel_stays_off_with_the_reason(hopper, monkeypatch, case, expect):
    fields = {"no lane": {"admission_lane": (), "lane_reserved_sms": 0},
              "lane on 2": {"admission_lane": (2,)},
              "spec": {"speculative": {1: ("self", 3)}}}.get(case, {})
    plan = EnginePlan.default(num_slots=8, precision="bf16" if case == "bf16" else "fp8",
                              **fields)  # fmt: skip
    hopper["value"] = {"ampere": (8, 0), "blackwell": (10, 0)}.get(case, (9, 0))
    if case == "no nvcc":
        def fail(threads=256):
            raise OSError("nvcc not found")
        monkeypatch.setattr(cp_megaframe, "extension", fail)
    cfg = _cfg("tiny" if case == "tiny" else "1.7b-customvoice")
    device = torch.device("cpu") if case == "cpu" else CUDA
    assert expect in loader.lane_kernel_why_not(plan, cfg, device)
    assert loader.lane_kernel_default(plan, cfg, device) == plan  # unchanged


def test_the_extension_is_built_before_the_plan_takes_it(hopper, monkeypatch):
    """The build is tried where the plan is chosen (a host without nvcc serves the plan it
    had); build=False asks nothing of it."""
    built = []
    monkeypatch.setattr(cp_megaframe, "extension", lambda threads=256: built.append(threads))
    plan = EnginePlan.default(num_slots=8, precision="fp8")
    loader.lane_kernel_why_not(plan, _cfg("1.7b-customvoice"), CUDA, build=False)
    assert built == []
    loader.lane_kernel_why_not(plan, _cfg("1.7b-customvoice"), CUDA)
    assert built == [256]


class _Recorded(Exception):
    pass


@pytest.fixture
def opened_plan(monkeypatch):
    """open_engine's plan for a graph engine of tiny random weights, the lane kernel's checks
    passing (the GraphEngine is not built: its plan is recorded)."""
    from ttsbuild.runtime import graph_engine

    monkeypatch.setattr(loader, "lane_kernel_why_not", lambda plan, cfg, device, build=True: None)

    def record(models, plan, **kw):
        raise _Recorded(plan)

    monkeypatch.setattr(graph_engine, "GraphEngine", record)

    def open_(**kw):
        with pytest.raises(_Recorded) as got:
            loader.open_engine(None, "cpu", kind="graph", random_variant="tiny", num_slots=4,
                               precision="fp8", **kw)  # fmt: skip
        return got.value.args[0]

    return open_


def test_open_engine_gives_a_checkpoint_the_lane_kernel_unless_one_of_its_fields_is_asked(
        opened_plan):  # fmt: skip
    plan = opened_plan()
    assert {k: getattr(plan, k) for k in loader.LANE_KERNEL_PLAN} == loader.LANE_KERNEL_PLAN
    assert opened_plan(admission_lane=(1,)).megaframe_code_predictor  # the lane keeps bucket 1
    # any of its four fields asked: the plan as asked (megaframe_regular True is the plan's
    # own value: nothing to change), the kernel off
    for asked in ({"megaframe_code_predictor": False}, {"code_predictor_fp8": False},
                  {"lane_reserved_sms": 8}, {"megaframe_regular": True}):  # fmt: skip
        plan = opened_plan(**asked)
        assert not plan.megaframe_code_predictor, asked
    assert opened_plan(lane_reserved_sms=8).lane_reserved_sms == 8
    assert not opened_plan(admission_lane=(2,)).megaframe_code_predictor


def test_the_default_is_the_plan_the_served_flags_give(opened_plan):
    """The H200's sweep ran `--fp8-code-predictor --megaframe-code-predictor
    --megaframe-lane-only`: the default must be that plan, field for field."""
    flags = opened_plan(code_predictor_fp8=True, megaframe_code_predictor=True,
                        megaframe_regular=False)  # fmt: skip
    assert opened_plan() == flags


def test_a_plan_that_refuses_the_lane_kernel_is_served_as_it_was(hopper, monkeypatch):
    """Should the plan's own rules refuse the fields (a rule lane_kernel_why_not does not know),
    the engine opens with the plan it had, not with an error."""
    def refuse(plan, **fields):
        raise ValueError("a new rule")

    monkeypatch.setattr(loader, "plan_update", refuse)
    plan = EnginePlan.default(num_slots=8, precision="fp8")
    assert loader.lane_kernel_default(plan, _cfg("1.7b-customvoice"), CUDA) == plan
