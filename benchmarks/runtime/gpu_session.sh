#!/usr/bin/env bash
# On the GPU host (repo root): one device call that checks and times a change to the runtime.
#   OUT=out STEPS="driver tests engine check ab" bash benchmarks/runtime/gpu_session.sh
# driver: the step driver (`ensure_driver`: says why a carried build does not import and
#         builds it then; the build comes back under $OUT: put it in ttsbuild/ and carry
#         "ttsbuild/_driver.cpython-312-x86_64-linux-gnu.so" to save the ~60 s build; it comes
#         back without debug sections, ~0.4 MB)
# TC_SAVE=1: the Triton cache (/tmp/tc), stripped to each kernel's metadata and binary
#         (strip_triton_cache.py), comes back as $OUT/tc.tgz: put it in .tc/ and carry
#         ".tc" (benchmarks/wheels.sh unpacks it: an engine's or server's start skips most
#         compiles; a cold 1.7B engine took 130 s to build on 2026-12-05, a warm one 70),
#         and the torch extensions built (the megaframe kernel's) as $OUT/tx.tgz + tx.sha
# probe:  the step driver's refusals, each in a process of its own (driver_errors_probe.py:
#         all 7 crashed on the H200 until setup.py linked -lstdc++, 2026-12-02)
# tests:  GPU tests of the step driver's host side (test_driver_host.py, alone first, with
#         faulthandler), then of the prefill kernel path, the prefix cache and W8A8, the
#         talker's fusions and the norms' quantised rows, then the admission writes as one
#         launch (ADMIT_FUSED) and the prefill graph with its admission work forked (same
#         codes and PCM as without)
# wide:   engine microbenchmark at batches 1,64,128,256 (slots up to 256, issue 9's batch-256
#         target), the served plan; ENGINE_ARGS adds flags to every engine microbenchmark,
#         e.g. "--plan-set codec_fused_attention=true --plan-set codec_fused_output=true"
# engine: engine microbenchmark, served plan (first chunk, prefill by bucket, frame, codec);
#         $ENGINE_REPEAT processes in turn (default 1; labels served, served2, ...): the spread
#         of the first chunk's host share between processes on one machine (issue 8; 2026-12-05
#         read 0.29 ms on one machine and 0.47 on the next)
# engine_env: the engine microbenchmark again for each ';'-separated group of environment
#         switches in $ENGINE_ENV (e.g. "TTSBUILD_PREFILL_FORK=1;TTSBUILD_SAMPLE_WARPS=2"),
#         labelled env1, env2, ...: right after `engine`, side by side in one call; `check`
#         runs with the switches of $CHECK_ENV exported (one group)
# check:  graph path vs eager path (tiny); with --kernels (CHECK_ARGS): the plan's optional
#         paths too, batched prefill (prefill_batches 1,2,4) among them; with "--admission-lane
#         1,2 --lane-switch" also the lane and the lane switched on and off between steps;
#         limited to $CHECK_S seconds (default 240: with --kernels the bf16 mode needs more)
# batched: engine microbenchmark with --prefill-batches 1 (one prompt per step, the default
#         before 2026-12-03; the served plan batches 1, 2 and 4 prompts per step)
# lane:   engine microbenchmark with the admission lane on buckets $LANE (default 1,2): a new
#         request's first chunk beside B stepping rows, the lane switched off and on in one
#         engine (`first_chunk_under_load`)
# green:  SMs reserved for the admission lane ($RESERVE, default 16; regular steps in green
#         contexts of the others): graph vs eager with the reserve, then the engine
#         microbenchmark's first chunk beside stepping rows with it (compare with `lane`)
# bootstrap: a real CustomVoice checkpoint's first chunk (two frames, the silent first one
#         dropped) with the lane making both (plan.lane_frames 2): graph vs eager (tiny) with
#         it, then the engine microbenchmark's first chunk of two frames beside stepping rows,
#         lane off and on
# pytest: the GPU tests named by $GPU_PYTEST (pytest arguments: files, -k ...), after the wheels
#         are on the path, with -k "$GPU_PYTEST_K" where given (2026-12-04: a pytest run before this script's setup failed on
#         `import pydantic`), log $OUT/gpu_pytest.log (-v: every test by name, with the exit code)
# newkernels: GPU tests of the kernels built 2026-12-04 (twenty-fifth session) without a GPU:
#         the stack's prefill (test_cp_fused.py -k prefill_kernel_path), the speculative round's
#         acceptance and head GEMV (test_spec_accept.py) and its books and verify index
#         (test_spec_round.py, 2026-12-05), the codec's ConvNeXt blocks in two
#         launches (test_convnext.py, test_codec_engine_gpu.py -k convnext), the prompt
#         embedding in four launches (test_prompt_embed.py, test_graph_engine.py -k
#         prompt_embed), the fused
#         sampler after its threshold searches became shared helpers (-k fused_sample), and
#         the exact-match speculative rounds (2026-12-05, twenty-ninth session: test_spec_accept.py
#         and test_cp_spec.py -k exact; their WHILE-node frame is in `spec`)
# spec:   the WHILE nodes (the step driver's graph_while.cu, built 2026-12-04, never run on a
#         GPU yet): their GPU tests (tests/runtime/test_graph_while.py: a counting loop, the
#         speculative rounds as one WHILE node against every round run, bit for bit), then
#         benchmarks/spec/bench_spec.sh (speculation on vs off, the rounds as a WHILE node vs
#         every round run) with $SPEC_BATCHES (default 1,8) and $SPEC_WINDOWS (default 3: each
#         window compiles the verify pass anew; 2026-12-04 the compiles outran 100 s), $SPEC_S
# codectests: the codec kernels' GPU tests for the conv at >= 2048 rows (the 1x1 conv's own
#         tiles since 2026-12-04) and the output stage's two-phase (window) small tiles
# codec_env: the served codec step (profile_codec.py, row $CODEC_ROW, default
#         triton+k+cl+o+s+a+l since 2026-12-06: "+l" is the pre-transformer as fused linears
#         up to 8 rows, as the engine's plan serves it (codec_fused_layers_max_rows 8); the
#         row without it, the default before, runs cuBLAS GEMVs at batch 1, not the engine's
#         figure; batches $CODEC_BATCHES, default 1,64) as served and with each
#         ';'-separated group of switches in $CODEC_ENV, alternated $CODEC_ROUNDS times
#         (default 2; one process each: compare the rounds' spread with the difference),
#         e.g. CODEC_ENV="TTSBUILD_CODEC_OUTPUT_TAPS=0"
# codecprof: the served codec step's kernels at each of $CODECPROF_BATCHES (default 1,64),
#         one profiled eager step each (profile_codec.py --top 30), with every launch
#         matching $CODECPROF_LAUNCHES (default the convs, GEMMs, output and snake kernels)
#         listed in order with its time; switches from $CODECPROF_ENV (VAR=VALUE words)
# codec:  the codec's kernel tests on the GPU (causal conv, snake + context, channels-last
#         operands, the fused output stage, ring attention), then profile_codec.py's
#         one-frame step (graph-replayed, SNR against fp32) at batches $CODEC_BATCHES (default
#         1,64,256): channels-last operands alone (`triton+k+cl`) and the served codec
#         (`+o+s+a`: the output stage as one kernel, fused attention, tails and spills along
#         channels; defaults since 2026-12-02); with CODEC_PDL_AB=1 the served row again with
#         the codec kernels launched with PDL, with CODEC_RING_AB=1 with the fused attention
#         kernel merging its new frames in registers (TTSBUILD_RING_MERGE=1), with
#         CODEC_LAYERS_AB=1 the served row and that with the pre-transformer as fused
#         linears (`+l`, steps up to 16 frames) at $CODEC_LAYERS_BATCHES (1,2,4,8,16), then
#         `+l` with fp32 rows as GEMVs (TTSBUILD_GEMV_ROWS_F32=16, built 2026-12-03), with
#         CODEC_TILE_AB=1 with the snake + context kernel's former 64 x 64 tile
# cp:     the code predictor's frame (bench_cp_fused.py, fused path, FP8, batches
#         $CP_BATCHES default 1,2,4,8), one process per variant of its switches: the
#         sampler's threshold searches bit by bit (TTSBUILD_SAMPLE_RADIX_BITS=1, the default)
#         or 4 bits per block reduction (built 2026-12-03, untimed), the attention run by
#         the qkv GEMV's last programs (TTSBUILD_CP_ATTEND_IN_QKV=1), the sampler run by the
#         head GEMV's last program at batch 1 (TTSBUILD_CP_SAMPLE_IN_HEAD=1); the GPU tests
#         of the sampler and the fused code-predictor kernels first
# l2persist: benchmarks/kernels/l2_persist.py (the code predictor's fused frame with an L2
#         set-aside and an access-policy window over its weights, against none; whether a
#         capture records a stream's window), batches $L2_BATCHES (default 1,16)
# gemvrule: TTSBUILD_FUSED_GEMV_RULE (the fused one-row GEMVs on the weight-only GEMV rule's
#         tiles): its kernel test, then bench_talker.py (unfused vs fused talker step) and
#         bench_cp_fused.py (unfused vs fused code-predictor frame) at batch $TALKER_BATCHES
#         (default 1), a process each with the rule off and on, two rounds
# talker: the talker's decode step (bench_talker.py, FP8, batches $TALKER_BATCHES default
#         1,8,64,128), one process per variant: its attention as three launches or as one
#         (TTSBUILD_TALKER_ATTEND_FUSED=1: qk_norm_rope_decode_attention), the FP8 gate/up
#         GEMV and silu_mul as two or as one (TTSBUILD_GATE_UP_SILU=1: fp8_gate_up_silu);
#         after the new kernels' GPU tests
# sampler: the fused sampler's latency by warps per row and top-k search (bench_sampler.py:
#         1, 2, 4, 8 warps, the 32-bit search and the early exit (TTSBUILD_SAMPLE_EARLY_EXIT),
#         at the code predictor's and the talker's vocabularies, batches 1 and 64, tokens
#         checked against the reference); the profile of 2026-12-03 gave 18.7 us a call at 8
#         warps, 16 calls a frame; GPU tests of the threshold searches first
# convsweep: the codec's implicit-GEMM conv at each decoder stage's shapes (channels-last,
#         k = 7 dilated and 1x1 with snake + residual), the served tile config against a grid
#         (sweep_conv.py; CONV_SWEEP_ARGS default --quick: 28 configs; at steps of up to 8
#         streams 24 with the engine's split-K, then split counts 1-16), batches $CONV_BATCHES
# chain:  bench_chain.py: us per launch in a captured chain of 420 dependent kernels (empty,
#         a 1024-element hand-off with a reduction over 1-128 programs, the code predictor's
#         linears at one row), with and without PDL: the floor under a frame's ~420 launches
# megaframe: benchmarks/kernels/megapass/bench_megaframe.py (the code predictor's frame at
#         batch 1 as one persistent CUDA kernel, ttsbuild/csrc/cp_megaframe.cu: its check
#         against a float32 reference, greedy and sampled, then its time and floors and stage
#         breakdowns), the package wrapper's GPU tests (tests/runtime/test_megaframe_gpu.py),
#         then the served fused frame at batch 1 (bench_cp_fused.py, FP8) in the same call
# cpkern: benchmarks/kernels/cp_many_rows.py (the code predictor's linears at 64-256 rows,
#         weight-only FP8 against cuBLAS on the bf16 copies) as served, with
#         TTSBUILD_FP8_TUNE_BY_ROWS=1, and with that and TTSBUILD_FP8_WO_MAX_BLOCK_M=128; then
#         the Triton cache stripped (strip_triton_cache.py) and the first run again in a new
#         process: it should compile nothing (its wall time against the first's)
# kvattn: benchmarks/kernels/kv_fp8_attention.py (the talker's decode attention and cache
#         write on a bf16 cache against an FP8 one, plan talker_kv_fp8; 1-256 rows, 200 and 600
#         positions of a 2048-position cache; $KVATTN_ARGS, e.g. --tiles 128,4,3;128,8,3
#         to sweep the split kernel's tiles (no quotes: the words reach the script as they
#         are, quotes included); $KVATTN_S its limit (default 150 s); $KVATTN_TAIL lines
#         of the log shown, default 12)
# megatalker: benchmarks/kernels/megatalker/bench_talker_step.py (the talker's decode step at
#         batch 1 as one persistent kernel, runtime/talker_megastep.py): against its fp32
#         reference and the served step at three positions, then ms per step by prefetch
#         distance beside the served step ($MEGATALKER_ARGS, $MEGATALKER_S default 300)
# megaengine: the engine microbenchmark with plan.megaframe_code_predictor (bucket 1's code
#         predictor as one kernel, regular step and admission lane), beside the same plan
#         without it: both with an FP8 code predictor and no SMs reserved for the lane; a third
#         side with $MEGAENGINE_EXTRA (option bits: cp_megaframe.TWO_TOKEN 32, XREDUCE 64,
#         KV_AHEAD 128, SPLIT_DOWN 256, EARLY_FREE 2048, TAGGED 4096, TAGGED_QKV 8192, WARP_QK
#         16384) beside the served ones through TTSBUILD_MEGAFRAME_EXTRA (unset: the engine's
#         default extras, TAGGED | TAGGED_QKV | WARP_QK; 0: none);
#         $MEGAENGINE_SIDES picks sides (cpfp8 megaframe megaframe_lane megaframe_extra)
# mfprofile: Nsight Compute (ncu --set full, source counters) on one frame of the one-kernel
#         code predictor (benchmarks/kernels/megapass/profile_megaframe.py, built with -lineinfo):
#         variants $MFPROFILE_VARIANTS (default "served race"); details and the stall samples
#         of each SASS instruction (CSV; the CUDA-source export of 2026-12-05 held no metrics,
#         so it is not made) come back beside the reports
# codecncu: Nsight Compute (--set full) on one launch of the codec kernels matching
#         $CODECNCU_KERNEL (default _codec_output) in profile_codec.py's served step at
#         $CODECNCU_BATCH rows (default 64); the report and its details page come back
# streamprobe: benchmarks/kernels/megapass/bench_stream_probe.py (one CTA an SM streaming
#         chunks from HBM to shared memory: TMA or cp.async, chunk size, copies in flight,
#         with a grid barrier after each chunk or without)
# profile: profile_graphs.py with TTSBUILD_PDL=0 (each kernel's own time) at batches
#         $PROFILE_BATCHES (default 1,64): frame, prefill 32/64, codec; the top $PROFILE_TOP
#         kernels of each graph by total time
# sweep:  serving sweep at $SWEEP_RPS req/s (default 1,10,20,30,40), 60 s each, one server,
#         prompt sets $SWEEP_DATASETS (default voice-agent; "harvard" for issue 12's other set),
#         `serve $SWEEP_ARGS` (e.g. --drop-bootstrap-frame: a stand-in making a real
#         CustomVoice checkpoint's first chunk, two frames with the silent one dropped), until
#         $DEADLINE_S seconds into the run; $BENCH_ARGS goes to `bench sweep` (and to the
#         overload step's `bench run`), e.g. "--workers 4": the schedule sent by four processes
# a8:     the W8A8 Triton tiles: their GPU tests; the engine bench as served (W8A8 16-127
#         rows), then with bf16 copies from 16 rows (the defaults before 2026-12-04), with the
#         norms writing quantised rows (TTSBUILD_A8_NORM_QUANT), silu_mul too
#         (TTSBUILD_A8_SILU_QUANT), and with silu(gate) * up in
#         the A8 epilogue (TTSBUILD_A8_GATE_UP_SILU), an FP8 code predictor, and one with
#         W8A8 on its unfused path (plan cp_w8a8_min_rows 16: batch 64); then, time left,
#         `sweep_fp8.py --a8`
# sides:  the engine microbenchmark once per side of $ENGINE_SIDES ("name|ENV=1 ...|flags;..."
#         e.g. "copies|X=0|;nocopies|X=0|--bf16-min-rows 0"), batches $BATCHES, a process each
# wosweep: `sweep_fp8.py` (the weight-only FP8 tiles, every config of its grid, against the
#         autotuner's pick and cuBLAS on bf16) at the shapes $WO_SHAPES (default cp: the code
#         predictor's, whose 16-64-row buckets run these tiles) and rows $WO_MS (default
#         16,32,64), until the deadline; its winners also as a config table,
#         $OUT/wo_table_$WO_SHAPES.json, for a later side's TTSBUILD_FP8_WO_TABLE (set
#         ENGINE_SIDES in double quotes after OUT, so that $OUT expands in it)
# fusedsweep: benchmarks/kernels/sweep_fused_cp.py (the fused code predictor's four linears,
#         each with its epilogue, over sweep_fp8's grid against the `plan` tiles) at rows
#         $WO_MS (default 16,32,64), until the deadline
# a8sweep: `sweep_fp8.py --a8` at rows $A8_MS (default 128,256,512): the A8 tiles' best config
#         (256-row tiles too from 256 rows) against cuBLAS on bf16 copies and cuBLASLt W8A8
# switches: kernel switches side by side in ONE process (bench_switches.py: a CUDA graph
#         per variant and shape, replayed in interleaved rounds; ratios to the baseline within
#         a round; the baseline: the switches as served): $SWITCH_VARIANTS (NAME on, -NAME
#         off; default: the served A8 switches off one by one and both, A8_SILU_QUANT, the
#         code predictor's attention-in-qkv and sampler-in-head, the persistent pass's L2
#         prefetch, attention in its qkv stage and counting barrier, the fused linears' and
#         the FP8 tiles' L2 prefetch before the PDL wait), $SWITCH_SHAPES (default
#         talker decode 1 and 64, prefill 1x32, 1x64, 4x64, code predictor frame 1 and 8,
#         persistent frame 1); first the persistent pass's GPU tests (SWITCH_TESTS=0 skips
#         them) and bench_barrier.py (the generation and the counting grid barrier)
# specab: speculation with the verify pass's attention as a program per token
#         (TTSBUILD_ATTEND_TOKENS_PARALLEL=1) against in turn, 2026-12-05: their GPU tests
#         (test_fused_kernels.py -k tokens_kernel, test_spec_accept.py, test_graph_while.py),
#         then bench_spec.sh, a process per side: serial (as served), parallel (the tokens'
#         programs side by side), gemv (that and TTSBUILD_GEMV_FEW_ROWS=1: the verify's linears
#         of 2-4 rows as GEMVs); $SPECAB_BATCHES (default 1,8), windows $SPECAB_WINDOWS
#         (default 2,3,4), top $SPECAB_PROFILE kernels (default 12), fused paths; PDL as set
#         (TTSBUILD_PDL=0 for each kernel's own time); logs bench_spec_{serial,parallel,gemv}.log
# ab:     serving A/B at $AB_RPS req/s (side X at $AB_RPS_X where given), $AB_DURATION each, until $DEADLINE_S seconds into the
#         run: `serve` with $AB_A (default: no extra flags) against `serve` with $AB_B (and
#         more sides: AB_SIDES="A B C" with $AB_C, ...).
# overload: issue 12's 2x check (benchmarks/serve/overload.sh) at $OVERLOAD_RPS req/s
#         (default 200: twice the 100 measured on 256 slots), $SLOTS slots (default: serve's), one
#         server per side of $OVERLOAD_SIDES (default "A"), `serve` flags $OVERLOAD_A, ...
#         (e.g. OVERLOAD_SIDES="A B" OVERLOAD_B="--queue-long-waits --standing-queue 1e9
#         --overload-slack 0": before the standing queue), $OVERLOAD_DURATION (60s) each
#         (2026-12-01: Python's GIL switch interval, 5 ms against 0.5 ms, through a
#         `--gil-switch-ms` flag: no difference at 10 req/s, and the flag was removed.)
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-driver tests engine check}
DEADLINE_S=${DEADLINE_S:-560}
mkdir -p "$OUT"
source benchmarks/wheels.sh
log() { echo "== $(date -u +%H:%M:%S) +${SECONDS}s $*"; }
# Preflight: the modules every step imports, before any device time goes to a step that would
# fail on an import (2026-12-03: a whole call's benchmarks failed on `import pydantic`).
# Serving steps import the web stack too (2026-12-05: fastapi without opentelemetry, then
# soxr, failed two A/B calls only once their servers started).
serving=""
case " $STEPS " in *" ab "* | *" sweep "* | *" overload "*) serving=", ttsbuild.serve.app" ;; esac
if ! why=$(python3 -c "import ttsbuild.bench.engine_bench, ttsbuild.serve.cli$serving" 2>&1); then
    echo "== preflight failed: $(tail -1 <<<"$why")"; exit 1
fi
# engine_sides MIN_LEFT "name|ENV=1 ...|flags" ...: the engine microbenchmark once per side, a
# process each with its environment and flags, while MIN_LEFT seconds of the deadline remain
engine_sides() {
    local min_left=$1 side name env flags
    shift
    for side in "$@"; do
        IFS='|' read -r name env flags <<<"$side"
        if [ $((DEADLINE_S - SECONDS)) -lt "$min_left" ]; then
            log "skip $name: $((DEADLINE_S - SECONDS))s left"; continue
        fi
        log "engine microbenchmark: $name ($env $flags)"
        # shellcheck disable=SC2086  # assignments and flags, split on purpose
        ( export ${env:-X=0}; engine_bench "$name" $flags )
    done
}
# grid_sweep LABEL LOG SCRIPT ARGS...: a tile-grid sweep (compiled in 16 processes) at rows
# $WO_MS (default 16,32,64), in its own Triton cache (TC_SAVE brings back the served kernels,
# not the grid's), until the deadline; its table from $OUT/LOG.log
grid_sweep() {
    local label=$1 name=$2
    shift 2
    if [ $((DEADLINE_S - SECONDS)) -lt 60 ]; then
        log "skip $label: $((DEADLINE_S - SECONDS))s left"; return
    fi
    log "$label, rows ${WO_MS:-16,32,64}"
    TRITON_CACHE_DIR=/tmp/tc_sweep timeout -k 5 $((DEADLINE_S - SECONDS - 10)) \
        python3 -u "$@" --ms "${WO_MS:-16,32,64}" --jobs 16 --out "$OUT" > "$OUT/$name.log" 2>&1
    echo "rc=$?"; grep -v "^  \|compile failed" "$OUT/$name.log" | tail -14
}
# a8_sweep ROWS: sweep_fp8.py --a8 at the talker's shapes and those row counts, until the deadline
a8_sweep() {
    if [ $((DEADLINE_S - SECONDS)) -lt 60 ]; then  # (timeout 0 would mean no limit at all)
        log "skip the A8 sweep: $((DEADLINE_S - SECONDS))s left"; return
    fi
    log "A8 tiles against cuBLAS bf16 / W8A8 at rows $1"
    timeout -k 5 $((DEADLINE_S - SECONDS - 10)) python3 benchmarks/kernels/sweep_fp8.py --a8 \
        --ms "$1" --jobs 14 > "$OUT/sweep_a8.log" 2>&1
    echo "rc=$?"; grep -vE "^  |compile failed" "$OUT/sweep_a8.log" | tail -20
}
for step in $STEPS; do
    case $step in
    driver)  # a fresh build comes back under $OUT, to carry next time
        ensure_driver "$OUT/build.log" || exit 1
        # (without its debug sections: 12 MB -> ~0.4 MB of the 64 MiB carry; it imports the same)
        [ ! -f "$OUT/build.log" ] || { cp ttsbuild/_driver.cpython-312-x86_64-linux-gnu.so "$OUT/" \
            && strip --strip-debug "$OUT/_driver.cpython-312-x86_64-linux-gnu.so" || true; } ;;
    probe)
        log "the step driver's refusals, one process each"
        timeout -k 5 120 python3 benchmarks/runtime/driver_errors_probe.py > "$OUT/probe.log" 2>&1
        echo "probe rc=$?"; grep -v "^   " "$OUT/probe.log" | tail -10 ;;
    wide)
        log "engine microbenchmark, batches 1,64,128,256"
        BATCHES=1,64,128,256 engine_bench wide ;;
    tests)
        log "GPU tests: the step driver's host side"
        timeout -k 5 120 python3 -X faulthandler -m pytest -v -s -p no:cacheprovider \
            tests/runtime/test_driver_host.py > "$OUT/gpu_tests_driver.log" 2>&1
        echo "driver host tests rc=$?"; grep -E "PASSED|FAILED|ERROR|Fatal|line [0-9]+ in test_" \
            "$OUT/gpu_tests_driver.log" | head -20
        log "GPU tests: prefill kernel path, prefix cache, W8A8"
        TRITON_F32_DEFAULT=ieee timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider \
            tests/runtime/test_cp_fused.py tests/plugins/test_fp8_w8a8.py \
            tests/plugins/test_gpu_kernels.py -k "prefill or w8a8 or scaled_mm or decode_attention" \
            2>&1 | tee "$OUT/gpu_tests.log" | tail -3
        log "GPU tests: the talker's fusions, the norms' quantised rows (no TRITON_F32_DEFAULT here: the tests' conftest sets it)"
        timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider \
            tests/runtime/test_talker_fusions.py tests/plugins/test_norm_act.py 2>&1 \
            | tee "$OUT/gpu_tests_talker_norms.log" | tail -3
        log "GPU tests: the admission writes as one launch (ADMIT_FUSED), the prefix copy of its own positions (PREFIX_COPY_KERNEL), the prefill graph's admission work on a forked stream (PREFILL_FORK)"
        TRITON_F32_DEFAULT=ieee timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/test_slot_writes.py tests/plugins/test_kv_copy.py \
            tests/runtime/test_graph_engine.py \
            -k "slot_writes or admission or prefix_copy or prefill_fork" 2>&1 \
            | tee "$OUT/gpu_tests_prefill_fork.log" | tail -3 ;;
    l2persist)
        log "the code predictor's frame with its weights persisting in L2"
        timeout -k 5 $((DEADLINE_S - SECONDS > 60 ? DEADLINE_S - SECONDS - 10 : 50)) \
            python3 benchmarks/kernels/l2_persist.py --batches "${L2_BATCHES:-1,16}" \
            > "$OUT/l2_persist.log" 2>&1
        echo "l2persist rc=$?"; tail -30 "$OUT/l2_persist.log" ;;
    cp)  # CP_TESTS=0 skips the GPU tests (2026-12-03: over 240 s on a cold Triton cache)
        if [ "${CP_TESTS:-1}" != 0 ]; then
            log "GPU tests: sampler, fused code-predictor kernels"
            TRITON_F32_DEFAULT=ieee timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider \
                tests/plugins/test_references.py tests/plugins/test_fused_kernels.py \
                tests/plugins/test_gpu_kernels.py tests/runtime/test_cp_fused.py \
                -k "sample or attend or norm_linear or fused or cp" 2>&1 \
                | tee "$OUT/gpu_tests_cp.log" | tail -3
        fi
        for variant in "RADIX=1 ATTEND=0 HEAD=0" "RADIX=4 ATTEND=0 HEAD=0" \
                "RADIX=1 ATTEND=1 HEAD=0" "RADIX=1 ATTEND=0 HEAD=1" "RADIX=4 ATTEND=1 HEAD=1"; do
            eval "$variant"
            name="r${RADIX}_a${ATTEND}_h${HEAD}"
            log "code predictor frame: sampler radix $RADIX bits, attention in qkv $ATTEND, sampler in head $HEAD"
            TTSBUILD_SAMPLE_RADIX_BITS=$RADIX TTSBUILD_CP_ATTEND_IN_QKV=$ATTEND \
                TTSBUILD_CP_SAMPLE_IN_HEAD=$HEAD \
                timeout -k 5 200 python3 benchmarks/kernels/bench_cp_fused.py \
                --batches "${CP_BATCHES:-1,2,4,8}" --precisions fp8 --paths unfused,fused \
                --fp32-batches 1,8 > "$OUT/bench_cp_$name.log" 2>&1
            echo "rc=$?"; grep -E "^(fp8|fp32|total)" "$OUT/bench_cp_$name.log"
        done ;;
    talker)  # TALKER_TESTS=0 skips the GPU tests
        if [ "${TALKER_TESTS:-1}" != 0 ]; then
            log "GPU tests: the talker's one-launch decode attention and gate/up + silu"
            TRITON_F32_DEFAULT=ieee timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider \
                tests/plugins/test_qk_decode_attention.py tests/plugins/test_fp8_gate_up.py \
                tests/runtime/test_talker_fusions.py 2>&1 | tee "$OUT/gpu_tests_talker.log" | tail -3
        fi
        for variant in "ATT=0 GU=0" "ATT=1 GU=0" "ATT=0 GU=1" "ATT=1 GU=1"; do
            eval "$variant"
            log "talker step: attention in one launch $ATT, gate/up + silu in one $GU"
            TTSBUILD_TALKER_ATTEND_FUSED=$ATT TTSBUILD_GATE_UP_SILU=$GU \
                timeout -k 5 200 python3 benchmarks/kernels/bench_talker.py \
                --batches "${TALKER_BATCHES:-1,8,64,128}" --precisions fp8 \
                > "$OUT/bench_talker_a${ATT}_g${GU}.log" 2>&1
            echo "rc=$?"; tail -6 "$OUT/bench_talker_a${ATT}_g${GU}.log"
        done ;;
    gemvrule)  # TTSBUILD_FUSED_GEMV_RULE off and on, two rounds, a process each
        log "GPU test: the fused GEMV rule's kernel against fp32"
        TRITON_F32_DEFAULT=ieee timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/test_fused_kernels.py -k "gemv_rule" 2>&1 \
            | tee "$OUT/gpu_tests_gemvrule.log" | tail -2
        for round in 1 2; do
            for rule in 0 1; do
                log "talker step and code-predictor frame, TTSBUILD_FUSED_GEMV_RULE=$rule (round $round)"
                TTSBUILD_FUSED_GEMV_RULE=$rule timeout -k 5 200 python3 \
                    benchmarks/kernels/bench_talker.py --batches "${TALKER_BATCHES:-1}" \
                    --precisions fp8 > "$OUT/bench_talker_rule${rule}_r$round.log" 2>&1
                echo "rc=$?"; tail -3 "$OUT/bench_talker_rule${rule}_r$round.log"
                TTSBUILD_FUSED_GEMV_RULE=$rule timeout -k 5 200 python3 \
                    benchmarks/kernels/bench_cp_fused.py --batches 1 --precisions fp8 \
                    --paths unfused,fused --fp32-batches "" \
                    > "$OUT/bench_cp_rule${rule}_r$round.log" 2>&1
                echo "rc=$?"; tail -2 "$OUT/bench_cp_rule${rule}_r$round.log"
            done
        done ;;
    a8)  # the FP8 x FP8 (W8A8) Triton tiles: GPU tests, engine benches side by side, sweep
        log "GPU tests: W8A8 (row quantisation, cuBLASLt, the A8 tiles, the norms' quantised rows)"
        timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider tests/plugins/test_fp8_w8a8.py \
            tests/plugins/test_norm_act.py tests/runtime/test_talker_fusions.py \
            2>&1 | tee "$OUT/gpu_tests_a8.log" | tail -2
        log "engine microbenchmark: the served plan (W8A8 from 16 rows, bf16 copies from DEFAULT_BF16_MIN_ROWS)"
        engine_bench served
        # name, environment, engine-bench flags: the defaults before 2026-12-04 (bf16 copies
        # from 16 rows), then the two A8 switches
        engine_sides 100 "bf16from16|X=0|--w8a8-min-rows 0 --bf16-min-rows 16" \
            "normquant|TTSBUILD_A8_NORM_QUANT=1|" "siluquant|TTSBUILD_A8_SILU_QUANT=1|" \
            "gateup|TTSBUILD_A8_GATE_UP_SILU=1|" "cpfp8|X=0|--plan-set code_predictor_fp8=true" \
            "cpw8a8|X=0|--plan-set code_predictor_fp8=true --plan-set cp_w8a8_min_rows=16"
        [ $((DEADLINE_S - SECONDS)) -le 90 ] || a8_sweep "${A8_MS:-16,32,64,128}" ;;
    sides)
        IFS=';' read -ra sides <<<"${ENGINE_SIDES:?set ENGINE_SIDES}"
        engine_sides 130 "${sides[@]}" ;;
    a8sweep)
        a8_sweep "${A8_MS:-128,256,512}" ;;
    wosweep)
        grid_sweep "weight-only FP8 tiles at the ${WO_SHAPES:-cp} shapes" sweep_wo \
            benchmarks/kernels/sweep_fp8.py --shapes "${WO_SHAPES:-cp}" \
            --table "$OUT/wo_table_${WO_SHAPES:-cp}.json" ;;
    fusedsweep)
        grid_sweep "the fused code predictor's linears" sweep_fused_cp \
            benchmarks/kernels/sweep_fused_cp.py ;;
    switches)  # SWITCH_TESTS=0 skips the persistent pass's GPU tests, SWITCH_BARRIER=0 the barrier bench
        if [ "${SWITCH_TESTS:-1}" != 0 ]; then
            log "GPU tests: the persistent code-predictor pass (L2 prefetch, attention in qkv, counting barrier), the L2-ahead of the fused linears and the FP8 tiles"
            timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider \
                tests/runtime/test_cp_fused.py tests/plugins/test_gpu_fused_kernels.py \
                -k "persistent_pass or persistent_frame or l2_ahead" 2>&1 \
                | tee "$OUT/gpu_tests_switches.log" | tail -2
        fi
        if [ "${SWITCH_BARRIER:-1}" != 0 ]; then  # SWITCH_BARRIER=0 skips bench_barrier.py
            log "grid barriers: generation vs counting, and a persistent pass's stages (bench_barrier.py)"
            timeout -k 5 150 python3 -u benchmarks/kernels/bench_barrier.py > "$OUT/bench_barrier.log" 2>&1
            echo "rc=$?"; tail -12 "$OUT/bench_barrier.log"
        fi
        log "kernel switches side by side in one process (bench_switches.py)"
        args=()
        [ -n "${SWITCH_VARIANTS:-}" ] && args+=("--variants=$SWITCH_VARIANTS")  # (may start with -)
        [ -n "${SWITCH_SHAPES:-}" ] && args+=(--shapes "$SWITCH_SHAPES")
        timeout -k 5 $((DEADLINE_S - SECONDS > 60 ? DEADLINE_S - SECONDS - 10 : 50)) \
            python3 -u benchmarks/kernels/bench_switches.py "${args[@]}" \
            --out "$OUT/bench_switches.json" > "$OUT/bench_switches.log" 2>&1
        echo "rc=$?"; grep -vE "^  |compile failed" "$OUT/bench_switches.log" | tail -30 ;;
    engine)
        for i in $(seq "${ENGINE_REPEAT:-1}"); do
            label=served; [ "$i" = 1 ] || label=served$i
            left=$((DEADLINE_S - SECONDS))
            if [ "$i" -gt 1 ] && [ "$left" -lt 130 ]; then log "skip $label: ${left}s left"; continue; fi
            log "engine microbenchmark (served plan) -> $label"
            engine_bench "$label"
        done ;;
    engine_env)  # one run per ';'-separated group of switches, labelled env1, env2, ...
        IFS=';' read -ra groups <<<"${ENGINE_ENV:?set ENGINE_ENV}"
        sides=()
        for i in "${!groups[@]}"; do sides+=("env$((i + 1))|${groups[$i]}|"); done
        engine_sides 130 "${sides[@]}" ;;
    check)
        log "graph vs eager (tiny) ${CHECK_ENV:-}"
        ( [ -z "${CHECK_ENV:-}" ] || export $CHECK_ENV
          timeout -k 5 "${CHECK_S:-240}" python3 benchmarks/runtime/graph_vs_eager.py --variant tiny \
              ${CHECK_ARGS:-} 2>&1 | tee "$OUT/graph_vs_eager.log" | grep -E "PASS|FAIL|Error" ) ;;
    batched)
        log "engine microbenchmark, one prompt per prefill step"
        engine_bench single --prefill-batches 1 ;;
    lane)
        log "engine microbenchmark, admission lane ${LANE:-1,2} (off and on side by side)"
        engine_bench lane --admission-lane "${LANE:-1,2}"
        grep -E "stepping rows" "$OUT/engine_bench_lane.log" ;;
    green)
        log "graph vs eager (tiny) with ${RESERVE:-16} SMs reserved for the admission lane"
        timeout -k 5 200 python3 benchmarks/runtime/graph_vs_eager.py --variant tiny \
            --admission-lane 1,2 --lane-reserved-sms "${RESERVE:-16}" 2>&1 \
            | tee "$OUT/graph_vs_eager_green.log" | grep -E "PASS|FAIL|Error"
        log "engine microbenchmark, lane ${LANE:-1,2} with ${RESERVE:-16} SMs reserved"
        engine_bench green --admission-lane "${LANE:-1,2}" --lane-reserved-sms "${RESERVE:-16}"
        grep -E "stepping rows" "$OUT/engine_bench_green.log" ;;
    bootstrap)
        log "graph vs eager (tiny), the lane making two first frames"
        timeout -k 5 200 python3 benchmarks/runtime/graph_vs_eager.py --variant tiny \
            --admission-lane 1,2 --lane-frames 2 2>&1 \
            | tee "$OUT/graph_vs_eager_lane_frames.log" | grep -E "PASS|FAIL|Error"
        log "engine microbenchmark, first chunk of two frames beside stepping rows"
        engine_bench bootstrap --admission-lane 1,2 --first-frames 2
        grep -E "stepping rows" "$OUT/engine_bench_bootstrap.log" ;;
    pytest)
        log "GPU tests: ${GPU_PYTEST:?GPU_PYTEST names the tests}"
        budget=${GPU_PYTEST_S:-200}  # no later than the session's deadline either
        left=$((DEADLINE_S - SECONDS - 10))
        [ "$left" -ge "$budget" ] || budget=$((left > 30 ? left : 30))
        # -v: each test's name and outcome as it ends, so a run the budget cuts short still
        # says which tests passed (2026-12-06: two cut runs left only dots); the console
        # gets the outcome counts
        # shellcheck disable=SC2086  # pytest arguments, split on purpose
        timeout -k 5 "$budget" python3 -m pytest -v -p no:cacheprovider $GPU_PYTEST \
            ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"} > "$OUT/gpu_pytest.log" 2>&1
        echo "rc $? (124: cut at ${budget}s)" >> "$OUT/gpu_pytest.log"
        grep -cE " PASSED" "$OUT/gpu_pytest.log" | sed 's/^/passed: /'
        grep -E " (FAILED|ERROR)|^rc |passed|failed" "$OUT/gpu_pytest.log" | tail -8 ;;
    newkernels)
        log "GPU tests: spec accept (and its exact-match mode) + head GEMV, the fused sampler"
        timeout -k 5 "${NEWTESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/test_spec_accept.py \
            tests/plugins/test_spec_round.py tests/plugins/test_convnext.py tests/runtime/test_codec_engine_gpu.py \
            tests/plugins/test_prompt_embed.py tests/runtime/test_graph_engine.py \
            tests/plugins/test_gpu_kernels.py tests/runtime/test_cp_fused.py tests/runtime/test_cp_spec.py \
            -k "spec_accept or spec_round or round_books or verify_index or head_gemv or fused_sample or prefill_kernel_path or convnext or prompt_embed or exact" \
            > "$OUT/gpu_tests_new.log" 2>&1
        echo "new kernels' GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_new.log" | head -20 ;;
    spec)
        log "GPU tests: WHILE nodes (graph_while.cu), the speculative rounds as one"
        timeout -k 5 "${SPECTESTS_S:-200}" python3 -X faulthandler -m pytest -v -p no:cacheprovider \
            tests/runtime/test_graph_while.py > "$OUT/gpu_tests_while.log" 2>&1
        echo "WHILE tests rc=$?"; grep -E "PASSED|FAILED|ERROR|Fatal|Error:" "$OUT/gpu_tests_while.log" | head -20
        log "speculation on vs off, the rounds as a WHILE node vs every round run"
        SPEC_S=${SPEC_S:-330} BATCHES=${SPEC_BATCHES:-1,8} WINDOWS=${SPEC_WINDOWS:-3} bash benchmarks/spec/bench_spec.sh \
            | grep -vE "^\s*$" | tail -30 ;;
    specab)
        log "GPU tests: attention over several tokens, spec accept, WHILE nodes"
        timeout -k 5 "${SPECTESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/test_fused_kernels.py tests/plugins/test_spec_accept.py \
            tests/runtime/test_graph_while.py -k "tokens_kernel or spec_accept or graph_while or plan_runs or norm_linear_attend" \
            > "$OUT/gpu_tests_specab.log" 2>&1
        echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_specab.log" | head -12
        for side in serial parallel gemv; do
            left=$((DEADLINE_S - SECONDS))
            if [ "$left" -lt 60 ]; then log "skip $side: ${left}s left"; continue; fi
            log "bench_spec, side $side"
            ( if [ "$side" = serial ]; then export TTSBUILD_ATTEND_TOKENS_PARALLEL=0; else export TTSBUILD_ATTEND_TOKENS_PARALLEL=1; fi
              [ "$side" != gemv ] || export TTSBUILD_GEMV_FEW_ROWS=1
              mkdir -p "$OUT/spec_$side"
              OUT="$OUT/spec_$side" SPEC_S=$((left - 10 < 150 ? left - 10 : 150)) \
                  BATCHES=${SPECAB_BATCHES:-1,8} WINDOWS=${SPECAB_WINDOWS:-2,3,4} \
                  PROFILE=${SPECAB_PROFILE:-12} PATHS=fused bash benchmarks/spec/bench_spec.sh \
                  > "$OUT/bench_spec_$side.log" 2>&1
              grep -E "^ +[0-9]+ |while nodes|kernels, " "$OUT/bench_spec_$side.log" | head -30 )
        done ;;
    codectests)  # the codec kernels' GPU tests touched by the 1x1 conv tiles and the output window
        log "GPU tests: causal conv at >= 2048 rows (the 1x1 conv's tiles), the output stage (two-phase window)"
        timeout -k 5 "${CODECTESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/plugins/test_causal_conv.py \
            tests/plugins/test_codec_output.py -k "700 or window" 2>&1 \
            | tee "$OUT/gpu_tests_codec.log" | tail -2 ;;
    codec_env)
        IFS=';' read -ra codec_groups <<< "${CODEC_ENV:?CODEC_ENV names the switches}"
        for round in $(seq "${CODEC_ROUNDS:-2}"); do
            for i in $(seq 0 "${#codec_groups[@]}"); do
                group=""; label=served
                [ "$i" = 0 ] || { group=${codec_groups[$((i - 1))]}; label="env$i ($group)"; }
                left=$((DEADLINE_S - SECONDS))
                if [ "$left" -lt 45 ]; then log "skip round $round $label: ${left}s left"; continue; fi
                log "codec step round $round: $label"
                # shellcheck disable=SC2086  # the group's VAR=VALUE words, split on purpose
                env $group timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                    --batches "${CODEC_BATCHES:-1,64}" --conv-impls triton \
                    --rows "${CODEC_ROW:-triton+k+cl+o+s+a+l}" --fused-layers-max-rows 8 \
                    --profile-impls none 2>&1 | grep -v Assertion \
                    | tee "$OUT/profile_codec_r${round}_$i.log" | grep -E "^\| triton"
            done
        done ;;
    codecprof)
        for b in $(tr ',' ' ' <<< "${CODECPROF_BATCHES:-1,64}"); do
            left=$((DEADLINE_S - SECONDS))
            if [ "$left" -lt 60 ]; then log "skip the batch $b profile: ${left}s left"; continue; fi
            log "codec step profile, batch $b ${CODECPROF_ENV:-}"
            # shellcheck disable=SC2086  # VAR=VALUE words, split on purpose
            env ${CODECPROF_ENV:-} timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "$b" --conv-impls triton --rows "${CODEC_ROW:-triton+k+cl+o+s+a+l}" \
                --fused-layers-max-rows 8 --profile-impls "${CODEC_ROW:-triton+k+cl+o+s+a+l}" \
                --profile-batch "$b" --top 30 \
                --launches "${CODECPROF_LAUNCHES:-conv|nvjet|gemm|output|snake|overlap|cutlass}" \
                2>&1 | grep -v Assertion > "$OUT/codecprof_b$b.log"
            grep -E "^\| triton|kernels,|^launches" "$OUT/codecprof_b$b.log" | cut -c1-1500
        done ;;
    codec)
        log "GPU tests: causal conv, snake + context"
        timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/plugins/test_causal_conv.py \
            tests/plugins/test_codec_context.py tests/plugins/test_codec_output.py \
            tests/plugins/test_ring_attention.py 2>&1 | tee "$OUT/gpu_tests_codec.log" | tail -2
        # rows: channels-last operands alone, and the served codec (2026-12-02: + the output
        # stage as one kernel, fused attention, tails and spills along channels)
        local_rows=triton+k+cl,triton+k+cl+o+s+a
        log "codec step: $local_rows"
        timeout -k 5 300 python3 benchmarks/codec/profile_codec.py --batches "${CODEC_BATCHES:-1,64,256}" \
            --conv-impls triton --rows "$local_rows" --profile-impls triton+k+cl+o+s+a --top 12 \
            2>&1 | grep -v Assertion | tee "$OUT/profile_codec.log" | grep -E "^\| triton"
        if [ -n "${CODEC_PDL_AB:-}" ]; then
            log "codec step, served row, codec kernels with PDL (TTSBUILD_CODEC_PDL=1)"
            TTSBUILD_CODEC_PDL=1 timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "${CODEC_BATCHES:-1,64,256}" --conv-impls triton --rows triton+k+cl+o+s+a \
                --profile-impls none 2>&1 | grep -v Assertion | tee "$OUT/profile_codec_pdl.log" \
                | grep -E "^\| triton"
        fi
        if [ -n "${CODEC_RING_AB:-}" ]; then
            log "codec step, served row, fused attention reading its ring before the writes (TTSBUILD_RING_MERGE=1)"
            TTSBUILD_RING_MERGE=1 timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "${CODEC_BATCHES:-1,64,256}" --conv-impls triton --rows triton+k+cl+o+s+a \
                --profile-impls triton+k+cl+o+s+a --top 6 2>&1 | grep -v Assertion \
                | tee "$OUT/profile_codec_ring.log" | grep -E "^\| triton|ring_attention"
        fi
        if [ -n "${CODEC_LAYERS_AB:-}" ]; then
            log "codec step, served row + the pre-transformer as fused linears up to 16 frames (+l)"
            timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "${CODEC_LAYERS_BATCHES:-1,2,4,8,16}" --conv-impls triton \
                --rows triton+k+cl+o+s+a,triton+k+cl+o+s+a+l --profile-impls none 2>&1 \
                | grep -v Assertion | tee "$OUT/profile_codec_layers.log" | grep -E "^\| triton"
            log "codec step, +l with up to 16 fp32 rows as GEMVs (TTSBUILD_GEMV_ROWS_F32=16)"
            TTSBUILD_GEMV_ROWS_F32=16 timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "${CODEC_LAYERS_BATCHES:-1,2,4,8,16}" --conv-impls triton \
                --rows triton+k+cl+o+s+a+l --profile-impls none 2>&1 | grep -v Assertion \
                | tee "$OUT/profile_codec_layers_gemv.log" | grep -E "^\| triton"
        fi
        if [ -n "${CODEC_TILE_AB:-}" ]; then
            log "codec step, served row, the snake + context kernel's former 64 x 64 x 4-warp tile"
            TTSBUILD_SNAKE_CL_TILE=64,64,4 timeout -k 5 200 python3 benchmarks/codec/profile_codec.py \
                --batches "${CODEC_BATCHES:-1,64,256}" --conv-impls triton --rows triton+k+cl+o+s+a \
                --profile-impls none 2>&1 | grep -v Assertion | tee "$OUT/profile_codec_tile.log" \
                | grep -E "^\| triton"
        fi ;;
    sampler)
        log "GPU tests: the sampler's threshold searches"
        timeout -k 5 180 python3 -m pytest -q -p no:cacheprovider tests/plugins/test_references.py \
            -k "thresholds or topk_threshold" 2>&1 | tee "$OUT/gpu_tests_sampler.log" | tail -2
        log "fused sampler by warps per row and top-k search"
        timeout -k 5 150 python3 benchmarks/kernels/bench_sampler.py --warps 8,4,2,1 \
            --batches 1,64 2>&1 | tee "$OUT/bench_sampler.log" | grep -E "^\|" ;;
    chain)  # what one dependent kernel costs in a captured chain (bench_chain.py)
        log "dependent-launch chains: empty, hop, the code predictor's linears (bench_chain.py)"
        timeout -k 5 240 python3 -u benchmarks/kernels/bench_chain.py --out "$OUT/bench_chain.json" \
            > "$OUT/bench_chain.log" 2>&1
        echo "rc=$?"; tail -9 "$OUT/bench_chain.log" ;;
    megaframe)  # the code predictor's frame as one persistent kernel (prototype) beside the served one
        log "one-kernel code-predictor frame (bench_megaframe.py), then the served fused frame at batch 1"
        # MEGAFRAME_ARGS: e.g. --newest (only the newest options beside the served ones);
        # MEGAFRAME_EACH: NEWEST names, each in a process of its own (--newest --only NAME: a
        # fault in one, a context lost, leaves the others measured), e.g. "two-token+xreduce"
        # (the served options' instance beside FETCH's own and the generic one, and the served
        # instance with its weights unconverted, OPT_RAW) or "kv-ahead split-down" (the first
        # builds the extension, ~90 s; each after ~30-40 s)
        if [ -n "${MEGAFRAME_EACH:-}" ]; then
            : > "$OUT/megaframe.log"
            for name in $MEGAFRAME_EACH; do
                timeout -k 5 240 python3 -u benchmarks/kernels/megapass/bench_megaframe.py \
                    --newest --only "$name" >> "$OUT/megaframe.log" 2>&1
                echo "rc=$? ($name)"
            done
        else
            # shellcheck disable=SC2086
            timeout -k 5 300 python3 -u benchmarks/kernels/megapass/bench_megaframe.py \
                ${MEGAFRAME_ARGS:-} > "$OUT/megaframe.log" 2>&1
            echo "rc=$?"
        fi
        grep -E "check|^\|" "$OUT/megaframe.log" | cut -c1-220
        timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_megaframe_gpu.py \
            > "$OUT/megaframe_gpu_tests.log" 2>&1
        echo "rc=$? (test_megaframe_gpu.py: the package's wrapper, eager and in a graph)"
        tail -3 "$OUT/megaframe_gpu_tests.log"
        timeout -k 5 150 python3 -u benchmarks/kernels/bench_cp_fused.py --batches 1 \
            --precisions fp8 --paths fused --fp32-batches "" > "$OUT/cp_fused_b1.log" 2>&1
        echo "rc=$?"; tail -4 "$OUT/cp_fused_b1.log" ;;
    cpkern)
        log "the code predictor's linears at 64-256 rows: weight-only FP8 against the bf16 copies (cp_many_rows.py)"
        t0=$SECONDS
        timeout -k 5 150 python3 -u benchmarks/kernels/cp_many_rows.py > "$OUT/cp_many_rows.log" 2>&1
        echo "rc=$? ($((SECONDS - t0)) s, cold)"; grep "a frame" "$OUT/cp_many_rows.log"
        TTSBUILD_FP8_TUNE_BY_ROWS=1 timeout -k 5 100 python3 -u benchmarks/kernels/cp_many_rows.py \
            > "$OUT/cp_many_rows_by_rows.log" 2>&1
        echo "rc=$?"; grep "a frame" "$OUT/cp_many_rows_by_rows.log"
        TTSBUILD_FP8_TUNE_BY_ROWS=1 TTSBUILD_FP8_WO_MAX_BLOCK_M=128 timeout -k 5 120 python3 -u \
            benchmarks/kernels/cp_many_rows.py --ms 128,256 > "$OUT/cp_many_rows_wo128.log" 2>&1
        echo "rc=$?"; grep "a frame" "$OUT/cp_many_rows_wo128.log"
        python3 benchmarks/runtime/strip_triton_cache.py "$TRITON_CACHE_DIR"
        t0=$SECONDS
        timeout -k 5 100 python3 -u benchmarks/kernels/cp_many_rows.py --tag stripped \
            > "$OUT/cp_many_rows_stripped.log" 2>&1
        echo "rc=$? ($((SECONDS - t0)) s on the stripped cache)"; grep "a frame" "$OUT/cp_many_rows_stripped.log" ;;
    kvattn)  # the talker's decode attention and cache write, bf16 cache against FP8
        log "decode attention on a bf16 against an FP8 talker cache (kv_fp8_attention.py)"
        timeout -k 5 "${KVATTN_S:-150}" python3 -u benchmarks/kernels/kv_fp8_attention.py \
            ${KVATTN_ARGS:-} > "$OUT/kv_fp8_attention.log" 2>&1
        echo "rc=$?"; tail -"${KVATTN_TAIL:-12}" "$OUT/kv_fp8_attention.log" ;;
    megatalker)  # the talker's decode step at batch 1 as one persistent kernel (prototype)
        log "one-kernel talker step (bench_talker_step.py): checks, then ms per step beside the served step"
        # MEGATALKER_ARGS: e.g. --dists 1,2 --positions 600 (the extension builds in ~1 min)
        # shellcheck disable=SC2086
        timeout -k 5 "${MEGATALKER_S:-300}" python3 -u benchmarks/kernels/megatalker/bench_talker_step.py \
            ${MEGATALKER_ARGS:-} > "$OUT/megatalker.log" 2>&1
        echo "rc=$?"; grep -vE "^\s*$" "$OUT/megatalker.log" | tail -14 | cut -c1-240
        timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_talker_megastep_gpu.py \
            > "$OUT/megatalker_gpu_tests.log" 2>&1
        echo "rc=$? (test_talker_megastep_gpu.py)"; tail -3 "$OUT/megatalker_gpu_tests.log" ;;
    megaengine)  # plan.megaframe_code_predictor in the engine, beside the same plan without it
        # (both: FP8 code predictor, no SMs reserved for the lane: the kernel needs them all);
        # the engine steps through the C++ step driver, so it is built here when not carried
        ensure_driver "$OUT/build.log" || exit 1
        # $MEGAENGINE_SIDES: which sides, in order (default "cpfp8 megaframe", plus
        # megaframe_extra where $MEGAENGINE_EXTRA, option bits, is set: the kernel with them
        # beside the served ones, through TTSBUILD_MEGAFRAME_EXTRA, in place of the engine's
        # default extras, cp_megaframe.ENGINE_EXTRA); megaframe: the kernel with the engine's
        # defaults; megaframe_lane: the kernel on the admission lane's first frames only (plan
        # megaframe_regular off; $MEGAENGINE_EXTRA's options, else the defaults);
        # megaframe_lane0: the same with the served options alone (EXTRA 0), for a
        # side-by-side of the extras; megaframe512 / megaframe_lane512: those two with the
        # kernel's 512-thread build (TTSBUILD_MEGAFRAME_THREADS=512)
        mega="--plan-set code_predictor_fp8=true --lane-reserved-sms 0 --plan-set megaframe_code_predictor=true"
        declare -A side_of=(
            [cpfp8]="cpfp8|0|--plan-set code_predictor_fp8=true --lane-reserved-sms 0"
            [megaframe]="megaframe||$mega"
            [megaframe_lane]="megaframe_lane|${MEGAENGINE_EXTRA:-}|$mega --plan-set megaframe_regular=false"
            [megaframe_lane0]="megaframe_lane0|0|$mega --plan-set megaframe_regular=false"
            [megaframe_extra]="megaframe_extra|${MEGAENGINE_EXTRA:-}|$mega"
            [megaframe_lane512]="megaframe_lane512|${MEGAENGINE_EXTRA:-}|$mega --plan-set megaframe_regular=false|512"
            [megaframe512]="megaframe512||$mega|512")
        names=${MEGAENGINE_SIDES:-cpfp8 megaframe${MEGAENGINE_EXTRA:+ megaframe_extra}}
        sides=()
        for n in $names; do
            [ -n "${side_of[$n]:-}" ] || { log "unknown megaengine side $n"; continue; }
            sides+=("${side_of[$n]}")
        done
        for side in "${sides[@]}"; do
            IFS='|' read -r name extra flags threads <<<"$side"
            left=$((DEADLINE_S - SECONDS))
            if [ "$left" -lt 130 ]; then log "skip $name: ${left}s left"; continue; fi
            log "engine microbenchmark: $name ($flags; TTSBUILD_MEGAFRAME_EXTRA=$extra, threads ${threads:-256})"
            # shellcheck disable=SC2086
            TTSBUILD_MEGAFRAME_EXTRA=$extra TTSBUILD_MEGAFRAME_THREADS=${threads:-256} \
                engine_bench "$name" $flags
        done ;;
    mfprofile)  # Nsight Compute on one frame of the one-kernel code predictor: stalls by line
        # $MFPROFILE_VARIANTS: profile_megaframe.py variants (default "served race"), one
        # report each; the text exports come back (details, and the SASS with its stall samples)
        for v in ${MFPROFILE_VARIANTS:-served race}; do
            log "ncu: one frame of the one-kernel code predictor, variant $v"
            TTSBUILD_MEGAFRAME_LINEINFO=1 timeout -k 5 300 ncu --clock-control none \
                -k regex:cp_megaframe_kernel --launch-skip 3 --launch-count 1 --set full \
                --import-source yes -f -o "$OUT/mf_$v" python3 -u \
                benchmarks/kernels/megapass/profile_megaframe.py --variant "$v" \
                > "$OUT/mf_$v.log" 2>&1
            echo "rc=$? ($v)"; grep -E "check|launches|==ERR|==WARN" "$OUT/mf_$v.log" | cut -c1-200
            [ -f "$OUT/mf_$v.ncu-rep" ] || continue
            ncu -i "$OUT/mf_$v.ncu-rep" --page details > "$OUT/mf_${v}_details.txt" 2>&1
            ncu -i "$OUT/mf_$v.ncu-rep" --page source --csv --print-source sass \
                > "$OUT/mf_${v}_sass.csv" 2> "$OUT/mf_${v}_sass.err" \
                || ncu -i "$OUT/mf_$v.ncu-rep" --page source --csv > "$OUT/mf_${v}_sass.csv" 2>&1
            grep -E "Duration|Stall|Warp Cycles|Issued Ipc|Memory Throughput|DRAM Throughput" \
                "$OUT/mf_${v}_details.txt" | head -30
            wc -c "$OUT/mf_${v}_sass.csv"
        done ;;
    codecncu)  # Nsight Compute on codec kernels of one served codec step (profile_codec.py)
        # $CODECNCU_KERNEL: a kernel-name regex (default _codec_output: 156 us at 64 rows on the
        # H200 for ~24 MB of input, as long taps first as with 7 SnakeBetas an input,
        # 2026-12-06); $CODECNCU_BATCH rows (default 64); the first matching launch of one
        # eager step of the served row inside the NVTX range codec_step (profile_codec.py
        # --nvtx-step; a launch count alone caught the SNR decode's launches, 2026-12-06)
        log "ncu: ${CODECNCU_KERNEL:-_codec_output} in the codec step at ${CODECNCU_BATCH:-64} rows"
        timeout -k 5 300 ncu --clock-control none -k "regex:${CODECNCU_KERNEL:-_codec_output}" \
            --nvtx --nvtx-include "codec_step/" --launch-count 1 --set full -f \
            -o "$OUT/codec_ncu" python3 -u benchmarks/codec/profile_codec.py \
            --batches "${CODECNCU_BATCH:-64}" --conv-impls triton \
            --rows "${CODEC_ROW:-triton+k+cl+o+s+a+l}" --fused-layers-max-rows 8 \
            --profile-impls none --nvtx-step --profile-batch "${CODECNCU_BATCH:-64}" \
            > "$OUT/codec_ncu.log" 2>&1
        echo "rc=$?"; grep -E "==ERR|==WARN|^\| triton" "$OUT/codec_ncu.log" | cut -c1-200
        if [ -f "$OUT/codec_ncu.ncu-rep" ]; then
            ncu -i "$OUT/codec_ncu.ncu-rep" --page details > "$OUT/codec_ncu_details.txt" 2>&1
            grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|Issued Ipc|Local|Stall" \
                "$OUT/codec_ncu_details.txt" | head -30
        fi ;;
    streamprobe)  # how fast one CTA an SM streams HBM into shared memory (the megaframe's fetch)
        log "HBM -> shared memory stream probe (bench_stream_probe.py)"
        timeout -k 5 200 python3 -u benchmarks/kernels/megapass/bench_stream_probe.py \
            > "$OUT/stream_probe.log" 2>&1
        echo "rc=$?"; grep -E "^\||GB/s" "$OUT/stream_probe.log" | cut -c1-160 ;;
    profile)  # where the captured steps' time goes, each kernel's own time (PDL off)
        log "profile of the captured steps (profile_graphs.py, TTSBUILD_PDL=0), batches ${PROFILE_BATCHES:-1,64}"
        TTSBUILD_PDL=0 timeout -k 5 300 python3 -u benchmarks/kernels/profile_graphs.py \
            --batches "${PROFILE_BATCHES:-1,64}" --top "${PROFILE_TOP:-25}" \
            > "$OUT/profile_pdl0.log" 2>&1
        echo "rc=$?"; grep -vE "^  " "$OUT/profile_pdl0.log" | tail -12 ;;
    convsweep)
        log "codec conv tiles: the served config against a grid, per stage shape, batches ${CONV_BATCHES:-64,256}"
        timeout -k 5 420 python3 benchmarks/codec/sweep_conv.py --batches "${CONV_BATCHES:-64,256}" \
            ${CONV_SWEEP_ARGS:---quick} --kinds "${CONV_KINDS:-k7,1x1s}" 2>&1 | grep -v Assertion \
            | tee "$OUT/sweep_conv.log" \
            | grep -E "^\| [0-9]" ;;
    sweep)
        left=$((DEADLINE_S - SECONDS))
        log "serving sweep at ${SWEEP_RPS:-1,10,20,30,40} req/s: serve ${SWEEP_ARGS:-} (${left}s left)"
        RESULTS=$OUT/sweep SERVE_ARGS="${SWEEP_ARGS:-}" PY=python3 SLOTS=${SLOTS-} PRECISION=fp8 \
            IN_MEMORY=1 DATASETS="${SWEEP_DATASETS:-voice-agent}" RPS=${SWEEP_RPS:-1,10,20,30,40} DURATION=60s \
            WARMUP=2s timeout -k 5 $((left - 10)) bash benchmarks/serve_sweep.sh \
            > "$OUT/sweep.log" 2>&1
        grep -E "^│|capacity" "$OUT/sweep.log" | tail -7 ;;
    ab)
        for side in ${AB_SIDES:-A B}; do
            args=AB_$side; args=${!args:-}
            rps=AB_RPS_$side; rps=${!rps:-${AB_RPS:-10}}  # a side's own rates, if given
            left=$((DEADLINE_S - SECONDS))
            if [ "$left" -lt 100 ]; then log "skip side $side: ${left}s left"; continue; fi
            log "serving at $rps req/s, side $side: serve $args (${left}s left)"
            RESULTS=$OUT/ab_$side SERVE_ARGS="$args" PY=python3 SLOTS=${SLOTS-} \
                PRECISION=fp8 IN_MEMORY=1 DATASETS=voice-agent RPS=$rps \
                DURATION=${AB_DURATION:-30s} WARMUP=1s timeout -k 5 $((left - 10)) \
                bash benchmarks/serve_sweep.sh > "$OUT/ab_$side.log" 2>&1
            grep -E "^│|capacity" "$OUT/ab_$side.log" | tail -3
        done ;;
    overload)
        for side in ${OVERLOAD_SIDES:-A}; do
            args=OVERLOAD_$side; args=${!args:-}
            left=$((DEADLINE_S - SECONDS))
            if [ "$left" -lt 150 ]; then log "skip overload side $side: ${left}s left"; continue; fi
            log "overload at ${OVERLOAD_RPS:-200} req/s, side $side: serve $args (${left}s left)"
            OUT=$OUT/overload_$side RATE=${OVERLOAD_RPS:-200} SLOTS=${SLOTS-} SERVE_ARGS="$args" \
                DURATION=${OVERLOAD_DURATION:-60s} WARMUP=2s PY=python3 timeout -k 5 $((left - 10)) \
                bash benchmarks/serve/overload.sh > "$OUT/overload_$side.log" 2>&1
            grep -E "^\| |refusals by reason" "$OUT/overload_$side.log" | tail -3
        done ;;
    esac
done
if [ "${TC_SAVE:-0}" = 1 ] && [ -d "$TRITON_CACHE_DIR" ]; then
    # the Triton cache to carry next time: copy it into .tc/ (git-ignored) as tc.tgz, stripped
    # to what a cache hit loads (strip_triton_cache.py: each kernel's metadata and binary)
    python3 benchmarks/runtime/strip_triton_cache.py "$TRITON_CACHE_DIR" || log "strip failed"
    tar czf "$OUT/tc.tgz" -C "$TRITON_CACHE_DIR" . && log "Triton cache -> tc.tgz ($(du -h \
        "$OUT/tc.tgz" | cut -f1)): put it in .tc/ and carry .tc"
fi
if [ "${TC_SAVE:-0}" = 1 ] && [ -n "$(ls -A "$TORCH_EXTENSIONS_DIR" 2>/dev/null)" ]; then
    # the torch extensions built here (the megaframe kernel's), with their sources' sha256
    tar czf "$OUT/tx.tgz" -C "$TORCH_EXTENSIONS_DIR" . && sha256sum ttsbuild/csrc/* > "$OUT/tx.sha" \
        && log "torch extensions -> tx.tgz ($(du -h "$OUT/tx.tgz" | cut -f1)) and tx.sha: put both in .tc/"
fi
log done
