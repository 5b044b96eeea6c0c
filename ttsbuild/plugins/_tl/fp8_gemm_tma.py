"""FP8 x FP8 GEMM for many rows (W8A8 from ~128 rows) on TMA loads.

out[m, n] = sx[m] * sw[n] * sum_k xq[m, k] w[n, k], fp32 sums, bf16 out: the product of
`fp8_w8a8` (rows quantised with a scale each, weights with one per output channel).

The A8 tiles of `fp8_linear` are shaped for few rows (swap-AB: the weight on the MMA's 64-row
side, the rows on its narrow side, pointer loads). Where a GEMM has hundreds of rows (long
prompts, batched prefill, decode buckets of 128-256) it is compute-bound, and this is the
plain orientation instead: a [BLOCK_M, BLOCK_N] output tile of two warpgroups, both operands
K-major (what the FP8 wgmma needs) brought in by tensor-descriptor (TMA) loads that the
copy engine zero-fills past M and K, pipelined over NUM_STAGES; programs ordered in groups
of GROUP_M row tiles so a weight tile is read from HBM once per group. Host-side
descriptors: a Triton that has them (`_dispatch.tma_capable`), sm_90 or the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsbuild.plugins._dispatch import interpret_mode, pdl_args, pdl_enabled
from ttsbuild.plugins._tl._math import pdl_prologue


@triton.jit
def _w8a8_tma_kernel(
    x_desc,
    w_desc,
    sx_ptr,
    sw_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows
    pid_n = (pid % in_group) // rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K] e4m3, zeros past M and K
        b = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        if DOT_F32:  # the interpreter: its 8- and 16-bit dots are not exact
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc)
        else:
            acc = tl.dot(a, b.T, acc)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tma_config(M: int, N: int) -> dict:
    """BLOCK_M/N/K, GROUP_M, warps and stages: 128 x 128 tiles of K blocks of 128 on two
    warpgroups, four stages (4 x 32 KB of shared memory); 128 x 256 where 128-wide tiles
    would still fill the SMs twice over (fewer, fatter tiles read each row tile half as often)."""
    bn = 256 if triton.cdiv(M, 128) * triton.cdiv(N, 256) >= 264 else 128
    return {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
            "num_stages": 3 if bn == 256 else 4}  # fmt: skip


def tma_takes(xq: torch.Tensor, w: torch.Tensor) -> bool:
    """Shapes the descriptors take: 16-byte rows (K a multiple of 16 FP8 values), contiguous
    operands with 16-byte aligned starts."""
    return (xq.dim() == 2 and w.dim() == 2 and xq.shape[1] == w.shape[1]
            and w.shape[1] % 16 == 0 and xq.is_contiguous() and w.is_contiguous()
            and xq.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)  # fmt: skip


def w8a8_tma(
    xq: torch.Tensor,  # [M, K] e4m3
    sx: torch.Tensor,  # [M] or [M, 1] fp32
    w: torch.Tensor,  # [N, K] e4m3
    sw: torch.Tensor,  # [N] fp32
    config: dict | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[M, N] out_dtype: sx[m] * sw[n] * sum_k xq[m, k] w[n, k] (see the module)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if xq.dtype != w.dtype:
        raise TypeError(f"W8A8 needs FP8 rows like the weight ({w.dtype}), got {xq.dtype}")
    if not tma_takes(xq, w):
        raise ValueError(f"the TMA GEMM does not take x {tuple(xq.shape)} x w {tuple(w.shape)} "
                         "(K a multiple of 16, contiguous, 16-byte aligned)")  # fmt: skip
    M, K = xq.shape
    N = w.shape[0]
    sx = sx.reshape(-1).float().contiguous()
    if sx.numel() != M:
        raise ValueError(f"{sx.numel()} row scales for {M} rows")
    c = dict(config or tma_config(M, N))
    bm, bn, bk = c.pop("BLOCK_M"), c.pop("BLOCK_N"), c.pop("BLOCK_K")
    x_desc = TensorDescriptor(xq, [M, K], [K, 1], [bm, bk])
    w_desc = TensorDescriptor(w, [N, K], [K, 1], [bn, bk])
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    stages = c.pop("num_stages")
    _w8a8_tma_kernel[grid](
        x_desc, w_desc, sx, sw.float().contiguous(), out, M, N, K, out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c.pop("GROUP_M"), NUM_STAGES=stages,
        DOT_F32=interpret_mode(), num_stages=stages, **c, **pdl_args(pdl_enabled(xq)),
    )  # fmt: skip
    return out
