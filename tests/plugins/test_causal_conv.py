"""The codec's implicit-GEMM causal conv: the reference is F.conv1d on the unpacked weight
(checked against a float64 conv), the kernel (CUDA, or CPU under TRITON_INTERPRET=1) equals
the reference on fresh random inputs, with and without bias and residual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.causal_conv import (
    causal_conv,
    causal_conv_reference,
    pack_conv_weight,
    pack_tconv_as_conv,
    residual_unit,
)
from ttsbuild.plugins.codec_context import to_channels_last


def _inputs(B, cin, cout, k, d, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    xin = torch.randn(B, cin, n + (k - 1) * d, generator=g)
    weight = torch.randn(cout, cin, k, generator=g) / (cin * k) ** 0.5
    bias = torch.randn(cout, generator=g)
    residual = torch.randn(B, cout, n, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (xin, weight, bias, residual)]


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_pack_and_reference_match_a_float64_conv():
    xin, weight, bias, residual = _inputs(2, 12, 10, 7, 3, 9, torch.float32, "cpu", 0)
    want = F.conv1d(xin.double(), weight.double(), bias.double(), dilation=3) + residual.double()
    w = pack_conv_weight(weight)
    assert w.shape == (7, 12, 10) and w.is_contiguous()
    got = causal_conv_reference(xin, w, bias, 3, residual)
    assert got.shape == (2, 10, 9) and rel_err(got, want) < 1e-6


def test_fp32_input_takes_the_reference_and_refuses_the_kernel():
    xin, weight, bias, _ = _inputs(1, 8, 8, 3, 1, 4, torch.float32, "cpu", 1)
    w = pack_conv_weight(weight)
    assert torch.equal(causal_conv(xin, w, bias, 1), causal_conv_reference(xin, w, bias, 1))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        causal_conv(xin, w, bias, 1, use_triton=True)


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n"), [
    (96, 96, 7, 9, 37),     # block 4 shapes: Cin not a multiple of 64, long dilation
    (192, 192, 1, 1, 70),   # the residual units' 1x1 conv
    (64, 128, 7, 3, 5),     # fewer times than a tile
    (96, 1, 7, 1, 20),      # one output channel (tile masked down)
    (48, 40, 3, 2, 16),
    (64, 96, 3, 2, 700),    # >= 2048 output rows: the 128 x 128 tile, tiles across rows
    (96, 160, 1, 1, 700),   # >= 2048 rows of a 1x1 conv: its 64 x 128 tile, 32-channel steps
])
# bf16 only on CUDA: the interpreter's tl.dot mishandles bf16 operands (numpy has no bf16).
@pytest.mark.parametrize("dtype", [torch.float16] + [torch.bfloat16] * (KDEV == "cuda"))
@pytest.mark.parametrize("fused", [True, False])
def test_kernel_equals_reference(cin, cout, k, d, n, dtype, fused):
    seed = cin + cout + k + d + n
    xin, weight, bias, residual = _inputs(3, cin, cout, k, d, n, dtype, KDEV, seed)
    w = pack_conv_weight(weight)
    bias, residual = (bias, residual) if fused else (None, None)
    want = causal_conv(xin, w, bias, d, residual, use_triton=False)
    got = causal_conv(xin, w, bias, d, residual, use_triton=True)
    assert got.shape == want.shape == (3, cout, n) and got.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert rel_err(got, want) <= tol


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n"), [
    (96, 96, 7, 9, 37),     # block 4's dilated conv
    (192, 192, 1, 1, 70),   # a residual unit's 1x1 conv
    (64, 96, 3, 2, 700),    # >= 2048 output rows: the 128 x 128 tile
])
@pytest.mark.parametrize("layouts", ["in", "in+out", "out+res"])
def test_channels_last_operands_give_the_same_conv(cin, cout, k, d, n, layouts):
    """An input (and a residual) as [B, C, L] views of contiguous [B, L, C] tensors, as
    snake_context(channels_last=True) makes them, and a channels-last output
    (channels_last=True: strides (n * Cout, 1, Cout)): the same values as the default layout,
    kernel and reference alike."""
    xin, weight, bias, residual = _inputs(3, cin, cout, k, d, n, torch.float16, KDEV,
                                          cin + k * d + n)  # fmt: skip
    w = pack_conv_weight(weight)
    want = causal_conv(xin, w, bias, d, residual, use_triton=False)
    if "in" in layouts.split("+"):
        xin = to_channels_last(xin)
    if "res" in layouts:
        residual = to_channels_last(residual)
    out_last = "out" in layouts
    for use_triton in (False, True):
        got = causal_conv(xin, w, bias, d, residual, channels_last=out_last,
                          use_triton=use_triton)  # fmt: skip
        assert got.shape == want.shape == (3, cout, n)
        if out_last:
            assert got.stride() == (n * cout, 1, cout)
        assert rel_err(got, want) <= 2e-3


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "n"), [(96, 96, 700), (192, 192, 40), (40, 24, 5)])
def test_kernel_with_snake_equals_snake_then_conv(cin, cout, n):
    """SnakeBeta applied in the kernel's input load = snake_context (no tail) then the conv."""
    from ttsbuild.plugins.codec_context import snake_context_reference

    xin, weight, bias, residual = _inputs(3, cin, cout, 1, 1, n, torch.float16, KDEV, cin + n)
    g = torch.Generator().manual_seed(n)
    alpha = (0.3 * torch.randn(cin, 1, generator=g)).exp().to(KDEV)
    inv_beta = (1.0 / ((0.3 * torch.randn(cin, 1, generator=g)).exp() + 1e-9)).to(KDEV)
    w = pack_conv_weight(weight)
    snaked = snake_context_reference(xin, alpha, inv_beta, None, None)
    want = causal_conv(snaked, w, bias, 1, residual, use_triton=False)
    assert torch.equal(causal_conv(xin, w, bias, 1, residual, alpha, inv_beta, use_triton=False),
                       want)
    got = causal_conv(xin, w, bias, 1, residual, alpha, inv_beta, use_triton=True)
    assert rel_err(got, want) <= 2e-3


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n", "snake"), [
    (96, 96, 7, 9, 37, "in"),     # block 4's dilated conv: 64-wide steps across taps
    (96, 96, 7, 1, 700, "out"),   # >= 2048 rows (the 128 x 128 tile), epilogue SnakeBeta
    (160, 48, 3, 2, 20, ""),      # 5 runs of 32 a tap: the last step half masked
    (96, 96, 2, 5, 30, "in"),     # two taps, SnakeBeta in the load
])
def test_flattened_k_steps_equal_the_reference(cin, cout, k, d, n, snake):
    """The flattened (tap, channel) K steps (FLAT_K) on channels-last inputs of 32 * odd
    channels: the reference's values, with a SnakeBeta in the load or the epilogue too; and
    the kernel takes them only where the input allows (channels-last, runs of 32)."""
    from ttsbuild.plugins.causal_conv import _causal_conv_triton, _flat_k

    xin, weight, bias, residual = _inputs(3, cin, cout, k, d, n, torch.float16, KDEV,
                                          cin + 7 * k + d + n)  # fmt: skip
    w = pack_conv_weight(weight)
    sn = {}
    if snake == "in":
        sn["alpha"], sn["inv_beta"] = _snake_params(cin, n, KDEV)
    elif snake == "out":
        sn["out_alpha"], sn["out_inv_beta"] = _snake_params(cout, n, KDEV)
    want = causal_conv(xin, w, bias, d, residual, use_triton=False, **sn)
    last = to_channels_last(xin)
    assert _flat_k(last, cin, k, True) and not _flat_k(xin, cin, k, True)
    assert not _flat_k(last, cin, k, False) and not _flat_k(last, cin, 1, True)
    got = _causal_conv_triton(last, w, bias, d, residual, channels_last=True, flat_k=True,
                              **sn)  # fmt: skip
    assert got.shape == want.shape == (3, cout, n)
    assert rel_err(got, want) <= 2e-3
    # the same values as the per-tap steps it replaces
    per_tap = _causal_conv_triton(last, w, bias, d, residual, channels_last=True,
                                  flat_k=False, **sn)  # fmt: skip
    assert rel_err(got, per_tap) <= 2e-3


@pytest.mark.parametrize(("taps", "stride"), [(1, 2), (2, 3), (2, 8)])
def test_transposed_conv_packed_as_a_causal_conv(taps, stride):
    """pack_tconv_as_conv: a causal conv of k = taps over the input (its left context the
    previous frames) with stride x Cout channels, its [B, n, stride, Cout] output read as
    [B, n * stride, Cout], equals the transposed conv with the last (taps - 1) x stride
    samples cut (the codec's causal transposed conv), in float64, streamed in two steps."""
    g = torch.Generator().manual_seed(40 + taps * stride)
    cin, cout, n = 12, 5, 9
    weight = torch.randn(cin, cout, taps * stride, generator=g, dtype=torch.float64)
    bias = torch.randn(cout, generator=g, dtype=torch.float64)
    x = torch.randn(2, cin, n, generator=g, dtype=torch.float64)
    want = F.conv_transpose1d(x, weight, bias, stride=stride)[..., : n * stride]
    w, b = pack_tconv_as_conv(weight, bias, stride)
    assert w.shape == (taps, cin, stride * cout) and b.shape == (stride * cout,)
    ctx = torch.zeros(2, cin, taps - 1, dtype=torch.float64)  # a new stream's tail
    got = []
    for part in (x[..., :4], x[..., 4:]):  # two steps, the tail carried between them
        xin = torch.cat([ctx, part], dim=-1)
        y = F.conv1d(xin, w.permute(2, 1, 0), b)  # [B, s * Cout, frames]
        got.append(y.transpose(1, 2).reshape(2, -1, cout).transpose(1, 2))
        ctx = xin[..., xin.shape[-1] - (taps - 1):]
    got = torch.cat(got, dim=-1)
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12
    with pytest.raises(ValueError, match="kernel % stride"):
        pack_tconv_as_conv(weight[..., :-1], bias, stride)


def test_split_k_plan(monkeypatch):
    """Programs a tile: 1 with the switch off; on, the most (a power of two, <= 16) that keep
    the grid in one wave with >= 2 K steps a program; an explicit count is taken as given
    (at most one a K step)."""
    import ttsbuild.plugins.causal_conv as cc

    monkeypatch.setattr(cc, "SPLIT_K", False)
    assert cc._split_k(12, 84, 132, None) == 1
    assert cc._split_k(12, 84, 132, 3) == 3 and cc._split_k(12, 2, 132, 8) == 2
    monkeypatch.setattr(cc, "SPLIT_K", True)
    assert cc._split_k(12, 84, 132, None) == 8      # 96 programs; 16 would be 192
    assert cc._split_k(3, 84, 132, None) == 16      # capped at SPLIT_MAX
    assert cc._split_k(12, 12, 132, None) == 4      # 3 K steps a program; 8 would leave 1-2
    assert cc._split_k(12, 6, 132, None) == 2
    assert cc._split_k(100, 84, 132, None) == 1     # a full wave already
    assert cc._split_k(12, 84, 132, 1) == 1


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n", "extra"), [
    (96, 96, 7, 3, 200, "res+out"),  # 64-channel steps over 96 (the next tap's weight rows),
                                     # a 128-wide output block over 96, a short last row tile
    (64, 192, 7, 9, 130, "out"),     # three 64-wide output blocks, long dilation
    (64, 48, 3, 1, 40, "none"),      # no bias: one row tile shorter than a stream's samples
])
def test_tma_kernel_equals_the_reference(cin, cout, k, d, n, extra, monkeypatch):
    """The TMA kernel (CONV_TMA: tensor-descriptor loads of one stream's rows a tile, zero
    fill past its samples and channels) against the reference: bias, residual and the
    epilogue SnakeBeta; it runs only on a channels-last input, and the served path takes it
    from CONV_TMA_MIN_N samples a stream with the switch on, for channels in multiples of
    64."""
    import ttsbuild.plugins.causal_conv as cc

    xin, weight, bias, residual = _inputs(2, cin, cout, k, d, n, torch.float16, KDEV,
                                          cin + cout + n)
    alpha, inv_beta = _snake_params(cout, n, KDEV)
    w = pack_conv_weight(weight)
    bias = None if extra == "none" else bias
    residual = to_channels_last(residual) if "res" in extra else None
    oa, oib = (alpha, inv_beta) if "out" in extra else (None, None)
    want = causal_conv(xin, w, bias, d, residual, out_alpha=oa, out_inv_beta=oib,
                       use_triton=False)
    xcl = to_channels_last(xin)
    assert cc._tma_fits(xcl, w, n, None, 1, None, True)
    assert not cc._tma_fits(xin, w, n, None, 1, None, True)  # not channels-last
    calls = []
    real = cc._causal_conv_tma
    monkeypatch.setattr(cc, "_causal_conv_tma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = causal_conv(xcl, w, bias, d, residual, out_alpha=oa, out_inv_beta=oib,
                      channels_last=True, split=False, tma=True, use_triton=True)
    assert calls and got.shape == want.shape == (2, cout, n) and got.stride(1) == 1
    assert rel_err(got, want) <= 2e-3
    monkeypatch.setattr(cc, "CONV_TMA", True)
    monkeypatch.setattr(cc, "CONV_TMA_MIN_N", n + 1)
    calls.clear()
    plain = causal_conv(xcl, w, bias, d, residual, out_alpha=oa, out_inv_beta=oib,
                        channels_last=True, split=False, use_triton=True)
    assert not calls and rel_err(plain, want) <= 2e-3  # below the bound: the pointer kernel
    monkeypatch.setattr(cc, "CONV_TMA_MIN_N", n)
    causal_conv(xcl, w, bias, d, residual, channels_last=True, split=False, use_triton=True)
    assert bool(calls) == (cin % 64 == 0 and cout % 64 == 0)  # 64-channel multiples only


@pytest.mark.parametrize(("cin", "cout", "n", "split"), [
    (64, 192, 700, False),   # >= 2048 rows: PLAIN_1X1_TILES's tile, three output blocks
    (96, 96, 30, False),     # 32-wide K steps, one short tile a stream
    (128, 64, 9, True),      # split-K: only the last program's epilogue stores either
])
def test_next_act_writes_the_next_convs_input(cin, cout, n, split):
    """causal_conv(next_act=(alpha, inv_beta, dst)): a residual unit's 1x1 conv (residual,
    no SnakeBeta in its load) also writes SnakeBeta of its stored output into dst, a view
    after ctx columns of the next conv's channels-last input buffer, as snake_context would:
    the reference path and the kernel (where one runs) alike; the columns before dst and the
    output itself untouched by it; bad destinations and parameters refused."""
    from ttsbuild.plugins.codec_context import snake_context_reference

    dev = KDEV or "cpu"
    xin, weight, bias, residual = _inputs(3, cin, cout, 1, 1, n, torch.float16, dev,
                                          cin + cout + n)
    alpha, inv_beta = _snake_params(cout, n + 1, dev)
    xin, residual, w = to_channels_last(xin), to_channels_last(residual), pack_conv_weight(weight)
    ctx = 18
    for use_triton in (False, True) if KDEV else (False,):
        buf = torch.full((3, ctx + n, cout), 7.0, dtype=xin.dtype, device=dev)
        dst = buf.transpose(1, 2)[..., ctx:]
        y = causal_conv(xin, w, bias, 1, residual, channels_last=True, split=split,
                        next_act=(alpha, inv_beta, dst), use_triton=use_triton)
        plain = causal_conv(xin, w, bias, 1, residual, channels_last=True, split=split,
                            use_triton=use_triton)
        assert torch.equal(y, plain)  # the output as without it
        want = snake_context_reference(y, alpha, inv_beta, None, None)
        assert rel_err(want, y) > 1e-2  # the SnakeBeta changes the values checked
        assert rel_err(dst, want) <= 1e-3, use_triton
        assert bool((buf[:, :ctx] == 7.0).all())  # the context columns left to context_fill
    with pytest.raises(ValueError, match="destination"):
        causal_conv(xin, w, bias, 1, residual, next_act=(alpha, inv_beta, dst[:, :-1]))
    with pytest.raises(ValueError, match="alpha"):
        causal_conv(xin, w, bias, 1, residual, next_act=(alpha[:-1], inv_beta, dst))


def test_1x1_tile_rules(monkeypatch):
    """A 1x1 conv of >= 2048 rows: with SnakeBeta in its load, 64-row tiles of 32-channel K
    steps; without (PLAIN_1X1_TILES), 128-row tiles of two warpgroups where they fill the
    SMs, their output block no wider than leaves a masked half, else 64 x 64 tiles; 96
    channels (K steps of 32) and the switch off keep the first rule."""
    import ttsbuild.plugins.causal_conv as cc

    assert cc._config(2048, 768, 768, 1, in_snake=False) == (64, 64, 64, 4)    # 96 tiles
    assert cc._config(10240, 384, 384, 1, in_snake=False) == (128, 64, 128, 8)
    assert cc._config(40960, 192, 192, 1, in_snake=False) == (128, 64, 64, 8)
    assert cc._config(40960, 192, 192, 1, in_snake=True) == (64, 32, 128, 4)
    assert cc._config(122880, 96, 96, 1, in_snake=False) == (64, 32, 128, 4)
    assert cc._config(8192, 768, 768, 1, in_snake=False, sms=400) == (64, 64, 64, 4)
    assert cc._config(40960, 192, 192, 7, in_snake=False) == (128, 64, 128, 8)
    monkeypatch.setattr(cc, "PLAIN_1X1_TILES", False)
    assert cc._config(10240, 384, 384, 1, in_snake=False) == (64, 32, 128, 4)


@needs_kernel
@pytest.mark.parametrize("sms", [8, 132])
@pytest.mark.parametrize(("cin", "cout"), [(128, 192), (64, 128)])
def test_plain_1x1_tiles_equal_the_reference(cin, cout, sms, monkeypatch):
    """A 1x1 conv with a residual and no SnakeBeta at >= 2048 rows, on both of
    PLAIN_1X1_TILES's tiles (the SM count the kernel reads set to 8 or 132), channels-last
    as served, against the reference."""
    import ttsbuild.plugins._tl.fp8_linear as fl
    import ttsbuild.plugins.causal_conv as cc

    monkeypatch.setattr(fl, "_num_sms", lambda device: sms)
    xin, weight, bias, residual = _inputs(3, cin, cout, 1, 1, 700, torch.float16, KDEV,
                                          cin + cout + sms)
    xin, residual = to_channels_last(xin), to_channels_last(residual)
    w = pack_conv_weight(weight)
    tile = cc._config(2100, cin, cout, 1, in_snake=False, sms=sms)
    assert tile[0] == (128 if sms == 8 else 64)
    want = causal_conv(xin, w, bias, 1, residual, use_triton=False)
    got = causal_conv(xin, w, bias, 1, residual, channels_last=True, use_triton=True)
    assert got.shape == want.shape == (3, cout, 700) and got.stride(1) == 1
    assert rel_err(got, want) <= 2e-3


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n", "split", "extra"), [
    (64, 48, 7, 3, 4, 4, "res"),       # a short conv: one 16-row tile, 7 K steps in 4 splits
    (96, 96, 7, 9, 5, 3, "out"),       # flattened K steps (11) in 3 splits, epilogue snake
    (128, 64, 1, 1, 9, 2, "in+res"),   # a 1x1 conv, SnakeBeta in the load, residual
])
def test_split_k_equals_the_reference(cin, cout, k, d, n, split, extra):
    """Split-K (SPLIT_K): each tile's K steps over `split` programs, the last to arrive
    summing the partials before the epilogue: the reference's values (bias, residual,
    SnakeBeta in the load or the epilogue), the one-program tiles' values, and every tile
    counter back at 0 for the next launch."""
    from ttsbuild.plugins._tl.fp8_linear import _counters
    from ttsbuild.plugins.causal_conv import _causal_conv_triton

    xin, weight, bias, residual = _inputs(2, cin, cout, k, d, n, torch.float16, KDEV,
                                          cin + cout + split)  # fmt: skip
    w = pack_conv_weight(weight)
    residual = residual if "res" in extra else None
    sn = {}
    if "in" in extra:
        sn["alpha"], sn["inv_beta"] = _snake_params(cin, n, KDEV)
    if "out" in extra:
        sn["out_alpha"], sn["out_inv_beta"] = _snake_params(cout, n, KDEV)
    want = causal_conv(xin, w, bias, d, residual, use_triton=False, **sn)
    last = to_channels_last(xin)
    one = _causal_conv_triton(last, w, bias, d, residual, channels_last=True, split_k=1,
                              **sn)  # fmt: skip
    got = _causal_conv_triton(last, w, bias, d, residual, channels_last=True, split_k=split,
                              **sn)  # fmt: skip
    assert got.shape == want.shape == (2, cout, n)
    assert rel_err(got, want) <= 2e-3 and rel_err(got, one) <= 2e-3
    assert not _counters(torch.device(KDEV)).any()


def test_tma_default_needs_hopper_and_host_descriptors(monkeypatch):
    """CONV_TMA (on by default) takes a fitting conv only on sm_90 or newer and with a Triton
    that has host-side tensor descriptors; an explicit tma=True is taken as asked."""
    import ttsbuild.plugins._dispatch as dispatch
    import ttsbuild.plugins.causal_conv as cc

    class _OnGpu:  # a channels-last input as the capability check sees it on a CUDA device
        def __init__(self, t):
            self.t, self.is_cuda, self.shape = t, True, t.shape
            self.device = torch.device("cuda", 0)

        def stride(self):
            return self.t.stride()

        def element_size(self):
            return self.t.element_size()

        def data_ptr(self):
            return self.t.data_ptr()

    xin = to_channels_last(torch.randn(2, 64, 600, dtype=torch.float16))
    w = torch.randn(7, 64, 64, dtype=torch.float16)
    monkeypatch.setattr(cc, "CONV_TMA", True)
    monkeypatch.setattr(cc, "CONV_TMA_MIN_N", 512)
    monkeypatch.setattr(dispatch, "_host_descriptors", lambda: True)
    assert cc._tma_fits(xin, w, 582, None, 1, None, None)       # the interpreter's CPU input
    assert not cc._tma_fits(xin, w, 582, None, 2, None, None)   # split over K: never
    assert not cc._tma_fits(xin, w, 100, None, 1, None, None)   # below CONV_TMA_MIN_N
    gpu = _OnGpu(xin)
    for major, want in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(dispatch.torch.cuda, "get_device_capability",
                            lambda index, major=major: (major, 0))
        dispatch._hopper.cache_clear()
        assert cc._tma_fits(gpu, w, 582, None, 1, None, None) is want
        assert cc._tma_fits(gpu, w, 582, None, 1, None, True)  # asked for: taken
    dispatch._hopper.cache_clear()  # no faked capability left behind for later tests
    monkeypatch.setattr(dispatch, "_host_descriptors", lambda: False)
    assert not cc._tma_fits(gpu, w, 582, None, 1, None, None)
    assert not cc._tma_fits(xin, w, 582, None, 1, None, None)
    monkeypatch.setattr(dispatch, "_host_descriptors", lambda: True)
    monkeypatch.setattr(cc, "CONV_TMA", False)
    assert not cc._tma_fits(gpu, w, 582, None, 1, None, None)


def test_few_tiles_parse_and_refuse_bad_entries():
    """TTSBUILD_CODEC_FEW_TILES: per output channel count a tile and an optional split count;
    a malformed entry is a clear error naming the variable, never a silent default."""
    from ttsbuild.plugins.causal_conv import _few_tiles

    assert _few_tiles("") == {}
    assert _few_tiles("96:64,64,64,8,4,1; 192:32,64,64,4,3;") == {
        96: (64, 64, 64, 8, 4, 1), 192: (32, 64, 64, 4, 3)}
    for bad in ("96:64,64", "x:64,64,64,4,3", "96:64,48,64,4,3", "96-64,64,64,4,3",
                "96:64,64,64,4,0", "96:64,64,64,6,3"):
        with pytest.raises(ValueError, match="TTSBUILD_CODEC_FEW_TILES"):
            _few_tiles(bad)


def test_few_tiles_default_on_hopper_up_to_four_streams(monkeypatch):
    """The few-stream tiles: FEW_TILES_HOPPER (valid entries) by default on sm_90 and newer
    only, up to FEW_TILES_MAX_STREAMS streams; TTSBUILD_CODEC_FEW_TILES's own tiles on any
    device, and "" none anywhere."""
    import ttsbuild.plugins.causal_conv as cc

    spec = ";".join(f"{c}:{','.join(map(str, t))}" for c, t in cc.FEW_TILES_HOPPER.items())
    assert cc._few_tiles(spec) == cc.FEW_TILES_HOPPER
    monkeypatch.setattr(cc, "FEW_TILES", None)
    monkeypatch.setattr(cc, "FEW_TILES_MAX_STREAMS", 4)
    x = torch.randn(4, 192, 50)
    assert cc._few_tile(x, 192) is None  # not a Hopper GPU
    monkeypatch.setattr(cc, "on_hopper", lambda t: True)
    assert cc._few_tile(x, 192) == cc.FEW_TILES_HOPPER[192]
    assert cc._few_tile(x, 193) is None
    assert cc._few_tile(torch.randn(5, 192, 50), 192) is None  # more streams: the rules
    monkeypatch.setattr(cc, "FEW_TILES", {})
    assert cc._few_tile(x, 192) is None
    monkeypatch.setattr(cc, "on_hopper", lambda t: False)
    monkeypatch.setattr(cc, "FEW_TILES", {192: (32, 64, 32, 4, 4)})
    assert cc._few_tile(x, 192) == (32, 64, 32, 4, 4)


@needs_kernel
@pytest.mark.parametrize(("cout", "n", "tile"), [
    (96, 40, (32, 64, 32, 4, 4, 3)),   # flattened K steps over 96 channels, 3 splits
    (192, 24, (16, 64, 64, 4, 3, 1)),  # FEW_TILES_HOPPER's 16-row tile, no split
    (128, 600, (64, 64, 64, 8, 3)),    # the engine's split count; TMA-sized, yet this kernel
])
def test_few_tiles_take_the_few_stream_convs(cout, n, tile, monkeypatch):
    """FEW_TILES: a few-stream conv (split=True, as the engine asks at up to
    CONV_SPLIT_MAX_STREAMS streams) of that many output channels runs the given tile and
    split count on the pointer-gather kernel (never `_config`'s tile, never the TMA kernel),
    with the reference's values; other calls keep the rules."""
    import ttsbuild.plugins.causal_conv as cc

    xin, weight, bias, residual = _inputs(2, cout, cout, 7, 3, n, torch.float16, KDEV,
                                          cout + n)  # fmt: skip
    alpha, inv_beta = _snake_params(cout, n, KDEV)
    w = pack_conv_weight(weight)
    want = causal_conv(xin, w, bias, 3, out_alpha=alpha, out_inv_beta=inv_beta,
                       use_triton=False)
    last = to_channels_last(xin)
    splits = []
    real_split = cc._split_k
    monkeypatch.setattr(cc, "_split_k", lambda t, k, sms, sk, auto=None: splits.append(sk)
                        or real_split(t, k, sms, sk, auto))
    monkeypatch.setattr(cc, "CONV_TMA", True)
    monkeypatch.setattr(cc, "CONV_TMA_MIN_N", 1)
    monkeypatch.setattr(cc, "_causal_conv_tma", lambda *a, **kw: pytest.fail("TMA kernel"))
    monkeypatch.setattr(cc, "FEW_TILES", {cout: tile})
    monkeypatch.setattr(cc, "_config", lambda *a, **kw: pytest.fail("_config's tile"))
    got = causal_conv(last, w, bias, 3, out_alpha=alpha, out_inv_beta=inv_beta,
                      channels_last=True, split=True, use_triton=True)
    assert rel_err(got, want) <= 2e-3
    assert splits == [tile[5] if len(tile) == 6 else None]
    monkeypatch.setattr(cc, "FEW_TILES", {cout + 1: tile})  # another width: the rules
    monkeypatch.setattr(cc, "CONV_TMA", False)
    calls = []
    monkeypatch.setattr(cc, "_config", lambda *a, **kw: calls.append(a) or (32, 64, 32, 4))
    causal_conv(last, w, bias, 3, out_alpha=alpha, out_inv_beta=inv_beta,
                channels_last=True, split=True, use_triton=True)
    assert len(calls) == 1


def _snake_params(c, seed, device):
    g = torch.Generator().manual_seed(seed)
    alpha = (0.3 * torch.randn(c, 1, generator=g)).exp()
    inv_beta = 1.0 / ((0.3 * torch.randn(c, 1, generator=g)).exp() + 1e-9)
    return alpha.to(device), inv_beta.to(device)


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "k", "d", "n", "channels_last"), [
    (96, 96, 7, 9, 37, True),      # block 4's dilated conv, channels-last as served
    (64, 96, 7, 3, 700, True),     # >= 2048 output rows: the 128 x 128 tile
    (48, 40, 3, 2, 16, False),     # a masked channel tile, [B, C, T] output
])
def test_output_snake_equals_conv_then_snake(cin, cout, k, d, n, channels_last):
    """SnakeBeta in the conv's epilogue (out_alpha, out_inv_beta) = the conv, rounded, then
    snake_context's SnakeBeta of it: the residual unit's second SnakeBeta moved from the 1x1
    conv's input load into the k = 7 conv. The reference path gives the same bits as the two
    steps; the kernel the same values within half-precision rounding."""
    from ttsbuild.plugins.codec_context import snake_context_reference

    xin, weight, bias, _ = _inputs(3, cin, cout, k, d, n, torch.float16, KDEV, cin + k + n)
    alpha, inv_beta = _snake_params(cout, n, KDEV)
    w = pack_conv_weight(weight)
    conv = causal_conv(xin, w, bias, d, use_triton=False)
    want = snake_context_reference(conv, alpha, inv_beta, None, None)
    assert rel_err(want, conv) > 1e-2  # the SnakeBeta changes the values it is checked on
    ref = causal_conv(xin, w, bias, d, out_alpha=alpha, out_inv_beta=inv_beta,
                      use_triton=False)
    assert torch.equal(ref, want)
    xin = to_channels_last(xin) if channels_last else xin
    got = causal_conv(xin, w, bias, d, out_alpha=alpha, out_inv_beta=inv_beta,
                      channels_last=channels_last, use_triton=True)
    assert got.shape == want.shape == (3, cout, n)
    assert rel_err(got, want) <= 2e-3
    # the kernel's own conv, then the SnakeBeta: the same rounding steps, only sin differs
    two_steps = snake_context_reference(
        causal_conv(xin, w, bias, d, channels_last=channels_last, use_triton=True), alpha,
        inv_beta, None, None)
    assert rel_err(got, two_steps) <= 1e-3
    # a wrong parameter fails the comparison (the epilogue reads out_alpha, not alpha)
    bad = causal_conv(xin, w, bias, d, out_alpha=alpha.flip(0), out_inv_beta=inv_beta,
                      channels_last=channels_last, use_triton=True)
    assert rel_err(bad, want) > 1e-2


@needs_kernel
@pytest.mark.parametrize(("C", "d", "n", "B", "channels_last"), [
    (96, 9, 37, 3, True),      # block 4's unit, channels-last as served, 32-row tiles
    (96, 1, 700, 3, True),     # >= 2048 rows: 64-row tiles
    (40, 3, 20, 2, False),     # masked channels, [B, C, T] operands
    (192, 3, 11, 2, True),     # block 3's unit: 256 channels a program, 8 warps
])
def test_residual_unit_equals_its_two_convs(C, d, n, B, channels_last, monkeypatch):
    """The fused residual unit (k = 7 conv, SnakeBeta, 1x1 conv, residual in one launch)
    against the two launches it replaces and the reference path: the same roundings, so the
    values agree to half-precision rounding; a wrong 1x1 weight or SnakeBeta fails it."""
    import ttsbuild.plugins.causal_conv as cc

    launched = []
    real = cc._residual_unit_kernel

    class Spy:  # the fused kernel, not the two convs, must be what runs
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(cc, "_residual_unit_kernel", Spy())
    xin, weight, bias, residual = _inputs(B, C, C, 7, d, n, torch.float16, KDEV, C + d + n)
    _, w1x1, b1, _ = _inputs(B, C, C, 1, 1, n, torch.float16, KDEV, C + d + n + 1)
    alpha, inv_beta = _snake_params(C, n, KDEV)
    w7, w1 = pack_conv_weight(weight), pack_conv_weight(w1x1)
    if channels_last:
        xin, residual = to_channels_last(xin), to_channels_last(residual)
    h = causal_conv(xin, w7, bias, d, out_alpha=alpha, out_inv_beta=inv_beta, use_triton=False)
    want = causal_conv(h, w1, b1, 1, residual, use_triton=False)
    got = residual_unit(xin, w7, bias, d, alpha, inv_beta, w1, b1, residual,
                        channels_last=channels_last, use_triton=True)
    assert got.shape == want.shape == (B, C, n)
    assert (got.stride(1) == 1) == channels_last
    assert rel_err(got, want) <= 4e-3, rel_err(got, want)
    assert rel_err(want, residual) > 5e-2  # the branch is not lost under the residual
    bad = residual_unit(xin, w7, bias, d, alpha, inv_beta, w1.flip(1).contiguous(), b1,
                        residual, channels_last=channels_last, use_triton=True)
    assert rel_err(bad, want) > 2e-2
    bad = residual_unit(xin, w7, bias, d, inv_beta, alpha, w1, b1, residual,
                        channels_last=channels_last, use_triton=True)
    assert rel_err(bad, want) > 2e-2
    assert len(launched) == 3


@needs_kernel
def test_snake_parameters_are_checked():
    xin, weight, bias, _ = _inputs(1, 16, 24, 3, 1, 8, torch.float16, KDEV, 11)
    w = pack_conv_weight(weight)
    alpha, inv_beta = _snake_params(24, 1, KDEV)
    with pytest.raises(ValueError, match="out_alpha must be 24"):
        causal_conv(xin, w, bias, 1, out_alpha=alpha[:16], out_inv_beta=inv_beta[:16],
                    use_triton=True)
    with pytest.raises(ValueError, match="both alpha and inv_beta"):
        causal_conv(xin, w, bias, 1, out_alpha=alpha, use_triton=True)
    with pytest.raises(ValueError, match="inv_beta must be 16"):
        causal_conv(xin, w, bias, 1, alpha=alpha[:16], inv_beta=inv_beta.half()[:16],
                    use_triton=True)


@needs_kernel
def test_kernel_reads_a_strided_input():
    xin, weight, bias, _ = _inputs(2, 32, 48, 3, 2, 24, torch.float16, KDEV, 7)
    strided = to_channels_last(xin)  # [B, C, T], C stride 1
    w = pack_conv_weight(weight)
    want = causal_conv(xin, w, bias, 2, use_triton=False)
    assert rel_err(causal_conv(strided, w, bias, 2, use_triton=True), want) <= 2e-3


def test_bad_shapes_are_refused():
    if KDEV is None:
        pytest.skip("needs CUDA + Triton (or the interpreter)")
    xin, weight, bias, residual = _inputs(1, 16, 16, 7, 9, 4, torch.float16, KDEV, 3)
    w = pack_conv_weight(weight)
    with pytest.raises(ValueError, match="shorter than the receptive field"):
        causal_conv(xin[..., :50], w, bias, 9, use_triton=True)
    with pytest.raises(ValueError, match="residual must be"):
        causal_conv(xin, w, bias, 9, residual[..., :2], use_triton=True)
    with pytest.raises(ValueError, match="w must be contiguous"):
        causal_conv(xin, weight.permute(2, 1, 0), bias, 9, use_triton=True)


# -- the transposed conv's overlap-add ------------------------------------------------------

from ttsbuild.plugins.causal_conv import overlap_add, overlap_add_reference  # noqa: E402


def _oa_inputs(B, n, taps, s, cout, S, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, n, taps, s, cout, generator=g)
    spill = torch.randn(S, cout, (taps - 1) * s, generator=g)
    rows = torch.randperm(S, generator=g)[:B]
    bias = torch.randn(cout, generator=g)
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for t in (z, spill, rows, bias)]


def test_overlap_add_reference_is_a_transposed_conv():
    """Two steps of the GEMM + overlap-add equal one F.conv_transpose1d over both steps'
    input (the spill carries the first step's tail into the second)."""
    g = torch.Generator().manual_seed(5)
    cin, cout, s, taps = 6, 4, 3, 2
    w = torch.randn(cin, cout, taps * s, generator=g, dtype=torch.float64)
    bias = torch.randn(cout, generator=g, dtype=torch.float64)
    x = torch.randn(2, cin, 7, generator=g, dtype=torch.float64)
    full = F.conv_transpose1d(x, w, bias, stride=s)[..., : 7 * s]
    wz = w.permute(0, 2, 1).reshape(cin, -1)  # [Cin, k * Cout], columns (tap, cout)
    spill = torch.zeros(3, cout, (taps - 1) * s, dtype=torch.float64)
    rows = torch.tensor([2, 0])
    outs = []
    for part in (x[..., :3], x[..., 3:]):
        B, _, n = part.shape
        z = (part.transpose(1, 2).reshape(B * n, cin) @ wz).view(B, n, taps, s, cout)
        outs.append(overlap_add_reference(z, spill, rows, bias))
    assert rel_err(torch.cat(outs, dim=-1), full) < 1e-12


@needs_kernel
@pytest.mark.parametrize(("n", "taps", "s", "cout"), [
    (1, 2, 8, 96), (4, 2, 5, 40), (7, 3, 2, 33), (2, 1, 2, 64), (1, 3, 4, 16), (16, 2, 3, 96),
])
@pytest.mark.parametrize(("channels_last", "spill_channels_last"),
                         [(False, False), (True, False), (True, True)])
def test_overlap_add_kernel_equals_reference(n, taps, s, cout, channels_last,
                                             spill_channels_last):
    z, spill, rows, bias = _oa_inputs(3, n, taps, s, cout, 5, torch.float16, KDEV, n + s)
    if spill_channels_last:  # [S, Cout, overlap] over [S, overlap, Cout] storage
        spill = to_channels_last(spill)
    ref_spill = spill.clone()
    for step in range(2):  # the second step reads the spill the first one wrote
        want = overlap_add(z, ref_spill if taps > 1 else None, rows, bias, use_triton=False)
        got = overlap_add(z, spill if taps > 1 else None, rows, bias,
                          channels_last=channels_last, use_triton=True)
        assert got.shape == want.shape == (3, cout, n * s)
        if channels_last:  # a [B, Cout, n * s] view of contiguous [B, n * s, Cout] storage
            assert got.stride() == (n * s * cout, 1, cout)
        assert rel_err(got, want) <= 2e-3, step
        if taps > 1:
            assert rel_err(spill, ref_spill) <= 2e-3, step
        z = z.flip(1).contiguous()


@pytest.mark.parametrize(("n", "taps", "s", "cout"), [(4, 2, 5, 40), (16, 2, 3, 96)])
def test_overlap_add_next_act_writes_the_next_convs_input(n, taps, s, cout):
    """overlap_add(next_act=...): the block's first residual unit's SnakeBeta'd input written
    beside the upsampled output, after ctx columns of a channels-last buffer, as snake_context
    would (SnakeBeta of the stored output): the reference and the kernel (where one runs)
    alike, the output and the spill as without it."""
    from ttsbuild.plugins.codec_context import snake_context_reference

    dev = KDEV or "cpu"
    z, spill, rows, bias = _oa_inputs(3, n, taps, s, cout, 5, torch.float16, dev, n + s + 1)
    alpha, inv_beta = _snake_params(cout, n + 2, dev)
    ctx = 6
    for use_triton in (False, True) if KDEV else (False,):
        sp1, sp2 = spill.clone(), spill.clone()
        buf = torch.full((3, ctx + n * s, cout), 7.0, dtype=z.dtype, device=dev)
        dst = buf.transpose(1, 2)[..., ctx:]
        y = overlap_add(z, sp1, rows, bias, channels_last=True, use_triton=use_triton,
                        next_act=(alpha, inv_beta, dst))
        plain = overlap_add(z, sp2, rows, bias, channels_last=True, use_triton=use_triton)
        assert torch.equal(y, plain) and torch.equal(sp1, sp2)
        want = snake_context_reference(y, alpha, inv_beta, None, None)
        assert rel_err(want, y) > 1e-2
        assert rel_err(dst, want) <= 1e-3, use_triton
        assert bool((buf[:, :ctx] == 7.0).all())
    with pytest.raises(ValueError, match="destination"):
        overlap_add(z, spill, rows, bias, next_act=(alpha, inv_beta, dst[..., 1:]))


def _output_stage(C, seed, device):
    """The output stage's conv to one channel (nn weight [1, C, 7]), its SnakeBeta [C, 1]."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(1, C, 7, generator=g) / (7 * C) ** 0.5
    alpha = (0.3 * torch.randn(C, 1, generator=g)).exp()
    inv_beta = 1.0 / ((0.3 * torch.randn(C, 1, generator=g)).exp() + 1e-9)
    return [t.to(device) for t in (weight, alpha, inv_beta)]


def test_output_taps_reference_is_the_definition_in_float64():
    """pack_output_taps: column j is tap j, zero past k; output_taps_reference: the taps of
    the SnakeBeta'd (unrounded, fp32) conv output, against float64; bad operands refused."""
    from ttsbuild.plugins.causal_conv import (
        conv_output_taps,
        output_taps_reference,
        pack_output_taps,
    )

    weight, alpha, inv_beta = _output_stage(10, 3, "cpu")
    taps = pack_output_taps(pack_conv_weight(weight))
    assert taps.shape == (10, 16) and taps.dtype == torch.float32
    assert torch.equal(taps[:, :7], weight[0]) and not taps[:, 7:].any()
    y = torch.randn(2, 10, 9, dtype=torch.float64)
    s = y + inv_beta.double() * torch.sin(alpha.double() * y) ** 2
    want = torch.stack([(weight[0, :, j].double()[None, :, None] * s).sum(1)
                        for j in range(7)], dim=-1)  # [2, 9, 7]  # fmt: skip
    got = output_taps_reference(y.half(), taps, alpha, inv_beta)
    assert got.shape == (2, 9, 16) and not got[..., 7:].any()
    yh = y.half().double()  # the reference reads y's rounded values
    sh = yh + inv_beta.double() * torch.sin(alpha.double() * yh) ** 2
    want_h = torch.stack([(weight[0, :, j].double()[None, :, None] * sh).sum(1)
                          for j in range(7)], dim=-1)  # fmt: skip
    assert rel_err(got[..., :7], want_h) < 1e-6 and rel_err(want_h, want) < 1e-2
    with pytest.raises(ValueError, match="one channel"):
        pack_output_taps(pack_conv_weight(weight.expand(2, 10, 7)))
    xin, w1, b1, res = _inputs(2, 12, 10, 1, 1, 9, torch.float16, "cpu", 4)
    with pytest.raises(ValueError, match="taps_w must be"):
        conv_output_taps(xin, pack_conv_weight(w1), b1, 1, res, taps[:9], alpha, inv_beta)


@needs_kernel
@pytest.mark.parametrize(("cin", "cout", "n", "snake", "split"), [
    (96, 96, 700, False, False),   # the last block's 1x1 conv at >= 2048 rows
    (512, 96, 40, True, True),     # few rows, split over K (2 of 8 steps), SnakeBeta in the load
    (48, 40, 20, False, True),     # channels masked in the one tile
])
def test_conv_output_taps_kernel_equals_the_reference(cin, cout, n, snake, split):
    """conv_output_taps on the kernel (the conv, its rounding, the output stage's SnakeBeta
    and taps in the epilogue, y never stored) against the conv reference then
    output_taps_reference, on fresh random inputs, channels-last input and residual."""
    from ttsbuild.plugins.causal_conv import (
        conv_output_taps,
        output_taps_reference,
        pack_output_taps,
    )
    from ttsbuild.plugins.codec_context import snake_context_reference

    xin, weight, bias, residual = _inputs(3, cin, cout, 1, 1, n, torch.float16, KDEV,
                                          cin + cout + n)  # fmt: skip
    xin, residual = to_channels_last(xin), to_channels_last(residual)
    w = pack_conv_weight(weight)
    ow, alpha, inv_beta = _output_stage(cout, n, KDEV)
    taps = pack_output_taps(pack_conv_weight(ow))
    g = torch.Generator().manual_seed(cin)
    in_a = (0.3 * torch.randn(cin, 1, generator=g)).exp().to(KDEV) if snake else None
    in_b = (1.0 / ((0.3 * torch.randn(cin, 1, generator=g)).exp() + 1e-9)).to(KDEV) \
        if snake else None
    want = conv_output_taps(xin, w, bias, 1, residual, taps, alpha, inv_beta, in_alpha=in_a,
                            in_inv_beta=in_b, use_triton=False)  # fmt: skip
    src = snake_context_reference(xin, in_a, in_b, None, None) if snake else xin
    y = causal_conv(src, w, bias, 1, residual, use_triton=False)
    assert want.shape == (3, n, 16) and torch.allclose(
        want, output_taps_reference(y, taps, alpha, inv_beta))
    got = conv_output_taps(xin, w, bias, 1, residual, taps, alpha, inv_beta, in_alpha=in_a,
                           in_inv_beta=in_b, split=split, use_triton=True)  # fmt: skip
    assert got.shape == (3, n, 16) and got.dtype == torch.float32
    assert rel_err(got, want) <= 2e-3 and not got[..., 7:].any()

