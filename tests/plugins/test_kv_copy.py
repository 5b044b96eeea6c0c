"""plugins.kv_copy.prefix_copy: a prompt prefix's KV from the pool into slots, only the
positions below each row's start, in one launch (on CUDA, or on the CPU under
TRITON_INTERPRET=1), against the row-by-row reference."""

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.kv_copy import prefix_copy, prefix_copy_reference, prefix_copy_supported

L, S, E, H, T, P, D = 3, 5, 4, 2, 40, 24, 16


def _tensors(device, g, dtype=torch.bfloat16):
    def rnd(*shape):
        return (torch.rand(shape, generator=g) + 0.5).to(device, dtype)  # no zeros

    return rnd(L, S, H, T, D), rnd(L, S, H, T, D), rnd(L, E, H, P, D), rnd(L, E, H, P, D)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_prefix_copy_kernel_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    k, v, pk, pv = _tensors(KDEV, g, dtype)
    k2, v2, k0 = k.clone(), v.clone(), k.clone()
    # the indices as the engine stages them: columns of one int64 block (strided)
    staged = torch.tensor([[4, 1, 0, 9], [0, 3, 7, 9], [2, 3, 30, 9]])  # slot, entry, start
    slots, entries, starts = (staged[:, i].to(KDEV) for i in range(3))
    prefix_copy(k, v, pk, pv, slots, entries, starts, use_triton=True)
    prefix_copy_reference(k2, v2, pk, pv, slots, entries, starts)
    if dtype == torch.float8_e4m3fn:  # (the talker's FP8 cache: compared as bytes)
        k, v, k2, v2, k0, pk = (t.view(torch.uint8) for t in (k, v, k2, v2, k0, pk))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(k[:, 2, :, :P], pk[:, 3, :, :P])  # a start past P: all P positions
    assert torch.equal(k[:, 0, :, :7], pk[:, 3, :, :7])
    assert torch.equal(k[:, 0, :, 7:], k0[:, 0, :, 7:])  # nothing at or past the start
    assert torch.equal(k[:, 4], k0[:, 4])  # a start of 0: nothing
    assert torch.equal(k[:, [1, 3]], k0[:, [1, 3]])  # other slots untouched


def test_unsupported_layouts_are_not_taken():
    g = torch.Generator().manual_seed(3)
    k, _, pk, _ = _tensors("cpu", g)
    assert prefix_copy_supported(k, pk)
    assert not prefix_copy_supported(k[..., :12], pk[..., :12])  # D not a power of two
    assert not prefix_copy_supported(k.transpose(3, 4), pk)  # D not contiguous
    assert not prefix_copy_supported(k, pk.float())  # dtypes differ
    assert not prefix_copy_supported(k[:, :, :1], pk)  # heads differ
