"""The codec step's first op, one launch: each frame's Q codes looked up in the pre-projected
codebook tables and summed, stored in the first stage's dtype along contiguous channels.

    codebook_sum(codes [B, Q, n] int, tables [Q * size, D] fp32, size, out_dtype)
        -> x [B, D, n] out_dtype, a view of contiguous [B, n, D] storage
    x[b, :, t] = sum_q tables[q * size + codes[b, q, t]]  (fp32 sums, rounded once)

Eager, that is an add of the tables' offsets, a gather of B x Q x n rows, a sum over Q and the
cast to the pre_conv stage's dtype: four launches at a batch-1 step, which is launch-bound.
Triton: one program per (row, frame, block of D channels), the Q rows summed in fp32 in order
(the eager sum may take another order: the same to fp32 rounding).
"""

from __future__ import annotations

import torch

from ttsbuild.plugins._dispatch import codec_pdl_args, triton_available, want_triton


def codebook_sum_reference(codes: torch.Tensor, tables: torch.Tensor, size: int,
                           out_dtype: torch.dtype) -> torch.Tensor:
    Q = codes.shape[1]
    offset = (torch.arange(Q, device=codes.device) * size)[None, :, None]
    x = tables[codes + offset].sum(1)  # [B, n, D] fp32
    return x.to(out_dtype).transpose(1, 2)


def codebook_sum(codes: torch.Tensor, tables: torch.Tensor, size: int, out_dtype: torch.dtype,
                 *, use_triton: bool | None = None) -> torch.Tensor:
    """See the module docstring; one launch on the GPU."""
    B, Q, n = codes.shape
    if tables.dim() != 2 or tables.shape[0] != Q * size or tables.dtype != torch.float32:
        raise ValueError(f"tables must be [{Q} * {size}, D] fp32, got {tuple(tables.shape)} "
                         f"{tables.dtype}")
    if not want_triton(tables, use_triton):
        return codebook_sum_reference(codes, tables, size, out_dtype)
    import triton

    D = tables.shape[1]
    if not tables.is_contiguous():
        raise ValueError("tables must be contiguous")
    out = torch.empty((B, n, D), dtype=out_dtype, device=tables.device)
    if out.numel():
        block_d = min(triton.next_power_of_2(D), 512)
        _codebook_sum_kernel[(B * n, triton.cdiv(D, block_d))](
            codes, tables, out, Q, n, D, size, *codes.stride(), BLOCK_D=block_d, num_warps=4,
            **codec_pdl_args(tables),
        )  # fmt: skip
    return out.transpose(1, 2)


if triton_available():
    import triton
    import triton.language as tl

    from ttsbuild.plugins._tl._math import pdl_prologue

    @triton.jit
    def _codebook_sum_kernel(codes_ptr, tables_ptr, out_ptr, Q, n, D, size, stride_b, stride_q,
                             stride_t, BLOCK_D: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        pdl_prologue(PDL)
        row = tl.program_id(0).to(tl.int64)  # b * n + t
        b, t = row // n, row % n
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for q in range(Q):
            code = tl.load(codes_ptr + b * stride_b + q * stride_q + t * stride_t).to(tl.int64)
            acc += tl.load(tables_ptr + (q * size + code) * D + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
