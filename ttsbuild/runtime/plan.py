"""The static plan of an engine: every shape the runtime captures or allocates, in one place.

`ttsbuild compile` writes the plan into the engine's manifest; the runtime, the server (chunk
caps, slot count), the engine benchmark and the loader read it from there and obey it. A
converted checkpoint (or an in-memory stand-in) has no compiled plan: it runs under
`EnginePlan.default(...)`, built here and nowhere else. A request that does not fit the plan
is refused at the edge with a clear message (`check_prompt`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SLOTS = 256
MAX_SPEC_WINDOW = 8  # runtime.cp_spec.MAX_WINDOW


def power_of_two_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `largest`, then `largest` itself."""
    return (*(2**i for i in range(largest.bit_length()) if 2**i < largest), largest)


DEFAULT_LANE_RESERVED_SMS = 16  # of the H200's 132 (see EnginePlan.lane_reserved_sms)
# FP8 talkers: linears as W8A8 on the Triton A8 tiles from 16 rows, and no bf16 copies
# (benchmarks/kernels/2026-12-04-h200-a8: prefill 1x32 1.97 -> 1.70 ms, talker step at batch 64
# 1.94 -> 1.78 ms against bf16 copies from 16; benchmarks/kernels/2026-12-06-h200-many-rows:
# at 128 rows W8A8 beat the copies, talker step at batch 128 2.43 -> 2.34 ms; from 256 the
# copies won with the A8 rule of then. With the many-row rule (`_tl.fp8_linear.a8_config`),
# benchmarks/kernels/2026-12-07-h100-no-copies, two processes a side on an H100: talker step
# at 256 3.88 against 4.06-4.12 ms with copies, prefill of 256 tokens 2.96 against 3.18, of
# 2 x 256 4.51 against 4.85; the copies cost 2.62 GiB for 1.7B, issue 8's duplicate weights)
DEFAULT_W8A8_MIN_ROWS = 16
DEFAULT_BF16_MIN_ROWS = 0
# The FP8 code predictor's linears and heads as W8A8 from this many rows (its unfused path:
# buckets above the fused ones); 0: weight-only. Off: faster, and not good enough. H200
# engine bench, 2026-12-07 (benchmarks/runtime/2026-12-07-h200-cp-w8a8): code predictor ms
# per frame at 16 / 32 / 64 / 256 rows 3.28 / 3.81 / 4.03 / 7.23 weight-only against 2.73 /
# 2.89 / 3.34 / 4.60 with W8A8 from 16 (frame at 256 10.74 -> 8.12 ms). But teacher forced
# against the bf16 model on the 1.7B stand-in (graph_vs_eager.py --cp-w8a8-only, H100,
# benchmarks/quality/2026-12-07-h100-cp-w8a8), codebooks 1-15 in calls of 16 rows: top-1
# 0.906 / KL 0.0213 weight-only, 0.873 / 0.0388 W8A8: W8A8 nearly doubles the error and
# takes KL past compile's gate (0.02). Was 16 for one session, on a greedy check that could
# not tell (see that directory).
DEFAULT_CP_W8A8_MIN_ROWS = 0
# The FP8 code predictor's linears (and FP8 heads) on bf16 copies of their weights
# (dequantised once at load, cuBLAS; `Dense.keep_bf16`) from this many rows on its unfused
# path; 0: never. Its quality is weight-only FP8's (the copy adds 2^-9 per weight to FP8's
# 2^-4): compile's gate measures weight-only FP8 (16-row calls). H100 engine bench, 2026-12-07
# (benchmarks/runtime/2026-12-07-h100-cp-bf16): a bf16 code predictor takes 4.62 against
# 6.56 ms a frame at 256 rows and 3.63 against 3.96 at 64 (weight-only FP8 tiles: 64-row
# activation tiles, dequantising the weight again for every row tile). The copies hold the
# code predictor's layers again in bf16 (157 MiB for 1.7B), so from 128 rows: a 64-slot
# engine holds no weight twice (issue 8) and the 256-row frame takes the larger win.
DEFAULT_CP_BF16_MIN_ROWS = 128
# The code predictor on the fused kernels (FusedCodePredictor.frame: weight-only, its heads'
# sampler in the head GEMV) on batch buckets up to this; the unfused path above. 16 since
# 2026-12-07: with the unfused path weight-only again, bucket 16 on the fused kernels took
# the code predictor 3.14 -> 2.84 ms a frame (H100 engine bench, benchmarks/runtime/
# 2026-12-07-h100-cp-sides; W8A8 there 2.81). Was 8. Past 16 they lose: at 64 rows 4.85
# against 3.95 ms unfused (H100, benchmarks/runtime/2026-12-07-h100-cp-bf16); 32 not yet set
# beside the unfused path in one run, nor any of it timed on the H200.
DEFAULT_FUSED_CP_MAX_BATCH = 16


def default_prefill_batches(num_slots: int) -> tuple[int, ...]:
    """Prompts per captured prefill step unless told otherwise: up to four arrivals admitted
    together share a step (H200, 70 req/s with 3 codec steps in flight: 4 refused and 3
    underrun requests a minute against 40 and 32 one prompt per step,
    benchmarks/serve/2026-12-03-h200-batched-prefill-ab)."""
    return tuple(b for b in (1, 2, 4) if b <= num_slots)


def default_admission_lane(buckets) -> tuple[int, ...]:
    """The admission lane's buckets unless told otherwise: up to two new requests per step."""
    return tuple(b for b in buckets if b <= 2)


class EnginePlan(BaseModel):
    """Shapes and per-bucket choices of one engine. Field docs are the manifest's docs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_slots: int = 32  # concurrent requests (KV cache rows); padding rows use one more
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # captured batch sizes, last = max
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)  # captured prompt lengths
    # Prompts per captured prefill step (requests admitted together, same length bucket, run
    # as one step; each bucket is captured for every prompt length). (1,): one per step.
    prefill_batches: tuple[int, ...] = (1,)
    codec_chunks: tuple[int, ...] = (1, 2, 4, 8, 16)  # frames per captured codec step
    codec_ring: int = 64  # frames buffered per slot between the frame and codec stages
    max_len: int = 2048  # talker positions per slot (prompt + frames)
    max_text: int = 1024  # trailing text positions per slot (streaming text mode)
    max_frames: int = 1536  # frames per request at most
    precision: Literal["bf16", "fp8"] = "bf16"  # talker linears (fp8: weight-only e4m3)
    code_predictor_fp8: bool = False
    # An FP8 code predictor's 15 heads in FP8 too (True), or in bf16 (False, the default; no
    # effect on a bf16 code predictor, whose heads are bf16). Teacher forced against the bf16
    # model on the 1.7B stand-in (compile's gate measure, codebooks 1-15, 16-row calls;
    # benchmarks/quality/2026-12-07-h100-cp-w8a8): mean KL 0.0209 with FP8 heads, past the
    # gate's 0.02, and 0.0130 with bf16 heads (a bf16 code predictor: 0.0025). The heads'
    # logits have std 6, so FP8's ~2-4 % error per product is ~0.2 of a logit. bf16 heads
    # hold 31 MiB more for 1.7B and read 2 MiB more a pass: no cost measured (H100 engine
    # bench, within 0.05 ms of FP8 heads at 1-256 rows, benchmarks/runtime/
    # 2026-12-07-h100-cp-bf16); the one-kernel frame (megaframe_code_predictor) reads the
    # same heads, FP8 or bf16 (no copy of its own).
    cp_heads_fp8: bool = False
    # The codec's compute precision (runtime.codec_engine; compile gates it at >= 45 dB SNR
    # against fp32). On the H200 fp16 (53.7 dB) and tf32 (57.8 dB) are 1.1-1.6x faster than
    # fp32 with TF32 off, and fp16 halves the codec graphs' activation memory.
    codec_precision: Literal["fp32", "tf32", "fp16", "bf16"] = "fp32"
    # How the codec's convolutions run (runtime.codec_engine.CONV_IMPLS): "auto" is "triton"
    # (implicit-GEMM kernel for half-precision stages, GEMM + overlap-add for transposed
    # convs) on CUDA and "cudnn" elsewhere; measured in benchmarks/codec/RESULTS.md.
    codec_conv: Literal["auto", "cudnn", "gemm", "triton"] = "auto"
    # The codec's fusions (CodecEngine(fused=True): ring attention, overlap-add and SnakeBeta
    # inside the 1x1 convs, one kernel each): 2-8 % faster on the H200 and the graph-vs-eager
    # check passes with them (benchmarks/codec/RESULTS.md, 2026-12-01).
    codec_fused: bool = True
    # The codec's implicit-GEMM convs on channels-last operands (CodecEngine(channels_last=
    # True)): same audio, layout only. H200, 2026-12-02: the one-frame step 1.06 / 4.56 /
    # 15.30 -> 1.05 / 3.80 / 12.45 ms at batch 1 / 64 / 256; served at 60 req/s on 128
    # slots, underrun requests 201 -> 70 (benchmarks/codec/RESULTS.md).
    codec_channels_last: bool = True
    # The codec's output stage (SnakeBeta, context, the fp32 conv to one channel, clamp) as
    # one kernel (CodecEngine(fused_output=True), plugins.codec_output): same audio to fp32
    # rounding. H200, 2026-12-02 (one-frame step, channels-last): 0.996 / 3.672 / 11.945 ->
    # 1.050 / 3.269 / 10.042 ms at batch 1 / 64 / 256 (benchmarks/codec/RESULTS.md).
    codec_fused_output: bool = True
    # Each codec pre-transformer layer's RoPE, ring writes, window mask and attention as one
    # kernel (CodecEngine(fused_attention=True), plugins.ring_attention.ring_attention_rope):
    # ~76 fewer launches per step. H200, 2026-12-02: 0.996 / 3.672 / 11.945 -> 0.871 /
    # 3.632 / 12.341 ms at batch 1 / 64 / 256; with the fused output stage 0.912 / 3.216 /
    # 10.419 (both on beat neither at every batch).
    codec_fused_attention: bool = True
    # With channels-last operands, the codec's half-precision conv tails and transposed-conv
    # spills stored along channels (CodecEngine(state_channels_last=True)), as the kernels'
    # tiles run. H200, 2026-12-02: 0.996 / 3.672 / 11.945 -> 0.978 / 3.386 / 10.969 ms.
    codec_state_channels_last: bool = True
    # Codec steps of at most this many frames (rows x chunk) run the pre-transformer as
    # fused_linear launches (CodecEngine(fused_layers_max_rows=...): ~5 per layer instead of
    # ~10; same audio, fp32 without TF32 rounding); 0: off. H200, 2026-12-03 (profile_codec.py
    # row '+l', one process): 0.846 -> 0.745 ms at 1 frame, but 0.978 / 1.063 / 1.114 / 1.454
    # -> 2.595 / 2.679 / 2.733 / 2.929 ms at 2 / 4 / 8 / 16 frames (16-row fp32 tiles through
    # tl.dot's IEEE path). With those rows as GEMVs (fused_linear's gemv_rows_f32, which the
    # codec sets to this field; 2026-12-03, eleventh session, same script): 0.848 / 0.978 /
    # 1.064 / 1.115 / 1.457 -> 0.742 / 0.824 / 0.935 / 1.029 / 1.507 ms at 1 / 2 / 4 / 8 /
    # 16 rows: on up to 8 (benchmarks/codec/2026-12-03-h200-gemv-rows).
    codec_fused_layers_max_rows: int = Field(default=8, ge=0)
    # The codec switches built on 2026-12-06 (runtime.codec_engine documents each; None: the
    # engine's default, its environment variable, so side-by-side runs can flip it; a value
    # pins it): the fused layers' weights in scaled fp16 (TR_HALF_WEIGHTS), their qkv GEMV and
    # attention as one launch (QKV_ATTEND), larger steps on the fused layers' TF32 tiles
    # (TR_TF32_MAX_ROWS), the attention rings in fp16 (RING_HALF), each decoder block's first
    # SnakeBeta folded into the conv before it (FOLD_BLOCK_ACT), small steps' convs all on the
    # implicit-GEMM kernel with split-K (CONV_SPLIT_MAX_STREAMS), small steps with PDL
    # (CODEC_PDL_MAX_ROWS). Timed on an H100 on 2026-12-06 (fortieth session,
    # benchmarks/codec/2026-12-06-h100-codec-switches): the engine defaults now have the half
    # weights (not in the strict fp32 engine), the fp16 rings, split convs up to 8 streams and
    # PDL up to 2 (together batch 1 / 2 / 8 0.644 / 0.736 / 0.955 -> 0.540 / 0.648 / 0.864 ms,
    # 64 / 256 rows 2.441 / 7.200 -> 2.444 / 7.140, 53.4 -> 53.2 dB); the qkv + attention
    # launch, the TF32 tiles and the fold lost or tied and stay off.
    codec_transformer_half_weights: bool | None = None
    codec_qkv_attend: bool | None = None
    codec_tf32_layers_max_rows: int | None = Field(default=None, ge=0)
    codec_ring_half: bool | None = None
    codec_fold_block_act: bool | None = None
    codec_conv_split_max_streams: int | None = Field(default=None, ge=0)
    codec_pdl_max_rows: int | None = Field(default=None, ge=0)
    # the transposed convs as causal convs (TCONV_CONV; off by default), the codebook lookup as
    # one kernel (LOOKUP_FUSED; on), the output stage begun in the last 1x1 conv's epilogue
    # (OUTPUT_EPILOGUE; on): timed 2026-12-06 on an H100
    codec_tconv_conv: bool | None = None
    codec_lookup_fused: bool | None = None
    codec_output_epilogue: bool | None = None
    # each residual unit's act1 written by the unit before it (NEXT_ACT_FOLD): off, slower at
    # every batch on an H100 (benchmarks/codec/2026-12-06-h100-tma-on)
    codec_next_act_fold: bool | None = None
    # Batch buckets whose code predictor runs on runtime.cp_fused (5 launches per layer):
    # measured faster at small batches only (benchmarks/kernels/RESULTS.md).
    fused_code_predictor: tuple[int, ...] = ()
    # Batch buckets whose code-predictor passes run as one persistent launch each
    # (plugins.cp_pass: projection + layers + head, grid barriers between stages); it takes
    # precedence over fused_code_predictor where both list a bucket.
    persistent_code_predictor: tuple[int, ...] = ()
    # Batch bucket 1's code predictor as ONE persistent CUDA kernel a frame
    # (runtime.cp_megaframe: FP8 weights of the shipped code predictor's shapes, sm_90, a
    # cooperative launch), on the regular step and the admission lane's first frames. On an
    # H100: frame b1 3.21 -> 2.72 ms, idle first chunk 4.63 -> 4.20 ms, codes identical to the
    # plan without it (benchmarks/runtime/2026-12-05-h100-megaframe-served); serving at 10
    # and 20 req/s: TTFA p50 7.6 -> 6.8 ms, p95 unchanged (benchmarks/serve/
    # 2026-12-05-h100-megaframe-ab, before the alternates below). Off in the plan's own
    # default; a checkpoint's FP8 plan on a Hopper GPU takes it on the admission lane only
    # (runtime.loader.lane_kernel_default: the H200 sweep of 2026-12-06 held issue 12's
    # targets with it, benchmarks/serve/2026-12-06-h200-lane-kernel); the lane then reserves
    # no SMs.
    megaframe_code_predictor: bool = False
    # With megaframe_code_predictor: whether the regular bucket-1 step runs the kernel too
    # (False: the admission lane's first frames only). With both, a bucket-1 step whose other
    # path's kernel step may still run takes a fused graph captured beside (the two grids
    # each need every SM: a first chunk beside one stepping row took 6.53 ms with the kernel
    # on both paths, 5.54 without it, 5.08 with it on the lane only; H100, before the
    # alternates).
    megaframe_regular: bool = True
    # Batch buckets whose talker step runs on runtime.cp_fused.decode_fused (5 launches per
    # layer instead of ~9: fused norm + linear, fused residual adds).
    fused_talker: tuple[int, ...] = ()
    # The regular step's talker at batch bucket 1 as ONE persistent kernel (runtime.
    # talker_megastep: the 1.7B talker's shapes, FP8 weights, a bf16 cache, sm_90, a
    # cooperative launch of a CTA per SM; each stage's weights prefetched into L2 ahead). A
    # prototype: off until timed in the engine (benchmarks/kernels/megatalker/).
    talker_megastep: bool = False
    # The talker's KV cache in FP8 (e4m3, a k and a v scale per layer from the engine's
    # calibration, `build.pack.calibrated_scales`): half the bytes a decode step's attention
    # reads (at 256 rows and ~200 positions ~5.7 GB a step in bf16), and half the cache's
    # memory. Needs a calibrated engine; the cache kernels of the default decode and prefill
    # paths and fused_talker's (not talker_megastep's). Off in a plan without scales
    # (a checkpoint's); compile turns it on for a calibrated FP8 engine (H100 2026-12-07: the
    # talker at 256 rows 3.89 -> 3.29 ms, at 600 positions 7.55 -> 5.53; gate passed).
    talker_kv_fp8: bool = False
    # Batch buckets of the admission lane (graph backend on CUDA): new requests' prefill and
    # first frame run on a stream of their own (its own graphs, memory pool and code-predictor
    # cache) beside the frame step of the streams already running, so a new request's first
    # audio waits behind no other step. Up to max(admission_lane) new rows of a frame step
    # take it; more join the regular step. (): off (prefill in order with frame steps).
    # `default` and compile turn it on for buckets 1, 2 (measured in serving).
    admission_lane: tuple[int, ...] = ()
    # SMs kept free of the regular steps for the admission lane (CUDA, needs the lane): frame
    # and codec steps of running streams run in green contexts of the other SMs, the lane in
    # the whole device at a higher priority, so a new request's first chunk always has these
    # SMs to itself. (Stream priority alone does not preempt a regular step's resident
    # blocks: on the H200 a first chunk beside 63 stepping rows took 8.8 ms against 6.1 idle.)
    # 0: off. `default` and compile reserve DEFAULT_LANE_RESERVED_SMS where there is a lane
    # (serving at 40 req/s on the H200, one minute per side: p95 time to first audio 49.2 ms
    # without, 46.3 with 16 SMs, 43.0 with 16 SMs and bf16_min_rows 16;
    # benchmarks/serve/2026-12-02-h200-reserve-ab). A runtime without green contexts (torch
    # or CUDA driver too old), or a GPU where it would be more than half the SMs, runs
    # without the reserve and says so.
    lane_reserved_sms: int = Field(0, ge=0)
    # A new row's first frames on the admission lane, and its first codec step of that many
    # frames there too: 1, or 2 for a first chunk of two frames (a real CustomVoice
    # checkpoint's: the silent bootstrap frame, dropped, and the first audible one; with 1 its
    # second frame and two-frame codec step wait for the regular lanes). 2 captures a lane
    # frame step with the talker and a two-frame lane codec step per lane bucket. Not yet
    # captured on a GPU.
    lane_frames: int = Field(1, ge=1, le=2)
    # The talker's FP8 linears as W8A8 (activations quantised per row at run time, FP8 x FP8
    # tensor-core tiles: plugins.fp8_w8a8, the Triton A8 tiles unless TTSBUILD_W8A8_GEMM=cublas)
    # from this many rows (prefill rows or decode batch) up to bf16_min_rows; 0: weight-only.
    # `default` and compile: 16 for FP8 talkers (DEFAULT_W8A8_MIN_ROWS). Each activation is
    # rounded to e4m3 with its row's scale: ~2-3 % relative error per product on random
    # rows, against 2^-9 for the bf16 copies.
    w8a8_min_rows: int = Field(0, ge=0)
    # The same for the code predictor's FP8 linears and heads on its unfused path (batch
    # buckets outside fused_code_predictor, e.g. 16-256): there the weight-only swap-AB tiles
    # stream 0.5-1.4 TB/s where the A8 tiles reach 1.5-3.0 (the talker's shapes, 16-128 rows).
    # 0: weight-only. `default` and compile: DEFAULT_CP_W8A8_MIN_ROWS (0) for FP8 engines.
    cp_w8a8_min_rows: int = Field(0, ge=0)
    # The FP8 code predictor's linears (and its heads where FP8) on bf16 copies of their
    # weights from this many rows on its unfused path, before cp_w8a8_min_rows; 0: never.
    # `default` and compile: DEFAULT_CP_BF16_MIN_ROWS for FP8 engines (a copy held only where
    # the plan has such buckets and an FP8 code predictor).
    cp_bf16_min_rows: int = Field(0, ge=0)
    # The talker's FP8 linears on bf16 copies of their weights (dequantised once at load,
    # cuBLAS; runtime.fast_model.Dense.keep_bf16) from this many rows (prefill rows or decode
    # batch); 0: never. Measured: from ~16 rows cuBLAS on bf16 beats the FP8 kernels on the
    # H200 despite twice the bytes (benchmarks/kernels/RESULTS.md), and from ~128 rows than
    # the A8 tiles of then; costs the talker's linear weights again in bf16 (2.6 GiB for
    # 1.7B). Checked before w8a8_min_rows. `default` and compile: DEFAULT_BF16_MIN_ROWS (0
    # since the A8 tiles' many-row rule: never).
    bf16_min_rows: int = Field(0, ge=0)
    # Prefix KV cache (graph backend): the talker KV of prompt prefixes that depend only on
    # (voice, language, instruct, text mode), kept on the device and copied into a slot at
    # admission, so only the rest of the prompt is prefilled. Entries (0: off) x positions
    # each (a longer shared prefix is cached up to this many positions; at most max_len).
    prefix_pool: int = 16
    max_prefix: int = 128
    # Batch buckets whose code predictor decodes speculatively (runtime.cp_spec): bucket ->
    # (draft kind "self" | "draft", window: codebooks drafted per verify pass). Off by
    # default: it pays only where a pass is launch-bound and the draft is accepted often.
    # It takes precedence over the persistent and fused code predictor for its buckets.
    speculative: dict[int, tuple[Literal["self", "draft"], int]] = {}
    # Verify drafts by exact match: the draft proposes with the noise of the target's own draw
    # and a draft is kept only where it equals that draw, so every code is the plain
    # sampler's, speculative or not, at any load (runtime.cp_spec, `exact`). Off: the
    # standard rule, accepted more often (~1.4x on the 1.7B stand-in) but its draws are not
    # the plain sampler's (load_dependent_samples).
    speculative_exact: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> EnginePlan:
        def ascending(name: str, values: tuple[int, ...]) -> None:
            if not values or min(values) < 1 or sorted(set(values)) != list(values):
                raise ValueError(f"{name} must be strictly ascending positive sizes: {values}")

        ascending("batch_buckets", self.batch_buckets)
        ascending("prefill_buckets", self.prefill_buckets)
        ascending("prefill_batches", self.prefill_batches)
        if self.prefill_batches[0] != 1 or self.prefill_batches[-1] > self.num_slots:
            raise ValueError(f"prefill_batches must start at 1 and stay within {self.num_slots} "
                             f"slots: {self.prefill_batches}")  # fmt: skip
        ascending("codec_chunks", self.codec_chunks)
        if self.admission_lane:
            ascending("admission_lane", self.admission_lane)
        if self.lane_reserved_sms and not self.admission_lane:
            raise ValueError("lane_reserved_sms needs an admission_lane to reserve them for")
        if self.lane_frames > 1 and not self.admission_lane:
            raise ValueError("lane_frames needs an admission_lane to run them on")
        if self.persistent_code_predictor and self.admission_lane:
            # Its grid (a program per SM) waits at grid barriers until every program runs: two
            # lanes' passes each holding part of the SMs, or a green context of fewer SMs than
            # the grid, would wait on each other for ever.
            raise ValueError("persistent_code_predictor needs every SM at once: it cannot run "
                             "beside an admission_lane (turn one of them off)")
        if self.megaframe_code_predictor:
            if not self.code_predictor_fp8:
                raise ValueError("megaframe_code_predictor needs code_predictor_fp8: the kernel "
                                 "takes FP8 weights")
            if 1 not in self.batch_buckets:
                raise ValueError("megaframe_code_predictor runs batch bucket 1: the plan has none")
            if 1 in self.persistent_code_predictor or 1 in self.speculative:
                raise ValueError("batch bucket 1's code predictor: megaframe_code_predictor, "
                                 "persistent_code_predictor or speculative, one of them")
            if not self.megaframe_regular and 1 not in self.admission_lane:
                raise ValueError("megaframe_code_predictor on the admission lane only "
                                 "(megaframe_regular off) needs the lane on batch bucket 1")
            if self.lane_reserved_sms:
                # its grid is a CTA per SM of the device, launched cooperatively: it cannot
                # start inside a green context of fewer SMs
                raise ValueError("megaframe_code_predictor needs every SM at once: it cannot run "
                                 "with lane_reserved_sms")
        if self.talker_megastep:
            if 1 not in self.batch_buckets:
                raise ValueError("talker_megastep runs batch bucket 1: the plan has none")
            if 1 in self.fused_talker:
                raise ValueError("batch bucket 1's talker: talker_megastep or fused_talker, "
                                 "one of them")
            if self.lane_reserved_sms:
                # a CTA per SM of the device, launched cooperatively: it cannot start inside
                # a green context of fewer SMs
                raise ValueError("talker_megastep needs every SM at once: it cannot run with "
                                 "lane_reserved_sms")
        if self.talker_kv_fp8 and self.talker_megastep:
            raise ValueError("talker_kv_fp8: the one-kernel talker step reads a bf16 cache; "
                             "turn talker_megastep off")
        if self.lane_frames > 1 and self.lane_frames not in self.codec_chunks:
            raise ValueError(f"lane_frames {self.lane_frames} must be one of the codec_chunks "
                             f"{self.codec_chunks}")
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be 1..{MAX_SLOTS}, got {self.num_slots}")
        if self.batch_buckets[-1] > self.num_slots:
            raise ValueError(
                f"largest batch bucket {self.batch_buckets[-1]} exceeds {self.num_slots} slots"
            )
        if self.codec_chunks[0] != 1:
            raise ValueError("codec_chunks must include 1 (any count of frames must decode)")
        if self.codec_chunks[-1] > self.codec_ring:
            raise ValueError(
                f"codec_ring ({self.codec_ring}) must hold the largest codec chunk "
                f"({self.codec_chunks[-1]})"
            )
        if self.prefill_buckets[-1] >= self.max_len:
            raise ValueError("the largest prefill bucket must leave room for frames in max_len")
        for name in ("fused_code_predictor", "persistent_code_predictor", "fused_talker",
                     "admission_lane"):  # fmt: skip
            if not set(getattr(self, name)) <= set(self.batch_buckets):
                raise ValueError(f"{name} must list batch buckets of the plan")
        if self.prefix_pool < 0 or self.max_prefix < 1:
            raise ValueError("prefix_pool must be >= 0 and max_prefix >= 1")
        if not set(self.speculative) <= set(self.batch_buckets):
            raise ValueError("speculative must list batch buckets of the plan")
        windows = [w for _, w in self.speculative.values()]
        if windows and not 1 <= min(windows) <= max(windows) <= MAX_SPEC_WINDOW:
            raise ValueError(f"speculation windows must be 1..{MAX_SPEC_WINDOW}: {windows}")
        if self.max_frames < 1 or self.max_text < 1:
            raise ValueError("max_frames and max_text must be positive")
        return self

    @classmethod
    def default(
        cls,
        num_slots: int = 32,
        max_len: int = 2048,
        precision: Literal["bf16", "fp8"] = "bf16",
        **overrides,
    ) -> EnginePlan:
        """The plan of a checkpoint run without compiling: buckets are powers of two up to
        min(num_slots, 256) (one graph per bucket; larger batches are split: on the H200 a
        256-row bucket on 256 slots served 100 req/s where 128 rows on 128 slots refused 18 %,
        benchmarks/serve/2026-12-03-h200-capacity-256), the fused code
        predictor on buckets up to 8 (where it was measured faster), the admission lane on
        buckets 1 and 2 (measured: p95 time to first audio 28.4 -> 25.3 / 25.5 ms at 10 req/s,
        benchmarks/serve/2026-12-01-h200-lane)."""
        max_batch = min(num_slots, overrides.pop("max_batch", 256))
        buckets = power_of_two_buckets(max_batch)
        overrides.setdefault("fused_code_predictor",
                             tuple(b for b in buckets if b <= DEFAULT_FUSED_CP_MAX_BATCH))
        overrides.setdefault("admission_lane", default_admission_lane(buckets))
        overrides.setdefault("prefill_batches", default_prefill_batches(num_slots))
        overrides.setdefault(
            "lane_reserved_sms", DEFAULT_LANE_RESERVED_SMS if overrides["admission_lane"] else 0
        )
        overrides.setdefault("bf16_min_rows", DEFAULT_BF16_MIN_ROWS if precision == "fp8" else 0)
        overrides.setdefault("w8a8_min_rows", DEFAULT_W8A8_MIN_ROWS if precision == "fp8" else 0)
        overrides.setdefault(
            "cp_w8a8_min_rows", DEFAULT_CP_W8A8_MIN_ROWS if precision == "fp8" else 0
        )
        overrides.setdefault(
            "cp_bf16_min_rows", DEFAULT_CP_BF16_MIN_ROWS if precision == "fp8" else 0
        )
        prefill = tuple(t for t in cls.model_fields["prefill_buckets"].default if t < max_len)
        # Codec graphs up to 8 frames: a 64-row x 16-frame codec graph holds GBs of activations
        # in its pool, and larger chunks decode as several steps at no loss.
        overrides.setdefault("codec_chunks", (1, 2, 4, 8))
        return cls(
            num_slots=num_slots,
            batch_buckets=buckets,
            prefill_buckets=overrides.pop("prefill_buckets", prefill or (max_len - 1,)),
            max_len=max_len,
            max_frames=min(overrides.pop("max_frames", 1536), max_len - 1),
            precision=precision,
            **overrides,
        )

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def cp_heads_are_fp8(self) -> bool:
        """Whether the code predictor's heads run in FP8: an FP8 code predictor's, unless
        cp_heads_fp8 keeps them bf16 (a bf16 code predictor's heads are bf16)."""
        return self.code_predictor_fp8 and self.cp_heads_fp8

    def summary(self) -> str:
        """The code-predictor and lane choices in a line (what a log must say for its figures
        to be read against another's: the engine bench's, serve's loaded line)."""
        mega = (("on every bucket-1 step" if self.megaframe_regular else "on the admission "
                 "lane only") if self.megaframe_code_predictor else "off")  # fmt: skip
        return (f"code predictor {'FP8' if self.code_predictor_fp8 else 'bf16'}, one-kernel "
                f"frame {mega}, admission lane {list(self.admission_lane) or 'off'} with "
                f"{self.lane_reserved_sms} reserved SMs, fused code predictor on "
                f"{list(self.fused_code_predictor)}, talker KV cache "
                f"{'FP8' if self.talker_kv_fp8 else 'bf16'}")

    @property
    def max_chunk(self) -> int:
        return self.codec_chunks[-1]

    def codec_engine_kwargs(self, device) -> dict:
        """runtime.codec_engine.CodecEngine's keyword arguments for this plan's codec on
        `device` (beside the model, slot count and precision): what the runtime serves and
        compile's quality gate measures."""
        from ttsbuild.runtime.codec_engine import SWITCHES, resolve_conv_impl

        return dict(
            max_chunk=self.max_chunk, conv_impl=resolve_conv_impl(self.codec_conv, device),
            fused=self.codec_fused, channels_last=self.codec_channels_last,
            fused_output=self.codec_fused_output, fused_attention=self.codec_fused_attention,
            state_channels_last=self.codec_state_channels_last,
            fused_layers_max_rows=self.codec_fused_layers_max_rows,
            # the switches (codec_engine.default_switches): each plan field as it stands
            **{name: getattr(self, f"codec_{name}") for name in SWITCHES},
        )  # fmt: skip

    @property
    def load_dependent_samples(self) -> bool:
        """Whether a sampled request's codes depend on the load: speculation is on for some
        frames it may take and off for others (buckets without it, the admission lane, which
        never speculates). A speculative frame has the target's distribution but not the plain
        sampler's draw for the same seed and counters, so the same seeded request can sound
        different alone and beside others. Greedy codes are the same either way, and so are all
        codes with exact-match verification (`speculative_exact`), which keeps the plain draw
        at ~0.7x the acceptance on the 1.7B stand-in (benchmarks/spec/RESULTS.md)."""
        if not self.speculative or self.speculative_exact:
            return False
        return set(self.speculative) != set(self.batch_buckets) or bool(self.admission_lane)

    def speculation_note(self) -> str:
        """The warning `compile` and the engine give for `load_dependent_samples`."""
        on = ", ".join(str(b) for b in sorted(self.speculative))
        return (f"speculation at batch bucket(s) {on} only: a sampled request's codes depend "
                "on the buckets its frames run in (the others and the admission lane draw with "
                "the plain sampler); every code keeps the target's distribution, greedy codes "
                "are the same, but a seeded request is reproducible only at the same load "
                "(--speculative-exact keeps the plain draws)")

    def bucket(self, n: int) -> int:
        """The smallest captured batch size that holds n rows."""
        for b in self.batch_buckets:
            if b >= n:
                return b
        raise ValueError(f"a batch of {n} exceeds the largest bucket {self.max_batch}")

    def prefill_bucket(self, n: int) -> int | None:
        """The smallest captured prompt length >= n; None: longer than any (runs uncaptured)."""
        return next((t for t in self.prefill_buckets if t >= n), None)

    def check_prompt(self, prompt_positions: int, text_positions: int, frames: int) -> None:
        """Raises ValueError (a 400 at the edge) when a request does not fit the plan."""
        if text_positions > self.max_text:
            raise ValueError(
                f"text is too long for this engine ({text_positions} > {self.max_text} tokens)"
            )
        if prompt_positions + frames > self.max_len:
            raise ValueError(
                f"prompt ({prompt_positions} positions) + {frames} frames exceeds the engine's "
                f"context of {self.max_len}"
            )

    def codec_chunk_for(self, pending: int) -> int:
        """The largest captured codec chunk <= pending (pending >= 1)."""
        return max(c for c in self.codec_chunks if c <= pending)
