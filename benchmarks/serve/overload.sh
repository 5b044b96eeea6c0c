#!/usr/bin/env bash
# Issue 12, deliverable 3: `ttsbuild serve` at twice its measured capacity. Excess requests
# must get 429 at once; admitted streams must keep 0 underruns, 0 failures and p95 audible
# TTFA <= 100 ms. On the GPU host (repo root), in about 2.5 minutes:
#
#   RATE=200 OUT=out bash benchmarks/serve/overload.sh        # RATE = 2 x the measured capacity
#   CAPACITY=100 bash benchmarks/serve/overload.sh            # the same: RATE = 2 x CAPACITY
#
# Serves in-memory random weights of the 1.7B CustomVoice shapes (FP8, 128 slots as `serve` on a
# GPU, low-latency profile), waits for /ready, runs one open-loop `ttsbuild bench run` of
# voice-agent prompts (Poisson, DURATION after WARMUP), saves /metrics, then prints the 429s by
# reason and, among admitted requests, failures, timeouts, underruns and the p95 audible TTFA
# (nearest rank).
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
SLOTS=${SLOTS:-128}
PROFILE=${PROFILE:-low-latency}
DURATION=${DURATION:-60s}
WARMUP=${WARMUP:-5s}
SLO_TTFA_S=${SLO_TTFA_S:-0.1}
RESULTS=$OUT/overload
mkdir -p "$RESULTS"

cli() { "$PY" -m ttsbuild.cli "$@"; }
get() { "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
echo "== $(date -u +%T) serving $VARIANT ($PRECISION, $SLOTS slots, $PROFILE) on $URL"
"$PY" -m ttsbuild.cli serve --random "$VARIANT" --precision "$PRECISION" --port "$PORT" --profile "$PROFILE" \
    --slots "$SLOTS" --device cuda --max-queue 256 --log-level warning >"$RESULTS/server.log" 2>&1 &
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
    --dataset voice-agent $VOICES --request-timeout 30s --output "$RESULTS/run" | tail -3
get "$URL/metrics" >"$RESULTS/server_metrics.txt" || echo "(no /metrics)"

"$PY" - "$RESULTS" "$RATE" "$SLO_TTFA_S" <<'EOF'
import json, math, sys
from collections import Counter
from pathlib import Path

results, rate, slo = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
records = [json.loads(line) for line in (results / "run/requests.jsonl").open()]
measured = [r for r in records if not r["warmup"]]
rejected = [r for r in measured if r["outcome"] == "rejected"]
admitted = [r for r in measured if r["outcome"] != "rejected"]
outcomes = Counter(r["outcome"] for r in admitted)


def reason(r):
    error = r.get("error") or ""
    for key in ("stayed at capacity", "behind their playback", "at capacity", "no engine slot",
                "queued", "unsent"):
        if key in error:
            return f"{r['http_status']} {key}"
    return f"{r['http_status']} other"


ttfa = sorted(r["ttfa_s"] for r in admitted if r["ttfa_s"] is not None)
p95 = ttfa[math.ceil(0.95 * len(ttfa)) - 1] if ttfa else None
underrun_requests = sum(1 for r in admitted if (r["underruns"] or 0) > 0)
summary = {
    "rate": rate,
    "sent": len(measured),
    "rejected": len(rejected),
    "rejected_by_reason": dict(Counter(reason(r) for r in rejected)),
    "admitted": len(admitted),
    "admitted_outcomes": dict(outcomes),
    "admitted_underrun_requests": underrun_requests,
    "admitted_underruns": sum(r["underruns"] or 0 for r in admitted),
    "admitted_ttfa_p95_s": p95,
    "admitted_ttfa_p50_s": ttfa[math.ceil(0.5 * len(ttfa)) - 1] if ttfa else None,
}
summary["meets_target"] = bool(
    admitted and outcomes.get("failed", 0) == 0 and outcomes.get("timeout", 0) == 0
    and underrun_requests == 0 and p95 is not None and p95 <= slo
)
(results / "overload.json").write_text(json.dumps(summary, indent=1))
fmt = lambda s: "-" if s is None else f"{1e3 * s:.1f} ms"  # noqa: E731
print(f"\n| offered | sent | 429/503 | admitted | ok | failed | timed out | underrun requests "
      f"| TTFA p50 | TTFA p95 | target met |\n|---|---|---|---|---|---|---|---|---|---|---|")
print(f"| {rate:g} req/s | {len(measured)} | {len(rejected)} | {len(admitted)} | "
      f"{outcomes.get('ok', 0)} | {outcomes.get('failed', 0)} | {outcomes.get('timeout', 0)} | "
      f"{underrun_requests} | {fmt(summary['admitted_ttfa_p50_s'])} | {fmt(p95)} | "
      f"{'yes' if summary['meets_target'] else 'NO'} |")
print("refusals by reason:", summary["rejected_by_reason"] or "none")
print(f"wrote {results / 'overload.json'}")
EOF
