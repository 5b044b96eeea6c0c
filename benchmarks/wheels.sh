# Sourced (from the repo root) by the scripts that run on the GPU host. That host is bare: the
# web stack travels as wheels in .whl (../shared/tools/gpu-wheels.sh). Where $PY (default
# python3) cannot import fastapi, install them into /tmp/site; then put the repo and /tmp/site
# on PYTHONPATH, unbuffered.
PY=${PY:-python3}
if [ -d .whl ] && ! PYTHONPATH=/tmp/site "$PY" -c 'import fastapi' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
