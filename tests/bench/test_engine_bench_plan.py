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
    # a field the benchmark sets itself is overridden, not passed twice (2026-12-07 on the
    # H200: `--plan-set fused_code_predictor=[...]` raised "multiple values")
    wide = bench_plan("fp8", (1, 16, 32), plan_set=parse_plan_set(
        ["fused_code_predictor=[1, 2, 4, 8, 16, 32]", "cp_w8a8_min_rows=64"]))
    assert wide.fused_code_predictor == (1, 2, 4, 8, 16, 32) and wide.cp_w8a8_min_rows == 64
    assert bench_plan("fp8", (1, 16, 32)).fused_code_predictor == (1, 2, 4, 8, 16)
    # the one-kernel talker step needs every SM: no lane reserve beside it unless asked
    # (2026-12-07 on the H200: `--plan-set talker_megastep=true` was refused)
    mega = bench_plan("fp8", (1, 64), plan_set={"talker_megastep": True})
    assert mega.talker_megastep and mega.lane_reserved_sms == 0
    assert bench_plan("fp8", (1, 64)).lane_reserved_sms > 0
    # the talker's cache as compile makes a calibrated FP8 engine: FP8, but not beside the
    # one-kernel talker step (which has none) nor for bf16, and a side can turn it off; the
    # fused talker reads it
    assert default.talker_kv_fp8
    assert not mega.talker_kv_fp8 and not bench_plan("bf16", (1, 64)).talker_kv_fp8
    assert bench_plan("fp8", (1, 64), fused_talker_max_batch=8).talker_kv_fp8
    assert bench_plan("fp8", (1, 64), plan_set={"fused_talker": [1]}).talker_kv_fp8
    assert not bench_plan("fp8", (1, 64), plan_set={"talker_kv_fp8": False}).talker_kv_fp8
    with pytest.raises(SystemExit, match="EnginePlan field"):
        parse_plan_set(["no_such_field=1"])
    with pytest.raises(SystemExit, match="not JSON"):
        parse_plan_set(["codec_fused_output=yes"])
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        parse_plan_set(["codec_fused_output"])


def test_fresh_resolve_resolves_every_prompt_once_with_the_word_table_warmed():
    """host_resolve_fresh_ms (CPU: the engine's resolve needs no GPU): the shipped voice-agent
    prompts, each resolved once after the tokenizer's warm_words, and a time for them."""
    from ttsbuild.bench.engine_bench import _resolve_fresh_ms
    from ttsbuild.runtime.loader import open_engine

    engine = open_engine(None, device="cpu", kind="graph", random_variant="tiny", num_slots=2)
    seen = []
    resolve = engine.resolve
    engine.resolve = lambda req: seen.append(req.text) or resolve(req)
    ms = _resolve_fresh_ms(engine, prompts=20)
    assert len(seen) == len(set(seen)) == 20 and 0 < ms < 1000
    assert len(engine.models.tokenizer._words) > 500  # warmed before the first prompt


def test_the_plan_line_says_what_the_code_predictor_and_the_lane_run():
    from ttsbuild.runtime.loader import LANE_KERNEL_PLAN, plan_update

    fused = bench_plan("fp8", (1, 64)).summary()
    assert "code predictor bf16, one-kernel frame off" in fused and "16 reserved SMs" in fused
    lane = plan_update(bench_plan("fp8", (1, 64)), **LANE_KERNEL_PLAN).summary()
    assert "code predictor FP8, one-kernel frame on the admission lane only" in lane
    assert "admission lane [1, 2] with 0 reserved SMs" in lane


def test_context_outside_the_cache_is_refused(monkeypatch, capsys):
    """--context: a negative position is a usage error before any weights load; one past the
    plan's cache a clear ValueError before the engine is built."""
    import sys

    from ttsbuild.bench import engine_bench

    monkeypatch.setattr(sys, "argv", ["engine_bench", "--context", "-3"])
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--context must be a position >= 0" in err
    plan = bench_plan("fp8", (1, 64))
    with pytest.raises(ValueError, match="a position of the plan's cache"):
        engine_bench.bench_precision(None, plan, (1,), 1, print, context=plan.max_len)
