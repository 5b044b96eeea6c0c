#!/usr/bin/env bash
# What a device call would carry to the GPU host, against its 64 MiB limit: the tracked files,
# the untracked files git does not ignore, and the carried paths given (default: .whl).
#   bash benchmarks/carry_size.sh [PATH...]
# (2026-12-03: the tracked tree was ~53 MB and .whl ~13 MB, 62 MiB together: a call over the
# limit is refused, so new benchmark data has to stay small: gzip raw request logs, keep them
# for the key rates only.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
carry=0
for p in "${@:-.whl}"; do
    [ -e "$p" ] || { echo "carry path $p: missing"; continue; }
    carry=$((carry + $(du -sb "$p" | cut -f1)))
done
total=$((tree + carry))
awk -v t="$tree" -v c="$carry" -v l="$limit" 'BEGIN {
    m = 1048576; printf "tree %.1f MiB + carried %.1f MiB = %.1f MiB of 64 (%.1f MiB left)\n",
    t / m, c / m, (t + c) / m, (l - t - c) / m }'
[ "$total" -le "$limit" ] || { echo "over the limit: the call would be refused"; exit 1; }
