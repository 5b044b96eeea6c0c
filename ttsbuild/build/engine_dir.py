"""The engine directory: its manifest schema, validation at load, and the eager CPU path.

An engine describes itself (never inferred from file or directory names): manifest.json
names the format and version, the variant, the precision and scale layout of every tensor
group, the fused projections, the static plan (`runtime.plan`), the KV-cache layout, the target GPU
architecture, the versions that built it, the sha256 of every file, the source checkpoint
and the FP8 quality report. `load_engine_dir` checks all of it before any tensor is read
and prints a summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import load_file

from ttsbuild.build.pack import SCALE_SUFFIXES
from ttsbuild.runtime.plan import EnginePlan
from ttsbuild.validation import damaged_files, read_json_object

ENGINE_FORMAT = "ttsbuild-engine"
ENGINE_VERSION = 2  # 2: the manifest carries the runtime's whole static plan
MODULE_FILES = {
    "talker": "talker.safetensors",
    "code_predictor": "code_predictor.safetensors",
    "codec": "codec.safetensors",
}
# Base checkpoints only: copied from the checkpoint as they are (fp32), for voice cloning.
VOICE_MODULE_FILES = {
    "speaker_encoder": "speaker_encoder.safetensors",
    "codec_encoder": "codec_encoder.safetensors",
}


class EngineError(ValueError):
    """An engine directory that is missing, malformed, altered, or built for another GPU."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorGroup(_Strict):
    module: str
    tensors: str  # which tensors, in words (a regex over packed names for FP8 groups)
    dtype: Literal["float8_e4m3fn", "bfloat16", "float32"]
    weight_scale: Literal["per_output_channel_fp32"] | None = None
    input_scale: Literal["per_tensor_fp32"] | None = None
    why: str


class FusedProjection(_Strict):
    parts: list[str]
    sizes: list[int]


class KVCacheLayout(_Strict):
    layout: str
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    max_len: int
    scales: Literal["per_layer_fp32"] | None


class OnnxCodec(_Strict):
    file: str
    kind: Literal["streaming_step", "full_decode"]
    batch: int
    frames_per_step: int
    opset: int
    exporter: str
    state_inputs: int
    max_abs_diff_vs_torch: float | None


class CodecQuality(_Strict):
    snr_db: float  # the codec engine at its precision against the fp32 decoder
    min_snr_db: float
    # per step size, frames a step (the lowest is snr_db); engines before 2026-12-06: None,
    # measured in 4-frame steps without the plan's kernels
    snr_db_by_chunk: dict[str, float] | None = None
    passed: bool
    rows: int  # random-code streams x frames measured
    frames: int
    device: str


class CodecInfo(_Strict):
    folded: bool
    dtype: str  # storage
    onnx: OnnxCodec | None
    # compute precision of runtime.codec_engine (engines before it: fp32, unmeasured)
    precision: Literal["fp32", "tf32", "fp16", "bf16"] = "fp32"
    fp32_stages: list[str] = []
    tf32_stages: list[str] = []  # of the fp32 stages, those with TF32 matmuls
    quality: CodecQuality | None = None


class Target(_Strict):
    arch: str  # "sm_90", or "any" for an engine compiled on CPU
    device_name: str


class Source(_Strict):
    checkpoint_manifest_sha256: str
    checkpoint_format_version: int


class Calibration(_Strict):
    file_sha256: str
    modelopt_version: str
    num_texts: int
    frames: int
    algorithm: str
    runtime_use: str | None = None  # what of it the runtime reads (engines before: unstated)


class EngineManifest(_Strict):
    format: Literal["ttsbuild-engine"]
    format_version: int
    variant: dict
    precision: Literal["fp8", "bf16"]
    tensor_groups: dict[str, TensorGroup]
    fused: dict[str, dict[str, FusedProjection]]
    plan: EnginePlan  # every shape the runtime captures or allocates
    kv_cache: dict[str, KVCacheLayout]
    codec: CodecInfo
    target: Target
    versions: dict[str, str | None]
    source: Source
    calibration: Calibration | None
    quality: dict | None
    speakers: dict
    languages: dict
    special_ids: dict
    sampling: dict
    standin: dict | None
    draft: dict | None = None  # metadata of the shipped draft heads (runtime.draft)
    files: dict[str, str]


@dataclass
class EngineArtifact:
    path: Path
    manifest: EngineManifest
    config: dict
    codec_config: dict
    generation_config: dict

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    def tensors(self, module: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        files = {**MODULE_FILES, **VOICE_MODULE_FILES}
        return load_file(self.path / files[module], device=str(device))


def device_arch(device: torch.device) -> str | None:
    """"sm_XY" of a CUDA device, None for a CPU."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def check_target(manifest_arch: str, current: str | None) -> None:
    """CPU runs accept any engine; a GPU needs an engine built for its architecture."""
    if current is None or manifest_arch in ("any", current):
        return
    raise EngineError(f"engine built for {manifest_arch}, this GPU is {current}: "
                      "recompile it on this GPU with `ttsbuild compile`")


def _read_json(path: Path, what: str) -> dict:
    return read_json_object(path, what, EngineError)


def parse_manifest(raw: dict, where: str) -> EngineManifest:
    """Format, then version, then the strict schema (unknown keys rejected)."""
    if raw.get("format") != ENGINE_FORMAT:
        raise EngineError(f"{where} is not a ttsbuild engine (manifest format "
                          f"{raw.get('format')!r}, expected {ENGINE_FORMAT!r})")
    if raw.get("format_version") != ENGINE_VERSION:
        raise EngineError(f"{where}: engine format version {raw.get('format_version')!r} is not "
                          f"supported (this ttsbuild reads version {ENGINE_VERSION}); "
                          "recompile it with `ttsbuild compile`")
    try:
        return EngineManifest.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"])
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            lines.append(f"{loc}: {msg}")
        raise EngineError(f"{where}: invalid manifest.json: " + "; ".join(lines)) from None


def load_engine_dir(
    path: str | Path, device: str | torch.device = "cpu", verify_hashes: bool = True,
    console=None,
) -> EngineArtifact:
    """Open and validate an engine directory; prints the manifest summary (rich table)."""
    root = Path(path)
    if not root.is_dir():
        raise EngineError(f"engine directory {root} does not exist")
    manifest = parse_manifest(_read_json(root / "manifest.json", "manifest.json"), str(root))
    problems = damaged_files(root, manifest.files, verify_hashes)
    if problems:
        raise EngineError(f"engine {root} is damaged: " + "; ".join(problems))
    check_target(manifest.target.arch, device_arch(torch.device(device)))
    artifact = EngineArtifact(
        path=root,
        manifest=manifest,
        config=_read_json(root / "config.json", "config.json"),
        codec_config=_read_json(root / "speech_tokenizer_config.json",
                                "speech_tokenizer_config.json"),
        generation_config=_read_json(root / "generation_config.json", "generation_config.json"),
    )
    print_summary(artifact, console)
    return artifact


def summary_table(artifact: EngineArtifact):
    from rich.table import Table

    m = artifact.manifest
    v = m.variant
    t = Table(title=f"engine {artifact.path}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    kind = " (random-weight stand-in)" if m.standin else ""
    t.add_row("format", f"{m.format} v{m.format_version}")
    t.add_row("variant", f"{v['tts_model_type']} {v['tts_model_size']}{kind}")
    t.add_row("precision", m.precision)
    for name, g in m.tensor_groups.items():
        scales = ", ".join(s for s in (g.weight_scale, g.input_scale) if s) or "-"
        t.add_row(f"  {name}", f"{g.dtype} (scales: {scales})")
    p = m.plan
    t.add_row("slots / batch buckets", f"{p.num_slots} / {list(p.batch_buckets)}")
    t.add_row("prefill buckets", str(list(p.prefill_buckets)))
    t.add_row("codec chunks / ring", f"{list(p.codec_chunks)} / {p.codec_ring}")
    t.add_row("max len / text / frames", f"{p.max_len} / {p.max_text} / {p.max_frames}")
    t.add_row("prefix pool", f"{p.prefix_pool} x {p.max_prefix} positions")
    t.add_row("target", f"{m.target.arch} ({m.target.device_name})")
    cq = m.codec.quality
    t.add_row("codec", f"{m.codec.precision}, folded={m.codec.folded}, onnx="
              f"{m.codec.onnx.kind if m.codec.onnx else 'none'}"
              + (f", SNR {cq.snr_db:.1f} dB ({'pass' if cq.passed else 'FAIL'})" if cq else ""))
    if m.quality:
        q = m.quality
        t.add_row("fp8 quality", f"c0 top-1 {q['codebook0_top1_agreement']:.3f}, "
                  f"KL {q['codebook0_mean_kl']:.4f} ({'pass' if q['passed'] else 'FAIL'})")
    t.add_row("versions", ", ".join(f"{k} {val}" for k, val in m.versions.items() if val))
    return t


def print_summary(artifact: EngineArtifact, console=None) -> None:
    from rich.console import Console

    (console or Console(stderr=True)).print(summary_table(artifact))


def models_from_engine(
    artifact: EngineArtifact,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    decoder_layers: bool = True,
):
    """`ttsbuild.runtime.engine.Models` from an engine. decoder_layers=True (the eager path):
    the layers unpacked to the module layout, FP8 emulated by dequantising (fp32 on CPU, bf16
    on CUDA by default). decoder_layers=False (the graph path): only the packed tensors as
    compiled; the modules keep embeddings, text projection and heads, no layer copies."""
    from ttsbuild.build.codec_fold import load_folded_codec
    from ttsbuild.generation.generate import LengthRule
    from ttsbuild.model.codec import CodecConfig
    from ttsbuild.model.config import ModelConfig
    from ttsbuild.runtime.draft import load_attached_draft
    from ttsbuild.runtime.engine import Models
    from ttsbuild.text.tokenizer import TextTokenizer

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = artifact.manifest
    cfg = ModelConfig.from_official(artifact.config)
    codec_cfg = CodecConfig.from_official(artifact.codec_config)
    packed = {name: artifact.tensors(name) for name in ("talker", "code_predictor")}
    sizes = {name: {f: p.sizes for f, p in m.fused[name].items()} for name in packed}
    talker, code_predictor = lm_modules_from_packed(
        cfg, packed, sizes, dtype, device, decoder_layers
    )
    codec = load_folded_codec(codec_cfg, artifact.tensors("codec")).to(device, torch.float32)
    voice_encoder = None
    if cfg.tts_model_type == "base":
        from ttsbuild.voices.encoder import VoiceEncoder

        voice_encoder = VoiceEncoder.from_tensors(
            artifact.config, artifact.codec_config, artifact.tensors("speaker_encoder"),
            artifact.tensors("codec_encoder"), device,
        )
    return Models(
        cfg=cfg,
        talker=talker,
        code_predictor=code_predictor,
        codec=codec,
        codec_cfg=codec_cfg,
        tokenizer=TextTokenizer.from_dir(artifact.tokenizer_dir),
        generation_config=artifact.generation_config,
        length_rule=LengthRule.from_standin(m.standin),
        manifest=m.model_dump(),
        packed={name: _runtime_tensors(t, dtype, device) for name, t in packed.items()},
        voice_encoder=voice_encoder,
        draft_heads=load_attached_draft(artifact.path, m.files, cfg, device, dtype),
    )


def _runtime_tensors(tensors: dict, dtype: torch.dtype, device) -> dict:
    """Packed tensors for the graph engine: FP8 weights and fp32 scales as stored, the rest
    in the runtime dtype, all on the device."""
    from ttsbuild.plugins.fp8_linear import FP8_DTYPE

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        keep = t.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIXES)
        return t.to(device) if keep else t.to(device=device, dtype=dtype)

    return {name: convert(name, t) for name, t in tensors.items()}


def lm_modules_from_packed(
    cfg, packed: dict, sizes: dict, dtype: torch.dtype, device, decoder_layers: bool = True
):
    """(Talker, CodePredictor) from packed engine tensors, FP8 dequantised to `dtype`.

    sizes[module][fused name, e.g. "self_attn.qkv_proj"] = output sizes of its parts.
    decoder_layers=False: modules without decoder layers (nothing of them is unpacked).
    """
    from ttsbuild.build.pack import unpack_state
    from ttsbuild.model.talker import CodePredictor, Talker

    out = []
    for name, cls in (("talker", Talker), ("code_predictor", CodePredictor)):
        tensors = packed[name]
        if not decoder_layers:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
        state = unpack_state(tensors, sizes[name], dtype)
        with torch.device("meta"):
            module = cls(cfg)
        if not decoder_layers:
            module.model.layers = torch.nn.ModuleList()
        module.load_state_dict(state, strict=True, assign=True)
        out.append(module.to(device).eval())
    return tuple(out)
