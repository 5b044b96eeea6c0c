#!/usr/bin/env bash
# On the GPU host (repo root): build the C++ step driver with CUDA, run the graph-vs-eager
# check, then the engine microbenchmark (random 1.7B CustomVoice weights, and optionally a
# compiled FP8 engine for its memory). Logs go to $OUT. Wheels the image lacks travel in .whl.
#   STEPS="build check bench engine" OUT=out bash benchmarks/runtime/gpu_check.sh
#   STEPS="build check timeline" OUT=out bash benchmarks/runtime/gpu_check.sh   # issue 10 item 3
#   STEPS="build codec" OUT=out bash benchmarks/runtime/gpu_check.sh   # codec step per conv impl
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-build check bench}
BATCHES=${BATCHES:-1,8,32,64}
PRECISIONS=${PRECISIONS:-bf16,fp8}
mkdir -p "$OUT"
source benchmarks/wheels.sh
log() { echo "== $(date -u +%H:%M:%S) $*"; }
for step in $STEPS; do
    case $step in
    build)
        log "build the step driver (CUDA)"
        ( time python3 setup.py -q build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
        tail -4 "$OUT/build.log"
        python3 -c 'import torch, ttsbuild._driver as d; print("driver built with CUDA:", d.built_with_cuda())' ;;
    check)
        log "graph vs eager (tiny)"
        timeout 300 python3 benchmarks/runtime/graph_vs_eager.py --variant tiny --kernels 2>&1 | tee "$OUT/graph_vs_eager.log" ;;
    bench)
        log "engine microbenchmark"
        timeout 420 python3 -m ttsbuild.bench.engine_bench --batches "$BATCHES" \
            --precisions "$PRECISIONS" --iters 20 --out "$OUT" 2>&1 | tee "$OUT/engine_bench.log" ;;
    guards)
        log "guards off vs on (issue 15)"
        timeout 300 python3 -m ttsbuild.cli bench engine --random 1.7b-customvoice --compare-guards \
            --precisions fp8 --batches "${GUARD_BATCHES:-1,64}" --iters 40 --output "$OUT/guards" \
            2>&1 | tee "$OUT/guards.log" ;;
    persistent)
        log "code-predictor frame: fused vs persistent pass (issue 9)"
        timeout 240 python3 benchmarks/kernels/bench_cp_fused.py --paths fused,persistent \
            --batches "${CP_BATCHES:-1}" --fp32-batches 1 2>&1 | tee "$OUT/cp_persistent.log" ;;
    talker)
        log "talker step: unfused vs decode_fused (issue 9)"
        timeout 200 python3 benchmarks/kernels/bench_talker.py --batches "${TALKER_BATCHES:-1,8,64}" \
            --precisions fp8 2>&1 | tee "$OUT/talker.log" ;;
    codec)
        log "codec step per conv implementation (issue 10)"
        timeout 240 python3 benchmarks/codec/profile_codec.py --batches "${CODEC_BATCHES:-1,64,256}" \
            --conv-impls "${CODEC_IMPLS:-cudnn,gemm,triton}" --profile-impls triton,triton+k --top 12 --opt-in-kernels 2>&1 \
            | grep -v Assertion | tee "$OUT/profile_codec.log" ;;
    timeline)
        log "codec stream timeline (1.7B random weights, 32 streams)"
        timeout 300 python3 benchmarks/codec/timeline.py --out "$OUT/timeline" 2>&1 | tee "$OUT/timeline.log" ;;
    engine)
        log "compiled 1.7B FP8 engine: memory and timings"
        W=$(mktemp -d)
        { python3 -m ttsbuild.cli init-random "$W/src" --variant 1.7b-customvoice --force &&
          python3 -m ttsbuild.cli convert "$W/src" -o "$W/ckpt" --force &&
          python3 -m ttsbuild.cli compile "$W/ckpt" -o "$W/engine" --precision fp8 --max-batch 64 \
              --force-quality --no-onnx --quality-texts 1 --quality-frames 4 &&
          timeout 300 python3 -m ttsbuild.bench.engine_bench --engine-dir "$W/engine" \
              --batches 1,64 --iters 20 --out "$OUT/compiled"; } 2>&1 | tee "$OUT/compiled_engine.log" ;;
    esac
done
log done
