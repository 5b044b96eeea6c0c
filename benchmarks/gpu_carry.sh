#!/usr/bin/env bash
# What a device call carries beside the tree, made and sized in one step (repo root):
#   bash benchmarks/gpu_carry.sh          # .whl as the engine and the server need it, then sizes
#   bash benchmarks/gpu_carry.sh --sizes  # sizes only
# .whl: the shared tool's wheels plus the serving stack's (../shared/tools/gpu-wheels.sh), less
# what the image has or no device call imports: the calibration-only wheels (nvidia_modelopt,
# pulp, omegaconf: 18 MB) and aiohttp with its dependencies (on the image), kept aside in
# $WHL_ASIDE (default /tmp/whl-aside). Then the carry's sizes against the device's 64 MiB: the
# tree (tracked and untracked files git does not ignore), .whl, the driver build
# (ttsbuild/_driver.cpython-312-*.so; gpu_session.sh brings it back stripped, ~0.4 MB) and .tc
# (the Triton cache, TC_SAVE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != --sizes ]; then
    bash ../shared/tools/gpu-wheels.sh .whl websockets opentelemetry-api httptools uvloop \
        annotated-doc soxr prometheus-client httpx httpcore h11 anyio sniffio typer rich \
        shellingham markdown-it-py mdurl idna soundfile cffi pycparser
    aside=${WHL_ASIDE:-/tmp/whl-aside}
    mkdir -p "$aside"
    for p in nvidia_modelopt pulp omegaconf antlr4 aiohttp aiohappyeyeballs aiosignal attrs \
            frozenlist multidict propcache yarl; do
        for f in .whl/"$p"-*.whl; do [ -e "$f" ] && mv "$f" "$aside/"; done
    done
fi
mib() { awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | mib)
sizes() { find "$@" -type f -printf '%s\n' 2>/dev/null || true; }  # (none where absent)
whl=$(sizes .whl | mib)
so=$(sizes ttsbuild -maxdepth 1 -name '_driver.cpython-312-*.so' | mib)
tc=$(sizes .tc | mib)
total=$(printf '%s\n%s\n%s\n%s\n' "$tree" "$whl" "$so" "$tc" | awk '{s += $1} END {printf "%.1f", s}')
echo "carry MiB: tree $tree + .whl $whl + driver $so + .tc $tc = $total (device limit 64)"
awk -v t="$total" 'BEGIN {exit !(t <= 64)}' || { echo "over the 64 MiB carry"; exit 1; }
