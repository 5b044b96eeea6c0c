#!/usr/bin/env bash
# On the GPU host (repo root): the persistent code-predictor pass (plugins.cp_pass) checked
# and timed. GPU tests of the pass and the fused kernels, then the code-predictor frame on
# the unfused / fused / persistent paths side by side (bench_cp_fused.py), then optionally
# the engine microbenchmark with the persistent pass on. Logs under $OUT.
#   OUT=out bash benchmarks/kernels/gpu_persistent.sh
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-tests bench}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_F32_DEFAULT=ieee
log() { echo "== $(date -u +%H:%M:%S) $*"; }
for step in $STEPS; do
    case $step in
    tests)
        log "GPU kernel tests"
        timeout -k 5 200 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_cp_fused.py \
            tests/plugins/test_fused_kernels.py -k "${TESTS_K:-kernel and not interpreter}" 2>&1 \
            | tee "$OUT/gpu_tests.log" | tail -5 ;;
    bench)
        log "code-predictor frame: unfused / fused / persistent"
        timeout -k 5 300 python3 benchmarks/kernels/bench_cp_fused.py --batches "${BATCHES:-1,8,32,64}" \
            --fp32-batches "${FP32_BATCHES:-1,8}" 2>&1 | tee "$OUT/bench_cp_persistent.log" ;;
    engine)
        log "engine microbenchmark, persistent pass on buckets <= ${PERSISTENT_MAX:-64}"
        timeout 300 python3 -m ttsbuild.bench.engine_bench --batches "${BATCHES:-1,8,32,64}" \
            --precisions fp8 --iters 20 --persistent-cp-max-batch "${PERSISTENT_MAX:-64}" \
            --out "$OUT/engine" 2>&1 | tee "$OUT/engine_bench_persistent.log" ;;
    esac
done
log done
