"""The engine microbenchmark's plan options (CPU: the plan only; the benchmark needs a GPU)."""

import pytest

from ttsbuild.bench.engine_bench import bench_plan, parse_plan_set


def test_plan_set_fields_reach_the_plan_and_bad_ones_are_refused():
    fields = parse_plan_set(["codec_fused_attention=true", "codec_fused_output=true"])
    plan = bench_plan("fp8", (1, 64), plan_set=fields)
    assert plan.codec_fused_attention and plan.codec_fused_output
    assert not bench_plan("fp8", (1, 64)).codec_fused_attention  # the default plan's value
    with pytest.raises(SystemExit, match="EnginePlan field"):
        parse_plan_set(["no_such_field=1"])
    with pytest.raises(SystemExit, match="not JSON"):
        parse_plan_set(["codec_fused_output=yes"])
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        parse_plan_set(["codec_fused_output"])
