"""`ttsbuild convert`: an official Qwen3-TTS checkpoint -> our canonical checkpoint directory.

Everything is validated before anything is written; all problems are reported together as
one `ConversionError`. The output is built in a temp dir beside DST and renamed into place
at the end, so a failed or interrupted conversion leaves nothing behind. Tensors are read and
written one at a time.

Output layout (see `MANIFEST_FORMAT`):
    manifest.json               format, variant, speakers, languages, special ids, sampling,
                                stand-in record, sha256 of every file and of every source file
    talker.safetensors          talker.* minus talker.code_predictor.*, prefix `talker.` removed
    code_predictor.safetensors  talker.code_predictor.*, that prefix removed
    speaker_encoder.safetensors speaker_encoder.* (Base only), prefix removed
    codec.safetensors           speech tokenizer decoder.*, prefix removed (fp32, as stored)
    codec_encoder.safetensors   speech tokenizer encoder.*, prefix removed (fp32)
    config.json                 the official config, byte for byte
    generation_config.json      byte for byte
    speech_tokenizer_config.json   the codec's config.json, byte for byte
    tokenizer/                  vocab.json, merges.txt, tokenizer_config.json
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import ttsbuild
from ttsbuild.convert.io import (
    ITEMSIZE,
    SafetensorsFormatError,
    SafetensorsReader,
    atomic_output_dir,
    sha256_file,
    write_json,
    write_safetensors,
)
from ttsbuild.convert.schema import (
    Schema,
    TensorSpec,
    model_schema,
    speech_tokenizer_schema,
    validate_config,
    validate_speech_tokenizer_config,
)
from ttsbuild.text.tokenizer import TOKENIZER_FILES, TextTokenizer, TokenizerError
from ttsbuild.validation import read_json_object

MANIFEST_FORMAT = "ttsbuild-checkpoint"
MANIFEST_VERSION = 1
STANDIN_FILE = "ttsbuild_standin.json"

# (output file, source file, source prefix). Order = order of writing.
MODULES: tuple[tuple[str, str, str], ...] = (
    ("talker.safetensors", "model.safetensors", "talker."),
    ("code_predictor.safetensors", "model.safetensors", "talker.code_predictor."),
    ("speaker_encoder.safetensors", "model.safetensors", "speaker_encoder."),
    ("codec.safetensors", "speech_tokenizer/model.safetensors", "decoder."),
    ("codec_encoder.safetensors", "speech_tokenizer/model.safetensors", "encoder."),
)
MODULE_NAMES = {out[: -len(".safetensors")]: out for out, _, _ in MODULES}


class ConversionError(ValueError):
    """All problems found in a source checkpoint, one per line."""

    def __init__(self, problems: list[str], source: Path | None = None):
        self.problems = list(problems)
        head = f"cannot convert {source}" if source else "cannot convert"
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}: {n} problem{'s' if n != 1 else ''}\n{lines}")


def module_of(name: str) -> str | None:
    """Output module file of an official tensor name (model.safetensors side)."""
    if name.startswith("talker.code_predictor."):
        return "code_predictor.safetensors"
    if name.startswith("talker."):
        return "talker.safetensors"
    if name.startswith("speaker_encoder."):
        return "speaker_encoder.safetensors"
    return None


@dataclass
class _Source:
    root: Path
    config: dict | None = None
    st_config: dict | None = None
    gen_config: dict | None = None
    standin: dict | None = None
    model: SafetensorsReader | None = None
    st_model: SafetensorsReader | None = None
    tokenizer: TextTokenizer | None = None


def _read_json(path: Path, label: str, problems: list[str]) -> dict | None:
    try:
        return read_json_object(path, label)
    except ValueError as exc:
        problems.append(str(exc))
        return None


def _open_tensors(path: Path, label: str, problems: list[str]) -> SafetensorsReader | None:
    if not path.is_file():
        problems.append(f"{label} is missing")
        return None
    try:
        return SafetensorsReader(path)
    except SafetensorsFormatError as exc:
        problems.append(f"{label}: {str(exc).replace(str(path), 'file')}")
    except OSError as exc:
        problems.append(f"{label} cannot be read ({exc.strerror})")
    return None


def compare_tensors(reader: SafetensorsReader, schema: Schema, label: str) -> list[str]:
    """Missing, unexpected, wrong-shape and wrong-dtype tensors, in plain words."""
    problems = []
    present = set(reader.keys())
    for name, spec in schema.items():
        if name not in present:
            problems.append(f"{label}: missing tensor {name} (expected shape "
                            f"{list(spec.shape)}, {spec.dtype})")
            continue
        dtype, shape = reader.spec(name)
        if shape != spec.shape:
            problems.append(f"{label}: tensor {name} has shape {list(shape)}, "
                            f"expected {list(spec.shape)}")
        if dtype != spec.dtype:
            problems.append(f"{label}: tensor {name} has dtype {dtype}, expected {spec.dtype}")
    for name in reader.keys():
        if name not in schema:
            problems.append(f"{label}: unexpected tensor {name}")
    return problems


def _check_standin(standin: dict, problems: list[str]) -> None:
    rule = standin.get("length_rule")
    ok = (standin.get("format") in (1, 2, 3) and isinstance(rule, dict)
          and isinstance(rule.get("min_frames"), int) and isinstance(rule.get("max_frames"), int)
          and 0 < rule["min_frames"] <= rule["max_frames"])
    if not ok:
        problems.append(f"{STANDIN_FILE} is not a valid stand-in record (format 1-3 with a "
                        "length_rule of 0 < min_frames <= max_frames)")


def inspect_source(src: str | Path) -> _Source:
    """Validate an official checkpoint directory; raise `ConversionError` listing all problems."""
    root = Path(src)
    if not root.is_dir():
        raise ConversionError([f"source {root} is not a directory"], root)
    s = _Source(root)
    problems: list[str] = []

    s.config = _read_json(root / "config.json", "config.json", problems)
    if s.config is not None:
        cfg_problems = validate_config(s.config)
        problems += cfg_problems
        if cfg_problems:
            s.config = None
    s.gen_config = _read_json(root / "generation_config.json", "generation_config.json", problems)

    missing_tok = [n for n in TOKENIZER_FILES if not (root / n).is_file()]
    if missing_tok:
        problems.append(f"tokenizer files missing: {', '.join(missing_tok)}")
    else:
        try:
            s.tokenizer = TextTokenizer.from_dir(root)
        except TokenizerError as exc:
            problems.append(f"tokenizer: {exc}")

    s.model = _open_tensors(root / "model.safetensors", "model.safetensors", problems)
    if s.model is not None and s.config is not None:
        problems += compare_tensors(s.model, model_schema(s.config), "model.safetensors")

    st_dir = root / "speech_tokenizer"
    if not st_dir.is_dir():
        problems.append("speech_tokenizer/ directory is missing (the codec)")
    else:
        s.st_config = _read_json(st_dir / "config.json", "speech_tokenizer/config.json", problems)
        if s.st_config is not None:
            st_problems = validate_speech_tokenizer_config(s.st_config)
            problems += st_problems
            if st_problems:
                s.st_config = None
        label = "speech_tokenizer/model.safetensors"
        s.st_model = _open_tensors(st_dir / "model.safetensors", label, problems)
        if s.st_model is not None and s.st_config is not None:
            problems += compare_tensors(s.st_model, speech_tokenizer_schema(s.st_config), label)

    if s.config is not None and s.tokenizer is not None:
        declared = set(s.tokenizer.added_tokens.values())
        for key in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id",
                    "tts_bos_token_id", "tts_eos_token_id"):
            if s.config[key] not in declared:
                problems.append(f"tokenizer_config.json does not declare the token with id "
                                f"{s.config[key]} ({key} in config.json)")
        if len(s.tokenizer.encode("\n")) != 1:
            problems.append("tokenizer: a newline is not a single token")

    if (root / STANDIN_FILE).exists():
        s.standin = _read_json(root / STANDIN_FILE, STANDIN_FILE, problems)
        if s.standin is not None:
            _check_standin(s.standin, problems)

    if problems:
        raise ConversionError(problems, root)
    return s


def _speaker_table(talker: dict) -> dict[str, dict]:
    out = {}
    for name, raw in talker["spk_id"].items():
        sid = raw[0] if isinstance(raw, list) else raw
        dialect = talker["spk_is_dialect"].get(name, False)
        out[name] = {"id": int(sid), "dialect": dialect if isinstance(dialect, str) else None}
    return out


def build_manifest(s: _Source, files: dict[str, str], source_files: dict[str, str]) -> dict:
    c, t = s.config, s.config["talker_config"]
    cp = t["code_predictor_config"]
    assert s.tokenizer is not None
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "variant": {
            "tts_model_type": c["tts_model_type"],
            "tts_model_size": c["tts_model_size"],
            "tokenizer_type": c["tokenizer_type"],
            "talker_hidden_size": t["hidden_size"],
            "talker_layers": t["num_hidden_layers"],
            "code_predictor_hidden_size": cp["hidden_size"],
            "code_predictor_layers": cp["num_hidden_layers"],
            "num_code_groups": t["num_code_groups"],
            "has_speaker_encoder": c["tts_model_type"] == "base",
            "sample_rate": s.st_config["output_sample_rate"],
            "samples_per_frame": s.st_config["decode_upsample_rate"],
        },
        "speakers": _speaker_table(t),
        "languages": {k: int(v[0] if isinstance(v, list) else v)
                      for k, v in t["codec_language_id"].items()},
        "special_ids": {
            "codec": {
                "pad": t["codec_pad_id"], "bos": t["codec_bos_id"],
                "eos": t["codec_eos_token_id"], "think": t["codec_think_id"],
                "nothink": t["codec_nothink_id"], "think_bos": t["codec_think_bos_id"],
                "think_eos": t["codec_think_eos_id"],
            },
            "text": {
                "im_start": c["im_start_token_id"], "im_end": c["im_end_token_id"],
                "assistant": c["assistant_token_id"],
                "newline": s.tokenizer.encode("\n")[0],
                "tts_pad": c["tts_pad_token_id"], "tts_bos": c["tts_bos_token_id"],
                "tts_eos": c["tts_eos_token_id"],
            },
        },
        "sampling": s.gen_config,
        "standin": s.standin,
        "files": files,
        "source": {"files": source_files},
        "ttsbuild_version": ttsbuild.__version__,
    }


def convert_checkpoint(src: str | Path, dst: str | Path, force: bool = False,
                       progress=None) -> dict:
    """Convert; returns the manifest. `progress(advance_bytes, total_bytes, label)`."""
    s = inspect_source(src)
    assert s.model is not None and s.st_model is not None
    plan: list[tuple[str, SafetensorsReader, list[tuple[str, TensorSpec]]]] = []
    for out, _src_file, prefix in MODULES:
        reader = s.st_model if out.startswith("codec") else s.model
        names = [n for n in reader.keys()
                 if n.startswith(prefix) and (reader is s.st_model or module_of(n) == out)]
        if not names:
            continue
        items = []
        for n in names:
            dtype, shape = reader.spec(n)
            items.append((n, TensorSpec(n[len(prefix):], shape, dtype)))
        plan.append((out, reader, items))
    total = sum(_nbytes(spec) for _, _, items in plan for _, spec in items)

    source_files = {}
    for rel in ("config.json", "generation_config.json", "model.safetensors",
                "preprocessor_config.json", *TOKENIZER_FILES, STANDIN_FILE,
                "speech_tokenizer/config.json", "speech_tokenizer/configuration.json",
                "speech_tokenizer/model.safetensors",
                "speech_tokenizer/preprocessor_config.json"):
        if (s.root / rel).is_file():
            source_files[rel] = sha256_file(s.root / rel)

    with atomic_output_dir(dst, force=force) as tmp:
        for out, reader, items in plan:
            def tensors(reader=reader, items=items):
                for src_name, spec in items:
                    yield spec.name, reader.get(src_name)

            def tick(spec, out=out):
                if progress is not None:
                    progress(_nbytes(spec), total, f"{out}: {spec.name}")

            write_safetensors(tmp / out, [spec for _, spec in items], tensors(), on_tensor=tick)
        shutil.copyfile(s.root / "config.json", tmp / "config.json")
        shutil.copyfile(s.root / "generation_config.json", tmp / "generation_config.json")
        shutil.copyfile(s.root / "speech_tokenizer" / "config.json",
                        tmp / "speech_tokenizer_config.json")
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            shutil.copyfile(s.root / name, tmp / "tokenizer" / name)
        files = {p.relative_to(tmp).as_posix(): sha256_file(p)
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = build_manifest(s, files, source_files)
        write_json(tmp / "manifest.json", manifest)
    return manifest


def _nbytes(spec: TensorSpec) -> int:
    return spec.numel * ITEMSIZE[spec.dtype]
