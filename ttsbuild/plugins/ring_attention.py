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

    ring_attention_rope(qkv [B, n, H + 2 * Hkv, D], pos [B], rows [B], k_ring, v_ring,
                        inv_freq [D / 2], window, scale) -> y [B, n, H * D]
the whole attention step of a layer in one launch (H == Hkv, as the 12 Hz codec has):
query frames q = pos + i; RoPE (angles q * inv_freq, rotate-half layout) of the queries and
new keys; the new keys and values written into the rows' rings at q % R; the window mask
(ring index r holds frame last - ((last - r) mod R), last = pos + n - 1, visible iff
q - window < frame <= q and frame >= 0) made in the kernel. Eager that is ~20 launches of
mask and cos/sin set-up per step plus RoPE (~5) and two ring scatters per layer; each program
writes its own head's new entries, then (after a barrier) reads the ring, so no program reads
what another writes (rows that share the scratch slot race there, and nobody reads it). From
RING_CHUNK_MIN_ROWS rows the ring is read RING_CHUNK entries at a time with an online
softmax (running max, rescaled sum and output), not held whole in registers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ttsbuild.model.codec import apply_rope, window_mask
from ttsbuild.plugins._dispatch import codec_pdl_args, triton_available, want_triton


def ring_attention_reference(q, k_ring, v_ring, rows, mask, scale,
                             mm_in: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
    """The eager ops. mm_in: applied to the matmul inputs (the codec engine's TF32 emulation
    on CPU)."""
    B, n, H, D = q.shape
    # [B, Hkv, R, D], in q's dtype (half-precision rings beside fp32 queries: the rounded
    # values the ring holds, in fp32 math)
    keys = k_ring.index_select(0, rows).to(q.dtype)
    values = v_ring.index_select(0, rows).to(q.dtype)
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
        BLOCK_D=triton.next_power_of_2(D), num_warps=4, **codec_pdl_args(q),
    )  # fmt: skip
    return out


def ring_step_inputs(pos, n: int, ring_frames, window: int, inv_freq, dtype):
    """What a step's attention layers share, eager: (mask [B, 1, n, R] additive fp32,
    cos, sin [B, n, 1, D] in `dtype`, ring_idx [B, n]) for query frames pos + i over a ring
    whose index r holds frame last - ((last - r) mod R). ring_frames: arange(R) on the
    device (the codec engine keeps one)."""
    R = ring_frames.shape[0]
    q_pos = pos[:, None] + torch.arange(n, device=pos.device)  # [B, n]
    last = q_pos[:, -1:]
    k_pos = last - (last - ring_frames) % R  # [B, R] frame at each index
    visible = window_mask(q_pos, k_pos, window)  # [B, 1, n, R]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=pos.device).masked_fill_(
        ~visible, float("-inf"))  # additive, fp32 scores
    freqs = q_pos.float()[..., None] * inv_freq  # [B, n, D / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]  # [B, n, 1, D]
    return mask, emb.cos().to(dtype), emb.sin().to(dtype), q_pos % R


# ring_attention_rope's kernel with the ring read before its new frames are written and
# those merged in registers (TTSBUILD_RING_MERGE=1), instead of written, a block barrier and
# the whole ring read back: one dependent global round trip fewer per layer; same results
# (interpreter tests); off until timed on the GPU (gpu_session codec step, CODEC_RING_AB=1).
RING_MERGE = os.environ.get("TTSBUILD_RING_MERGE", "0") == "1"
# ring_attention_rope's read of the ring in chunks of RING_CHUNK entries with an online
# softmax, for steps of at least RING_CHUNK_MIN_ROWS rows; else the whole ring (padded to a
# power of two) in registers at once. Whole, a program of 4 warps takes 204 registers a
# thread (offline sm_90 compile; chunks of 32: 90): two programs an SM, so 64 rows x 16 heads
# = 1024 programs run in four waves. The served codec step on an H100, one process a side
# (call1-h100 of benchmarks/codec/2026-12-06-codec-three-kernels): batch 64 2.664 -> 2.580 ms
# with chunks of 32, batch 1 (16 programs, one wave either way) 0.789 -> 0.794; on an H200 the
# 8 launches at 64 rows took 0.179 ms chunked against 0.285 whole (profiles 2026-12-06 and
# 2026-12-04). TTSBUILD_RING_CHUNK=0: never chunked.
RING_CHUNK = int(os.environ.get("TTSBUILD_RING_CHUNK", "32"))
RING_CHUNK_MIN_ROWS = 16  # 16 rows x 16 heads: one wave of the whole-ring programs on ~132 SMs


def ring_attention_rope_reference(qkv, pos, rows, k_ring, v_ring, inv_freq, window, scale):
    """The eager ops (the codec engine's unfused layer): see the module docstring."""
    B, n, heads, D = qkv.shape
    Hkv, R = k_ring.shape[1], k_ring.shape[2]
    H = heads - 2 * Hkv
    mask, cos, sin, ring_idx = ring_step_inputs(
        pos, n, torch.arange(R, device=qkv.device), window, inv_freq, qkv.dtype)
    qk = apply_rope(qkv[:, :, : H + Hkv], cos, sin)
    q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
    k_ring[rows[:, None], :, ring_idx] = k.to(k_ring.dtype)
    v_ring[rows[:, None], :, ring_idx] = v.to(v_ring.dtype)
    return ring_attention_reference(q, k_ring, v_ring, rows, mask, scale)


def ring_attention_rope(qkv, pos, rows, k_ring, v_ring, inv_freq, window: int, scale: float, *,
                        use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU. Updates the rows' rings in place."""
    B, n, heads, D = qkv.shape
    S, Hkv, R, Dk = k_ring.shape
    if heads != 3 * Hkv or Dk != D or D % 2 or v_ring.shape != k_ring.shape:
        raise ValueError(f"ring_attention_rope needs qkv [B, n, 3 * Hkv, D] (as many query as "
                         f"key/value heads) and rings [S, Hkv, R, D]; got qkv "
                         f"{tuple(qkv.shape)}, rings {tuple(k_ring.shape)}")
    if inv_freq.shape != (D // 2,):
        raise ValueError(f"inv_freq must be [{D // 2}], got {tuple(inv_freq.shape)}")
    if not want_triton(qkv, use_triton):
        return ring_attention_rope_reference(qkv, pos, rows, k_ring, v_ring, inv_freq, window,
                                             scale)  # fmt: skip
    import triton

    if not (k_ring.is_contiguous() and v_ring.is_contiguous()) or D & (D - 1):
        raise ValueError(f"the kernel needs contiguous rings and a power-of-two head size, got "
                         f"{D}")
    out = torch.empty((B, n, Hkv * D), dtype=qkv.dtype, device=qkv.device)
    if out.numel() == 0:
        return out
    chunk = RING_CHUNK if B >= RING_CHUNK_MIN_ROWS else 0
    _ring_attention_rope_kernel[(B, Hkv)](
        qkv, pos, rows, k_ring, v_ring, inv_freq, out, n, R, int(window), float(scale),
        qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3),
        H=Hkv, D=D, BLOCK_R=triton.next_power_of_2(R), MERGE=RING_MERGE and not chunk,
        CHUNK=chunk, num_warps=4,
        **codec_pdl_args(qkv),
    )  # fmt: skip
    return out


if triton_available():  # the kernel exists only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    from ttsbuild.plugins._tl._math import cos_f32, pdl_prologue, sin_f32

    @triton.jit
    def _ring_attention_kernel(
        q_ptr, k_ptr, v_ptr, rows_ptr, mask_ptr, out_ptr, N, R, scale,
        sqb, sqn, sqh, sqd,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
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

    @triton.jit
    def _load_qkv(ptr, CG: tl.constexpr):
        """A load of qkv: through L2 (.cg) where other programs of the launch wrote it."""
        if CG:
            x = tl.load(ptr, cache_modifier=".cg")
        else:
            x = tl.load(ptr)
        return x

    @triton.jit
    def _rope(x_ptr, d, partner, sign, inv, qp, CG: tl.constexpr = False):
        """RoPE of one head vector at frame qp (rotate-half layout), fp32."""
        ang = qp.to(tl.float32) * inv
        x = _load_qkv(x_ptr + d, CG).to(tl.float32)
        xp = _load_qkv(x_ptr + partner, CG).to(tl.float32)
        return x * cos_f32(ang) + sign * xp * sin_f32(ang)

    @triton.jit
    def _ring_attention_rope_kernel(
        qkv_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, inv_freq_ptr, out_ptr, N, R, W, scale,
        sb, sn, sh, sd,
        H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, MERGE: tl.constexpr,
        CHUNK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        ring_rope_item(
            qkv_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, inv_freq_ptr, out_ptr,
            tl.program_id(0).to(tl.int64), tl.program_id(1), N, R, W, scale, sb, sn, sh, sd,
            H, D, BLOCK_R, MERGE, CHUNK, False,
        )  # fmt: skip

    @triton.jit
    def ring_rope_item(
        qkv_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, inv_freq_ptr, out_ptr, b, h, N, R, W, scale,
        sb, sn, sh, sd,
        H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, MERGE: tl.constexpr,
        CHUNK: tl.constexpr, CG: tl.constexpr,
    ):  # fmt: skip
        """Row b's head h of `ring_attention_rope` (b int64): its new keys and values into
        the row's ring, then its N query frames over the window. CG: qkv is read through L2
        (written by other programs of the same launch: plugins.fused_linear
        norm_linear_ring_attend)."""
        slot = tl.load(rows_ptr + b).to(tl.int64)
        p0 = tl.load(pos_ptr + b)
        d = tl.arange(0, D)
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        inv = tl.load(inv_freq_ptr + d % (D // 2)).to(tl.float32)
        row = qkv_ptr + b * sb
        ring = (slot * H + h) * R * D
        r = tl.arange(0, BLOCK_R)
        r_mask = r < R
        kv = ring + r[:, None] * D + d[None, :]
        if MERGE:  # the ring's old contents now, the new frames merged in registers below
            keys = tl.load(k_ptr + kv, mask=r_mask[:, None], other=0.0).to(tl.float32)
            values = tl.load(v_ptr + kv, mask=r_mask[:, None], other=0.0).to(tl.float32)
        # 1. this head's new keys (RoPE) and values into the row's ring
        for i in range(0, N):
            qp = p0 + i
            k = _rope(row + i * sn + (H + h) * sh, d * sd, partner * sd, sign, inv, qp, CG)
            v = _load_qkv(row + i * sn + (2 * H + h) * sh + d * sd, CG)
            at = ring + (qp % R) * D + d
            k = k.to(k_ptr.dtype.element_ty)
            v = v.to(v_ptr.dtype.element_ty)
            tl.store(k_ptr + at, k)
            tl.store(v_ptr + at, v)
            if MERGE:  # as stored (rounded to the ring's dtype), in place of what was loaded
                hit = (r == qp % R)[:, None]
                keys = tl.where(hit, k.to(tl.float32)[None, :], keys)
                values = tl.where(hit, v.to(tl.float32)[None, :], values)
        last = p0 + N - 1
        if CHUNK:  # 2. (chunked) each query frame over the ring, CHUNK entries at a time
            tl.debug_barrier()  # the writes above precede the reads below (one program, head)
            for i in range(0, N):
                qp = p0 + i
                q = _rope(row + i * sn + h * sh, d * sd, partner * sd, sign, inv, qp, CG)
                m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
                den = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
                acc = tl.zeros([D], tl.float32)
                for r0 in range(0, R, CHUNK):
                    rc = r0 + tl.arange(0, CHUNK)
                    rc_mask = rc < R
                    at = ring + rc[:, None] * D + d[None, :]
                    keys = tl.load(k_ptr + at, mask=rc_mask[:, None], other=0.0).to(tl.float32)
                    vals = tl.load(v_ptr + at, mask=rc_mask[:, None], other=0.0).to(tl.float32)
                    back = (last - rc) % R
                    back = tl.where(back < 0, back + R, back)
                    dist = qp - (last - back)
                    visible = rc_mask & (dist >= 0) & (dist < W) & (last - back >= 0)
                    sc = tl.where(visible, tl.sum(keys * q[None, :], axis=1) * scale,
                                  float("-inf"))
                    m_new = tl.maximum(m, tl.max(sc, axis=0))
                    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
                    p = tl.exp(sc - base)
                    rescale = tl.exp(m - base)
                    den = den * rescale + tl.sum(p, axis=0)
                    acc = acc * rescale + tl.sum(p[:, None] * vals, axis=0)
                    m = m_new
                tl.store(out_ptr + (b * N + i) * (H * D) + h * D + d,
                         (acc / den).to(out_ptr.dtype.element_ty))  # den > 0: frame qp is seen
        else:
            if not MERGE:
                tl.debug_barrier()  # the writes above precede the reads below (one program, head)
                keys = tl.load(k_ptr + kv, mask=r_mask[:, None], other=0.0).to(tl.float32)
                values = tl.load(v_ptr + kv, mask=r_mask[:, None], other=0.0).to(tl.float32)
            # 2. attention of each query frame over the ring's window
            back = (last - r) % R
            back = tl.where(back < 0, back + R, back)  # floor mod (C's % truncates)
            k_pos = last - back  # [R]: the frame at ring index r
            for i in range(0, N):
                qp = p0 + i
                q = _rope(row + i * sn + h * sh, d * sd, partner * sd, sign, inv, qp, CG)
                dist = qp - k_pos
                visible = r_mask & (dist >= 0) & (dist < W) & (k_pos >= 0)
                s = tl.sum(keys * q[None, :], axis=1) * scale
                s = tl.where(visible, s, float("-inf"))
                p = tl.exp(s - tl.max(s, axis=0))
                p = p / tl.sum(p, axis=0)
                y = tl.sum(p[:, None] * values, axis=0)  # [D]
                tl.store(out_ptr + (b * N + i) * (H * D) + h * D + d,
                         y.to(out_ptr.dtype.element_ty))
