"""A compiled engine in the fast runtime: its packed (and FP8) tensors are used as compiled,
and the result equals the reference engine on the same (dequantised) weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ttsbuild.runtime.artifact import load_models
from ttsbuild.runtime.engine import EagerEngine, synthesize
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.loader import open_engine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest

REQ = SynthesisRequest(text="The birch canoe slid on the smooth planks.", voice="ryan", seed=4,
                       max_frames=10)  # fmt: skip


@pytest.mark.parametrize("which", ["bf16_engine", "fp8_engine"])
def test_graph_engine_runs_compiled_weights_as_compiled(which, request):
    path = request.getfixturevalue(which)
    models = load_models(path, "cpu")
    fast = GraphEngine(models, EnginePlan(num_slots=1, max_len=256, max_text=64,
                                          batch_buckets=(1,), prefill_buckets=(32,)),
                       use_graphs=False)  # fmt: skip
    assert fast.backend.talker_stack.is_fp8 == (which == "fp8_engine")
    packed = models.packed["talker"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert fast.backend.talker_stack.layers[0].qkv.weight is packed  # no copy, no re-quantisation
    reference, _ = synthesize(EagerEngine(models, 1, 256), REQ)
    got, stats = synthesize(fast, REQ)
    assert stats["frames"] == 10 and got.shape == reference.shape
    assert np.abs(got - reference).max() <= 1e-5


def test_open_engine_refuses_shapes_the_engine_was_not_compiled_for(fp8_engine):
    with pytest.raises(ValueError, match="compiled for at most"):
        open_engine(fp8_engine, "cpu", num_slots=200, kind="graph")


def test_the_admission_lane_is_compiled_in_and_can_be_set_at_load(fp8_engine):
    """compile's default plan has the lane on buckets 1 and 2; open_engine may set it to other
    batch buckets of the plan (its graphs are captured at load) and refuses others clearly;
    fewer slots drop the buckets above them."""
    manifest = json.loads((fp8_engine / "manifest.json").read_text())
    compiled = EnginePlan.model_validate(manifest["plan"])
    assert compiled.admission_lane == (1, 2)
    off = open_engine(fp8_engine, "cpu", kind="graph", admission_lane=())
    assert off.plan.admission_lane == () and not off.backend.lane_on
    # what only a lane has goes with it (the compiled plan reserves SMs for it) ...
    assert compiled.lane_reserved_sms > 0 and off.plan.lane_reserved_sms == 0
    # ... and a plan the validators refuse cannot be made at load either
    with pytest.raises(ValueError, match="needs an admission lane"):
        open_engine(fp8_engine, "cpu", kind="graph", admission_lane=(), lane_reserved_sms=8)
    one = open_engine(fp8_engine, "cpu", kind="graph", admission_lane=(1,))
    assert one.plan.admission_lane == (1,) and one.backend.lane_on
    with pytest.raises(ValueError, match=r"admission lane buckets \[3\] must be batch buckets"):
        open_engine(fp8_engine, "cpu", kind="graph", admission_lane=(3,))
    small = open_engine(fp8_engine, "cpu", kind="graph", num_slots=1)
    assert small.plan.admission_lane == (1,)
    assert set(small.plan.fused_code_predictor) <= set(small.plan.batch_buckets) == {1}


def test_the_bf16_copies_of_a_compiled_fp8_engine_can_be_set_at_load(fp8_engine):
    """`serve --bf16-min-rows`: the talker's FP8 linears get bf16 copies (made at load) used
    from that many rows; 0 keeps the FP8 weights alone."""
    on = open_engine(fp8_engine, "cpu", kind="graph", bf16_min_rows=16)
    dense = on.backend.talker_stack.layers[0].qkv
    assert on.plan.bf16_min_rows == 16 and dense.bf16_min_rows == 16
    assert dense.bf16_weight is not None and dense.bf16_weight.shape == dense.weight.shape
    off = open_engine(fp8_engine, "cpu", kind="graph", bf16_min_rows=0)
    assert off.backend.talker_stack.layers[0].qkv.bf16_weight is None


def test_the_code_predictors_bf16_copies_can_be_set_at_load(ckpt):
    """`serve --cp-bf16-min-rows`: an FP8 code predictor's linears get bf16 copies (made at
    load) from that many rows where a bucket reaches it; 0 keeps its FP8 weights alone; a
    negative threshold is refused."""
    kw = dict(kind="graph", precision="fp8", code_predictor_fp8=True, num_slots=2)
    on = open_engine(ckpt, "cpu", cp_bf16_min_rows=1, **kw)
    dense = on.backend.cp_stack.layers[0].gate_up
    assert on.plan.cp_bf16_min_rows == 1 and dense.is_fp8 and dense.bf16_min_rows == 1
    assert dense.bf16_weight is not None and dense.bf16_weight.shape == dense.weight.shape
    off = open_engine(ckpt, "cpu", cp_bf16_min_rows=0, **kw)
    assert off.backend.cp_stack.layers[0].gate_up.bf16_weight is None
    with pytest.raises(ValueError, match="cp_bf16_min_rows must be >= 0"):
        open_engine(ckpt, "cpu", cp_bf16_min_rows=-1, **kw)


def test_w8a8_of_a_compiled_fp8_engine_can_be_set_at_load(fp8_engine):
    """`serve --w8a8-min-rows`: compiled with the default (W8A8 from 16 rows), set at load to
    another threshold or 0 (weight-only), on every talker linear; a negative one is refused."""
    served = open_engine(fp8_engine, "cpu", kind="graph")
    layer = served.backend.talker_stack.layers[0]
    assert served.plan.w8a8_min_rows == 16
    assert {d.w8a8_min_rows for d in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {16}
    off = open_engine(fp8_engine, "cpu", kind="graph", w8a8_min_rows=0)
    assert off.plan.w8a8_min_rows == 0
    assert not off.backend.talker_stack.layers[0].qkv.takes_w8a8(32, cuda=False)
    assert served.backend.talker_stack.layers[0].qkv.takes_w8a8(32, cuda=False)
    with pytest.raises(ValueError, match="w8a8_min_rows must be >= 0"):
        open_engine(fp8_engine, "cpu", kind="graph", w8a8_min_rows=-1)


def test_the_codec_conv_layout_can_be_set_at_load(fp8_engine):
    """`serve --codec-channels-last`: a layout choice made at load, for compiled engines too."""
    compiled = open_engine(fp8_engine, "cpu", kind="graph").plan.codec_channels_last
    flipped = open_engine(fp8_engine, "cpu", kind="graph", codec_channels_last=not compiled)
    assert flipped.plan.codec_channels_last is (not compiled)
    fused = open_engine(fp8_engine, "cpu", kind="graph", codec_fused_output=True)
    assert fused.plan.codec_fused_output and fused.backend.codec_engine.fused_output is False
    attn = open_engine(fp8_engine, "cpu", kind="graph", codec_fused_attention=True)
    assert attn.plan.codec_fused_attention and attn.backend.codec_engine.fused_attention
    plain = open_engine(fp8_engine, "cpu", kind="graph", codec_fused_output=False,
                        codec_fused_attention=False)
    assert not plain.plan.codec_fused_output and not plain.plan.codec_fused_attention
    assert plain.backend.codec_engine.fused_attention is False


def test_the_largest_batch_bucket_can_be_lowered_at_load_never_raised(fp8_engine):
    """`serve --max-batch`: the plan's buckets stop at that size (and the plan's per-bucket
    choices with them); more than was compiled is a clear error."""
    compiled = open_engine(fp8_engine, "cpu", kind="graph").plan
    assert compiled.max_batch >= 2, compiled.batch_buckets
    one = open_engine(fp8_engine, "cpu", kind="graph", max_batch=1)
    assert one.plan.batch_buckets == (1,) and one.plan.admission_lane == (1,)
    assert set(one.plan.fused_code_predictor) <= {1}
    with pytest.raises(ValueError, match="exceeds the plan's largest batch bucket"):
        open_engine(fp8_engine, "cpu", kind="graph", max_batch=compiled.max_batch + 1)


def test_a_checkpoint_plan_steps_all_its_slots_and_max_batch_lowers_it(ckpt):
    """A checkpoint's default plan steps up to all of its slots in one step, 256 rows with the
    256 slots `compile` and a GPU `serve` default to (slots up to 256, issue 9; measured on
    the H200, benchmarks/serve/2026-12-03-h200-capacity-256); --max-batch lowers it."""
    wide = open_engine(ckpt, "cpu", num_slots=256, kind="eager").plan
    assert wide.batch_buckets[-2:] == (128, 256) and wide.num_slots == 256
    half = open_engine(ckpt, "cpu", num_slots=256, kind="eager", max_batch=128).plan
    assert half.max_batch == 128 and half.batch_buckets[-2:] == (64, 128)
    assert half.num_slots == 256
    low = open_engine(ckpt, "cpu", num_slots=128, kind="eager", max_batch=64).plan
    assert low.max_batch == 64 and low.num_slots == 128
    with pytest.raises(ValueError, match="exceeds the plan's largest batch bucket"):
        open_engine(ckpt, "cpu", num_slots=32, kind="eager", max_batch=64)


def test_slots_fit_the_free_memory_with_the_reserve_kept():
    """slots_that_fit: all that was asked for where it fits; otherwise multiples of 8 below
    what fits (one slot's worth kept for the padding row), at least one. The real 1.7B
    talker's slot at 2048 positions: ~235 MB of KV cache, so an 80 GB GPU holds 256 slots,
    a 48 GB one 136 and a 24 GB one 32."""
    from ttsbuild.model.config import DecoderStackConfig
    from ttsbuild.runtime.loader import (
        FIT_RESERVE_BYTES,
        SLOT_STATE_BYTES,
        slot_bytes,
        slots_that_fit,
    )

    talker = DecoderStackConfig.from_official(_real_talker_config(), "talker")
    per_slot = slot_bytes(talker, 2048)
    assert per_slot == 2 * 28 * 8 * 128 * 2048 * 2 + SLOT_STATE_BYTES
    assert slots_that_fit(256, per_slot, 75 * 10**9) == 256
    assert slots_that_fit(256, per_slot, 44 * 10**9) == 136
    assert slots_that_fit(256, per_slot, 20 * 10**9) == 32
    assert slots_that_fit(256, per_slot, FIT_RESERVE_BYTES + 3 * per_slot) == 2  # below 8
    assert slots_that_fit(256, per_slot, FIT_RESERVE_BYTES // 2) == 1
    assert slots_that_fit(8, per_slot, 75 * 10**9) == 8
    fit = slots_that_fit(256, per_slot, 44 * 10**9)
    assert (fit + 1) * per_slot + FIT_RESERVE_BYTES <= 44 * 10**9


def _real_talker_config() -> dict:
    from importlib.resources import files

    cfg = json.loads((files("ttsbuild.convert.variants") / "1.7b-customvoice.json").read_text())
    return cfg["talker_config"]


def test_slot_bytes_is_what_the_graph_engine_allocates_for_kv(ckpt):
    """slot_bytes' KV part equals the graph engine's KV cache per row (slots + the padding
    row), so the fit is computed on what is actually allocated."""
    from ttsbuild.runtime.loader import SLOT_STATE_BYTES, slot_bytes

    engine = open_engine(ckpt, "cpu", num_slots=3, max_len=96, kind="graph")
    backend = getattr(engine, "backend", engine)
    kv = backend.memory_report()["kv_cache"]
    per_slot = slot_bytes(backend.models.cfg.talker, 96, backend.kv_k.element_size())
    assert kv == 4 * (per_slot - SLOT_STATE_BYTES)


def test_open_engine_fits_its_slots_to_a_cuda_device_s_free_memory(ckpt, monkeypatch):
    """fit_slots on a CUDA device: the plan takes the slots that fit (here: a device with
    room for 8 of the tiny model's slots beside the reserve), the batch buckets cut with
    them; without fit_slots the slots asked for stand. (The device is faked: the fit is
    computed before anything is allocated on it.)"""
    import torch

    from ttsbuild.runtime import loader

    models = load_models(ckpt, device="cpu")
    per_slot = loader.slot_bytes(models.cfg.talker, 256)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (loader.FIT_RESERVE_BYTES + 9 * per_slot, 0))
    assert loader._fit_slots(64, models, torch.device("cuda"), 256) == 8
    assert loader._fit_slots(4, models, torch.device("cuda"), 256) == 4


def test_the_one_kernel_code_predictor_is_chosen_at_load_only_over_fp8_weights(fp8_engine):
    """`serve --megaframe-code-predictor` packs the kernel at load from FP8 code-predictor
    weights: an engine compiled with a bf16 code predictor refuses it (and a different code
    predictor precision) with a message that says how to get one."""
    with pytest.raises(ValueError, match="needs an FP8 code predictor"):
        open_engine(fp8_engine, "cpu", kind="graph", megaframe_code_predictor=True)
    with pytest.raises(ValueError, match="recompile"):
        open_engine(fp8_engine, "cpu", kind="graph", code_predictor_fp8=True)
    same = open_engine(fp8_engine, "cpu", kind="graph", code_predictor_fp8=False,
                       megaframe_code_predictor=False)  # fmt: skip
    assert not same.plan.megaframe_code_predictor and not same.backend.cp_mega


def test_the_talker_kv_cache_in_fp8_at_load(fp8_engine, bf16_engine):
    """open_engine(talker_kv_fp8=True) on an engine compiled with a calibration: the cache in
    e4m3 with the calibration's k/v scales (as compiled into the engine), serving a request;
    an engine compiled without one, or the eager engine, is refused clearly."""
    import torch

    from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE

    engine = open_engine(fp8_engine, "cpu", kind="graph", talker_kv_fp8=True)
    b = engine.backend
    assert engine.plan.talker_kv_fp8 and b.kv_k.dtype == b.kv_v.dtype == KV_FP8_DTYPE
    assert b.prefix.k.dtype == KV_FP8_DTYPE
    packed = load_models(fp8_engine, "cpu").packed["talker"]
    assert b.talker_stack.kv_scales == [
        (float(packed[f"model.layers.{i}.self_attn.k_scale"]),
         float(packed[f"model.layers.{i}.self_attn.v_scale"]))
        for i in range(len(b.talker_stack.layers))
    ]  # fmt: skip
    pcm, stats = synthesize(engine, REQ)
    assert stats["frames"] == 10 and np.isfinite(pcm).all() and np.abs(pcm).max() > 0
    assert b.kv_k.view(torch.uint8).any()  # written
    with pytest.raises(ValueError, match="compile the engine with a calibration"):
        open_engine(bf16_engine, "cpu", kind="graph", talker_kv_fp8=True)
    with pytest.raises(ValueError, match="the graph engine's"):
        open_engine(fp8_engine, "cpu", kind="eager", talker_kv_fp8=True)


def test_an_engine_compiled_with_the_fp8_talker_cache(ckpt, calib_file, tmp_path):
    """compile --talker-kv-fp8 --calib: the plan has it, the gate measured the talker on it
    (and passed), and the engine opens with its cache in e4m3 without being asked;
    --talker-kv-bf16 keeps a calibrated FP8 engine's cache bf16 (the default is FP8)."""
    from ttsbuild.build.compile import BuildConfig, compile_engine_dir
    from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE

    from .conftest import QUICK

    out = tmp_path / "engine"
    manifest = compile_engine_dir(ckpt, out, BuildConfig(precision="fp8", talker_kv_fp8=True,
                                                         **QUICK), calib_file)  # fmt: skip
    assert manifest["plan"]["talker_kv_fp8"]
    q = manifest["quality"]
    assert q["talker_kv_cache"] == "fp8" and q["passed"]
    engine = open_engine(out, "cpu", kind="graph")
    assert engine.plan.talker_kv_fp8 and engine.backend.kv_k.dtype == KV_FP8_DTYPE
    pcm, stats = synthesize(engine, REQ)
    assert stats["frames"] == 10 and np.isfinite(pcm).all()
    bf16 = open_engine(out, "cpu", kind="graph", talker_kv_fp8=False)  # at load: a runtime choice
    assert bf16.backend.kv_k.dtype != KV_FP8_DTYPE
    # the eager reference (a CPU's default engine) runs it on its own cache, unasked
    eager = open_engine(out, "cpu")
    assert type(eager).__name__ == "EagerEngine" and not eager.plan.talker_kv_fp8
    assert synthesize(eager, REQ)[1]["frames"] == 10
    with pytest.raises(ValueError, match="the graph engine's"):
        open_engine(out, "cpu", kind="eager", talker_kv_fp8=True)
    kept = compile_engine_dir(ckpt, tmp_path / "kept", BuildConfig(
        precision="fp8", talker_kv_fp8=False, **QUICK), calib_file)  # fmt: skip
    assert not kept["plan"]["talker_kv_fp8"] and kept["quality"]["talker_kv_cache"] == "bf16"
