"""The codec engine on a GPU: strict fp32 equals the CPU decoder, every precision replays in a
CUDA graph exactly as it runs eagerly, half precision passes the gate (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from test_codec import our_decoder, rand_codes, small_config, test_state
from test_codec_engine import _fused_layers_case

from ttsbuild.runtime.codec_engine import (
    CodecEngine,
    capture_step,
    codec_snr_db,
    decode_with,
    snr_db,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def decoders():
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=40))
    return cfg, dec, our_decoder(cfg, test_state(cfg, seed=40)).cuda()


def test_strict_fp32_on_gpu_equals_cpu(decoders):
    cfg, cpu_dec, gpu_dec = decoders
    codes = rand_codes(cfg, 3, 10, seed=41)
    with torch.no_grad():
        ref = cpu_dec(codes)[:, 0]
    got = decode_with(CodecEngine(gpu_dec, 3, "fp32"), codes, chunk=3).cpu()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_graph_replay_equals_eager(decoders, precision):
    cfg, _, dec = decoders
    engine = CodecEngine(dec, 8, precision, max_chunk=2)
    rows = torch.tensor([5, 1, engine.scratch, engine.scratch], device="cuda")
    codes = [rand_codes(cfg, 4, 2, seed=50 + i).cuda() for i in range(4)]
    static = codes[0].clone()
    graph, pcm = capture_step(engine, rows, static)
    engine.reset(rows)
    eager = [engine.step(rows, c)[:2].clone() for c in codes]
    engine.reset(rows)
    for c, e in zip(codes, eager, strict=True):
        static.copy_(c)
        graph.replay()
        # the same kernels on the same inputs: equal up to a workspace-dependent reduction order
        assert ((pcm[:2] - e).abs().max() / e.abs().max()).item() <= 1e-6


@pytest.mark.parametrize(("precision", "min_db"), [("tf32", 50), ("fp16", 45)])
def test_half_precision_passes_the_gate(decoders, precision, min_db):
    cfg, _, dec = decoders
    snr = codec_snr_db(CodecEngine(dec, 2, precision), dec, rand_codes(cfg, 2, 16, seed=60))
    assert min_db <= snr < 90, snr


def _switch_snr(monkeypatch, dec, precision, kw, codes, chunk, name, off, on):
    """The decode with codec_engine.<name> = off and = on, same settings: (SNR of the second
    against the first, the second's engine)."""
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, name, off)
    plain = decode_with(CodecEngine(dec, 2, precision, **kw), codes, chunk=chunk).float()
    monkeypatch.setattr(codec_engine, name, on)
    engine = CodecEngine(dec, 2, precision, **kw)
    got = decode_with(engine, codes, chunk=chunk).float()
    return snr_db(plain, got), engine


def _assert_replay_equals_eager(engine, codes, frames=1):
    """A captured step of `frames` frames of rows 0 and 1 replays what the eager step
    computes."""
    rows = torch.tensor([0, 1], device="cuda")
    static = codes[..., :frames].cuda().clone()
    graph, pcm = capture_step(engine, rows, static)
    engine.reset(rows)
    eager = engine.step(rows, static).clone()
    engine.reset(rows)
    graph.replay()
    assert ((pcm - eager).abs().max() / eager.abs().max()).item() <= 1e-6


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fused_convnext_blocks_keep_the_decode_and_replay(decoders, monkeypatch, precision):
    """The upsample stage's ConvNeXt blocks as two launches each (plugins.convnext, rows up to
    CONVNEXT_FUSED_MAX_ROWS) against the module ops in the same engine settings: the same
    audio to the stage's rounding (SNR between the two far above the gate), the slot state
    carried across steps alike, and a captured step equal to the eager one."""
    cfg, _, dec = decoders
    codes = rand_codes(cfg, 2, 8, seed=70)
    kw = dict(conv_impl="triton", fused=True)
    snr, engine = _switch_snr(monkeypatch, dec, precision, kw, codes, 1, "CONVNEXT_FUSED",
                              False, True)  # fmt: skip
    assert snr > 35, snr
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_dwconv_norm_keeps_the_decode_and_replays(decoders, monkeypatch, precision):
    """The ConvNeXt blocks' depthwise conv and LayerNorm as one launch (DWCONV_NORM,
    plugins.convnext.dwconv_norm) against cuDNN's conv and the norm's kernel: the same audio
    to the stage's rounding, the tails carried alike over steps of 1 and 3 frames, and a
    captured step equal to the eager one."""
    cfg, _, dec = decoders
    codes = rand_codes(cfg, 2, 8, seed=72)
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True)
    for chunk in (1, 3):
        snr, engine = _switch_snr(monkeypatch, dec, precision, kw, codes, chunk, "DWCONV_NORM",
                                  False, True)  # fmt: skip
        assert snr > 35, (chunk, snr)
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fused_residual_units_keep_the_decode_and_replay(decoders, monkeypatch, precision):
    """Every residual unit as one launch (FUSED_UNIT_MAX_C, plugins.causal_conv.residual_unit;
    all convs on the implicit-GEMM path, min rows 1) against its two conv launches: the same
    roundings, so the same audio to the summation order (SNR far above the gate), and a
    captured step equal to the eager one."""
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)
    cfg, _, dec = decoders
    codes = rand_codes(cfg, 2, 8, seed=73)
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True)
    snr, engine = _switch_snr(monkeypatch, dec, precision, kw, codes, 2, "FUSED_UNIT_MAX_C",
                              0, 256)  # fmt: skip
    assert snr > 45, snr
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_snake_epilogue_keeps_the_decode_and_replays(decoders, monkeypatch, precision):
    """The residual units' second SnakeBeta in the k = 7 conv's epilogue (snake_epilogue)
    against it in the 1x1 conv's input load, in the served settings with every conv on the
    implicit-GEMM kernel (min rows 1): the same audio (both round the conv output, then the
    same fp32 SnakeBeta), and a captured step equal to the eager one."""
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)
    monkeypatch.setattr(codec_engine, "SNAKE_EPILOGUE_MAX_ROWS", 1 << 30)
    cfg, _, dec = decoders
    _assert_same_bits_and_replay(dec, precision, rand_codes(cfg, 2, 8, seed=71),
                                 "snake_epilogue")


def _assert_same_bits_and_replay(dec, precision, codes, flag):
    """The served settings, every conv as the kernel runs it, CodecEngine(<flag>) off and on:
    the same audio (to 1e-6 relative), and a captured step of the second equal to its eager
    step."""
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True)
    plain = decode_with(CodecEngine(dec, 2, precision, **kw, **{flag: False}), codes, chunk=2)
    engine = CodecEngine(dec, 2, precision, **kw, **{flag: True})
    assert getattr(engine, flag)
    got = decode_with(engine, codes, chunk=2)
    assert ((got - plain).abs().max() / plain.abs().max()).item() <= 1e-6
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_next_act_fold_keeps_the_decode_and_replays(decoders, monkeypatch, precision):
    """Each residual unit's act1 written by the unit before (next_act_fold: the 1x1 conv's
    epilogue, or the block's overlap-add for its first unit, stores SnakeBeta of its rounded
    output after the next conv's context columns, context_fill puts the tail in front)
    against snake_context, every conv on the implicit-GEMM kernel (min rows 1): the same
    audio (the same fp32 SnakeBeta of the same rounded values), and a captured step equal to
    the eager one."""
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)
    cfg, _, dec = decoders
    _assert_same_bits_and_replay(dec, precision, rand_codes(cfg, 2, 8, seed=78),
                                 "next_act_fold")


def test_tma_convs_keep_the_decode_and_replay(monkeypatch):
    """The multi-tap convs on the TMA kernel (causal_conv.CONV_TMA, from any length: its
    host-side tensor descriptors baked into the captured graph) against the pointer-gather
    kernel, on a decoder wide enough for it (blocks of 128 and 64 channels): the same audio
    to the summation order, and a captured step equal to the eager one."""
    from ttsbuild.plugins import causal_conv
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)  # every conv on the kernels
    cfg = small_config(decoder_dim=256)
    dec = our_decoder(cfg, test_state(cfg, seed=41)).cuda()
    codes = rand_codes(cfg, 2, 8, seed=76)
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True,
              conv_split_max_streams=0)  # split-K convs never take the TMA kernel
    calls, real = [], causal_conv._causal_conv_tma
    monkeypatch.setattr(causal_conv, "_causal_conv_tma",
                        lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setattr(causal_conv, "CONV_TMA", False)
    plain = decode_with(CodecEngine(dec, 2, "fp16", **kw), codes, chunk=2).float()
    assert not calls
    monkeypatch.setattr(causal_conv, "CONV_TMA", True)
    monkeypatch.setattr(causal_conv, "CONV_TMA_MIN_N", 1)
    engine = CodecEngine(dec, 2, "fp16", **kw)
    got = decode_with(engine, codes, chunk=2).float()
    assert calls and {w[1] for w in calls} == {128, 64}, {tuple(w) for w in calls}
    assert snr_db(plain, got) > 45
    _assert_replay_equals_eager(engine, codes, frames=2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_split_k_convs_keep_the_decode_and_replay(decoders, monkeypatch, precision):
    """Every conv on the implicit-GEMM kernel, the short ones' tiles split over K
    (conv_split_max_streams: partials, an arrival counter, the last program's epilogue)
    against the same without the split (min rows 1): the same audio to the summation order,
    several steps in a row (the counters reset themselves), and a captured step equal to the
    eager one."""
    from ttsbuild.plugins import causal_conv
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(causal_conv, "SPLIT_K", False)  # only where the engine asks
    splits, plan = [], causal_conv._split_k
    monkeypatch.setattr(causal_conv, "_split_k", lambda *a: splits.append(plan(*a)) or splits[-1])
    cfg, _, dec = decoders
    codes = rand_codes(cfg, 2, 8, seed=75)
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True)
    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)
    plain = CodecEngine(dec, 2, precision, conv_split_max_streams=0, **kw)
    plain = decode_with(plain, codes, chunk=2).float()
    assert splits and max(splits) == 1
    splits.clear()
    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 512)
    engine = CodecEngine(dec, 2, precision, conv_split_max_streams=2, **kw)
    got = decode_with(engine, codes, chunk=2).float()
    assert max(splits) > 1, splits
    assert snr_db(plain, got) > 45
    _assert_replay_equals_eager(engine, codes, frames=4)  # 8 rows: the tiles


def test_few_stream_tiles_keep_the_decode_and_replay(monkeypatch):
    """The few-stream tiles (FEW_TILES_HOPPER: on by default on sm_90 and newer, up to 4
    streams) at the real decoder widths (768 / 384 / 192 / 96 channels), two streams, against
    the rules' tiles (FEW_TILES empty): every one of them taken, the same audio to the
    summation order over several steps (the split-K counters reset themselves), and a captured
    step equal to the eager one."""
    from ttsbuild.plugins import causal_conv
    from ttsbuild.plugins._dispatch import on_hopper

    if not on_hopper(torch.empty(0, device="cuda")):
        pytest.skip("the few-stream tiles are the default on sm_90 and newer only")
    cfg = small_config(decoder_dim=1536)
    dec = our_decoder(cfg, test_state(cfg, seed=90)).cuda()
    codes = rand_codes(cfg, 2, 8, seed=91)
    kw = dict(conv_impl="triton", fused=True, channels_last=True, state_channels_last=True)
    taken, real = [], causal_conv._few_tile
    monkeypatch.setattr(causal_conv, "_few_tile",
                        lambda x, c: taken.append(real(x, c)) or taken[-1])
    monkeypatch.setattr(causal_conv, "FEW_TILES", {})
    plain = decode_with(CodecEngine(dec, 2, "fp16", **kw), codes, chunk=1).float()
    assert taken and not any(taken)  # asked, and none given
    taken.clear()
    monkeypatch.setattr(causal_conv, "FEW_TILES", None)  # the default
    engine = CodecEngine(dec, 2, "fp16", **kw)
    got = decode_with(engine, codes, chunk=1).float()
    assert {t for t in taken if t} == set(causal_conv.FEW_TILES_HOPPER.values())
    assert snr_db(plain, got) > 45
    _assert_replay_equals_eager(engine, codes, frames=4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_block_act_fold_keeps_the_decode_and_replays(decoders, monkeypatch, precision):
    """Each decoder block's first SnakeBeta in the epilogue of the conv before it
    (fold_block_act) against its own launch, every conv on the implicit-GEMM kernel (min rows
    1): the same audio (both round the conv output, then the same fp32 SnakeBeta), and a
    captured step equal to the eager one."""
    from ttsbuild.runtime import codec_engine

    monkeypatch.setattr(codec_engine, "IMPLICIT_MIN_ROWS", 1)
    cfg, _, dec = decoders
    _assert_same_bits_and_replay(dec, precision, rand_codes(cfg, 2, 8, seed=77),
                                 "fold_block_act")


def _served_fused_layers(seed, max_rows, codes_seed, frames=8, **extra):
    """`_fused_layers_case`'s decoder on the GPU in the served settings (channels-last operands
    and state) with `extra`, and `frames` frames of codes for 2 rows."""
    cfg, dec, kw = _fused_layers_case(seed, max_rows)
    kw.update(channels_last=True, state_channels_last=True, **extra)
    return dec.cuda(), kw, rand_codes(cfg, 2, frames, seed=codes_seed)


@pytest.mark.parametrize(("precision", "min_db"), [("fp32", 55), ("fp16", 45)])
def test_half_transformer_weights_keep_the_decode_and_replay(precision, min_db):
    """The fused pre-transformer layers (a frame a step, as GEMV kernels) reading scaled fp16
    weights (transformer_half_weights) against their fp32 weights, in the served settings:
    audio that differs by the weights' rounding (fp32 elsewhere: that loss alone; fp16: with
    the later stages' roundings, within the gate), and a captured step equal to the eager
    one. (On the GPU the transformer stage's weights are not TF32-rounded as on CPU, so the
    fp16 copies differ from them at every precision.)"""
    dec, kw, codes = _served_fused_layers(46, 8, 79)
    plain = CodecEngine(dec, 2, precision, transformer_half_weights=False, **kw)
    plain = decode_with(plain, codes, chunk=1)
    engine = CodecEngine(dec, 2, precision, transformer_half_weights=True, **kw)
    assert engine.fused_layers_max_rows == 8 and engine._tr_half
    got = decode_with(engine, codes, chunk=1)
    snr = snr_db(plain, got)
    assert min_db < snr < 200, snr  # rounded weights were read, and only rounded
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize(("precision", "half"), [("fp32", False), ("fp16", False), ("fp16", True)])
def test_qkv_attend_keeps_the_decode_and_replays(precision, half):
    """The fused layers' qkv GEMV and attention as one launch (qkv_attend: each head's
    attention run by the program that wrote its last qkv tile, across the GPU's concurrent
    programs) against the two launches, fp32 or scaled fp16 weights, in the served settings:
    the same audio to the summation order (fp16: that order flips roundings in the later
    stages, so both are held to the fp32 decode instead, and the fused launch may be no
    further from it than 1 dB beyond the two launches; on an H100 the fp16 pair with fp16
    weights differed by 57.5 dB, each ~53 dB from the fp32 decode), the rings carried over
    steps, the head counters reset by themselves, and a captured step equal to the eager
    one."""
    dec, kw, codes = _served_fused_layers(48, 8, 81, transformer_half_weights=half)
    plain = decode_with(CodecEngine(dec, 2, precision, **kw), codes, chunk=1)
    engine = CodecEngine(dec, 2, precision, qkv_attend=True, **kw)
    assert engine.qkv_attend
    got = decode_with(engine, codes, chunk=1)
    if precision == "fp32":
        assert ((got - plain).abs().max() / plain.abs().max()).item() <= 1e-5
    else:
        ref = decode_with(CodecEngine(dec, 2, "fp32", **kw), codes, chunk=1)
        plain_db, got_db = snr_db(ref, plain), snr_db(ref, got)
        assert 45 < plain_db < 200 and got_db > plain_db - 1.0, (plain_db, got_db)
        assert snr_db(plain, got) > 50
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("half", [False, True])
def test_tf32_layer_tiles_keep_the_decode_and_replay(half):
    """Steps of more rows than the GEMV layers take (2 rows x 4 frames here), up to
    tf32_layers_max_rows, on the fused layers' TF32 tiles against the cuBLAS TF32 GEMM path,
    in the served settings (fp16 elsewhere; fp32 or scaled fp16 transformer weights): the
    same audio to TF32's rounding, and a captured step equal to the eager one. 64 rows cover
    every step of this 2-slot engine ((2 + 1) x 16 frames): with the fp16 copies, its fp32
    transformer weights are freed (the default, TR_TF32_MAX_ROWS "all", does the same)."""
    dec, kw, codes = _served_fused_layers(52, 2, 83, transformer_half_weights=half)
    plain = decode_with(CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=0, **kw), codes,
                        chunk=4)  # fmt: skip
    engine = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=64, **kw)
    assert engine.tf32_layers_max_rows == 64 and engine.tr_fp32_dropped == half
    got = decode_with(engine, codes, chunk=4)
    assert snr_db(plain, got) > 45
    _assert_replay_equals_eager(engine, codes, frames=4)  # 8 rows: the tiles


@pytest.mark.parametrize("frames", [1, 4])
def test_half_rings_keep_the_decode_and_replay(frames):
    """The pre-transformer's rings in fp16 (ring_half) against fp32 rings, in the served
    settings at one frame a step (the GEMV layers) and four (the TF32 tiles): the audio within
    the rings' rounding, and a captured step equal to the eager one."""
    dec, kw, codes = _served_fused_layers(54, 2, 85)
    plain = decode_with(CodecEngine(dec, 2, "fp16", ring_half=False, **kw), codes, chunk=frames)
    engine = CodecEngine(dec, 2, "fp16", ring_half=True, **kw)
    assert engine.ring_half
    got = decode_with(engine, codes, chunk=frames)
    assert 45 < snr_db(plain, got) < 200
    _assert_replay_equals_eager(engine, codes, frames=frames)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_transposed_convs_as_causal_convs_keep_the_decode_and_replay(precision):
    """The transposed convs as causal convs over their input (tconv_conv: the implicit-GEMM
    kernel, the input's last frames as context, the block SnakeBeta with it) against the
    GEMM + overlap-add path, in the served settings: the audio to the half precision's
    rounding, chunk by chunk, and a captured step equal to the eager one."""
    dec, kw, codes = _served_fused_layers(60, 8, 89, frames=8, fused_output=True)
    plain = decode_with(CodecEngine(dec, 2, precision, tconv_conv=False, **kw), codes, chunk=1)
    engine = CodecEngine(dec, 2, precision, tconv_conv=True, **kw)
    assert engine._tconv_k and not engine._tconv_w
    got = decode_with(engine, codes, chunk=1)
    assert snr_db(plain.float(), got.float()) > (45 if precision == "fp16" else 25)
    _assert_replay_equals_eager(engine, codes)
    _assert_replay_equals_eager(engine, codes, frames=4)


def test_fused_codebook_lookup_keeps_the_decode_and_replays():
    """The codebook lookup as one launch (lookup_fused) against the eager lookup, in the
    served settings: the audio to fp32's summation order (fp16 after it), and a captured
    step equal to the eager one."""
    dec, kw, codes = _served_fused_layers(62, 8, 91, frames=6, fused_output=True)
    plain = decode_with(CodecEngine(dec, 2, "fp16", lookup_fused=False, **kw), codes, chunk=1)
    engine = CodecEngine(dec, 2, "fp16", lookup_fused=True, **kw)
    got = decode_with(engine, codes, chunk=1)
    assert snr_db(plain.float(), got.float()) > 60
    _assert_replay_equals_eager(engine, codes)


def test_small_steps_with_pdl_keep_the_decode_and_replay():
    """Steps of at most pdl_max_rows streams launch the codec kernels with PDL (each
    waits on the device for the one before): the same audio as without (to 1e-6), in the
    served settings with the fused layers, and a captured step equal to the eager one."""
    dec, kw, codes = _served_fused_layers(58, 8, 87, frames=6, fused_output=True)
    plain = decode_with(CodecEngine(dec, 2, "fp16", pdl_max_rows=0, **kw), codes, chunk=1)
    engine = CodecEngine(dec, 2, "fp16", pdl_max_rows=2, **kw)
    got = decode_with(engine, codes, chunk=1)
    assert ((got - plain).abs().max() / plain.abs().max()).item() <= 1e-6
    _assert_replay_equals_eager(engine, codes)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_output_stage_in_the_last_conv_epilogue_keeps_the_decode_and_replays(precision):
    """The output stage begun in the last 1x1 conv's epilogue (output_epilogue) against the
    fused output kernel, in the served settings: the audio to fp32's summation order, chunk
    by chunk, and a captured step equal to the eager one."""
    dec, kw, codes = _served_fused_layers(64, 8, 93, frames=6, fused_output=True)
    plain = decode_with(CodecEngine(dec, 2, precision, output_epilogue=False, **kw), codes,
                        chunk=1)  # fmt: skip
    engine = CodecEngine(dec, 2, precision, output_epilogue=True, **kw)
    assert engine.output_epilogue
    got = decode_with(engine, codes, chunk=1)
    assert ((got - plain).abs().max() / plain.abs().max()).item() < 1e-4
    _assert_replay_equals_eager(engine, codes)
    _assert_replay_equals_eager(engine, codes, frames=4)
