"""plugins.convnext: a codec ConvNeXt block for few rows in two launches against the engine's
module ops, fresh random weights and inputs (fp32 and bf16; gamma applied or folded)."""

import pytest
import torch
from kernel_device import KDEV, kernel_cases, needs_kernel

from ttsbuild.plugins.convnext import convnext, dwconv_norm, dwconv_norm_reference

CASES = [(1, 2, 64, torch.float32, True), (2, 4, 96, torch.float32, False),
         (1, 4, 128, torch.bfloat16, True), (3, 2, 64, torch.bfloat16, False)]


def _block(B, n, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, n, generator=g).to(dtype)
    xe = torch.cat([torch.randn(B, C, 6, generator=g).to(dtype), x], dim=-1)
    p = dict(
        dw_weight=(torch.randn(C, 1, 7, generator=g) * 0.3).to(dtype),
        dw_bias=(torch.randn(C, generator=g) * 0.1).to(dtype),
        ln_weight=1 + 0.2 * torch.randn(C, generator=g),
        ln_bias=0.1 * torch.randn(C, generator=g), eps=1e-6,
        w1=(torch.randn(4 * C, C, generator=g) / C**0.5).to(dtype),
        b1=(torch.randn(4 * C, generator=g) * 0.1).to(dtype),
        w2=(torch.randn(C, 4 * C, generator=g) / (4 * C) ** 0.5).to(dtype),
        b2=(torch.randn(C, generator=g) * 0.1).to(dtype),
    )  # fmt: skip
    return x, xe, p


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_kernel
@pytest.mark.parametrize("B,n,C,dtype,with_gamma", kernel_cases(CASES, CASES))
def test_convnext_kernel_matches_the_module_ops(B, n, C, dtype, with_gamma, monkeypatch):
    x, xe, p = _block(B, n, C, dtype, seed=B * 100 + n * 10 + C)
    gamma = (0.5 + torch.rand(C, generator=torch.Generator().manual_seed(1))).to(dtype) \
        if with_gamma else None  # fmt: skip
    dev = {k: v.to(KDEV) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    out = convnext(x.to(KDEV), xe.to(KDEV), gamma=None if gamma is None else gamma.to(KDEV),
                   use_triton=True, **dev).cpu()  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = convnext(x, xe, gamma=gamma, use_triton=False, **p)
    branch_ref = (ref - x).double()  # the block's branch: what the kernels compute
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel(out - x, branch_ref) < tol, _rel(out - x, branch_ref)
    # a context one step off (the conv's taps shifted) is seen
    shifted = torch.roll(xe, 1, dims=-1)
    alt = convnext(x, shifted, gamma=gamma, use_triton=False, **p)
    assert _rel(alt - x, branch_ref) > 10 * tol


def test_convnext_refuses_a_context_that_does_not_fit():
    x, xe, p = _block(1, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="left context"):
        convnext(x, xe[..., 1:], gamma=None, **p)


DW_CASES = [(2, 3, 96, torch.float32), (3, 4, 1024, torch.float16), (1, 2, 40, torch.bfloat16)]


@needs_kernel
@pytest.mark.parametrize("B,n,C,dtype", kernel_cases(DW_CASES, DW_CASES))
def test_dwconv_norm_kernel_matches_the_module_ops(B, n, C, dtype):
    """The depthwise conv + LayerNorm launch against F.conv1d and F.layer_norm (rows of
    several programs, a channel count that is not a power of two); a context one step off
    fails the comparison."""
    x, xe, p = _block(B, n, C, dtype, seed=B * 7 + n * 3 + C)
    args = (p["dw_weight"], p["dw_bias"], p["ln_weight"], p["ln_bias"], p["eps"])
    out = dwconv_norm(xe.to(KDEV), *(a.to(KDEV) if isinstance(a, torch.Tensor) else a
                                     for a in args), use_triton=True).cpu()  # fmt: skip
    ref = dwconv_norm_reference(xe.float(), *(a.float() if isinstance(a, torch.Tensor) else a
                                              for a in args))  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == (B, n, C) and out.dtype == dtype and out.is_contiguous()
    assert _rel(out, ref) < tol, _rel(out, ref)
    alt = dwconv_norm_reference(torch.roll(xe, 1, dims=-1).float(),
                                *(a.float() if isinstance(a, torch.Tensor) else a for a in args))
    assert _rel(alt, ref) > 10 * tol


def test_dwconv_norm_refuses_a_weight_that_is_not_depthwise():
    x, xe, p = _block(1, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="depthwise"):
        dwconv_norm(xe, p["w1"][:, :, None], p["dw_bias"], p["ln_weight"], p["ln_bias"], 1e-6)

