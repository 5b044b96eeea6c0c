"""The codec pre-transformer's ring attention: the reference equals a float64 softmax
attention over the rows' visible ring entries; the kernel (CUDA, or CPU under
TRITON_INTERPRET=1) equals the reference on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KDEV, needs_kernel

from ttsbuild.plugins.ring_attention import (
    ring_attention,
    ring_attention_reference,
    ring_attention_rope,
    ring_attention_rope_reference,
)


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


def _rope_inputs(B, n, H, R, D, S, device, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, n, 3 * H, D, generator=g)
    k_ring = torch.randn(S, H, R, D, generator=g)
    v_ring = torch.randn(S, H, R, D, generator=g)
    rows = torch.randperm(S, generator=g)[:B]
    pos = torch.randint(0, 3 * R, (B,), generator=g)
    pos[0] = 0  # a fresh stream: every older ring entry at a negative frame, unseen
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    return [t.to(device) for t in (qkv, pos, rows, k_ring, v_ring, inv_freq)]


def test_rope_reference_is_rope_then_the_window_in_float64():
    """The fused layer's reference against the definition: RoPE of q and the new k at frames
    pos + i, the new keys/values at ring index frame % R, and softmax attention over the
    ring entries whose frames lie in (q - window, q] (frames of the ring tracked by hand)."""
    B, n, H, R, D, S, W = 2, 3, 2, 11, 8, 4, 6
    qkv, pos, rows, k_ring, v_ring, inv_freq = _rope_inputs(B, n, H, R, D, S, "cpu", 3)
    pos[1] = 25  # a ring that has wrapped twice
    frames = torch.full((S, R), -1, dtype=torch.long)  # the frame each ring entry holds
    frames[rows[1]] = torch.tensor([25 - ((25 - 1 - r) % R) - 1 for r in range(R)])
    old_k, old_v = k_ring.clone().double(), v_ring.clone().double()
    y = ring_attention_rope_reference(qkv, pos, rows, k_ring, v_ring, inv_freq, W, 0.4)

    def rope(x, frame):  # x [..., D]
        ang = frame * inv_freq.double()
        c, s_ = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        rot = torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)
        return x * c + rot * s_

    for b in range(B):
        slot = rows[b]
        keys, values, held = old_k[slot].clone(), old_v[slot].clone(), frames[slot].clone()
        for i in range(n):
            f = int(pos[b]) + i
            keys[:, f % R] = rope(qkv[b, i, H:2 * H].double(), f)
            values[:, f % R] = qkv[b, i, 2 * H:].double()
            held[f % R] = f
        for i in range(n):
            f = int(pos[b]) + i
            seen = (held <= f) & (held > f - W) & (held >= 0)
            for h in range(H):
                s = keys[h] @ rope(qkv[b, i, h].double(), f) * 0.4
                s = s.masked_fill(~seen, float("-inf"))
                want = torch.softmax(s, 0) @ values[h]
                assert (y[b, i, h * D:(h + 1) * D].double() - want).abs().max() < 1e-5
        assert torch.allclose(k_ring[slot].double(), keys, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("half_rings", [False, True])
@pytest.mark.parametrize("merge", [False, True, 32, 16])
@pytest.mark.parametrize(("n", "R"), [(1, 75), (4, 87), (3, 20)])
def test_rope_kernel_equals_reference_and_writes_the_same_rings(n, R, merge, half_rings,
                                                                 monkeypatch):  # fmt: skip
    """Queries/keys/values from one qkv projection, RoPE, the ring writes and the window mask
    in one launch (the real codec's 16 heads of 64); two steps, the second at the positions
    after the first, reading what the first wrote. merge True: the ring read first and the
    new frames merged in registers (TTSBUILD_RING_MERGE=1), not written and read back; 32,
    16: the ring read in chunks of that many entries with an online softmax
    (TTSBUILD_RING_CHUNK; chunks past the frames written so far hold no visible one).
    half_rings: fp16 rings beside fp32 queries (CodecEngine(ring_half=True)): the new keys
    and values rounded as written, the attention in fp32 over what the ring holds."""
    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_MERGE", merge is True)
    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_CHUNK",
                        0 if isinstance(merge, bool) else merge)
    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_CHUNK_MIN_ROWS", 1)
    qkv, pos, rows, k_ring, v_ring, inv_freq = _rope_inputs(3, n, 16, R, 64, 6, KDEV, n + R)
    if half_rings:
        k_ring, v_ring = k_ring.half(), v_ring.half()
    # fp16 rings: a key may round to its neighbouring fp16 value (RoPE's sin/cos differ in
    # the last fp32 bits between the kernel and torch: one ulp, 2**-10 of the largest at
    # most), moving its scores by ~2**-11
    out_tol, key_tol = (2e-3, 2**-10) if half_rings else (1e-5, 1e-5)
    ref_k, ref_v = k_ring.clone(), v_ring.clone()
    for step in range(2):
        want = ring_attention_rope(qkv, pos, rows, ref_k, ref_v, inv_freq, 72, 0.125,
                                   use_triton=False)  # fmt: skip
        got = ring_attention_rope(qkv, pos, rows, k_ring, v_ring, inv_freq, 72, 0.125,
                                  use_triton=True)  # fmt: skip
        assert got.shape == want.shape == (3, n, 16 * 64) and got.dtype == torch.float32
        assert ((got - want).abs().max() / want.abs().max()).item() < out_tol, step
        key_err = (k_ring.float() - ref_k.float()).abs().max()  # fp16: relative to the largest
        assert (key_err / (ref_k.float().abs().max() if half_rings else 1)).item() < key_tol, step
        assert k_ring.dtype == (torch.float16 if half_rings else torch.float32)
        assert torch.equal(v_ring, ref_v), step
        pos, qkv = pos + n, qkv.flip(1).contiguous()


@needs_kernel
@pytest.mark.parametrize("n", [1, 5])
def test_merged_rope_kernel_sees_half_precision_rings_as_stored(n, monkeypatch):
    """Half-precision rings: the merged keys and values are the rounded values the ring
    holds, so both kernels give the same output, and the reference's to fp32 rounding."""
    qkv, pos, rows, k_ring, v_ring, inv_freq = _rope_inputs(4, n, 16, 75, 64, 5, KDEV, 11 + n)
    qkv, k_ring, v_ring = qkv.half(), k_ring.half(), v_ring.half()
    outs, rings = [], []
    for merge in (False, True):
        monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_MERGE", merge)
        k, v = k_ring.clone(), v_ring.clone()
        outs.append(ring_attention_rope(qkv, pos, rows, k, v, inv_freq, 60, 0.125,
                                        use_triton=True).float())  # fmt: skip
        rings.append((k, v))
    ref_k, ref_v = k_ring.clone(), v_ring.clone()
    want = ring_attention_rope(qkv, pos, rows, ref_k, ref_v, inv_freq, 60, 0.125,
                               use_triton=False).float()  # fmt: skip
    # the outputs are half precision and the merged kernel sums in another order, so an
    # element may round to its neighbouring half value (one ulp <= 2**-10 of the largest;
    # H200 2026-12-03: 4.4e-6), never further
    assert ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item() <= 2**-10
    assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
    assert ((outs[1] - want).abs().max() / want.abs().max()).item() < 2e-3


def test_rope_refuses_grouped_heads():
    qkv, pos, rows, k_ring, v_ring, inv_freq = _rope_inputs(2, 1, 4, 10, 8, 3, "cpu", 1)
    with pytest.raises(ValueError, match="as many query as"):
        ring_attention_rope(qkv[:, :, 2:], pos, rows, k_ring, v_ring, inv_freq, 5, 1.0)


def _qkv_attend_inputs(B, F, H, R, D, S, K, half, seed):
    from ttsbuild.plugins.fused_linear import scaled_half_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B * F, K, generator=g) * 2
    nw = 1 + 0.3 * torch.randn(K, generator=g)
    w = torch.randn(3 * H * D, K, generator=g) * K**-0.5
    bias = torch.randn(3 * H * D, generator=g) * 0.1
    weight, scale = scaled_half_weight(w) if half else (w, None)
    k_ring = torch.randn(S, H, R, D, generator=g)
    v_ring = torch.randn(S, H, R, D, generator=g)
    rows = torch.randperm(S, generator=g)[:B]
    pos = torch.randint(0, 3 * R, (B,), generator=g)
    pos[0] = 0  # a fresh stream
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    return [t.to(KDEV) if t is not None else None
            for t in (x, nw, weight, scale, bias, pos, rows, k_ring, v_ring, inv_freq)]


def test_norm_linear_ring_attend_reference_is_the_two_ops_and_checks_shapes():
    from ttsbuild.plugins.fused_linear import fused_linear_reference, norm_linear_ring_attend

    B, F, H, R, D, S, K = 2, 3, 2, 11, 8, 4, 24
    x, nw, w, s, bias, pos, rows, k_ring, v_ring, inv_freq = (
        t.cpu() if t is not None else None
        for t in _qkv_attend_inputs(B, F, H, R, D, S, K, False, 5))
    k2, v2 = k_ring.clone(), v_ring.clone()
    y = norm_linear_ring_attend(x, nw, w, None, bias, pos, rows, k_ring, v_ring, inv_freq,
                                window=6, attn_scale=0.3, eps=1e-6, use_triton=False)
    qkv = fused_linear_reference(x, w, None, norm_weight=nw, eps=1e-6, bias=bias)
    want = ring_attention_rope_reference(qkv.view(B, F, 3 * H, D), pos, rows, k2, v2, inv_freq,
                                         6, 0.3)  # fmt: skip
    assert torch.equal(y, want.view(B * F, H * D))
    assert torch.equal(k_ring, k2) and torch.equal(v_ring, v2) and not torch.equal(k2, v2)
    with pytest.raises(ValueError, match="x \\[B \\* F, K\\]"):
        norm_linear_ring_attend(x[:5], nw, w, None, bias, pos, rows, k_ring, v_ring, inv_freq,
                                window=6, attn_scale=0.3, eps=1e-6, use_triton=False)
    with pytest.raises(ValueError, match="x \\[B \\* F, K\\]"):
        norm_linear_ring_attend(x, nw, w[:-1], None, bias, pos, rows, k_ring, v_ring, inv_freq,
                                window=6, attn_scale=0.3, eps=1e-6, use_triton=False)
    with pytest.raises(TypeError, match="per-channel scale"):
        norm_linear_ring_attend(x, nw, w, bias, bias, pos, rows, k_ring, v_ring, inv_freq,
                                window=6, attn_scale=0.3, eps=1e-6, use_triton=False)


@needs_kernel
@pytest.mark.parametrize(("F", "half", "chunk"), [(1, False, 0), (2, True, 0), (1, True, 8)])
def test_norm_linear_ring_attend_kernel_equals_the_two_ops(F, half, chunk, monkeypatch):
    """The codec pre-transformer's qkv GEMV (norm, linear, bias; fp32 or scaled fp16 weights)
    and each head's RoPE, ring writes and windowed attention in one launch, run by the
    program that wrote the head's last qkv tile: the same attention output and rings as the
    two ops' references, two steps in a row (the second reads what the first wrote, and the
    head counters reset themselves). chunk: the ring read in chunks (RING_CHUNK)."""
    from ttsbuild.plugins.fused_linear import norm_linear_ring_attend

    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_MERGE", False)
    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_CHUNK", chunk)
    monkeypatch.setattr("ttsbuild.plugins.ring_attention.RING_CHUNK_MIN_ROWS", 1)
    B, H, R, D, S, K = 3, 4, 20, 16, 5, 48
    x, nw, w, s, bias, pos, rows, k_ring, v_ring, inv_freq = _qkv_attend_inputs(
        B, F, H, R, D, S, K, half, 60 + F)
    ref_k, ref_v = k_ring.clone(), v_ring.clone()
    kw = dict(window=12, attn_scale=0.25, eps=1e-6, gemv_rows_f32=B * F)
    for step in range(2):
        want = norm_linear_ring_attend(x, nw, w, s, bias, pos, rows, ref_k, ref_v, inv_freq,
                                       use_triton=False, **kw)  # fmt: skip
        got = norm_linear_ring_attend(x, nw, w, s, bias, pos, rows, k_ring, v_ring, inv_freq,
                                      use_triton=True, **kw)  # fmt: skip
        assert got.shape == want.shape == (B * F, H * D)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, step
        assert ((k_ring - ref_k).abs().max() / ref_k.abs().max()).item() < 1e-5, step
        assert ((v_ring - ref_v).abs().max() / ref_v.abs().max()).item() < 1e-5, step
        pos, x = pos + F, x.flip(0).contiguous()
