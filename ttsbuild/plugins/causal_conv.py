"""The codec's convolutions: stride-1 convs as one implicit-GEMM launch (bias and residual
fused), and the overlap-add that finishes a transposed conv computed as one GEMM.

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
dtype. Optionally (alpha, inv_beta) a SnakeBeta is applied to the input tiles as they load,
for convs whose input carries no left context (the residual units' 1x1 convs), or
(out_alpha, out_inv_beta) one to the output tile before it is stored: the residual unit's
second SnakeBeta in its k = 7 conv's epilogue, once per element, where in the 1x1 conv's
load it is recomputed for every block of output channels and sits between each K step's
load and its MMA. The output is rounded to its dtype first, so either place gives the same
bits. Half precision only (fp16, bf16): the engine runs fp32 stages as im2col + GEMM.

    residual_unit(xin, w7, b7, d, alpha2, inv_beta2, w1, b1, residual) -> [B, C, n]
    a decoder residual unit after its first SnakeBeta (the k = 7 conv, the second SnakeBeta,
    the 1x1 conv, the residual) as one launch, the SnakeBeta'd tile kept in registers
    (slower than its two launches on an H100 so far: the engine takes it only when asked).

    conv_output_taps(xin, w, bias, d, residual, taps_w [Cout, 16], alpha, inv_beta, ...)
        -> z [B, n, 16] fp32
    the conv as above (its output y rounded to xin's dtype) and, in its epilogue, the codec's
    output stage up to its taps: z[b, t, j] = sum_o taps_w[o, j] * snake(y[b, o, t]) (the
    SnakeBeta and the products in fp32, no rounding: the output stage is strict fp32), where
    taps_w column j is tap j of the conv to one channel (`pack_output_taps`). y itself is
    never stored: `codec_output.output_from_taps` adds the taps along time and clamps (one
    tile holds every output channel: Cout <= OUTPUT_TAPS_MAX_COUT).

    overlap_add(z [B, n, taps, s, Cout], spill [S, Cout, (taps - 1) * s], rows [B],
                bias [Cout]) -> y [B, Cout, n * s], spill rows advanced in place
    A transposed conv (kernel = taps * stride s) of x [B, Cin, n] is z = x^T @ w (one GEMM:
    frame t's contribution to output blocks t .. t + taps - 1) followed by
    y[b, :, t * s + r] = bias + sum_j z[b, t - j, j, r] (t - j < 0: the slot's spill, what the
    previous step's frames contributed past their end), and the new spill block q
    (q < taps - 1) = sum_{j > q} z[b, n + q - j, j] (+ the old spill block n + q when it is
    still ahead). Eager that is a cat, two in-place adds per tap, a gather and a scatter of
    the spill and a bias add; the kernel does it in one pass, one program per (row, block of
    output samples, block of channels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ttsbuild.plugins._dispatch import (
    codec_pdl_args,
    on_hopper,
    tma_capable,
    triton_available,
    want_triton,
)
from ttsbuild.plugins.codec_context import snake_context_reference, to_channels_last


def pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d weight [Cout, Cin, k] -> the kernel's operand [k, Cin, Cout], contiguous."""
    return weight.permute(2, 1, 0).contiguous()


def pack_tconv_as_conv(weight: torch.Tensor, bias: torch.Tensor,
                       stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.ConvTranspose1d weight [Cin, Cout, taps * stride] and bias [Cout] -> the operand
    [taps, Cin, stride * Cout] and bias [stride * Cout] of a causal conv of k = taps over the
    same input with the same output: tap j reads input frame t - (taps - 1) + j, whose part
    of output sample t * stride + r is W[:, :, (taps - 1 - j) * stride + r]; output channel
    r * Cout + co, so [B, n, stride, Cout] storage is the [B, n * stride, Cout] output
    (runtime.codec_engine TCONV_CONV)."""
    cin, cout, k = weight.shape
    if k % stride:
        raise ValueError(f"needs kernel % stride == 0, got kernel {k}, stride {stride}")
    taps = k // stride
    w = weight.view(cin, cout, taps, stride).flip(2).permute(2, 0, 3, 1)  # [j, Cin, r, Cout]
    return w.reshape(taps, cin, stride * cout).contiguous(), bias.repeat(stride).contiguous()


# The output taps' width: the tap count padded to the fp32 product's minimum of 16
TAPS_WIDTH = 16
# conv_output_taps' tile holds every output channel (one block of a power of two)
OUTPUT_TAPS_MAX_COUT = 128
# ... on this many warps: the last 1x1 conv's 64 x 128 tile with the taps' SnakeBeta and
# [64, 128] x [128, 16] fp32 product in its epilogue takes 255 registers a thread and spills
# 336 bytes on one warpgroup, 115 registers and no spills on two (offline sm_90 compile,
# `benchmarks/codec/ptx_loads.py --registers`; the 1x1 conv alone: 148 on one). Seven
# per-tap row sums in place of the product took 195 / 128.
OUTPUT_TAPS_WARPS = 8


def pack_output_taps(w: torch.Tensor) -> torch.Tensor:
    """The codec's output conv, packed (`pack_conv_weight`: [k, C, 1], k <= 16) -> taps_w
    [C, 16] fp32: column j is tap j, zero past k (conv_output_taps' epilogue operand)."""
    k, C, cout = w.shape
    if cout != 1 or k > TAPS_WIDTH:
        raise ValueError(f"the output taps need a conv to one channel of at most {TAPS_WIDTH} "
                         f"taps, got packed weight {tuple(w.shape)}")
    taps = torch.zeros((C, TAPS_WIDTH), dtype=torch.float32, device=w.device)
    taps[:, :k] = w[:, :, 0].T.float()
    return taps


def output_taps_reference(y, taps_w, alpha, inv_beta):
    """z [B, n, 16] fp32 = sum_o taps_w[o, j] * snake(y[b, o, t]) of a [B, Cout, n] tensor:
    the SnakeBeta (alpha, inv_beta: Cout fp32 values) of y's values in fp32, unrounded."""
    s = snake_context_reference(y.float(), alpha.reshape(-1, 1).float(),
                                inv_beta.reshape(-1, 1).float(), None, None)
    return torch.einsum("bot,oj->btj", s, taps_w.float())


def conv_output_taps(xin, w, bias, dilation, residual, taps_w, alpha, inv_beta, *,
                     in_alpha=None, in_inv_beta=None, split: bool | None = None,
                     use_triton: bool | None = None):
    """See the module docstring: z [B, n, 16] fp32 (a view of [16, B, n] storage on the
    kernel's path). in_alpha, in_inv_beta: a SnakeBeta applied to the input as it loads (as
    causal_conv's alpha, inv_beta). One launch on the GPU, the rows' y never stored."""
    cout = w.shape[-1]
    if taps_w.shape != (cout, TAPS_WIDTH) or taps_w.dtype != torch.float32:
        raise ValueError(f"taps_w must be fp32 [{cout}, {TAPS_WIDTH}], got "
                         f"{tuple(taps_w.shape)} {taps_w.dtype}")
    if (xin.dtype not in (torch.float16, torch.bfloat16) or not want_triton(xin, use_triton)
            or cout > OUTPUT_TAPS_MAX_COUT):
        if use_triton and (xin.dtype not in (torch.float16, torch.bfloat16)
                           or cout > OUTPUT_TAPS_MAX_COUT):
            raise ValueError(f"the output taps' kernel takes fp16 or bf16 and at most "
                             f"{OUTPUT_TAPS_MAX_COUT} channels, not {xin.dtype} x {cout}")
        y = causal_conv_reference(xin, w, bias, dilation, residual, in_alpha, in_inv_beta)
        return output_taps_reference(y, taps_w, alpha, inv_beta)
    return _causal_conv_triton(xin, w, bias, dilation, residual, in_alpha, in_inv_beta,
                               split=split, taps=(taps_w, alpha, inv_beta))


def causal_conv_reference(xin, w, bias, dilation, residual=None, alpha=None, inv_beta=None,
                          out_alpha=None, out_inv_beta=None):
    """F.conv1d on the unpacked weight (of SnakeBeta(xin) when alpha/inv_beta [C, 1] fp32 are
    given: x + inv_beta * sin(alpha * x)^2 in fp32, rounded to xin's dtype); the residual
    added in fp32, rounded once; then SnakeBeta(out_alpha, out_inv_beta) of that, if given."""
    if alpha is not None:
        xin = snake_context_reference(xin, alpha, inv_beta, None, None)
    y = F.conv1d(xin, w.permute(2, 1, 0), None, dilation=dilation).float()
    if bias is not None:
        y = y + bias.float()[:, None]
    if residual is not None:
        y = y + residual.float()
    y = y.to(xin.dtype)
    return y if out_alpha is None else snake_context_reference(y, out_alpha, out_inv_beta,
                                                               None, None)


def causal_conv(xin, w, bias, dilation, residual=None, alpha=None, inv_beta=None, *,
                out_alpha=None, out_inv_beta=None, channels_last: bool = False,
                split: bool | None = None, tma: bool | None = None, next_act=None,
                use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU. alpha, inv_beta: a SnakeBeta applied
    to the input first (only where the input carries no left context that already had it);
    out_alpha, out_inv_beta: one applied to the output last.
    channels_last: y is a [B, Cout, n] view of a contiguous [B, n, Cout] tensor, as
    `snake_context(channels_last=True)` makes the input, so a conv reading y reads along
    contiguous channels too (the kernel takes any input and residual strides).
    split: whether tiles that leave SMs idle split over K (`_split_k`); None: SPLIT_K.
    tma: the TMA kernel where it takes the conv (`_tma_fits`); None: CONV_TMA.
    next_act: (alpha, inv_beta, dst): SnakeBeta of the output (after out_alpha's, if any) also
    written to dst, a [B, Cout, n] view of xin's dtype (the next conv's input beside its left
    context: snake_context's SnakeBeta of y, the same rounding steps), by the epilogue."""
    if next_act is not None:
        _check_next_act(next_act, xin.shape[0], w.shape[-1], xin.dtype)
    if xin.dtype not in (torch.float16, torch.bfloat16) or not want_triton(xin, use_triton):
        if use_triton and xin.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the causal_conv kernel takes fp16 or bf16, not {xin.dtype}")
        y = causal_conv_reference(xin, w, bias, dilation, residual, alpha, inv_beta,
                                  out_alpha, out_inv_beta)
        _next_act_reference(next_act, y)
        return to_channels_last(y) if channels_last else y
    return _causal_conv_triton(xin, w, bias, dilation, residual, alpha, inv_beta, channels_last,
                               out_alpha=out_alpha, out_inv_beta=out_inv_beta, split=split,
                               tma=tma, next_act=next_act)


def _next_act_reference(next_act, y) -> None:
    """The reference paths' next_act (if any): snake_context's SnakeBeta of y into dst."""
    if next_act is not None:
        next_act[2].copy_(snake_context_reference(y, next_act[0], next_act[1], None, None))


def _check_next_act(next_act, B: int, cout: int, dtype: torch.dtype) -> None:
    """causal_conv's or overlap_add's next_act: (alpha, inv_beta) Cout contiguous fp32 values
    each and a [B, Cout, n] destination of the output's dtype."""
    alpha, inv_beta, dst = next_act
    for name, p in (("alpha", alpha), ("inv_beta", inv_beta)):
        if p.numel() != cout or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"next_act's {name} must be {cout} contiguous fp32 values, got "
                             f"{tuple(p.shape)} {p.dtype}")
    if dst.dim() != 3 or dst.shape[:2] != (B, cout) or dst.dtype != dtype:
        raise ValueError(f"next_act's destination must be [{B}, {cout}, n] {dtype}, got "
                         f"{tuple(dst.shape)} {dst.dtype}")


# 1x1 convs with no SnakeBeta in their load (the residual units' second conv once the first
# took that SnakeBeta in its epilogue, as served at every size): tiles as wide as the k = 7
# convs' where they still fill the SMs. The 2026-12-04 rule below (64-row tiles, 32-channel K
# steps) was found with the SnakeBeta in the load; without it, at 64 streams on an H100
# (sweep_conv.py kind 1x1, benchmarks/codec/2026-12-06-h100-output-epilogue/call3):
# C = 768 / 384 / 192 0.0119 / 0.0151 / 0.0275 ms at the old rule, 0.0097 / 0.0120 / 0.0216
# at (64, 64, 64, 4) / (128, 64, 128, 8) / (128, 64, 64, 8), the grid's best. C = 96 (K steps
# of 32) keeps the old rule: its best, (64, 32, 128, 4, 4 stages), was 5 % off it.
# TTSBUILD_CODEC_PLAIN_1X1_TILES=0 puts the old rule back.
PLAIN_1X1_TILES = os.environ.get("TTSBUILD_CODEC_PLAIN_1X1_TILES", "1") == "1"


def _config(m: int, cin: int, cout: int, k: int = 7, in_snake: bool = True,
            sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_CI, BLOCK_O, num_warps) for M = B * n output rows of a width-k conv:
    128 x 128 tiles with two warpgroups where there are rows enough, else tiles of >= 16 (the
    MMA minimum) no wider than the problem, so masked lanes stay few. A 1x1 conv (the
    residual units' second) has k times less work per row and is memory-bound. With SnakeBeta
    on its input (in_snake): 64-row tiles of one warpgroup and 32-channel K steps, which ran
    1.3-1.8x faster at every decoder stage at 64 and 256 rows on the H200 (sweep_conv.py,
    benchmarks/codec/2026-12-04-h200-convsweep); without it, see PLAIN_1X1_TILES (sms: the
    GPU's SM count, which the 128-row tiles must fill). The k = 7 convs are at the grid's
    best."""
    import triton

    block_ci = 64 if cin % 64 == 0 else 32
    if m >= 2048 and k == 1 and not in_snake and block_ci == 64 and PLAIN_1X1_TILES:
        bo = 128 if cout % 128 == 0 else 64  # no masked half tile (C = 192: 3 x 64)
        if triton.cdiv(m, 128) * triton.cdiv(cout, bo) >= sms:
            return 128, 64, bo, 8
        return 64, 64, 64, 4
    if m >= 2048 and k == 1:
        return 64, 32, 128 if cout > 64 else 64, 4
    if m >= 2048:
        return 128, block_ci, 128 if cout > 64 else 64, 8
    return min(64, max(16, triton.next_power_of_2(m))), block_ci, 64 if cout >= 64 else \
        max(16, triton.next_power_of_2(cout)), 4


def _conv_out(xin, n: int, cout: int, channels_last: bool, residual):
    """The output [B, Cout, n] (a view of contiguous [B, n, Cout] with channels_last), after
    checking that the residual, if any, has its shape."""
    B = xin.shape[0]
    if channels_last:
        out = torch.empty((B, n, cout), dtype=xin.dtype, device=xin.device).transpose(1, 2)
    else:
        out = torch.empty((B, cout, n), dtype=xin.dtype, device=xin.device)
    if residual is not None and residual.shape != out.shape:
        raise ValueError(f"residual must be {tuple(out.shape)}, got {tuple(residual.shape)}")
    return out


# The two-warpgroup tile with the epilogue SnakeBeta capped at this many registers a thread:
# uncapped it takes 189 (one CTA an SM); capped it spills 404 bytes in the epilogue only
# (offline sm_90 compile) and ran faster at every decoder stage's shape at 64 rows on an H100
# (sweep_conv.py kind k7s128 against k7s: 0.056 / 0.052 / 0.077 / 0.092 ms against 0.057 /
# 0.063 / 0.097 / 0.133 at C = 768 / 384 / 192 / 96; call1-h100 of
# benchmarks/codec/2026-12-06-codec-three-kernels).
EPILOGUE_MAXNREG = 128


# K steps over the flattened (tap, channel) index for the multi-tap convs of channels-last
# inputs whose channel count is a multiple of 32 but not of 64 (the decoder's last block,
# C = 96): 64-wide steps that may span two taps (11 of them for k = 7) instead of 32-wide
# steps within one tap (21), each a run of 32-channel vector loads. The served codec step on
# an H100, two alternated rounds, one process a side, with the epilogue SnakeBeta at every
# size (benchmarks/codec/2026-12-06-h100-flat-k-epilogue): batch 1 / 64 / 256 0.658 / 2.454
# / 7.355 -> 0.648 / 2.440 / 7.208 ms. Not for 1x1 convs: their K (96) becomes one full step
# and one half-masked one, and with the SnakeBeta in their load that lost (batch 64 2.479 ->
# 2.568 ms with it on every conv). TTSBUILD_CODEC_FLAT_K=0 turns it off.
FLAT_K = os.environ.get("TTSBUILD_CODEC_FLAT_K", "1") == "1"
FLAT_RUN = 32


def _flat_k(xin, cin: int, k: int, flat_k: bool | None) -> bool:
    """Whether the k-tap conv of `xin` takes the flattened K steps (see FLAT_K)."""
    if k < 2 or not (FLAT_K if flat_k is None else flat_k):
        return False
    return (xin.stride(1) == 1 and cin % FLAT_RUN == 0 and cin % 64 != 0
            and xin.stride(2) % FLAT_RUN == 0 and xin.stride(0) % FLAT_RUN == 0)


# Split-K for convs whose output tiles leave SMs idle (the one-stream step's short convs: 32
# rows x 768 channels is 12 tiles of 64 x 64 over a K of 5,376): SPLIT programs per tile, each
# summing a contiguous range of the K steps into an fp32 workspace; the last to arrive at the
# tile's counter (acq_rel atomic, as fused_linear's split-K) adds the partials and runs the
# epilogue (bias, residual, SnakeBeta, store) and resets the counter. One launch where
# im2col + cuBLAS takes a copy, a split-K GEMM and its reduction. The codec engine asks for
# it (`split`) on steps of few streams (codec_engine.CONV_SPLIT_MAX_STREAMS, where it also
# takes the short convs on this kernel); TTSBUILD_CODEC_CONV_SPLIT=1 turns it on for every
# call that does not say.
SPLIT_K = os.environ.get("TTSBUILD_CODEC_CONV_SPLIT", "0") == "1"
SPLIT_MAX = 16


def _few_tiles(spec: str) -> dict[int, tuple[int, ...]]:
    """"C:BLOCK_M,BLOCK_CI,BLOCK_O,warps,stages[,split];..." -> {C: (..)} (FEW_TILES). Entries
    are separated by ';' or '/' (gpu_session.sh's CODEC_ENV splits its variants on ';')."""
    tiles: dict[int, tuple[int, ...]] = {}
    for entry in filter(None, (e.strip() for e in spec.replace("/", ";").split(";"))):
        try:
            c, rest = entry.split(":")
            vals = tuple(int(v) for v in rest.split(","))
            c = int(c)
        except ValueError:
            raise ValueError(f"TTSBUILD_CODEC_FEW_TILES entries are 'C:BLOCK_M,BLOCK_CI,"
                             f"BLOCK_O,warps,stages[,split]', got {entry!r}") from None
        if len(vals) not in (5, 6) or c < 1 or any(v < 1 for v in vals) \
                or any(v & (v - 1) for v in vals[:4]):
            raise ValueError(f"TTSBUILD_CODEC_FEW_TILES {entry!r}: five or six positive "
                             "values, the block sizes and warps powers of two")
        tiles[c] = vals
    return tiles


# The multi-tap convs of few-stream steps (those the engine splits over K: `split=True`,
# codec_engine.CONV_SPLIT_MAX_STREAMS) of up to FEW_TILES_MAX_STREAMS streams on a tile given
# per output channel count, with an optional split count, in place of `_config`'s tile and
# the automatic split. At one stream `_config`'s tiles took 9.2-10.4 us a k = 7 conv whatever
# its size (H100, 2026-12-06); `sweep_conv.py --batches 1`'s winners (FEW_TILES_HOPPER) took
# 5.6-8.6, and in the served codec step at 1 / 2 / 4 / 8 streams 0.528 / 0.633 / 0.751 /
# 0.786 -> 0.507 / 0.586 / 0.649 / 0.808 ms (two rounds, the same to 0.002; 8 streams lose,
# hence the bound of 4; benchmarks/codec/2026-12-06-h100-few-tiles). On by default on sm_90
# and newer (the tiles were chosen there); TTSBUILD_CODEC_FEW_TILES="C:BLOCK_M,BLOCK_CI,
# BLOCK_O,warps,stages[,split];..." puts others on any device, "" none.
FEW_TILES_HOPPER = {768: (32, 64, 32, 4, 4, 8), 384: (32, 64, 64, 8, 4),
                    192: (16, 64, 64, 4, 3, 1), 96: (64, 64, 32, 4, 3)}  # fmt: skip
_FEW_ENV = os.environ.get("TTSBUILD_CODEC_FEW_TILES")
FEW_TILES = None if _FEW_ENV is None else _few_tiles(_FEW_ENV)  # None: FEW_TILES_HOPPER there
FEW_TILES_MAX_STREAMS = int(os.environ.get("TTSBUILD_CODEC_FEW_TILES_MAX_STREAMS", "4"))


def _few_tile(xin, cout: int) -> tuple[int, ...] | None:
    """The FEW_TILES tile of a few-stream multi-tap conv of `cout` outputs, or None."""
    if xin.shape[0] > FEW_TILES_MAX_STREAMS:
        return None
    tiles = FEW_TILES if FEW_TILES is not None else (FEW_TILES_HOPPER if on_hopper(xin) else {})
    return tiles.get(cout)


def _split_k(tiles: int, k_steps: int, sms: int, split_k: int | None,
             auto: bool | None = None) -> int:
    """Programs a tile (a power of two): split_k where given, else 1 unless `auto` (None:
    SPLIT_K), then the most that keep the grid within one wave of `sms` programs and >= 2 K
    steps a program."""
    if split_k is not None:
        return max(1, min(split_k, k_steps))
    auto = SPLIT_K if auto is None else auto
    split = 1
    while (auto and split < SPLIT_MAX and tiles * split * 2 <= sms
           and k_steps >= 4 * split):
        split *= 2
    return split


# Multi-tap convs of long per-stream steps on TMA loads (`_conv_tma_kernel`): the input is
# channels-last, so tap j's input tile of one stream's rows t0..t0 + BLOCK_M is one [rows,
# channels] box at (b, t0 + j dilation, c0), which a tensor descriptor loads into shared
# memory asynchronously (the copy engine zero-fills past the stream's samples and channels),
# and the loop over (tap, channel block) is software-pipelined by Triton over NUM_STAGES
# buffers feeding the tensor cores; the pointer-gather tiles of `_conv_acc` are issued by
# every thread and spend registers on addresses. Tiles never span two streams, so a step
# of n samples a stream wastes rows where n is not a multiple of BLOCK_M: only where
# n >= CONV_TMA_MIN_N (the last two decoder stages at one frame a step: 640 and 1920). The
# k = 7 convs were 180-450 TFLOP/s on an H100 at their tile grid's best (2026-12-06), ~1.24
# of the 2.25 ms 64-stream step and 4.2 of 6.8 at 256. On an H100 (sweep_conv.py kind
# k7stma, benchmarks/codec/2026-12-06-h100-output-epilogue/call6), the k = 7 conv with its
# epilogue SnakeBeta, against the served pointer-gather kernel in the same run: C = 192, 640
# samples a stream, 0.0666 / 0.2569 ms against 0.0778 / 0.3218 at 64 / 256 streams; C = 96
# (1920 samples) lost, 0.1149 / 0.3803 against 0.0873 / 0.3052 (K and output blocks of 64 and
# 128 over 96 channels), as did 384 and 768 at 160 and 32 samples (rows wasted at a stream's
# end). Hence channels in multiples of 64 and CONV_TMA_MIN_N. The served codec step on an
# H100, two alternated rounds, one process a side (benchmarks/codec/2026-12-06-h100-tma-on,
# call1): batch 1 / 8 / 64 / 256 0.532 / 0.834 / 2.284 / 6.798 -> 0.535 / 0.788 / 2.203 /
# 6.617 ms (round 2: 0.533 / 0.830 / 2.276 / 6.799 -> 0.534 / 0.786 / 2.202 / 6.615), 53.2 dB
# either way; with it on, the first 22 of the codec engine's 37 GPU tests passed (call3; the
# call's time ran out before the rest). On by default on sm_90 and newer (TMA hardware);
# TTSBUILD_CODEC_CONV_TMA=0 turns it off.
CONV_TMA = os.environ.get("TTSBUILD_CODEC_CONV_TMA", "1") == "1"
CONV_TMA_MIN_N = int(os.environ.get("TTSBUILD_CODEC_CONV_TMA_MIN_N", "512"))


def _tma_fits(xin, w, n: int, alpha, split: int, taps, tma: bool | None) -> bool:
    """Whether the conv runs on `_conv_tma_kernel` (see CONV_TMA): on where asked (tma, else
    the switch, on a CUDA GPU of sm_90 or newer with a Triton that has host-side tensor
    descriptors), a multi-tap conv with no SnakeBeta in its load, no split-K, no output
    taps, of >= CONV_TMA_MIN_N samples a stream and channels in multiples of 64 (tma=True:
    any), over a channels-last input whose [B, L, Cin] storage is contiguous with 16-byte
    rows (a tensor descriptor's strides)."""
    if not (CONV_TMA if tma is None else tma) or taps is not None or alpha is not None:
        return False
    if tma is None and not tma_capable(xin):
        return False  # the switch's default: GPUs with TMA copies and a Triton that has them
    k, cin, cout = w.shape
    B, _, L = xin.shape
    return (k > 1 and split == 1 and (tma or n >= CONV_TMA_MIN_N)
            and (tma or (cin % 64 == 0 and cout % 64 == 0))
            and xin.stride() == (L * cin, 1, cin) and (cin * xin.element_size()) % 16 == 0
            and (cout * w.element_size()) % 16 == 0 and xin.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0)


def _tma_config(cout: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_CI, BLOCK_O, num_warps, num_stages) of `_conv_tma_kernel`: 128-row
    tiles of two warpgroups, output blocks that leave no masked half where 64 divides Cout."""
    import triton

    bo = 64 if cout % 128 and cout % 64 == 0 else min(128, max(16, triton.next_power_of_2(cout)))
    return 128, 64, bo, 8, 4


def _causal_conv_tma(xin, w, bias, dilation, residual, out_alpha, out_inv_beta, out,
                     config=None):
    """The conv on `_conv_tma_kernel` into `out` (see CONV_TMA; `_tma_fits` holds)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, cin, L = xin.shape
    k, _, cout = w.shape
    n = out.shape[-1]
    bm, bci, bo, warps, stages = config or _tma_config(cout)
    x_desc = TensorDescriptor(xin, [B, L, cin], [L * cin, cin, 1], [1, bm, bci])
    w_desc = TensorDescriptor(w, [k * cin, cout], [cout, 1], [bci, bo])
    res = residual if residual is not None else out
    out_snake = out_alpha is not None
    grid = (triton.cdiv(cout, bo), B * triton.cdiv(n, bm))
    _conv_tma_kernel[grid](
        x_desc, w_desc, bias if bias is not None else w, res, out,
        out_alpha if out_snake else w, out_inv_beta if out_snake else w, cin, cout, n,
        dilation, res.stride(0), res.stride(1), res.stride(2), out.stride(0), out.stride(1),
        out.stride(2),
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_OUT_SNAKE=out_snake,
        BLOCK_M=bm, BLOCK_CI=bci, BLOCK_O=bo, NUM_STAGES=stages, num_warps=warps,
        **codec_pdl_args(xin),
    )  # fmt: skip
    return out


def _causal_conv_triton(xin, w, bias, dilation, residual, alpha=None, inv_beta=None,
                        channels_last=False, config=None, out_alpha=None, out_inv_beta=None,
                        maxnreg: int | None = None, flat_k: bool | None = None,
                        split_k: int | None = None, split: bool | None = None,
                        taps=None, tma: bool | None = None, next_act=None):
    """taps: (taps_w, alpha, inv_beta) of `conv_output_taps`: z [B, n, 16] fp32 returned in
    place of the output (one tile of every output channel). next_act: see causal_conv (not
    with taps; never on the TMA kernel).
    config: (BLOCK_M, BLOCK_CI, BLOCK_O, num_warps, num_stages) in place of `_config`'s
    (benchmarks/codec/sweep_conv.py times a grid of them). maxnreg: a cap on the registers a
    thread (Triton's compile option; timing only: with the epilogue SnakeBeta the 128 x 128
    tile of 8 warps takes 189 registers against 121, one CTA an SM instead of two, in an
    offline sm_90 compile, `benchmarks/codec/ptx_loads.py --registers`). flat_k: the
    flattened K steps (FLAT_K) where the input allows them; None: the switch decides.
    split_k: programs a tile (SPLIT_K's split-K); None: `split` (None: the switch) and the
    grid decide. tma: the TMA kernel where `_tma_fits` (None: CONV_TMA); with it, config is
    that kernel's (`_tma_config`)."""
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
    if taps is None:
        out = _conv_out(xin, n, cout, channels_last, residual)
    else:  # z as a [B, n, 16] view of [16, B, n] (each tap's values contiguous along rows)
        if residual is not None and residual.shape != (B, cout, n):
            raise ValueError(f"residual must be {(B, cout, n)}, got {tuple(residual.shape)}")
        out = torch.empty((TAPS_WIDTH, B, n), dtype=torch.float32,
                          device=xin.device).permute(1, 2, 0)  # fmt: skip
        out_alpha, out_inv_beta = taps[1], taps[2]
    from ttsbuild.plugins._tl.fp8_linear import _MAX_TILES, _counters, _num_sms

    sms = _num_sms(xin.device)
    few = _few_tile(xin, cout) if (config is None and split is True and k > 1
                                   and taps is None) else None  # fmt: skip
    if few is not None:  # see FEW_TILES: as an explicit config of this kernel (sweep_conv's)
        config, tma = few[:5], False
        if len(few) == 6 and split_k is None:
            split_k = few[5]
    bm, bci, bo, warps, stages = config or (
        *_config(B * n, cin, cout, k, in_snake=alpha is not None, sms=sms), 3)
    if taps is not None:  # every output channel in the tile
        bo = max(16, triton.next_power_of_2(cout))
        if config is None:  # two warpgroups: see OUTPUT_TAPS_WARPS
            warps = OUTPUT_TAPS_WARPS
    flat = _flat_k(xin, cin, k, flat_k)
    if flat and config is None:
        bci = 64  # two 32-channel runs a step
    if config is None and maxnreg is None and out_alpha is not None and warps == 8 \
            and taps is None:
        maxnreg = EPILOGUE_MAXNREG  # the two-warpgroup tile with the epilogue SnakeBeta
    tiles = triton.cdiv(B * n, bm) * triton.cdiv(cout, bo)
    k_steps = triton.cdiv(k * cin, bci) if flat else k * triton.cdiv(cin, bci)
    split = _split_k(tiles, k_steps, sms, split_k, split)
    if split > 1 and tiles > _MAX_TILES:
        split = 1
    if next_act is not None and (taps is not None or next_act[2].shape[-1] != n):
        raise ValueError(f"next_act takes a [B, Cout, {n}] destination and no output taps")
    if next_act is None and _tma_fits(xin, w, n, alpha, split, taps, tma):
        return _causal_conv_tma(xin, w, bias, dilation, residual, out_alpha, out_inv_beta,
                                out, config if tma else None)
    if split > 1:  # partials [split, M, Cout] fp32 and the tiles' arrival counters
        ws = torch.empty(split * B * n * cout, dtype=torch.float32, device=xin.device)
        cnt = _counters(xin.device)
    else:
        ws = cnt = w
    grid = (triton.cdiv(B * n, bm), triton.cdiv(cout, bo), split)
    for name, p, c in (("alpha", alpha, cin), ("inv_beta", inv_beta, cin),
                       ("out_alpha", out_alpha, cout), ("out_inv_beta", out_inv_beta, cout)):
        if p is not None and (p.numel() != c or p.dtype != torch.float32
                              or not p.is_contiguous()):
            raise ValueError(f"{name} must be {c} contiguous fp32 values, got "
                             f"{tuple(p.shape)} {p.dtype}")
    if (alpha is None) != (inv_beta is None) or (out_alpha is None) != (out_inv_beta is None):
        raise ValueError("a SnakeBeta takes both alpha and inv_beta")
    res = residual if residual is not None else (xin if taps is not None else out)
    snake, out_snake = alpha is not None, out_alpha is not None
    # with taps the kernel rounds y to xin's dtype (its out_ptr) and stores z instead
    dst = xin if taps is not None else out
    so = (0, 0, 0) if taps is not None else out.stride()
    nxt = next_act[2] if next_act is not None else out
    _causal_conv_kernel[grid](
        xin, w, bias if bias is not None else w, res, dst, alpha if snake else w,
        inv_beta if snake else w, out_alpha if out_snake else w,
        out_inv_beta if out_snake else w, ws, cnt, taps[0] if taps is not None else w,
        out if taps is not None else w, nxt,
        next_act[0] if next_act is not None else w, next_act[1] if next_act is not None else w,
        B * n, cin, cout, n, dilation,
        xin.stride(0), xin.stride(1), xin.stride(2), res.stride(0), res.stride(1), res.stride(2),
        *so, *(nxt.stride() if next_act is not None else (0, 0, 0)),
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_SNAKE=snake,
        HAS_OUT_SNAKE=out_snake and taps is None, OUT_TAPS=taps is not None,
        NEXT_SNAKE=next_act is not None,
        FLAT_K=FLAT_RUN if flat else 0, SPLIT_K=split,
        BLOCK_M=bm, BLOCK_CI=bci, BLOCK_O=bo, num_warps=warps, num_stages=stages,
        **codec_pdl_args(xin), **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return out


def residual_unit(xin, w7, b7, dilation, alpha2, inv_beta2, w1, b1, residual, *,
                  channels_last: bool = False, use_triton: bool | None = None):
    """A decoder residual unit after its first SnakeBeta, in one launch on the GPU:
        residual + conv_1x1(SnakeBeta2(conv_k(xin)))
    xin [B, C, n + (k - 1) * d] (SnakeBeta1 of the unit's input, left context in front, as
    `snake_context` makes it), w7 [k, C, C] and w1 [1, C, C] packed (`pack_conv_weight`),
    b7, b1 [C], (alpha2, inv_beta2) [C] fp32, residual [B, C, n] -> [B, C, n]. The same
    roundings as the two launches (`causal_conv` with out_alpha, then the 1x1 conv with the
    residual): the k-tap conv's output rounded to the input dtype, its SnakeBeta in fp32
    rounded again, the 1x1 conv and the residual summed in fp32 and rounded once. The kernel
    keeps the SnakeBeta'd tile in registers as the second product's operand: the
    intermediate [B, C, n] is never written or read back, and one launch of two goes."""
    k, C, cout = w7.shape
    if cout != C or w1.shape != (1, C, C) or residual is None:
        raise ValueError(f"residual_unit: w7 [k, C, C], w1 [1, C, C] and a residual, got w7 "
                         f"{tuple(w7.shape)}, w1 {tuple(w1.shape)}")
    if (xin.dtype not in (torch.float16, torch.bfloat16) or not want_triton(xin, use_triton)
            or triton_block(C) > RESIDUAL_UNIT_MAX_C or b7 is None or b1 is None):
        h = causal_conv(xin, w7, b7, dilation, out_alpha=alpha2, out_inv_beta=inv_beta2,
                        channels_last=channels_last, use_triton=use_triton)
        return causal_conv(h, w1, b1, 1, residual, channels_last=channels_last,
                           use_triton=use_triton)
    return _residual_unit_triton(xin, w7, b7, dilation, alpha2, inv_beta2, w1, b1, residual,
                                 channels_last)


# The fused unit's channel block (the whole of C in one program, a power of two) up to this:
# 128 takes the decoder's last block (C = 96), 256 the one before (C = 192). Offline sm_90
# compile (fp16), the 1x1 conv's product in 64-column blocks: 64-row tiles of 4 warps, 128
# channels, 174 registers a thread (202 with the product whole, as timed on the H100
# 2026-12-06), no spills; 256 channels on 8 warps 246 (4 warps spill 412 bytes).
RESIDUAL_UNIT_MAX_C = 256


def triton_block(c: int) -> int:
    """The power of two >= c (>= 16), as the kernels' channel blocks take it."""
    return max(16, 1 << (c - 1).bit_length())


def _residual_unit_triton(xin, w7, b7, dilation, alpha2, inv_beta2, w1, b1, residual,
                          channels_last, config=None):
    """config: (BLOCK_M, BLOCK_CI, num_warps, num_stages) for timing (sweep_conv.py)."""
    import triton

    B, C, L = xin.shape
    k = w7.shape[0]
    n = L - (k - 1) * dilation
    if n < 1 or w7.dtype != xin.dtype or w1.dtype != xin.dtype:
        raise ValueError(f"residual_unit: input of {L} samples for a receptive field of "
                         f"{(k - 1) * dilation + 1}, weights {w7.dtype}/{w1.dtype}")
    out = _conv_out(xin, n, C, channels_last, residual)
    for name, p in (("alpha2", alpha2), ("inv_beta2", inv_beta2)):
        if p.numel() != C or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"{name} must be {C} contiguous fp32 values")
    bm, bci, warps, stages = config or (64 if B * n >= 2048 else 32, 32,
                                        8 if triton_block(C) > 128 else 4, 3)
    _residual_unit_kernel[(triton.cdiv(B * n, bm),)](
        xin, w7, b7, alpha2, inv_beta2, w1, b1, residual, out, B * n, C, n, dilation,
        xin.stride(0), xin.stride(1), xin.stride(2), residual.stride(0), residual.stride(1),
        residual.stride(2), out.stride(0), out.stride(1), out.stride(2),
        K=k, BLOCK_M=bm, BLOCK_CI=bci, BLOCK_C=triton_block(C), num_warps=warps,
        num_stages=stages, **codec_pdl_args(xin),
    )  # fmt: skip
    return out


def overlap_add_reference(z, spill, rows, bias):
    """The eager overlap-add (see the module docstring); updates `spill` in place."""
    B, n, taps, s, cout = z.shape
    y = z[:, :, 0]  # [B, n, s, Cout]
    if taps > 1:
        prev = spill.index_select(0, rows).reshape(B, cout, taps - 1, s).permute(0, 2, 3, 1)
        full = torch.cat([y, y.new_zeros(B, taps - 1, s, cout)], dim=1)  # blocks 0..n+taps-2
        full[:, : taps - 1] += prev
        for j in range(1, taps):
            full[:, j : j + n] += z[:, :, j]
        y = full[:, :n]
        spill.index_copy_(0, rows, full[:, n:].permute(0, 3, 1, 2).reshape(B, cout, -1))
    y = y + bias.to(y.dtype)
    return y.reshape(B, n * s, cout).transpose(1, 2)  # [B, Cout, n * s]


def overlap_add(z, spill, rows, bias, *, channels_last: bool = False, next_act=None,
                use_triton: bool | None = None):
    """See the module docstring; one launch on the GPU. `spill` may be None when taps == 1.
    Returns [B, Cout, n * s]: the eager path a transposed view (channels-last storage), the
    kernel a contiguous tensor, or with channels_last a view of a contiguous
    [B, n * s, Cout] one (the kernel then stores along z's contiguous channels).
    next_act: (alpha, inv_beta, dst) as causal_conv's: SnakeBeta of the output also written
    to dst [B, Cout, n * s] (the next conv's input after its context columns)."""
    B, n, taps, s, cout = z.shape
    if next_act is not None:
        _check_next_act(next_act, B, cout, z.dtype)
        if next_act[2].shape[-1] != n * s:
            raise ValueError(f"next_act's destination must be [{B}, {cout}, {n * s}], got "
                             f"{tuple(next_act[2].shape)}")
    if not want_triton(z, use_triton):
        y = overlap_add_reference(z, spill, rows, bias)
        _next_act_reference(next_act, y)
        return y
    return _overlap_add_triton(z, spill, rows, bias, channels_last, next_act)


def _overlap_add_triton(z, spill, rows, bias, channels_last=False, next_act=None):
    import triton

    B, n, taps, s, cout = z.shape
    if not z.is_contiguous():
        raise ValueError("z must be contiguous [B, n, taps, stride, Cout]")
    ov = (taps - 1) * s
    if taps > 1 and (spill is None or spill.shape[1:] != (cout, ov) or spill.dtype != z.dtype
                     or spill.stride(0) != cout * ov or 1 not in spill.stride()[1:]):
        raise ValueError(f"spill must be [S, {cout}, {ov}] {z.dtype} over contiguous "
                         f"[S, {cout}, {ov}] or [S, {ov}, {cout}] storage")
    if channels_last:
        out = torch.empty((B, n * s, cout), dtype=z.dtype, device=z.device).transpose(1, 2)
    else:
        out = torch.empty((B, cout, n * s), dtype=z.dtype, device=z.device)
    if out.numel() == 0:
        return out
    block_o = min(64, triton.next_power_of_2(cout))
    block_u = min(128, triton.next_power_of_2(max(n * s, (taps - 1) * s)))
    if (taps - 1) * s > block_u:  # the spill must sit in one program's block (see kernel)
        raise ValueError(f"an overlap of {(taps - 1) * s} samples exceeds the kernel's "
                         f"{block_u}-sample block")
    span = max(n * s, (taps - 1) * s)  # outputs, and the new spill's samples (row program)
    grid = (B, triton.cdiv(span, block_u), triton.cdiv(cout, block_o))
    nxt = next_act[2] if next_act is not None else out
    _overlap_add_kernel[grid](
        z, spill if taps > 1 else z, rows, bias, out, nxt,
        next_act[0] if next_act is not None else bias,
        next_act[1] if next_act is not None else bias, n, s, cout,
        out.stride(0), out.stride(1), out.stride(2), *nxt.stride(),
        *(spill.stride()[1:] if taps > 1 else (1, 1)),
        TAPS=taps, NEXT_SNAKE=next_act is not None, BLOCK_U=block_u, BLOCK_O=block_o,
        num_warps=4, **codec_pdl_args(z),
    )  # fmt: skip
    return out


if triton_available():  # the kernel exists only where Triton imports (not needed on CPU)
    import triton
    import triton.language as tl

    from ttsbuild.plugins._tl._math import pdl_prologue, sin_f32

    @triton.jit
    def _snake_cols_f32(a, alpha_ptr, inv_beta_ptr, c, c_mask):
        """SnakeBeta of a [rows, cols] tile whose columns are channels c, in fp32 (0 on
        masked channels of a tile that is 0 there)."""
        al = tl.load(alpha_ptr + c, mask=c_mask, other=0.0)
        ib = tl.load(inv_beta_ptr + c, mask=c_mask, other=0.0)
        af = a.to(tl.float32)
        sn = sin_f32(af * al[None, :])
        return af + ib[None, :] * (sn * sn)

    @triton.jit
    def _snake_cols(a, alpha_ptr, inv_beta_ptr, c, c_mask):
        """_snake_cols_f32 rounded back to the tile's dtype (as snake_context)."""
        return _snake_cols_f32(a, alpha_ptr, inv_beta_ptr, c, c_mask).to(a.dtype)

    @triton.jit
    def _split_range(steps, pid_k, SPLIT_K: tl.constexpr):
        """K steps [lo, hi) of split pid_k of SPLIT_K (all of them for one split)."""
        if SPLIT_K == 1:
            lo = 0
            hi = steps
        else:
            per = tl.cdiv(steps, SPLIT_K)
            lo = pid_k * per
            hi = tl.minimum(lo + per, steps)
        return lo, hi

    @triton.jit
    def _split_sum(acc, ws_ptr, cnt_ptr, offs_m, offs_o, mask, M, COUT,
                   SPLIT_K: tl.constexpr):  # fmt: skip
        """Split-K: this program's partial into the workspace; the tile's last program to
        arrive (acq_rel counter, reset after) gets the sum of every partial. Returns (the sum
        where last, else zeros; 1 where last, else 0)."""
        pid_k = tl.program_id(2)
        rows = offs_m[:, None].to(tl.int64) * COUT + offs_o[None, :]
        tl.store(ws_ptr + pid_k * M * COUT + rows, acc, mask=mask)
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        last = (arrived == SPLIT_K - 1).to(tl.int32)
        tot = tl.zeros_like(acc)
        if last > 0:
            for s in tl.static_range(SPLIT_K):
                tot += tl.load(ws_ptr + s * M * COUT + rows, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
        return tot, last

    @triton.jit
    def _conv_acc(x_rows, w_ptr, alpha_ptr, inv_beta_ptr, offs_o, m_mask, o_mask, CIN, COUT,
                  DIL, sxc, sxt, K: tl.constexpr, HAS_SNAKE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr,
                  BLOCK_O: tl.constexpr, FLAT_K: tl.constexpr = 0, pid_k=0,
                  SPLIT_K: tl.constexpr = 1):  # fmt: skip
        """The implicit GEMM of a tile: sum over taps j and input channels of x[t + j DIL, c]
        (SnakeBeta'd as it loads with HAS_SNAKE) times w[j, c, o], fp32 [BLOCK_M, BLOCK_O].
        FLAT_K (> 0): K steps of BLOCK_CI over the flattened (tap, channel) index kk = j CIN
        + c, which may span two taps; the caller guarantees channels-last input (sxc == 1)
        with CIN and sxt multiples of FLAT_K, so each step is runs of FLAT_K contiguous,
        aligned channels (vector loads), and the packed weight's row is kk itself.
        SPLIT_K > 1: only split pid_k's contiguous range of the K steps."""
        acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
        if FLAT_K > 0:
            KC = K * CIN
            lo, hi = _split_range(tl.cdiv(KC, BLOCK_CI), pid_k, SPLIT_K)
            for kb in range(lo, hi):
                kk = kb * BLOCK_CI + tl.arange(0, BLOCK_CI)
                k_mask = kk < KC
                j = kk // CIN
                c = kk - j * CIN
                col = tl.max_contiguous(tl.multiple_of(j * DIL * sxt + c, FLAT_K), FLAT_K)
                a = tl.load(x_rows[:, None] + col[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                if HAS_SNAKE:
                    a = _snake_cols(a, alpha_ptr, inv_beta_ptr, c, k_mask)
                wt = tl.load(w_ptr + kk[:, None] * COUT + offs_o[None, :],
                             mask=k_mask[:, None] & o_mask[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        else:
            # one loop over (tap j, channel block c0), so the compiler pipelines its loads
            cin_blocks = tl.cdiv(CIN, BLOCK_CI)
            lo, hi = _split_range(K * cin_blocks, pid_k, SPLIT_K)
            for it in range(lo, hi):
                j = it // cin_blocks
                offs_c = (it % cin_blocks) * BLOCK_CI + tl.arange(0, BLOCK_CI)
                c_mask = offs_c < CIN
                a = tl.load(x_rows[:, None] + offs_c[None, :] * sxc + j * DIL * sxt,
                            mask=m_mask[:, None] & c_mask[None, :], other=0.0)
                if HAS_SNAKE:
                    a = _snake_cols(a, alpha_ptr, inv_beta_ptr, offs_c, c_mask)
                wt = tl.load(w_ptr + (j * CIN + offs_c[:, None]) * COUT + offs_o[None, :],
                             mask=c_mask[:, None] & o_mask[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        return acc

    @triton.jit
    def _bias_residual(acc, bias_ptr, res_ptr, res_rows, offs_o, o_mask, mask, sro, dtype,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
        """The conv tile's epilogue before any SnakeBeta: acc (fp32) + the bias + the
        residual (its rows' offsets res_rows [BLOCK_M], channel stride sro), rounded to dtype
        once."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_o, mask=o_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            r = tl.load(res_ptr + res_rows[:, None] + offs_o[None, :] * sro, mask=mask,
                        other=0.0)
            acc += r.to(tl.float32)
        return acc.to(dtype)

    @triton.jit
    def _causal_conv_kernel(
        x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, alpha_ptr, inv_beta_ptr, out_alpha_ptr,
        out_inv_beta_ptr, ws_ptr, cnt_ptr, taps_ptr, z_ptr, next_ptr, next_alpha_ptr,
        next_inv_beta_ptr, M, CIN, COUT, N, DIL, sxb, sxc, sxt, srb, sro, srt, sob, soo, sot,
        snb, sno, snt,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SNAKE: tl.constexpr,
        HAS_OUT_SNAKE: tl.constexpr, OUT_TAPS: tl.constexpr, NEXT_SNAKE: tl.constexpr,
        FLAT_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_O: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        # output rows m = b * N + t over the whole batch: a tile spans rows of several
        # batch rows when n is short (a one-frame step at batch 64 is 64 x 4..1920 rows)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        m_mask = offs_m < M
        o_mask = offs_o < COUT
        b = (offs_m // N).to(tl.int64)
        t = offs_m % N
        x_rows = x_ptr + b * sxb + t * sxt  # [BLOCK_M]: input time t of row b, tap 0
        acc = _conv_acc(x_rows, w_ptr, alpha_ptr, inv_beta_ptr, offs_o, m_mask, o_mask, CIN,
                        COUT, DIL, sxc, sxt, K, HAS_SNAKE, BLOCK_M, BLOCK_CI, BLOCK_O,
                        FLAT_K, tl.program_id(2), SPLIT_K)
        mask = m_mask[:, None] & o_mask[None, :]
        rows_kept = m_mask
        if SPLIT_K > 1:  # only the tile's last program goes on, with the sum of the partials
            acc, last = _split_sum(acc, ws_ptr, cnt_ptr, offs_m, offs_o, mask, M, COUT, SPLIT_K)
            mask = mask & ((tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.int32) + last) > 0)
            rows_kept = m_mask & ((tl.zeros([BLOCK_M], dtype=tl.int32) + last) > 0)
        y = _bias_residual(acc, bias_ptr, res_ptr, b * srb + t * srt, offs_o, o_mask, mask,
                           sro, out_ptr.dtype.element_ty, HAS_BIAS, HAS_RES)
        if OUT_TAPS:  # the output stage's SnakeBeta (fp32, unrounded) times its taps
            # 0 on masked channels (y is: their weights, bias and residual load as 0)
            sb = _snake_cols_f32(y, out_alpha_ptr, out_inv_beta_ptr, offs_o, o_mask)
            tap = tl.arange(0, 16)
            wt = tl.load(taps_ptr + offs_o[:, None] * 16 + tap[None, :], mask=o_mask[:, None],
                         other=0.0)
            z = tl.dot(sb, wt, input_precision="ieee")  # [BLOCK_M, 16]
            tl.store(z_ptr + tap[None, :].to(tl.int64) * M + offs_m[:, None], z,
                     mask=rows_kept[:, None] & (tap < 16)[None, :])
        else:
            if HAS_OUT_SNAKE:  # SnakeBeta of the rounded output, in fp32, rounded again
                y = _snake_cols(y, out_alpha_ptr, out_inv_beta_ptr, offs_o, o_mask)
            dst = out_ptr + (b * sob + t * sot)[:, None] + offs_o[None, :] * soo
            tl.store(dst, y, mask=mask)
            if NEXT_SNAKE:  # the next conv's input: SnakeBeta of the stored output
                h = _snake_cols(y, next_alpha_ptr, next_inv_beta_ptr, offs_o, o_mask)
                tl.store(next_ptr + (b * snb + t * snt)[:, None] + offs_o[None, :] * sno, h,
                         mask=mask)

    @triton.jit
    def _conv_tma_kernel(
        x_desc, w_desc, bias_ptr, res_ptr, out_ptr, out_alpha_ptr, out_inv_beta_ptr, CIN,
        COUT, N, DIL, srb, sro, srt, sob, soo, sot,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
        HAS_OUT_SNAKE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr,
        BLOCK_O: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """`_causal_conv_kernel`'s conv (no input SnakeBeta, no split-K) on tensor-descriptor
        loads (see CONV_TMA). Program: output channels o0.. of rows t0.. of stream b (the
        output-channel blocks of one row tile adjacent in launch order, so they share its
        input in L2). x_desc: [B, L, CIN] boxes [1, BLOCK_M, BLOCK_CI]; w_desc: the packed
        weight as [K * CIN, COUT], boxes [BLOCK_CI, BLOCK_O]. Where BLOCK_CI does not divide
        CIN, a step's last rows of the weight belong to the next tap (or lie past the end,
        zero-filled), and the input's channels there are zero-filled, so they add nothing."""
        pdl_prologue(PDL)
        tiles_t = tl.cdiv(N, BLOCK_M)
        pid = tl.program_id(1)
        b = pid // tiles_t
        t0 = (pid % tiles_t) * BLOCK_M
        o0 = tl.program_id(0) * BLOCK_O
        cin_blocks = tl.cdiv(CIN, BLOCK_CI)
        acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
        for it in tl.range(0, K * cin_blocks, num_stages=NUM_STAGES):
            j = it // cin_blocks
            c0 = (it % cin_blocks) * BLOCK_CI
            a = x_desc.load([b, t0 + j * DIL, c0]).reshape(BLOCK_M, BLOCK_CI)
            wt = w_desc.load([j * CIN + c0, o0])
            acc = tl.dot(a, wt, acc)
        offs_t = t0 + tl.arange(0, BLOCK_M)
        offs_o = o0 + tl.arange(0, BLOCK_O)
        o_mask = offs_o < COUT
        mask = (offs_t < N)[:, None] & o_mask[None, :]
        b64 = b.to(tl.int64)
        y = _bias_residual(acc, bias_ptr, res_ptr, b64 * srb + offs_t * srt, offs_o, o_mask,
                           mask, sro, out_ptr.dtype.element_ty, HAS_BIAS, HAS_RES)
        if HAS_OUT_SNAKE:  # SnakeBeta of the rounded output, in fp32, rounded again
            y = _snake_cols(y, out_alpha_ptr, out_inv_beta_ptr, offs_o, o_mask)
        tl.store(out_ptr + (b64 * sob + offs_t * sot)[:, None] + offs_o[None, :] * soo, y,
                 mask=mask)

    @triton.jit
    def _residual_unit_kernel(
        x_ptr, w7_ptr, b7_ptr, alpha_ptr, inv_beta_ptr, w1_ptr, b1_ptr, res_ptr, out_ptr,
        M, C, N, DIL, sxb, sxc, sxt, srb, sro, srt, sob, soo, sot,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr,
        BLOCK_C: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One block of output rows m = b * N + t, every channel: the k-tap conv as in
        _causal_conv_kernel, its bias, rounding and SnakeBeta; that tile (in registers) times
        the 1x1 conv's [C, C] weight; its bias and the residual; stored once."""
        pdl_prologue(PDL)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_o = tl.arange(0, BLOCK_C)
        m_mask = offs_m < M
        o_mask = offs_o < C
        b = (offs_m // N).to(tl.int64)
        t = offs_m % N
        x_rows = x_ptr + b * sxb + t * sxt
        acc = _conv_acc(x_rows, w7_ptr, alpha_ptr, inv_beta_ptr, offs_o, m_mask, o_mask, C, C,
                        DIL, sxc, sxt, K, False, BLOCK_M, BLOCK_CI, BLOCK_C)
        acc += tl.load(b7_ptr + offs_o, mask=o_mask, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        # the k-tap conv's output as stored in two launches, its SnakeBeta (0 on masked
        # channels: snake(0) = 0)
        h = _snake_cols(acc.to(dt), alpha_ptr, inv_beta_ptr, offs_o, o_mask)
        for o0 in tl.static_range(0, BLOCK_C, 64):  # the 1x1 conv, 64 output channels at a time
            oc = o0 + tl.arange(0, 64)
            oc_mask = oc < C
            w1 = tl.load(w1_ptr + offs_o[:, None] * C + oc[None, :],
                         mask=o_mask[:, None] & oc_mask[None, :], other=0.0)
            out = tl.dot(h, w1)
            out += tl.load(b1_ptr + oc, mask=oc_mask, other=0.0).to(tl.float32)[None, :]
            mask = m_mask[:, None] & oc_mask[None, :]
            r = tl.load(res_ptr + (b * srb + t * srt)[:, None] + oc[None, :] * sro, mask=mask,
                        other=0.0)
            out += r.to(tl.float32)
            tl.store(out_ptr + (b * sob + t * sot)[:, None] + oc[None, :] * soo, out.to(dt),
                     mask=mask)

    @triton.jit
    def _overlap_add_kernel(
        z_ptr, spill_ptr, rows_ptr, bias_ptr, out_ptr, next_ptr, next_alpha_ptr,
        next_inv_beta_ptr, N, S, COUT, sob, soo, sou, snb, sno, snu, spo, spu,
        TAPS: tl.constexpr, NEXT_SNAKE: tl.constexpr, BLOCK_U: tl.constexpr,
        BLOCK_O: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        # Program: row b, output samples u = t * S + r (a block of them), channels o. It also
        # writes the new spill samples u' < (TAPS - 1) * S of its channels (sample n * S + u'
        # of the continued output), read from z and the old spill; all its reads of the old
        # spill precede the barrier, its writes follow it (one program owns a row's samples
        # of these channels for both).
        b = tl.program_id(0).to(tl.int64)
        u = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
        o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = o < COUT
        t, r = u // S, u % S
        ov = (TAPS - 1) * S
        slot = tl.load(rows_ptr + b).to(tl.int64)
        z_row = z_ptr + b * N * TAPS * S * COUT
        sp_row = spill_ptr + slot * COUT * ov
        # outputs: block t = sum_j z[t - j, j] (t - j < 0: spill block t, only j = t + ...)
        out_mask = (u < N * S)[:, None] & o_mask[None, :]
        acc = tl.load(bias_ptr + o, mask=o_mask, other=0.0).to(tl.float32)[None, :] + \
            tl.zeros([BLOCK_U, BLOCK_O], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            src = t - j
            ok = out_mask & (src >= 0)[:, None]
            acc += tl.load(z_row + ((src * TAPS + j) * S + r)[:, None] * COUT + o[None, :],
                           mask=ok, other=0.0).to(tl.float32)
        if TAPS > 1:
            # the previous step's contributions to this step's first TAPS - 1 blocks
            from_spill = out_mask & (u < ov)[:, None]
            acc += tl.load(sp_row + o[None, :] * spo + u[:, None] * spu, mask=from_spill,
                           other=0.0).to(tl.float32)
            # new spill sample u (< ov): block q = u // S of what follows this step
            q = t
            new_mask = (u < ov)[:, None] & o_mask[None, :]
            sp = tl.zeros([BLOCK_U, BLOCK_O], dtype=tl.float32)
            for j in tl.static_range(1, TAPS):
                src = N + q - j
                ok = new_mask & ((src >= 0) & (src < N) & (j > q))[:, None]
                sp += tl.load(z_row + ((src * TAPS + j) * S + r)[:, None] * COUT + o[None, :],
                              mask=ok, other=0.0).to(tl.float32)
            # old spill blocks still ahead of the new end: block N + q of the old spill
            ahead = new_mask & ((N + q) < (TAPS - 1))[:, None]
            sp += tl.load(sp_row + o[None, :] * spo + (u + N * S)[:, None] * spu, mask=ahead,
                          other=0.0).to(tl.float32)
            tl.debug_barrier()  # every read of the old spill precedes any write of the new
            tl.store(sp_row + o[None, :] * spo + u[:, None] * spu,
                     sp.to(out_ptr.dtype.element_ty), mask=new_mask)
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * sob + o[None, :] * soo + u[:, None] * sou, y, mask=out_mask)
        if NEXT_SNAKE:  # the next conv's input: SnakeBeta of the stored output
            h = _snake_cols(y, next_alpha_ptr, next_inv_beta_ptr, o, o_mask)
            tl.store(next_ptr + b * snb + o[None, :] * sno + u[:, None] * snu, h, mask=out_mask)
