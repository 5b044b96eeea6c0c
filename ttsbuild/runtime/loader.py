"""Open an engine for serving or synthesis from a checkpoint dir or a compiled engine dir."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ttsbuild.generation.guards import GuardConfig
from ttsbuild.runtime.artifact import load_models
from ttsbuild.runtime.engine import EagerEngine
from ttsbuild.runtime.plan import EnginePlan

ENGINE_KINDS = ("auto", "graph", "eager")
# Device memory a graph engine takes beyond its loaded weights and its slots' KV cache: the
# talker's bf16 copies where a plan asks for them (bf16_min_rows), graph pools, codec
# workspace, activations and the allocator's slack. H200, 1.7B CustomVoice FP8, 128 slots:
# 20.9 GiB reserved by the process of which 7.1 KV cache and 8.5 weights as loaded (engine
# microbenchmark, 2026-12-03, with the bf16 copies then served).
FIT_RESERVE_BYTES = 10 << 30
SLOT_STATE_BYTES = 6 << 20  # per slot beside its KV cache (H200: 0.64 GiB for 128 slots)
# The plan fields `lane_kernel_default` sets (an FP8 plan of a checkpoint on a Hopper GPU)
LANE_KERNEL_PLAN = {"code_predictor_fp8": True, "megaframe_code_predictor": True,
                    "megaframe_regular": False, "lane_reserved_sms": 0}
_log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on; a clear error for one this machine does not have."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but this machine has no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported (use cpu or cuda)")
    return dev


def open_engine(
    path: str | Path | None,
    device: str | torch.device | None = None,
    num_slots: int | None = None,
    max_len: int | None = None,
    kind: str = "auto",
    precision: str | None = None,
    random_variant: str | None = None,
    guards: GuardConfig | None = None,
    prefill_batches: tuple[int, ...] | None = None,
    admission_lane: tuple[int, ...] | None = None,
    lane_reserved_sms: int | None = None,
    bf16_min_rows: int | None = None,
    cp_bf16_min_rows: int | None = None,
    w8a8_min_rows: int | None = None,
    max_batch: int | None = None,
    lane_frames: int | None = None,
    codec_channels_last: bool | None = None,
    codec_fused_output: bool | None = None,
    codec_fused_attention: bool | None = None,
    code_predictor_fp8: bool | None = None,
    megaframe_code_predictor: bool | None = None,
    megaframe_regular: bool | None = None,
    talker_kv_fp8: bool | None = None,
    fit_slots: bool = False,
):
    """Load `path` into an engine (or, for benchmarks, in-memory random weights of
    `random_variant`, e.g. "1.7b-customvoice", when path is None).

    A compiled engine runs under the plan in its manifest: num_slots / max_len may only ask
    for less than it was compiled for (None: the plan's). A checkpoint runs under
    `EnginePlan.default(num_slots, max_len, precision)`, FP8 on a Hopper GPU with the lane
    kernel (`lane_kernel_default`) unless one of code_predictor_fp8, megaframe_code_predictor,
    megaframe_regular or lane_reserved_sms is given.
    kind: "graph" (slot buffers + CUDA graphs: the fast path), "eager" (the reference
    modules), or "auto" (graph on CUDA, eager on CPU). precision (checkpoints, graph engines):
    "bf16" or "fp8"; a compiled engine's is the one it was compiled with. prefill_batches
    (checkpoints): prompts per captured prefill step (`EnginePlan.prefill_batches`).
    admission_lane: batch buckets of the admission lane (`EnginePlan.admission_lane`; its
    graphs are captured at load, so a compiled engine takes it too); None: the plan's.
    lane_reserved_sms: SMs kept free of regular steps for that lane
    (`EnginePlan.lane_reserved_sms`, a compiled engine takes it too); None: the plan's.
    bf16_min_rows: the talker's FP8 linears on bf16 copies from this many rows
    (`EnginePlan.bf16_min_rows`, a runtime choice: the copies are made at load); None: the
    plan's. cp_bf16_min_rows: the same for an FP8 code predictor's linears on its unfused
    path (`EnginePlan.cp_bf16_min_rows`); None: the plan's.
    w8a8_min_rows: the talker's FP8 linears as W8A8 from this many rows
    (`EnginePlan.w8a8_min_rows`, a runtime choice); None: the plan's. lane_frames: a new
    request's first frames on the admission lane
    (`EnginePlan.lane_frames`; its graphs are captured at load); None: the plan's.
    codec_channels_last: the codec's implicit-GEMM convs on channels-last operands
    (`EnginePlan.codec_channels_last`, a layout chosen at load); None: the plan's.
    codec_fused_output: the codec's output stage as one kernel (`EnginePlan.codec_fused_output`,
    chosen at load); None: the plan's. codec_fused_attention: the codec pre-transformer's
    attention steps as one kernel each (`EnginePlan.codec_fused_attention`); None: the plan's.
    code_predictor_fp8 (checkpoints and random weights; a compiled engine's weights are as
    compiled): the code predictor's linears in FP8 (`EnginePlan.code_predictor_fp8`); None:
    the plan's. megaframe_code_predictor: batch bucket 1's code predictor as one kernel a
    frame (`EnginePlan.megaframe_code_predictor`, packed at load from the FP8 weights; Hopper
    GPUs); turning it on also turns the lane's reserved SMs off unless lane_reserved_sms asks
    for some (which the plan then refuses); None: the plan's. megaframe_regular (with the
    kernel): the regular bucket-1 step runs it too, False: the admission lane's first frames
    only (`EnginePlan.megaframe_regular`, needs the lane on bucket 1); None: the plan's.
    talker_kv_fp8 (graph engines): the talker's KV cache in FP8 with the engine's calibrated
    k/v scales (`EnginePlan.talker_kv_fp8`, allocated at load; a compiled engine without a
    calibration is refused; random weights measure theirs as a calibration does); None: the
    plan's, and for FP8 random weights on the graph engine True (as compile's default for a
    calibrated FP8 engine).
    fit_slots (a CUDA device): fewer slots than asked for (or than compiled) where their KV
    cache would not fit in the device's free memory (`slots_that_fit`)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    device = resolve_device(device)
    if (path is None) == (random_variant is None):
        raise ValueError("give exactly one of a path or a random variant")
    if kind == "auto":
        kind = "graph" if device.type == "cuda" else "eager"
    graph = kind == "graph"
    if talker_kv_fp8 is None and random_variant is not None and graph and precision == "fp8":
        # random weights stand in for a compiled FP8 engine, whose talker cache is FP8 by
        # default (compile --calib): their k/v scales are measured below as a calibration's
        talker_kv_fp8 = True
    if random_variant is not None:
        from ttsbuild.runtime.engine import random_models

        models = random_models(random_variant, device=device)
    else:
        models = load_models(path, device=device, decoder_layers=not graph)
    compiled = models.manifest.get("plan")
    if compiled is not None:
        compiled = EnginePlan.model_validate(compiled)
        default_slots, default_len = compiled.num_slots, compiled.max_len
    else:
        default_slots, default_len = 32, 2048  # a checkpoint's plan when not asked otherwise
    if fit_slots and device.type == "cuda":
        fp8_kv = talker_kv_fp8 if talker_kv_fp8 is not None else bool(
            compiled is not None and compiled.talker_kv_fp8)  # fmt: skip
        num_slots = _fit_slots(num_slots or default_slots, models, device,
                               max_len or default_len, 1 if fp8_kv else 2)  # fmt: skip
        max_batch = None if max_batch is None else min(max_batch, num_slots)
    if compiled is not None:
        plan = plan_within(compiled, num_slots, max_len, path)
        if precision is not None and precision != plan.precision:
            raise ValueError(
                f"{path} was compiled for {plan.precision}; recompile with --precision "
                f"{precision}"
            )
        if prefill_batches is not None and tuple(prefill_batches) != plan.prefill_batches:
            raise ValueError(
                f"{path} was compiled with prefill batches {list(plan.prefill_batches)}; "
                "recompile with --prefill-batches to change them"
            )
        if code_predictor_fp8 is not None and code_predictor_fp8 != plan.code_predictor_fp8:
            raise ValueError(
                f"{path} was compiled with {'an FP8' if plan.code_predictor_fp8 else 'a bf16'} "
                "code predictor; recompile (--fp8-code-predictor) to change it"
            )
    else:
        extra = {} if prefill_batches is None else {"prefill_batches": tuple(prefill_batches)}
        if max_batch is not None:
            extra["max_batch"] = max_batch
        plan = EnginePlan.default(
            num_slots=num_slots or default_slots, max_len=max_len or default_len,
            precision=precision or "bf16",
            codec_precision="fp16" if device.type == "cuda" else "fp32", **extra,
        )  # fmt: skip
    if max_batch is not None and max_batch != plan.max_batch:
        plan = plan_max_batch(plan, max_batch, path or random_variant)
    asked = (code_predictor_fp8, megaframe_code_predictor, megaframe_regular, lane_reserved_sms)
    if (compiled is None and graph and all(v is None for v in asked)
            and (admission_lane is None or 1 in admission_lane)):
        # a checkpoint's FP8 plan on a Hopper GPU (a compiled engine keeps its manifest's)
        plan = lane_kernel_default(plan, models.cfg, device)
    if code_predictor_fp8 is not None and code_predictor_fp8 != plan.code_predictor_fp8:
        if code_predictor_fp8 and plan.precision != "fp8":
            raise ValueError("an FP8 code predictor needs an FP8 engine (--precision fp8)")
        off = {} if code_predictor_fp8 else {"megaframe_code_predictor": False}
        plan = plan_update(plan, code_predictor_fp8=code_predictor_fp8, **off)
    if (megaframe_code_predictor is not None
            and megaframe_code_predictor != plan.megaframe_code_predictor):
        if megaframe_code_predictor and not plan.code_predictor_fp8:
            raise ValueError("megaframe_code_predictor runs FP8 code-predictor weights: it needs "
                             "an FP8 code predictor (--fp8-code-predictor)")
        # the kernel needs every SM: no reserve for the lane unless asked (and then refused)
        reserve = {"lane_reserved_sms": 0} if megaframe_code_predictor else {}
        plan = plan_update(plan, megaframe_code_predictor=megaframe_code_predictor, **reserve)
    if megaframe_regular is not None and megaframe_regular != plan.megaframe_regular:
        if not plan.megaframe_code_predictor:
            raise ValueError("megaframe_regular chooses where the one-kernel code predictor runs: "
                             "it needs the kernel (--megaframe-code-predictor)")
        plan = plan_update(plan, megaframe_regular=megaframe_regular)
    if admission_lane is not None and tuple(admission_lane) != plan.admission_lane:
        if not set(admission_lane) <= set(plan.batch_buckets):
            raise ValueError(
                f"admission lane buckets {list(admission_lane)} must be batch buckets of the "
                f"engine's plan {list(plan.batch_buckets)}"
            )
        lane = tuple(sorted(set(admission_lane)))
        # what only a lane has goes with it (a reserve asked for beside is refused below)
        off = {} if lane else {"lane_frames": 1, "lane_reserved_sms": 0}
        plan = plan_update(plan, admission_lane=lane, **off)
    if lane_reserved_sms is not None and lane_reserved_sms != plan.lane_reserved_sms:
        if lane_reserved_sms and not plan.admission_lane:
            raise ValueError("lane_reserved_sms needs an admission lane to reserve them for "
                             "(--admission-lane)")  # fmt: skip
        if lane_reserved_sms and plan.megaframe_code_predictor:
            raise ValueError("lane_reserved_sms: the one-kernel code predictor "
                             "(megaframe_code_predictor) needs every SM; reserve none or turn "
                             "it off")  # fmt: skip
        plan = plan_update(plan, lane_reserved_sms=lane_reserved_sms)
    if bf16_min_rows is not None and bf16_min_rows != plan.bf16_min_rows:
        if bf16_min_rows < 0:
            raise ValueError(f"bf16_min_rows must be >= 0, got {bf16_min_rows}")
        plan = plan_update(plan, bf16_min_rows=bf16_min_rows)
    if cp_bf16_min_rows is not None and cp_bf16_min_rows != plan.cp_bf16_min_rows:
        if cp_bf16_min_rows < 0:
            raise ValueError(f"cp_bf16_min_rows must be >= 0, got {cp_bf16_min_rows}")
        plan = plan_update(plan, cp_bf16_min_rows=cp_bf16_min_rows)
    if w8a8_min_rows is not None and w8a8_min_rows != plan.w8a8_min_rows:
        if w8a8_min_rows < 0:
            raise ValueError(f"w8a8_min_rows must be >= 0, got {w8a8_min_rows}")
        plan = plan_update(plan, w8a8_min_rows=w8a8_min_rows)
    if lane_frames is not None and lane_frames != plan.lane_frames:
        if lane_frames > 1 and not plan.admission_lane:
            raise ValueError("lane_frames needs an admission lane to run them on "
                             "(--admission-lane)")  # fmt: skip
        if lane_frames not in (1, 2) or lane_frames not in plan.codec_chunks:
            raise ValueError(f"lane_frames must be 1 or 2 (a codec chunk size of the plan "
                             f"{list(plan.codec_chunks)}), got {lane_frames}")  # fmt: skip
        plan = plan_update(plan, lane_frames=lane_frames)
    codec = {"codec_channels_last": codec_channels_last, "codec_fused_output": codec_fused_output,
             "codec_fused_attention": codec_fused_attention}  # layouts and kernels chosen at load
    codec = {k: v for k, v in codec.items() if v is not None and v != getattr(plan, k)}
    if codec:
        plan = plan_update(plan, **codec)
    if talker_kv_fp8 and not graph:
        raise ValueError("an FP8 talker KV cache is the graph engine's (--engine graph)")
    if talker_kv_fp8 is not None and talker_kv_fp8 != plan.talker_kv_fp8:
        plan = plan_update(plan, talker_kv_fp8=talker_kv_fp8)
    elif plan.talker_kv_fp8 and not graph:
        # an engine compiled with the FP8 cache (compile's default with --calib) on the eager
        # reference, which keeps its own cache in the model's dtype
        plan = plan_update(plan, talker_kv_fp8=False)
    if not graph:
        return EagerEngine(models, plan=plan, guards=guards)

    from ttsbuild.runtime.graph_engine import GraphEngine

    kv_scales = None
    if plan.talker_kv_fp8 and random_variant is not None:
        # in-memory weights have no calibration: the k/v scales as `calibrate` takes them
        # (amax over a reference generation, / 448), before the engine drops the layers
        from ttsbuild.calibration.calibrate import measure_kv_scales
        from ttsbuild.calibration.corpus import load_texts

        kv_scales = measure_kv_scales(models, load_texts(None, 2), max_frames=32)
    return GraphEngine(models, plan, release_modules=True, guards=guards, kv_scales=kv_scales)


def lane_kernel_why_not(plan: EnginePlan, cfg, device: torch.device,
                         build: bool = True) -> str | None:
    """Why `plan` on `device` does not take `LANE_KERNEL_PLAN` by default, or None.

    The lane kernel: FP8 code-predictor linears, batch bucket 1's code predictor as one kernel
    a frame (`runtime.cp_megaframe`) on the admission lane only (new requests' first frames;
    regular steps keep the fused kernels), no SMs reserved for the lane. On the H200
    (2026-12-06, benchmarks/serve/2026-12-06-h200-lane-kernel/) it took an idle engine's first
    chunk to 3.49 ms (4.44-4.48 before: issue 12's bound is 4) and served voice-agent prompts
    at p95 first audio 7.4 / 10.3 / 12.2 / 17.3 ms at 1 / 10 / 20 / 40 req/s, 79.0 at 100,
    every admitted stream of a 2x overload at 54.6, no underrun.
    It needs an FP8 engine, a Hopper GPU (the kernel is built for sm_90a), the lane on
    bucket 1, bucket 1 free of the persistent and speculative code predictors, the shipped
    code predictor's shapes, and the kernel's extension (built with nvcc on first use;
    `build`: try it here, so a host without nvcc serves the plan it had)."""
    from ttsbuild.runtime import cp_megaframe

    if plan.precision != "fp8":
        return "a bf16 engine"
    why = cp_megaframe.unsupported_device(device)
    if why:
        return why
    if 1 not in plan.admission_lane:
        return "no admission lane on batch bucket 1"
    if 1 in plan.persistent_code_predictor or 1 in plan.speculative:
        return "batch bucket 1 runs the persistent or speculative code predictor"
    why = cp_megaframe.unsupported_config(cfg)
    if why:
        return why
    if build:
        try:
            cp_megaframe.extension(cp_megaframe.threads_from_env())
        except Exception as exc:  # no nvcc, a failed build: serve without the kernel
            return f"its extension did not build ({type(exc).__name__}: {exc})"
    return None


def lane_kernel_default(plan: EnginePlan, cfg, device: torch.device,
                        build: bool = True) -> EnginePlan:
    """`plan` with `LANE_KERNEL_PLAN` where `lane_kernel_why_not` finds no reason against it
    (logged either way for an FP8 plan on a GPU)."""
    why = lane_kernel_why_not(plan, cfg, device, build)
    if why is None:
        try:
            lane = plan_update(plan, **LANE_KERNEL_PLAN)
        except ValueError as exc:  # a rule of the plan's this check does not know yet
            why = f"the plan refuses it: {exc}"
        else:
            _log.info("FP8 plan on a Hopper GPU: the code predictor in FP8, a new request's "
                      "first frame as one kernel on the admission lane "
                      "(--no-megaframe-code-predictor: the fused kernels)")
            return lane
    if plan.precision == "fp8" and device.type == "cuda":
        _log.info("the lane kernel is off: %s", why)
    return plan


def slot_bytes(talker, max_len: int, dtype_bytes: int = 2) -> int:
    """Device bytes one slot takes: its talker KV cache (keys and values of every layer over
    max_len positions) and SLOT_STATE_BYTES of other per-slot state."""
    kv = 2 * talker.num_layers * talker.num_kv_heads * talker.head_dim * max_len * dtype_bytes
    return kv + SLOT_STATE_BYTES


def slots_that_fit(wanted: int, per_slot: int, free: int, reserve: int = FIT_RESERVE_BYTES) -> int:
    """Slots, at most `wanted`, whose state fits in `free` bytes with `reserve` kept for the
    rest of the engine (one more slot's worth for the padding row); multiples of 8 from 8 on,
    and always at least one slot."""
    fit = (free - reserve) // per_slot - 1
    if fit >= wanted:
        return wanted
    return max(1, fit - fit % 8 if fit >= 8 else fit)


def _fit_slots(wanted: int, models, device: torch.device, max_len: int,
               kv_bytes: int = 2) -> int:  # fmt: skip
    """`slots_that_fit` on this CUDA device now (its weights loaded): the KV cache is
    allocated at the engine's start, so slots that do not fit would fail it. kv_bytes: a
    cache entry's (1 for an FP8 cache)."""
    free, _ = torch.cuda.mem_get_info(device)
    return slots_that_fit(wanted, slot_bytes(models.cfg.talker, max_len, kv_bytes), free)


def plan_update(plan: EnginePlan, **fields) -> EnginePlan:
    """`plan` with these fields changed, validated as a whole (pydantic's model_copy skips
    the validators: a plan that could not be compiled must not be loadable either)."""
    return EnginePlan.model_validate({**plan.model_dump(), **fields})


# EnginePlan fields that list batch buckets (a subset of batch_buckets)
BUCKET_SUBSETS = ("fused_code_predictor", "persistent_code_predictor", "fused_talker",
                  "admission_lane")  # fmt: skip


def plan_max_batch(plan: EnginePlan, max_batch: int, where) -> EnginePlan:
    """`plan` with its batch buckets cut at `max_batch` (one of them, or the slot count);
    asking for more than the plan captures is an error."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_batch > plan.max_batch:
        raise ValueError(
            f"{where}: max_batch {max_batch} exceeds the plan's largest batch bucket "
            f"{plan.max_batch} (a checkpoint: ask for as many slots; an engine: recompile "
            "with --max-batch)"
        )
    buckets = tuple(b for b in plan.batch_buckets if b < max_batch) + (max_batch,)
    return plan_update(plan, **_buckets_update(plan, buckets))


def _buckets_update(plan: EnginePlan, buckets: tuple[int, ...]) -> dict:
    """The plan fields to change for these batch buckets: the buckets, and every per-bucket
    choice cut to them."""
    keep = set(buckets)
    return {
        "batch_buckets": buckets,
        **{name: tuple(b for b in getattr(plan, name) if b in keep) for name in BUCKET_SUBSETS},
        "speculative": {b: v for b, v in plan.speculative.items() if b in keep},
    }


def plan_within(
    plan: EnginePlan, num_slots: int | None, max_len: int | None, where
) -> EnginePlan:
    """The compiled plan, or a part of it: fewer slots (buckets above them dropped) or a
    shorter context. Asking for more than was compiled is an error."""
    num_slots = plan.num_slots if num_slots is None else num_slots
    max_len = plan.max_len if max_len is None else max_len
    if num_slots > plan.num_slots or max_len > plan.max_len:
        raise ValueError(
            f"{where} was compiled for at most {plan.num_slots} slots and {plan.max_len} "
            f"positions; asked for {num_slots} and {max_len} (recompile with --slots/--max-len)"
        )
    if (num_slots, max_len) == (plan.num_slots, plan.max_len):
        return plan
    buckets = tuple(b for b in plan.batch_buckets if b <= num_slots) or (num_slots,)
    prefill = tuple(t for t in plan.prefill_buckets if t < max_len) or (max_len - 1,)
    return plan_update(
        plan,
        **{
            **_buckets_update(plan, buckets),
            "num_slots": num_slots, "max_len": max_len,
            "prefill_buckets": prefill, "max_frames": min(plan.max_frames, max_len - 1),
            "prefill_batches": tuple(b for b in plan.prefill_batches if b <= num_slots),
        }
    )  # fmt: skip
