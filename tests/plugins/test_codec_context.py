"""The codec's fused SnakeBeta + causal-conv left context: the reference is the eager ops,
the kernel (CUDA, or CPU under TRITON_INTERPRET=1) equals the reference and advances the
same tails."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.codec_context import (
    snake_context,
    snake_context_reference,
    to_channels_last,
)


def _inputs(B, C, n, ctx, S, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(B, C, n, generator=g)).to(dtype)
    alpha = (0.3 * torch.randn(C, 1, generator=g)).exp()
    inv_beta = 1.0 / ((0.3 * torch.randn(C, 1, generator=g)).exp() + 1e-9)
    tail = torch.randn(S, C, ctx, generator=g).to(dtype)
    rows = torch.randperm(S, generator=g)[:B]
    return [t.to(device) for t in (x, alpha, inv_beta, tail, rows)]


def test_reference_is_snake_then_context():
    x, alpha, inv_beta, tail, rows = _inputs(3, 5, 4, 6, 7, torch.float32, "cpu", 0)
    old = tail.clone()
    xin = snake_context_reference(x, alpha, inv_beta, tail, rows)
    snake = x + inv_beta * torch.sin(alpha * x) ** 2
    assert torch.equal(xin[..., :6], old[rows]) and torch.allclose(xin[..., 6:], snake)
    assert torch.equal(tail[rows], xin[..., -6:])  # the last 6 inputs seen
    others = [s for s in range(7) if s not in rows.tolist()]
    assert torch.equal(tail[others], old[others])


@needs_kernel
@pytest.mark.parametrize("snake", [True, False])
@pytest.mark.parametrize(("C", "n", "ctx"), [(96, 1, 6), (48, 4, 54), (40, 16, 2), (33, 3, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(snake, C, n, ctx, dtype):
    x, alpha, inv_beta, tail, rows = _inputs(3, C, n, ctx, 5, dtype, KDEV, C + n + ctx)
    if not snake:
        alpha = inv_beta = None
    ref_tail = tail.clone()
    want = snake_context(x, alpha, inv_beta, ref_tail if ctx else None, rows, use_triton=False)
    got = snake_context(x, alpha, inv_beta, tail if ctx else None, rows, use_triton=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert got.shape == want.shape
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= tol
    if ctx:  # the same new tails (the rows' last ctx inputs), the other slots untouched
        assert ((tail.float() - ref_tail.float()).abs().max()).item() <= tol * 10


@needs_kernel
@pytest.mark.parametrize(("C", "n", "ctx", "x_channels_last"),
                         [(96, 4, 6, False), (48, 30, 54, True), (40, 16, 2, True),
                          (96, 300, 54, False), (130, 200, 6, True)])  # several time blocks
@pytest.mark.parametrize("tail_channels_last", [False, True])
def test_channels_last_output_holds_the_same_values(C, n, ctx, x_channels_last,
                                                    tail_channels_last):
    """channels_last: xin is a [B, C, L] view of a contiguous [B, L, C] tensor, the same values
    and the same tails as the default layout, from either layout of x, with tails stored either
    way ([S, C, ctx] or a view of [S, ctx, C])."""
    x, alpha, inv_beta, tail, rows = _inputs(3, C, n, ctx, 5, torch.float16, KDEV, C * n + ctx)
    if x_channels_last:
        x = to_channels_last(x)
    if tail_channels_last:
        tail = to_channels_last(tail)
    ref_tail = tail.clone()
    want = snake_context(x, alpha, inv_beta, ref_tail, rows, use_triton=False)
    for use_triton in (False, True):
        got_tail = tail.clone()
        got = snake_context(x, alpha, inv_beta, got_tail, rows, channels_last=True,
                            use_triton=use_triton)  # fmt: skip
        assert got.shape == want.shape == (3, C, ctx + n)
        assert got.stride() == ((ctx + n) * C, 1, C)
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err.item() <= 1e-3
        assert ((got_tail.float() - ref_tail.float()).abs().max()).item() <= 1e-2


def test_the_channels_last_tile_setting_is_checked():
    from ttsbuild.plugins.codec_context import _tile

    assert _tile("32,128,8") == (32, 128, 8)
    for bad in ("32,128", "a,b,c", "48,64,4", "0,64,4"):
        with pytest.raises(ValueError, match="TTSBUILD_SNAKE_CL_TILE"):
            _tile(bad)


@pytest.mark.parametrize(("C", "n", "ctx", "channels_last"),
                         [(96, 300, 54, True), (48, 4, 54, True), (40, 16, 6, False),
                          (130, 70, 18, True)])
def test_context_fill_is_snake_context_of_samples_in_place(C, n, ctx, channels_last):
    """context_fill over a buffer whose last n columns hold SnakeBeta'd samples (as
    causal_conv's next_act writes them) = snake_context of the raw samples: the same input
    with its left context from the rows' tails (n < ctx: part of the old tail shifted), the
    same new tails, the other slots untouched; the reference and the kernel alike."""
    from ttsbuild.plugins.codec_context import context_fill

    x, alpha, inv_beta, tail, rows = _inputs(3, C, n, ctx, 5, torch.float16, KDEV or "cpu",
                                             C + n)
    ref_tail = tail.clone()
    want = snake_context(x, alpha, inv_beta, ref_tail, rows, channels_last=channels_last,
                         use_triton=False)
    for use_triton in (False, True) if KDEV else (False,):  # the kernel where one runs
        t = tail.clone()
        buf = torch.full((3, ctx + n, C) if channels_last else (3, C, ctx + n), 7.0,
                         dtype=x.dtype, device=x.device)
        xin = buf.transpose(1, 2) if channels_last else buf
        xin[..., ctx:] = snake_context_reference(x, alpha, inv_beta, None, None)
        got = context_fill(xin, t, rows, use_triton=use_triton)
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(got, want), use_triton
        assert torch.equal(t, ref_tail), use_triton
        assert not torch.equal(t, tail)  # the tails moved on
