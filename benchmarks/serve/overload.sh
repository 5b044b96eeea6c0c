#!/usr/bin/env bash
# Issue 12, deliverable 3: `ttsbuild serve` at twice its measured capacity. Excess requests
# must get 429 at once; admitted streams must keep 0 underruns, 0 failures and p95 audible
# TTFA <= 100 ms. On the GPU host (repo root), in about 2.5 minutes:
#
#   RATE=200 OUT=out bash benchmarks/serve/overload.sh        # RATE = 2 x the measured capacity
#   CAPACITY=100 bash benchmarks/serve/overload.sh            # the same: RATE = 2 x CAPACITY
#
# Serves in-memory random weights of the 1.7B CustomVoice shapes (FP8, 256 slots as `serve` on a
# GPU, low-latency profile), waits for /ready, runs one open-loop `ttsbuild bench run` of
# voice-agent prompts (Poisson, DURATION after WARMUP), saves /metrics, then prints the 429s by
# reason and, among admitted requests, failures, timeouts, underruns and the p95 audible TTFA
# (nearest rank), and how fast the refusals were answered (benchmarks/serve/overload_summary.py).
# SERVE_ARGS adds `serve` flags (e.g. the behaviour before the standing queue:
# "--queue-long-waits --standing-queue 1e9 --overload-slack 0").
# Writes $OUT/overload/{run/,server.log,server_metrics.txt,overload.json}.
set -euo pipefail

if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
source benchmarks/wheels.sh
ensure_driver || exit 1
CAPACITY=${CAPACITY:-}
RATE=${RATE:-}
if [ -z "$RATE" ]; then
    [ -n "$CAPACITY" ] || { echo "set RATE (2 x capacity) or CAPACITY"; exit 2; }
    RATE=$("$PY" -c 'import sys; print(2 * float(sys.argv[1]))' "$CAPACITY")
fi
OUT=${OUT:-out}
VARIANT=${VARIANT:-1.7b-customvoice}
PRECISION=${PRECISION:-fp8}
SLOTS=${SLOTS-}  # empty: `serve`'s own default
PROFILE=${PROFILE:-low-latency}
DURATION=${DURATION:-60s}
WARMUP=${WARMUP:-5s}
SLO_TTFA_S=${SLO_TTFA_S:-0.1}
BENCH_ARGS=${BENCH_ARGS:-}  # more `ttsbuild bench run` flags, e.g. "--workers 4"
RESULTS=$OUT/overload
mkdir -p "$RESULTS"

cli() { "$PY" -m ttsbuild.cli "$@"; }
get() { "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
echo "== $(date -u +%T) serving $VARIANT ($PRECISION, ${SLOTS:-default} slots, $PROFILE) on $URL"
"$PY" -m ttsbuild.cli serve --random "$VARIANT" --precision "$PRECISION" --port "$PORT" --profile "$PROFILE" \
    ${SLOTS:+--slots "$SLOTS"} --device cuda --max-queue 256 --log-level warning ${SERVE_ARGS:-} \
    >"$RESULTS/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do
    if get "$URL/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server exited:"; tail -30 "$RESULTS/server.log"; exit 1; fi
    sleep 1
done
get "$URL/ready" >/dev/null 2>&1 || { echo "server not ready after 150 s"; tail -30 "$RESULTS/server.log"; exit 1; }

VOICES=$(get "$URL/v1/voices" | "$PY" -c \
    'import json, sys; print(" ".join(f"--voice {v}" for v in [x["id"] if isinstance(x, dict) else x for x in json.load(sys.stdin)["voices"]][:4]))')
echo "== $(date -u +%T) $RATE req/s of voice-agent prompts for $DURATION after $WARMUP warm-up"
# shellcheck disable=SC2086
cli bench run --url "$URL" --rps "$RATE" --duration "$DURATION" --warmup "$WARMUP" \
    --dataset voice-agent $VOICES --request-timeout 30s --output "$RESULTS/run" $BENCH_ARGS | tail -3
get "$URL/metrics" >"$RESULTS/server_metrics.txt" || echo "(no /metrics)"

"$PY" benchmarks/serve/overload_summary.py "$RESULTS/run" --rate "$RATE" --slo-ttfa "$SLO_TTFA_S" \
    --out "$RESULTS/overload.json"
