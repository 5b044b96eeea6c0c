"""Fused elementwise/row ops of the decoder blocks and the codec (one launch each).

- rms_norm: RMSNorm (fp32 statistics, cast to the input dtype, times the weight), i.e.
  `ttsbuild.model.layers.RMSNorm` / `runtime.fast_model.rms_norm` (7 eager kernels).
- add_rms_norm: residual add + RMSNorm of the sum, for a pre-norm block chain:
  returns (residual + x, rms_norm(residual + x)).
- silu_mul: silu(gate) * up on the packed [.., 2I] gate_up output (chunk + 2 kernels).
- snake_beta: the codec's SnakeBeta, x + 1 / (exp(log_beta) + 1e-9) * sin(exp(log_alpha) x)^2
  per channel of x [B, C, T] (5 kernels incl. the exps of the stored logs).

The references below are the model's eager ops exactly (the CPU path is bit-identical to
the model). Triton computes in fp32 and rounds where the eager ops round to the input
dtype (the normalised value before the weight, the residual sum, silu before the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import want_triton

SNAKE_EPS = 1e-9


# ----------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly the model's RMSNorm.forward.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return new_residual, rms_norm_reference(new_residual, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def snake_beta_reference(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor
) -> torch.Tensor:
    # Exactly codec.SnakeBeta.forward.
    alpha = log_alpha.exp()[:, None]  # [C, 1]
    inv_beta = 1.0 / (log_beta.exp()[:, None] + SNAKE_EPS)
    return x + inv_beta * torch.sin(x * alpha).pow(2)


# ----------------------------------------------------------------------------- dispatch


def _quantized(h: torch.Tensor):
    from ttsbuild.plugins.fp8_w8a8 import quantize_rows_reference

    return quantize_rows_reference(h.reshape(-1, h.shape[-1]))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None,
    quantize: bool = False,
):  # fmt: skip
    """RMSNorm over the last dim, one launch on the GPU. quantize: (normed, (q, scale)), the
    normed rows also quantised to FP8 per row (`fp8_w8a8.quantize_rows` of the normed
    output, for a W8A8 linear after it) in the same launch."""
    if not want_triton(x, use_triton):
        h = rms_norm_reference(x, weight, eps)
        return (h, _quantized(h)) if quantize else h
    from ttsbuild.plugins._tl.norm_act import rms_norm_triton

    out = rms_norm_triton(x, None, weight, eps, quantize=quantize)
    return (out[1], out[2]) if quantize else out[1]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    use_triton: bool | None = None,
    quantize: bool = False,
):
    """(new_residual = residual + x, rms_norm(new_residual)), one launch on the GPU.
    quantize: (new_residual, normed, (q, scale)) as `rms_norm(quantize=True)`."""
    if not want_triton(x, use_triton):
        res, h = add_rms_norm_reference(x, residual, weight, eps)
        return (res, h, _quantized(h)) if quantize else (res, h)
    from ttsbuild.plugins._tl.norm_act import rms_norm_triton

    return rms_norm_triton(x, residual, weight, eps, quantize=quantize)


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None,
             quantize: bool = False):  # fmt: skip
    """silu(gate_up[..., :I]) * gate_up[..., I:] -> [..., I], one launch on the GPU.
    quantize: (that, (q, scale)), its rows also quantised to FP8 per row in the same launch
    (one program per row then), for a W8A8 linear after it."""
    if not want_triton(gate_up, use_triton):
        act = silu_mul_reference(gate_up)
        return (act, _quantized(act)) if quantize else act
    if quantize:
        from ttsbuild.plugins._tl.norm_act import silu_mul_quant_triton

        return silu_mul_quant_triton(gate_up)
    from ttsbuild.plugins._tl.norm_act import silu_mul_triton

    return silu_mul_triton(gate_up)


def snake_beta(
    x: torch.Tensor,  # [B, C, T]
    log_alpha: torch.Tensor,  # [C] (stored log alpha)
    log_beta: torch.Tensor,  # [C] (stored log beta)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """x + 1 / (exp(log_beta) + 1e-9) * sin(exp(log_alpha) * x)^2 per channel; one launch
    on the GPU (fp32 math, the exps of the per-channel logs done in the kernel)."""
    if not want_triton(x, use_triton):
        return snake_beta_reference(x, log_alpha, log_beta)
    from ttsbuild.plugins._tl.norm_act import snake_beta_triton

    return snake_beta_triton(x, log_alpha, log_beta)
