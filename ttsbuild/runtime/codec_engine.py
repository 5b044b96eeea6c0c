"""The codec decoder as a slot-indexed streaming engine.

Every streaming state tensor lives indexed by slot, like the talker's KV cache:
  conv tails        [slots, Cin, (kernel - 1) * dilation]   the last inputs a causal conv saw
                    (state_channels_last: views of [slots, context, Cin] storage, spills too)
  transposed spills [slots, Cout, kernel - stride]          output spilling into the next step
  attention K/V     [slots, Hkv, R, D], a ring of R = sliding_window - 1 + max_chunk frames
  output taps       [slots, context, 16] fp32 (OUTPUT_EPILOGUE, in place of the output conv's
                    tail): the taps of the output stage's last inputs
  pos               [slots]                                 frames decoded
`step(rows, codes)` reads and updates only the rows' state, inside the computation: a conv
reads its rows' tails with index_select and writes them back with index_copy_, attention
writes the new keys into the rows' ring (index_put_) and reads the rows' windows. No host
sync and fixed shapes per (batch, n): one CUDA graph per (bucket, n). Slot `num_slots` is a
scratch slot that padding rows point at (several padding rows may share it; its state is
then garbage, which nobody reads).

Ring: frame f of a slot sits at ring index f % R. After writing the n new frames, index i
holds the frame last - ((last - i) mod R) (last = pos + n - 1); a query at frame q sees it iff
q - W < frame <= q and frame >= 0, so entries of an earlier request in the same slot (all at
negative frames once pos restarts at 0) are never seen. R >= W - 1 + n means the n writes
never overwrite a frame that one of the n queries still sees.

Precision: `precision` is "fp32" (strict, TF32 off), "tf32" (fp32 storage, TF32 tensor-core
convolutions and matmuls), "fp16" or "bf16" (weights, activations and state tails in that
dtype; cuDNN/cuBLAS accumulate in fp32). Whatever the precision: the codebook lookup is
pre-projected and summed in fp32, LayerNorm/RMSNorm statistics are fp32, SnakeBeta is
evaluated in fp32 math, and the stages named in `fp32_stages` (default: the pre-transformer
and the output stage, SnakeBeta(96) + conv 96->1 + clamp) run in strict fp32.
`benchmarks/codec/precision_probe.py` measures which stages lose the most in half precision.

On CPU, TF32 is emulated: conv/linear/attention inputs and weights are rounded to TF32's
10-bit mantissa (round to nearest even) and accumulated in fp32, which is what the tensor
cores do; fp16 and bf16 run natively (CPU kernels of those dtypes).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsbuild.model.codec import (
    CausalConv1d,
    CausalConvTranspose1d,
    CodecDecoder,
    ConvNeXtBlock,
    DecoderBlock,
    ResidualUnit,
    SnakeBeta,
    TransformerLayer,
    apply_rope,
)
from ttsbuild.plugins._dispatch import codec_pdl_scope, want_triton
from ttsbuild.plugins.causal_conv import (
    OUTPUT_TAPS_MAX_COUT,
    causal_conv,
    conv_output_taps,
    output_taps_reference,
    overlap_add,
    pack_conv_weight,
    pack_output_taps,
    pack_tconv_as_conv,
    residual_unit,
    triton_block,
)
from ttsbuild.plugins.codebook_sum import codebook_sum
from ttsbuild.plugins.codec_context import context_fill, snake_context
from ttsbuild.plugins.codec_output import codec_output, output_from_taps
from ttsbuild.plugins.convnext import convnext, dwconv_norm
from ttsbuild.plugins.fused_linear import (
    fused_linear,
    norm_linear_ring_attend,
    scaled_half_weight,
)
from ttsbuild.plugins.norm_act import rms_norm, silu_mul
from ttsbuild.plugins.ring_attention import (
    ring_attention,
    ring_attention_reference,
    ring_attention_rope,
    ring_step_inputs,
)

PRECISIONS = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
OUTPUT_STAGE = "output"
# Stages kept in strict fp32 whatever the precision, from the per-stage probe on the real
# config (benchmarks/codec/RESULTS.md): the pre-transformer alone in fp16 costs the most
# (56.3 dB, bf16 37.7 dB) for ~2% of the FLOPs; the output conv (96 -> 1) is ~0.05% of them
# and feeds the clamp directly.
DEFAULT_FP32_STAGES = ("transformer", OUTPUT_STAGE)
# Of the fp32 stages, those whose matmuls run on TF32 tensor cores (fp32 storage, fp32
# statistics) when the engine's precision is not "fp32": the pre-transformer in TF32 alone
# keeps 63.5 dB in the probe against 56.3 in fp16, and its fp32 GEMMs were 0.39 ms of a 4.85 ms
# step at batch 64 on the H200 (FFMA kernels, no tensor cores).
DEFAULT_TF32_STAGES = ("transformer",)
# How convolutions run: "cudnn" (F.conv1d / F.conv_transpose1d on [B, C, T]); "gemm" (one
# GEMM per conv over an im2col copy of the input, bias fused; transposed convs as one GEMM and
# an overlap-add of their kernel // stride taps); "triton" (stride-1 convs of half-precision
# stages as one implicit-GEMM kernel, plugins.causal_conv, bias and residual fused; the rest
# as "gemm"). Depthwise convs always use cuDNN.
CONV_IMPLS = ("cudnn", "gemm", "triton")
# "triton" runs a stride-1 conv as the implicit-GEMM kernel from this many output rows
# (batch x frames x samples per frame at the conv) and as im2col + cuBLAS below it: the short
# convs of a one-stream step are few long-K tiles, where cuBLAS's split-K GEMMs win. One-frame
# step on the H200: 1.21 ms at 1 stream and 4.98 ms at 64 (im2col everywhere: 1.19 / 6.58;
# benchmarks/codec/RESULTS.md). TTSBUILD_CODEC_IMPLICIT_MIN_ROWS moves the limit: with
# TTSBUILD_CODEC_CONV_SPLIT=1 (causal_conv.SPLIT_K, the short convs' tiles split over K in the
# one launch) the kernel may take the short convs too, an im2col copy, a GEMM and its split-K
# reduction a conv fewer and their SnakeBeta in the epilogue (built 2026-12-06, not yet timed).
IMPLICIT_MIN_ROWS = int(os.environ.get("TTSBUILD_CODEC_IMPLICIT_MIN_ROWS", "512"))
# Steps of at most this many streams run every conv of a half-precision stage on the
# implicit-GEMM kernel, whatever its rows, with split-K where its tiles leave SMs idle
# (causal_conv's `split`): the short convs of a small step as one launch each in place of an
# im2col copy, a split-K GEMM and its reduction. The served codec step on an H100, two
# alternated rounds, one process a side (IMPLICIT_MIN_ROWS=1 with SPLIT_K, which is this at
# every size; benchmarks/codec/2026-12-06-h100-codec-switches): batch 1 / 2 / 8 / 64
# 0.647 / 0.737 / 0.954 / 2.442 -> 0.606 / 0.706 / 0.944 / 2.472 ms, so only up to 8 streams.
# 0: off. TTSBUILD_CODEC_CONV_SPLIT_MAX_STREAMS sets it; a plan pins it
# (codec_conv_split_max_streams).
CONV_SPLIT_MAX_STREAMS = int(os.environ.get("TTSBUILD_CODEC_CONV_SPLIT_MAX_STREAMS", "8"))
# The upsample stage's ConvNeXt blocks of half-precision stages with at most this many
# positions (batch x frames x upsampling so far) as two launches each (plugins.convnext: the
# depthwise conv, LayerNorm and pwconv1 + GELU; pwconv2, gamma and the residual) after the
# context kernel, instead of ~10 (cuDNN's depthwise conv, a transpose, the LayerNorm, two
# split-K GEMMs and their reductions, the GELU, gamma, the add). Off: slower on the H200
# (the codec step at batch 1 0.807 -> 0.872 ms in two alternated rounds, batch 64 the same;
# benchmarks/runtime/2026-12-05-h200-new-paths/). TTSBUILD_CODEC_CONVNEXT_FUSED=1 turns it
# on, with `fused`.
CONVNEXT_FUSED = os.environ.get("TTSBUILD_CODEC_CONVNEXT_FUSED", "0") == "1"
CONVNEXT_FUSED_MAX_ROWS = 16
# The other ConvNeXt blocks of half-precision stages: the depthwise conv and the LayerNorm as
# one launch (plugins.convnext.dwconv_norm) instead of cuDNN's `conv1D_NCHW_general` (41 us a
# call at 64 rows of a one-frame step, two calls: H200 profile 2026-12-04) and the norm's own
# kernel: 13 us for the two there. The served codec step, one process a side
# (benchmarks/codec/2026-12-06-codec-three-kernels): on an H100 batch 1 / 64 0.789 / 2.664 ->
# 0.770 / 2.569 ms; on an H200 this with the ring read in chunks and the output stage taps
# first 0.765 / 2.585 / 7.93 -> 0.742 / 2.383 / 7.10 ms at 1 / 64 / 256.
# TTSBUILD_CODEC_DWCONV_NORM=0 turns it off.
DWCONV_NORM = os.environ.get("TTSBUILD_CODEC_DWCONV_NORM", "1") == "1"
# A residual unit's second SnakeBeta in its k = 7 conv's epilogue (plugins.causal_conv
# out_alpha: once per element, the same bits) instead of in the 1x1 conv's input load, where
# it is recomputed for every block of output channels between each K step's load and its MMA,
# for units of fewer than SNAKE_EPILOGUE_MAX_ROWS rows (batch x samples; no limit since it
# was capped, below). H100, the served codec step with it at every size (profile_codec.py,
# two alternated rounds, one process each; benchmarks/codec/2026-12-06-h100-snake-epilogue):
# batch 1 0.815 / 0.813 -> 0.783 / 0.782 ms, but batch 64 2.657 / 2.655 -> 2.823 / 2.824 and
# batch 256 8.175 / 8.177 -> 9.208 / 9.212: the 128 x 128 tiles of two warpgroups, which the
# larger units take, lose with it (121 -> 189 registers a thread in an offline compile: one
# CTA an SM instead of two). TTSBUILD_CODEC_SNAKE_EPILOGUE=0 turns it off.
SNAKE_EPILOGUE = os.environ.get("TTSBUILD_CODEC_SNAKE_EPILOGUE", "1") == "1"
# Since 2026-12-06 the large tiles take the epilogue capped at 128 registers a thread
# (causal_conv.EPILOGUE_MAXNREG), and the limit is gone: the served codec step on an H100, two
# alternated rounds, one process a side (benchmarks/codec/2026-12-06-h100-flat-k-epilogue):
# batch 1 / 64 / 256 0.659 / 2.479 / 7.383 -> 0.658 / 2.454 / 7.355 ms (limit 2048 ->
# none); with causal_conv's flattened K steps too (FLAT_K) 0.648 / 2.440 / 7.208.
# TTSBUILD_CODEC_SNAKE_EPILOGUE_MAX_ROWS=2048 puts the old limit back.
SNAKE_EPILOGUE_MAX_ROWS = int(os.environ.get("TTSBUILD_CODEC_SNAKE_EPILOGUE_MAX_ROWS",
                                             str(1 << 62)))
# Each decoder block's leading SnakeBeta (before its transposed conv) applied in the epilogue
# of the conv before it, the previous block's last residual unit's 1x1 conv or the decoder's
# input conv (causal_conv out_alpha; the same bits: both round the conv output, then take the
# same fp32 SnakeBeta of it), where both stages share a dtype: 4 launches a step fewer (and at
# 64 rows ~53 MB of reads and writes). The conv's un-snaked output has no other reader.
# Where the implicit-GEMM kernel does not run that conv, its output gets the SnakeBeta as a
# launch of its own, as before. TTSBUILD_CODEC_FOLD_BLOCK_ACT=1 turns it on (built
# 2026-12-06, not yet timed).
FOLD_BLOCK_ACT = os.environ.get("TTSBUILD_CODEC_FOLD_BLOCK_ACT", "0") == "1"
# A residual unit as one launch after its first SnakeBeta (plugins.causal_conv.residual_unit:
# the k = 7 conv, the second SnakeBeta, the 1x1 conv and the residual, the SnakeBeta'd tile
# kept in registers) for units whose channels, as a power of two, are at most this (128: the
# last decoder block's C = 96; 256: also the one before, C = 192), on the implicit-GEMM
# path's rows (>= IMPLICIT_MIN_ROWS). At 64 rows of a one-frame step the last block's k = 7
# and 1x1 convs took 66 + 45 us a unit on the H200 (sweep, 2026-12-04) for ~72 MB of
# traffic and 18 GFLOP together. Slower on an H100 (2026-12-06, one process a side,
# call1-h100 of benchmarks/codec/2026-12-06-codec-three-kernels): the codec step at batch 64
# 2.664 -> 2.776 ms (128) and 2.898 (256), at 202-255 registers a thread. 0 (the default):
# off; TTSBUILD_CODEC_FUSED_UNIT=128 or 256 turns it on.
FUSED_UNIT_MAX_C = int(os.environ.get("TTSBUILD_CODEC_FUSED_UNIT", "0"))
# The pre-transformer's fused layers (fused_layers_max_rows: the GEMVs of a batch-1 step) read
# fp16 weights with per-output-channel power-of-two scales (plugins.fused_linear
# scaled_half_weight: the fp32 weights rounded to 11 significant bits) beside fp32
# activations, norms, attention and accumulation, in place of the fp32 weights: 61 MB a step
# instead of 122. On an H100 (2026-12-06 profile) those 34 GEMV launches were 0.158 ms of the
# 0.655 ms batch-1 step, ~0.8 TB/s. fp16 keeps the 10 explicit mantissa bits that the TF32
# tensor cores of the many-row path read of the same weights (which stay loaded for it). The
# real config, random weights, CPU (benchmarks/codec/2026-12-06-cpu-tr-half-weights): that
# rounding alone 66 dB against the fp32 decode; served fp16 53.4 dB with or without it.
# On an H100 (the served step, two alternated rounds, one process a side;
# benchmarks/codec/2026-12-06-h100-codec-switches): batch 1 / 2 / 8 0.647 / 0.737 / 0.954 ->
# 0.631 / 0.706 / 0.887 ms, 64 rows the same (2.442 -> 2.436: larger steps run cuBLAS),
# 53.4 -> 53.1 dB. On by default where the engine is not the strict fp32 reference (an
# explicit True applies anyway); TTSBUILD_CODEC_TR_HALF_WEIGHTS=0 turns it off.
TR_HALF_WEIGHTS = os.environ.get("TTSBUILD_CODEC_TR_HALF_WEIGHTS", "1") == "1"
# The fused layers' qkv GEMV and their attention (RoPE, ring writes, the window) as one launch
# (plugins.fused_linear.norm_linear_ring_attend: each head's attention run by the program that
# wrote its last qkv tile), 8 launches a batch-1 step fewer of its ~151.
# TTSBUILD_CODEC_QKV_ATTEND=1 turns it on (built 2026-12-06, not yet timed). Only for steps
# of at most QKV_ATTEND_MAX_STREAMS streams on the GEMVs: one program a head attends for
# every stream in turn, where the separate kernel runs a program per (stream, head).
QKV_ATTEND = os.environ.get("TTSBUILD_CODEC_QKV_ATTEND", "0") == "1"
QKV_ATTEND_MAX_STREAMS = 2
# Steps of more frames than fused_layers_max_rows, up to this many, run the pre-transformer as
# the fused layers too, their linears as TF32 tensor-core tiles of plugins.fused_linear (the
# precision of the cuBLAS TF32 GEMMs they replace; with TR_HALF_WEIGHTS, fp16 weights), in
# place of ~95 launches at 64 rows (33 TF32 GEMMs, 17 split-K reductions, 17 RMSNorms, 16
# copies and the elementwise ops: ~0.3 ms of the 2.41 ms step on an H100, 2026-12-06
# profile) against ~42. Only where the transformer stage is a TF32 stage (never in a strict
# fp32 engine). On by default since 2026-12-07 for every step (TR_TF32_ALL): then, with the
# fp16 copies (TR_HALF_WEIGHTS), no step reads the fp32 weights of the pre-transformer's
# linears and they are freed (116 MiB for the 12 Hz codec: issue 8's "no duplicate weights").
# Timed on an H100, two rounds a side, one-frame steps at 1 / 64 / 256 streams: 0.506-0.509 /
# 2.206-2.209 / 6.639-6.641 ms on the GEMM path against 0.508 / 2.194 / 6.703-6.704 ms, 53.2 dB
# either way (benchmarks/kernels/2026-12-07-h100-no-copies/call10). TTSBUILD_CODEC_TR_TF32_MAX_ROWS
# =N takes the tiles up to N frames a step only (0: never; then the fp32 weights stay).
TR_TF32_ALL = 1 << 30  # more frames than any engine's step
_TR_TF32 = os.environ.get("TTSBUILD_CODEC_TR_TF32_MAX_ROWS", "all")
if _TR_TF32 != "all" and not _TR_TF32.isdigit():
    raise ValueError(f"TTSBUILD_CODEC_TR_TF32_MAX_ROWS must be 'all' or a number of frames "
                     f"(0: off), got {_TR_TF32!r}")
TR_TF32_MAX_ROWS = TR_TF32_ALL if _TR_TF32 == "all" else int(_TR_TF32)
# The pre-transformer's key/value rings in fp16 where the stage is fp32 (keys after RoPE and
# values rounded to 11 significant bits as they are written; attention still in fp32 math):
# the ring attention reads half the bytes (at 64 rows its 8 launches took 0.206 ms of the
# 2.41 ms step on an H100, 2026-12-06, ~39 MB of fp32 rings a layer), and the rings take half
# the memory. On an H100 (as TR_HALF_WEIGHTS): batch 1 / 2 / 8 / 64 0.647 / 0.737 / 0.954 /
# 2.442 -> 0.640 / 0.726 / 0.938 / 2.411 ms, 53.4 dB either way. On by default (never in the
# strict fp32 engine); TTSBUILD_CODEC_RING_HALF=0 turns it off.
RING_HALF = os.environ.get("TTSBUILD_CODEC_RING_HALF", "1") == "1"
# Transposed convs of half-precision stages (kernel = taps x stride) as the implicit-GEMM
# causal conv over their input: output block t (stride samples) of a kernel-2s, stride-s
# transposed conv is x[t] W[:, :, r] + x[t-1] W[:, :, r + s] for r < s, so it is a k = taps
# conv with stride x Cout output channels ([B, n, s, Cout] channels-last storage is the
# [B, Cout, n * s] output: no copy), its left context the input's last taps - 1 frames
# (the slot's tail, as a causal conv's) instead of the output spill. One launch with the
# bias, the block's SnakeBeta with the context (snake_context) before it, in place of a
# SnakeBeta, a cuBLAS GEMM into a [B, n, taps, s, Cout] buffer and the overlap-add (6
# transposed convs a step: 4 decoder blocks of 2 taps, 2 upsample blocks of 1).
# On an H100, two alternated rounds, one process a side (as LOOKUP_FUSED): batch 1 / 2 / 8 /
# 64 / 256 0.537 / 0.646 / 0.862 / 2.408 / 7.135 -> 0.543 / 0.653 / 0.870 / 2.396 / 7.090 ms:
# 0.5-0.6 % faster from 64 streams, 1 % slower below (the first block's k = 2 conv of 768 x
# 8 channels over 4 rows a stream took 0.020 ms at batch 1 against the GEMM + overlap-add's
# 0.013; sweep_conv.py kind tconv). Off; TTSBUILD_CODEC_TCONV_CONV=1 turns it on.
TCONV_CONV = os.environ.get("TTSBUILD_CODEC_TCONV_CONV", "0") == "1"
# The step's codebook lookup (the tables' offsets added, a gather of Q rows a frame, their sum,
# the cast to the pre_conv stage's dtype: four launches) as one kernel
# (plugins.codebook_sum), writing channels-last rows. The served step on an H100, two
# alternated rounds, one process a side (benchmarks/codec/2026-12-06-h100-output-epilogue):
# batch 1 / 2 / 8 / 64 / 256 0.537 / 0.646 / 0.862 / 2.408 / 7.135 -> 0.534 / 0.642 / 0.856 /
# 2.405 / 7.124 ms (53.2 dB either way). On by default; TTSBUILD_CODEC_LOOKUP_FUSED=0 turns it
# off.
LOOKUP_FUSED = os.environ.get("TTSBUILD_CODEC_LOOKUP_FUSED", "1") == "1"
# The output stage (SnakeBeta, the conv to one channel, clamp) begun in the epilogue of the
# last residual unit's 1x1 conv (plugins.causal_conv.conv_output_taps): the tile holds all 96
# channels of its rows, so it takes their SnakeBeta in fp32 and their 7 taps (a [rows, 96] x
# [96, 16] product of fp32 FMAs) and stores those 16 floats a sample in place of the 96 half
# channels; then plugins.codec_output.output_from_taps adds the taps along time with the
# slot's last taps as context and clamps. At 64 rows of a one-frame step that leaves ~47 MB
# of the 1x1 conv's store and the output kernel's read, and the output kernel (156 us on an
# H100 in the 2026-12-06 profile: latency-bound, one 8-warp CTA an SM) becomes one of ~8 MB.
# The slot keeps the taps of the stage's last 6 inputs ([S, 6, 16] fp32) in place of their
# 96 SnakeBeta'd channels. Needs the fused output stage (fp32) after a half-precision last
# block of residual units on the implicit-GEMM kernel. The served step on an H100, two
# alternated rounds, one process a side (benchmarks/codec/2026-12-06-h100-output-epilogue):
# batch 1 / 2 / 8 / 64 / 256 0.537 / 0.646 / 0.862 / 2.408 / 7.135 -> 0.533 / 0.643 / 0.842 /
# 2.320 / 6.817 ms (53.2 dB either way). On by default; TTSBUILD_CODEC_OUTPUT_EPILOGUE=0 turns
# it off. (OUTPUT_TAPS_MAX_T=32, 32-sample tiles for the output kernel, lost: 2.487 / 7.460 ms
# at 64 / 256.)
OUTPUT_EPILOGUE = os.environ.get("TTSBUILD_CODEC_OUTPUT_EPILOGUE", "1") == "1"
# Each residual unit's first SnakeBeta (act1) written by the unit before it: that unit's 1x1
# conv epilogue stores SnakeBeta of its output (the rounded value snake_context would read)
# beside the output, after the next conv's context columns in that conv's input buffer
# (causal_conv next_act); then plugins.codec_context.context_fill puts the slot's tail in
# front and advances it (a launch over the context's columns alone) in place of
# snake_context's pass over the whole input. Units 2 and 3 of each block take it from the
# unit before, unit 1 from the block's overlap-add (the transposed conv's GEMM path: the
# kernel's epilogue, overlap_add next_act): 12 of the step's 20 snake_context launches, 217
# us of the 64-stream step on an H100 (2026-12-06: 10-25 us each). The conv or overlap-add
# stores one more output; the pass that read it back is gone. Needs the SnakeBeta in conv1's
# epilogue and the 1x1 conv on the implicit-GEMM kernel.
# Timed on an H100 (benchmarks/codec/2026-12-06-h100-tma-on, call1; the served step, two
# alternated rounds, one process a side), it lost at every batch: 1 / 8 / 64 / 256 streams
# 0.532 / 0.834 / 2.284 / 6.798 -> 0.600 / 0.887 / 2.427 / 7.038 ms (same audio, 53.2 dB).
# Per stage at 64 / 256 streams (sweep_conv.py kind 1x1next, same call) the 1x1 conv with the
# extra store + context_fill took as long as the conv + snake_context or longer (C = 384:
# 0.0312 against 0.0259 ms at 64): the store costs what the pass it replaces did. Off;
# TTSBUILD_CODEC_NEXT_ACT_FOLD=1 turns it on.
NEXT_ACT_FOLD = os.environ.get("TTSBUILD_CODEC_NEXT_ACT_FOLD", "0") == "1"
# Steps of at most this many streams launch the codec's kernels with PDL (plugins._dispatch
# codec_pdl_scope): on the H200 (2026-12-02) PDL for every codec kernel made batch 1 1.6 %
# faster (0.856 -> 0.842 ms) and batches 8-256 2-6 % slower, where programs resident early
# only take SM slots from the kernel before them. 0: off (TTSBUILD_CODEC_PDL=1 keeps it on
# at every size). With today's kernels on an H100 (as TR_HALF_WEIGHTS), PDL_MAX_ROWS=2:
# batch 1 / 2 0.647 / 0.737 -> 0.586 / 0.720 ms, 8 and 64 untouched (0.955 / 2.443).
# TTSBUILD_CODEC_PDL_MAX_ROWS sets it (default 2); a plan pins it (codec_pdl_max_rows).
CODEC_PDL_MAX_ROWS = int(os.environ.get("TTSBUILD_CODEC_PDL_MAX_ROWS", "2"))


def default_switches(precision: str) -> dict:
    """The switches above as an engine of `precision` takes them when not given (their
    environment variables; the fp16 copies never in the strict fp32 engine), keyed by
    CodecEngine's arguments: what `ttsbuild compile` pins into the plan it gates and ships,
    so a deployment host serves what the gate measured whatever its environment."""
    return dict(
        fold_block_act=FOLD_BLOCK_ACT, transformer_half_weights=TR_HALF_WEIGHTS
        and precision != "fp32", qkv_attend=QKV_ATTEND, tf32_layers_max_rows=TR_TF32_MAX_ROWS,
        ring_half=RING_HALF and precision != "fp32", conv_split_max_streams=CONV_SPLIT_MAX_STREAMS,
        pdl_max_rows=CODEC_PDL_MAX_ROWS, tconv_conv=TCONV_CONV, lookup_fused=LOOKUP_FUSED,
        output_epilogue=OUTPUT_EPILOGUE, next_act_fold=NEXT_ACT_FOLD,
    )  # fmt: skip


# The switches' names (CodecEngine's arguments; the plan's fields are "codec_" + each)
SWITCHES = tuple(default_switches("fp16"))


def resolve_conv_impl(choice: str, device: torch.device | str) -> str:
    """A plan's `codec_conv`: "auto" is "triton" on CUDA, "cudnn" elsewhere; the environment
    variable TTSBUILD_CODEC_CONV (one of CONV_IMPLS) overrides "auto" for measurements."""
    if choice != "auto":
        return choice
    forced = os.environ.get("TTSBUILD_CODEC_CONV")
    if forced:
        if forced not in CONV_IMPLS:
            raise ValueError(f"TTSBUILD_CODEC_CONV must be one of {CONV_IMPLS}, got {forced!r}")
        return forced
    return "triton" if torch.device(device).type == "cuda" else "cudnn"


MIN_CODEC_SNR_DB = 45.0


def stage_names(codec: CodecDecoder) -> list[str]:
    """The engine's precision stages, in decode order."""
    n_blocks = len(codec.config.upsample_rates)
    return ["pre_conv", "transformer", "upsample", "decoder.in",
            *(f"decoder.block{i + 1}" for i in range(n_blocks)), OUTPUT_STAGE]


def round_to_tf32(x: Tensor) -> Tensor:
    """fp32 -> fp32 holding only TF32's 10 mantissa bits (round to nearest even)."""
    bits = x.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & -8192).view(torch.float32)


@contextlib.contextmanager
def _tf32_mode(enabled: bool):
    """cuBLAS and cuDNN TF32 switches (read when an op is launched, so baked into a graph)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def _snake_params(m: nn.Module) -> tuple[Tensor, Tensor]:
    """(alpha, inv_beta) [C, 1] fp32 of a SnakeBeta (stored logs) or FoldedSnakeBeta."""
    if isinstance(m, SnakeBeta):
        alpha, inv_beta = m.alpha.exp(), 1.0 / (m.beta.exp() + 1e-9)
    else:  # build.codec_fold.FoldedSnakeBeta: the same expressions, folded ahead of time
        alpha, inv_beta = m.alpha, m.inv_beta
    return alpha.detach().float()[:, None].clone(), inv_beta.detach().float()[:, None].clone()


class _Stage:
    """How one stage computes: its dtype, TF32 on the GPU, TF32 emulation on CPU."""

    def __init__(self, dtype: torch.dtype, tf32: bool, device: torch.device):
        self.dtype = dtype
        self.tf32 = tf32
        self.emulate_tf32 = tf32 and device.type != "cuda"

    def mm_in(self, x: Tensor) -> Tensor:
        return round_to_tf32(x) if self.emulate_tf32 else x


class CodecEngine:
    """Streaming codec state for `num_slots` slots (+ one scratch slot) and a step over any
    subset of them. See the module docstring for the layout and the precision rules."""

    def __init__(
        self,
        codec: CodecDecoder,
        num_slots: int,
        precision: str | torch.dtype = "fp32",
        device: torch.device | str | None = None,
        *,
        max_chunk: int = 16,
        fp32_stages: tuple[str, ...] = DEFAULT_FP32_STAGES,
        tf32_stages: tuple[str, ...] = DEFAULT_TF32_STAGES,
        conv_impl: str = "cudnn",
        fused: bool = False,
        channels_last: bool = False,
        fused_output: bool = False,
        fused_attention: bool = False,
        state_channels_last: bool = False,
        fused_layers_max_rows: int = 0,
        snake_epilogue: bool | None = None,
        fold_block_act: bool | None = None,
        transformer_half_weights: bool | None = None,
        qkv_attend: bool | None = None,
        tf32_layers_max_rows: int | None = None,
        ring_half: bool | None = None,
        conv_split_max_streams: int | None = None,
        pdl_max_rows: int | None = None,
        tconv_conv: bool | None = None,
        lookup_fused: bool | None = None,
        output_epilogue: bool | None = None,
        next_act_fold: bool | None = None,
    ) -> None:
        if isinstance(precision, torch.dtype):
            precision = {v: k for k, v in PRECISIONS.items() if k != "tf32"}[precision]
        if precision not in PRECISIONS:
            raise ValueError(f"codec precision must be one of {list(PRECISIONS)}, "
                             f"got {precision!r}")
        names = stage_names(codec)
        unknown = sorted((set(fp32_stages) | set(tf32_stages)) - set(names))
        if unknown:
            raise ValueError(f"unknown codec stages {unknown}; the stages are {names}")
        if max_chunk < 1:
            raise ValueError("max_chunk must be >= 1")
        if conv_impl not in CONV_IMPLS:
            raise ValueError(f"conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}")
        self.conv_impl = conv_impl
        # The opt-in fusions, off until timed on the GPU (benchmarks/codec/profile_codec.py
        # --opt-in-kernels): the pre-transformer's attention over the rings as one kernel
        # per layer (plugins.ring_attention); with "triton" convs also the transposed convs'
        # overlap-add as one kernel (plugins.causal_conv.overlap_add) and the SnakeBeta before
        # a conv without left context (the residual units' 1x1 convs) applied inside the
        # implicit-GEMM conv's input load instead of a launch of its own.
        self.fused = fused
        self.fused_convs = fused and conv_impl == "triton"
        # a residual unit's act2 in its conv1's epilogue (None: SNAKE_EPILOGUE, the
        # environment's choice); with "triton" convs, where the kernel runs conv1
        self.snake_epilogue = (SNAKE_EPILOGUE if snake_epilogue is None
                               else snake_epilogue) and conv_impl == "triton"
        # each decoder block's first SnakeBeta in the epilogue of the conv before it (None:
        # FOLD_BLOCK_ACT); with "triton" convs, where the kernel runs that conv
        dflt = default_switches(precision)  # the switches not given
        self.fold_block_act = (dflt["fold_block_act"] if fold_block_act is None
                               else fold_block_act) and conv_impl == "triton"
        # steps of at most this many streams: every half-precision conv on the implicit-GEMM
        # kernel, split over K where its tiles are few (None: CONV_SPLIT_MAX_STREAMS)
        split = (dflt["conv_split_max_streams"] if conv_split_max_streams is None
                 else conv_split_max_streams)  # fmt: skip
        # steps of at most this many streams launch with PDL (None: CODEC_PDL_MAX_ROWS)
        pdl = dflt["pdl_max_rows"] if pdl_max_rows is None else pdl_max_rows
        if split < 0 or pdl < 0:
            raise ValueError(f"conv_split_max_streams and pdl_max_rows must be >= 0, got "
                             f"{split} and {pdl}")
        self.conv_split_max_streams = split if conv_impl == "triton" else 0
        self.pdl_max_rows = pdl
        # the half-precision stages' transposed convs as causal convs (None: TCONV_CONV), with
        # channels-last operands (their output is a view of the kernel's then)
        self.tconv_conv = bool(dflt["tconv_conv"] if tconv_conv is None
                               else tconv_conv) and conv_impl == "triton" and channels_last
        # the codebook lookup as one kernel (None: LOOKUP_FUSED)
        self.lookup_fused = bool(dflt["lookup_fused"] if lookup_fused is None else lookup_fused)
        # The implicit-GEMM convs' inputs and outputs as channels-last views ([B, C, T] shapes
        # over contiguous [B, T, C] storage: snake_context / causal_conv channels_last), so the
        # kernel reads its input tiles along contiguous channels, in vectors its compiler can
        # pipeline, where [B, C, T] storage makes it gather one element per channel row; on in
        # the served plan since the H200 timed it (one-frame step 4.56 -> 3.78 ms at 64 rows,
        # benchmarks/codec/RESULTS.md).
        self.channels_last = channels_last and conv_impl == "triton"
        # On in the served plan since timed (benchmarks/codec/RESULTS.md): the output stage
        # (SnakeBeta, left context, the fp32 conv to one channel, clamp) as one kernel
        # (plugins.codec_output) reading the last block's half-precision output once, in place
        # of a cast to fp32, the snake + context kernel, an im2col copy of 7x the stage's
        # input and a GEMV with one column (~0.8 GB of traffic at 64 rows of one frame).
        self.fused_output = fused_output and conv_impl != "cudnn"
        # On in the served plan since timed (benchmarks/codec/RESULTS.md): each
        # pre-transformer layer's RoPE, ring writes, window mask and attention as one kernel
        # (plugins.ring_attention.ring_attention_rope), where the fused path makes ~20 launches
        # of mask and cos/sin set-up per step and 8 per layer (RoPE, two ring scatters, the
        # attention): ~76 fewer of a batch-1 step's ~275, which is launch-bound. Needs as many
        # query as key/value heads (the 12 Hz codec).
        tr_heads = [(m.self_attn.n_head, m.self_attn.n_kv) for m in codec.pre_transformer.layers]
        self.fused_attention = fused_attention and all(h == kv for h, kv in tr_heads)
        # On in the served plan since timed (plan codec_state_channels_last,
        # benchmarks/codec/RESULTS.md): with channels-last operands, the half-precision stages'
        # conv tails and transposed-conv spills stored [S, context, C] (as [S, C, context]
        # views), so the snake + context and overlap-add kernels, whose tiles run along
        # channels, read and write them along channels too (run 3 of 2026-12-02: the
        # overlap-add 0.119 -> 0.170 ms at 64 rows once its output went channels-last).
        self.state_channels_last = state_channels_last and self.channels_last
        if fused_layers_max_rows < 0:
            raise ValueError(f"fused_layers_max_rows must be >= 0, got {fused_layers_max_rows}")
        device = torch.device(device) if device is not None else next(codec.parameters()).device
        self.precision, self.device, self.max_chunk = precision, device, max_chunk
        self.config = cfg = codec.config
        self.num_slots, self.scratch = num_slots, num_slots
        self.fp32_stages = tuple(fp32_stages)
        # TF32 only where a stage is kept in fp32 and the engine is not the strict reference
        self.tf32_stages = tuple(s for s in tf32_stages if s in fp32_stages and precision != "fp32")
        half = PRECISIONS[precision]
        self.stages = {
            name: _Stage(torch.float32, name in self.tf32_stages, device) if name in fp32_stages
            else _Stage(half, precision == "tf32", device)
            for name in names
        }
        with torch.no_grad():
            self._load(codec, device)
        # the output stage begun in the last 1x1 conv's epilogue (None: OUTPUT_EPILOGUE)
        self.output_epilogue = bool(dflt["output_epilogue"] if output_epilogue is None
                                    else output_epilogue) and self._output_epilogue_fits()
        self._out_taps = (pack_output_taps(self._conv_w[self.codec.decoder[-1]])
                          if self.output_epilogue else None)  # fmt: skip
        # each residual unit's act1 written by the unit before it (None: NEXT_ACT_FOLD), with
        # the SnakeBeta in conv1's epilogue and channels-last implicit-GEMM convs
        self.next_act_fold = bool(
            (dflt["next_act_fold"] if next_act_fold is None else next_act_fold)
            and self.snake_epilogue and self.channels_last)
        # Off until timed on the GPU (profile_codec.py row '+l'): steps of at most this many
        # frames (rows x chunk) run each pre-transformer layer as five launches of
        # plugins.fused_linear (norm + qkv + bias; the fused attention; o + bias + residual;
        # norm + gate/up + SiLU; down + bias + residual) and the input / output projections
        # (final norm in the latter's prologue) as one each, in place of ~10 per layer
        # (norms, cuBLAS GEMMs and their split-K reductions, addmm, silu_mul): a one-frame step
        # at batch 1 is launch-bound (0.86 ms for 194 launches on the H200). Those GEMV tiles
        # lose to cuBLAS at many rows, hence the bound. Needs the fused attention and the
        # layer scales folded into o / down (a strict-fp32 transformer stage); fp32 FMA, no
        # TF32 rounding.
        tr = self.codec.pre_transformer
        folded = all(layer.self_attn.o_proj in self._folded
                     and layer.mlp.down_proj in self._folded for layer in tr.layers)
        self.fused_layers_max_rows = (fused_layers_max_rows if self.fused_attention and folded
                                      and self.stages["transformer"].dtype == torch.float32
                                      else 0)  # fmt: skip
        # the fused layers' weights in scaled fp16 (None: TR_HALF_WEIGHTS): (weight, scale)
        # of each linear, {} when off or when no step runs the fused layers
        half_w = (dflt["transformer_half_weights"] if transformer_half_weights is None
                  else transformer_half_weights)  # fmt: skip
        self._tr_half: dict[object, tuple[Tensor, Tensor]] = {}
        if half_w and self.fused_layers_max_rows:
            with torch.no_grad():
                self._tr_half = self._half_transformer_weights()
        # larger steps on the fused layers as TF32 tiles (None: TR_TF32_MAX_ROWS), where the
        # GEMM path would run TF32 (see TR_TF32_MAX_ROWS)
        tf32_rows = (dflt["tf32_layers_max_rows"] if tf32_layers_max_rows is None
                     else tf32_layers_max_rows)  # fmt: skip
        if tf32_rows < 0:
            raise ValueError(f"tf32_layers_max_rows must be >= 0, got {tf32_rows}")
        self.tf32_layers_max_rows = (
            tf32_rows if self.fused_layers_max_rows and "transformer" in self.tf32_stages else 0)
        # Every step the engine can take (all slots, max_chunk frames each) on the fused
        # layers with the fp16 copies: the fp32 weights of the pre-transformer's linears are
        # never read, so they go (the copies are then the only ones)
        self.max_step_rows = (num_slots + 1) * max_chunk
        self.tr_fp32_dropped = bool(self._tr_half) and max(
            self.fused_layers_max_rows, self.tf32_layers_max_rows) >= self.max_step_rows
        if self.tr_fp32_dropped:
            self._drop_transformer_fp32()
        # the fused layers' qkv GEMV and attention as one launch (None: QKV_ATTEND)
        self.qkv_attend = bool(dflt["qkv_attend"] if qkv_attend is None else qkv_attend) and bool(
            self.fused_layers_max_rows)
        self.window = cfg.sliding_window
        self.ring = cfg.sliding_window - 1 + max_chunk
        head_dim = cfg.head_dim
        idx = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float()
        self.inv_freq = 1.0 / (cfg.rope_theta ** (idx / head_dim))  # [D / 2]
        self._ring_frames = torch.arange(self.ring, device=device)

        # -- per-slot state ------------------------------------------------------------------
        # the attention rings in fp16 (None: RING_HALF) where their stage is fp32, never in
        # the strict fp32 engine
        self.ring_half = (dflt["ring_half"] if ring_half is None
                          else ring_half) and precision != "fp32"  # fmt: skip
        S = num_slots + 1
        self.pos = torch.zeros(S, dtype=torch.long, device=device)
        self.state: list[tuple[Tensor, ...]] = []
        for m in self.codec.stateful:
            dtype = self._stage_of[m].dtype
            along_c = self.state_channels_last and dtype != torch.float32

            def zeros(S, C, L, dtype=dtype, along_c=along_c):  # [S, C, L]
                if along_c:  # a view of [S, L, C] storage
                    return torch.zeros((S, L, C), dtype=dtype, device=device).transpose(1, 2)
                return torch.zeros((S, C, L), dtype=dtype, device=device)

            if m is self.codec.decoder[-1] and self.output_epilogue:  # see OUTPUT_EPILOGUE
                self.state.append((torch.zeros((S, m.context, self._out_taps.shape[1]),
                                               dtype=torch.float32, device=device),)
                                  if m.context else ())  # fmt: skip
            elif isinstance(m, CausalConv1d):
                self.state.append((zeros(S, m.conv.in_channels, m.context),)
                                  if m.context else ())
            elif m in self._tconv_k:  # the input's last taps - 1 frames (see TCONV_CONV)
                ctx = m.overlap // m.stride
                self.state.append((zeros(S, m.conv.in_channels, ctx),) if ctx else ())
            elif isinstance(m, CausalConvTranspose1d):
                self.state.append((zeros(S, m.conv.out_channels, m.overlap),)
                                  if m.overlap else ())
            else:  # Attention: a K and a V ring
                shape = (S, m.n_kv, self.ring, m.head_dim)
                ring_dtype = (torch.float16 if self.ring_half and dtype == torch.float32
                              else dtype)  # fmt: skip
                self.state.append(tuple(torch.zeros(shape, dtype=ring_dtype, device=device)
                                        for _ in range(2)))

    # -- set-up ------------------------------------------------------------------------------
    def _load(self, codec: CodecDecoder, device: torch.device) -> None:
        """A private copy of the decoder with each stage's weights in its dtype."""
        src = codec
        codec = copy.deepcopy(src).to(device=device, dtype=torch.float32).eval()
        for p in codec.parameters():
            p.requires_grad_(False)
        # Only into fp32 stages: a small scale folded into half-precision weights would push
        # them into fp16's subnormals (ConvNeXt's gamma starts at 1e-6).
        fp32 = {n for n, s in self.stages.items() if s.dtype == torch.float32}
        self._folded = _fold_scales(codec, "transformer" in fp32, "upsample" in fp32)
        self.codec = codec
        names = stage_names(codec)
        parts = [codec.pre_conv, codec.pre_transformer, codec.upsample, *codec.decoder]
        # decoder = [conv in, blocks..., SnakeBeta, conv out]: the last two form the output
        groups = [[p] for p in parts[:-2]] + [parts[-2:]]
        self._stage_of: dict[nn.Module, _Stage] = {}
        for name, group in zip(names, groups, strict=True):
            stage = self.stages[name]
            for part in group:
                for m in part.modules():
                    self._stage_of[m] = stage
                if stage.dtype != torch.float32:
                    part.to(stage.dtype)
                elif stage.emulate_tf32:
                    for p in part.parameters():
                        if p.dim() >= 2:
                            p.copy_(round_to_tf32(p))
        for m in codec.modules():
            if isinstance(m, nn.LayerNorm):
                m.float()  # statistics and affine in fp32, cast back after
        self._snake = {m: tuple(t.to(device) for t in _snake_params(s))
                       for m, s in zip(self._snake_modules(codec), self._snake_modules(src),
                                       strict=True)}
        # The codebooks summed through output_proj (a 1x1 conv, linear): pre-project every
        # codebook once, so a frame is one gather of Q rows and a sum, in fp32.
        q = src.quantizer
        tables = []
        for group in (q.rvq_first, q.rvq_rest):
            w = group.output_proj.weight.detach().float()[:, :, 0].to(device)  # [io, dim]
            for layer in group.vq.layers:
                tables.append(layer._codebook.embedding().detach().float().to(device) @ w.T)
        self.codebooks = torch.cat(tables)  # [Q * size, codebook_dim]
        # q/k/v and gate/up packed: one GEMM each (Linear(x) rows are independent of packing);
        # the unpacked weights and biases are dropped, so nothing is held twice
        self._packed = {}
        for layer in codec.pre_transformer.layers:
            a, mlp = layer.self_attn, layer.mlp
            bias = None if a.q_proj.bias is None else torch.cat(
                [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            self._packed[layer] = (
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), bias,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            )
            for m in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
                _drop_params(m)
        del codec.quantizer  # only the pre-projected tables are used
        size = self.config.codebook_size
        self._book_offset = (torch.arange(len(tables), device=device) * size)[None, :, None]
        # "gemm" / "triton" convs: stride-1 weights packed once as [k, Cin, Cout] (the
        # implicit-GEMM kernel's operand; viewed [k * Cin, Cout] it is the GEMM operand of an
        # im2col laid out (tap, cin)), transposed-conv weights as [Cin, k * Cout] (columns
        # (tap, cout)); the unpacked weights are dropped, so nothing is held twice.
        self._conv_w: dict[nn.Module, Tensor] = {}
        self._tconv_w: dict[nn.Module, Tensor] = {}
        # TCONV_CONV: (weight [taps, Cin, stride * Cout], bias [stride * Cout]) per module
        self._tconv_k: dict[nn.Module, tuple[Tensor, Tensor]] = {}
        if self.conv_impl != "cudnn":
            for m in codec.modules():
                if isinstance(m, CausalConv1d) and m.conv.groups == 1:
                    self._conv_w[m] = pack_conv_weight(m.conv.weight)  # [Cout, Cin, k] in
                elif isinstance(m, CausalConvTranspose1d):
                    w = m.conv.weight  # [Cin, Cout, k]
                    k = w.shape[-1]
                    if k % m.stride:
                        raise ValueError(f"gemm transposed conv needs kernel % stride == 0, "
                                         f"got kernel {k}, stride {m.stride}")
                    if (self.tconv_conv and self._stage_of[m].dtype != torch.float32
                            and m.conv.bias is not None):
                        self._tconv_k[m] = pack_tconv_as_conv(w, m.conv.bias, m.stride)
                    else:
                        self._tconv_w[m] = w.permute(0, 2, 1).reshape(w.shape[0], -1).contiguous()
                else:
                    continue
                _drop_params(m.conv, bias=False)

    def _half_transformer_weights(self) -> dict[object, tuple[Tensor, Tensor]]:
        """The pre-transformer's linears as `scaled_half_weight`s, keyed as the fused layers
        read them: the input / output projections by module, each layer's packed qkv and
        gate/up by (layer, "qkv" / "gate_up"), its o / down projections by module."""
        tr = self.codec.pre_transformer
        half = {tr.input_proj: scaled_half_weight(tr.input_proj.weight),
                tr.output_proj: scaled_half_weight(tr.output_proj.weight)}
        for layer in tr.layers:
            qkv_weight, _, gate_up_weight = self._packed[layer]
            half[layer, "qkv"] = scaled_half_weight(qkv_weight)
            half[layer, "gate_up"] = scaled_half_weight(gate_up_weight)
            for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
                half[m] = scaled_half_weight(m.weight)
        return half

    def _drop_transformer_fp32(self) -> None:
        """Free the fp32 weights of the pre-transformer's linears (their biases stay): the
        fused layers read the scaled fp16 copies (`_half_transformer_weights`) only."""
        tr = self.codec.pre_transformer
        empty = tr.input_proj.weight.new_empty(0)
        for m in (tr.input_proj, tr.output_proj):
            _drop_params(m, bias=False)
        for layer in tr.layers:
            _, qkv_bias, _ = self._packed[layer]
            self._packed[layer] = (empty, qkv_bias, empty)
            for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
                _drop_params(m, bias=False)

    def _output_epilogue_fits(self) -> bool:
        """Whether the output stage can begin in the last 1x1 conv's epilogue
        (OUTPUT_EPILOGUE): the fused output stage (fp32, a conv to one channel of at most 16
        taps with a bias) after a half-precision decoder block whose last residual unit ends
        in a packed 1x1 conv of at most OUTPUT_TAPS_MAX_COUT channels, on Triton convs."""
        dec = self.codec.decoder
        out, block = dec[-1], dec[-3]
        if not (self.fused_output and self.conv_impl == "triton" and isinstance(block, DecoderBlock)
                and out in self._conv_w and out.conv.out_channels == 1 and out.conv.bias is not None
                and out.conv.kernel_size[0] <= 16 and out.conv.groups == 1
                and self._stage_of[out].dtype == torch.float32):
            return False
        unit = block.block[-1]
        return (isinstance(unit, ResidualUnit) and unit.conv2 in self._conv_w
                and not unit.conv2.context and unit.conv2.conv.bias is not None
                and unit.conv2.conv.out_channels <= OUTPUT_TAPS_MAX_COUT
                and self._stage_of[unit].dtype != torch.float32)

    @staticmethod
    def _snake_modules(codec: nn.Module) -> list[nn.Module]:
        return [m for m in codec.modules() if hasattr(m, "alpha") and (
            hasattr(m, "beta") or hasattr(m, "inv_beta"))]

    def weight_bytes(self) -> int:
        """Bytes of the engine's own weights: its private decoder copy (in the stages'
        dtypes), the packed conv weights and the pre-projected codebook tables."""
        tensors = [*self.codec.parameters(), *self._conv_w.values(), *self._tconv_w.values(),
                   self.codebooks, *(t for packed in self._packed.values() for t in packed
                                     if t is not None),
                   *(t for pair in self._tr_half.values() for t in pair),
                   *(t for pair in self._tconv_k.values() for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- state -------------------------------------------------------------------------------
    def tensors(self) -> list[Tensor]:
        """Every state tensor (the position counter included), each [slots + 1, ...]."""
        return [self.pos, *(t for group in self.state for t in group)]

    @torch.no_grad()
    def reset(self, slots: Tensor | list[int]) -> None:
        """Zero the state of `slots` for new requests (a LongTensor on the engine's device
        needs no host copy and can be captured in a graph)."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        for t in self.tensors():
            t.index_fill_(0, slots, 0)

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, rows: Tensor, codes: Tensor) -> Tensor:
        """rows: LongTensor [B] (slots; padding rows = `scratch`), codes: [B, Q, n] ->
        pcm float32 [B, n * 1920], the continuation of each row's audio."""
        with codec_pdl_scope(rows.shape[0] <= self.pdl_max_rows):  # see CODEC_PDL_MAX_ROWS
            return self._step(rows, codes)

    def _step(self, rows: Tensor, codes: Tensor) -> Tensor:
        n = codes.shape[-1]
        if n > self.max_chunk:
            raise ValueError(f"{n} frames per step exceeds max_chunk {self.max_chunk}")
        c = self.codec
        pos = self.pos.index_select(0, rows)  # [B]
        if self.lookup_fused:  # one launch, in the stage's dtype (see LOOKUP_FUSED)
            x = codebook_sum(codes, self.codebooks, self.config.codebook_size,
                             self.stages["pre_conv"].dtype)  # fmt: skip
        else:
            book = codes + self._book_offset  # [B, Q, n]
            x = self.codebooks[book].sum(1).transpose(1, 2)  # [B, codebook_dim, n] fp32
        with self._in_stage("pre_conv") as st:
            x = self._conv(c.pre_conv, x.to(st.dtype), rows, st)  # [B, latent, n]
        with self._in_stage("transformer") as st:
            x = self._transformer(x.transpose(1, 2).to(st.dtype), rows, pos, st,
                                  self.stages["upsample"].dtype).transpose(1, 2)
        with self._in_stage("upsample") as st:
            x = x.to(st.dtype)
            for up, block in c.upsample:
                x = self._convnext(block, self._conv_t(up, x, rows, st), rows, st)
        names = stage_names(c)
        decoder = list(zip(names[3:-1], c.decoder[:-2], strict=True))
        act_done = False  # whether x already had the coming block's first SnakeBeta
        for i, (name, m) in enumerate(decoder):
            with self._in_stage(name) as st:
                x = x.to(st.dtype)
                nxt = decoder[i + 1] if i + 1 < len(decoder) else None
                out_act = None
                # (a block's output comes from its last residual unit: none, nothing to fold in)
                if (self.fold_block_act and nxt is not None and isinstance(nxt[1], DecoderBlock)
                        and self.stages[nxt[0]].dtype == st.dtype
                        and (not isinstance(m, DecoderBlock) or len(m.block) > 2)):
                    out_act = nxt[1].block[0]
                if isinstance(m, DecoderBlock):  # the last one's taps with OUTPUT_EPILOGUE
                    x = self._decoder_block(m, x, rows, st, act_done, out_act,
                                            taps=self.output_epilogue and nxt is None)
                else:
                    x = self._conv(m, x, rows, st, out_act=out_act)
                act_done = out_act is not None
        with self._in_stage(OUTPUT_STAGE) as st:
            act, out = c.decoder[-2], c.decoder[-1]
            tail = self.state[out.slot][0] if out.context else None
            w = self._conv_w.get(out)
            if self.output_epilogue:  # x: the stage's taps [B, n * 1920, 16] (OUTPUT_EPILOGUE)
                pcm = output_from_taps(x, out.conv.kernel_size[0], out.conv.bias, tail, rows,
                                       out.conv.dilation[0])  # fmt: skip
            elif (self.fused_output and w is not None and w.shape[-1] == 1
                    and st.dtype == torch.float32 and out.conv.bias is not None):
                pcm = codec_output(x, w, out.conv.bias, *self._snake[act], tail, rows,
                                   out.conv.dilation[0])  # [B, n * 1920] fp32, clamped
            else:
                x = self._conv(out, x.to(st.dtype), rows, st, act=act)
                pcm = x.float().clamp(-1.0, 1.0)[:, 0]  # [B, n * 1920]
        self.pos.index_copy_(0, rows, pos + n)
        return pcm

    @contextlib.contextmanager
    def _in_stage(self, name: str):
        stage = self.stages[name]
        if self.device.type == "cuda":
            with _tf32_mode(stage.tf32):
                yield stage
        else:
            yield stage

    # -- layers ------------------------------------------------------------------------------
    def _act(self, m: nn.Module, x: Tensor, rows: Tensor, channels_last: bool = False) -> Tensor:
        """SnakeBeta in fp32 math: x + inv_beta * sin(alpha * x)^2, cast back to x's dtype."""
        return snake_context(x, *self._snake[m], None, rows, channels_last=channels_last)

    def _conv(self, m: CausalConv1d, x: Tensor, rows: Tensor, st: _Stage,
              act: nn.Module | None = None, residual: Tensor | None = None,
              out_act: nn.Module | None = None, pre: Tensor | None = None,
              next_act: tuple | None = None) -> Tensor:
        """residual + the causal conv of act(x) (act: a SnakeBeta or None), its left context
        read from and written back to the rows' tails [S, Cin, context]; then out_act (a
        SnakeBeta or None) of that: in the implicit-GEMM kernel's epilogue where it runs the
        conv, else as a launch of its own. pre: act(x) already written after the context
        columns of this [B, Cin, context + n] buffer (NEXT_ACT_FOLD): only the context is
        put in; next_act: causal_conv's (`_fold_next` holds)."""
        y, applied = self._conv_in(m, x, rows, st, act, residual, out_act, pre, next_act)
        if out_act is None or applied:
            return y
        return self._act(out_act, y, rows, channels_last=y.stride(1) == 1)

    def _split_step(self, streams: int) -> bool:
        """Whether a step of `streams` streams runs every half-precision conv on the
        implicit-GEMM kernel with split-K (CONV_SPLIT_MAX_STREAMS)."""
        return streams <= self.conv_split_max_streams

    def _implicit(self, streams: int, n: int) -> bool:
        """Whether a half-precision conv of `streams` x `n` output rows runs on the
        implicit-GEMM kernel (IMPLICIT_MIN_ROWS, `_split_step`)."""
        return streams * n >= IMPLICIT_MIN_ROWS or self._split_step(streams)

    def _conv_in(self, m: CausalConv1d, x: Tensor, rows: Tensor, st: _Stage,
                 act: nn.Module | None, residual: Tensor | None,
                 out_act: nn.Module | None, pre: Tensor | None = None,
                 next_act: tuple | None = None) -> tuple[Tensor, bool]:
        """`_conv` before out_act, and whether the kernel applied out_act already."""
        conv = m.conv
        if pre is not None and not m.context:
            raise ValueError("a prepared input (pre) is for a conv with left context")
        alpha, inv_beta = self._snake[act] if act is not None else (None, None)
        w = self._conv_w.get(m)
        if next_act is not None and not (w is not None and not m.context and out_act is None
                                         and self._on_kernel(x)):
            raise ValueError("next_act is written only by the implicit-GEMM kernel's epilogue")
        split = self._split_step(x.shape[0])
        if (w is not None and self.fused_convs and not m.context and alpha is not None
                and x.dtype != torch.float32 and self._implicit(x.shape[0], x.shape[-1])):
            # no left context to keep: the SnakeBeta runs inside the conv's input load
            return causal_conv(x, w, conv.bias, conv.dilation[0], residual, alpha=alpha,
                               inv_beta=inv_beta, channels_last=self.channels_last,
                               split=split), False  # fmt: skip
        tail = self.state[m.slot][0] if m.context else None
        # channels-last only where the implicit-GEMM kernel takes the conv (see __init__)
        last = (self.channels_last and w is not None and x.dtype != torch.float32
                and self._implicit(x.shape[0], x.shape[-1]))  # fmt: skip
        if pre is not None:  # act(x) in place already (NEXT_ACT_FOLD): only the context
            x = context_fill(pre, tail, rows)
        elif alpha is not None or tail is not None or (last and x.stride(1) != 1):
            x = snake_context(x, alpha, inv_beta, tail, rows,
                              channels_last=last)  # [B, Cin, context + n]
        # else nothing to apply or put in front: the conv reads x as it is
        if w is None:  # cuDNN: conv_impl "cudnn", and depthwise convs
            y = F.conv1d(st.mm_in(x), conv.weight, conv.bias, dilation=conv.dilation,
                         groups=conv.groups)
            return (y if residual is None else residual + y), False
        B, cin, L = x.shape
        k, d = conv.kernel_size[0], conv.dilation[0]
        n = L - m.context
        if self.conv_impl == "triton" and x.dtype != torch.float32 and self._implicit(B, n):
            if next_act is not None:
                return causal_conv(x, w, conv.bias, d, residual, channels_last=last,
                                   split=split, next_act=next_act), False  # fmt: skip
            if out_act is not None:
                out_alpha, out_inv_beta = self._snake[out_act]
                return causal_conv(x, w, conv.bias, d, residual, out_alpha=out_alpha,
                                   out_inv_beta=out_inv_beta, channels_last=last,
                                   split=split), True  # fmt: skip
            return causal_conv(x, w, conv.bias, d, residual, channels_last=last,
                               split=split), False  # fmt: skip
        # im2col: patches [B, n, k, Cin] (tap j of output t is input t + j * dilation), one
        # GEMM with the bias fused; the result is [B, Cout, n] as a view of [B, n, Cout].
        cols = x.unfold(2, m.context + 1, 1)[..., ::d]  # [B, Cin, n, k]
        cols = st.mm_in(cols.permute(0, 2, 3, 1).reshape(B * n, k * cin))
        w = w.view(k * cin, -1)
        y = cols @ w if conv.bias is None else torch.addmm(conv.bias, cols, w)  # [B * n, Cout]
        y = y.view(B, n, -1).transpose(1, 2)
        return (y if residual is None else residual + y), False

    def _conv_t(self, m: CausalConvTranspose1d, x: Tensor, rows: Tensor, st: _Stage,
                act: nn.Module | None = None) -> Tensor:
        """act: a SnakeBeta applied to x first (TCONV_CONV modules only)."""
        conv = m.conv
        n_out = x.shape[-1] * m.stride
        if m in self._tconv_k:
            return self._conv_t_conv(m, x, rows, act)
        if act is not None:
            raise ValueError("act is applied here only on the TCONV_CONV path")
        w = self._tconv_w.get(m)
        if w is not None:
            return self._conv_t_gemm(m, x, rows, st, w)
        y = F.conv_transpose1d(st.mm_in(x), conv.weight, None, stride=m.stride)
        if m.overlap:  # y: [B, Cout, n_out + overlap], bias not yet added
            (spill,) = self.state[m.slot]
            y = torch.cat([y[..., : m.overlap] + spill.index_select(0, rows),
                           y[..., m.overlap:]], dim=-1)
            spill.index_copy_(0, rows, y[..., n_out:])
        return y[..., :n_out] + conv.bias[:, None]

    def _conv_t_conv(self, m: CausalConvTranspose1d, x: Tensor, rows: Tensor,
                     act: nn.Module | None) -> Tensor:
        """The transposed conv as a causal conv over act(x) with the slot's input tail as
        its left context (see TCONV_CONV): [B, Cout, n * stride], a channels-last view."""
        w, bias = self._tconv_k[m]
        B, _, n = x.shape
        tail = self.state[m.slot][0] if m.overlap else None
        alpha, inv_beta = self._snake[act] if act is not None else (None, None)
        if tail is not None or alpha is not None or x.stride(1) != 1:
            x = snake_context(x, alpha, inv_beta, tail, rows, channels_last=True)
        y = causal_conv(x, w, bias, 1, channels_last=True,
                        split=self._split_step(B))  # [B, s * Cout, n]
        cout = m.conv.out_channels
        return y.transpose(1, 2).reshape(B, n * m.stride, cout).transpose(1, 2)

    def _conv_t_gemm(self, m: CausalConvTranspose1d, x: Tensor, rows: Tensor, st: _Stage,
                     w: Tensor, next_act: tuple | None = None) -> Tensor:
        """Transposed conv as z = x^T @ w ([B, n, taps, stride, Cout]: input frame t's
        contribution to output blocks t .. t + taps - 1), then the overlap-add with the slot's
        spill (plugins.causal_conv.overlap_add: one kernel with the fused convs, else the
        eager ops); next_act: overlap_add's (NEXT_ACT_FOLD)."""
        B, cin, n = x.shape
        s, cout = m.stride, m.conv.out_channels
        taps = m.conv.kernel_size[0] // s
        z = (st.mm_in(x.transpose(1, 2).reshape(B * n, cin)) @ w).view(B, n, taps, s, cout)
        spill = self.state[m.slot][0] if taps > 1 else None  # [S, Cout, overlap]
        kernel = None if self.fused_convs else False
        return overlap_add(z, spill, rows, m.conv.bias, channels_last=self.channels_last,
                           next_act=next_act, use_triton=kernel)

    def _linear(self, m: nn.Linear, x: Tensor, st: _Stage) -> Tensor:
        return F.linear(st.mm_in(x), m.weight, m.bias)

    def _convnext(self, m: ConvNeXtBlock, x: Tensor, rows: Tensor, st: _Stage) -> Tensor:
        B, _, n = x.shape
        if (CONVNEXT_FUSED and self.fused and x.dtype != torch.float32
                and B * n <= CONVNEXT_FUSED_MAX_ROWS and want_triton(x, None)):
            dw = m.dwconv
            tail = self.state[dw.slot][0] if dw.context else None
            xe = snake_context(x, None, None, tail, rows)  # [B, C, context + n], tail kept
            return convnext(x, xe, dw.conv.weight, dw.conv.bias, m.norm.weight, m.norm.bias,
                            m.norm.eps, m.pwconv1.weight, m.pwconv1.bias, m.pwconv2.weight,
                            m.pwconv2.bias, None if m in self._folded else m.gamma)  # fmt: skip
        if (DWCONV_NORM and self.fused and x.dtype != torch.float32
                and m.dwconv.conv.bias is not None and want_triton(x, None)):
            dw = m.dwconv
            tail = self.state[dw.slot][0] if dw.context else None
            xe = snake_context(x, None, None, tail, rows)  # [B, C, context + n], tail kept
            h = dwconv_norm(xe, dw.conv.weight, dw.conv.bias, m.norm.weight, m.norm.bias,
                            m.norm.eps)  # [B, T, C]
        else:
            h = self._conv(m.dwconv, x, rows, st).transpose(1, 2)  # [B, T, C]
            h = m.norm(h.float()).to(x.dtype)
        h = self._linear(m.pwconv2, F.gelu(self._linear(m.pwconv1, h, st)), st)
        return x + (h if m in self._folded else m.gamma * h).transpose(1, 2)

    def _linear_residual(self, m: nn.Linear, scale: nn.Module, y: Tensor, x: Tensor,
                         st: _Stage) -> Tensor:  # fmt: skip
        """x + scale * m(y), as one GEMM with the residual as its accumulator where the
        scale is folded into m's weight (`_fold_scales`)."""
        if m not in self._folded:
            return x + scale(self._linear(m, y, st))
        if m.bias is not None:
            return x + self._linear(m, y, st)
        shape = x.shape
        out = torch.addmm(x.reshape(-1, shape[-1]), st.mm_in(y.reshape(-1, y.shape[-1])),
                          m.weight.T)  # fmt: skip
        return out.view(shape)

    def _decoder_block(self, m: DecoderBlock, x: Tensor, rows: Tensor, st: _Stage,
                       act_done: bool = False, out_act: nn.Module | None = None,
                       taps: bool = False) -> Tensor:
        """act_done: x is already SnakeBeta(x) of the block's act (FOLD_BLOCK_ACT); out_act:
        a SnakeBeta (the next block's first) applied to the block's output; taps: the
        output stage's taps of the block's output returned in its place (OUTPUT_EPILOGUE)."""
        act, up, *units = m.block
        pre = None  # the unit's conv1 input, made before it (NEXT_ACT_FOLD)
        if up in self._tconv_k:  # the SnakeBeta with the conv's context (see TCONV_CONV)
            x = self._conv_t(up, x, rows, st, act=None if act_done else act)
        else:
            if not act_done:
                # channels-last: the transposed conv's GEMM reads x^T without a copy
                last = self.channels_last and up in self._tconv_w and x.dtype != torch.float32
                x = self._act(act, x, rows, channels_last=last)
            if self.next_act_fold and up in self._tconv_w and x.dtype != torch.float32:
                # the first unit's act1 in the overlap-add (see NEXT_ACT_FOLD)
                ctx = units[0].conv1.context
                pre = self._fold_buffer(x, ctx, x.shape[-1] * up.stride, up.conv.out_channels)
                x = self._conv_t_gemm(up, x, rows, st, self._tconv_w[up],
                                      next_act=(*self._snake[units[0].act1], pre[..., ctx:]))
            else:
                x = self._conv_t(up, x, rows, st)
        for i, u in enumerate(units):
            last = i == len(units) - 1
            x, pre = self._residual(u, x, rows, st, out_act if last else None,
                                    taps=taps and last, pre=pre,
                                    nxt=None if last else units[i + 1])  # fmt: skip
        return x

    def _residual(self, m: ResidualUnit, x: Tensor, rows: Tensor, st: _Stage,
                  out_act: nn.Module | None = None, taps: bool = False,
                  pre: Tensor | None = None,
                  nxt: ResidualUnit | None = None) -> tuple[Tensor, Tensor | None]:
        """out_act: a SnakeBeta applied to the unit's output (in the 1x1 conv's epilogue
        where the kernel runs it); taps: the output stage's taps of the unit's output
        returned in its place (`_conv_taps`); pre: conv1's input [B, C, context + n] with
        its SnakeBeta'd samples after the context, written by the unit before (`_fold_next`);
        nxt: the next unit. Returns (the output, the next unit's pre or None)."""
        c1, c2 = m.conv1, m.conv2
        if taps:
            if self.snake_epilogue and x.shape[0] * x.shape[-1] < SNAKE_EPILOGUE_MAX_ROWS:
                h = self._conv(c1, x, rows, st, act=m.act1, out_act=m.act2, pre=pre)
                return self._conv_taps(c2, h, rows, st, residual=x), None
            h = self._conv(c1, x, rows, st, act=m.act1)
            return self._conv_taps(c2, h, rows, st, act=m.act2, residual=x), None
        if (FUSED_UNIT_MAX_C and self.conv_impl == "triton" and self.channels_last
                and x.dtype != torch.float32 and triton_block(x.shape[1]) <= FUSED_UNIT_MAX_C
                and x.shape[0] * x.shape[-1] >= IMPLICIT_MIN_ROWS and c1 in self._conv_w
                and c2 in self._conv_w and c1.conv.bias is not None
                and c2.conv.bias is not None and want_triton(x, None)):
            # the whole unit in one launch (see FUSED_UNIT_MAX_C)
            tail = self.state[c1.slot][0] if c1.context else None
            xin = snake_context(x, *self._snake[m.act1], tail, rows, channels_last=True)
            y = residual_unit(xin, self._conv_w[c1], c1.conv.bias, c1.conv.dilation[0],
                              *self._snake[m.act2], self._conv_w[c2], c2.conv.bias, x,
                              channels_last=True)  # fmt: skip
            return y if out_act is None else self._act(out_act, y, rows, channels_last=True), None
        if self.snake_epilogue and x.shape[0] * x.shape[-1] < SNAKE_EPILOGUE_MAX_ROWS:
            # act2 in conv1's epilogue (see SNAKE_EPILOGUE)
            h = self._conv(m.conv1, x, rows, st, act=m.act1, out_act=m.act2, pre=pre)
            if nxt is not None and out_act is None and self._fold_next(c2, h):
                # the next unit's act1 here (see NEXT_ACT_FOLD)
                ctx = nxt.conv1.context
                nxt_in = self._fold_buffer(h, ctx, h.shape[-1], c2.conv.out_channels)
                y = self._conv(c2, h, rows, st, residual=x,
                               next_act=(*self._snake[nxt.act1], nxt_in[..., ctx:]))
                return y, nxt_in
            return self._conv(m.conv2, h, rows, st, residual=x, out_act=out_act), None
        h = self._conv(m.conv1, x, rows, st, act=m.act1)
        return self._conv(m.conv2, h, rows, st, act=m.act2, residual=x, out_act=out_act), None

    def _fold_next(self, m: CausalConv1d, x: Tensor) -> bool:
        """Whether the 1x1 conv `m` of input x writes the next unit's SnakeBeta'd input
        (NEXT_ACT_FOLD): where the implicit-GEMM kernel runs it (`_conv_in`'s branch)."""
        return self.next_act_fold and m in self._conv_w and not m.context and self._on_kernel(x)

    def _on_kernel(self, x: Tensor) -> bool:
        """Whether a conv with no left context of input x [B, Cin, n] runs on the
        implicit-GEMM kernel (given its packed weight): `_conv_in`'s kernel branch."""
        return (self.conv_impl == "triton" and x.dtype != torch.float32
                and self._implicit(x.shape[0], x.shape[-1]))

    def _fold_buffer(self, like: Tensor, ctx: int, n: int, channels: int) -> Tensor:
        """The next conv's input [B, channels, ctx + n] of like's dtype (NEXT_ACT_FOLD), a
        view of contiguous [B, ctx + n, channels] storage: its samples written after ctx
        columns by a kernel's next_act, its context by context_fill."""
        return torch.empty((like.shape[0], ctx + n, channels), dtype=like.dtype,
                           device=like.device).transpose(1, 2)

    def _conv_taps(self, m: CausalConv1d, x: Tensor, rows: Tensor, st: _Stage,
                   act: nn.Module | None = None, residual: Tensor | None = None) -> Tensor:
        """The output stage's taps [B, n, 16] fp32 of `_conv(m, x, ..., act, residual)`'s
        output (OUTPUT_EPILOGUE): in the implicit-GEMM kernel's epilogue where it runs that
        1x1 conv (its output never stored), else from the conv's output."""
        alpha, inv_beta = self._snake[self.codec.decoder[-2]]
        w = self._conv_w[m]
        B, n = x.shape[0], x.shape[-1]
        if x.dtype != torch.float32 and self._implicit(B, n) and (act is None or self.fused_convs):
            in_alpha, in_inv_beta = self._snake[act] if act is not None else (None, None)
            return conv_output_taps(x, w, m.conv.bias, m.conv.dilation[0], residual,
                                    self._out_taps, alpha, inv_beta, in_alpha=in_alpha,
                                    in_inv_beta=in_inv_beta, split=self._split_step(B))
        y = self._conv(m, x, rows, st, act=act, residual=residual)
        return output_taps_reference(y, self._out_taps, alpha, inv_beta)

    def _transformer(self, x: Tensor, rows: Tensor, pos: Tensor, st: _Stage,
                     next_dtype: torch.dtype | None = None) -> Tensor:
        """next_dtype: the next stage's; the fused layers' last linear stores its output in it
        (rounded as the cast after it would: a launch fewer), the GEMM path in fp32."""
        tr = self.codec.pre_transformer  # x: [B, n, latent]
        if x.shape[0] * x.shape[1] > self.max_step_rows:
            raise ValueError(f"a codec step of {x.shape[0]} x {x.shape[1]} frames is more than "
                             f"the engine's {self.num_slots + 1} slots x {self.max_chunk}")
        if 0 < x.shape[0] * x.shape[1] <= self.fused_layers_max_rows:
            return self._transformer_fused(x, rows, pos, out_dtype=next_dtype)
        if 0 < x.shape[0] * x.shape[1] <= self.tf32_layers_max_rows:
            return self._transformer_fused(x, rows, pos, tf32=True, out_dtype=next_dtype)
        if self.fused_attention:  # made in each layer's attention kernel (ring_attention_rope)
            mask = cos = sin = ring_idx = None
        else:  # once per step, shared by the layers
            mask, cos, sin, ring_idx = ring_step_inputs(pos, x.shape[1], self._ring_frames,
                                                        self.window, self.inv_freq, x.dtype)
        h = self._linear(tr.input_proj, x, st)
        for layer in tr.layers:
            h = self._layer(layer, h, cos, sin, mask, rows, ring_idx, st, pos)
        return self._linear(tr.output_proj, rms_norm(h, tr.norm.weight, tr.norm.eps), st)

    def _transformer_fused(self, x: Tensor, rows: Tensor, pos: Tensor, tf32: bool = False,
                           out_dtype: torch.dtype | None = None) -> Tensor:
        """`_transformer` as fused_linear launches (see fused_layers_max_rows); tf32: a step
        of more rows, on TF32 tiles (see TR_TF32_MAX_ROWS)."""
        tr = self.codec.pre_transformer
        b, n, _ = x.shape
        # up to fused_layers_max_rows rows: fp32 ones as GEMVs (16-row fp32 tiles go through
        # tl.dot's IEEE path: 2.6 ms a step from 2 rows on the H200); more: TF32 tiles
        gemv = functools.partial(fused_linear, gemv_rows_f32=self.fused_layers_max_rows,
                                 tf32=tf32)  # fmt: skip
        half = self._tr_half

        def weights(weight: Tensor, key: object) -> tuple[Tensor, Tensor | None]:
            # (weight, scale): `key`'s scaled fp16 copy where they are on, else the fp32 weight
            return half[key] if half else (weight, None)

        def linear(x: Tensor, weight: Tensor, key: object, **kw) -> Tensor:
            return gemv(x, *weights(weight, key), **kw)

        h = linear(x.reshape(b * n, -1), tr.input_proj.weight, tr.input_proj,
                   bias=tr.input_proj.bias)  # fmt: skip
        for layer in tr.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias, gate_up_weight = self._packed[layer]
            norm = layer.input_layernorm
            k_ring, v_ring = self.state[a.slot]
            if self.qkv_attend and not tf32 and b <= QKV_ATTEND_MAX_STREAMS:  # see QKV_ATTEND
                weight, scale = weights(qkv_weight, (layer, "qkv"))
                y = norm_linear_ring_attend(
                    h, norm.weight, weight, scale, qkv_bias, pos, rows, k_ring, v_ring,
                    self.inv_freq, window=self.window, attn_scale=a.head_dim ** -0.5,
                    eps=norm.eps, gemv_rows_f32=self.fused_layers_max_rows,
                )  # fmt: skip
            else:
                qkv = linear(h, qkv_weight, (layer, "qkv"), norm_weight=norm.weight,
                             eps=norm.eps, bias=qkv_bias)  # fmt: skip
                y = ring_attention_rope(qkv.view(b, n, a.n_head + 2 * a.n_kv, a.head_dim), pos,
                                        rows, k_ring, v_ring, self.inv_freq, self.window,
                                        a.head_dim ** -0.5)  # fmt: skip
            h = linear(y.view(b * n, -1), a.o_proj.weight, a.o_proj, bias=a.o_proj.bias,
                       residual=h)  # fmt: skip
            norm = layer.post_attention_layernorm
            act = linear(h, gate_up_weight, (layer, "gate_up"), norm_weight=norm.weight,
                         eps=norm.eps, gate_up=True)  # fmt: skip
            h = linear(act, mlp.down_proj.weight, mlp.down_proj, bias=mlp.down_proj.bias,
                       residual=h)  # fmt: skip
        out = linear(h, tr.output_proj.weight, tr.output_proj, norm_weight=tr.norm.weight,
                     eps=tr.norm.eps, bias=tr.output_proj.bias, out_dtype=out_dtype)  # fmt: skip
        return out.view(b, n, -1)

    def _layer(self, layer: TransformerLayer, x: Tensor, cos: Tensor | None,
               sin: Tensor | None, mask: Tensor | None, rows: Tensor, ring_idx: Tensor | None,
               st: _Stage, pos: Tensor | None = None) -> Tensor:
        """mask None: the fused attention step (RoPE, ring writes, mask in one kernel), at the
        rows' positions `pos`."""
        a = layer.self_attn
        b, n, _ = x.shape
        qkv_weight, qkv_bias, _ = self._packed[layer]
        norm = layer.input_layernorm
        qkv = F.linear(st.mm_in(rms_norm(x, norm.weight, norm.eps)), qkv_weight, qkv_bias)
        qkv = qkv.view(b, n, a.n_head + 2 * a.n_kv, a.head_dim)
        k_ring, v_ring = self.state[a.slot]  # [S, Hkv, R, D]
        # Written out (plugins.ring_attention): a few frames against a ring of ~75 keys; SDPA
        # with a mask picks the memory-efficient kernel, 0.64 ms for the 8 layers at batch 64
        # against ~0.2 ms for plain matmuls. Every query sees itself: no row is all -inf.
        scale = a.head_dim ** -0.5
        if mask is None:
            y = ring_attention_rope(qkv, pos, rows, k_ring, v_ring, self.inv_freq, self.window,
                                    scale)  # fmt: skip
            return self._layer_tail(layer, y, x, st)
        qk, v = qkv[:, :, : a.n_head + a.n_kv], qkv[:, :, a.n_head + a.n_kv :]  # [B, n, *, D]
        qk = apply_rope(qk, cos, sin)  # q and k at once
        q, k = qk[:, :, : a.n_head], qk[:, :, a.n_head :]  # [B, n, H, D], [B, n, Hkv, D]
        k_ring[rows[:, None], :, ring_idx] = k.to(k_ring.dtype)  # the rows' new frames
        v_ring[rows[:, None], :, ring_idx] = v.to(v_ring.dtype)
        if self.fused:
            y = ring_attention(q, k_ring, v_ring, rows, mask, scale)
        else:
            y = ring_attention_reference(q, k_ring, v_ring, rows, mask, scale, st.mm_in)
        return self._layer_tail(layer, y, x, st)

    def _layer_tail(self, layer: TransformerLayer, y: Tensor, x: Tensor, st: _Stage) -> Tensor:
        """The layer after its attention: output projection, residual, MLP, residual."""
        a = layer.self_attn
        gate_up_weight = self._packed[layer][2]
        x = self._linear_residual(a.o_proj, layer.self_attn_layer_scale, y, x, st)
        norm = layer.post_attention_layernorm
        gate_up = F.linear(st.mm_in(rms_norm(x, norm.weight, norm.eps)), gate_up_weight)
        h = silu_mul(gate_up)
        return self._linear_residual(layer.mlp.down_proj, layer.mlp_layer_scale, h, x, st)


def _drop_params(module: nn.Module, bias: bool = True) -> None:
    """Empty `module`'s weight (and bias): a packed copy is the engine's only one."""
    for name in ("weight", "bias") if bias else ("weight",):
        p = getattr(module, name, None)
        if p is not None:
            setattr(module, name, nn.Parameter(p.new_empty(0), requires_grad=False))


def _fold_scales(codec: CodecDecoder, transformer: bool, convnext: bool) -> set[nn.Module]:
    """Per-channel output scales folded into the linear before them, in place (fp32, before
    the stages' casts): each transformer layer's attention and MLP layer scales into o_proj
    and down_proj, each ConvNeXt block's gamma into pwconv2. scale * (y @ W.T + b) equals
    y @ (scale * W).T + scale * b, so a residual branch is one GEMM and one add (or one addmm)
    instead of a GEMM, a multiply and an add. Returns the modules folded (the linears, and
    the ConvNeXt blocks whose gamma is in their pwconv2)."""
    pairs = []
    if transformer:
        for layer in codec.pre_transformer.layers:
            pairs += [(layer.self_attn.o_proj, layer.self_attn_layer_scale.scale, None),
                      (layer.mlp.down_proj, layer.mlp_layer_scale.scale, None)]
    if convnext:
        pairs += [(m.pwconv2, m.gamma, m) for m in codec.modules() if isinstance(m, ConvNeXtBlock)]
    folded = set()
    for linear, scale, block in pairs:
        linear.weight.mul_(scale[:, None])
        if linear.bias is not None:
            linear.bias.mul_(scale)
        scale.fill_(1.0)  # the module, if run, stays equivalent
        folded |= {linear} if block is None else {linear, block}
    return folded


# -- the quality gate ----------------------------------------------------------------------------


@torch.no_grad()
def decode_with(engine_or_decoder: CodecEngine | CodecDecoder, codes: Tensor,
                chunk: int = 4) -> Tensor:
    """codes [B, Q, T] -> pcm float32 [B, T * 1920]: an engine streams it (slots 0..B-1 reset,
    `chunk` frames per step), a decoder decodes it whole."""
    if isinstance(engine_or_decoder, CodecEngine):
        eng = engine_or_decoder
        B, T = codes.shape[0], codes.shape[-1]
        if B > eng.num_slots:
            raise ValueError(f"{B} rows need {B} slots; the engine has {eng.num_slots}")
        rows = torch.arange(B, device=eng.device)
        eng.reset(rows)
        codes = codes.to(eng.device)
        step = min(chunk, eng.max_chunk)
        out = [eng.step(rows, codes[..., i:i + step]) for i in range(0, T, step)]
        return torch.cat(out, dim=-1).float()
    dec = engine_or_decoder
    return dec(codes.to(next(dec.parameters()).device))[:, 0].float()


def snr_db(reference: Tensor, test: Tensor) -> float:
    """10 log10(signal power / error power), over all samples, in float64."""
    ref, out = reference.double().cpu(), test.double().cpu()
    noise = (out - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def codec_snr_db(engine_or_decoder: CodecEngine | CodecDecoder, reference_fp32: CodecDecoder,
                 codes: Tensor, chunk: int = 4) -> float:
    """SNR in dB of `engine_or_decoder`'s decode of `codes` [B, Q, T] (an engine's in steps of
    `chunk` frames) against the full decode of the fp32 reference decoder (TF32 off)."""
    with _tf32_mode(False):
        ref = decode_with(reference_fp32, codes)
    return snr_db(ref, decode_with(engine_or_decoder, codes, chunk=chunk))


def random_codes(config, batch: int, frames: int, seed: int) -> Tensor:
    """Uniform random codes [batch, Q, frames] (CPU), the gate's input."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames),
                         generator=g)


# -- CUDA graphs ---------------------------------------------------------------------------------


def capture_step(engine: CodecEngine, rows: Tensor, codes: Tensor, pool=None,
                 stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """One CUDA graph of `engine.step(rows, codes)` over the static buffers `rows` [B] and
    `codes` [B, Q, n]; returns (graph, pcm [B, n * 1920]) with pcm refreshed by each replay.

    The two warm-up steps and the capture step advance the state of the slots in `rows`:
    capture with `rows` at the scratch slot (or reset them afterwards). `stream`: the side
    stream to capture on (the codec's own stream), a fresh one if None.
    """
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: allocator, cuDNN/cuBLAS handles and plans
            engine.step(rows, codes)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        pcm = engine.step(rows, codes)
    return graph, pcm
