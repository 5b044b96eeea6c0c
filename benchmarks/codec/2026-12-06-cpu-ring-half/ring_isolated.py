"""The pre-transformer's fp16 key/value rings alone: every stage strict fp32 but the rings
(precision tf32 with every stage kept fp32 and none on TF32), CPU, the real codec config with
random weights (precision_probe.real_codec), random codes, SNR against the full fp32 decode.

    PYTHONPATH=. python benchmarks/codec/2026-12-06-cpu-ring-half/ring_isolated.py
"""

import sys
import time

import torch

sys.path.insert(0, "benchmarks/codec")  # precision_probe
from precision_probe import real_codec  # noqa: E402

from ttsbuild.runtime.codec_engine import (  # noqa: E402
    CodecEngine,
    _tf32_mode,
    decode_with,
    random_codes,
    snr_db,
    stage_names,
)

PATHS = (
    ("GEMM path, 4-frame steps", {}, 4),
    ("fused layers, 1-frame steps", dict(conv_impl="triton", fused=True, fused_attention=True,
                                         fused_layers_max_rows=8), 1),
)


def main() -> None:
    torch.set_num_threads(2)
    dec = real_codec("cpu")
    stages = tuple(stage_names(dec))
    print("| rows x frames | path | rings | SNR dB | s |\n|---|---|---|---|---|")
    for rows, frames in ((1, 4), (2, 8)):
        codes = random_codes(dec.config, rows, frames, seed=1)
        with _tf32_mode(False):
            ref = decode_with(dec, codes)
        for name, kw, chunk in PATHS:
            for ring in (False, True):
                t = time.time()
                eng = CodecEngine(dec, rows, "tf32", fp32_stages=stages, tf32_stages=(),
                                  ring_half=ring, **kw)  # fmt: skip
                assert eng.ring_half == ring
                snr = snr_db(ref, decode_with(eng, codes, chunk=chunk))
                print(f"| {rows} x {frames} | {name} | {'fp16' if ring else 'fp32'} | "
                      f"{snr:.1f} | {time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
