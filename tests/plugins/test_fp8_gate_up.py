"""fp8_gate_up_silu (the talker's MLP up half in one launch): the reference is the two
unfused ops; the Triton kernel (fp8_linear's GATE_UP mode) against them on fresh random
inputs (on CUDA, or on CPU under TRITON_INTERPRET=1)."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.fp8_linear import (
    dequantize_weight_fp8,
    fp8_gate_up_silu,
    fp8_linear,
    fp8_linear_reference,
    quantize_weight_fp8,
)
from ttsbuild.plugins.norm_act import silu_mul_reference


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _case(seed, M, N, K, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(2 * N, K, device=device, generator=g) * K**-0.5
    q, s = quantize_weight_fp8(w)
    x = torch.randn(M, K, device=device, generator=g).bfloat16()
    return x, q, s


def test_reference_is_the_two_ops():
    x, q, s = _case(1, 3, 48, 64, "cpu")
    out = fp8_gate_up_silu(x, q, s, use_triton=False)
    assert out.shape == (3, 48)
    assert torch.equal(out, silu_mul_reference(fp8_linear_reference(x, q, s)))
    with pytest.raises(ValueError, match="even row count"):
        fp8_gate_up_silu(x, q[:95], s[:95], use_triton=False)


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("N,K", [(64, 256), (40, 200)])  # the second: uneven N and K
@pytest.mark.parametrize("split", [1, 2])
def test_kernel_rounds_as_the_unfused_kernels(M, N, K, split):
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton

    x, q, s = _case(M * 31 + N + K + split, M, N, K, KDEV)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": split}
    for _ in range(2):  # twice: split-K counters reset
        out = fp8_linear_triton(x, q, s, config=cfg, gate_up=True)
        unfused = silu_mul_reference(fp8_linear_triton(x, q, s, config=cfg))
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        if KDEV == "cuda":  # the interpreter rounds fp32 -> bf16 by truncation, torch does not
            assert torch.equal(out, unfused)
        else:
            assert _rel(out, unfused) < 2e-2
    gate_up = x.float() @ dequantize_weight_fp8(q, s).t()  # fp32 reference
    ref = torch.nn.functional.silu(gate_up[:, :N]) * gate_up[:, N:]
    assert _rel(out, ref) < 2e-2


@needs_kernel
@pytest.mark.parametrize("M", [1, 8])
def test_public_op_takes_the_kernel(M):
    x, q, s = _case(7 + M, M, 128, 256, KDEV)
    out = fp8_gate_up_silu(x, q, s, use_triton=True)
    ref = silu_mul_reference(fp8_linear(x, q, s, use_triton=False))
    assert _rel(out, ref) < 2e-2
