"""A decode linear with its neighbours fused in: one launch per block of the decoder layer.

`fused_linear` = optional row gather (an embedding lookup) -> optional RMSNorm -> linear
(bf16/fp32, or FP8 e4m3 weight-only with per-output-channel scales as `fp8_linear` stores
them, or fp16 weights with such scales beside fp32 activations: `scaled_half_weight`) ->
optional bias -> optional silu(gate) * up of the packed gate/up matrix -> optional residual
add. The named forms are the decoder layer's blocks:

- norm_linear:        rms_norm(x) @ W.T                      (input norm + qkv; final norm + head)
- linear_residual:    residual + x @ W.T                     (o + add, down + add)
- norm_gate_up_silu:  silu(h @ Wg.T) * (h @ Wu.T), h = rms_norm(x)  (post norm + MLP up half)
- gather_linear:      table[index] @ W.T + b                 (code embedding + projection)
- norm_linear_sample: norm_linear (a head, fp32 logits) then `fused_sample`, one launch: the
                      program that writes the last logits tile samples every row
- norm_linear_attend: norm_linear (qkv) then `qk_norm_rope_attend` in one launch (the code
                      predictor's short caches): the program that writes the last qkv tile of
                      a KV head's group attends that group for every row

The reference is the model's unfused ops in order (the CPU path equals the unfused runtime
path). The kernel computes in fp32 and rounds to x's dtype where the eager ops round
(normed activations, the linear's output before the residual add / silu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsbuild.generation.sampling import SamplingBatch
from ttsbuild.plugins._dispatch import want_triton
from ttsbuild.plugins.fp8_linear import FP8_DTYPE, fp8_linear_reference
from ttsbuild.plugins.norm_act import rms_norm_reference, silu_mul_reference
from ttsbuild.plugins.qk_norm_rope import inv_freq
from ttsbuild.plugins.qk_norm_rope_attend import qk_norm_rope_attend_reference
from ttsbuild.plugins.sampling import fused_sample_reference


def fused_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    index: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gate_up: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    h = x[index] if index is not None else x
    if norm_weight is not None:
        h = rms_norm_reference(h, norm_weight, eps)
    if scale is not None:
        y = fp8_linear_reference(h, weight, scale)
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(h, weight, bias)
    if gate_up:
        y = silu_mul_reference(y)
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def _check_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    if weight.dtype == FP8_DTYPE and scale is None:
        raise TypeError("FP8 weights need their per-channel scale")
    if scale is not None and weight.dtype not in SCALED_DTYPES:
        raise TypeError(f"a per-channel scale goes with FP8, fp16 or bf16 weights, "
                        f"not {weight.dtype}")


# Weights that may carry per-output-channel scales: FP8 (which needs them) and half precision
# (`scaled_half_weight`: weight-only fp16 beside fp32 activations, e.g. the codec's
# pre-transformer GEMVs, half the bytes of fp32 weights).
SCALED_DTYPES = (FP8_DTYPE, torch.float16, torch.bfloat16)


def scaled_half_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 weights with per-output-channel power-of-two scales: (w16 [N, K], scale [N] fp32)
    with w16 * scale[:, None] = weight rounded to fp16's 11 significant bits. Each row is
    scaled by the power of two at or above its largest magnitude, so it lies in [-1, 1]: no
    overflow, and only entries below 2^-14 of the row's largest lose bits as subnormals (a
    small layer scale folded into a row would otherwise push the whole row there)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax)))
    return (w / scale[:, None]).to(torch.float16), scale


def fused_linear(
    x: torch.Tensor,  # [M, K] (or the table [rows, K] that index picks from)
    weight: torch.Tensor,  # [N, K], [2N, K] with gate_up; bf16/fp16/fp32 or float8_e4m3fn
    scale: torch.Tensor | None = None,  # [N] / [2N] fp32: FP8 (needed) and half weights
    *,
    index: torch.Tensor | None = None,  # [M] int64
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, N]
    gate_up: bool = False,
    out_dtype: torch.dtype | None = None,
    use_triton: bool | None = None,
    config: dict | None = None,  # BLOCK_M/N/K, SPLIT_K: overrides the per-shape plan
    residual_ready: bool = False,
    gemv_rows_f32: int | None = None,
    out: torch.Tensor | None = None,  # [M, N] rows contiguous: written in place and returned
    tf32: bool = False,
) -> torch.Tensor:
    """[M, N] in out_dtype (default x's dtype); one launch on the GPU. out: the result's
    storage (e.g. rows of a larger buffer that several launches fill). residual_ready: the
    residual was written at least two kernels before this one (not by the kernel right
    before it), so under programmatic dependent launch it is read before waiting for that
    kernel, with the weights. gemv_rows_f32: fp32 x of at most this many rows runs as GEMVs,
    a program per row and column tile (None: TTSBUILD_GEMV_ROWS_F32, default 0; see the
    per-shape plan). tf32: fp32 x in tiles (rows beyond gemv_rows_f32) runs on TF32 tensor
    cores, as cuBLAS's TF32 GEMMs (the reference stays exact fp32), instead of IEEE fp32."""
    _check_scale(weight, scale)
    kw = dict(
        index=index, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
        gate_up=gate_up, out_dtype=out_dtype,
    )  # fmt: skip
    if out is not None:
        M = index.shape[0] if index is not None else x.shape[0]
        N = weight.shape[0] // 2 if gate_up else weight.shape[0]
        if out.shape != (M, N) or out.dtype != (out_dtype or x.dtype) or out.stride(1) != 1:
            raise ValueError(f"out must be [{M}, {N}] {out_dtype or x.dtype} with contiguous "
                             f"rows, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if not want_triton(x, use_triton):
        y = fused_linear_reference(x, weight, scale, **kw)
        return y if out is None else out.copy_(y)
    from ttsbuild.plugins._tl.fused_linear import fused_linear_triton

    return fused_linear_triton(x, weight, scale, config=config, residual_ready=residual_ready,
                               gemv_rows_f32=gemv_rows_f32, out=out, tf32=tf32, **kw)  # fmt: skip


def norm_linear(x, norm_weight, weight, scale=None, *, eps, out_dtype=None, use_triton=None):
    """rms_norm(x) @ W.T: [M, N]."""
    return fused_linear(
        x, weight, scale, norm_weight=norm_weight, eps=eps, out_dtype=out_dtype,
        use_triton=use_triton,
    )  # fmt: skip


def linear_residual(x, weight, scale, residual, *, use_triton=None, residual_ready=False):
    """residual + x @ W.T: the new residual [M, N] (residual_ready: see fused_linear)."""
    return fused_linear(x, weight, scale, residual=residual, use_triton=use_triton,
                        residual_ready=residual_ready)  # fmt: skip


def norm_gate_up_silu(x, norm_weight, gate_up_weight, scale=None, *, eps, use_triton=None):
    """silu(h @ Wg.T) * (h @ Wu.T) with h = rms_norm(x), from the packed [2I, K] gate/up
    matrix: [M, I]."""
    return fused_linear(
        x, gate_up_weight, scale, norm_weight=norm_weight, eps=eps, gate_up=True,
        use_triton=use_triton,
    )  # fmt: skip


def gather_linear(table, index, weight, bias=None, scale=None, *, use_triton=None):
    """table[index] @ W.T + bias: [M, N]."""
    return fused_linear(table, weight, scale, index=index, bias=bias, use_triton=use_triton)


def norm_linear_attend(
    x: torch.Tensor,  # [R, K]: the layer input
    norm_weight: torch.Tensor,  # [K]: the input norm
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]: the packed qkv projection
    scale: torch.Tensor | None,  # FP8 weights only
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [R] int, < S
    slots: torch.Tensor,  # [R] int
    k_cache: torch.Tensor,  # [slots, Hkv, S, D], S <= MAX_POSITIONS
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    theta: float,
    use_triton: bool | None = None,
    config: dict | None = None,  # the qkv GEMV's tiles (BLOCK_N is narrowed to divide D)
) -> torch.Tensor:
    """qk_norm_rope_attend(norm_linear(x, ...), ...): the attention output [R, Hq * D]; k and v
    of each row's token are written into the caches. One launch on the GPU."""
    if (scale is not None) != (weight.dtype == FP8_DTYPE):
        raise TypeError("FP8 weights need their per-channel scale, other weights none")
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    if not want_triton(x, use_triton):
        qkv = fused_linear_reference(x, weight, scale, norm_weight=norm_weight, eps=eps)
        return qk_norm_rope_attend_reference(
            qkv, q_weight, k_weight, positions, slots, k_cache, v_cache, theta=theta, **kw
        )
    from ttsbuild.plugins._tl.fused_linear import norm_linear_attend_triton

    D = k_cache.shape[-1]
    return norm_linear_attend_triton(
        x, norm_weight, weight, scale, q_weight, k_weight, inv_freq(D, theta, x.device),
        positions, slots, k_cache, v_cache, attn_scale=D**-0.5, config=config, **kw,
    )  # fmt: skip


def norm_linear_ring_attend(
    x: torch.Tensor,  # [B * F, K]: the layer input, B streams x F frames (frame-major)
    norm_weight: torch.Tensor,  # [K]: the input norm
    weight: torch.Tensor,  # [3 H D, K]: the packed qkv projection
    scale: torch.Tensor | None,  # [3 H D]: FP8 (needed) or scaled half weights
    bias: torch.Tensor | None,  # [3 H D]
    pos: torch.Tensor,  # [B]: frames each stream decoded before this step
    rows: torch.Tensor,  # [B]: the streams' slots in the rings
    k_ring: torch.Tensor,  # [slots, H, R, D]
    v_ring: torch.Tensor,
    inv_freq: torch.Tensor,  # [D / 2]
    *,
    window: int,
    attn_scale: float,
    eps: float,
    gemv_rows_f32: int | None = None,
    use_triton: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """ring_attention_rope(norm_linear(x, ...) + bias, ...): the codec pre-transformer's
    attention output [B * F, H D], its new keys and values written into the rows' rings. One
    launch on the GPU: the qkv GEMV, and each head's RoPE, ring writes and windowed attention
    run by the program that wrote the head's last qkv tile (as norm_linear_attend's groups),
    one launch a layer fewer than the two ops."""
    from ttsbuild.plugins.ring_attention import ring_attention_rope

    _check_scale(weight, scale)
    B, (M, K) = pos.shape[0], x.shape
    _, H, R, D = k_ring.shape
    if M % max(B, 1) or weight.shape != (3 * H * D, K) or rows.shape != (B,):
        raise ValueError(f"norm_linear_ring_attend needs x [B * F, K], weight [3 H D, K] and "
                         f"rows [B]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"rows {tuple(rows.shape)}, {B} positions, rings {tuple(k_ring.shape)}")
    F = M // max(B, 1)
    if not want_triton(x, use_triton):
        qkv = fused_linear_reference(x, weight, scale, norm_weight=norm_weight, eps=eps,
                                     bias=bias)  # fmt: skip
        y = ring_attention_rope(qkv.view(B, F, 3 * H, D), pos, rows, k_ring, v_ring, inv_freq,
                                window, attn_scale, use_triton=False)  # fmt: skip
        return y.view(M, H * D)
    if not (k_ring.is_contiguous() and v_ring.is_contiguous()) or D & (D - 1):
        raise ValueError(f"the kernel needs contiguous rings and a power-of-two head size, got "
                         f"{D}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows")
    from ttsbuild.plugins._tl.fused_linear import norm_linear_ring_attend_triton

    return norm_linear_ring_attend_triton(
        x, norm_weight, weight, scale, bias, pos, rows, k_ring, v_ring, inv_freq, frames=F,
        window=window, attn_scale=attn_scale, eps=eps, gemv_rows_f32=gemv_rows_f32,
        config=config,
    )  # fmt: skip


def norm_linear_sample(
    x: torch.Tensor,  # [M, K]: the residual stream before the final norm
    norm_weight: torch.Tensor,  # [K]
    weight: torch.Tensor,  # [V, K]: the head
    scale: torch.Tensor | None,  # FP8 weights only
    batch: SamplingBatch,
    seeds: torch.Tensor,  # [M] int64
    counters: torch.Tensor,  # [M] int64
    *,
    eps: float,
    use_triton: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """fused_sample(norm_linear(x, ..., out_dtype=float32), batch, seeds, counters): the
    tokens [M] int64. One launch on the GPU."""
    if (scale is not None) != (weight.dtype == FP8_DTYPE):
        raise TypeError("FP8 weights need their per-channel scale, other weights none")
    if not want_triton(x, use_triton):
        logits = fused_linear_reference(x, weight, scale, norm_weight=norm_weight, eps=eps,
                                        out_dtype=torch.float32)  # fmt: skip
        return fused_sample_reference(logits, batch, seeds, counters)
    from ttsbuild.plugins._tl.fused_linear import norm_linear_sample_triton

    return norm_linear_sample_triton(x, norm_weight, weight, scale, batch, seeds, counters,
                                     eps=eps, config=config)[0]  # fmt: skip
