"""plan.talker_kv_fp8 in the graph engine (eager on CPU): the talker's cache and prefix pool
in e4m3 with each layer's k/v scales, measured as a calibration takes them; the engine's
talker states against the bf16 cache's, and refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from engine_runs import finish

from ttsbuild.calibration.calibrate import measure_kv_scales
from ttsbuild.convert.checkpoint import load_checkpoint
from ttsbuild.plugins.qk_norm_rope import KV_FP8_DTYPE, KV_FP8_MAX
from ttsbuild.runtime.engine import Models
from ttsbuild.runtime.graph_engine import GraphEngine
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.runtime.request import SynthesisRequest

PLAN = dict(num_slots=3, max_len=256, max_text=64, batch_buckets=(1, 2), prefill_buckets=(32, 64),
            codec_chunks=(1, 2), codec_ring=8)  # fmt: skip
REQUESTS = [
    SynthesisRequest(text="The birch canoe slid on the smooth planks.", voice="ryan", seed=1,
                     max_frames=8),
    SynthesisRequest(text="Rice is often served in round bowls.", voice="vivian", seed=3,
                     max_frames=6),
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return Models.load(load_checkpoint(tiny_checkpoint), device="cpu")


@pytest.fixture(scope="module")
def scales(models):
    return measure_kv_scales(models, ["Glue the sheet to the dark blue background."],
                             max_frames=6)  # fmt: skip


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _states(engine, requests):
    """Each request's talker state after its prefill and after its third frame, then the
    run to the end ((codes, pcm) per request)."""
    slots = [engine.admit(r) for r in requests]
    engine.prefill(slots)
    b = engine.backend
    states = [b.hidden[slots].clone()]
    for _ in range(3):
        engine.frames(slots)
    states.append(b.hidden[slots].clone())
    return states, finish(engine, slots, 2)


def test_measured_scales_are_the_cache_amax(models, scales):
    L = models.cfg.talker.num_layers
    assert len(scales) == L
    assert all(math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0 for k, v in scales)
    # the amax of k after its norm: per head, |k| <= |norm weight| * sqrt(head_dim)
    D = models.cfg.talker.head_dim
    for i, (k, _) in enumerate(scales):
        bound = models.talker.model.layers[i].self_attn.k_norm.weight.detach().abs().max() * D**0.5
        assert k * KV_FP8_MAX <= float(bound) * 1.001


def test_fp8_cache_tracks_the_bf16_cache(models, scales):
    """Same weights, same requests: the talker's states with the FP8 cache differ from the
    exact cache's (the cache really is e4m3) by about e4m3's rounding, and with k scales 50x
    too small (most keys clamped) by far more."""
    exact = GraphEngine(models, EnginePlan(**PLAN), use_graphs=False)
    fp8 = GraphEngine(models, EnginePlan(talker_kv_fp8=True, **PLAN), use_graphs=False,
                      kv_scales=scales)  # fmt: skip
    assert fp8.backend.kv_k.dtype == KV_FP8_DTYPE and fp8.backend.kv_v.dtype == KV_FP8_DTYPE
    assert fp8.backend.memory_report()["kv_cache"] * 4 == exact.backend.memory_report()[
        "kv_cache"]  # fmt: skip  (fp32 on the CPU: a quarter of the bytes)
    want, want_runs = _states(exact, REQUESTS)
    got, runs = _states(fp8, REQUESTS)
    for w, g in zip(want, got, strict=True):
        assert 1e-5 < _rel(g, w) < 1e-2, _rel(g, w)  # (measured 8e-4, 2e-4)
    for (codes, pcm), (ref_codes, _) in zip(runs, want_runs, strict=True):
        # (the three frames stepped before `finish` have their audio in pcm, not in codes)
        assert codes.shape[1] == ref_codes.shape[1] and pcm.shape[0] % 1920 == 0
        assert pcm.shape[0] > codes.shape[0] * 1920 and np.isfinite(pcm).all()
    assert fp8.free_slots() == PLAN["num_slots"]
    # again, in reverse order: the prompts' prefixes now come from the (FP8) prefix pool into
    # other slots, and the talker states are those of the first round (after the prefill bit
    # for bit; after three frames to fp32 rounding: the rows' order in the batch differs)
    hits = fp8.backend.prefix.hits
    again, _ = _states(fp8, REQUESTS[::-1])
    assert fp8.backend.prefix.hits >= hits + len(REQUESTS)
    assert torch.equal(again[0], got[0].flip(0)) and _rel(again[1], got[1].flip(0)) < 1e-6
    broken = GraphEngine(models, EnginePlan(talker_kv_fp8=True, **PLAN), use_graphs=False,
                         kv_scales=[(k / 50, v) for k, v in scales])  # fmt: skip
    bad, _ = _states(broken, REQUESTS)
    assert _rel(bad[1], want[1]) > 3 * _rel(got[1], want[1])


def test_fp8_cache_needs_scales_and_the_default_kernels(models, scales):
    with pytest.raises(ValueError, match="compile the engine with a calibration"):
        GraphEngine(models, EnginePlan(talker_kv_fp8=True, **PLAN), use_graphs=False)
    with pytest.raises(ValueError, match="compile the engine with a calibration"):
        GraphEngine(models, EnginePlan(talker_kv_fp8=True, **PLAN), use_graphs=False,
                    kv_scales=scales[:-1])  # fmt: skip
    from ttsbuild.runtime.engine import EagerEngine

    with pytest.raises(ValueError, match="the graph engine's"):
        EagerEngine(models, plan=EnginePlan(talker_kv_fp8=True, **PLAN))
    with pytest.raises(ValueError, match="reads a bf16 cache"):
        EnginePlan(talker_kv_fp8=True, talker_megastep=True, **PLAN)
    # the cache kernels refuse an FP8 cache given without its scales
    stack = GraphEngine(models, EnginePlan(**PLAN), use_graphs=False).backend.talker_stack
    cache = torch.zeros(1, 1, 1, 4, 8, dtype=KV_FP8_DTYPE)
    with pytest.raises(ValueError, match="compile the engine with a calibration"):
        stack.kv_cache_args(0, cache)


def test_random_fp8_weights_serve_the_fp8_cache_with_measured_scales():
    """open_engine on in-memory FP8 random weights (serve's and the sweeps' stand-in for a
    compiled engine): the talker's cache is FP8 as compile's default for a calibrated FP8
    engine, with k/v scales measured as a calibration's (positive, one pair a layer);
    talker_kv_fp8=False and bf16 weights keep it bf16."""
    from ttsbuild.runtime.loader import open_engine

    kw = dict(device="cpu", kind="graph", random_variant="tiny", num_slots=2, max_len=256)
    fp8 = open_engine(None, precision="fp8", **kw)
    b = fp8.backend
    assert fp8.plan.talker_kv_fp8 and b.kv_k.dtype == b.kv_v.dtype == KV_FP8_DTYPE
    scales = b.talker_stack.kv_scales
    assert len(scales) == len(b.talker_stack.layers)
    assert all(k > 0 and v > 0 and math.isfinite(k + v) for k, v in scales)
    assert len({k for k, _ in scales}) > 1  # measured per layer, not one constant
    for engine in (open_engine(None, precision="fp8", talker_kv_fp8=False, **kw),
                   open_engine(None, precision="bf16", **kw)):  # fmt: skip
        assert not engine.plan.talker_kv_fp8 and engine.backend.kv_k.dtype != KV_FP8_DTYPE


def test_the_fused_talker_reads_the_fp8_cache(models, scales):
    """plan.fused_talker (`cp_fused.decode_fused`) beside talker_kv_fp8: its long-cache path
    writes and reads the FP8 cache with the layers' scales, as the unfused step does: the
    same talker states and codes (the CPU references of both paths), the same cache bytes;
    a short FP8 cache is refused (its kernels read bf16 caches)."""
    plain = GraphEngine(models, EnginePlan(talker_kv_fp8=True, **PLAN), use_graphs=False,
                        kv_scales=scales)  # fmt: skip
    fused = GraphEngine(models, EnginePlan(talker_kv_fp8=True, fused_talker=(1, 2), **PLAN),
                        use_graphs=False, kv_scales=scales)  # fmt: skip
    assert fused.backend.kv_k.dtype == KV_FP8_DTYPE
    want, want_runs = _states(plain, REQUESTS)
    got, runs = _states(fused, REQUESTS)
    for w, g in zip(want, got, strict=True):
        assert _rel(g, w) < 1e-6, _rel(g, w)
    for (codes, _), (ref_codes, _) in zip(runs, want_runs, strict=True):
        assert np.array_equal(codes, ref_codes)
    assert torch.equal(fused.backend.kv_k.view(torch.uint8), plain.backend.kv_k.view(torch.uint8))
    from ttsbuild.runtime.cp_fused import decode_fused

    stack = fused.backend.talker_stack
    short = torch.zeros(len(stack.layers), 2, 2, 8, 16, dtype=KV_FP8_DTYPE)
    with pytest.raises(ValueError, match="FP8 cache takes decode_fused's long-cache path"):
        decode_fused(stack, torch.zeros(1, stack.cfg.hidden_size), short, short.clone(),
                     torch.tensor([0]), torch.tensor([0]))  # fmt: skip
