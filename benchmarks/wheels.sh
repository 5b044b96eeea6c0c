# Sourced (from the repo root) by the scripts that run on the GPU host. That host is bare: the
# web stack travels as wheels in .whl (../shared/tools/gpu-wheels.sh). For serving runs
# (checked 2026-12-01): `gpu-wheels.sh .whl websockets opentelemetry-api httptools uvloop
# annotated-doc av soxr prometheus-client httpx httpcore h11 anyio sniffio typer rich
# shellingham markdown-it-py mdurl` (2026-12-02, the bench's HTTP client: aiohttp
# aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna; 2026-12-04, the GPU
# tests' tests/runtime/test_clone_engine.py and voice clips: soundfile cffi pycparser), then move the
# calibration-only wheels (pulp, nvidia_modelopt, omegaconf: 18 MB) out of .whl so the tree and .whl fit the 64 MiB carry.
# (2026-12-02: PyAV's 35 MB wheel moved out too, to .whl-av/: a server streaming PCM never
# imports it (serve/formats.py loads it in the FFmpeg encoders), which leaves room for a
# Triton cache, .tc/tc.tgz, 17 MB, that cut a server's start from ~210 s to ~40 s: unpacked
# below when carried.)
# On a warm host whose /tmp/site lacks one of them, install .whl there again by hand. Where $PY (default
# python3) cannot import fastapi, install them into /tmp/site; then put the repo and /tmp/site
# on PYTHONPATH, unbuffered. Also defines the helpers those scripts share (below).
PY=${PY:-python3}
# (2026-12-03: a run found fastapi and aiohttp but not pydantic, and every benchmark failed on
# its import: the check names every package the runtime and the bench import.)
if [ -d .whl ] && ! PYTHONPATH=/tmp/site "$PY" -c \
        'import fastapi, aiohttp, pydantic, uvicorn, typer, prometheus_client' 2>/dev/null; then
    echo "== installing $(ls .whl/*.whl | wc -l) wheels from .whl into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "== wheel install failed (rc $?)"
elif [ ! -d .whl ]; then
    echo "== no .whl here: carry it (../shared/tools/gpu-wheels.sh)"
fi
# (2026-12-05: a .whl of the bare gpu-wheels.sh list, without the serving extras above, lost
# two serving runs to fastapi's missing opentelemetry and then soxr: gpu_session.sh's
# preflight now imports the web stack before a serving step.)
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# Triton's compiled kernels in /tmp/tc, unpacked from .tc/tc.tgz where one was carried (made on
# an earlier call by gpu_session.sh with TC_SAVE=1; sm_90 kernels serve the H100 and the H200
# alike): a server's or an engine's first start then skips most of its Triton compiles.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
if [ -f .tc/tc.tgz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && tar xzf .tc/tc.tgz -C "$TRITON_CACHE_DIR" \
        && echo "== Triton cache from .tc/tc.tgz: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files"
fi
# The megaframe kernel's extension (runtime/cp_megaframe.py: nvcc on first use, 1-2 min; a
# fresh H100's server with it took ~7 min to start, 2026-12-06), built by
# torch.utils.cpp_extension under $TORCH_EXTENSIONS_DIR: carried as .tc/tx.tgz with the sha256
# of the ttsbuild/csrc sources it was built from (.tc/tx.sha, both made by gpu_session.sh with
# TC_SAVE=1), and used only where those match. Its files are then touched: ninja compares
# times, and the carried sources are newer than anything in the archive.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tx}
if [ -f .tc/tx.tgz ] && [ -f .tc/tx.sha ] && [ ! -d "$TORCH_EXTENSIONS_DIR" ]; then
    if sha256sum ttsbuild/csrc/* | cmp -s - .tc/tx.sha; then
        mkdir -p "$TORCH_EXTENSIONS_DIR" && tar xzf .tc/tx.tgz -C "$TORCH_EXTENSIONS_DIR" \
            && find "$TORCH_EXTENSIONS_DIR" -type f -exec touch {} + \
            && echo "== torch extensions from .tc/tx.tgz: $(ls "$TORCH_EXTENSIONS_DIR")"
    else
        echo "== .tc/tx.tgz was built from other ttsbuild/csrc sources: not used"
    fi
fi

# ensure_driver [LOG]: build the C++ step driver in place unless it already imports with CUDA
# (a build carried from this host is kept: the import needs torch first, for libc10). Says why
# it did not import; the build's output goes to LOG (default: discarded).
ensure_driver() {
    local why
    # a build without capture_while (graph_while.cu, 2026-12-04) is stale: build it again
    # (unless TTSBUILD_GRAPH_WHILE=0: built without it on purpose)
    why=$("$PY" -c 'import os, torch, ttsbuild._driver as d
assert d.built_with_cuda(), "built without CUDA"
assert hasattr(d, "capture_while") or os.environ.get("TTSBUILD_GRAPH_WHILE") == "0", \
    "built without graph_while.cu"' 2>&1) && return 0
    echo "== building the step driver (CUDA): it does not import: $(tail -1 <<<"$why")"
    if ! "$PY" setup.py build_ext --inplace > "${1:-/dev/null}" 2>&1; then
        # graph_while.cu (nvcc) first built on the GPU host 2026-12-05 at the earliest: if it
        # breaks the build, say why and build without it, so the session's other steps run
        echo "driver build failed"; [ -z "${1:-}" ] || tail -20 "$1"
        [ "${TTSBUILD_GRAPH_WHILE:-1}" != "0" ] || return 1
        echo "== building the step driver again without graph_while.cu (TTSBUILD_GRAPH_WHILE=0)"
        export TTSBUILD_GRAPH_WHILE=0
        local again=${1:+$1.nowhile}
        "$PY" setup.py build_ext --inplace > "${again:-/dev/null}" 2>&1 || {
            echo "driver build failed again"; [ -z "$again" ] || tail -20 "$again"; return 1; }
    fi
    # the C++ runtime it binds (a private, static libstdc++ crashed every refusal, 2026-12-02)
    echo "== step driver built; libstdc++: $(ldd ttsbuild/_driver*.so 2>/dev/null \
        | grep -o 'libstdc++[^ ]* => [^ ]*' || echo 'none (a private static copy?)')"
}

# engine_bench NAME [ARGS...]: the engine microbenchmark (random 1.7B CustomVoice weights,
# FP8, batches $BATCHES, default 1,64) with ARGS, log $OUT/engine_bench_NAME.log and JSON in
# $OUT/engine_NAME/; prints its table and first-chunk line. At most $ENGINE_TIMEOUT_S seconds
# (default 360: on an empty Triton cache a run to batch 256 outlasted 240 s on 2026-12-07 and
# lost its table), and never past $DEADLINE_S less 10 where a session sets one.
engine_bench() {
    local name=$1 limit=${ENGINE_TIMEOUT_S:-360}
    shift
    if [ -n "${DEADLINE_S:-}" ] && [ $((DEADLINE_S - SECONDS - 10)) -lt "$limit" ]; then
        limit=$((DEADLINE_S - SECONDS - 10))
    fi
    if [ "$limit" -le 0 ]; then  # (timeout 0 would mean no limit at all)
        echo "== skip engine bench $name: no time left before the deadline"; return 1
    fi
    timeout -k 5 "$limit" "$PY" -m ttsbuild.bench.engine_bench --batches "${BATCHES:-1,64}" \
        --precisions fp8 --iters 20 --out "$OUT/engine_$name" ${ENGINE_ARGS:-} "$@" 2>&1 \
        | tee "$OUT/engine_bench_$name.log" | grep -E "^\||first 1-frame|memory"
}
