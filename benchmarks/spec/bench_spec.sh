#!/usr/bin/env bash
# On the GPU host (repo root): speculative code predictor on vs off, flat and peaked random
# 1.7B CustomVoice code predictors, both draft kinds, windows 1-6, batches 1/8/32/64.
# Expected: ~2-3 min (the first run also compiles Triton kernels); killed at $SPEC_S s (230).
#   OUT=out bash benchmarks/spec/bench_spec.sh            # PEAKED=8 WINDOWS=... BATCHES=...
#   TARGETS=standin: heads and residual branches as the engine's stand-ins (logit std 6)
#   EXACT=1: verification by exact match (every code the plain sampler's draw)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/wheels.sh
timeout "${SPEC_S:-230}" python3 benchmarks/spec/bench_spec.py --peaked "${PEAKED:-8}" \
    --targets "${TARGETS:-flat,peaked}" --frames "${FRAMES:-16}" \
    $([ "${GREEDY_CHECK:-1}" = 1 ] || echo --no-greedy-check) \
    $([ "${EXACT:-0}" = 1 ] && echo --exact) \
    --batches "${BATCHES:-1,8,32,64}" --windows "${WINDOWS:-1,2,3,4,5,6}" \
    --conditional "${CONDITIONAL:-auto}" --loop "${LOOP:-auto}" --profile "${PROFILE:-0}" \
    ${PATHS:+--paths "$PATHS"} --out "$OUT" 2>&1 \
    | tee "$OUT/bench_spec.log"
