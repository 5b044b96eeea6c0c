"""The codec pre-transformer's ring attention: the reference equals a float64 softmax
attention over the rows' visible ring entries; the kernel (CUDA, or CPU under
TRITON_INTERPRET=1) equals the reference on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.ring_attention import ring_attention, ring_attention_reference


def _inputs(B, n, H, Hkv, R, D, S, device, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, D, generator=g)
    k_ring = torch.randn(S, Hkv, R, D, generator=g)
    v_ring = torch.randn(S, Hkv, R, D, generator=g)
    rows = torch.randperm(S, generator=g)[:B]
    visible = torch.rand(B, 1, n, R, generator=g) < 0.6
    visible[..., 0] = True  # every query sees at least one key (itself, in the engine)
    mask = torch.zeros(B, 1, n, R).masked_fill_(~visible, float("-inf"))
    return [t.to(device) for t in (q.to(dtype), k_ring.to(dtype), v_ring.to(dtype), rows,
                                   mask)]


def test_reference_is_masked_softmax_attention():
    q, k_ring, v_ring, rows, mask = _inputs(3, 2, 4, 2, 9, 8, 5, "cpu", 0)
    y = ring_attention_reference(q, k_ring, v_ring, rows, mask, 0.3)
    assert y.shape == (3, 2, 32)
    for b in range(3):
        for i in range(2):
            for h in range(4):
                keys = k_ring[rows[b], h // 2].double()
                s = keys @ q[b, i, h].double() * 0.3 + mask[b, 0, i].double()
                want = torch.softmax(s, 0) @ v_ring[rows[b], h // 2].double()
                got = y[b, i, h * 8 : (h + 1) * 8].double()
                assert (got - want).abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize(("n", "H", "Hkv", "R", "D"), [
    (1, 16, 16, 75, 64),  # the real codec: one frame, a ring of 72 - 1 + 4
    (4, 16, 16, 87, 64),
    (3, 4, 2, 20, 24),    # GQA, D not a power of two
])
def test_kernel_equals_reference(n, H, Hkv, R, D):
    q, k_ring, v_ring, rows, mask = _inputs(3, n, H, Hkv, R, D, 6, KDEV, n + R)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided like the engine's view
    want = ring_attention(q, k_ring, v_ring, rows, mask, D ** -0.5, use_triton=False)
    got = ring_attention(q, k_ring, v_ring, rows, mask, D ** -0.5, use_triton=True)
    assert got.shape == want.shape == (3, n, H * D)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@needs_kernel
def test_kernel_refuses_bad_shapes():
    q, k_ring, v_ring, rows, mask = _inputs(2, 1, 4, 4, 10, 8, 3, KDEV, 1)
    with pytest.raises(ValueError, match="mask must be"):
        ring_attention(q, k_ring, v_ring, rows, mask[..., :5], 1.0, use_triton=True)
    with pytest.raises(ValueError, match="rings must be"):
        ring_attention(q, k_ring[..., :4], v_ring[..., :4], rows, mask, 1.0, use_triton=True)
