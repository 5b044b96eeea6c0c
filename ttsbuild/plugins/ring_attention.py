"""The codec pre-transformer's attention over its per-slot key/value rings, one launch.

    ring_attention(q [B, n, H, D], k_ring [S, Hkv, R, D], v_ring [S, Hkv, R, D], rows [B],
                   mask [B, 1, n, R] (additive fp32: 0 or -inf), scale) -> y [B, n, H * D]
    y[b, i, h] = softmax_r(scale * q[b, i, h] . k_ring[rows[b], h // (H / Hkv), r]
                           + mask[b, 0, i, r]) @ v_ring[rows[b], h // (H / Hkv)]

A codec step has n = 1..max_chunk query frames per stream against a ring of R ~ 75 frames
(`runtime.codec_engine` writes the new keys into the ring first and builds the window mask
once per step). Eager, that is two index_selects of the rows' rings, two matmuls, the mask
add, the softmax, a cast and the [B, H, n, D] -> [B, n, H * D] copy: ~7 kernels per layer.
The kernel: one program per (row, head) holds the head's keys and values ([R, D], R padded to
a power of two) and loops over the n queries; fp32 math whatever the input dtype (the output
takes q's dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ttsbuild.plugins._dispatch import triton_available, want_triton


def ring_attention_reference(q, k_ring, v_ring, rows, mask, scale,
                             mm_in: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
    """The eager ops. mm_in: applied to the matmul inputs (the codec engine's TF32 emulation
    on CPU)."""
    B, n, H, D = q.shape
    keys, values = k_ring.index_select(0, rows), v_ring.index_select(0, rows)  # [B,Hkv,R,D]
    if keys.shape[1] != H:
        keys = keys.repeat_interleave(H // keys.shape[1], dim=1)
        values = values.repeat_interleave(H // values.shape[1], dim=1)
    qh = q.transpose(1, 2)  # [B, H, n, D]
    scores = mm_in(qh) @ mm_in(keys).transpose(-1, -2) * scale + mask
    y = torch.softmax(scores, dim=-1).to(q.dtype) @ mm_in(values)  # [B, H, n, D]
    return y.transpose(1, 2).reshape(B, n, H * D)


def ring_attention(q, k_ring, v_ring, rows, mask, scale, *, use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU."""
    if not want_triton(q, use_triton):
        return ring_attention_reference(q, k_ring, v_ring, rows, mask, scale)
    return _ring_attention_triton(q, k_ring, v_ring, rows, mask, scale)


def _ring_attention_triton(q, k_ring, v_ring, rows, mask, scale):
    import triton

    B, n, H, D = q.shape
    S, Hkv, R, Dk = k_ring.shape
    if Dk != D or H % Hkv or v_ring.shape != k_ring.shape:
        raise ValueError(f"rings must be [S, Hkv, R, {D}] with H % Hkv == 0, got "
                         f"{tuple(k_ring.shape)} / {tuple(v_ring.shape)} for {H} heads")
    if not (k_ring.is_contiguous() and v_ring.is_contiguous()):
        raise ValueError("the rings must be contiguous")
    if mask.shape != (B, 1, n, R) or mask.dtype != torch.float32 or not mask.is_contiguous():
        raise ValueError(f"mask must be contiguous fp32 [{B}, 1, {n}, {R}]")
    out = torch.empty((B, n, H * D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    _ring_attention_kernel[(B, H)](
        q, k_ring, v_ring, rows, mask, out, n, R, float(scale),
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        H=H, GROUP=H // Hkv, D=D, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )  # fmt: skip
    return out


if triton_available():  # the kernel exists only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    @triton.jit
    def _ring_attention_kernel(
        q_ptr, k_ptr, v_ptr, rows_ptr, mask_ptr, out_ptr, N, R, scale,
        sqb, sqn, sqh, sqd,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        slot = tl.load(rows_ptr + b).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        r_mask, d_mask = r < R, d < D
        kv = (slot * (H // GROUP) + h // GROUP) * R * D + r[:, None] * D + d[None, :]
        kv_mask = r_mask[:, None] & d_mask[None, :]
        keys = tl.load(k_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)  # [R, D]
        values = tl.load(v_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)
        for i in range(0, N):
            qi = tl.load(q_ptr + b * sqb + i * sqn + h * sqh + d * sqd, mask=d_mask,
                         other=0.0).to(tl.float32)  # [D]
            bias = tl.load(mask_ptr + (b * N + i) * R + r, mask=r_mask, other=float("-inf"))
            s = tl.sum(keys * qi[None, :], axis=1) * scale + bias  # [R]
            p = tl.exp(s - tl.max(s, axis=0))
            p = p / tl.sum(p, axis=0)
            y = tl.sum(p[:, None] * values, axis=0)  # [D]
            tl.store(out_ptr + (b * N + i) * (H * D) + h * D + d,
                     y.to(out_ptr.dtype.element_ty), mask=d_mask)
