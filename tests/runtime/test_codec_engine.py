"""The slot-indexed codec engine: exact against a full fp32 decode for any chunking and any
interleaving of slots, state touched only for the rows stepped, half precision measured."""

from __future__ import annotations

import pytest
import torch
from kernel_device import HAS_TRITON
from test_codec import our_decoder, rand_codes, small_config, test_state

from ttsbuild.build.codec_fold import fold_codec_state, load_folded_codec
from ttsbuild.runtime.codec_engine import (
    MIN_CODEC_SNR_DB,
    CodecEngine,
    codec_snr_db,
    random_codes,
    round_to_tf32,
    stage_names,
)

REL_TOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def interleaved_run(engine: CodecEngine, cfg, bucket: int, steps: int, seed: int, leave: float):
    """Requests join and leave slots at random; each step runs a random subset of the busy
    slots in a random order, padded to `bucket` with the scratch slot, with a random chunk
    size. Returns (per request: streamed pcm, its codes)."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(engine.num_slots))
    busy: dict[int, dict] = {}  # slot -> request
    done = []
    for _ in range(steps):
        # leave: a request ends with probability `leave` (never before its first step)
        for slot in [s for s, r in busy.items() if r["pcm"] and torch.rand(1, generator=g) < leave]:
            done.append(busy.pop(slot))
            free.append(slot)
        # join
        while free and torch.rand(1, generator=g) < 0.5:
            slot = free.pop(int(torch.randint(len(free), (1,), generator=g)))
            engine.reset([slot])
            busy[slot] = {"codes": [], "pcm": []}
        if not busy:
            continue
        slots = [s for s in busy if torch.rand(1, generator=g) < 0.8] or list(busy)[:1]
        slots = [slots[i] for i in torch.randperm(len(slots), generator=g)][:bucket]
        n = int(torch.randint(1, engine.max_chunk + 1, (1,), generator=g))
        codes = torch.randint(0, cfg.codebook_size, (bucket, cfg.num_quantizers, n), generator=g)
        rows = torch.tensor(slots + [engine.scratch] * (bucket - len(slots)))
        idle = [s for s in range(engine.num_slots) if s not in slots]
        before = [[t[s].clone() for t in engine.tensors()] for s in idle]
        pcm = engine.step(rows, codes)
        assert pcm.shape == (bucket, n * 1920) and pcm.dtype == torch.float32
        for s, snap in zip(idle, before, strict=True):  # untouched: not stepped
            assert all(torch.equal(t[s], b) for t, b in zip(engine.tensors(), snap, strict=True))
        for j, s in enumerate(slots):
            busy[s]["codes"].append(codes[j])
            busy[s]["pcm"].append(pcm[j])
    done.extend(busy.values())
    return [(torch.cat(r["pcm"]), torch.cat(r["codes"], dim=-1)) for r in done if r["pcm"]]


@pytest.mark.parametrize(("window", "max_chunk", "steps", "leave"),
                         [(8, 4, 40, 1 / 6), (72, 5, 60, 1 / 40)])
@pytest.mark.parametrize("conv_impl", ["cudnn", "gemm"])
def test_interleaved_slots_equal_full_decode(window, max_chunk, steps, leave, conv_impl):
    cfg = small_config(sliding_window=window)
    dec = our_decoder(cfg, test_state(cfg, seed=20))
    engine = CodecEngine(dec, num_slots=4, max_chunk=max_chunk, conv_impl=conv_impl)
    results = interleaved_run(engine, cfg, bucket=4, steps=steps, seed=window, leave=leave)
    assert len(results) >= 4
    longest = max(codes.shape[-1] for _, codes in results)
    assert longest > window + max_chunk  # the ring has wrapped
    for pcm, codes in results:
        with torch.no_grad():
            full = dec(codes[None])[0, 0]
        assert rel_err(pcm, full) <= REL_TOL


@pytest.mark.parametrize("splits", [[1] * 12 + [4, 4, 3], [4, 2, 4, 1, 4, 4]])
@pytest.mark.parametrize("conv_impl", ["cudnn", "gemm"])
def test_any_chunking_equals_full_decode(splits, conv_impl):
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=21))
    codes = rand_codes(cfg, 2, sum(splits), seed=22)
    engine = CodecEngine(dec, num_slots=2, max_chunk=4, conv_impl=conv_impl)
    rows = torch.tensor([1, 0])  # slot order differs from the batch order
    engine.reset(rows)
    out, i = [], 0
    for n in splits:
        out.append(engine.step(rows, codes[..., i:i + n]))
        i += n
    with torch.no_grad():
        full = dec(codes)[:, 0]
    assert rel_err(torch.cat(out, dim=-1), full) <= REL_TOL
    assert engine.pos.tolist() == [sum(splits)] * 2 + [0]


def test_folded_codec_engine_equals_decoder(tiny_checkpoint):
    """The engine built from the compiled (folded) codec of the tiny stand-in."""
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.model.codec import CodecConfig

    ckpt = load_checkpoint(tiny_checkpoint)
    cfg = CodecConfig.from_official(ckpt.codec_config)
    state = ckpt.tensors("codec")
    g = torch.Generator().manual_seed(0)
    for k, t in state.items():  # non-trivial Snake folds
        if k.endswith((".alpha", ".beta")):
            state[k] = 0.3 * torch.randn(t.shape, generator=g)
    folded = load_folded_codec(cfg, fold_codec_state(state))
    ref = our_decoder(cfg, state)
    codes = random_codes(cfg, 2, 6, seed=1)
    engine = CodecEngine(folded, num_slots=3)
    assert codec_snr_db(engine, ref, codes) > 100


def test_step_rejects_a_chunk_beyond_the_ring():
    cfg = small_config(sliding_window=8)
    engine = CodecEngine(our_decoder(cfg, test_state(cfg, seed=1)), num_slots=1, max_chunk=2)
    with pytest.raises(ValueError, match="max_chunk"):
        engine.step(torch.tensor([0]), rand_codes(cfg, 1, 3, seed=2))


def test_bad_precision_and_stage_names():
    cfg = small_config(sliding_window=8)
    dec = our_decoder(cfg, test_state(cfg, seed=1))
    with pytest.raises(ValueError, match="precision"):
        CodecEngine(dec, 1, "fp8")
    with pytest.raises(ValueError, match="unknown codec stages"):
        CodecEngine(dec, 1, "fp16", fp32_stages=("decoder.block9",))
    assert stage_names(dec)[-1] == "output"


def test_round_to_tf32():
    x = torch.randn(1000, dtype=torch.float32) * 1e3
    r = round_to_tf32(x)
    assert (r.view(torch.int32) & 0x1FFF).eq(0).all()  # 13 low mantissa bits cleared
    rel = ((r - x).abs() / x.abs()).max().item()
    assert 0 < rel <= 2.0**-11 * (1 + 1e-6)  # half an ulp of a 10-bit mantissa


def test_half_precision_quality_order():
    """Measured, not assumed: on the small real-structure codec fp32 is exact, TF32 loses
    least, then fp16, then bf16."""
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=30))
    codes = rand_codes(cfg, 2, 8, seed=31)
    snr = {p: codec_snr_db(CodecEngine(dec, 2, p), dec, codes)
           for p in ("fp32", "tf32", "fp16", "bf16")}
    assert snr["fp32"] > 100
    assert snr["fp32"] > snr["tf32"] > snr["fp16"] > snr["bf16"] > 20, snr


@pytest.mark.parametrize(("conv_impl", "implicit_min_rows", "fused", "split"),
                         [("gemm", 512, False, False), ("triton", 1, True, False),
                          ("triton", 512, False, False), ("triton", 1, True, True)])
def test_conv_impls_keep_fp16_quality(conv_impl, implicit_min_rows, fused, split, monkeypatch):
    """The im2col and implicit-GEMM convs (the Triton kernels under TRITON_INTERPRET=1, else
    their references; min rows 1: every half-precision conv takes the implicit GEMM, and the
    opt-in fusions are on; split: the 2-stream steps' convs on the kernel with their short
    tiles split over K, conv_split_max_streams) decode fp16 as well as cuDNN's convs do: the
    same SNR to 1 dB against the fp32 decode, above the compile gate. The packed weights
    replace the unpacked ones."""
    import ttsbuild.plugins.causal_conv as cc
    import ttsbuild.runtime.codec_engine as ce

    monkeypatch.setattr(ce, "IMPLICIT_MIN_ROWS", implicit_min_rows)
    splits, plan = [], cc._split_k
    monkeypatch.setattr(cc, "_split_k", lambda *a: splits.append(plan(*a)) or splits[-1])
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=32))
    codes = rand_codes(cfg, 2, 8, seed=33)
    base = CodecEngine(dec, 2, "fp16")
    other = CodecEngine(dec, 2, "fp16", conv_impl=conv_impl, fused=fused,
                        conv_split_max_streams=2 if split else 0)
    assert other.fused_convs == fused
    assert other._conv_w and other._tconv_w
    assert all(m.conv.weight.numel() == 0 for m in [*other._conv_w, *other._tconv_w])
    assert other.weight_bytes() == base.weight_bytes()  # repacked, not held twice
    snr_base, snr_other = codec_snr_db(base, dec, codes), codec_snr_db(other, dec, codes)
    assert abs(snr_base - snr_other) < 1.0 and snr_other > MIN_CODEC_SNR_DB, (snr_base, snr_other)
    if splits:  # the kernel ran (the interpreter): split tiles exactly where asked for
        assert (max(splits) > 1) == split, splits


def test_small_steps_take_every_conv_on_the_kernel_with_split_k(monkeypatch):
    """conv_split_max_streams (default CONV_SPLIT_MAX_STREAMS): a step of at most that many
    streams runs every half-precision conv on the implicit-GEMM kernel, whatever its rows, and
    asks it for split-K; a larger step keeps the short convs (below IMPLICIT_MIN_ROWS) on
    im2col + GEMM and asks for no split. The same audio either way to fp16 rounding."""
    import ttsbuild.runtime.codec_engine as ce

    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=34))
    kw = dict(conv_impl="triton", fused=True)
    assert CodecEngine(dec, 3, "fp16", **kw).conv_split_max_streams == ce.CONV_SPLIT_MAX_STREAMS
    assert CodecEngine(dec, 3, "fp16").conv_split_max_streams == 0  # cuDNN convs: no kernel
    with pytest.raises(ValueError, match="conv_split_max_streams"):
        CodecEngine(dec, 3, "fp16", conv_split_max_streams=-1, **kw)
    calls = _spy(monkeypatch, ce, "causal_conv",
                 lambda x, *a, **k: (x.shape[0] * x.shape[-1], k.get("split")))
    engine = CodecEngine(dec, 3, "fp16", conv_split_max_streams=2, **kw)
    packed = [m for m in engine.codec.modules() if isinstance(m, ce.CausalConv1d)
              and m in engine._conv_w and engine._stage_of[m].dtype != torch.float32]  # fmt: skip
    codes, pcm = rand_codes(cfg, 3, 1, seed=35), {}
    for streams in (2, 3):
        calls.clear()
        pcm[streams] = ce.decode_with(engine, codes[:streams])
        if streams == 2:  # every stride-1 conv with a packed weight, split asked for
            assert len(calls) == len(packed) > 0 and all(split for _, split in calls), calls
            assert min(rows for rows, _ in calls) < ce.IMPLICIT_MIN_ROWS
        else:  # only the convs of IMPLICIT_MIN_ROWS rows or more, no split
            assert all(rows >= ce.IMPLICIT_MIN_ROWS and not split for rows, split in calls)
            assert len(calls) < len(packed)
    assert ce.snr_db(pcm[3][:2].float(), pcm[2].float()) > 40  # the same two streams


def test_resolve_conv_impl(monkeypatch):
    from ttsbuild.runtime.codec_engine import resolve_conv_impl

    monkeypatch.delenv("TTSBUILD_CODEC_CONV", raising=False)
    assert resolve_conv_impl("auto", "cpu") == "cudnn"
    assert resolve_conv_impl("auto", "cuda") == "triton"
    assert resolve_conv_impl("gemm", "cuda") == "gemm"
    monkeypatch.setenv("TTSBUILD_CODEC_CONV", "gemm")
    assert resolve_conv_impl("auto", "cuda") == "gemm"
    assert resolve_conv_impl("cudnn", "cuda") == "cudnn"  # an explicit plan choice wins
    monkeypatch.setenv("TTSBUILD_CODEC_CONV", "fast")
    with pytest.raises(ValueError, match="TTSBUILD_CODEC_CONV"):
        resolve_conv_impl("auto", "cuda")


def test_the_fused_attention_steps_decode_the_same_audio():
    """CodecEngine(fused_attention=True): each pre-transformer layer's RoPE, ring writes,
    window mask and attention in one kernel (the kernel under TRITON_INTERPRET=1, else its
    reference). The same audio over 10 frames in chunks of 4 (the rings carried across steps,
    a second stream started in a slot the first used), as the fused path's separate ops."""
    import ttsbuild.runtime.codec_engine as ce

    cfg = small_config(num_key_value_heads=4)  # as many key/value as query heads, as the real
    dec = our_decoder(cfg, test_state(cfg, seed=38))
    plain = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True)
    fused = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True, fused_attention=True)
    assert fused.fused_attention and not plain.fused_attention
    grouped = small_config()  # 4 query heads on 2 key/value heads: the separate ops stay
    assert not CodecEngine(our_decoder(grouped, test_state(grouped, seed=38)), 2, "fp16",
                           conv_impl="triton", fused=True, fused_attention=True).fused_attention
    for seed in (39, 40):
        codes = rand_codes(cfg, 2, 10, seed=seed)
        want, got = ce.decode_with(plain, codes), ce.decode_with(fused, codes)
        rel = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        assert got.shape == want.shape and rel <= 1e-3, rel


def test_small_steps_run_the_transformer_as_fused_linears_with_the_same_audio(monkeypatch):
    """CodecEngine(fused_layers_max_rows=R): a step of at most R frames (rows x chunk) runs
    the pre-transformer as plugins.fused_linear launches (norm + qkv, o + residual, norm +
    gate/up + SiLU, down + residual, the projections; the kernels under TRITON_INTERPRET=1,
    else their references); larger steps keep the GEMM path. The same audio either way, over
    chunks of 1 and 3 frames (rings carried across steps); off without the fused attention
    or with a half-precision transformer stage."""
    import ttsbuild.runtime.codec_engine as ce

    cfg = small_config(num_key_value_heads=4)
    dec = our_decoder(cfg, test_state(cfg, seed=41))
    plain = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True, fused_attention=True)
    small = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True, fused_attention=True,
                        fused_layers_max_rows=4, tf32_layers_max_rows=0)  # fmt: skip
    assert small.fused_layers_max_rows == 4 and plain.fused_layers_max_rows == 0
    assert CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True,
                       fused_layers_max_rows=4).fused_layers_max_rows == 0  # no fused attention
    all_half = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True, fused_attention=True,
                           fp32_stages=("output",), fused_layers_max_rows=4)  # fmt: skip
    assert all_half.fused_layers_max_rows == 0  # layer scales not folded into fp16 weights
    with pytest.raises(ValueError, match="fused_layers_max_rows"):
        CodecEngine(dec, 2, "fp16", fused_layers_max_rows=-1)
    calls = []
    fused_path = ce.CodecEngine._transformer_fused
    monkeypatch.setattr(ce.CodecEngine, "_transformer_fused",
                        lambda self, x, *a, **k: calls.append(x.shape[0] * x.shape[1])
                        or fused_path(self, x, *a, **k))  # fmt: skip
    exact = CodecEngine(dec, 2, "fp32", conv_impl="triton", fused=True, fused_attention=True,
                        fused_layers_max_rows=4)  # fmt: skip
    for seed, chunk in ((42, 1), (43, 3)):
        codes = rand_codes(cfg, 2, 9, seed=seed)
        ref = ce.decode_with(dec, codes)  # the full fp32 decode
        want = ce.decode_with(plain, codes, chunk=chunk)
        calls.clear()
        got = ce.decode_with(small, codes, chunk=chunk)
        # 2 rows x 1 frame <= 4 takes the fused path; 2 x 3 = 6 frames the GEMMs
        assert calls == ([2] * 9 if chunk == 1 else []), calls
        # fp16 elsewhere: no further from the fp32 decode than the GEMM path (which rounds
        # the transformer's GEMM inputs to TF32; the fused linears do not)
        assert got.shape == want.shape == ref.shape
        assert rel_err(got, ref) <= max(1.2 * rel_err(want, ref), 1e-4), (
            rel_err(got, ref), rel_err(want, ref))
        assert rel_err(got, want) <= 1e-2
        calls.clear()
        assert rel_err(ce.decode_with(exact, codes, chunk=chunk), ref) <= REL_TOL
        assert calls == ([2] * 9 if chunk == 1 else []), calls


def _fused_layers_case(seed: int, max_rows: int = 4):
    """The small decoder with as many key/value as query heads (the fused attention's need, as
    the real codec has; weights from `seed`) and the engine settings of the fused
    pre-transformer layers on steps of up to `max_rows` frames."""
    cfg = small_config(num_key_value_heads=4)
    kw = dict(conv_impl="triton", fused=True, fused_attention=True,
              fused_layers_max_rows=max_rows)  # fmt: skip
    return cfg, our_decoder(cfg, test_state(cfg, seed=seed)), kw


def test_fused_layers_with_half_weights_read_the_fp32_weights_rounded_to_fp16(monkeypatch):
    """CodecEngine(transformer_half_weights=True): the fused pre-transformer layers read fp16
    weights with per-row power-of-two scales (plugins.fused_linear scaled_half_weight) in
    place of the fp32 ones; the same audio as the fp32 fused layers with those weights
    rounded, and close to the fp32 decode. Off where no step runs the fused layers."""
    import ttsbuild.runtime.codec_engine as ce

    cfg, dec, kw = _fused_layers_case(46)
    exact = CodecEngine(dec, 2, "fp32", **kw)
    half = CodecEngine(dec, 2, "fp32", transformer_half_weights=True, **kw)
    layers = len(dec.pre_transformer.layers)
    assert not exact._tr_half and len(half._tr_half) == 2 + 4 * layers
    # the default (TR_HALF_WEIGHTS): on where the engine is not the strict fp32 reference
    assert bool(CodecEngine(dec, 2, "fp16", **kw)._tr_half) == ce.TR_HALF_WEIGHTS
    extra = sum(w.numel() * 2 + s.numel() * 4 for w, s in half._tr_half.values())
    assert half.weight_bytes() == exact.weight_bytes() + extra
    assert not CodecEngine(dec, 2, "fp32", conv_impl="triton", fused=True, fused_attention=True,
                           transformer_half_weights=True)._tr_half  # fmt: skip
    seen = _spy(monkeypatch, ce, "fused_linear", lambda x, w, s=None, **k: (w.dtype, s is not None))
    codes = rand_codes(cfg, 2, 9, seed=47)
    ref = ce.decode_with(dec, codes)  # the full fp32 decode
    got = ce.decode_with(half, codes, chunk=1)
    assert seen and set(seen) == {(torch.float16, True)}, set(seen)
    seen.clear()
    want = ce.decode_with(exact, codes, chunk=1)
    assert set(seen) == {(torch.float32, False)}
    assert not torch.equal(got, want)  # the rounded weights were read
    snr = ce.snr_db(ref, got)
    assert 60 <= snr < 200, snr
    # the exact engine with its weights rounded as the half copies are: the same audio
    tr_e, tr_h, h = exact.codec.pre_transformer, half.codec.pre_transformer, half._tr_half
    pairs = [(tr_e.input_proj.weight, h[tr_h.input_proj]),
             (tr_e.output_proj.weight, h[tr_h.output_proj])]
    for le, lh in zip(tr_e.layers, tr_h.layers, strict=True):
        qkv, _, gate_up = exact._packed[le]
        pairs += [(qkv, h[lh, "qkv"]), (gate_up, h[lh, "gate_up"]),
                  (le.self_attn.o_proj.weight, h[lh.self_attn.o_proj]),
                  (le.mlp.down_proj.weight, h[lh.mlp.down_proj])]
    with torch.no_grad():
        for weight, (w16, scale) in pairs:
            assert weight.shape == w16.shape
            weight.copy_(w16.float() * scale[:, None])
    assert rel_err(ce.decode_with(exact, codes, chunk=1), got) <= REL_TOL


def test_fused_layers_with_qkv_and_attention_in_one_launch_decode_the_same_audio(monkeypatch):
    """CodecEngine(qkv_attend=True): each fused layer's qkv GEMV and its attention (RoPE, ring
    writes, window) as one plugins.fused_linear.norm_linear_ring_attend launch (the kernel
    under TRITON_INTERPRET=1, else its reference), with fp32 or scaled fp16 weights: the same
    audio as the two launches, the rings carried across steps. Off without fused layers and
    for steps of more than QKV_ATTEND_MAX_STREAMS streams."""
    import ttsbuild.runtime.codec_engine as ce

    cfg, dec, kw = _fused_layers_case(48)
    assert not CodecEngine(dec, 2, "fp32", conv_impl="triton", fused=True, fused_attention=True,
                           qkv_attend=True).qkv_attend  # fmt: skip
    calls = _spy(monkeypatch, ce, "norm_linear_ring_attend", lambda *a, **k: a[2].dtype)
    codes = rand_codes(cfg, 2, 7, seed=49)
    layers = len(dec.pre_transformer.layers)
    for half in (False, True):
        plain = CodecEngine(dec, 2, "fp32", transformer_half_weights=half, **kw)
        one = CodecEngine(dec, 2, "fp32", transformer_half_weights=half, qkv_attend=True, **kw)
        assert one.qkv_attend and not plain.qkv_attend
        calls.clear()
        want = ce.decode_with(plain, codes, chunk=1)
        assert calls == []
        got = ce.decode_with(one, codes, chunk=1)
        assert calls == [torch.float16 if half else torch.float32] * (7 * layers)
        assert got.shape == want.shape and rel_err(got, want) <= REL_TOL
    # three streams a step: one program a head would attend for all in turn; the two launches
    assert ce.QKV_ATTEND_MAX_STREAMS == 2
    calls.clear()
    ce.decode_with(CodecEngine(dec, 3, "fp32", qkv_attend=True, **kw),
                   rand_codes(cfg, 3, 2, seed=50), chunk=1)  # fmt: skip
    assert calls == []


def test_larger_steps_on_tf32_tiles_decode_as_the_tf32_gemms(monkeypatch):
    """CodecEngine(tf32_layers_max_rows=R): steps of more frames than fused_layers_max_rows,
    up to R, run the fused layers with TF32 tiles (fused_linear(tf32=True); on CPU the
    references), in place of the TF32 GEMM path: close to it and to the fp32 decode. Never in
    a strict fp32 engine (no TF32 stage) or without the fused layers."""
    import ttsbuild.runtime.codec_engine as ce

    cfg, dec, kw = _fused_layers_case(52, max_rows=2)
    plain = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=0, **kw)
    tiles = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=6, **kw)
    assert tiles.tf32_layers_max_rows == 6 and plain.tf32_layers_max_rows == 0
    # the default (TR_TF32_MAX_ROWS): every step, unless the environment says otherwise
    assert CodecEngine(dec, 2, "fp16", **kw).tf32_layers_max_rows == ce.TR_TF32_MAX_ROWS
    assert ce._TR_TF32 != "all" or ce.TR_TF32_MAX_ROWS == ce.TR_TF32_ALL
    assert CodecEngine(dec, 2, "fp32", tf32_layers_max_rows=6, **kw).tf32_layers_max_rows == 0
    assert CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=True, fused_attention=True,
                       tf32_layers_max_rows=6).tf32_layers_max_rows == 0  # fmt: skip
    with pytest.raises(ValueError, match="tf32_layers_max_rows"):
        CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=-1, **kw)
    asked = _spy(monkeypatch, ce, "fused_linear", lambda *a, **k: (a[0].shape[0], k.get("tf32")))
    codes = rand_codes(cfg, 2, 9, seed=53)
    ref = ce.decode_with(dec, codes)
    want = ce.decode_with(plain, codes, chunk=3)
    assert asked == []  # 2 rows x 3 frames: the GEMM path
    got = ce.decode_with(tiles, codes, chunk=3)
    layers = len(dec.pre_transformer.layers)
    assert asked == [(6, True)] * (3 * (2 + 4 * layers))  # 3 steps of 6 rows, on the tiles
    asked.clear()
    ce.decode_with(tiles, codes, chunk=1)  # 2 rows: the GEMVs, no TF32
    assert {t for _, t in asked} == {False}
    assert got.shape == want.shape == ref.shape
    assert rel_err(got, ref) <= max(1.2 * rel_err(want, ref), 1e-4), (rel_err(got, ref),
                                                                       rel_err(want, ref))
    assert rel_err(got, want) <= 1e-2


def test_tf32_tiles_for_every_step_drop_the_fp32_transformer_weights(monkeypatch):
    """Where every step the engine can take ((slots + 1) x max_chunk frames) runs the fused
    layers on the scaled fp16 copies (GEMVs, then TF32 tiles), the fp32 weights of the
    pre-transformer's linears are freed: weight_bytes falls by exactly their bytes, the
    biases stay, the audio is the same as with them kept, and a step past the bound is
    refused with a clear error. Kept where a step could take the GEMM path."""
    import ttsbuild.runtime.codec_engine as ce

    cfg, dec, kw = _fused_layers_case(54, max_rows=2)
    kw = dict(kw, max_chunk=3, transformer_half_weights=True)
    bound = (2 + 1) * 3  # (slots + 1) x max_chunk
    kept = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=bound - 1, **kw)
    dropped = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=bound, **kw)
    assert not kept.tr_fp32_dropped and dropped.tr_fp32_dropped
    assert not CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=bound, **dict(
        kw, transformer_half_weights=False)).tr_fp32_dropped  # no copies to read instead
    tr = kept.codec.pre_transformer
    fp32 = [tr.input_proj.weight, tr.output_proj.weight]
    for layer in tr.layers:
        qkv, _, gate_up = kept._packed[layer]
        fp32 += [qkv, gate_up, layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
    assert all(w.dtype == torch.float32 and w.numel() > 0 for w in fp32)
    freed = sum(w.numel() * w.element_size() for w in fp32)
    assert kept.weight_bytes() - dropped.weight_bytes() == freed
    tr_d = dropped.codec.pre_transformer
    assert tr_d.output_proj.weight.numel() == 0 and tr_d.output_proj.bias.numel() > 0
    assert all(dropped._packed[layer][0].numel() == 0 for layer in tr_d.layers)
    codes = rand_codes(cfg, 2, 9, seed=55)
    for chunk in (1, 3):  # 2 rows on the GEMVs, 6 on the TF32 tiles
        assert torch.equal(ce.decode_with(dropped, codes, chunk=chunk),
                           ce.decode_with(kept, codes, chunk=chunk))
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="more than the engine's 3 slots x 3"):
        dropped._transformer(torch.randn(4, 3, tr_d.input_proj.in_features), rows,
                             torch.zeros(4, dtype=torch.long), dropped.stages["transformer"])


@pytest.mark.parametrize("fused_layers", [0, 4])
def test_half_precision_rings_keep_the_audio_close(fused_layers, monkeypatch):
    """CodecEngine(ring_half=True): the pre-transformer's key/value rings in fp16 beside its
    fp32 stage (the fused attention kernel, under TRITON_INTERPRET=1, else its reference;
    the GEMV layers or the GEMM path): the keys and values rounded as written, the audio
    within their rounding of the fp32 rings' over chunks of 1 and 3 (rings carried across
    steps). Never in the strict fp32 engine."""
    import ttsbuild.runtime.codec_engine as ce

    cfg, dec, kw = _fused_layers_case(54, max_rows=fused_layers)
    plain = CodecEngine(dec, 2, "fp16", ring_half=False, **kw)
    half = CodecEngine(dec, 2, "fp16", ring_half=True, **kw)
    rings = [t for group in half.state for t in group if t.dim() == 4]
    assert rings and {t.dtype for t in rings} == {torch.float16}
    assert {t.dtype for g in plain.state for t in g if t.dim() == 4} == {torch.float32}
    monkeypatch.setattr(ce, "RING_HALF", True)  # TTSBUILD_CODEC_RING_HALF=1
    assert CodecEngine(dec, 2, "fp16", **kw).ring_half  # None: the environment's choice
    assert not CodecEngine(dec, 2, "fp16", ring_half=False, **kw).ring_half  # a plan's pin
    monkeypatch.setattr(ce, "RING_HALF", False)
    strict = CodecEngine(dec, 2, "fp32", ring_half=True, **kw)
    assert not strict.ring_half and {t.dtype for g in strict.state for t in g if t.dim() == 4} == {
        torch.float32}
    codes = rand_codes(cfg, 2, 9, seed=55)
    for chunk in (1, 3):
        want = ce.decode_with(plain, codes, chunk=chunk)
        got = ce.decode_with(half, codes, chunk=chunk)
        assert got.shape == want.shape and not torch.equal(got, want)
        assert ce.snr_db(want, got) > 50
    # the rings hold the keys and values as fp16 rounds them: a step's new entries equal
    # the fp32 engine's rounded (same slots, positions and inputs in both)
    frame = rand_codes(cfg, 2, 1, seed=56)
    for e in (plain, half):
        e.reset([0, 1])
        e.step(torch.tensor([0, 1]), frame)
    first_k = [(a[0][:2, :, 0], b[0][:2, :, 0]) for a, b in zip(
        [g for g in plain.state if g and g[0].dim() == 4],
        [g for g in half.state if g and g[0].dim() == 4], strict=True)]
    assert torch.equal(first_k[0][1], first_k[0][0].half())  # the first layer's keys


def test_steps_of_few_streams_launch_the_codec_kernels_with_pdl(monkeypatch):
    """CODEC_PDL_MAX_ROWS: a step of at most that many streams runs inside
    codec_pdl_scope(True), so the codec kernels' launch arguments ask for PDL (where the GPU
    takes it); larger steps, and everything after the step, do not."""
    import ttsbuild.plugins._dispatch as dispatch
    import ttsbuild.runtime.codec_engine as ce

    pdl_enabled = dispatch.pdl_enabled
    monkeypatch.setattr(dispatch, "pdl_enabled", lambda t: True)  # as on a Hopper GPU
    monkeypatch.delenv("TTSBUILD_CODEC_PDL", raising=False)
    x, on, off = torch.zeros(1), {"PDL": True, "launch_pdl": True}, {"PDL": False}
    assert dispatch.codec_pdl_args(x) == off
    with dispatch.codec_pdl_scope(True):
        assert dispatch.codec_pdl_args(x) == on
        with dispatch.codec_pdl_scope(False):
            assert dispatch.codec_pdl_args(x) == off
        assert dispatch.codec_pdl_args(x) == on
    assert dispatch.codec_pdl_args(x) == off
    monkeypatch.setenv("TTSBUILD_CODEC_PDL", "1")  # every size
    assert dispatch.codec_pdl_args(x) == on
    monkeypatch.delenv("TTSBUILD_CODEC_PDL")
    # the engine's steps: the scope each runs in (the kernels, where the interpreter runs
    # them, launch as this machine does: no PDL off a GPU)
    monkeypatch.setattr(dispatch, "pdl_enabled", pdl_enabled)
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=57))
    engine = CodecEngine(dec, 3, "fp32")
    seen, real = [], ce.CodecEngine._step
    monkeypatch.setattr(ce.CodecEngine, "_step", lambda self, r, c: seen.append(
        dispatch._CODEC_PDL_SCOPE.get()) or real(self, r, c))  # fmt: skip
    assert engine.pdl_max_rows == ce.CODEC_PDL_MAX_ROWS == 2  # the default (None)
    for limit in (0, 2):
        engine.pdl_max_rows = limit  # as CodecEngine(pdl_max_rows=limit) sets it
        for streams in (1, 2, 3):
            ce.decode_with(engine, rand_codes(cfg, streams, 1, seed=58))
    assert seen == [False, False, False, True, True, False]
    assert not dispatch._CODEC_PDL_SCOPE.get()  # the scope ends with each step
    monkeypatch.setattr(ce, "CODEC_PDL_MAX_ROWS", 4)  # TTSBUILD_CODEC_PDL_MAX_ROWS=4
    assert CodecEngine(dec, 3, "fp32").pdl_max_rows == 4
    assert CodecEngine(dec, 3, "fp32", pdl_max_rows=0).pdl_max_rows == 0  # a plan's pin
    with pytest.raises(ValueError, match="pdl_max_rows"):
        CodecEngine(dec, 3, "fp32", pdl_max_rows=-1)


def test_fused_layers_store_their_output_in_the_next_stages_dtype():
    """The fused layers' last linear writes the upsample stage's dtype itself (the kernel
    rounds as the cast it replaces: the same bits, a launch fewer); the GEMM path returns
    fp32 for the cast after it."""
    _, dec, kw = _fused_layers_case(59)
    eng = CodecEngine(dec, 2, "fp16", tf32_layers_max_rows=0, **kw)  # the GEMM path past R
    tr_stage, rows = eng.stages["transformer"], torch.tensor([0, 1])
    x = torch.randn(2, 1, eng.codec.pre_transformer.input_proj.in_features,
                    generator=torch.Generator().manual_seed(60))  # fmt: skip
    outs = []
    for next_dtype in (torch.float16, None):
        eng.reset(rows)  # the same rings for both
        outs.append(eng._transformer(x, rows, eng.pos.index_select(0, rows), tr_stage,
                                     next_dtype))  # fmt: skip
    assert outs[0].dtype == torch.float16 and outs[1].dtype == torch.float32
    assert torch.equal(outs[0], outs[1].to(torch.float16))
    x4 = x.expand(2, 3, -1).contiguous()  # 6 rows: the GEMM path, fp32 whatever comes next
    assert eng._transformer(x4, rows, eng.pos.index_select(0, rows), tr_stage,
                            torch.float16).dtype == torch.float32  # fmt: skip


def test_fused_transformer_steps_ask_for_their_rows_as_gemvs(monkeypatch):
    """The fused pre-transformer runs steps of at most fused_layers_max_rows rows, so it asks
    fused_linear to run that many fp32 rows as GEMVs (16-row fp32 tiles went through tl.dot's
    IEEE path: 2.6 ms a step from 2 rows on the H200; as GEMVs 0.82-1.03 ms at 2-8 rows)."""
    import ttsbuild.runtime.codec_engine as ce

    cfg = small_config(num_key_value_heads=4)
    dec = our_decoder(cfg, test_state(cfg, seed=44))
    engine = CodecEngine(dec, 3, "fp32", conv_impl="triton", fused=True, fused_attention=True,
                         fused_layers_max_rows=6)  # fmt: skip
    asked, real = [], ce.fused_linear
    monkeypatch.setattr(ce, "fused_linear", lambda *a, **kw: asked.append(
        (a[0].shape[0], kw.get("gemv_rows_f32"))) or real(*a, **kw))  # fmt: skip
    codes = rand_codes(cfg, 3, 4, seed=45)
    got = ce.decode_with(engine, codes, chunk=2)  # 3 rows x 2 frames = 6: the fused path
    layers = len(dec.pre_transformer.layers)
    assert len(asked) == 2 * (2 + 4 * layers)  # two steps: projections + 4 per layer
    assert {rows for rows, _ in asked} == {6} and {g for _, g in asked} == {6}
    # steps of several frames per row on the fused path decode the same audio
    assert rel_err(got, ce.decode_with(dec, codes)) <= REL_TOL


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the launch plan imports it)")
def test_fused_linear_launch_takes_the_callers_gemv_rows():
    from ttsbuild.plugins._tl.fused_linear import _launch

    x = torch.randn(4, 512)
    w = torch.randn(3072, 512)
    out = torch.empty(4, 3072)
    as_gemv = _launch(x, w, 4, 3072, 512, False, None, out, gemv_rows_f32=8)[0]
    tiled = _launch(x, w, 4, 3072, 512, False, None, out, gemv_rows_f32=0)[0]
    assert as_gemv["BLOCK_M"] == 1 and tiled["BLOCK_M"] == 16
    half = _launch(x.half(), w.half(), 4, 3072, 512, False, None, out, gemv_rows_f32=8)[0]
    assert half["BLOCK_M"] == 16  # fp32 activations only


def test_the_fused_output_stage_decodes_the_same_audio():
    """CodecEngine(fused_output=True): the output stage (SnakeBeta, context, the fp32 conv to
    one channel, clamp) as one kernel (plugins.codec_output; the kernel under
    TRITON_INTERPRET=1, else its reference). The same audio, chunk by chunk (its tail carried
    across steps), as the stage's eager ops; the cuDNN engine ignores the flag."""
    import ttsbuild.runtime.codec_engine as ce

    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=36))
    codes = rand_codes(cfg, 2, 6, seed=37)
    kw = dict(conv_impl="triton", fused=True, channels_last=True)
    plain = CodecEngine(dec, 2, "fp16", **kw)
    fused = CodecEngine(dec, 2, "fp16", **kw, fused_output=True)
    assert fused.fused_output and not plain.fused_output
    want, got = ce.decode_with(plain, codes), ce.decode_with(fused, codes)
    assert got.shape == want.shape and got.dtype == torch.float32
    rel = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert rel <= 1e-5, rel
    assert not CodecEngine(dec, 2, "fp16", fused_output=True).fused_output


@pytest.mark.parametrize("fused", [False, True])
def test_channels_last_conv_operands_decode_the_same_audio(fused, monkeypatch):
    """CodecEngine(channels_last=True): the implicit-GEMM convs' inputs and outputs as
    channels-last views (the Triton kernels under TRITON_INTERPRET=1, else their references;
    min rows 1: every half-precision conv takes that path). Only the memory layout changes:
    the same audio as the default layout, chunk by chunk, and the same SNR against fp32."""
    import ttsbuild.runtime.codec_engine as ce

    monkeypatch.setattr(ce, "IMPLICIT_MIN_ROWS", 1)
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=34))
    codes = rand_codes(cfg, 2, 6, seed=35)
    plain = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=fused)
    last = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=fused, channels_last=True)
    assert last.channels_last and not plain.channels_last
    want, got = ce.decode_with(plain, codes), ce.decode_with(last, codes)
    assert got.shape == want.shape
    rel = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert rel <= 2e-3, rel
    assert abs(codec_snr_db(plain, dec, codes) - codec_snr_db(last, dec, codes)) < 0.2
    # its tails and spills stored along channels too: the same audio again
    both = CodecEngine(dec, 2, "fp16", conv_impl="triton", fused=fused, channels_last=True,
                       state_channels_last=True)  # fmt: skip
    tails = [t for group in both.state for t in group if t.dim() == 3]
    assert tails and all(t.stride(1) == 1 for t in tails if t.dtype != torch.float32)
    got = ce.decode_with(both, codes)
    rel = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert rel <= 2e-3, rel
    # only the implicit-GEMM path takes it: the cuDNN engine ignores the flag
    assert not CodecEngine(dec, 2, "fp16", channels_last=True).channels_last


def _small_triton(seed, channels_last):
    """The small decoder (weights from `seed`), 6 frames of codes for 2 rows (seed + 1), and
    the engine settings of the implicit-GEMM path with its fusions."""
    cfg = small_config()
    dec = our_decoder(cfg, test_state(cfg, seed=seed))
    kw = dict(conv_impl="triton", fused=True, channels_last=channels_last)
    return dec, rand_codes(cfg, 2, 6, seed=seed + 1), kw


def _spy(monkeypatch, module, name, record):
    """module.<name> replaced by a wrapper that appends record(*args, **kw) to the returned
    list, then calls the original."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kw):
        calls.append(record(*args, **kw))
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize(("channels_last", "implicit_min_rows"), [(False, 1), (True, 1),
                                                                  (True, 20)])
def test_block_act_in_the_conv_before_decodes_the_same_audio(channels_last, implicit_min_rows,
                                                             monkeypatch):
    """CodecEngine(fold_block_act=True): each decoder block's first SnakeBeta applied in the
    epilogue of the conv before it (the decoder's input conv, the previous block's last 1x1
    conv; the Triton kernel under TRITON_INTERPRET=1, else its reference) instead of a
    snake_context launch of its own: the same audio, bit for bit, chunk by chunk, and one
    SnakeBeta launch fewer a block and step where the kernel runs those convs. With a row
    limit above some of the convs' rows those take the launch as before (same audio)."""
    import ttsbuild.runtime.codec_engine as ce

    monkeypatch.setattr(ce, "IMPLICIT_MIN_ROWS", implicit_min_rows)
    calls = _spy(monkeypatch, ce, "snake_context", lambda *args, **kw: args[3] is None)
    dec, codes, kw = _small_triton(40, channels_last)
    plain = CodecEngine(dec, 2, "fp16", **kw, fold_block_act=False)
    want = ce.decode_with(plain, codes)
    before = len(calls)
    calls.clear()
    folded = CodecEngine(dec, 2, "fp16", **kw, fold_block_act=True)
    assert folded.fold_block_act
    got = ce.decode_with(folded, codes)
    assert got.shape == want.shape and torch.equal(got, want)
    blocks = sum(isinstance(m, ce.DecoderBlock) for m in dec.modules())
    steps = -(-codes.shape[-1] // 4)
    assert blocks and before - len(calls) <= blocks * steps
    if implicit_min_rows == 1:  # the kernel runs every conv: every block's launch goes
        assert before - len(calls) == blocks * steps
    # only the implicit-GEMM convs take it
    assert not CodecEngine(dec, 2, "fp16", fold_block_act=True).fold_block_act


@pytest.mark.parametrize(("state_channels_last", "fold"), [(False, False), (True, False),
                                                           (True, True)])
def test_transposed_convs_as_causal_convs_decode_the_same_audio(state_channels_last, fold,
                                                                monkeypatch):
    """CodecEngine(tconv_conv=True): the half-precision stages' transposed convs as causal
    convs over their input (plugins.causal_conv.pack_tconv_as_conv; the Triton kernel under
    TRITON_INTERPRET=1, else its reference), the slot's last input frames as their context
    in place of the output spill, the block's SnakeBeta with that context: the fp16 audio
    of the GEMM + overlap-add path to its rounding, streamed in chunks of 1 and 4 (the tails
    carried over steps), no GEMM and no overlap-add left, and the states it keeps."""
    import ttsbuild.runtime.codec_engine as ce

    dec, codes, kw = _small_triton(42, True)
    kw.update(state_channels_last=state_channels_last, fold_block_act=fold)
    plain = CodecEngine(dec, 2, "fp16", **kw, tconv_conv=False)
    eng = CodecEngine(dec, 2, "fp16", **kw, tconv_conv=True)
    tconvs = [m for m in eng.codec.modules() if isinstance(m, ce.CausalConvTranspose1d)]
    assert eng.tconv_conv and set(eng._tconv_k) == set(tconvs) and not eng._tconv_w
    for m in tconvs:  # the input's last taps - 1 frames, not the output's spill
        taps = m.conv.kernel_size[0] // m.stride
        shapes = [tuple(t.shape[1:]) for t in eng.state[m.slot]]
        assert shapes == ([(m.conv.in_channels, taps - 1)] if taps > 1 else []), shapes
    assert any(m.overlap for m in tconvs) and any(not m.overlap for m in tconvs)
    overlap = _spy(monkeypatch, ce, "overlap_add", lambda *a, **k: None)
    for chunk in (1, 4):
        n = len(overlap)
        want = ce.decode_with(plain, codes, chunk=chunk)
        assert len(overlap) > n  # the GEMM path's, seen
        n = len(overlap)
        got = ce.decode_with(eng, codes, chunk=chunk)
        assert len(overlap) == n  # none from the conv path
        assert got.shape == want.shape and ce.snr_db(want.float(), got.float()) > 45
    ref = ce.decode_with(dec, codes)  # the fp32 decode: both as close to it
    assert abs(ce.snr_db(ref, got.float()) - ce.snr_db(ref, want.float())) < 1.0
    # the strict fp32 engine, cuDNN convs and [B, C, T] operands keep the GEMM / cuDNN path
    assert not CodecEngine(dec, 2, "fp32", **kw, tconv_conv=True)._tconv_k
    assert not CodecEngine(dec, 2, "fp16", tconv_conv=True).tconv_conv
    assert not CodecEngine(dec, 2, "fp16", **{**kw, "channels_last": False},
                           tconv_conv=True).tconv_conv  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_fused_codebook_lookup_decodes_the_same_audio(precision, monkeypatch):
    """CodecEngine(lookup_fused=True): the codebook lookup, sum and cast as one launch
    (plugins.codebook_sum; the kernel under TRITON_INTERPRET=1, else its reference): the
    audio of the eager lookup to fp32's summation order, over chunks of 1 and 4."""
    import ttsbuild.runtime.codec_engine as ce

    calls = _spy(monkeypatch, ce, "codebook_sum", lambda codes, *a, **k: tuple(codes.shape))
    dec, codes, kw = _small_triton(44, True)
    plain = CodecEngine(dec, 2, precision, **kw, lookup_fused=False)
    fused = CodecEngine(dec, 2, precision, **kw, lookup_fused=True)
    for chunk in (1, 4):
        want = ce.decode_with(plain, codes, chunk=chunk)
        assert not calls
        got = ce.decode_with(fused, codes, chunk=chunk)
        assert calls and calls[0][:2] == (2, codes.shape[1])
        calls.clear()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("channels_last", [False, True])
def test_snake_in_the_conv_epilogue_decodes_the_same_audio(channels_last, monkeypatch):
    """CodecEngine(snake_epilogue=True): each residual unit's second SnakeBeta applied in its
    k = 7 conv's epilogue (causal_conv out_alpha; the Triton kernel under TRITON_INTERPRET=1,
    else its reference) instead of in the 1x1 conv's input load. Both round the conv's output
    first and compute the same fp32 SnakeBeta of it: the same audio, bit for bit, chunk by
    chunk. Every residual unit takes the epilogue (min rows 1, no row limit), and the 1x1
    convs no SnakeBeta of their own; with a limit of one row none does."""
    import ttsbuild.runtime.codec_engine as ce

    monkeypatch.setattr(ce, "IMPLICIT_MIN_ROWS", 1)
    monkeypatch.setattr(ce, "SNAKE_EPILOGUE_MAX_ROWS", 1 << 30)
    calls = _spy(monkeypatch, ce, "causal_conv", lambda *args, **kw: (
        kw.get("out_alpha") is not None,
        kw.get("alpha") is not None or len(args) > 5 and args[5] is not None))
    dec, codes, kw = _small_triton(38, channels_last)
    plain = CodecEngine(dec, 2, "fp16", **kw, snake_epilogue=False)
    want = ce.decode_with(plain, codes)
    assert calls and not any(out for out, _ in calls) and any(load for _, load in calls)
    calls.clear()
    epilogue = CodecEngine(dec, 2, "fp16", **kw, snake_epilogue=True)
    got = ce.decode_with(epilogue, codes)
    units = sum(isinstance(m, ce.ResidualUnit) for m in dec.modules())
    assert units and sum(out for out, _ in calls) == units * -(-codes.shape[-1] // 4)
    assert not any(load for _, load in calls)
    assert got.shape == want.shape and torch.equal(got, want)
    # units of SNAKE_EPILOGUE_MAX_ROWS rows or more keep the SnakeBeta in the 1x1 conv's load
    monkeypatch.setattr(ce, "SNAKE_EPILOGUE_MAX_ROWS", 1)
    calls.clear()
    assert torch.equal(ce.decode_with(epilogue, codes), want)
    assert not any(out for out, _ in calls) and any(load for _, load in calls)
    # only the implicit-GEMM convs take it
    assert not CodecEngine(dec, 2, "fp16", snake_epilogue=True).snake_epilogue


@pytest.mark.parametrize(("precision", "kernel"), [("fp16", True), ("bf16", True),
                                                   ("fp16", False)])
def test_output_stage_in_the_last_conv_epilogue_decodes_the_same_audio(precision, kernel,
                                                                       monkeypatch):
    """CodecEngine(output_epilogue=True): the output stage's SnakeBeta and taps in the last
    residual unit's 1x1 conv (causal_conv.conv_output_taps; the kernel under
    TRITON_INTERPRET=1, else its reference), then output_from_taps with the slot's last taps:
    the fused output stage's audio (the same fp32 sums in another order), streamed in chunks
    of 1 and 4 from two slots, no codec_output call, the slot keeping [context, 16] taps;
    kernel False: that conv off the implicit-GEMM kernel, its taps from its output. The
    engines it does not fit keep the output kernel."""
    import ttsbuild.runtime.codec_engine as ce

    if not kernel:
        monkeypatch.setattr(ce, "IMPLICIT_MIN_ROWS", 1 << 30)

    taps = _spy(monkeypatch, ce, "conv_output_taps", lambda x, *a, **k: tuple(x.shape))
    outputs = _spy(monkeypatch, ce, "codec_output", lambda *a, **k: None)
    dec, codes, kw = _small_triton(46, True)
    kw.update(fused_output=True, conv_split_max_streams=8 if kernel else 0)
    plain = CodecEngine(dec, 2, precision, **kw, output_epilogue=False)
    eng = CodecEngine(dec, 2, precision, **kw, output_epilogue=True)
    out = eng.codec.decoder[-1]
    assert eng.output_epilogue and not plain.output_epilogue
    assert [tuple(t.shape) for t in eng.state[out.slot]] == [(3, out.context, 16)]
    for chunk in (1, 4):
        want = ce.decode_with(plain, codes, chunk=chunk)
        assert outputs and not taps
        outputs.clear()
        got = ce.decode_with(eng, codes, chunk=chunk)
        assert not outputs
        assert len(taps) == (-(-codes.shape[-1] // chunk) if kernel else 0)  # one a step
        taps.clear()
        assert got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # the strict fp32 engine, cuDNN convs and no fused output stage keep the output kernel
    assert not CodecEngine(dec, 2, "fp32", **kw, output_epilogue=True).output_epilogue
    assert not CodecEngine(dec, 2, "fp16", output_epilogue=True).output_epilogue
    assert not CodecEngine(dec, 2, "fp16", **{**kw, "fused_output": False},
                           output_epilogue=True).output_epilogue  # fmt: skip


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_next_act_fold_decodes_the_same_audio(precision, monkeypatch):
    """CodecEngine(next_act_fold=True): each residual unit's act1 written by the unit before
    (its 1x1 conv's next_act, then context_fill; the kernels under TRITON_INTERPRET=1, else
    their references; the first unit's from the block's overlap-add) against snake_context:
    the same audio (the same SnakeBeta of the same rounded values, the same tails carried),
    chunks of 1 and 4 from two slots, each unit's snake_context launch gone; off without the
    SnakeBeta in conv1's epilogue or channels-last operands."""
    import ttsbuild.runtime.codec_engine as ce

    fills = _spy(monkeypatch, ce, "context_fill", lambda xin, *a, **k: tuple(xin.shape))
    contexts = _spy(monkeypatch, ce, "snake_context", lambda *a, **k: None)
    dec, codes, kw = _small_triton(47, True)
    plain = CodecEngine(dec, 2, precision, **kw, next_act_fold=False)
    eng = CodecEngine(dec, 2, precision, **kw, next_act_fold=True)
    assert eng.next_act_fold and not plain.next_act_fold
    blocks = sum(isinstance(m, ce.DecoderBlock) for m in eng.codec.decoder)
    for chunk in (1, 4):
        want = ce.decode_with(plain, codes, chunk=chunk)
        steps = -(-codes.shape[-1] // chunk)
        assert not fills
        before = len(contexts)
        contexts.clear()
        got = ce.decode_with(eng, codes, chunk=chunk)
        assert len(fills) == 3 * blocks * steps  # every unit: 2, 3 from the unit before,
        # 1 from the overlap-add
        assert before - len(contexts) == len(fills)
        fills.clear()
        contexts.clear()
        assert got.shape == want.shape
        assert torch.equal(got, want)
    assert not CodecEngine(dec, 2, precision, **kw, next_act_fold=True,
                           snake_epilogue=False).next_act_fold
    assert not CodecEngine(dec, 2, precision, **{**kw, "channels_last": False},
                           next_act_fold=True).next_act_fold  # fmt: skip


def test_a_bad_tf32_rows_switch_is_refused_with_a_clear_error():
    """TTSBUILD_CODEC_TR_TF32_MAX_ROWS takes "all" or a number of frames; anything else stops
    the import with the variable named, not a bare int() error."""
    import os
    import subprocess
    import sys

    code = "import ttsbuild.runtime.codec_engine as c; print(c.TR_TF32_MAX_ROWS)"
    for value, want in (("abc", None), ("-3", None), ("64", "64")):
        env = dict(os.environ, TTSBUILD_CODEC_TR_TF32_MAX_ROWS=value)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        if want is None:
            assert run.returncode != 0
            assert "TTSBUILD_CODEC_TR_TF32_MAX_ROWS must be 'all'" in run.stderr, run.stderr
        else:
            assert run.returncode == 0 and run.stdout.strip() == want, run.stderr
