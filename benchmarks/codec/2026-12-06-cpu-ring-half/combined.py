"""The batch-1 switches together on the served fp16 codec: the fused layers (strict fp32
transformer, as the GPU's GEMVs), then with scaled fp16 weights and fp16 rings, then with the
qkv GEMV and attention in one launch; a frame a step, CPU, the real config with random
weights, SNR against the full fp32 decode.

    PYTHONPATH=. python benchmarks/codec/2026-12-06-cpu-ring-half/combined.py
"""

import sys

import torch

sys.path.insert(0, "benchmarks/codec")  # precision_probe
from precision_probe import real_codec  # noqa: E402

from ttsbuild.runtime.codec_engine import (  # noqa: E402
    CodecEngine,
    _tf32_mode,
    decode_with,
    random_codes,
    snr_db,
)

ROWS = (
    ("fused layers", {}),
    ("+ fp16 weights + fp16 rings", dict(transformer_half_weights=True, ring_half=True)),
    ("+ qkv and attention in one launch", dict(transformer_half_weights=True, ring_half=True,
                                               qkv_attend=True)),
)


def main() -> None:
    torch.set_num_threads(2)
    dec = real_codec("cpu")
    codes = random_codes(dec.config, 1, 4, seed=1)
    with _tf32_mode(False):
        ref = decode_with(dec, codes)
    kw = dict(conv_impl="triton", fused=True, fused_attention=True, fused_layers_max_rows=8,
              tf32_stages=())
    print("| precision | engine | SNR dB |\n|---|---|---|")
    for name, extra in ROWS:
        eng = CodecEngine(dec, 1, "fp16", **kw, **extra)
        print(f"| fp16 | {name} | {snr_db(ref, decode_with(eng, codes, chunk=1)):.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
