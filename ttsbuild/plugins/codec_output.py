"""The codec's output stage in one launch: SnakeBeta, left context, the conv to one channel,
clamp.

    codec_output(x [B, C, n], w [k, C, 1], bias [1], alpha [C, 1], inv_beta [C, 1],
                 tail [S, C, (k - 1) * d] fp32, rows [B], dilation d) -> pcm [B, n] fp32
    xin[b] = cat(tail[rows[b]], snake(x[b]))     (snake in fp32 math of x's values)
    pcm[b, t] = clamp(bias + sum_{j, c} w[j, c] * xin[b, c, t + j * d], -1, 1)
    tail[rows[b]] = xin[b, :, n:]                 (the last (k - 1) * d inputs)

The stage is strict fp32 (`codec_engine.DEFAULT_FP32_STAGES`): the kernel reads x in its own
dtype, evaluates SnakeBeta and accumulates in fp32 without tensor cores, as the eager path
does after its cast. Eager that path is a cast of x to fp32, the snake + context kernel over
the fp32 copy, an im2col copy of k times its size and a GEMV with one output column; at 64
rows of a one-frame step (96 channels, 1920 samples) that is ~0.8 GB of memory traffic
where this kernel reads x once (~24 MB in fp16). Each output block recomputes the snake of
its k taps' inputs (k = 7: 7 sines per input, ~30 us of arithmetic at 64 rows on an H200,
against a bandwidth floor of ~10 us).

    output_from_taps(z [B, n, 16] fp32, k, bias [1], ztail [S, (k - 1) * d, 16] fp32 | None,
                     rows [B], dilation d) -> pcm [B, n] fp32
    the stage's last part where the conv before it computed its taps in its epilogue
    (causal_conv.conv_output_taps: z[b, i, j] = sum_c w[j, c] * snake(x)[b, c, i]):
    zin[b] = cat(ztail[rows[b]], z[b]) along time, pcm[b, t] = clamp(bias + sum_j
    zin[b, t + j * d, j], -1, 1), ztail[rows[b]] = zin[b, n:] (the last (k - 1) * d inputs'
    taps: the slot's state in place of their SnakeBeta'd channels). The same sums as
    codec_output's in another order.

Triton: one program per (row, block of output samples), a loop over channel blocks and taps.
The first block (BLOCK_T >= the context) is the only one that reads the old tail; after its
loop it writes the new one (every read of the old tail precedes a barrier, every write
follows it, channel block by channel block).
"""

from __future__ import annotations

import os

import torch

from ttsbuild.plugins._dispatch import codec_pdl_args, triton_available, want_triton
from ttsbuild.plugins.codec_context import snake_context_reference

# Small steps' output tiles halved until the grid holds two programs per SM (`_spread`): a
# one-frame step of one row is otherwise 15 programs of 128 samples on 132 SMs, each walking
# every channel and tap (68.7 us at batch 1 in the 2026-12-03 profile, 9 % of the codec
# step). The same sums in the same order per sample. On by default since timed on the H200
# (codec step at batch 1 0.77 -> 0.75 ms, 2026-12-04); TTSBUILD_CODEC_OUTPUT_SPREAD=0 turns it off.
SPREAD = os.environ.get("TTSBUILD_CODEC_OUTPUT_SPREAD", "1") != "0"
# Every tile as taps first (`_codec_output_taps_kernel`): z[col, j] = sum_c xin[c, col] *
# w[j, c] over the program's input window, one [window, C] x [C, 16] product of fp32 FMAs
# (taps padded to the product's minimum of 16), each input's SnakeBeta once; then
# pcm[t] = sum_j z[t + j d, j], shifted reads of a [window, 16] scratch (8.7 KB a program
# for 128 samples, where the window path's [C, window] was 52 KB). Timed on, one process a side
# (benchmarks/codec/2026-12-06-codec-three-kernels): the served codec step on an H100 at
# batch 1 / 64 0.789 / 2.664 -> 0.780 / 2.661 ms; on an H200 (two rounds) at 1 / 64 / 256
# 0.748 / 2.391 / 7.155 -> 0.742 / 2.386 / 7.127. Its launch still takes 156 us at 64 rows
# there, as the kernel before it did with 7 SnakeBetas an input: not sine-bound.
# It replaced the window path (2026-12-04: the spread tiles' input window, SnakeBeta'd once,
# into a [C, window] scratch, then the taps as shifted reads of it; batch 1 0.825 -> 0.796 ms
# on the H200), which it beat at batch 1 on both cards. TTSBUILD_CODEC_OUTPUT_TAPS=0 gives
# the one-phase kernel (`_codec_output_kernel`, each tap recomputing its inputs' SnakeBeta).
TAPS_FIRST = os.environ.get("TTSBUILD_CODEC_OUTPUT_TAPS", "1") == "1"
# TTSBUILD_CODEC_OUTPUT_TAPS_MAX_T=N caps its tiles at N samples (more, smaller programs at
# large batches; off: 128). Timed only together with the channel loop unrolled (the channel
# count a compile-time constant), which lost on an H100 (batch 1 / 64 / 256 0.659 / 2.479 /
# 7.383 -> 0.669 / 2.567 / 7.754 ms, benchmarks/codec/2026-12-06-h100-flat-k-epilogue) and was
# removed; the cap alone is not yet timed.
TAPS_MAX_T = int(os.environ.get("TTSBUILD_CODEC_OUTPUT_TAPS_MAX_T", "128"))


def _spread(B: int, n: int, block_ctx: int, block_t: int, sms: int) -> tuple[int, int]:
    """(samples per program, warps): block_t halved, not below 16 or the context's block,
    until B rows x ceil(n / block_t) programs fill two per SM; fewer warps for narrower
    tiles (a [16, block_t] tile per channel block and tap)."""
    floor = max(block_ctx, 16)
    while block_t > floor and B * -(-n // block_t) < 2 * sms:
        block_t //= 2
    return block_t, 4 if block_t >= 64 else 2 if block_t >= 32 else 1


def codec_output_reference(x, w, bias, alpha, inv_beta, tail, rows, dilation: int = 1):
    """The eager output stage (see the module docstring); updates `tail` in place. The conv
    sums its taps in float64 (on CUDA an fp32 conv1d would take TF32, cuDNN's default)."""
    xin = snake_context_reference(x.float(), alpha, inv_beta, tail, rows)  # [B, C, ctx + n]
    n = xin.shape[-1] - (w.shape[0] - 1) * dilation
    wd = w.double()[..., 0]  # [k, C]
    y = bias.double() + sum(
        torch.einsum("c,bct->bt", wd[j], xin[:, :, j * dilation: j * dilation + n].double())
        for j in range(w.shape[0])
    )  # fmt: skip
    return y.clamp(-1.0, 1.0).float()


def codec_output(x, w, bias, alpha, inv_beta, tail, rows, dilation: int = 1, *,
                 use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU."""
    k, C, cout = w.shape
    ctx = (k - 1) * dilation
    if cout != 1 or x.shape[1] != C or bias is None or bias.numel() != 1:
        raise ValueError(f"codec_output is the conv to one channel with a bias: w [k, {C}, 1], "
                         f"got w {tuple(w.shape)}, x {tuple(x.shape)}")
    if ctx and (tail is None or tail.shape[1:] != (C, ctx) or tail.dtype != torch.float32
                or not tail.is_contiguous()):
        raise ValueError(f"tail must be contiguous fp32 [S, {C}, {ctx}]")
    if not want_triton(x, use_triton):
        return codec_output_reference(x, w, bias, alpha, inv_beta, tail if ctx else None, rows,
                                      dilation)
    return _codec_output_triton(x, w, bias, alpha, inv_beta, tail, rows, dilation)


def output_from_taps_reference(z, k, bias, ztail, rows, dilation: int = 1):
    """The eager output_from_taps (see the module docstring); updates `ztail` in place."""
    B, n, _ = z.shape
    ctx = (k - 1) * dilation
    zin = z.float()
    if ctx:
        zin = torch.cat([ztail.index_select(0, rows), zin], dim=1)  # [B, ctx + n, 16]
        ztail.index_copy_(0, rows, zin[:, n:])
    y = bias.double() + sum(zin[:, j * dilation: j * dilation + n, j].double() for j in range(k))
    return y.clamp(-1.0, 1.0).float()


def output_from_taps(z, k: int, bias, ztail, rows, dilation: int = 1, *,
                     use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU."""
    B, n, width = z.shape
    ctx = (k - 1) * dilation
    if not 1 <= k <= width or z.dtype != torch.float32 or bias is None or bias.numel() != 1:
        raise ValueError(f"output_from_taps: z fp32 [B, n, >= {k}] and a bias, got "
                         f"{tuple(z.shape)} {z.dtype}")
    if ctx and (ztail is None or ztail.shape[1:] != (ctx, width)
                or ztail.dtype != torch.float32 or not ztail.is_contiguous()):
        raise ValueError(f"ztail must be contiguous fp32 [S, {ctx}, {width}]")
    if not want_triton(z, use_triton):
        return output_from_taps_reference(z, k, bias, ztail if ctx else None, rows, dilation)
    import triton

    out = torch.empty((B, n), dtype=torch.float32, device=z.device)
    if out.numel() == 0:
        return out
    block_ctx = triton.next_power_of_2(max(ctx, 1))
    block_t = max(block_ctx, min(256, triton.next_power_of_2(n)))
    _output_from_taps_kernel[(B, triton.cdiv(n, block_t))](
        z, bias, ztail if ctx else z, rows, out, n, ctx, dilation, z.stride(0), z.stride(1),
        z.stride(2), K=k, WIDTH=width, HAS_TAIL=ctx > 0, BLOCK_T=block_t,
        BLOCK_CTX=block_ctx, num_warps=4 if block_t >= 128 else 2, **codec_pdl_args(z),
    )  # fmt: skip
    return out


def _codec_output_triton(x, w, bias, alpha, inv_beta, tail, rows, dilation):
    import triton

    B, C, n = x.shape
    k = w.shape[0]
    ctx = (k - 1) * dilation
    out = torch.empty((B, n), dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    block_ctx = triton.next_power_of_2(max(ctx, 1))
    # 128 x 16 tiles and a tap loop that is not unrolled: 144 registers, no stack, where
    # 256 x 32 unrolled took 128 registers and 7.5 KB of stack (offline sm_90 compile)
    block_t = max(block_ctx, min(128, triton.next_power_of_2(n)))
    block_c = min(16, triton.next_power_of_2(C))
    warps = 4
    if SPREAD:  # SMs as the linears count them (132, the H200's, off CUDA)
        from ttsbuild.plugins._tl.fp8_linear import _num_sms

        block_t, warps = _spread(B, n, block_ctx, block_t, _num_sms(x.device))
    snake = alpha is not None
    if TAPS_FIRST:
        block_t = max(16, block_ctx, min(block_t, TAPS_MAX_T))
        blocks = triton.cdiv(n, block_t)
        # 16-channel K steps; warps by tile: 72-147 registers a thread, no spills (offline
        # sm_90 compile, 16-128 samples; 32-channel steps or fewer warps spill or take 160+)
        block_w = max(16, block_ctx)  # the product's minimum width
        win = block_t + block_w
        scratch = torch.empty((B * blocks, win, 16), dtype=torch.float32, device=x.device)
        _codec_output_taps_kernel[(B, blocks)](
            x, w, bias, alpha if snake else x, inv_beta if snake else x, tail if ctx else x,
            rows, out, scratch, C, n, ctx, dilation, x.stride(0), x.stride(1), x.stride(2),
            K=k, HAS_SNAKE=snake, HAS_TAIL=ctx > 0, BLOCK_C=16, BLOCK_T=block_t,
            BLOCK_W=block_w, BLOCK_CTX=block_ctx, WIN=win,
            num_warps=8 if block_t >= 128 else 4 if block_t >= 32 else 2,
            **codec_pdl_args(x),
        )  # fmt: skip
        return out
    _codec_output_kernel[(B, triton.cdiv(n, block_t))](
        x, w, bias, alpha if snake else x, inv_beta if snake else x, tail if ctx else x,
        rows, out, C, n, ctx, dilation, x.stride(0), x.stride(1), x.stride(2),
        K=k, HAS_SNAKE=snake, HAS_TAIL=ctx > 0, BLOCK_C=block_c, BLOCK_T=block_t,
        BLOCK_CTX=block_ctx, num_warps=warps, **codec_pdl_args(x),
    )  # fmt: skip
    return out


if triton_available():  # the kernel exists only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    from ttsbuild.plugins._tl._math import pdl_prologue, sin_f32
    from ttsbuild.plugins.codec_context import snake_params

    @triton.jit
    def _snake_f32(v, al, ib, HAS_SNAKE: tl.constexpr):
        v = v.to(tl.float32)
        if HAS_SNAKE:
            s = sin_f32(v * al[:, None])
            v = v + ib[:, None] * (s * s)
        return v

    @triton.jit
    def _row_block(rows_ptr, n, BLOCK_T: tl.constexpr):
        """A (row, block of BLOCK_T samples) program's row b, whether it is the row's first
        block, its samples t and their mask, and the row's slot."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        return b, tl.program_id(1) == 0, t, t < n, tl.load(rows_ptr + b).to(tl.int64)

    @triton.jit
    def _codec_output_kernel(
        x_ptr, w_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, tail_ptr, rows_ptr, out_ptr,
        C, n, ctx, DIL, sxb, sxc, sxt,
        K: tl.constexpr, HAS_SNAKE: tl.constexpr, HAS_TAIL: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CTX: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        b, first, t, t_mask, slot = _row_block(rows_ptr, n, BLOCK_T)
        x_row = x_ptr + b * sxb
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < C
            al, ib = snake_params(alpha_ptr, inv_beta_ptr, c, c_mask, HAS_SNAKE)
            for j in range(K):  # not unrolled (registers, above)
                i = t + j * DIL  # xin column: the tail below ctx, snake(x) from there on
                from_x = t_mask & (i >= ctx)
                v = tl.load(x_row + c[:, None] * sxc + (i - ctx)[None, :] * sxt,
                            mask=c_mask[:, None] & from_x[None, :], other=0.0)
                v = _snake_f32(v, al, ib, HAS_SNAKE)
                if HAS_TAIL:
                    from_tail = t_mask & (i < ctx)
                    old = tl.load(tail_ptr + (slot * C + c[:, None]) * ctx + i[None, :],
                                  mask=c_mask[:, None] & from_tail[None, :], other=0.0)
                    v = tl.where(from_tail[None, :], old, v)
                wj = tl.load(w_ptr + j * C + c, mask=c_mask, other=0.0).to(tl.float32)
                acc += tl.sum(wj[:, None] * v, axis=0)
        y = acc + tl.load(bias_ptr).to(tl.float32)
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
        tl.store(out_ptr + b * n + t, y, mask=t_mask)
        if HAS_TAIL:
            if first:  # the block that read the old tail (BLOCK_T >= ctx): the new tail
                _new_tail(x_row, alpha_ptr, inv_beta_ptr, tail_ptr, slot, C, n, ctx, sxc, sxt,
                          HAS_SNAKE, BLOCK_C, BLOCK_CTX)  # fmt: skip

    @triton.jit
    def _xin_piece(x_row, tail_ptr, slot, c, c_mask, al, ib, i, C, n, ctx, sxc, sxt,
                   HAS_SNAKE: tl.constexpr, HAS_TAIL: tl.constexpr):  # fmt: skip
        """xin columns i of channels c as fp32 [len(i), BLOCK_C] (time down, channels across,
        as channels-last storage holds them): the old tail below ctx, SnakeBeta of x from
        there to n + ctx, zeros past it and on masked channels."""
        from_x = (i >= ctx) & (i < n + ctx)
        v = tl.load(x_row + (i - ctx)[:, None] * sxt + c[None, :] * sxc,
                    mask=from_x[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        if HAS_SNAKE:  # 0 where masked: the snake of 0 is 0
            s = sin_f32(v * al[None, :])
            v = v + ib[None, :] * (s * s)
        if HAS_TAIL:
            from_tail = i < ctx
            old = tl.load(tail_ptr + (slot * C + c[None, :]) * ctx + i[:, None],
                          mask=from_tail[:, None] & c_mask[None, :], other=0.0)
            v = tl.where(from_tail[:, None], old, v)
        return v

    @triton.jit
    def _codec_output_taps_kernel(
        x_ptr, w_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, tail_ptr, rows_ptr, out_ptr,
        scratch_ptr, C, n, ctx, DIL, sxb, sxc, sxt,
        K: tl.constexpr, HAS_SNAKE: tl.constexpr, HAS_TAIL: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_CTX: tl.constexpr, WIN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """The output stage of one (row, block of BLOCK_T samples), taps first (TAPS_FIRST):
        z [WIN, 16] = xin^T [WIN, C] x w [C, 16 (taps, padded)] over the program's window
        (xin columns t0 .. t0 + WIN - 1, in two pieces of BLOCK_T and BLOCK_W columns), fp32
        FMAs; z into the program's scratch, a barrier, then pcm[t] = bias + sum_j
        z[t + j DIL, j]."""
        pdl_prologue(PDL)
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        first = blk == 0
        t0 = blk * BLOCK_T
        slot = tl.load(rows_ptr + b).to(tl.int64)
        x_row = x_ptr + b * sxb
        scratch = scratch_ptr + (b * tl.num_programs(1) + blk) * WIN * 16
        col_a = tl.arange(0, BLOCK_T)
        col_b = BLOCK_T + tl.arange(0, BLOCK_W)
        tap = tl.arange(0, 16)
        za = tl.zeros([BLOCK_T, 16], dtype=tl.float32)
        zb = tl.zeros([BLOCK_W, 16], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < C
            al, ib = snake_params(alpha_ptr, inv_beta_ptr, c, c_mask, HAS_SNAKE)
            wt = tl.load(w_ptr + tap[None, :] * C + c[:, None],
                         mask=c_mask[:, None] & (tap < K)[None, :], other=0.0).to(tl.float32)
            va = _xin_piece(x_row, tail_ptr, slot, c, c_mask, al, ib, t0 + col_a, C, n, ctx,
                            sxc, sxt, HAS_SNAKE, HAS_TAIL)  # fmt: skip
            vb = _xin_piece(x_row, tail_ptr, slot, c, c_mask, al, ib, t0 + col_b, C, n, ctx,
                            sxc, sxt, HAS_SNAKE, HAS_TAIL)  # fmt: skip
            za = tl.dot(va, wt, za, input_precision="ieee")
            zb = tl.dot(vb, wt, zb, input_precision="ieee")
        tl.store(scratch + col_a[:, None] * 16 + tap[None, :], za)
        tl.store(scratch + col_b[:, None] * 16 + tap[None, :], zb)
        tl.debug_barrier()  # z's stores precede the shifted reads (one CTA)
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(scratch + (j * DIL + col_a) * 16 + j)
        t = t0 + col_a
        t_mask = t < n
        y = acc + tl.load(bias_ptr).to(tl.float32)
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
        tl.store(out_ptr + b * n + t, y, mask=t_mask)
        if HAS_TAIL:
            if first:  # its window held the old tail (BLOCK_T >= ctx): the new tail
                _new_tail(x_row, alpha_ptr, inv_beta_ptr, tail_ptr, slot, C, n, ctx, sxc, sxt,
                          HAS_SNAKE, BLOCK_C, BLOCK_CTX)  # fmt: skip

    @triton.jit
    def _output_from_taps_kernel(
        z_ptr, bias_ptr, ztail_ptr, rows_ptr, out_ptr, n, ctx, DIL, szb, szt, szj,
        K: tl.constexpr, WIDTH: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_CTX: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """pcm of one (row, block of BLOCK_T samples): the taps along time (the slot's ztail
        below ctx); the first block (BLOCK_T >= ctx, the only one reading the old ztail)
        writes the new one after a barrier."""
        pdl_prologue(PDL)
        b, first, t, t_mask, slot = _row_block(rows_ptr, n, BLOCK_T)
        z_row = z_ptr + b * szb
        acc = tl.zeros([BLOCK_T], dtype=tl.float32) + tl.load(bias_ptr).to(tl.float32)
        for j in tl.static_range(K):
            i = t + j * DIL  # zin row: the ztail below ctx, z from there on
            v = tl.load(z_row + (i - ctx) * szt + j * szj, mask=t_mask & (i >= ctx), other=0.0)
            if HAS_TAIL:
                old = tl.load(ztail_ptr + (slot * ctx + i) * WIDTH + j,
                              mask=t_mask & (i < ctx), other=0.0)
                v = tl.where(i < ctx, old, v)
            acc += v
        y = tl.minimum(tl.maximum(acc, -1.0), 1.0)
        tl.store(out_ptr + b * n + t, y, mask=t_mask)
        if HAS_TAIL:
            if first:  # the new ztail: zin rows n .. n + ctx - 1, every tap column
                i2 = tl.arange(0, BLOCK_CTX)
                col = tl.arange(0, WIDTH)
                src = n + i2
                keep = (i2 < ctx)[:, None] & (col < WIDTH)[None, :]
                from_tail = keep & (src < ctx)[:, None]
                row = ztail_ptr + slot * ctx * WIDTH
                shifted = tl.load(row + src[:, None] * WIDTH + col[None, :], mask=from_tail,
                                  other=0.0)
                fresh = tl.load(z_row + (src - ctx)[:, None] * szt + col[None, :] * szj,
                                mask=keep & (src >= ctx)[:, None], other=0.0)
                new = tl.where(from_tail, shifted, fresh)
                tl.debug_barrier()  # every read of the old ztail precedes the writes
                tl.store(row + i2[:, None] * WIDTH + col[None, :], new, mask=keep)

    @triton.jit
    def _new_tail(x_row, alpha_ptr, inv_beta_ptr, tail_ptr, slot, C, n, ctx, sxc, sxt,
                  HAS_SNAKE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CTX: tl.constexpr):
        """The row's new tail: the last ctx columns of xin (the old tail shifted, or SnakeBeta
        of x), written after every read of the old one (barriers)."""
        tl.debug_barrier()  # every read of the old tail above precedes the writes
        i2 = tl.arange(0, BLOCK_CTX)
        src = n + i2  # xin column of new tail entry i2
        from_tail = (src < ctx) & (i2 < ctx)
        from_x = (src >= ctx) & (i2 < ctx)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < C
            al, ib = snake_params(alpha_ptr, inv_beta_ptr, c, c_mask, HAS_SNAKE)
            row = tail_ptr + (slot * C + c[:, None]) * ctx
            shifted = tl.load(row + src[None, :],
                              mask=c_mask[:, None] & from_tail[None, :], other=0.0)
            hx = tl.load(x_row + c[:, None] * sxc + (src - ctx)[None, :] * sxt,
                         mask=c_mask[:, None] & from_x[None, :], other=0.0)
            new = tl.where(from_tail[None, :], shifted, _snake_f32(hx, al, ib, HAS_SNAKE))
            tl.debug_barrier()  # this block's reads of the old tail precede its writes
            tl.store(row + i2[None, :], new, mask=c_mask[:, None] & (i2 < ctx)[None, :])
