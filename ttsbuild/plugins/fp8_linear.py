"""Weight-only FP8 linear: y = x @ (w_fp8 * scale[:, None]).T, x bf16 [M, K], M small.

Weights are float8_e4m3fn [N, K] with one fp32 scale per output channel (amax / 448),
quantised offline by `quantize_weight_fp8`. Decode is memory-bound (M <= 64 rows against
N x K weights), so reading one byte per weight instead of two is up to a 2x win; the
kernel dequantises in registers and accumulates in fp32 (see `_tl/fp8_linear.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.norm_act import silu_mul_reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel amax quantisation: w [N, K] -> (w_fp8 [N, K] e4m3fn, scale [N] fp32).

    w ~= w_fp8.float() * scale[:, None]; each row's largest magnitude maps to 448.
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantize_weight_fp8(
    w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (w_fp8.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 product with the dequantised weight, cast to x's dtype."""
    out = x.float() @ dequantize_weight_fp8(w_fp8, scale).t()
    return out.to(x.dtype)


def fp8_linear(
    x: torch.Tensor,  # [..., K] bf16
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] fp32
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    if w_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {w_fp8.dtype}")
    if not want_triton(x, use_triton):
        return fp8_linear_reference(x, w_fp8, scale)
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton

    lead = x.shape[:-1]
    out = fp8_linear_triton(x.reshape(-1, x.shape[-1]), w_fp8, scale)
    return out.reshape(*lead, w_fp8.shape[0])


def fp8_gate_up_silu(
    x: torch.Tensor,  # [..., K] bf16
    w_fp8: torch.Tensor,  # [2N, K] float8_e4m3fn: gate rows, then up rows
    scale: torch.Tensor,  # [2N] fp32
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """silu_mul(fp8_linear(x, w, scale)): silu(gate) * up [..., N] in x's dtype, one launch
    on the GPU (rounded as the two unfused kernels round)."""
    if w_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {w_fp8.dtype}")
    if w_fp8.shape[0] % 2:
        raise ValueError(f"a packed gate/up weight has an even row count, got {w_fp8.shape[0]}")
    if not want_triton(x, use_triton):
        return silu_mul_reference(fp8_linear_reference(x, w_fp8, scale))
    from ttsbuild.plugins._tl.fp8_linear import fp8_linear_triton

    lead = x.shape[:-1]
    out = fp8_linear_triton(x.reshape(-1, x.shape[-1]), w_fp8, scale, gate_up=True)
    return out.reshape(*lead, w_fp8.shape[0] // 2)


class FP8Linear(nn.Module):
    """Drop-in for a bias-free nn.Linear whose weight was quantised with quantize_weight_fp8."""

    def __init__(self, w_fp8: torch.Tensor, scale: torch.Tensor, use_triton: bool | None = None):
        super().__init__()
        self.register_buffer("weight", w_fp8)
        self.register_buffer("scale", scale.float())
        self.use_triton = use_triton

    @classmethod
    def from_linear(cls, linear: nn.Linear, use_triton: bool | None = None) -> FP8Linear:
        if linear.bias is not None:
            raise ValueError("FP8Linear has no bias")
        return cls(*quantize_weight_fp8(linear.weight), use_triton=use_triton)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, use_triton=self.use_triton)
