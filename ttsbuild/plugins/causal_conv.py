"""The codec's stride-1 convolutions as one implicit-GEMM launch, bias and residual fused.

    causal_conv(xin [B, Cin, n + (k - 1) * d], w [k, Cin, Cout], bias [Cout] | None,
                dilation d, residual [B, Cout, n] | None) -> y [B, Cout, n]
    y[b, o, t] = bias[o] + sum_{j, c} w[j, c, o] * xin[b, c, t + j * d]  (+ residual[b, o, t])

`xin` is what `codec_context.snake_context` returns: the left context (the slot's tail)
already in front, so the conv itself is "valid" (no padding). `pack_conv_weight` turns an
nn.Conv1d weight [Cout, Cin, k] into the [k, Cin, Cout] operand once, at engine build.

cuDNN runs these convs on [B, C, T] half tensors as implicit GEMMs with layout transposes
around them (or as a slow NCHW kernel); an im2col copy plus one GEMM writes k copies of the
input. The kernel reads the input tiles straight from [B, C, T] for each tap: one program per
(block of output rows m = b * n + t, over the whole batch; block of output channels),
accumulating k * Cin / BLOCK_CI products of [BLOCK_M, BLOCK_CI] x [BLOCK_CI, BLOCK_O] in fp32
on the tensor cores, then adds the bias and the residual and stores the tile in the input's
dtype. Half precision only (fp16,
bf16): fp32 stages keep cuDNN, whose TF32 switch the engine controls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import triton_available, want_triton


def pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d weight [Cout, Cin, k] -> the kernel's operand [k, Cin, Cout], contiguous."""
    return weight.permute(2, 1, 0).contiguous()


def causal_conv_reference(xin, w, bias, dilation, residual=None):
    """F.conv1d on the unpacked weight; the residual added in fp32, rounded once."""
    y = F.conv1d(xin, w.permute(2, 1, 0), None, dilation=dilation).float()
    if bias is not None:
        y = y + bias.float()[:, None]
    if residual is not None:
        y = y + residual.float()
    return y.to(xin.dtype)


def causal_conv(xin, w, bias, dilation, residual=None, *, use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU."""
    if xin.dtype not in (torch.float16, torch.bfloat16) or not want_triton(xin, use_triton):
        if use_triton and xin.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the causal_conv kernel takes fp16 or bf16, not {xin.dtype}")
        return causal_conv_reference(xin, w, bias, dilation, residual)
    return _causal_conv_triton(xin, w, bias, dilation, residual)


def _config(m: int, cin: int, cout: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_CI, BLOCK_O, num_warps) for M = B * n output rows: 128 x 128 tiles
    with two warpgroups where there are rows enough, else tiles of >= 16 (the MMA minimum)
    no wider than the problem, so masked lanes stay few."""
    import triton

    block_ci = 64 if cin % 64 == 0 else 32
    if m >= 2048:
        return 128, block_ci, 128 if cout > 64 else 64, 8
    return min(64, max(16, triton.next_power_of_2(m))), block_ci, 64 if cout >= 64 else \
        max(16, triton.next_power_of_2(cout)), 4


def _causal_conv_triton(xin, w, bias, dilation, residual):
    import triton

    B, cin, L = xin.shape
    k, cin_w, cout = w.shape
    if cin_w != cin or w.dtype != xin.dtype or not w.is_contiguous():
        raise ValueError(f"w must be contiguous [k, {cin}, Cout] {xin.dtype}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    n = L - (k - 1) * dilation
    if n < 1:
        raise ValueError(f"input of {L} samples is shorter than the receptive field "
                         f"{(k - 1) * dilation + 1}")
    out = torch.empty((B, cout, n), dtype=xin.dtype, device=xin.device)
    if residual is not None and residual.shape != out.shape:
        raise ValueError(f"residual must be {tuple(out.shape)}, got {tuple(residual.shape)}")
    bm, bci, bo, warps = _config(B * n, cin, cout)
    grid = (triton.cdiv(B * n, bm), triton.cdiv(cout, bo))
    res = residual if residual is not None else out
    _causal_conv_kernel[grid](
        xin, w, bias if bias is not None else w, res, out, B * n, cin, cout, n, dilation,
        xin.stride(0), xin.stride(1), xin.stride(2), res.stride(0), res.stride(1), res.stride(2),
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_M=bm, BLOCK_CI=bci, BLOCK_O=bo, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return out


if triton_available():  # the kernel exists only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    @triton.jit
    def _causal_conv_kernel(
        x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, CIN, COUT, N, DIL,
        sxb, sxc, sxt, srb, sro, srt,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        # output rows m = b * N + t over the whole batch: a tile spans rows of several
        # batch rows when n is short (a one-frame step at batch 64 is 64 x 4..1920 rows)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        m_mask = offs_m < M
        o_mask = offs_o < COUT
        b = (offs_m // N).to(tl.int64)
        t = offs_m % N
        x_rows = x_ptr + b * sxb + t * sxt  # [BLOCK_M]: input time t of row b, tap 0
        acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
        # one loop over (tap j, channel block c0), so the compiler pipelines its loads
        cin_blocks = tl.cdiv(CIN, BLOCK_CI)
        for it in range(0, K * cin_blocks):
            j = it // cin_blocks
            offs_c = (it % cin_blocks) * BLOCK_CI + tl.arange(0, BLOCK_CI)
            c_mask = offs_c < CIN
            a = tl.load(x_rows[:, None] + offs_c[None, :] * sxc + j * DIL * sxt,
                        mask=m_mask[:, None] & c_mask[None, :], other=0.0)
            wt = tl.load(w_ptr + (j * CIN + offs_c[:, None]) * COUT + offs_o[None, :],
                         mask=c_mask[:, None] & o_mask[None, :], other=0.0)
            acc = tl.dot(a, wt, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_o, mask=o_mask, other=0.0).to(tl.float32)[None, :]
        mask = m_mask[:, None] & o_mask[None, :]
        if HAS_RES:
            r = tl.load(res_ptr + (b * srb + t * srt)[:, None] + offs_o[None, :] * sro,
                        mask=mask, other=0.0)
            acc += r.to(tl.float32)
        dst = out_ptr + (b * COUT * N + t)[:, None] + offs_o[None, :] * N
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
