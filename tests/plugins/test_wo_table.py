"""The weight-only FP8 config table (`_tl.wo_table`, TTSBUILD_FP8_WO_TABLE): a sweep's winners
by launch shape, validated when loaded, taken by the launches of its shapes on its GPU model
ahead of the rule and the autotuner (the launches are recorded, not run: the GPU path without
a GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_device import record_fp8_launches

pytest.importorskip("triton")

from ttsbuild.plugins._tl import fp8_linear as tl_fp8  # noqa: E402
from ttsbuild.plugins._tl import wo_table  # noqa: E402
from ttsbuild.plugins.fp8_linear import quantize_weight_fp8  # noqa: E402

GPU = "NVIDIA H200"


def _cfg(n=64, k=128, split=4, warps=4, stages=3):
    return {"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split, "num_warps": warps, "num_stages": stages}


def _table(**overrides):
    entry = {"rows": 16, "N": 256, "K": 512, "gate_up": False, "config": _cfg(), "us": 7.6}
    entry.update(overrides)
    return {"gpu": GPU, "configs": [entry]}


def test_a_table_loads_and_gives_its_configs_by_shape_on_its_gpu(caplog):
    t = wo_table.parse({"gpu": GPU, "configs": [
        {"rows": 16, "N": 256, "K": 512, "config": _cfg()},
        {"rows": 1, "N": 256, "K": 512, "config": _cfg(8, 256, 1, 4, 1)},
        {"rows": 16, "N": 128, "K": 512, "gate_up": True, "config": _cfg(32, 128, 2)},
    ]})  # fmt: skip
    assert t.lookup(16, 256, 512, False, GPU) == _cfg()
    assert t.lookup(1, 256, 512, False, GPU) == _cfg(8, 256, 1, 4, 1)
    assert t.lookup(16, 128, 512, True, GPU) == _cfg(32, 128, 2)
    assert t.lookup(32, 256, 512, False, GPU) is None  # another row tile
    assert t.lookup(16, 128, 512, False, GPU) is None  # gate_up is part of the shape
    got = t.lookup(16, 256, 512, False, GPU)
    got["SPLIT_K"] = 1  # a copy: the caller cannot change the table
    assert t.lookup(16, 256, 512, False, GPU)["SPLIT_K"] == 4
    with caplog.at_level("WARNING"):
        assert t.lookup(16, 256, 512, False, "NVIDIA H100 80GB HBM3") is None
        assert t.lookup(16, 256, 512, False, "NVIDIA H100 80GB HBM3") is None
    warned = [r for r in caplog.records if "measured on NVIDIA H200" in r.getMessage()]
    assert len(warned) == 1  # once per device model


@pytest.mark.parametrize("bad,match", [
    ({"gpu": ""}, "gpu"),
    ({"configs": []}, "non-empty"),
    ({"configs": [{"rows": 8, "N": 256, "K": 512, "config": _cfg()}]}, "row tile"),
    ({"configs": [{"rows": True, "N": 256, "K": 512, "config": _cfg()}]}, "row tile"),
    ({"configs": [{"rows": 16, "N": -1, "K": 512, "config": _cfg()}]}, "N must be"),
    ({"configs": [{"rows": 16, "N": 256, "K": "512", "config": _cfg()}]}, "K must be"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "gate_up": 1, "config": _cfg()}]},
     "gate_up"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": {"BLOCK_N": 64}}]}, "exactly"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": _cfg(n=48)}]}, "power of 2"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": _cfg(split=16)}]}, "SPLIT_K <="),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": _cfg(k=256, split=4)}]},
     "multiple of BLOCK_K"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": _cfg(stages=0)}]}, "positive"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "gate_up": True,
                   "config": _cfg(128, 128, 1)}]}, "8192 weights"),
    ({"configs": [{"rows": 16, "N": 256, "K": 512, "config": _cfg()}] * 2}, "a second config"),
    ({"configs": ["x"]}, "an object"),
])  # fmt: skip
def test_a_bad_table_is_refused_with_what_is_wrong(bad, match):
    data = {**_table(), **bad}
    with pytest.raises(ValueError, match=match):
        wo_table.parse(data, "t.json")


def test_the_sweep_report_becomes_a_table_of_each_tiles_winner_at_its_most_rows():
    def result(M, N, top):
        return {"shape": "x", "M": M, "N": N, "K": 512, "top": [
            {"us": us, **_cfg(*c)} for us, c in top]}  # fmt: skip

    report = {"gpu": GPU, "torch": "2.11", "results": [
        result(2, 256, [(5.0, (32, 128, 2))]),
        result(8, 256, [(6.0, (64, 128, 4)), (6.1, (32, 128, 2))]),  # the 2-16 tile's
        result(1, 256, [(3.0, (8, 256, 1, 4, 1))]),
        result(32, 256, [(9.0, (64, 256, 2))]),
        result(8, 128, []),  # nothing timed: no entry
    ]}  # fmt: skip
    table = wo_table.from_sweep(report, tl_fp8.m_bucket)
    got = {(e["rows"], e["N"]): (e["config"], e["at_rows"]) for e in table["configs"]}
    assert got == {(16, 256): (_cfg(64, 128, 4), 8), (1, 256): (_cfg(8, 256, 1, 4, 1), 1),
                   (32, 256): (_cfg(64, 256, 2), 32)}  # fmt: skip
    t = wo_table.parse(json.loads(json.dumps(table)))
    assert t.gpu == GPU and t.lookup(16, 256, 512, False, GPU) == _cfg(64, 128, 4)


def test_launches_of_its_shapes_take_the_table_ahead_of_rule_and_autotuner(monkeypatch):
    launched = record_fp8_launches(monkeypatch)
    device = {"name": GPU}
    monkeypatch.setattr(tl_fp8, "_device_name", lambda dev: device["name"])
    table = wo_table.parse({"gpu": GPU, "configs": [
        {"rows": 16, "N": 256, "K": 512, "config": _cfg(32, 128, 2, 4, 4)},
        {"rows": 1, "N": 256, "K": 512, "config": _cfg(16, 512, 1, 2, 1)}]})  # fmt: skip
    monkeypatch.setattr(tl_fp8, "WO_TABLE", table)
    w, s = quantize_weight_fp8(torch.randn(256, 512))
    for rule in (False, True):
        monkeypatch.setattr(tl_fp8, "WO_RULE", rule)
        for M, want in ((1, _cfg(16, 512, 1, 2, 1)), (5, _cfg(32, 128, 2, 4, 4)),
                        (16, _cfg(32, 128, 2, 4, 4))):  # fmt: skip
            launched.clear()
            tl_fp8.fp8_linear_triton(torch.randn(M, 512).bfloat16(), w, s)
            (name, kw), = launched
            assert name == "_heur" and {k: kw[k] for k in want} == want, (rule, M, kw)
        launched.clear()
        tl_fp8.fp8_linear_triton(torch.randn(40, 512).bfloat16(), w, s)  # not in the table
        (name, kw), = launched
        if rule:
            want = tl_fp8.wo_config(40, 256, 512)
            assert name == "_heur" and {k: kw[k] for k in want} == want
        else:
            assert name == "_gemm"
    monkeypatch.setattr(tl_fp8, "WO_RULE", False)
    device["name"] = "NVIDIA H100 80GB HBM3"  # another model: the table does not apply
    monkeypatch.setattr(table, "_checked", {})
    launched.clear()
    tl_fp8.fp8_linear_triton(torch.randn(5, 512).bfloat16(), w, s)
    assert [n for n, _ in launched] == ["_gemm"]
    # an explicit config still wins
    launched.clear()
    tl_fp8.fp8_linear_triton(torch.randn(5, 512).bfloat16(), w, s, config=_cfg(64, 64, 1))
    assert launched[0][0] == "_heur" and launched[0][1]["BLOCK_K"] == 64


def test_the_table_is_read_at_import_and_a_bad_one_fails_it_clearly(tmp_path):
    code = ("import ttsbuild.plugins._tl.fp8_linear as f; t = f.WO_TABLE; "
            "print(t.gpu, len(t.configs))")  # fmt: skip
    good = tmp_path / "table.json"
    good.write_text(json.dumps(_table()))
    env = {**os.environ, "TTSBUILD_FP8_WO_TABLE": str(good)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["NVIDIA", "H200", "1"], out.stderr
    for text, match in (("{", "not JSON"), (json.dumps(_table(rows=8)), "row tile")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        env["TTSBUILD_FP8_WO_TABLE"] = str(bad)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True)  # fmt: skip
        assert out.returncode != 0 and match in out.stderr and str(bad) in out.stderr
    env["TTSBUILD_FP8_WO_TABLE"] = str(tmp_path / "missing.json")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "no file" in out.stderr


def test_a_processs_autotuned_picks_are_listed_in_the_tables_form(monkeypatch):
    """fp8_linear.autotuned: each tuning key's pick (the tuners' caches) as a table entry, so
    the engine bench logs them and two processes of one plan compare pick by pick; the list
    loads as a table."""
    import triton

    from ttsbuild.bench.engine_bench import _pick

    class Tuner:
        def __init__(self, cache):
            self.cache = cache

    dt = ("torch.bfloat16", "torch.float8_e4m3fn")
    monkeypatch.setattr(tl_fp8, "_gemv", Tuner({
        (4096, 2048, 1, False, *dt): triton.Config(
            {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1}, num_warps=4, num_stages=1)}))
    monkeypatch.setattr(tl_fp8, "_gemm", Tuner({
        (2048, 6144, 16, False, *dt): triton.Config(
            {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4}, num_warps=4, num_stages=3),
        (1024, 512, 16, True, *dt): triton.Config(
            {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2}, num_warps=8, num_stages=4)}))
    monkeypatch.setattr(tl_fp8, "TUNE_BY_ROWS", False)
    picks = tl_fp8.autotuned()
    assert [(e["rows"], e["N"], e["K"], e["gate_up"]) for e in picks] == [
        (1, 4096, 2048, False), (16, 1024, 512, True), (16, 2048, 6144, False)]
    assert picks[2]["config"] == _cfg(64, 256, 4, 4, 3)
    t = wo_table.parse({"gpu": GPU, "configs": picks})
    assert t.lookup(16, 1024, 512, True, GPU) == _cfg(32, 128, 2, 8, 4)
    assert _pick(picks[1]) == "16 1024x512 gate_up: 32x128 s2 w8 st4"
