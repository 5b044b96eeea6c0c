"""rms_norm / add_rms_norm / silu_mul / snake_beta: references on CPU, kernels against an
fp32 reference (on CUDA, or on CPU under TRITON_INTERPRET=1)."""


import pytest
import torch
import torch.nn.functional as F
from kernel_device import KDEV, needs_kernel

from ttsbuild.model.codec import SnakeBeta
from ttsbuild.model.layers import RMSNorm
from ttsbuild.plugins._dispatch import interpret_mode
from ttsbuild.plugins.norm_act import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
    snake_beta,
    snake_beta_reference,
)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- references (CPU, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_the_model(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    m = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.3 * torch.randn(64, generator=g))
        assert torch.equal(rms_norm_reference(x, m.weight, 1e-6), m(x))
        if not interpret_mode():  # the CPU dispatch is the reference
            assert torch.equal(rms_norm(x, m.weight, 1e-6), m(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 96, generator=g).to(dtype)
    res = torch.randn(4, 96, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    new_res, out = add_rms_norm(x, res, w, 1e-5, use_triton=False)
    assert torch.equal(new_res, res + x) and torch.equal(new_res, x + res)
    assert torch.equal(out, rms_norm_reference(res + x, w, 1e-5))
    assert torch.equal(add_rms_norm_reference(x, res, w, 1e-5)[1], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_reference(dtype):
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(2, 3, 2 * 48, generator=g).to(dtype)
    out = silu_mul(gu, use_triton=False)
    assert out.shape == (2, 3, 48)
    assert torch.equal(out, F.silu(gu[..., :48]) * gu[..., 48:])
    assert torch.equal(silu_mul_reference(gu), out)


def test_snake_beta_reference_is_the_module():
    g = torch.Generator().manual_seed(3)
    m = SnakeBeta(24)
    with torch.no_grad():
        m.alpha.copy_(0.5 * torch.randn(24, generator=g))
        m.beta.copy_(0.5 * torch.randn(24, generator=g))
        x = torch.randn(2, 24, 37, generator=g) * 3
        ref = x + 1.0 / (m.beta.exp()[:, None] + 1e-9) * torch.sin(x * m.alpha.exp()[:, None]) ** 2
        assert torch.equal(snake_beta_reference(x, m.alpha, m.beta), ref)
        assert torch.equal(m(x), ref)  # on CPU the module runs the reference


# ---------------------------------------------------------------- kernels vs fp32 reference


def _gen(seed):
    return torch.Generator(device=KDEV).manual_seed(seed)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (64, 2048), (3, 7, 1024), (5, 300)])
def test_rms_norm_kernel(shape, dtype):
    g = _gen(sum(shape))
    N = shape[-1]
    x = (torch.randn(shape, device=KDEV, generator=g) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(N, device=KDEV, generator=g)).to(dtype)
    out = rms_norm(x, w, 1e-6, use_triton=True)
    assert out.shape == x.shape and out.dtype == dtype
    ref = rms_norm_reference(x.float(), w.float(), 1e-6)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out, ref) < tol
    # close to the model's own rounding too
    assert _rel(out, rms_norm_reference(x, w, 1e-6)) < tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (64, 2048), (2, 9, 1024)])
def test_add_rms_norm_kernel(shape, dtype):
    g = _gen(7 + sum(shape))
    N = shape[-1]
    x = torch.randn(shape, device=KDEV, generator=g).to(dtype)
    res = (torch.randn(shape, device=KDEV, generator=g) * 4).to(dtype)
    w = (1 + 0.3 * torch.randn(N, device=KDEV, generator=g)).to(dtype)
    new_res, out = add_rms_norm(x, res, w, 1e-6, use_triton=True)
    # the sum is the eager add exactly (one rounding of an exact fp32 sum); the CPU
    # interpreter rounds fp32 -> bf16 by truncation, so there only within one ulp
    if KDEV == "cuda":
        assert torch.equal(new_res, res + x)
    else:
        assert torch.allclose(new_res.float(), (res + x).float(), rtol=2**-7, atol=0)
    ref_res, ref = add_rms_norm_reference(x.float(), res.float(), w.float(), 1e-6)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(new_res, ref_res) < tol
    assert _rel(out, ref) < tol
    assert _rel(out, add_rms_norm_reference(x, res, w, 1e-6)[1]) < tol


@needs_kernel
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 1024), (33, 2048), (2, 9, 1000)])
def test_norm_writes_its_rows_quantised(shape, residual):
    """quantize=True: the normed rows (bf16, unchanged) and, in the same launch, those rows
    quantised to FP8 with a scale per row exactly as `quantize_rows_reference` of the normed
    output (the input of a W8A8 linear after the norm)."""
    from ttsbuild.plugins.fp8_w8a8 import quantize_rows_reference

    g = _gen(11 + sum(shape) + residual)
    N = shape[-1]
    x = (torch.randn(shape, device=KDEV, generator=g) * 3).bfloat16()
    res = (torch.randn(shape, device=KDEV, generator=g) * 2).bfloat16()
    w = (1 + 0.3 * torch.randn(N, device=KDEV, generator=g)).bfloat16()
    if residual:
        new_res, out, (q, s) = add_rms_norm(x, res, w, 1e-6, use_triton=True, quantize=True)
        plain_res, plain = add_rms_norm(x, res, w, 1e-6, use_triton=True)
        assert torch.equal(new_res, plain_res)
    else:
        out, (q, s) = rms_norm(x, w, 1e-6, use_triton=True, quantize=True)
        plain = rms_norm(x, w, 1e-6, use_triton=True)
    assert torch.equal(out, plain)
    rq, rs = quantize_rows_reference(out.reshape(-1, N))
    assert q.shape == (out.numel() // N, N) and s.shape == (out.numel() // N, 1)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
    if s.numel() > 1:  # a scale per row, not one for all
        assert len(set(s.flatten().tolist())) > 1
    # and the reference path (CPU, no kernel) hands back the same pairing
    if not residual:
        cpu_out, (cq, cs) = rms_norm(x.cpu(), w.cpu(), 1e-6, use_triton=False, quantize=True)
        assert torch.equal(cs, quantize_rows_reference(cpu_out.reshape(-1, N))[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2 * 3072), (64, 2 * 6144), (2, 5, 2 * 3072), (3, 2 * 300)])
def test_silu_mul_kernel(shape, dtype):
    g = _gen(11 + sum(shape))
    gu = (torch.randn(shape, device=KDEV, generator=g) * 3).to(dtype)
    out = silu_mul(gu, use_triton=True)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    ref = silu_mul_reference(gu.float())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out, ref) < tol
    assert _rel(out, silu_mul_reference(gu)) < tol


@needs_kernel
@pytest.mark.parametrize("B,C,T", [(1, 1536, 1), (1, 96, 1923), (8, 768, 13), (3, 5, 300)])
def test_snake_beta_kernel(B, C, T):
    g = _gen(B * 1000 + C + T)
    x = torch.randn(B, C, T, device=KDEV, generator=g) * 4
    la = 0.7 * torch.randn(C, device=KDEV, generator=g)
    lb = 0.7 * torch.randn(C, device=KDEV, generator=g)
    out = snake_beta(x, la, lb, use_triton=True)
    ref = snake_beta_reference(x.double(), la.double(), lb.double())
    assert out.shape == x.shape and out.dtype == torch.float32
    assert _rel(out, ref) < 1e-5
    # a strided (non-contiguous) input
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert _rel(snake_beta(xt, la, lb, use_triton=True), ref) < 1e-5


@needs_kernel
def test_snake_beta_module_dispatch():
    m = SnakeBeta(32).to(KDEV)
    with torch.no_grad():
        m.alpha.normal_(0, 0.5)
        m.beta.normal_(0, 0.5)
        x = torch.randn(2, 32, 50, device=KDEV) * 2
        ref = snake_beta_reference(x.double(), m.alpha.double(), m.beta.double())
        assert _rel(m(x), ref) < 1e-5


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2 * 1024), (17, 2 * 3072), (2, 3, 2 * 500)])
def test_silu_mul_writes_its_rows_quantised(shape):
    """silu_mul(quantize=True): silu(gate) * up as the plain kernel writes it and, in the same
    launch (a program per row), its rows quantised as `quantize_rows_reference` of it."""
    from ttsbuild.plugins.fp8_w8a8 import quantize_rows_reference

    g = _gen(5 + sum(shape))
    gu = (torch.randn(shape, device=KDEV, generator=g) * 2).bfloat16()
    act, (q, s) = silu_mul(gu, use_triton=True, quantize=True)
    assert torch.equal(act, silu_mul(gu, use_triton=True))
    rq, rs = quantize_rows_reference(act.reshape(-1, act.shape[-1]))
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
    ref_act, (cq, cs) = silu_mul(gu.cpu(), use_triton=False, quantize=True)
    assert torch.equal(cs, quantize_rows_reference(ref_act.reshape(-1, act.shape[-1]))[1])
