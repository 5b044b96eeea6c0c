"""The codec's output stage in one kernel (SnakeBeta, left context, conv to one channel,
clamp): the reference equals a float64 computation of the definition, the kernel (CUDA, or
CPU under TRITON_INTERPRET=1) equals the reference over two steps and advances the same
tails."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.codec_context import to_channels_last
from ttsbuild.plugins.codec_output import codec_output, codec_output_reference


def _inputs(B, C, n, k, d, S, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (0.5 * torch.randn(B, C, n, generator=g)).to(dtype)
    w = torch.randn(k, C, 1, generator=g) / (k * C) ** 0.5  # outputs mostly inside (-1, 1)
    bias = 0.1 * torch.randn(1, generator=g)
    alpha = (0.3 * torch.randn(C, 1, generator=g)).exp()
    inv_beta = 1.0 / ((0.3 * torch.randn(C, 1, generator=g)).exp() + 1e-9)
    tail = 0.5 * torch.randn(S, C, (k - 1) * d, generator=g)
    rows = torch.randperm(S, generator=g)[:B]
    return [t.to(device) for t in (x, w, bias, alpha, inv_beta, tail, rows)]


class _Spy:
    """A launcher that records its launches (kernel[grid](...))."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_reference_is_the_definition_in_float64():
    x, w, bias, alpha, inv_beta, tail, rows = _inputs(3, 5, 9, 4, 2, 6, torch.float32, "cpu", 0)
    old = tail.clone()
    got = codec_output_reference(x, w, bias, alpha, inv_beta, tail, rows, dilation=2)
    xd = x.double()
    h = xd + inv_beta.double() * torch.sin(alpha.double() * xd) ** 2
    xin = torch.cat([old[rows].double(), h], dim=-1)  # [B, C, 6 + 9]
    want = torch.stack([sum(w[j, :, 0].double() @ xin[:, :, t + 2 * j].T for j in range(4))
                        for t in range(9)], dim=-1) + bias.double()  # fmt: skip
    assert got.shape == (3, 9) and rel_err(got, want.clamp(-1, 1)) < 1e-6
    assert torch.allclose(tail[rows].double(), xin[..., -6:])  # the last 6 inputs
    others = [s for s in range(6) if s not in rows.tolist()]
    assert torch.equal(tail[others], old[others])


def test_shapes_it_cannot_run_are_refused():
    x, w, bias, alpha, inv_beta, tail, rows = _inputs(2, 4, 5, 3, 1, 3, torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match="one channel"):
        codec_output(x, w.expand(3, 4, 2), bias, alpha, inv_beta, tail, rows)
    with pytest.raises(ValueError, match="tail must be"):
        codec_output(x, w, bias, alpha, inv_beta, tail.half(), rows)


@needs_kernel
@pytest.mark.parametrize(("C", "n", "k", "d"), [(96, 300, 7, 1), (40, 3, 7, 1), (33, 20, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("spread", [False, True, "taps", "taps-wide", "taps-32"])
def test_kernel_equals_reference_over_two_steps(C, n, k, d, dtype, channels_last, spread,
                                                monkeypatch):  # fmt: skip
    """Output blocks past the first (n 300: two; with the small-step spread, 128 -> 16
    samples a program: nineteen), a chunk shorter than the context (n 3: the new tail partly
    the old one, shifted), x of either layout, two steps (the second reads the tails the
    first wrote); False, True: the one-phase kernel, each tap recomputing its inputs'
    SnakeBeta; "taps": taps first (the window's [window, C] x [C, 16] product, then
    shifted sums of it), spread tiles; "taps-wide": the same on tiles of up to
    128 samples; "taps-32": tiles of at most 32 samples."""
    import ttsbuild.plugins.codec_output as co

    taps = isinstance(spread, str) and spread.startswith("taps")
    monkeypatch.setattr(co, "SPREAD", spread in (True, "taps"))
    monkeypatch.setattr(co, "TAPS_FIRST", taps)
    monkeypatch.setattr(co, "TAPS_MAX_T", 32 if spread == "taps-32" else 128)
    name = "_codec_output_taps_kernel" if taps else "_codec_output_kernel"
    launched = []  # the kernel asked for must be the one that runs
    monkeypatch.setattr(co, name, _Spy(getattr(co, name), launched), raising=True)
    x, w, bias, alpha, inv_beta, tail, rows = _inputs(3, C, n, k, d, 5, dtype, KDEV,
                                                      C + n + k + d)  # fmt: skip
    ref_tail = tail.clone()
    for step in range(2):
        xs = to_channels_last(x) if channels_last else x
        want = codec_output(xs, w, bias, alpha, inv_beta, ref_tail, rows, d, use_triton=False)
        got = codec_output(xs, w, bias, alpha, inv_beta, tail, rows, d, use_triton=True)
        assert got.shape == want.shape == (3, n) and got.dtype == torch.float32
        assert rel_err(got, want) <= 1e-5, step
        assert rel_err(tail, ref_tail) <= 1e-6, step
        x = x.flip(-1).contiguous()
    assert len(launched) == 2


def test_taps_then_output_from_taps_is_the_output_stage():
    """The stage split at its taps (causal_conv.output_taps_reference in the conv before,
    output_from_taps_reference after, the slot keeping the last inputs' taps): the output
    stage's pcm over three steps of different lengths (2 shorter than the context), the
    other slots' state untouched, bad operands refused."""
    from ttsbuild.plugins.causal_conv import output_taps_reference, pack_output_taps
    from ttsbuild.plugins.codec_output import output_from_taps

    B, C, k, d, S = 3, 12, 7, 1, 5
    x, w, bias, alpha, inv_beta, tail, rows = _inputs(B, C, 9, k, d, S, torch.float32, "cpu", 7)
    tail.zero_()
    taps = pack_output_taps(w)  # w: packed [k, C, 1]
    ztail = torch.zeros(S, (k - 1) * d, 16)
    ztail[[s for s in range(S) if s not in rows.tolist()]] = 5.0  # other slots: untouched
    g = torch.Generator().manual_seed(8)
    for n in (9, 2, 11):
        x = (0.5 * torch.randn(B, C, n, generator=g)).half()
        want = codec_output_reference(x, w, bias, alpha, inv_beta, tail, rows, d)
        z = output_taps_reference(x, taps, alpha, inv_beta)
        got = output_from_taps(z, k, bias, ztail, rows, d, use_triton=False)
        assert got.shape == (B, n) and rel_err(got, want) < 1e-5, n
    assert (ztail[[s for s in range(S) if s not in rows.tolist()]] == 5.0).all()
    with pytest.raises(ValueError, match="ztail must be"):
        output_from_taps(z, k, bias, ztail[:, :3], rows, d)
    with pytest.raises(ValueError, match="z fp32"):
        output_from_taps(z.half(), k, bias, ztail, rows, d)


@needs_kernel
@pytest.mark.parametrize(("n", "k", "d"), [(300, 7, 1), (3, 7, 1), (20, 3, 3)])
def test_output_from_taps_kernel_equals_reference_over_two_steps(n, k, d):
    """The kernel against the reference: blocks past the first, a step shorter than the
    context (the new ztail partly the old one), z as a [B, n, 16] view of [16, B, n]
    storage (as conv_output_taps writes it), two steps (the second reads what the first
    wrote)."""
    from ttsbuild.plugins.codec_output import output_from_taps

    g = torch.Generator().manual_seed(n + k + d)
    S, B, ctx = 5, 3, (k - 1) * d
    rows = torch.randperm(S, generator=g)[:B].to(KDEV)
    bias = (0.1 * torch.randn(1, generator=g)).to(KDEV)
    ztail = (0.1 * torch.randn(S, ctx, 16, generator=g)).to(KDEV)
    ref_tail = ztail.clone()
    for step in range(2):
        z = (0.1 * torch.randn(16, B, n, generator=g)).to(KDEV).permute(1, 2, 0)
        want = output_from_taps(z, k, bias, ref_tail, rows, d, use_triton=False)
        got = output_from_taps(z, k, bias, ztail, rows, d, use_triton=True)
        assert got.shape == (B, n) and rel_err(got, want) <= 1e-5, step
        assert torch.equal(ztail, ref_tail), step
