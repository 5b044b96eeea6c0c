"""A codec ConvNeXt block (the upsample stage's: causal depthwise conv k7 -> LayerNorm ->
Linear 4x -> GELU -> Linear -> gamma, residual) for few rows in two launches.

At one frame per row the upsample stage runs 2 and 4 positions per row through each block;
the module's ops are ~10 launches there (the conv on cuDNN, a transpose, the LayerNorm, two
split-K GEMMs with their reductions, the GELU, gamma, the residual add). The kernels
(plugins/_tl/convnext.py) take the depthwise conv's input with its left context already
attached (`plugins.codec_context.snake_context` keeps the slot's tail, as before): the conv,
the LayerNorm and pwconv1 + GELU in one launch, pwconv2 + gamma + residual in another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import want_triton


def convnext_reference(x, xe, dw_weight, dw_bias, ln_weight, ln_bias, eps: float, w1, b1, w2,
                       b2, gamma):  # fmt: skip
    """The codec engine's ops (CodecEngine._convnext): x [B, C, n], xe [B, C, ctx + n]."""
    h = dwconv_norm_reference(xe, dw_weight, dw_bias, ln_weight, ln_bias, eps)  # [B, n, C]
    h = F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
    return x + (h if gamma is None else gamma * h).transpose(1, 2)


def convnext(x, xe, dw_weight, dw_bias, ln_weight, ln_bias, eps: float, w1, b1, w2, b2, gamma,
             *, use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    """x + the block's branch: [B, C, n] in x's dtype. gamma None: folded into w2 and b2."""
    B, C, n = x.shape
    if xe.shape[:2] != (B, C) or xe.shape[2] != n + dw_weight.shape[-1] - 1:
        raise ValueError(f"convnext: xe {tuple(xe.shape)} is not x {tuple(x.shape)} after its "
                         f"left context of {dw_weight.shape[-1] - 1}")  # fmt: skip
    if not want_triton(x, use_triton):
        return convnext_reference(x, xe, dw_weight, dw_bias, ln_weight, ln_bias, eps, w1, b1,
                                  w2, b2, gamma)  # fmt: skip
    from ttsbuild.plugins._tl.convnext import convnext_triton

    return convnext_triton(x, xe, dw_weight, dw_bias, ln_weight, ln_bias, eps, w1, b1, w2, b2,
                           gamma)  # fmt: skip


def dwconv_norm_reference(xe, dw_weight, dw_bias, ln_weight, ln_bias, eps: float):
    """The engine's module ops: the depthwise conv of xe [B, C, ctx + n] (rounded to its
    dtype), then the LayerNorm in fp32 -> [B, n, C] in xe's dtype."""
    h = F.conv1d(xe, dw_weight, dw_bias, groups=xe.shape[1]).transpose(1, 2)
    return F.layer_norm(h.float(), (xe.shape[1],), ln_weight.float(), ln_bias.float(),
                        eps).to(xe.dtype)  # fmt: skip


def dwconv_norm(xe, dw_weight, dw_bias, ln_weight, ln_bias, eps: float, *,
                use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    """A ConvNeXt block's depthwise conv and LayerNorm as one launch (any number of rows;
    `convnext` is the whole block for few): xe [B, C, ctx + n] -> [B, n, C], contiguous. On
    the GPU cuDNN ran the conv as `conv1D_NCHW_general`, 41 us a call at 64 rows of a
    one-frame step (H200 profile, 2026-12-04), for ~2 MFLOP."""
    C, K = dw_weight.shape[0], dw_weight.shape[-1]
    if dw_weight.shape != (C, 1, K) or xe.shape[1] != C or xe.shape[2] < K:
        raise ValueError(f"dwconv_norm: a depthwise weight [C, 1, k] over xe [B, C, >= k], got "
                         f"{tuple(dw_weight.shape)} and {tuple(xe.shape)}")
    if not want_triton(xe, use_triton):
        return dwconv_norm_reference(xe, dw_weight, dw_bias, ln_weight, ln_bias, eps)
    from ttsbuild.plugins._tl.convnext import dwconv_norm_triton

    return dwconv_norm_triton(xe, dw_weight, dw_bias, ln_weight, ln_bias, eps,
                              xe.shape[2] - K + 1)
