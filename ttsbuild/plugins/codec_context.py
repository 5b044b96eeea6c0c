"""The codec's causal-conv input, one launch: optional SnakeBeta, left context from the rows'
slot-indexed tails, the tails advanced in place.

    snake_context(x [B, C, n], alpha [C, 1] | None, inv_beta [C, 1] | None,
                  tail [S, C, ctx] | None, rows [B], channels_last=False) -> xin [B, C, ctx + n]
    h = x + inv_beta * sin(alpha * x)^2 (fp32 math, rounded to x's dtype; h = x without alpha)
    xin[b] = cat(tail[rows[b]], h[b]);  tail[rows[b]] = xin[b, :, n:]  (the last ctx inputs)
channels_last: xin is a [B, C, ctx + n] view of a contiguous [B, ctx + n, C] tensor (strides
(L * C, 1, C)): the implicit-GEMM conv then reads its input tiles along contiguous channels
(vector loads its compiler can pipeline) instead of gathering one element per channel row.

Eager, that is SnakeBeta (~6 kernels with the casts) + index_select + cat + index_copy_; the
kernel does it in one pass over x and the tails. Rows that share a slot (padding rows on the
scratch slot) race on that slot's tail: whichever wins, nobody reads the scratch slot.

Triton: one program per (row, block of channels, block of time). The first time block holds
all of the old tail's columns (BLOCK_T >= ctx), so only its programs read the old tail or write
the new one, and every load of the old tail precedes a barrier and every store of the new one
follows it (the new tail is the old one shifted by n, read by other threads of the program).
[B, C, L] output: one time block of the whole axis, few channels (contiguous along time);
channels-last output: blocks of channels by blocks of time (CHANNELS_LAST_TILE), so each
program's rows are contiguous along channels (with the whole axis in one block, the last
stage's 1974 columns left 2 channels per program: 4-byte pieces 192 bytes apart, the kernel
at twice its [B, C, L] time on the H200, 2026-12-02).
"""

from __future__ import annotations

import os

import torch

from ttsbuild.plugins._dispatch import codec_pdl_args, triton_available, want_triton


def snake_context_reference(x, alpha, inv_beta, tail, rows, channels_last=False):
    if alpha is not None:
        xf = x.float()
        x = (xf + inv_beta * torch.sin(xf * alpha).pow(2)).to(x.dtype)
    if tail is not None and tail.shape[-1]:
        ctx = tail.shape[-1]
        x = torch.cat([tail.index_select(0, rows), x], dim=-1)  # [B, C, ctx + n]
        tail.index_copy_(0, rows, x[..., -ctx:])
    return to_channels_last(x) if channels_last else x


def context_fill_reference(xin, tail, rows):
    """xin [B, C, ctx + n] whose last n columns hold the conv's input: its first ctx columns
    set to the rows' tails, then the tails set to its last ctx columns, in place."""
    ctx = tail.shape[-1]
    xin[..., :ctx] = tail.index_select(0, rows)
    tail.index_copy_(0, rows, xin[..., -ctx:])
    return xin


def context_fill(xin, tail, rows, *, use_triton: bool | None = None):
    """snake_context's left context alone, for an input whose SnakeBeta'd samples are already
    in place (causal_conv's next_act wrote them after ctx columns of its buffer): xin
    [B, C, ctx + n] channels-last or contiguous, returned; one launch on the GPU (the first
    time block of `_snake_context_kernel`, without SnakeBeta, over xin itself: it reads only
    the columns it rewrites with the same values, and those of the new tail)."""
    B, C, L = xin.shape
    ctx = tail.shape[-1]
    if not ctx or L <= ctx:
        raise ValueError(f"context_fill needs a context and samples after it, got xin "
                         f"{tuple(xin.shape)} for a context of {ctx}")
    if not want_triton(xin, use_triton):
        return context_fill_reference(xin, tail, rows)
    import triton

    if tail.shape[1] != C or tail.dtype != xin.dtype or tail.stride(0) != C * ctx \
            or 1 not in tail.stride()[1:]:
        raise ValueError(f"tail must be [S, {C}, {ctx}] {xin.dtype} over contiguous storage, "
                         f"got {tuple(tail.shape)} {tail.dtype} strides {tail.stride()}")
    n = L - ctx
    x = xin[..., ctx:]
    block_ctx = triton.next_power_of_2(ctx)
    channels_last = xin.stride(1) == 1
    block_c = min(triton.next_power_of_2(C), CHANNELS_LAST_TILE[0] if channels_last
                  else max(1, 4096 // block_ctx))
    grid = (B, triton.cdiv(C, block_c), 1)  # the time block holding the context only
    _snake_context_kernel[grid](
        x, x, x, tail, rows, xin, C, n, ctx, x.stride(0), x.stride(1), x.stride(2),
        xin.stride(0), xin.stride(1), xin.stride(2), *tail.stride()[1:],
        HAS_SNAKE=False, HAS_TAIL=True, BLOCK_C=block_c, BLOCK_T=block_ctx,
        BLOCK_CTX=block_ctx, num_warps=4, **codec_pdl_args(xin),
    )  # fmt: skip
    return xin


def _tile(spec: str) -> tuple[int, int, int]:
    """"channels,time,warps", each a power of two (TTSBUILD_SNAKE_CL_TILE)."""
    try:
        c, t, w = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(
            f"TTSBUILD_SNAKE_CL_TILE must be 'channels,time,warps', got {spec!r}") from None
    if any(v < 1 or v & (v - 1) for v in (c, t, w)):
        raise ValueError(f"TTSBUILD_SNAKE_CL_TILE values must be powers of two, got {spec!r}")
    return c, t, w


# Channels-last tiles (channels, time, warps). Offline sm_90 compiles (Triton 3.9, fp16,
# snake + 64-column tail): 64 x 64 with 4 warps takes 255 registers and spills 256-696 bytes
# to the stack; 32 x 128 with 8 warps, the default, takes 102 registers and no stack. H200,
# 2026-12-02, the codec's one-frame step (channels-last, no other opt-in fusion): 0.996 /
# 3.672 / 11.945 ms with 64 x 64 against 0.958 / 3.451 / 11.316 with 32 x 128 at batch 1 /
# 64 / 256. TTSBUILD_SNAKE_CL_TILE="channels,time,warps" times another.
CHANNELS_LAST_TILE = _tile(os.environ.get("TTSBUILD_SNAKE_CL_TILE", "32,128,8"))


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, L]'s values as a [B, C, L] view of a contiguous [B, L, C] tensor."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def snake_context(x, alpha, inv_beta, tail, rows, *, channels_last: bool = False,
                  use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU."""
    if not want_triton(x, use_triton):
        return snake_context_reference(x, alpha, inv_beta, tail, rows, channels_last)
    return _snake_context_triton(x, alpha, inv_beta, tail, rows, channels_last)


def _snake_context_triton(x, alpha, inv_beta, tail, rows, channels_last=False):
    import triton

    B, C, n = x.shape
    ctx = 0 if tail is None else tail.shape[-1]
    if tail is not None and (tail.shape[1] != C or tail.dtype != x.dtype
                             or tail.stride(0) != C * ctx or 1 not in tail.stride()[1:]):
        raise ValueError(f"tail must be [S, {C}, ctx] {x.dtype} over contiguous [S, {C}, ctx] "
                         f"or [S, ctx, {C}] storage, got {tuple(tail.shape)} {tail.dtype} "
                         f"strides {tail.stride()}")
    if channels_last:
        out = torch.empty((B, ctx + n, C), dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty((B, C, ctx + n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_ctx = triton.next_power_of_2(max(ctx, 1))
    warps = 4
    if channels_last:  # tiles contiguous along channels, the time axis split into blocks
        cl_c, cl_t, warps = CHANNELS_LAST_TILE
        block_c = min(triton.next_power_of_2(C), cl_c)
        block_t = max(block_ctx, min(triton.next_power_of_2(ctx + n), cl_t))
    else:  # the whole time axis in one block
        block_t = triton.next_power_of_2(ctx + n)
        block_c = min(triton.next_power_of_2(C), max(1, 4096 // block_t))
    snake = alpha is not None
    grid = (B, triton.cdiv(C, block_c), triton.cdiv(ctx + n, block_t))
    _snake_context_kernel[grid](
        x, alpha if snake else x, inv_beta if snake else x, tail if ctx else x,
        rows if ctx else x, out, C, n, ctx, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *(tail.stride()[1:] if ctx else (1, 1)),
        HAS_SNAKE=snake, HAS_TAIL=ctx > 0, BLOCK_C=block_c, BLOCK_T=block_t,
        BLOCK_CTX=block_ctx, num_warps=warps, **codec_pdl_args(x),
    )  # fmt: skip
    return out


if triton_available():  # the kernels exist only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    from ttsbuild.plugins._tl._math import pdl_prologue, sin_f32

    @triton.jit
    def snake_params(alpha_ptr, inv_beta_ptr, offs_c, c_mask, HAS_SNAKE: tl.constexpr):
        """(alpha, inv_beta) fp32 [BLOCK_C] of these channels; zeros without a snake."""
        alpha = tl.zeros(offs_c.shape, dtype=tl.float32)
        inv_beta = tl.zeros(offs_c.shape, dtype=tl.float32)
        if HAS_SNAKE:
            alpha = tl.load(alpha_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
            inv_beta = tl.load(inv_beta_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        return alpha, inv_beta

    @triton.jit
    def _snake(v, alpha, inv_beta, HAS_SNAKE: tl.constexpr):
        if HAS_SNAKE:
            xf = v.to(tl.float32)
            s = sin_f32(xf * alpha[:, None])
            v = (xf + inv_beta[:, None] * (s * s)).to(v.dtype)
        return v

    @triton.jit
    def _snake_context_kernel(
        x_ptr, alpha_ptr, inv_beta_ptr, tail_ptr, rows_ptr, out_ptr, C, n, ctx,
        stride_xb, stride_xc, stride_xt, stride_ob, stride_oc, stride_ot, stride_tc, stride_tt,
        HAS_SNAKE: tl.constexpr, HAS_TAIL: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CTX: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        b = tl.program_id(0).to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_mask = offs_c < C
        alpha, inv_beta = snake_params(alpha_ptr, inv_beta_ptr, offs_c, c_mask, HAS_SNAKE)
        x_row = x_ptr + b * stride_xb + offs_c[:, None] * stride_xc
        # xin[t] for t < ctx + n: the old tail, then snake(x)
        in_x = (t >= ctx) & (t < ctx + n)
        h = tl.load(x_row + (t - ctx)[None, :] * stride_xt, mask=c_mask[:, None] & in_x[None, :],
                    other=0.0)
        xin = _snake(h, alpha, inv_beta, HAS_SNAKE)
        if HAS_TAIL:
            slot = tl.load(rows_ptr + b).to(tl.int64)
            tail_row = tail_ptr + slot * C * ctx + offs_c[:, None] * stride_tc
            old = tl.load(tail_row + t[None, :] * stride_tt,
                          mask=c_mask[:, None] & (t < ctx)[None, :], other=0.0)
            xin = tl.where((t < ctx)[None, :], old, xin)
            if tl.program_id(2) == 0:  # the block that read the old tail (BLOCK_T >= ctx)
                # the new tail: xin[n + i] for i < ctx, from the old tail or from x (a block of
                # BLOCK_CTX columns: the snake is not evaluated again over the whole time axis)
                i = tl.arange(0, BLOCK_CTX)
                src = n + i
                from_tail = (src < ctx) & (i < ctx)
                from_x = (src >= ctx) & (i < ctx)
                shifted = tl.load(tail_row + src[None, :] * stride_tt,
                                  mask=c_mask[:, None] & from_tail[None, :], other=0.0)
                hx = tl.load(x_row + (src - ctx)[None, :] * stride_xt,
                             mask=c_mask[:, None] & from_x[None, :], other=0.0)
                hx = _snake(hx, alpha, inv_beta, HAS_SNAKE)
                new_tail = tl.where(from_tail[None, :], shifted, hx)
                tl.debug_barrier()  # every thread has read the old tail before any writes it
                tl.store(tail_row + i[None, :] * stride_tt, new_tail,
                         mask=c_mask[:, None] & (i < ctx)[None, :])
        dst = out_ptr + b * stride_ob + offs_c[:, None] * stride_oc + t[None, :] * stride_ot
        tl.store(dst, xin, mask=c_mask[:, None] & (t < ctx + n)[None, :])

