"""Compiled engines reproduce the foundation model on CPU; compile is atomic and gated."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from ttsbuild.build.compile import (
    BuildConfig,
    QualityError,
    compile_engine_dir,
    resolved_talker_kv_fp8,
)
from ttsbuild.build.engine_dir import load_engine_dir, models_from_engine
from ttsbuild.build.quality import teacher_forced_logits
from ttsbuild.calibration.corpus import generate_corpus
from ttsbuild.generation.generate import ReferenceModel, generate_codes
from ttsbuild.generation.prompt import build_prompt
from ttsbuild.runtime.plan import DEFAULT_LANE_RESERVED_SMS
from ttsbuild.runtime.request import SamplingOverrides, SynthesisRequest

from .conftest import QUICK

TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue."]


def _checkpoint_models(ckpt):
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.runtime.engine import Models

    return Models.load(load_checkpoint(ckpt), "cpu")


def _codes(models, greedy: bool, frames: int = 5) -> list[torch.Tensor]:
    over = SamplingOverrides(do_sample=False, subtalker_do_sample=False) if greedy else None
    reqs = [
        SynthesisRequest(text=t, voice=models.voices[i], language="english", seed=11 + i,
                         max_frames=frames, sampling=over or SamplingOverrides())
        for i, t in enumerate(TEXTS)
    ]
    prompts = [build_prompt(models.talker, models.prompt_spec(r)) for r in reqs]
    ref = ReferenceModel(models.talker, models.code_predictor, len(reqs), 128)
    out = generate_codes(ref, prompts, [models.generation_params(r) for r in reqs],
                         [r.seed for r in reqs], [frames] * len(reqs))
    return [r.codes for r in out]


def test_bf16_engine_is_the_checkpoint_model(ckpt, bf16_engine):
    base = _checkpoint_models(ckpt)
    eng = models_from_engine(load_engine_dir(bf16_engine))
    for name in ("talker", "code_predictor"):
        a, b = getattr(base, name).state_dict(), getattr(eng, name).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    for x, y in zip(_codes(base, greedy=False), _codes(eng, greedy=False), strict=True):
        assert torch.equal(x, y)


def test_engine_runs_in_the_eager_engine(ckpt, bf16_engine):
    """Through runtime.artifact.load_models + EagerEngine: same PCM as the checkpoint."""
    from ttsbuild.runtime.artifact import load_models
    from ttsbuild.runtime.engine import EagerEngine, synthesize

    req = SynthesisRequest(text=TEXTS[0], voice="ryan", seed=5, max_frames=3)
    pcm = [synthesize(EagerEngine(load_models(p), num_slots=1, max_len=128), req)[0]
           for p in (ckpt, bf16_engine)]
    assert pcm[0].shape == pcm[1].shape == (3 * 1920,)
    # The engine's codec is folded (codebooks pre-divided, Snake parameters exp'd): the same
    # function, rounded differently in fp32, so equal to rounding, not bit for bit.
    assert np.abs(pcm[0] - pcm[1]).max() <= 1e-5 * np.abs(pcm[0]).max()
    assert np.abs(pcm[0]).max() > 0.01  # audible: a silent codec would prove nothing


def test_fp8_engine_within_rounding(ckpt, fp8_engine):
    art = load_engine_dir(fp8_engine)
    assert art.manifest.precision == "fp8"
    groups = art.manifest.tensor_groups
    assert groups["talker.layers"].dtype == "float8_e4m3fn"
    assert groups["code_predictor.layers"].dtype == "bfloat16"  # launch-bound: recorded choice
    packed = art.tensors("talker")
    assert packed["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert packed["model.layers.0.self_attn.qkv_proj.input_scale"].numel() == 1
    assert packed["model.layers.1.self_attn.k_scale"] > 0
    # recorded, and used: a calibrated FP8 engine's talker cache is FP8 by default
    assert art.manifest.calibration.runtime_use.startswith("k/v_scale: the talker's FP8 KV")
    assert art.manifest.plan.talker_kv_fp8
    base, eng = _checkpoint_models(ckpt), models_from_engine(art)
    a, b = base.talker.state_dict(), eng.talker.state_dict()
    for k in a:
        if k.startswith("model.layers.") and k.endswith("_proj.weight"):
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, and values below
            # the per-row normal range are absolute-rounded at the subnormal step (amax 2^-9/448)
            step = a[k].abs().amax(1, keepdim=True) / 448 * 2**-9 * 2
            assert ((a[k] - b[k]).abs() <= a[k].abs() * 2**-4 + step).all(), k
            assert not torch.equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k
    # Free-running greedy decoding diverges at the first differing code and never recovers
    # (every later frame is conditioned on it), and the random stand-in's code-predictor logits
    # are near ties; so free running is checked on the first code and the rest position by
    # position under teacher forcing (greedy codes = argmax of the teacher-forced logits).
    for x, y in zip(_codes(base, True), _codes(eng, True), strict=True):
        assert x[0, 0] == y[0, 0]
    items = generate_corpus(base, TEXTS, seed=3, max_frames=8)
    (ref_c0, ref_cp), (fp8_c0, fp8_cp) = (teacher_forced_logits(m, items) for m in (base, eng))
    assert (ref_c0.argmax(-1) == fp8_c0.argmax(-1)).float().mean() >= 0.9
    assert (ref_cp.argmax(-1) == fp8_cp.argmax(-1)).float().mean() >= 0.8
    q = art.manifest.quality
    assert q["passed"] and q["random_weights"] and q["codebook0_top1_agreement"] >= 0.9
    assert set(q["code_predictor_paths"]) == {"fused"}  # QUICK's buckets (<= 8) are all fused
    assert q["talker_kv_cache"] == "fp8"  # the plan's cache (the default), as measured
    assert q["code_predictor_passed"] and q["codebook0_passed"]
    assert "weight-only" in q["activations"]  # the calibrated scales are not used: said so
    assert 0.4 < q["reference_sharpness"]["codebook0"]["mean_top1_prob"] < 0.85  # peaked


def test_runtime_teacher_forcing_is_the_eager_model(ckpt):
    """Unquantised packed weights through the runtime's code (talker prefill + batched decode,
    both code-predictor paths) give the eager modules' teacher-forced logits to fp32 rounding:
    the gate compares like with like, position by position."""
    from ttsbuild.build.pack import fused_sizes, pack_state
    from ttsbuild.build.quality import RuntimeLM

    base = _checkpoint_models(ckpt)
    states = {m: getattr(base, m).state_dict() for m in ("talker", "code_predictor")}
    packed = {m: pack_state(dict(s)) for m, s in states.items()}
    sizes = {m: fused_sizes(s) for m, s in states.items()}
    runtime = RuntimeLM.from_packed(base.cfg, packed, sizes, torch.float32, "cpu", False)
    items = generate_corpus(base, TEXTS, seed=5, max_frames=7)
    ref_c0, ref_cp = teacher_forced_logits(base, items)
    c0, cp = runtime.logits(items, {"fused": 4, "unfused": 3})
    assert c0.shape == ref_c0.shape and ref_c0.shape[0] == sum(len(i.codes) for i in items)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(c0, ref_c0) < 1e-5
    for path in ("fused", "unfused"):
        assert cp[path].shape == ref_cp.shape
        assert rel(cp[path], ref_cp) < 1e-5, path


def test_bf16_heads_take_most_of_an_fp8_code_predictors_error(ckpt):
    """An FP8 code predictor (layers as compile quantises them) with its heads FP8 and with
    them bf16 (EnginePlan.cp_heads_fp8, off by default: compile --fp8-code-predictor-heads
    turns it on), teacher forced against the eager model as the gate measures it: with bf16
    heads codebooks 1-15 are several times closer on the tiny stand-in (the peaked heads'
    logits carry FP8's per-product error at full scale; on the 1.7B one 0.021 -> 0.013 nats),
    the layers still FP8."""
    from ttsbuild.build.quality import RuntimeLM, measure_quality, pack_models

    base = _checkpoint_models(ckpt)
    cfg = BuildConfig(fp8_code_predictor=True)
    assert not cfg.runtime_plan().cp_heads_fp8  # the default: bf16 heads
    assert BuildConfig(fp8_code_predictor_heads=True).runtime_plan().cp_heads_fp8
    packed, sizes, _ = pack_models(base, cfg.fp8_groups(), torch.device("cpu"))
    items = generate_corpus(base, TEXTS, seed=5, max_frames=8)
    ref = teacher_forced_logits(base, items)
    kl = {}
    for heads_fp8 in (True, False):
        rt = RuntimeLM.from_packed(base.cfg, {m: dict(t) for m, t in packed.items()}, sizes,
                                   torch.float32, "cpu", heads_fp8)  # fmt: skip
        cp = rt.code_predictor
        assert cp.stack.is_fp8 and all(h.is_fp8 == heads_fp8 for h in cp.heads)
        report = measure_quality(base, rt, items, {"fused": 4, "unfused": 4},
                                 reference_logits=ref)  # fmt: skip
        kl[heads_fp8] = report.code_predictor_mean_kl
    assert 0 < kl[False] < kl[True] / 3, kl


def test_the_gate_measures_the_talkers_w8a8_decode_where_the_plan_serves_it(ckpt):
    """compile's `talker_decode_paths`: where a batch bucket reaches the talker's W8A8 rows
    (below its bf16-copy rows), codebook 0 is measured again with the decode as W8A8, and
    the report's codebook-0 figures are the worse path's. The W8A8 path really rounds the
    activations (its logits differ from the few-row path's); the stack's thresholds are back
    as they were after."""
    from ttsbuild.build.compile import talker_decode_paths
    from ttsbuild.build.quality import RuntimeLM, measure_quality, pack_models
    from ttsbuild.runtime.plan import EnginePlan

    big = EnginePlan(precision="fp8", batch_buckets=(1, 8, 16, 32), w8a8_min_rows=16)
    assert talker_decode_paths(big) == {"w8a8": 1}
    assert talker_decode_paths(big.model_copy(update={"batch_buckets": (1, 2, 4, 8)})) == {}
    assert talker_decode_paths(big.model_copy(update={"bf16_min_rows": 16})) == {}
    assert talker_decode_paths(big.model_copy(update={"w8a8_min_rows": 0})) == {}
    base = _checkpoint_models(ckpt)
    packed, sizes, _ = pack_models(base, BuildConfig().fp8_groups(), torch.device("cpu"))
    rt = RuntimeLM.from_packed(base.cfg, packed, sizes, torch.float32, "cpu", False)
    rt.talker.set_linear_paths(big, rt.code_predictor.stack, rt.code_predictor.heads)
    items = generate_corpus(base, TEXTS, seed=5, max_frames=8)
    ref = teacher_forced_logits(base, items)
    assert not torch.equal(rt.codebook0_logits(items, 1), rt.codebook0_logits(items, 16))
    assert all(d.w8a8_min_rows == 16 for d in rt.talker.linears())
    r = measure_quality(base, rt, items, {"fused": 4}, reference_logits=ref,
                        talker_paths=talker_decode_paths(big))  # fmt: skip
    paths = r.codebook0_paths
    assert set(paths) == {"few rows", "w8a8"} and paths["w8a8"] != paths["few rows"]
    worst = max(paths.values(), key=lambda a: a["mean_kl"])
    assert r.codebook0_mean_kl == worst["mean_kl"] and "(few rows, w8a8)" in r.summary()
    plain = measure_quality(base, rt, items, {"fused": 4}, reference_logits=ref)
    assert plain.codebook0_paths == {} and plain.codebook0_mean_kl == paths["few rows"]["mean_kl"]


@pytest.mark.parametrize("linears", [("mlp.gate_up_proj",), (
    "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
def test_quality_gate_refuses_one_layer_scaled_by_4(ckpt, tmp_path, monkeypatch, linears):
    """One layer's per-channel weight scales x4 (as a packing or scale-layout bug would leave
    them): the runtime's kernels read them, the gate measures them and refuses the engine,
    while the correct engine of the same checkpoint passes (fp8_engine)."""
    from ttsbuild.build import compile as compile_mod

    quantize = compile_mod.quantize_groups

    def broken(packed, groups, device):
        done = quantize(packed, groups, device)
        for lin in linears:
            name = f"model.layers.1.{lin}.weight_scale"
            packed["talker"][name] = packed["talker"][name] * 4
        return done

    monkeypatch.setattr(compile_mod, "quantize_groups", broken)
    with pytest.raises(QualityError, match="below the gate"):
        compile_engine_dir(ckpt, tmp_path / "e", BuildConfig(precision="fp8", onnx=False, **QUICK))
    assert not (tmp_path / "e").exists()


def test_quality_gate_runs_the_talkers_linears_as_served(ckpt, tmp_path, monkeypatch):
    """The gate measures what runs: the prompts' prefill (>= the plan's w8a8_min_rows rows)
    through W8A8, the few-row decode steps weight-only."""
    from ttsbuild.runtime import fast_model

    rows_w8a8 = []
    real = fast_model.fp8_linear_w8a8

    def counting(x, *args, **kwargs):
        rows_w8a8.append(x.numel() // x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fast_model, "fp8_linear_w8a8", counting)
    cfg = BuildConfig(precision="fp8", onnx=False, **QUICK)
    assert cfg.runtime_plan().w8a8_min_rows == 16
    manifest = compile_engine_dir(ckpt, tmp_path / "e", cfg)
    assert manifest["quality"]["passed"] and "W8A8" in manifest["quality"]["activations"]
    assert rows_w8a8 and min(rows_w8a8) >= 16


def test_failing_compile_leaves_nothing(ckpt, tmp_path, monkeypatch):
    from ttsbuild.build import onnx_codec

    def boom(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(onnx_codec, "export_codec_step", boom)
    out = tmp_path / "engine"
    with pytest.raises(RuntimeError, match="export failed"):
        compile_engine_dir(ckpt, out, BuildConfig(precision="bf16", **QUICK))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_quality_gate_refuses_broken_scales(ckpt, tmp_path, monkeypatch):
    from ttsbuild.build import compile as compile_mod
    from ttsbuild.plugins.fp8_linear import quantize_weight_fp8

    def broken(w):
        q, scale = quantize_weight_fp8(w)
        gen = torch.Generator().manual_seed(0)
        return q, scale * torch.empty_like(scale).uniform_(0.2, 5.0, generator=gen)

    monkeypatch.setattr(compile_mod, "quantize_weight_fp8", broken)
    out = tmp_path / "engine"
    with pytest.raises(QualityError, match="below the gate"):
        compile_engine_dir(ckpt, out, BuildConfig(precision="fp8", onnx=False, **QUICK))
    assert not out.exists()
    manifest = compile_engine_dir(
        ckpt, out, BuildConfig(precision="fp8", onnx=False, force_quality=True, **QUICK)
    )
    assert out.is_dir() and manifest["quality"]["passed"] is False


def test_calibration_from_another_checkpoint_is_refused(ckpt, calib_file, tmp_path):
    import json

    doc = json.loads(calib_file.read_text())
    doc["checkpoint"]["manifest_sha256"] = "0" * 64
    other = tmp_path / "calib.json"
    other.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="made for another checkpoint"):
        compile_engine_dir(ckpt, tmp_path / "e", BuildConfig(**QUICK), other)


def test_codec_precision_is_measured_and_recorded(bf16_engine):
    codec = load_engine_dir(bf16_engine).manifest.codec
    assert codec.precision == "fp16" and codec.fp32_stages == ["transformer", "output"]
    q = codec.quality
    # fp16 on the stand-in keeps ~50 dB (GPU.md: 50.8 on the real config); never exact
    assert q.passed and 45 <= q.snr_db < 80 and q.min_snr_db == 45 and q.device == "cpu"
    assert (q.rows, q.frames) == (1, 4)
    # streamed a frame a step (the plan's fused pre-transformer layers) and in the largest
    # chunk the gate's frames allow; the gate takes the lower
    assert set(q.snr_db_by_chunk) == {"1", "4"} and q.snr_db == min(q.snr_db_by_chunk.values())


def test_compile_pins_the_codec_switches_it_gates(bf16_engine, monkeypatch):
    """The plan pins the codec switches as the compile host takes them (None would leave
    them to the deployment host's environment, which the gate never measured): the fp16
    copies only beside a half-precision codec; the served engine keeps them under another
    environment."""
    import ttsbuild.runtime.codec_engine as ce

    fp16 = BuildConfig(codec_precision="fp16").runtime_plan()
    assert fp16.codec_transformer_half_weights is ce.TR_HALF_WEIGHTS
    assert fp16.codec_ring_half is ce.RING_HALF
    assert fp16.codec_pdl_max_rows == ce.CODEC_PDL_MAX_ROWS
    assert fp16.codec_conv_split_max_streams == ce.CONV_SPLIT_MAX_STREAMS
    assert fp16.codec_qkv_attend is ce.QKV_ATTEND and fp16.codec_fold_block_act is ce.FOLD_BLOCK_ACT
    assert fp16.codec_tconv_conv is ce.TCONV_CONV and fp16.codec_lookup_fused is ce.LOOKUP_FUSED
    assert fp16.codec_output_epilogue is ce.OUTPUT_EPILOGUE
    assert fp16.codec_next_act_fold is ce.NEXT_ACT_FOLD
    strict = BuildConfig(codec_precision="fp32").runtime_plan()
    assert strict.codec_transformer_half_weights is False and strict.codec_ring_half is False
    ring, pdl = ce.RING_HALF, ce.CODEC_PDL_MAX_ROWS  # as the engine directory was built
    monkeypatch.setattr(ce, "RING_HALF", not ring)  # another TTSBUILD_CODEC_RING_HALF here
    monkeypatch.setattr(ce, "CODEC_PDL_MAX_ROWS", pdl + 3)
    other = BuildConfig(codec_precision="fp16").runtime_plan()
    assert other.codec_ring_half is not ring and other.codec_pdl_max_rows == pdl + 3
    # the engine directory serves what it was built (and gated) with, under this environment
    kw = load_engine_dir(bf16_engine).manifest.plan.codec_engine_kwargs("cpu")
    assert kw["ring_half"] is ring and kw["pdl_max_rows"] == pdl


def test_codec_precision_below_the_gate_is_refused(ckpt, tmp_path):
    """bf16 keeps 8 mantissa bits: ~32 dB on the real codec, measured here on the stand-in."""
    out = tmp_path / "engine"
    cfg = dict(precision="bf16", onnx=False, codec_precision="bf16", **QUICK)
    with pytest.raises(QualityError, match=r"codec bf16: SNR \d+\.\d dB .* below the gate"):
        compile_engine_dir(ckpt, out, BuildConfig(**cfg))
    assert not out.exists()
    manifest = compile_engine_dir(ckpt, out, BuildConfig(force_quality=True, **cfg))
    q = manifest["codec"]["quality"]
    assert q["passed"] is False and 20 < q["snr_db"] < 45


def test_build_settings_are_validated():
    with pytest.raises(ValueError, match="codec precision"):
        BuildConfig(codec_precision="int8")
    with pytest.raises(ValueError, match="largest graph batch"):
        BuildConfig(max_batch=8, graph_batches=(1, 2, 4))
    with pytest.raises(ValueError, match="max frames"):
        BuildConfig(max_frames=4096, max_len=2048)


def test_the_one_kernel_code_predictor_plan(ckpt, tmp_path):
    """--megaframe-code-predictor: written into the plan with the lane's SM reserve off by
    default (the kernel needs every SM); refused without an FP8 code predictor, beside a
    reserve asked for, and (before anything is packed or written) for a checkpoint whose code
    predictor the kernel has no shapes for."""
    plan = BuildConfig(fp8_code_predictor=True, megaframe_code_predictor=True).runtime_plan()
    assert plan.megaframe_code_predictor and plan.admission_lane and plan.lane_reserved_sms == 0
    assert not plan.megaframe_regular  # on the lane only, as served on the H200
    assert BuildConfig(fp8_code_predictor=True, megaframe_code_predictor=True,
                       megaframe_regular=True).runtime_plan().megaframe_regular  # fmt: skip
    with pytest.raises(ValueError, match="needs the lane on batch bucket 1"):
        BuildConfig(fp8_code_predictor=True, megaframe_code_predictor=True, admission_lane=(2,))
    regular = BuildConfig(fp8_code_predictor=True, megaframe_code_predictor=True,
                          admission_lane=(2,), megaframe_regular=True)  # fmt: skip
    assert regular.runtime_plan().admission_lane == (2,)
    assert BuildConfig().runtime_plan().lane_reserved_sms == DEFAULT_LANE_RESERVED_SMS > 0
    with pytest.raises(ValueError, match="needs --fp8-code-predictor"):
        BuildConfig(megaframe_code_predictor=True)
    with pytest.raises(ValueError, match="needs every SM"):
        BuildConfig(fp8_code_predictor=True, megaframe_code_predictor=True, lane_reserved_sms=8)
    cfg = BuildConfig(precision="fp8", fp8_code_predictor=True, megaframe_code_predictor=True,
                      onnx=False, **QUICK)  # fmt: skip
    with pytest.raises(ValueError, match="code predictor's shapes"):
        compile_engine_dir(ckpt, tmp_path / "e", cfg)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("flags, asked", [([], None), (["--talker-kv-fp8"], True),
                                           (["--talker-kv-bf16"], False)])  # fmt: skip
def test_cli_talker_kv_flags_reach_the_build(ckpt, tmp_path, monkeypatch, flags, asked):
    """compile --talker-kv-fp8 / --talker-kv-bf16 reach the build settings (neither: None,
    FP8 where a calibration gives the scales, `resolved_talker_kv_fp8`)."""
    from typer.testing import CliRunner

    import ttsbuild.build.compile as compile_mod
    from ttsbuild.cli import app

    seen = []
    monkeypatch.setattr(compile_mod, "compile_engine_dir",
                        lambda ckpt, out, cfg, *rest: seen.append(cfg) or {"quality": None})
    result = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(tmp_path / "e"),
                                      "--no-onnx", *flags])  # fmt: skip
    assert seen and seen[0].talker_kv_fp8 is asked, result.output


def test_the_gate_measures_the_talker_on_its_fp8_cache(ckpt, tmp_path):
    """compile --talker-kv-fp8 needs a calibration (refused before anything is written); the
    gate's talker then runs on an FP8 cache with the stack's scales (RuntimeLM.kv_fp8): its
    codebook-0 logits differ from the bf16 cache's by about e4m3's rounding, not more."""
    from ttsbuild.build.quality import RuntimeLM, pack_models
    from ttsbuild.calibration.calibrate import measure_kv_scales

    out = tmp_path / "engine"
    with pytest.raises(ValueError, match="give --calib"):
        compile_engine_dir(ckpt, out, BuildConfig(talker_kv_fp8=True, **QUICK), None)
    assert not out.exists()
    assert BuildConfig(talker_kv_fp8=True).runtime_plan().talker_kv_fp8
    # the default (None): FP8 only for an FP8 engine with a calibration; asked, as asked
    fp8, bf16 = BuildConfig(precision="fp8"), BuildConfig(precision="bf16")
    assert resolved_talker_kv_fp8(fp8, calibrated=True)
    assert not resolved_talker_kv_fp8(fp8, calibrated=False)
    assert not resolved_talker_kv_fp8(bf16, calibrated=True)
    assert not resolved_talker_kv_fp8(replace(fp8, talker_kv_fp8=False), calibrated=True)
    assert resolved_talker_kv_fp8(replace(bf16, talker_kv_fp8=True), calibrated=True)
    assert not fp8.runtime_plan().talker_kv_fp8  # unresolved: the plan's bf16 cache
    base = _checkpoint_models(ckpt)
    packed, sizes, _ = pack_models(base, BuildConfig().fp8_groups(), torch.device("cpu"))
    rt = RuntimeLM.from_packed(base.cfg, packed, sizes, torch.float32, "cpu", False)
    items = generate_corpus(base, TEXTS, seed=5, max_frames=8)
    exact = rt.codebook0_logits(items, 0)
    rt.kv_fp8 = True
    with pytest.raises(ValueError, match="compile the engine with a calibration"):
        rt.codebook0_logits(items, 0)  # (packed without a calibration: no scales)
    rt.talker.kv_scales = measure_kv_scales(base, TEXTS, max_frames=6)
    fp8 = rt.codebook0_logits(items, 0)
    rel = ((fp8 - exact).norm() / exact.norm()).item()
    assert 1e-5 < rel < 2e-2, rel
