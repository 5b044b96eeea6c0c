"""The codec step's codebook lookup and sum in one launch: the reference is the eager ops
against a float64 sum; the kernel (CUDA, or CPU under TRITON_INTERPRET=1) equals it to fp32
rounding, in the stage's dtype and layout, for codes with any strides."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.codebook_sum import codebook_sum, codebook_sum_reference


def _case(B, Q, n, size, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tables = torch.randn(Q * size, D, generator=g)
    codes = torch.randint(0, size, (B, Q, n + 3), generator=g)[..., 2:-1]  # strided
    return codes.to(device), tables.to(device)


def _want(codes, tables, size):
    """float64 [B, D, n]: sum over q of tables[q * size + codes[b, q, t]]."""
    B, Q, n = codes.shape
    t64 = tables.double().cpu()
    out = torch.zeros(B, tables.shape[1], n, dtype=torch.float64)
    for q in range(Q):
        out += t64[q * size + codes[:, q].cpu()].permute(0, 2, 1)
    return out


def _rel(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


def test_reference_sums_the_codebooks_in_the_stage_dtype():
    codes, tables = _case(2, 5, 4, 11, 24, seed=0)
    want = _want(codes, tables, 11)
    x = codebook_sum_reference(codes, tables, 11, torch.float32)
    assert x.shape == (2, 24, 4) and x.stride(1) == 1 and _rel(x, want) < 1e-6
    half = codebook_sum(codes, tables, 11, torch.float16, use_triton=False)
    assert half.dtype == torch.float16 and 1e-6 < _rel(half, want) < 1e-3
    with pytest.raises(ValueError, match="tables must be"):
        codebook_sum(codes, tables[:-1], 11, torch.float16)


@needs_kernel
@pytest.mark.parametrize(("B", "Q", "n", "D", "dtype"), [(1, 16, 1, 512, torch.float16),
                                                        (3, 5, 4, 40, torch.float32)])
def test_kernel_matches_the_sum(B, Q, n, D, dtype):
    size = 64
    codes, tables = _case(B, Q, n, size, D, seed=B * 100 + D, device=KDEV)
    want = _want(codes, tables, size)
    got = codebook_sum(codes, tables, size, dtype, use_triton=True)
    assert got.shape == (B, D, n) and got.dtype == dtype and got.stride(1) == 1
    assert _rel(got, want) < (1e-3 if dtype == torch.float16 else 1e-6)
    ref = codebook_sum_reference(codes, tables, size, dtype)
    assert _rel(got, ref.double().cpu()) < (1e-3 if dtype == torch.float16 else 1e-6)
