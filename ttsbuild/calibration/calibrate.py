"""FP8 max calibration with NVIDIA modelopt on real talker and code-predictor inputs.

1. Generate: the reference loop speaks the calibration texts; forward pre-hooks record every
   input the talker, its text projection and the code predictor actually receive (the
   KV caches are recorded by identity, not content).
2. Calibrate: modelopt-quantised copies of the talker and the code predictor
   (`mtq.quantize(copy, FP8 config, forward_loop)`) replay those inputs in order against fresh
   caches of the recorded shapes. In calibration mode modelopt's quantizers only observe, so
   the replay computes exactly what generation computed.
3. KV cache: modelopt's `*[kv]_bmm_quantizer` only attaches to attention classes it knows
   (HF ones), not ours, so K/V ranges are read from the replay's cache after each call: the
   cache holds k after k_norm and RoPE and v, exactly what an FP8 cache would store.

The calibration file records per-tensor amax of every linear's weight and input (modelopt's
FP8_DEFAULT_CFG: e4m3, per-tensor, "max" algorithm; its `*lm_head*` exclusion is dropped so
every linear is measured, whether it runs in FP8 is `ttsbuild compile`'s decision) and
per-layer K/V amax.

What uses it: `ttsbuild compile --calib` checks the weight amax against the checkpoint's
(same weights?) and writes input_scale (per FP8 linear) and k/v_scale (per layer) into the
engine. No runtime path reads those yet: the FP8 linears are weight-only (bf16
activations) and the KV cache is bf16, so calibration does not change what an engine
computes (the manifest's calibration.runtime_use says so). They are kept for a W8A8 GEMM
and an FP8 KV cache (issue 9), which will read them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import ttsbuild
from ttsbuild.convert.io import sha256_file, write_json
from ttsbuild.model.layers import KVCache

CALIB_FORMAT = "ttsbuild-calibration"
CALIB_VERSION = 1
MODULES = ("talker", "code_predictor")


class CalibrationError(ValueError):
    """A calibration run that cannot proceed, or a calibration file that cannot be used."""


@dataclass
class _Call:
    kind: str  # "talker" | "text_projection" | "code_predictor"
    args: tuple  # tensors cloned; a KVCache replaced by ("cache", key, slots, max_len)


@dataclass
class InputRecorder:
    """Records the real inputs of the talker, its text projection and the code predictor."""

    calls: list[_Call] = field(default_factory=list)
    _cache_keys: dict[int, int] = field(default_factory=dict)
    _caches: list[KVCache] = field(default_factory=list)  # keeps ids unique while recording

    def _freeze(self, a):
        if isinstance(a, KVCache):
            if id(a) not in self._cache_keys:
                self._cache_keys[id(a)] = len(self._cache_keys)
                self._caches.append(a)
            return ("cache", self._cache_keys[id(a)], a.num_slots, a.max_len)
        return a.detach().clone() if isinstance(a, torch.Tensor) else a

    def attach(self, talker: nn.Module, code_predictor: nn.Module) -> list:
        def hook(kind):
            def pre(_module, args):
                self.calls.append(_Call(kind, tuple(self._freeze(a) for a in args)))

            return pre

        return [
            talker.register_forward_pre_hook(hook("talker")),
            talker.text_projection.register_forward_pre_hook(hook("text_projection")),
            code_predictor.register_forward_pre_hook(hook("code_predictor")),
        ]

    def count(self, kind: str) -> int:
        return sum(c.kind == kind for c in self.calls)


class KVRange:
    """Running per-layer amax of the keys and values written into a cache."""

    def __init__(self, num_layers: int):
        self.k = torch.zeros(num_layers, dtype=torch.float64)
        self.v = torch.zeros(num_layers, dtype=torch.float64)

    def observe(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        rows = slots[:, None].expand_as(positions)  # [B, T]
        # Advanced indices split by a slice go first: [B, T, L, kv_heads, D] -> [L, B, T, ...]
        k = cache.k[:, rows, :, positions].movedim(2, 0)
        v = cache.v[:, rows, :, positions].movedim(2, 0)
        self.k = torch.maximum(self.k, k.float().abs().flatten(1).amax(1).double().cpu())
        self.v = torch.maximum(self.v, v.float().abs().flatten(1).amax(1).double().cpu())


def replay(model: nn.Module, kind: str, rec: InputRecorder, kv: KVRange, on_call=None) -> None:
    """Feed the recorded inputs of `kind` ("talker" or "code_predictor") through `model`."""
    cfg = model.cfg.talker if kind == "talker" else model.cfg.code_predictor
    p = next(model.parameters())
    caches: dict[int, KVCache] = {}
    with torch.no_grad():
        for call in rec.calls:
            if kind == "talker" and call.kind == "text_projection":
                model.text_projection(*call.args)
            elif call.kind == kind:
                x, (_, key, num_slots, max_len), slots, positions, *rest = call.args
                if key not in caches:
                    caches = {key: KVCache(cfg, num_slots, max_len, p.dtype, p.device)}
                model(x, caches[key], slots, positions, *rest)
                kv.observe(caches[key], slots, positions)
            else:
                continue
            if on_call is not None:
                on_call()


def measure_kv_scales(models, texts: list[str], *, seed: int = 0, max_frames: int = 32,
                      batch_size: int = 8) -> list[tuple[float, float]]:  # fmt: skip
    """Each talker layer's (k_scale, v_scale) for an FP8 KV cache as `compile --calib` sets
    them from a calibration file (the layer's amax over the reference generation of `texts`,
    / 448), measured without modelopt: for an engine built in memory (the engine benchmark's
    stand-in, `GraphEngine(kv_scales=...)`). `models`: a `runtime.engine.Models` with its
    decoder layers."""
    from ttsbuild.calibration.corpus import generate_corpus
    from ttsbuild.plugins.qk_norm_rope import KV_FP8_MAX

    rec = InputRecorder()
    hooks = rec.attach(models.talker, models.code_predictor)
    try:
        generate_corpus(models, texts, seed=seed, max_frames=max_frames, batch_size=batch_size)
    finally:
        for h in hooks:
            h.remove()
    kv = KVRange(models.cfg.talker.num_layers)
    replay(models.talker, "talker", rec, kv)
    if not (kv.k.min() > 0 and kv.v.min() > 0):
        raise CalibrationError("a talker layer wrote no nonzero k or v: no scale to take")
    return [(k / KV_FP8_MAX, v / KV_FP8_MAX) for k, v in zip(kv.k.tolist(), kv.v.tolist(),
                                                             strict=True)]  # fmt: skip


def kv_scales_range(scales: list[tuple[float, float]]) -> str:
    """'k LO..HI, v LO..HI' over the layers' (k_scale, v_scale), for a log line."""
    ks, vs = [k for k, _ in scales], [v for _, v in scales]
    return f"k {min(ks):.3e}..{max(ks):.3e}, v {min(vs):.3e}..{max(vs):.3e}"


def fp8_config() -> dict:
    """modelopt's FP8_DEFAULT_CFG without its lm_head exclusion (every linear is measured)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    entries = cfg["quant_cfg"]
    if not isinstance(entries, list):
        raise CalibrationError(
            "this modelopt has a dict quant_cfg; ttsbuild needs nvidia-modelopt 0.47 (a list)"
        )
    cfg["quant_cfg"] = [e for e in entries if e.get("quantizer_name") != "*lm_head*"]
    return cfg


def _amax(q) -> float | None:
    a = getattr(q, "amax", None)
    return None if a is None else float(a.float().max())


def calibrate_module(model: nn.Module, kind: str, rec: InputRecorder, on_call=None) -> dict:
    """amax of every linear (weight, input) and of the KV cache for one module."""
    import modelopt.torch.quantization as mtq

    cfg = model.cfg.talker if kind == "talker" else model.cfg.code_predictor
    kv = KVRange(cfg.num_layers)
    qmodel = copy.deepcopy(model)
    with contextlib.redirect_stdout(io.StringIO()):  # modelopt prints "Inserted N quantizers"
        mtq.quantize(qmodel, fp8_config(), lambda m: replay(m, kind, rec, kv, on_call))
    linears, problems = {}, []
    for name, mod in qmodel.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        w, x = _amax(getattr(mod, "weight_quantizer", None)), _amax(
            getattr(mod, "input_quantizer", None)
        )
        if w is None or x is None:
            problems.append(f"{kind}.{name}: no {'weight' if w is None else 'input'} amax")
            continue
        linears[name] = {"weight_amax": w, "input_amax": x}
    if problems:
        raise CalibrationError("modelopt did not calibrate every linear: " + "; ".join(problems))
    return {
        "linears": linears,
        "kv_cache": {"k_amax": kv.k.tolist(), "v_amax": kv.v.tolist()},
    }


def run_calibration(
    ckpt_path: str | Path,
    texts: list[str],
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_frames: int = 64,
    batch_size: int = 8,
    texts_source: str = "ttsbuild/data/harvard720.txt",
    progress=None,
) -> dict:
    """Calibrate; returns the calibration document (see `write_calibration`).

    progress(stage, advance, total) is called as frames are generated and calls replayed.
    """
    import modelopt

    from ttsbuild.calibration.corpus import generate_corpus
    from ttsbuild.convert.checkpoint import load_checkpoint
    from ttsbuild.runtime.engine import Models

    ckpt = load_checkpoint(ckpt_path)
    models = Models.load(ckpt, device=device)
    rec = InputRecorder()
    hooks = rec.attach(models.talker, models.code_predictor)
    try:
        est = len(texts) * max_frames
        items = generate_corpus(
            models, texts, seed=seed, max_frames=max_frames, batch_size=batch_size,
            on_frames=(lambda n: progress("generating frames", n, est)) if progress else None,
        )
    finally:
        for h in hooks:
            h.remove()
    modules = {}
    for kind, model in (("talker", models.talker), ("code_predictor", models.code_predictor)):
        total = rec.count(kind) + (rec.count("text_projection") if kind == "talker" else 0)

        def tick(total=total, kind=kind):
            progress(f"calibrating {kind}", 1, total)

        modules[kind] = calibrate_module(model, kind, rec, tick if progress else None)
    doc = {
        "format": CALIB_FORMAT,
        "format_version": CALIB_VERSION,
        "checkpoint": {
            "manifest_sha256": sha256_file(Path(ckpt_path) / "manifest.json"),
            "variant": ckpt.manifest["variant"],
            "standin": ckpt.standin is not None,
        },
        "method": {
            "tool": "nvidia-modelopt",
            "modelopt_version": modelopt.__version__,
            "config": "FP8_DEFAULT_CFG without the lm_head exclusion",
            "algorithm": "max",
            "num_bits": "e4m3",
            "granularity": "per-tensor",
            "kv_cache": "per-layer amax of k (after k_norm and RoPE) and v, read from the cache",
        },
        "run": {
            "device": str(models.talker.codec_head.weight.device),
            "dtype": str(models.talker.codec_head.weight.dtype).removeprefix("torch."),
            "seed": seed,
            "max_frames": max_frames,
            "frames": [int(i.codes.shape[0]) for i in items],
            "talker_calls": rec.count("talker"),
            "code_predictor_calls": rec.count("code_predictor"),
            "torch_version": torch.__version__,
            "ttsbuild_version": ttsbuild.__version__,
        },
        "texts_source": texts_source,
        "texts": texts,
        "modules": modules,
    }
    validate_calibration(doc)
    return doc


def validate_calibration(doc: dict, where: str = "calibration") -> None:
    """Raise CalibrationError unless `doc` is a usable calibration document."""
    if doc.get("format") != CALIB_FORMAT:
        raise CalibrationError(f"{where} is not a ttsbuild calibration file "
                               f"(format {doc.get('format')!r}, expected {CALIB_FORMAT!r})")
    if doc.get("format_version") != CALIB_VERSION:
        raise CalibrationError(f"{where}: calibration format version "
                               f"{doc.get('format_version')!r} is not supported (this ttsbuild "
                               f"reads version {CALIB_VERSION}); re-run `ttsbuild calibrate`")
    problems = []
    modules = doc.get("modules")
    if not isinstance(modules, dict) or set(modules) != set(MODULES):
        raise CalibrationError(f"{where}: 'modules' must hold exactly {', '.join(MODULES)}")
    for kind, m in modules.items():
        for name, entry in m["linears"].items():
            for key in ("weight_amax", "input_amax"):
                v = entry.get(key)
                if not isinstance(v, float | int) or not math.isfinite(v) or v <= 0:
                    problems.append(f"{kind}.{name}.{key} = {v!r}")
        for key in ("k_amax", "v_amax"):
            for i, v in enumerate(m["kv_cache"][key]):
                if not math.isfinite(v) or v <= 0:
                    problems.append(f"{kind} layer {i} {key} = {v!r}")
    if problems:
        raise CalibrationError(f"{where}: amax values must be finite and > 0: "
                               + "; ".join(problems[:10]))


def write_calibration(path: str | Path, doc: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    write_json(tmp, doc)
    tmp.replace(path)


def load_calibration(path: str | Path) -> dict:
    from ttsbuild.validation import read_json_object

    doc = read_json_object(path, "calibration file", CalibrationError)
    validate_calibration(doc, str(path))
    return doc
