#!/usr/bin/env bash
# The FP8 quality gate on the 1.7B CustomVoice stand-in, on a GPU host (~3 min on the H200):
#   init-random (peaked logits; sharpness measured on the GPU) -> convert -> compile --precision
#   fp8 WITHOUT --force-quality (the gate: the runtime's kernels on the packed FP8 weights
#   against the eager bf16 model, codebook 0 and codebooks 1-15) -> the same gate on
#   deliberately broken engines (one linear's scale x4, a zeroed channel) and on the old flat
#   stand-in (benchmarks/quality/gate_sensitivity.py, with the talker's FP8 KV cache on k/v scales
#   measured as a calibration takes them, and on broken ones). No calibration file.
#   OUT=out bash benchmarks/quality/gate_1p7b.sh   (GATE_SENSITIVITY=0: the compile's gate only, ~1.5 min)
# Writes $OUT/gate_1p7b.log, $OUT/standin.json, $OUT/quality.json, $OUT/gate_sensitivity*.json.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/wheels.sh
W=$(mktemp -d)
log() { echo "== $(date -u +%H:%M:%S) $*"; }
cli() { python3 -m ttsbuild.cli "$@"; }
{
    log "init-random 1.7b-customvoice (peaked)"
    cli init-random "$W/src" --variant 1.7b-customvoice --force || exit 1
    cp "$W/src/ttsbuild_standin.json" "$OUT/standin.json"
    log "convert"
    cli convert "$W/src" -o "$W/ckpt" --force || exit 1
    log "compile fp8 with the gate (no --force-quality)"
    if cli compile "$W/ckpt" -o "$W/engine" --precision fp8 --no-onnx --force; then
        python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1]))["quality"], open(sys.argv[2], "w"), indent=1)' \
            "$W/engine/manifest.json" "$OUT/quality.json"
        echo "GATE: compile passed without --force-quality"
    else
        echo "GATE: compile refused the engine"
    fi
    if [ "${GATE_SENSITIVITY:-1}" = 1 ]; then  # GATE_SENSITIVITY=0: the compile's gate only
        log "the gate on broken engines"
        timeout 300 python3 benchmarks/quality/gate_sensitivity.py "$W/ckpt" --kv-fp8 --out "$OUT"
        log "the gate on the old flat stand-in (in memory)"
        timeout 200 python3 benchmarks/quality/gate_sensitivity.py --random 1.7b-customvoice \
            --flat --only-correct --out "$OUT"
    fi
    log done
} 2>&1 | tee "$OUT/gate_1p7b.log"
rm -rf "$W"
