"""`ttsbuild compile`: a converted checkpoint (+ calibration) -> a self-contained engine dir.

Ahead of time, once: fuse q/k/v and gate/up; quantise the chosen weight groups to FP8 e4m3
with per-output-channel scales (activation and KV scales from the calibration file are
recorded, but no runtime path reads them yet: the FP8 linears are weight-only or scale their
activations per row at run time (W8A8), and the KV cache is bf16; the manifest's
calibration.runtime_use says so); fold the codec; export the
codec step to ONNX and check it in onnxruntime; measure FP8 quality of the runtime's kernels
against the bf16 model and refuse an engine below the gate (`build.quality`); measure the
codec at its compute precision against the fp32 decoder (SNR over random codes) and refuse a
codec precision below its gate. The output is built in a temp dir beside ENGINE and renamed
into place only when complete.

Engine layout:
    manifest.json               see `engine_dir.EngineManifest`
    talker.safetensors          packed (fused) talker; FP8 weights + *.weight_scale
    code_predictor.safetensors  packed code predictor
    codec.safetensors           FoldedCodec state (fp32 storage; compute precision in the
                                manifest's codec.precision, measured in codec.quality)
    codec.onnx                  the codec streaming step (batch 1, one frame)
    config.json, generation_config.json, speech_tokenizer_config.json, tokenizer/
"""

from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

import ttsbuild
from ttsbuild.build.engine_dir import (
    ENGINE_FORMAT,
    ENGINE_VERSION,
    MODULE_FILES,
    VOICE_MODULE_FILES,
    EngineError,
    device_arch,
    parse_manifest,
)
from ttsbuild.build.pack import FP8_GROUPS, FUSED, calibrated_scales, fused_sizes, pack_state
from ttsbuild.build.quality import MAX_KL, MIN_TOP1, QualityError
from ttsbuild.convert.io import atomic_output_dir, sha256_file, write_json
from ttsbuild.model.codec import CodecConfig
from ttsbuild.model.config import ModelConfig
from ttsbuild.plugins.fp8_linear import FP8_MAX, quantize_weight_fp8
from ttsbuild.runtime.codec_engine import (
    DEFAULT_FP32_STAGES,
    DEFAULT_TF32_STAGES,
    MIN_CODEC_SNR_DB,
    PRECISIONS,
    default_switches,
)
from ttsbuild.runtime.draft import DRAFT_FILE, read_draft
from ttsbuild.runtime.plan import (
    DEFAULT_BF16_MIN_ROWS,
    DEFAULT_CP_BF16_MIN_ROWS,
    DEFAULT_CP_W8A8_MIN_ROWS,
    DEFAULT_FUSED_CP_MAX_BATCH,
    DEFAULT_LANE_RESERVED_SMS,
    DEFAULT_W8A8_MIN_ROWS,
    MAX_SPEC_WINDOW,
    EnginePlan,
    default_admission_lane,
    default_prefill_batches,
)

LM_MODULES = ("talker", "code_predictor")
# What the runtime does with a calibration file's scales (the manifest says it).
CALIBRATION_RUNTIME_USE = (
    "k/v_scale: the talker's FP8 KV cache where the plan has it (talker_kv_fp8, "
    "--talker-kv-fp8); input_scale: none yet (the runtime's FP8 linears are weight-only or, "
    "at the plan's W8A8 rows, quantise activations with a scale per row computed at run time)"
)


@dataclass(frozen=True)
class BuildConfig:
    """Every choice `ttsbuild compile` makes; the manifest records all of them."""

    precision: str = "fp8"  # "fp8": FP8 weight groups below; "bf16": no quantisation
    # The code predictor is launch-bound (GPU.md: 0.31 ms per graph-replayed step against a
    # 0.04 ms weight-read floor), so halving its weight bytes buys ~0.02 ms of 0.3 ms while
    # costing accuracy on all 15 codebooks: bf16 unless asked.
    fp8_code_predictor: bool = False
    # with it: its 15 heads FP8 too (True), or bf16 (False: EnginePlan.cp_heads_fp8; KL
    # against bf16 0.021 -> 0.013 on the 1.7B stand-in)
    fp8_code_predictor_heads: bool = False
    # batch bucket 1's code predictor as one persistent kernel a frame (runtime.cp_megaframe:
    # the shipped code predictor's shapes, FP8, Hopper); needs fp8_code_predictor and every SM,
    # so the admission lane reserves none (lane_reserved_sms 0)
    megaframe_code_predictor: bool = False
    # with it: the regular bucket-1 steps run the kernel too (True), or only new requests'
    # first frames on the admission lane do (False, the default: the plan served on the H200
    # at p95 7.4 / 10.3 / 12.2 / 17.3 ms at 1 / 10 / 20 / 40 req/s, benchmarks/serve/
    # 2026-12-06-h200-lane-kernel; needs the lane on bucket 1)
    megaframe_regular: bool = False
    max_batch: int = 64  # streams decoded together at most
    graph_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # captured batch sizes
    max_frames: int = 1536  # frames per request at most (~123 s of audio)
    max_len: int = 2048  # talker KV positions per slot (prompt + frames)
    num_slots: int | None = None  # concurrent requests the engine holds (None: max batch)
    prefill_buckets: tuple[int, ...] | None = None  # captured prompt lengths (None: 32..512)
    # prompts per captured prefill step (None: 1, 2 and 4 within the slots, runtime.plan's)
    prefill_batches: tuple[int, ...] | None = None
    # batch buckets of the admission lane; (): off; None: 1 and 2 (runtime.plan's default),
    # off where persistent_cp_max_batch is set (EnginePlan refuses the two together)
    admission_lane: tuple[int, ...] | None = None
    # Frames per captured codec step: a 64-row x 16-frame codec graph holds GBs of activations.
    codec_chunks: tuple[int, ...] = (1, 2, 4, 8)
    codec_ring: int = 64  # frames buffered per slot between the frame and codec stages
    max_text: int = 1024  # trailing text positions per slot
    # fused code predictor on buckets up to this (0: never)
    fused_cp_max_batch: int = DEFAULT_FUSED_CP_MAX_BATCH
    # one persistent launch per code-predictor pass on buckets up to this (0: never)
    persistent_cp_max_batch: int = 0
    # FP8 talker linears as W8A8 from this many rows (prefill, large buckets); 0: never
    w8a8_min_rows: int = DEFAULT_W8A8_MIN_ROWS
    # the FP8 code predictor's linears and heads as W8A8 from this many rows (its unfused
    # path); 0: never
    cp_w8a8_min_rows: int = DEFAULT_CP_W8A8_MIN_ROWS
    # the FP8 code predictor's linears on bf16 copies of their weights from this many rows
    # (its unfused path; held only where a bucket reaches it); 0: never
    cp_bf16_min_rows: int = DEFAULT_CP_BF16_MIN_ROWS
    # FP8 talker linears on bf16 copies of their weights from this many rows; 0: never
    bf16_min_rows: int = DEFAULT_BF16_MIN_ROWS
    # the talker's KV cache in FP8 with the calibration's k/v scales (True needs a
    # calibration; the quality gate measures the talker on it). None: on for an FP8 engine
    # compiled with a calibration, off otherwise (`resolved_talker_kv_fp8`; measured on an
    # H100 2026-12-07: the talker at 256 rows 3.89 -> 3.29 ms, at 600 positions 7.55 -> 5.53;
    # the 1.7B gate's codebook-0 KL 0.0120 -> 0.0136, benchmarks/runtime/RESULTS.md)
    talker_kv_fp8: bool | None = None
    # SMs kept for the admission lane (regular steps in green contexts of the others; 0: off;
    # only with an admission lane)
    # (None: DEFAULT_LANE_RESERVED_SMS, 0 with megaframe_code_predictor)
    lane_reserved_sms: int | None = None
    prefix_pool: int = 16  # prompt-prefix KV entries kept on the device (0: no prefix cache)
    max_prefix: int = 128  # positions per prefix entry
    # Speculative code predictor per bucket: {bucket: ("self" | "draft", window)}; off ({})
    # unless asked: it pays only where measured (benchmarks/spec).
    speculative: dict = field(default_factory=dict)
    # decide `speculative` at compile from the acceptance the checkpoint's draft records
    # (`distill-draft`) and the H200's measured pass and round costs (build.spec_choice)
    speculative_auto: bool = False
    # verify drafts by exact match (EnginePlan.speculative_exact); auto then decides from the
    # lower bound of its acceptance (build.spec_choice.exact_acceptance)
    speculative_exact: bool = False
    quality_texts: int = 4  # calibration texts for the FP8 quality gate
    quality_frames: int = 32  # frames per text generated for the gate
    min_top1: float = MIN_TOP1
    max_kl: float = MAX_KL
    force_quality: bool = False  # write an engine that fails a gate (recorded as failed)
    # Codec compute precision (storage stays fp32). fp16 measured 50.8 dB SNR against fp32 on
    # the H200 (TF32 56.5, bf16 32.7; GPU.md) and the conv stacks run ~3x faster than fp32;
    # the gate below re-measures it on this checkpoint's weights.
    codec_precision: str = "fp16"
    codec_min_snr_db: float = MIN_CODEC_SNR_DB
    codec_gate_rows: int = 2  # random-code streams decoded for the codec gate
    codec_gate_frames: int = 16  # frames per stream
    onnx: bool = True  # export the codec step to codec.onnx
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.precision not in ("fp8", "bf16"):
            problems.append(f"precision must be fp8 or bf16, not {self.precision!r}")
        if self.fp8_code_predictor and self.precision != "fp8":
            problems.append("an FP8 code predictor needs --precision fp8")
        if self.megaframe_code_predictor and not self.fp8_code_predictor:
            problems.append("--megaframe-code-predictor runs FP8 code-predictor weights: it "
                            "needs --fp8-code-predictor")
        buckets = list(self.graph_batches)
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            problems.append(f"graph batches must be increasing positive sizes, got {buckets}")
        elif buckets[-1] != self.max_batch:
            problems.append(f"the largest graph batch ({buckets[-1]}) must equal the max batch "
                            f"({self.max_batch}), so every batch size has a bucket")
        if self.max_frames < 1 or self.max_len <= self.max_frames:
            problems.append(f"need 1 <= max frames ({self.max_frames}) < max len "
                            f"({self.max_len}): a prompt needs positions too")
        if self.speculative_exact and not (self.speculative or self.speculative_auto):
            problems.append("--speculative-exact says how drafts are verified: it needs "
                            "--speculative (BUCKETS:KIND:WINDOW or auto)")
        if self.quality_texts < 1 or self.quality_frames < 2:
            problems.append("the quality gate needs >= 1 text and >= 2 frames")
        if not problems:
            try:
                self.runtime_plan()
            except ValidationError as exc:
                problems += [e["msg"].removeprefix("Value error, ") for e in exc.errors()]
        if self.codec_precision not in PRECISIONS:
            problems.append(f"codec precision must be one of {', '.join(PRECISIONS)}, "
                            f"not {self.codec_precision!r}")
        if self.codec_gate_rows < 1 or self.codec_gate_frames < 1:
            problems.append("the codec gate needs >= 1 stream and >= 1 frame")
        if problems:
            raise ValueError("invalid build settings: " + "; ".join(problems))

    def runtime_plan(self) -> EnginePlan:
        """The static plan the runtime obeys (written into the manifest)."""
        # the default lane is off under a persistent code predictor (which needs every SM)
        lane = (default_admission_lane(self.graph_batches)
                if self.admission_lane is None and not self.persistent_cp_max_batch
                else tuple(self.admission_lane or ()))  # fmt: skip
        return EnginePlan(
            num_slots=self.num_slots or self.max_batch, batch_buckets=tuple(self.graph_batches),
            prefill_buckets=tuple(
                self.prefill_buckets or (t for t in (32, 64, 128, 256, 512) if t < self.max_len)
            ), prefill_batches=tuple(self.prefill_batches) if self.prefill_batches is not None
            else default_prefill_batches(self.num_slots or self.max_batch),
            admission_lane=lane, lane_reserved_sms=self.reserved_sms() if lane else 0,
            codec_chunks=tuple(self.codec_chunks),
            codec_ring=self.codec_ring, max_len=self.max_len, max_text=self.max_text,
            max_frames=self.max_frames, precision=self.precision,
            code_predictor_fp8=self.fp8_code_predictor, codec_precision=self.codec_precision,
            cp_heads_fp8=self.fp8_code_predictor_heads,
            megaframe_code_predictor=self.megaframe_code_predictor,
            megaframe_regular=self.megaframe_regular or not self.megaframe_code_predictor,
            fused_code_predictor=tuple(
                b for b in self.graph_batches if b <= self.fused_cp_max_batch
            ),
            persistent_code_predictor=tuple(
                b for b in self.graph_batches if b <= self.persistent_cp_max_batch
            ),
            prefix_pool=self.prefix_pool, max_prefix=self.max_prefix,
            speculative=dict(self.speculative), speculative_exact=self.speculative_exact,
            w8a8_min_rows=self.w8a8_min_rows if self.precision == "fp8" else 0,
            cp_w8a8_min_rows=self.cp_w8a8_min_rows if self.precision == "fp8" else 0,
            cp_bf16_min_rows=self.cp_bf16_min_rows if self.precision == "fp8" else 0,
            bf16_min_rows=self.bf16_min_rows if self.precision == "fp8" else 0,
            talker_kv_fp8=bool(self.talker_kv_fp8),  # (None: compile resolves it first)
            # the codec switches pinned as this host takes them: the gate measures them and
            # the engine directory serves them, whatever the deployment host's environment
            **{f"codec_{k}": v for k, v in default_switches(self.codec_precision).items()},
        )  # fmt: skip

    def reserved_sms(self) -> int:
        """SMs reserved for the admission lane: as asked, else the default (none beside the
        one-kernel code predictor, which needs them all)."""
        if self.lane_reserved_sms is not None:
            return self.lane_reserved_sms
        return 0 if self.megaframe_code_predictor else DEFAULT_LANE_RESERVED_SMS

    def fp8_groups(self) -> list[str]:
        if self.precision != "fp8":
            return []
        return ["talker.layers"] + (["code_predictor.layers"] if self.fp8_code_predictor else [])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def quantize_groups(
    packed: dict[str, dict[str, torch.Tensor]], groups: list[str], device: torch.device
) -> dict[str, set[str]]:
    """FP8 in place for the weights of `groups`; returns the quantised names per module."""
    done: dict[str, set[str]] = {m: set() for m in packed}
    for group in groups:
        module, pattern = FP8_GROUPS[group]
        for name in [n for n in packed[module] if pattern.match(n)]:
            w8, scale = quantize_weight_fp8(packed[module][name].to(device))
            packed[module][name] = w8.cpu()
            packed[module][name.removesuffix(".weight") + ".weight_scale"] = scale.cpu()
            done[module].add(name)
    return done


def _check_weight_amax(packed: dict[str, torch.Tensor], names: set[str], calib: dict,
                       module: str) -> None:
    """The calibration's per-tensor weight amax must be the weights' own (same checkpoint)."""
    for name in names:
        base = name.removesuffix(".weight")
        ours = float(packed[base + ".weight_scale"].max()) * FP8_MAX
        parts = next(
            ([base[: -len(f)] + p for p in ps] for f, ps in FUSED.items() if base.endswith(f)),
            [base],
        )
        theirs = max(calib["linears"][p]["weight_amax"] for p in parts)
        if abs(ours - theirs) > 1e-2 * theirs:
            raise ValueError(f"calibration weight amax of {module}.{base} is {theirs:.6g}, the "
                             f"checkpoint's is {ours:.6g}: calibrated on other weights?")


def _tensor_groups(cfg: BuildConfig, calibrated: bool) -> dict[str, dict]:
    fp8 = set(cfg.fp8_groups())
    groups = {}
    for group, why_fp8, why_bf16 in (
        ("talker.layers",
         "decode is weight-read bound: 1 byte per weight instead of 2 (weight-only FP8 GEMV "
         "below the plan's w8a8_min_rows, W8A8 tiles with per-row activation scales from it; "
         "an input_scale, where calibrated, is recorded but not read)",
         "bf16 engine"),
        ("code_predictor.layers",
         "requested (--fp8-code-predictor)",
         "launch-bound: FP8 would save ~0.02 ms of a ~0.3 ms step; not worth its error"),
    ):
        module, pattern = FP8_GROUPS[group]
        q = group in fp8
        groups[group] = {
            "module": module,
            "tensors": pattern.pattern,
            "dtype": "float8_e4m3fn" if q else "bfloat16",
            "weight_scale": "per_output_channel_fp32" if q else None,
            "input_scale": "per_tensor_fp32" if q and calibrated else None,
            "why": why_fp8 if q else why_bf16,
        }
    for module in LM_MODULES:
        groups[f"{module}.other"] = {
            "module": module,
            "tensors": "embeddings, norms, text projection, heads, small_to_mtp_projection",
            "dtype": "bfloat16",
            "why": "off the decode hot path (prefill, embeddings) or logits heads kept exact",
        }
    groups["codec"] = {
        "module": "codec", "tensors": "all (FoldedCodec)", "dtype": "float32",
        "why": "the conv stacks are precision-sensitive and cheap next to the LM",
    }
    return groups


def resolved_talker_kv_fp8(cfg: BuildConfig, calibrated: bool) -> bool:
    """The talker's cache precision an engine is compiled with: as asked, else (None) FP8
    for an FP8 engine whose calibration gives the k/v scales."""
    if cfg.talker_kv_fp8 is not None:
        return cfg.talker_kv_fp8
    return cfg.precision == "fp8" and calibrated


def compile_engine_dir(
    checkpoint: str | Path,
    output: str | Path,
    cfg: BuildConfig = BuildConfig(),
    calibration: str | Path | None = None,
    device: str | torch.device = "cpu",
    force: bool = False,
    log=None,
) -> dict:
    """Build the engine; returns its manifest. log(message) reports the steps."""
    from ttsbuild.build.codec_fold import fold_codec_state, load_folded_codec
    from ttsbuild.calibration.calibrate import load_calibration
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.convert.convert import MANIFEST_VERSION

    log = log or (lambda msg: None)
    device = torch.device(device)
    ckpt = load_checkpoint(checkpoint)
    ckpt_hash = sha256_file(Path(checkpoint) / "manifest.json")
    calib = load_calibration(calibration) if calibration is not None else None
    if calib is not None and calib["checkpoint"]["manifest_sha256"] != ckpt_hash:
        raise ValueError(f"calibration file {calibration} was made for another checkpoint "
                         "(its checkpoint manifest hash differs); re-run `ttsbuild calibrate`")
    if cfg.precision == "fp8" and calib is None:
        log("no calibration file: FP8 weights only, no activation or KV scales recorded")
    if cfg.talker_kv_fp8 and calib is None:
        raise ValueError("--talker-kv-fp8 takes its k/v scales from a calibration: give "
                         "--calib (`ttsbuild calibrate` makes one)")  # fmt: skip
    cfg = replace(cfg, talker_kv_fp8=resolved_talker_kv_fp8(cfg, calib is not None))

    # before the packing: a plan that cannot be met fails at once
    has_draft = DRAFT_FILE in ckpt.manifest["files"]
    if has_draft:  # checked again here: compile packs only a draft that fits
        read_draft(ckpt.path / DRAFT_FILE, ModelConfig.from_official(ckpt.config))
    elif any(kind == "draft" for kind, _ in cfg.speculative.values()):
        raise ValueError("--speculative asks for a trained draft, but the checkpoint ships "
                         "none: attach one with `ttsbuild convert CKPT --draft DRAFT`")
    if cfg.speculative_auto:
        cfg = _auto_speculative(cfg, ckpt, has_draft, log)
    plan = cfg.runtime_plan()
    if plan.megaframe_code_predictor:
        from ttsbuild.runtime.cp_megaframe import unsupported_config

        why = unsupported_config(ModelConfig.from_official(ckpt.config))
        if why:
            raise ValueError(f"--megaframe-code-predictor: {why}")
    if plan.load_dependent_samples:
        log(f"note: {plan.speculation_note()}")

    log("packing fused projections")
    packed = {m: pack_state({k: v.to(torch.bfloat16) for k, v in ckpt.tensors(m).items()})
              for m in LM_MODULES}
    sizes = {m: fused_sizes(ckpt.tensors(m)) for m in LM_MODULES}
    fp8_names = quantize_groups(packed, cfg.fp8_groups(), device)
    if calib is not None and cfg.precision == "fp8":
        for m in LM_MODULES:
            _check_weight_amax(packed[m], fp8_names[m], calib["modules"][m], m)
            packed[m].update(calibrated_scales(packed[m], calib["modules"][m], fp8_names[m]))
        log(f"calibration: activation and KV scales recorded; runtime use: "
            f"{CALIBRATION_RUNTIME_USE}")
    codec_state = fold_codec_state(ckpt.tensors("codec"))
    codec_cfg = CodecConfig.from_official(ckpt.codec_config)
    codec_quality = check_codec_quality(codec_cfg, codec_state, cfg, device, log)

    quality = None
    if cfg.precision == "fp8":
        quality = check_quality(ckpt, packed, sizes, cfg, device, log)

    arch = device_arch(device) or "any"
    model_cfg = ckpt.config["talker_config"]
    with atomic_output_dir(output, force=force) as tmp:
        for m in LM_MODULES:
            save_file(packed[m], str(tmp / MODULE_FILES[m]), metadata={"format": "pt"})
        save_file(codec_state, str(tmp / MODULE_FILES["codec"]), metadata={"format": "pt"})
        if ckpt.config["tts_model_type"] == "base":
            for name in VOICE_MODULE_FILES.values():
                shutil.copyfile(ckpt.path / name, tmp / name)
        for name in ("config.json", "generation_config.json", "speech_tokenizer_config.json"):
            shutil.copyfile(ckpt.path / name, tmp / name)
        shutil.copytree(ckpt.tokenizer_dir, tmp / "tokenizer")
        if has_draft:
            shutil.copyfile(ckpt.path / DRAFT_FILE, tmp / DRAFT_FILE)
        onnx = None
        if cfg.onnx:
            from ttsbuild.build.onnx_codec import check_codec_onnx, export_codec_step

            log("exporting the codec step to ONNX")
            codec = load_folded_codec(codec_cfg, codec_state)
            onnx = export_codec_step(codec, tmp / "codec.onnx")
            onnx["max_abs_diff_vs_torch"] = check_codec_onnx(codec, tmp / "codec.onnx")
        files = {p.relative_to(tmp).as_posix(): sha256_file(p)
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        cm = ckpt.manifest
        manifest = {
            "format": ENGINE_FORMAT,
            "format_version": ENGINE_VERSION,
            "variant": cm["variant"],
            "precision": cfg.precision,
            "tensor_groups": _tensor_groups(cfg, calib is not None),
            "fused": {
                m: {
                    fused: {"parts": list(parts), "sizes": sizes[m][fused]}
                    for fused, parts in FUSED.items()
                }
                for m in LM_MODULES
            },
            "plan": cfg.runtime_plan().model_dump(mode="json"),
            "kv_cache": {
                "talker": _kv(model_cfg, cfg.max_len, calib is not None),
                "code_predictor": _kv(model_cfg["code_predictor_config"],
                                      cm["variant"]["num_code_groups"], calib is not None),
            },
            "codec": {"folded": True, "dtype": "float32", "onnx": onnx,
                      "precision": cfg.codec_precision,
                      "fp32_stages": list(DEFAULT_FP32_STAGES),
                      "tf32_stages": [] if cfg.codec_precision == "fp32"
                      else list(DEFAULT_TF32_STAGES),
                      "quality": codec_quality},
            "target": {"arch": arch, "device_name": torch.cuda.get_device_name(device)
                       if device.type == "cuda" else "cpu"},
            "versions": {
                "ttsbuild": ttsbuild.__version__, "torch": torch.__version__,
                "triton": _version("triton"), "nvidia-modelopt":
                    calib["method"]["modelopt_version"] if calib else None,
                "onnx": _version("onnx") if onnx else None,
                "onnxruntime": _version("onnxruntime") if onnx else None,
            },
            "source": {"checkpoint_manifest_sha256": ckpt_hash,
                       "checkpoint_format_version": MANIFEST_VERSION},
            "calibration": None if calib is None else {
                "file_sha256": sha256_file(Path(calibration)),
                "modelopt_version": calib["method"]["modelopt_version"],
                "num_texts": len(calib["texts"]),
                "frames": sum(calib["run"]["frames"]),
                "algorithm": calib["method"]["algorithm"],
                "runtime_use": CALIBRATION_RUNTIME_USE,
            },
            "quality": quality,
            "speakers": cm["speakers"],
            "languages": cm["languages"],
            "special_ids": cm["special_ids"],
            "sampling": cm["sampling"],
            "standin": cm["standin"],
            "draft": cm.get("draft"),
            "files": files,
        }
        parse_manifest(manifest, "the new engine")  # the writer obeys the reader's schema
        write_json(tmp / "manifest.json", manifest)
    return manifest


def _auto_speculative(cfg: BuildConfig, ckpt, has_draft: bool, log) -> BuildConfig:
    """cfg with `speculative` decided from the draft's recorded acceptance (batch 1 only)."""
    from ttsbuild.build.spec_choice import choose, draft_acceptance

    if not has_draft:
        raise ValueError("--speculative auto decides from the acceptance `ttsbuild distill-draft` "
                         "measures and records in its draft, but the checkpoint ships none: "
                         "attach one with `ttsbuild convert CKPT --draft DRAFT`")
    _, meta = read_draft(ckpt.path / DRAFT_FILE, ModelConfig.from_official(ckpt.config))
    acceptance = draft_acceptance(meta)
    if not acceptance:
        raise ValueError("--speculative auto: the checkpoint's draft records no acceptance "
                         "(not made by `ttsbuild distill-draft`); give "
                         "--speculative BUCKETS:KIND:WINDOW instead")
    choice = choose(acceptance, max_window=min(int(meta["window"]), MAX_SPEC_WINDOW),
                    exact=cfg.speculative_exact)  # fmt: skip
    if 1 not in cfg.graph_batches:
        choice = choose({})
    shown = ", ".join(f"{k} {v:.2f}" for k, v in choice.considered.items())
    how = ("recorded in the draft, priced by exact match's lower bound" if cfg.speculative_exact
           else "recorded in the draft")  # fmt: skip
    verdict = (f"on at batch 1: {choice.kind}, window {choice.window}"
               if choice.kind else "off (no choice expected >= 5 % faster)")
    log(f"speculation {verdict}; expected code-predictor frame ms at batch 1: {shown} against "
        f"{choice.plain_ms:.2f} without (acceptance {how}: {acceptance})")
    # exact match says how drafts are verified: with speculation decided off there are none
    # (and BuildConfig refuses --speculative-exact without speculation)
    return replace(cfg, speculative=choice.plan(), speculative_auto=False,
                   speculative_exact=cfg.speculative_exact and bool(choice.plan()))


def _kv(stack: dict, max_len: int, calibrated: bool) -> dict:
    return {
        "layout": "[num_layers, num_slots, kv_heads, max_len, head_dim], k after k_norm + RoPE",
        "dtype": "bfloat16",
        "num_layers": stack["num_hidden_layers"],
        "kv_heads": stack["num_key_value_heads"],
        "head_dim": stack["head_dim"],
        "max_len": max_len,
        "scales": "per_layer_fp32" if calibrated else None,
    }


def check_codec_quality(codec_cfg: CodecConfig, folded_state: dict, cfg: BuildConfig,
                        device: torch.device, log) -> dict:
    """The codec engine at `cfg.codec_precision`, as the runtime plan serves it on this device
    (`EnginePlan.codec_engine_kwargs`), against the fp32 decoder (TF32 off) on random codes,
    streamed a frame a step (the batch-1 step's paths: the pre-transformer's fused layers)
    and in the plan's largest chunk (the many-row paths); the lower SNR is the gate's. Raises
    QualityError below the gate unless forced."""
    from ttsbuild.build.codec_fold import load_folded_codec
    from ttsbuild.runtime.codec_engine import CodecEngine, codec_snr_db, random_codes

    p = cfg.codec_precision
    kwargs = cfg.runtime_plan().codec_engine_kwargs(device)
    chunks = sorted({1, min(kwargs["max_chunk"], cfg.codec_gate_frames)})
    log(f"measuring the codec at {p} ({kwargs['conv_impl']} convs) against fp32, "
        f"{'- and '.join(map(str, chunks))}-frame steps")
    state = {k: v.to(device) for k, v in folded_state.items()}
    reference = load_folded_codec(codec_cfg, state)
    engine = CodecEngine(reference, cfg.codec_gate_rows, p, device, **kwargs)
    codes = random_codes(codec_cfg, cfg.codec_gate_rows, cfg.codec_gate_frames, seed=cfg.seed)
    by_chunk = {c: codec_snr_db(engine, reference, codes, chunk=c) for c in chunks}
    snr = min(by_chunk.values())
    passed = snr >= cfg.codec_min_snr_db
    summary = (f"codec {p}: SNR {snr:.1f} dB against fp32 (gate {cfg.codec_min_snr_db:g} dB; "
               + ", ".join(f"{c}-frame steps {v:.1f}" for c, v in by_chunk.items()) + ")")
    log(summary)
    if not passed and not cfg.force_quality:
        raise QualityError(f"{summary}: below the gate; no engine written (choose a wider "
                           "--codec-precision, e.g. tf32 or fp32, or --force-quality)")
    return {
        # an fp32 engine can equal its reference exactly (infinite SNR): JSON has no inf
        "snr_db": round(min(snr, 999.0), 2), "min_snr_db": cfg.codec_min_snr_db,
        "snr_db_by_chunk": {str(c): round(min(v, 999.0), 2) for c, v in by_chunk.items()},
        "passed": passed, "rows": cfg.codec_gate_rows, "frames": cfg.codec_gate_frames,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def check_quality(ckpt, packed, sizes, cfg: BuildConfig, device, log) -> dict:
    """Teacher-forced report of the runtime on the packed weights against the checkpoint's
    eager modules (`build.quality`); raises QualityError below the gate unless forced."""
    from ttsbuild.build.quality import RuntimeLM, measure_quality
    from ttsbuild.calibration.corpus import generate_corpus, load_texts
    from ttsbuild.runtime.engine import Models

    log("measuring FP8 quality of the runtime's kernels against bf16 (teacher forcing)")
    reference = Models.load(ckpt, device=device)
    dtype = reference.talker.codec_head.weight.dtype
    plan = cfg.runtime_plan()
    runtime = RuntimeLM.from_packed(reference.cfg, packed, sizes, dtype, device,
                                    plan.cp_heads_are_fp8)
    runtime.kv_fp8 = plan.talker_kv_fp8  # the talker's cache as the plan serves it
    # the linears by rows as the plan serves them: W8A8, bf16 copies, weight-only
    runtime.talker.set_linear_paths(plan, runtime.code_predictor.stack,
                                    runtime.code_predictor.heads)  # fmt: skip
    items = generate_corpus(reference, load_texts(None, cfg.quality_texts), seed=cfg.seed,
                            max_frames=cfg.quality_frames)
    report = measure_quality(reference, runtime, items, code_predictor_paths(plan),
                             cfg.min_top1, cfg.max_kl, talker_paths=talker_decode_paths(plan))
    log(f"FP8 quality: {report.summary()}")
    if not report.passed and not cfg.force_quality:
        raise QualityError(
            f"FP8 quality below the gate: {report.summary()}; no engine written "
            "(--force-quality writes it anyway, recorded as failed)"
        )
    # what the talker's cache was in the measurement (the plan's: talker_kv_fp8)
    return {**report.to_dict(), "talker_kv_cache": "fp8" if runtime.kv_fp8 else "bf16"}


def talker_decode_paths(plan: EnginePlan) -> dict[str, int]:
    """The talker's decode paths the plan serves beyond the gate corpus's few rows (which run
    as a small bucket does), as the w8a8_min_rows to measure each with: {"w8a8": 1} where a
    batch bucket reaches the plan's W8A8 threshold below its bf16-copy one (per-row scales:
    W8A8 from 1 row over the few rows computes what such a bucket computes); {} otherwise."""
    w8a8, bf16 = plan.w8a8_min_rows, plan.bf16_min_rows
    served = [b for b in plan.batch_buckets if w8a8 and b >= w8a8 and not (bf16 and b >= bf16)]
    return {"w8a8": 1} if served else {}


def code_predictor_paths(plan: EnginePlan) -> dict[str, int]:
    """The code-predictor paths the plan runs, with the largest batch each runs at."""
    fused = [b for b in plan.batch_buckets if b in plan.fused_code_predictor]
    unfused = [b for b in plan.batch_buckets if b not in plan.fused_code_predictor]
    return {**({"fused": max(fused)} if fused else {}),
            **({"unfused": max(unfused)} if unfused else {})}


__all__ = ["BuildConfig", "EngineError", "QualityError", "compile_engine_dir"]
