#!/usr/bin/env bash
# Latency-vs-rate sweep of `ttsbuild serve` on a stand-in 1.7B CustomVoice checkpoint (GPU host).
#
#   benchmarks/serve_sweep.sh                 # writes $OUT/serve_sweep/ (OUT defaults to out)
#   PROFILE=balanced SLOTS=64 RPS=1,4,8 DURATION=60s benchmarks/serve_sweep.sh
#   IN_MEMORY=1 benchmarks/serve_sweep.sh     # serve --random VARIANT: no 4 GB files to write
#
# Steps: init-random + convert (cached in $WORK), serve on a free port, wait for /ready,
# `ttsbuild bench sweep` rotating over the server's voices, print the table, stop the server.
set -euo pipefail

if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
IN_MEMORY=${IN_MEMORY:-0}
OUT=${OUT:-out}
WORK=${WORK:-$OUT/serve_sweep_work}
VARIANT=${VARIANT:-1.7b-customvoice}
PROFILE=${PROFILE:-low-latency}
SLOTS=${SLOTS:-32}
RPS=${RPS:-1,4,8,10,20,40}
DURATION=${DURATION:-30s}
WARMUP=${WARMUP:-5s}
DEVICE=${DEVICE:-cuda}
RESULTS=$OUT/serve_sweep
mkdir -p "$WORK" "$RESULTS"

cli() { "$PY" -m ttsbuild.cli "$@"; }
# GET a URL to stdout, failing on non-2xx (no curl needed on bare GPU images).
get() { "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }

if [ "$IN_MEMORY" = 1 ]; then
    MODEL_ARGS=(--random "$VARIANT")
elif [ ! -f "$WORK/ckpt/manifest.json" ]; then
    echo "== writing the stand-in checkpoint ($VARIANT) to $WORK"
    cli init-random "$WORK/src" --variant "$VARIANT" --force
    cli convert "$WORK/src" --output "$WORK/ckpt" --force
fi
[ "$IN_MEMORY" = 1 ] || MODEL_ARGS=("$WORK/ckpt")

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
if cli --help | grep -q ' serve '; then
    SERVE=(cli serve)
else  # until `serve` is registered on the main app
    SERVE=("$PY" -c 'import typer; from ttsbuild.serve.cli import serve; typer.run(serve)')
fi
echo "== serving on $URL (profile $PROFILE, $SLOTS slots, $DEVICE); log: $RESULTS/server.log"
"${SERVE[@]}" "${MODEL_ARGS[@]}" --port "$PORT" --profile "$PROFILE" --slots "$SLOTS" \
    --device "$DEVICE" --max-queue 256 --log-level warning >"$RESULTS/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 1 600); do
    if get "$URL/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server exited:"; cat "$RESULTS/server.log"; exit 1; fi
    sleep 1
done
get "$URL/ready" >/dev/null 2>&1 || { echo "server not ready after 600 s"; exit 1; }

VOICES=$(get "$URL/v1/voices" | "$PY" -c \
    'import json, sys; print(" ".join(f"--voice {v}" for v in json.load(sys.stdin)["voices"][:4]))')
echo "== sweep: rps $RPS, $DURATION each after $WARMUP warm-up ($VOICES)"
# shellcheck disable=SC2086
cli bench sweep --url "$URL" --rps "$RPS" --duration "$DURATION" --warmup "$WARMUP" \
    $VOICES --output "$RESULTS"
get "$URL/metrics" >"$RESULTS/server_metrics.txt"
echo "== results in $RESULTS (sweep.json, plots, server.log, server_metrics.txt)"
