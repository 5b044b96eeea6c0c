#!/usr/bin/env bash
# Cost of the stopping guards on the GPU: the frame graph (talker + code predictor + the
# repetition detector + stop codes) and the 1-frame codec graph (+ the silence detector),
# guards off and on side by side in one process, bf16 and fp8, at several batch sizes.
#
#   benchmarks/guards_bench.sh                    # prints the table, writes $OUT/guard_bench.json
#   VARIANT=0.6b-customvoice BATCHES=1,8 benchmarks/guards_bench.sh
set -euo pipefail

if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
OUT=${OUT:-out}
VARIANT=${VARIANT:-1.7b-customvoice}
BATCHES=${BATCHES:-1,8,32,64}
ITERS=${ITERS:-100}
"$PY" -m ttsbuild.bench.engine_bench --compare-guards --variant "$VARIANT" \
    --batches "$BATCHES" --iters "$ITERS" --out "$OUT"
