#!/usr/bin/env bash
# On the GPU host (repo root): programmatic dependent launch (PDL) for the decode kernels,
# checked and timed side by side. Logs under $OUT.
#   OUT=out bash benchmarks/kernels/gpu_pdl.sh
# Steps (STEPS, default all): build (the step driver, if missing: tests and engine need it),
# tests (GPU kernel tests with PDL on), cp (the code predictor's
# 15-pass frame graph, fused path: PDL off / on without the weight prefetch / on with one
# or two K blocks prefetched),
# talker (the 28-layer talker step graph, PDL off / on), engine (engine microbenchmark, PDL
# on), w8a8 (not in the default: W8A8 tests and the engine with --w8a8-min-rows), check (graph_vs_eager, tiny, PDL on),
# early (not in the default: the code-predictor frame and the talker step with inputs read
# before the PDL wait on/off, TTSBUILD_PDL_EARLY, x 16-column split-K / 8-column GEMV tiles,
# TTSBUILD_GEMV_NARROW).
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-build tests cp talker engine check}
mkdir -p "$OUT"
source benchmarks/wheels.sh
export PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }
for step in $STEPS; do
    case $step in
    tests)
        log "GPU kernel tests (PDL on)"
        TRITON_F32_DEFAULT=ieee timeout -k 5 180 python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/test_gpu_fused_kernels.py tests/plugins/test_gpu_kernels.py \
            tests/runtime/test_cp_fused.py -k "not interpreter" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 ;;
    cp)
        # (TTSBUILD_PDL, TTSBUILD_PDL_PREFETCH, TTSBUILD_PDL_PREFETCH_BLOCKS)
        for v in "0 0 1" "1 0 1" "1 1 1" "1 1 2"; do
            set -- $v
            log "code-predictor frame, TTSBUILD_PDL=$1 TTSBUILD_PDL_PREFETCH=$2 TTSBUILD_PDL_PREFETCH_BLOCKS=$3"
            TTSBUILD_PDL=$1 TTSBUILD_PDL_PREFETCH=$2 TTSBUILD_PDL_PREFETCH_BLOCKS=$3 \
                TRITON_F32_DEFAULT=ieee timeout -k 5 150 \
                python3 benchmarks/kernels/bench_cp_fused.py --paths unfused,fused \
                --batches "${CP_BATCHES:-1,8,64}" --precisions fp8 --fp32-batches 1 2>&1 \
                | tee "$OUT/cp_pdl$1_prefetch$2x$3.log" | grep -E "^(fp8|prec)|equal|DIFFER"
        done ;;
    talker)
        for p in 0 1; do
            log "talker step, TTSBUILD_PDL=$p"
            TTSBUILD_PDL=$p timeout -k 5 120 python3 benchmarks/kernels/bench_talker.py \
                --batches "${TALKER_BATCHES:-1,64}" --precisions fp8 2>&1 \
                | tee "$OUT/talker_pdl$p.log" | grep -E "^(fp8|prec)"
        done ;;
    early)
        # (TTSBUILD_PDL_EARLY, TTSBUILD_GEMV_NARROW)
        for v in "0 0" "1 0" "0 1" "1 1"; do
            set -- $v
            log "code-predictor frame (fused) and talker step, TTSBUILD_PDL_EARLY=$1 TTSBUILD_GEMV_NARROW=$2"
            TTSBUILD_PDL_EARLY=$1 TTSBUILD_GEMV_NARROW=$2 TRITON_F32_DEFAULT=ieee timeout -k 5 150 \
                python3 benchmarks/kernels/bench_cp_fused.py --paths fused \
                --batches "${CP_BATCHES:-1,8}" --precisions fp8 --fp32-batches 1 2>&1 \
                | tee "$OUT/cp_early$1_narrow$2.log" | grep -E "^(fp8|prec)|equal|DIFFER"
            TTSBUILD_PDL_EARLY=$1 TTSBUILD_GEMV_NARROW=$2 timeout -k 5 120 \
                python3 benchmarks/kernels/bench_talker.py --batches "${TALKER_BATCHES:-1,8}" \
                --precisions fp8 2>&1 | tee "$OUT/talker_early$1_narrow$2.log" | grep -E "^(fp8|prec)"
        done ;;
    build)
        ensure_driver "$OUT/build.log" || exit 1 ;;
    engine)
        log "engine microbenchmark (PDL on)"
        engine_bench served ;;
    w8a8)
        log "W8A8 (FP8 activations, cuBLASLt FP8 GEMM) for the talker: GPU tests, then the engine"
        timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/plugins/test_fp8_w8a8.py 2>&1 \
            | tee "$OUT/w8a8_tests.log" | tail -3
        engine_bench w8a8 --w8a8-min-rows "${W8A8_MIN_ROWS:-16}" ;;
    check)
        log "graph vs eager (tiny, PDL on)"
        timeout -k 5 150 python3 benchmarks/runtime/graph_vs_eager.py --variant tiny 2>&1 \
            | tee "$OUT/graph_vs_eager.log" | grep -E "PASS|FAIL|Error" ;;
    esac
done
log done
