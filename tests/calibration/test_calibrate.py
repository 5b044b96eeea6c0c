"""`ttsbuild calibrate` on the tiny stand-in: every linear and every KV layer gets a range."""

from __future__ import annotations

import json
import math

import pytest
import typer
from torch import nn
from typer.testing import CliRunner

from ttsbuild.calibration.calibrate import CalibrationError, load_calibration
from ttsbuild.calibration.cli import calibrate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from ttsbuild.convert.convert import convert_checkpoint
    from ttsbuild.convert.init_random import init_random

    d = tmp_path_factory.mktemp("calib")
    init_random(d / "src", "tiny", seed=0)
    convert_checkpoint(d / "src", d / "ckpt")
    return d / "ckpt"


@pytest.fixture(scope="module")
def calib_path(ckpt, tmp_path_factory):
    app = typer.Typer()
    app.command()(calibrate)
    out = tmp_path_factory.mktemp("out") / "calib.json"
    res = CliRunner().invoke(app, [str(ckpt), "-o", str(out), "--num-texts", "3",
                                   "--max-frames", "3", "--device", "cpu", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "random-weight stand-in" in res.output
    return out


def test_every_linear_and_kv_layer_has_a_range(ckpt, calib_path):
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.runtime.engine import Models

    doc = load_calibration(calib_path)
    models = Models.load(load_checkpoint(ckpt), "cpu")
    for kind in ("talker", "code_predictor"):
        module = getattr(models, kind)
        linears = {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
        got = doc["modules"][kind]
        assert set(got["linears"]) == linears, kind
        for name, entry in got["linears"].items():
            for v in entry.values():
                assert math.isfinite(v) and v > 0, (kind, name)
        layers = module.cfg.talker if kind == "talker" else module.cfg.code_predictor
        for key in ("k_amax", "v_amax"):
            assert len(got["kv_cache"][key]) == layers.num_layers
            assert all(math.isfinite(v) and v > 0 for v in got["kv_cache"][key])
    # The weight range is the weight's own maximum (max calibration of a static tensor).
    w = models.talker.model.layers[0].self_attn.q_proj.weight
    got = doc["modules"]["talker"]["linears"]["model.layers.0.self_attn.q_proj"]["weight_amax"]
    assert got == pytest.approx(w.abs().max().item(), rel=1e-6)
    assert len(doc["texts"]) == 3 and doc["texts"][0].startswith("The birch canoe")
    assert doc["method"]["modelopt_version"] == "0.47.0"
    assert doc["run"]["frames"] == [3, 3, 3]
    assert len(doc["checkpoint"]["manifest_sha256"]) == 64


def test_refuses_other_version_and_bad_values(calib_path, tmp_path):
    doc = json.loads(calib_path.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "format_version": 9}))
    with pytest.raises(CalibrationError, match="version 9 is not supported"):
        load_calibration(bad)
    doc["modules"]["talker"]["kv_cache"]["k_amax"][0] = 0.0
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="talker layer 0 k_amax = 0.0"):
        load_calibration(bad)


def test_cli_error_is_plain(tmp_path):
    app = typer.Typer()
    app.command()(calibrate)
    res = CliRunner().invoke(app, [str(tmp_path / "nope"), "-o", str(tmp_path / "c.json"),
                                   "--device", "cpu"])
    assert res.exit_code == 1 and "error:" in res.output and "Traceback" not in res.output


def test_kv_range_is_per_layer_over_written_entries():
    import torch

    from ttsbuild.calibration.calibrate import KVRange
    from ttsbuild.model.config import DecoderStackConfig
    from ttsbuild.model.layers import KVCache

    cfg = DecoderStackConfig(8, 16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4,
                             rms_norm_eps=1e-6, rope_theta=1e4)
    cache = KVCache(cfg, num_slots=4, max_len=6, dtype=torch.float32)
    for layer in range(3):
        cache.k[layer, 1, :, 2] = -(layer + 1.0)  # written below
        cache.v[layer, 3, :, 0] = 10.0 * (layer + 1)
        cache.k[layer, 0, :, 5] = 99.0  # never written by this call: ignored
    kv = KVRange(3)
    kv.observe(cache, torch.tensor([1, 3]), torch.tensor([[2], [0]]))
    assert kv.k.tolist() == [1.0, 2.0, 3.0] and kv.v.tolist() == [10.0, 20.0, 30.0]
