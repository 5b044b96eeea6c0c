"""The engine microbenchmark's plan options (CPU: the plan only; the benchmark needs a GPU)."""

import pytest

from ttsbuild.bench.engine_bench import bench_plan, parse_plan_set


def test_plan_set_fields_reach_the_plan_and_bad_ones_are_refused():
    default = bench_plan("fp8", (1, 64))
    for value in (True, False):
        fields = parse_plan_set([f"codec_fused_attention={str(value).lower()}",
                                 f"codec_fused_output={str(value).lower()}"])
        plan = bench_plan("fp8", (1, 64), plan_set=fields)
        assert plan.codec_fused_attention is value and plan.codec_fused_output is value
        assert plan.fused_code_predictor == default.fused_code_predictor  # the rest untouched
    with pytest.raises(SystemExit, match="EnginePlan field"):
        parse_plan_set(["no_such_field=1"])
    with pytest.raises(SystemExit, match="not JSON"):
        parse_plan_set(["codec_fused_output=yes"])
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        parse_plan_set(["codec_fused_output"])
