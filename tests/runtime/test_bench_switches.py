"""benchmarks/kernels/bench_switches.py on the CPU (--tiny): every variant really runs its
switches, the quantised-row switches change no bit on the references, and bad arguments are
refused with exit 2."""

import pytest
from helpers_scripts import script_fixture

from ttsbuild.runtime import fast_model

bench = script_fixture("benchmarks/kernels/bench_switches.py")


def _served(bench, monkeypatch, **on):
    """The baseline's switches: all off but `on` (what the tests count from), whatever the
    defaults and the environment say."""
    monkeypatch.setattr(bench, "SERVED", {n: on.get(n, False) for n in bench.SWITCHES})


def test_arguments_are_parsed_and_bad_ones_refused(bench, capsys, monkeypatch):
    _served(bench, monkeypatch, A8_NORM_QUANT=True)
    assert bench.parse_variants("-A8_NORM_QUANT; A8_SILU_QUANT,A8_GATE_UP_SILU;") == [
        ("base", {}), ("-A8_NORM_QUANT", {"A8_NORM_QUANT": False}),
        ("A8_SILU_QUANT+A8_GATE_UP_SILU", {"A8_SILU_QUANT": True, "A8_GATE_UP_SILU": True}),
    ]  # fmt: skip
    for text in ("A8_NORM_QUANT", "-A8_SILU_QUANT", "A8_NORM_QUANT,-A8_SILU_QUANT",
                 "A8_SILU_QUANT,-A8_SILU_QUANT"):  # the baseline again, or a switch twice
        with pytest.raises(ValueError):
            bench.parse_variants(text)
    assert bench.parse_shapes("decode:64, prefill:4x32") == [("decode", 64, 1),
                                                             ("prefill", 4, 32)]  # fmt: skip
    for argv in (
        ["--variants", "A8_NORM_QUANTS"],
        ["--variants=-A8_SILU_QUANT"],
        ["--shapes", "prefill:4"],
        ["--shapes", "decode:0"],
        ["--shapes", "verify:2"],
        ["--rounds", "0"],
    ):
        assert bench.main([*argv, "--tiny"]) == 2
        assert "error:" in capsys.readouterr().err


def test_variants_run_their_switches_and_keep_the_bits(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors: the references
    _served(bench, monkeypatch)
    seen = {"handed": 0, "gate_up": 0}
    real_hand, real_w8a8 = fast_model.Dense.hand_quantized, fast_model.fp8_linear_w8a8

    def hand(self, x, quantized):
        seen["handed"] += 1
        real_hand(self, x, quantized)

    def w8a8(*args, **kwargs):
        seen["gate_up"] += bool(kwargs.get("gate_up"))
        return real_w8a8(*args, **kwargs)

    monkeypatch.setattr(fast_model.Dense, "hand_quantized", hand)
    monkeypatch.setattr(fast_model, "fp8_linear_w8a8", w8a8)
    counts = {}
    real_run = bench.Runner.run

    def run(self):
        before = dict(seen)
        real_run(self)
        key = tuple(sorted(self.flags))
        counts[key] = {k: seen[k] - before[k] for k in seen}

    monkeypatch.setattr(bench.Runner, "run", run)
    # 16 prompt rows: W8A8 (the plan's default from 16 rows), where the switches act
    variants = bench.parse_variants("A8_NORM_QUANT;A8_SILU_QUANT;A8_GATE_UP_SILU")
    rows = bench.run(variants, [("prefill", 1, 16)], rounds=2, replays=1, tiny=True,
                     log=lambda *_: None)  # fmt: skip
    assert [r["variant"] for r in rows] == [name for name, _ in variants]
    layers = len(bench.make_stack("tiny", "cpu", bench.torch.float32)[1].layers)
    assert counts[()] == {"handed": 0, "gate_up": 0}
    # the norms before qkv and gate/up hand their rows quantised; silu_mul before down
    assert counts[("A8_NORM_QUANT",)] == {"handed": 2 * layers, "gate_up": 0}
    assert counts[("A8_SILU_QUANT",)] == {"handed": layers, "gate_up": 0}
    assert counts[("A8_GATE_UP_SILU",)] == {"handed": 0, "gate_up": layers}
    for r in rows:
        assert r["rel_diff"] == 0.0, r  # the same bits as the baseline on the references
        assert r["ms"] > 0 and len(r["rounds_ms"]) == 2
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
    base = next(r for r in rows if r["variant"] == "base")
    assert base["ratio"] == base["ratio_min"] == base["ratio_max"] == 1.0


@pytest.mark.parametrize("flags", [{}, {"A8_NORM_QUANT": False, "CP_ATTEND_IN_QKV": True}])
def test_switched_sets_its_flags_the_rest_as_served_and_restores_them(bench, monkeypatch,
                                                                      flags):  # fmt: skip
    from ttsbuild.runtime import cp_fused

    _served(bench, monkeypatch, A8_NORM_QUANT=True, A8_GATE_UP_SILU=True)
    monkeypatch.setattr(fast_model, "A8_SILU_QUANT", True)  # changed since the script started
    monkeypatch.setattr(fast_model, "A8_NORM_QUANT", False)
    with bench.switched(flags):
        assert {n: getattr(*bench.SWITCHES[n]) for n in bench.SWITCHES} == {
            n: flags.get(n, n in ("A8_NORM_QUANT", "A8_GATE_UP_SILU")) for n in bench.SWITCHES
        }
    assert fast_model.A8_SILU_QUANT is True and fast_model.A8_NORM_QUANT is False
    assert cp_fused.ATTEND_IN_QKV is False


def test_the_baseline_is_the_served_switches(bench):
    """SERVED is read from the modules when the script starts (the defaults, or what the
    environment turned on or off): the baseline times what is served."""
    assert bench.SERVED == {n: bool(getattr(*bench.SWITCHES[n])) for n in bench.SWITCHES}
    assert bench.SERVED["A8_NORM_QUANT"] == fast_model.A8_NORM_QUANT
    for _name, flags in bench.parse_variants(bench.DEFAULT_VARIANTS)[1:]:
        assert any(bench.SERVED[n] != on for n, on in flags.items())


def test_code_predictor_variants_run_their_switches(bench, monkeypatch):
    """cp:B runs the code predictor's frame; its two switches take their one-launch kernels
    (qkv + attention per layer and pass, head + sampler per codebook) and keep the codes."""
    from ttsbuild.runtime import cp_fused

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _served(bench, monkeypatch)
    calls = {"attend": 0, "sample": 0}
    for key, name in (("attend", "norm_linear_attend"), ("sample", "norm_linear_sample")):
        real = getattr(cp_fused, name)

        def spy(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cp_fused, name, spy)
    counts = {}
    real_run = bench.Runner.run

    def run(self):
        before = dict(calls)
        real_run(self)
        counts[tuple(sorted(self.flags))] = {k: calls[k] - before[k] for k in calls}

    monkeypatch.setattr(bench.Runner, "run", run)
    variants = bench.parse_variants("CP_ATTEND_IN_QKV;CP_SAMPLE_IN_HEAD")
    rows = bench.run(variants, [("cp", 1, 1)], rounds=1, replays=1, tiny=True,
                     log=lambda *_: None)  # fmt: skip
    cfg = bench.model_config("tiny").code_predictor
    groups = bench.model_config("tiny").num_code_groups
    assert counts[()] == {"attend": 0, "sample": 0}
    # every layer of every pass (G passes: [h, E0(c0)] then one per codebook 1..G-2)
    assert counts[("CP_ATTEND_IN_QKV",)] == {"attend": cfg.num_layers * groups, "sample": 0}
    assert counts[("CP_SAMPLE_IN_HEAD",)] == {"attend": 0, "sample": groups - 1}
    assert [r["rel_diff"] for r in rows] == [0.0, 0.0, 0.0]  # greedy codes: all the same


def _counted_per_variant(bench, monkeypatch, name, counts_call, variant, shapes):
    """Run `variant` against the baseline (switches all off but it) on the tiny model, with
    cp_fused.<name> spied: per variant's flags, how many calls `counts_call(kwargs)` counted.
    Returns (counts, rows)."""
    from ttsbuild.runtime import cp_fused

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _served(bench, monkeypatch)
    calls = {"n": 0}
    real = getattr(cp_fused, name)

    def spy(*args, **kwargs):
        calls["n"] += counts_call(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(cp_fused, name, spy)
    counts = {}
    real_run = bench.Runner.run

    def run(self):
        before = calls["n"]
        real_run(self)
        counts[tuple(sorted(self.flags))] = calls["n"] - before

    monkeypatch.setattr(bench.Runner, "run", run)
    rows = bench.run(bench.parse_variants(variant), shapes, rounds=1, replays=1, tiny=True,
                     log=lambda *_: None)  # fmt: skip
    return counts, rows


def test_the_pair_prefill_variant_runs_its_two_token_pass(bench, monkeypatch):
    """CP_PAIR_PREFILL: the frame's prefill as one pass of both tokens (every layer's
    attention once with tokens=2), the baseline never; the same greedy codes."""
    counts, rows = _counted_per_variant(bench, monkeypatch, "qk_norm_rope_attend",
                                        lambda kw: kw.get("tokens", 1) == 2, "CP_PAIR_PREFILL",
                                        [("cp", 1, 1)])  # fmt: skip
    layers = bench.model_config("tiny").code_predictor.num_layers
    assert counts == {(): 0, ("CP_PAIR_PREFILL",): layers}
    assert [r["rel_diff"] for r in rows] == [0.0, 0.0]


def test_a_variant_runs_only_on_the_shapes_its_switches_act_on(bench, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _served(bench, monkeypatch)
    assert bench.acts({}, "cpp") and bench.acts({"A8_NORM_QUANT": True}, "prefill")
    assert not bench.acts({"A8_NORM_QUANT": True}, "cp")
    assert bench.acts({"A8_NORM_QUANT": True, "CP_PASS_PREFETCH": True}, "cpp")
    variants = bench.parse_variants("A8_SILU_QUANT;CP_SAMPLE_IN_HEAD")
    rows = bench.run(variants, [("decode", 1, 1), ("cp", 1, 1)], rounds=1, replays=1,
                     tiny=True, log=lambda *_: None)  # fmt: skip
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("decode 1", "base"), ("decode 1", "A8_SILU_QUANT"),
        ("cp 1", "base"), ("cp 1", "CP_SAMPLE_IN_HEAD"),
    ]  # fmt: skip


def test_rows_are_written_after_each_shape(bench, monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "rows.json"
    assert bench.main(["--tiny", "--rounds", "1", "--replays", "1", "--variants",
                       "A8_SILU_QUANT", "--shapes", "decode:1,prefill:1x16",
                       "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("decode 1", "base"), ("decode 1", "A8_SILU_QUANT"),
        ("prefill 1x16", "base"), ("prefill 1x16", "A8_SILU_QUANT"),
    ]  # fmt: skip


def test_the_attend_o_variant_runs_its_launch(bench, monkeypatch):
    """CP_ATTEND_O: every one-token pass's layers run attend_o_residual, the baseline never;
    the same greedy codes."""
    counts, rows = _counted_per_variant(bench, monkeypatch, "attend_o_residual", lambda kw: 1,
                                        "CP_ATTEND_O", [("cp", 1, 1)])  # fmt: skip
    cfg = bench.model_config("tiny")
    # the prefill as two one-token passes (the pair pass off here), then one per codebook
    passes = cfg.num_code_groups
    assert counts == {(): 0, ("CP_ATTEND_O",): cfg.code_predictor.num_layers * passes}
    assert [r["rel_diff"] for r in rows] == [0.0, 0.0]
