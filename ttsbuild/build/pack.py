"""Weight layout of an engine: fused projections and FP8 weight groups.

Packing (talker and code predictor, every layer):
  self_attn.qkv_proj = cat(q_proj, k_proj, v_proj) along the output dim   (one GEMM, one read)
  mlp.gate_up_proj   = cat(gate_proj, up_proj)                               (one GEMM)
Per-output-channel FP8 scales survive concatenation unchanged, so packing and quantising
commute. Unpacking (for the eager path) splits by the sizes recorded in the manifest.

An FP8 weight `W.weight` (float8_e4m3fn [N, K]) comes with `W.weight_scale` (fp32 [N]):
W ~= weight.float() * weight_scale[:, None]. Calibrated linears also carry `W.input_scale`
(fp32 scalar, input amax / 448) for a W8A8 kernel; layers carry `self_attn.k_scale` and
`v_scale` (fp32 scalar, per-layer cache amax / 448) for an FP8 KV cache.
"""

from __future__ import annotations

import re

import torch

from ttsbuild.plugins.fp8_linear import FP8_DTYPE, FP8_MAX, dequantize_weight_fp8

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^(.*layers\.\d+)\.self_attn\.q_proj\.weight$")
_PACKED_LAYER = re.compile(r"^(.*layers\.(\d+))\.self_attn\.qkv_proj\.weight$")

# Tensor groups that can be stored in FP8, by module: name -> regex over packed weight names.
FP8_GROUPS = {
    "talker.layers": ("talker", re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")),
    "talker.text_projection": ("talker", re.compile(r"^text_projection\.linear_fc\d\.weight$")),
    "code_predictor.layers": (
        "code_predictor", re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
    ),
    "code_predictor.lm_head": ("code_predictor", re.compile(r"^lm_head\.\d+\.weight$")),
}
# Extra (non-parameter) tensors an engine file may hold next to the module weights.
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale")


def layer_prefixes(state: dict[str, torch.Tensor]) -> list[str]:
    return [m.group(1) for k in state if (m := _LAYER.match(k))]


def fused_sizes(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Output sizes of the parts of each fused projection (the same in every layer)."""
    prefix = layer_prefixes(state)[0]
    return {
        fused: [int(state[f"{prefix}.{p}.weight"].shape[0]) for p in parts]
        for fused, parts in FUSED.items()
    }


def pack_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module-layout state dict -> packed layout (fused projections), same dtypes."""
    out = dict(state)
    for prefix in layer_prefixes(state):
        for fused, parts in FUSED.items():
            out[f"{prefix}.{fused}.weight"] = torch.cat(
                [out.pop(f"{prefix}.{p}.weight") for p in parts], dim=0
            )
    return out


def unpack_state(packed: dict[str, torch.Tensor], sizes: dict[str, list[int]],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Packed engine tensors -> module-layout state dict in `dtype`, FP8 dequantised.

    Scale tensors are consumed; `load_state_dict(strict=True)` then checks the rest.
    """
    state: dict[str, torch.Tensor] = {}
    for name, t in packed.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        if t.dtype == FP8_DTYPE:
            scale_name = name.removesuffix(".weight") + ".weight_scale"
            if scale_name not in packed:
                raise ValueError(f"FP8 tensor {name} has no {scale_name}")
            t = dequantize_weight_fp8(t, packed[scale_name], torch.float32)
        state[name] = t.to(dtype)
    for name in list(state):
        for fused, parts in FUSED.items():
            if name.endswith(f".{fused}.weight"):
                prefix = name[: -len(f".{fused}.weight")]
                for p, w in zip(parts, state.pop(name).split(sizes[fused]), strict=True):
                    state[f"{prefix}.{p}.weight"] = w.contiguous()
    return state


def calibrated_scales(
    packed: dict[str, torch.Tensor], calib: dict, fp8_names: set[str]
) -> dict[str, torch.Tensor]:
    """input_scale of every FP8 linear and k/v_scale of every layer from a module's calibration.

    A fused linear's input is its parts' common input: the scale takes their largest amax.
    """
    linears, scales = calib["linears"], {}
    for name in fp8_names:
        base = name.removesuffix(".weight")
        parts = next(
            ([f"{base[: -len(f)]}{p}" for p in ps] for f, ps in FUSED.items() if base.endswith(f)),
            [base],
        )
        missing = [p for p in parts if p not in linears]
        if missing:
            raise ValueError(f"the calibration file has no amax for {', '.join(missing)}")
        amax = max(linears[p]["input_amax"] for p in parts)
        scales[f"{base}.input_scale"] = torch.tensor(amax / FP8_MAX, dtype=torch.float32)
    for name in packed:
        if m := _PACKED_LAYER.match(name):
            prefix, index = m.group(1), int(m.group(2))
            for kv in ("k", "v"):
                amax = calib["kv_cache"][f"{kv}_amax"][index]
                scales[f"{prefix}.self_attn.{kv}_scale"] = torch.tensor(
                    amax / FP8_MAX, dtype=torch.float32
                )
    return scales
