#!/usr/bin/env bash
# The tiny stand-in through the whole pipeline on a GPU host: init-random -> convert ->
# compile (fp8, target arch recorded) -> synth through the engine on CUDA (GraphEngine,
# CUDA graphs, Triton kernels). Writes $OUT/pipeline.log and $OUT/tiny_gpu.wav.
set -euo pipefail
OUT=${OUT:-out}
W=${WORK:-$(mktemp -d)}
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
cli() { "$PY" -m ttsbuild.cli "$@"; }
mkdir -p "$OUT"
{
    cli init-random "$W/src" --variant tiny --force
    cli convert "$W/src" -o "$W/ckpt" --force
    cli compile "$W/ckpt" -o "$W/engine" --precision fp8 --max-batch 8
    "$PY" -c 'import json, sys; m = json.load(open(sys.argv[1])); print("engine target:", m["target"])' "$W/engine/manifest.json"
    cli synth "$W/engine" "The birch canoe slid on the smooth planks." --voice ryan --seed 1 \
        --device cuda -o "$OUT/tiny_gpu.wav"
} 2>&1 | tee "$OUT/pipeline.log"
