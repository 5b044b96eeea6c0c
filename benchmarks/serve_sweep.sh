#!/usr/bin/env bash
# Latency-vs-rate sweeps of `ttsbuild serve` on a stand-in 1.7B CustomVoice checkpoint (GPU
# host), one per prompt set, >= 60 s per rate, the server's /metrics saved after each rate.
#
#   benchmarks/serve_sweep.sh                       # both prompt sets -> $OUT/serve_sweep/
#   DATASETS=voice-agent RPS=1,10,20,40 benchmarks/serve_sweep.sh     # one set, some rates
#   PRECISION=fp8 SLOTS=64 IN_MEMORY=1 benchmarks/serve_sweep.sh      # no 4 GB files written
#
# Steps: init-random + convert (cached in $WORK), serve on a free port, wait for /ready, then
# per prompt set `ttsbuild bench sweep --dataset SET --metrics-url auto` rotating over the
# server's voices, which prints the table and the capacity (the highest rate with p95
# audible TTFA <= 100 ms, no underrun, no failure) and writes
#   $OUT/serve_sweep/SET/sweep.json, rps-R/{summary.json,requests.jsonl,server_metrics.txt},
#   server_metrics_start.txt, the plots; and $OUT/serve_sweep/server.log.
# Time: (warm-up + duration) per rate per set, e.g. 8 rates x 65 s x 2 sets = 17 min; where
# one command may run at most 10 minutes, run one set (DATASETS=...) or fewer rates per call.
set -euo pipefail

if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
source benchmarks/wheels.sh
IN_MEMORY=${IN_MEMORY:-0}
OUT=${OUT:-out}
WORK=${WORK:-$OUT/serve_sweep_work}
VARIANT=${VARIANT:-1.7b-customvoice}
PROFILE=${PROFILE:-low-latency}
SLOTS=${SLOTS-}  # empty: `serve`'s own default (a GPU: 256, fewer where they do not fit)
PRECISION=${PRECISION:-}  # bf16 or fp8 (default: the engine's own)
DATASETS=${DATASETS:-voice-agent harvard}
RPS=${RPS:-1,10,20,40,70,100,140,200}
DURATION=${DURATION:-60s}
WARMUP=${WARMUP:-5s}
DEVICE=${DEVICE:-cuda}
RESULTS=${RESULTS:-$OUT/serve_sweep}
SERVE_ARGS=${SERVE_ARGS:-}  # more `ttsbuild serve` flags, e.g. "--capacity-margin 0.3"
BENCH_ARGS=${BENCH_ARGS:-}  # more `ttsbuild bench sweep` flags, e.g. "--workers 4" or "--http-client httpx"
mkdir -p "$WORK" "$RESULTS"

cli() { "$PY" -m ttsbuild.cli "$@"; }
# GET a URL to stdout, failing on non-2xx (no curl needed on bare GPU images).
get() { "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }

secs=$("$PY" -c 'import sys; from ttsbuild.bench.units import parse_duration as p; print(p(sys.argv[1]))' "$DURATION")
if "$PY" -c 'import sys; sys.exit(float(sys.argv[1]) >= 60)' "$secs"; then
    echo "note: DURATION=$DURATION is under 60 s per rate: fine for a try, not for a capacity figure"
fi

if [ "$IN_MEMORY" = 1 ]; then
    MODEL_ARGS=(--random "$VARIANT")
elif [ ! -f "$WORK/ckpt/manifest.json" ]; then
    echo "== writing the stand-in checkpoint ($VARIANT) to $WORK"
    cli init-random "$WORK/src" --variant "$VARIANT" --force
    cli convert "$WORK/src" --output "$WORK/ckpt" --force
fi
[ "$IN_MEMORY" = 1 ] || MODEL_ARGS=("$WORK/ckpt")
[ -z "$PRECISION" ] || MODEL_ARGS+=(--precision "$PRECISION")

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
echo "== serving on $URL (profile $PROFILE, ${SLOTS:-default} slots, $DEVICE); log: $RESULTS/server.log"
# started directly, not through cli(): `$!` of a backgrounded shell function is the subshell,
# and killing it left the server running (2026-12-02: each A/B side's server stayed up, the
# next side's ran out of GPU memory)
"$PY" -m ttsbuild.cli serve "${MODEL_ARGS[@]}" --port "$PORT" --profile "$PROFILE" ${SLOTS:+--slots "$SLOTS"} \
    --device "$DEVICE" --max-queue 256 --log-level warning $SERVE_ARGS >"$RESULTS/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 1 600); do
    if get "$URL/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server exited:"; cat "$RESULTS/server.log"; exit 1; fi
    sleep 1
done
get "$URL/ready" >/dev/null 2>&1 || { echo "server not ready after 600 s"; exit 1; }

VOICES=$(get "$URL/v1/voices" | "$PY" -c \
    'import json, sys; print(" ".join(f"--voice {v}" for v in [x["id"] if isinstance(x, dict) else x for x in json.load(sys.stdin)["voices"]][:4]))')
for SET in $DATASETS; do
    echo "== $SET: rps $RPS, $DURATION each after $WARMUP warm-up ($VOICES)"
    # shellcheck disable=SC2086
    cli bench sweep --url "$URL" --dataset "$SET" --rps "$RPS" --duration "$DURATION" \
        --warmup "$WARMUP" $VOICES --metrics-url auto --output "$RESULTS/$SET" $BENCH_ARGS
done
for SET in $DATASETS; do
    "$PY" -c 'import json, sys; from ttsbuild.bench.sweep import capacity_line
print(sys.argv[2] + ": " + capacity_line(json.load(open(sys.argv[1]))))' "$RESULTS/$SET/sweep.json" "$SET"
done
for SET in $DATASETS; do  # where first chunks' time went, per rate (the server's /metrics)
    # in rate order (the path's other dashes, e.g. voice-agent, defeat `sort -t-`: the
    # metrics are cumulative, and 100 sorted before 60 gave negative counts, 2026-12-02)
    rates=$(ls -d "$RESULTS/$SET"/rps-* 2>/dev/null | sed 's/.*rps-\(.*\)$/\1 &/' | sort -g \
        | cut -d' ' -f2-)
    # shellcheck disable=SC2086
    start=()
    [ ! -f "$RESULTS/$SET/server_metrics_start.txt" ] || start=(--start "$RESULTS/$SET/server_metrics_start.txt")
    [ -z "$rates" ] || "$PY" benchmarks/serve/first_audio_phases.py "${start[@]}" \
        $(for r in $rates; do echo "$r/server_metrics.txt"; done) | tee "$RESULTS/$SET/phases.txt"
done
# one file to bring back from a device host (it returns few files, two folders deep)
tar czf "$RESULTS.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
echo "== results in $RESULTS/<set>/ (sweep.json, rps-R/server_metrics.txt, plots, phases.txt),"
echo "   $RESULTS/server.log, all of it in $RESULTS.tgz"
