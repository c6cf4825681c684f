# Sourced by run.sh and device_check.sh (from the repository root): the Python to use ($PY) and its path.
# Where NIXL, pyzmq or msgspec are missing, the wheels in benchmarks/gpu/wheels/ (fetch_wheels.sh) are
# installed with --no-deps into a private target directory ($KVB_GPU_SITE, default /tmp/kvbridge-gpu-site):
# the machine's own torch and numpy are used as they are. Returns 2 where packages are missing and no
# wheels are here.
PY=$(command -v "${PYTHON:-python3}")
missing=$("$PY" - <<'PYEOF'
import importlib.util as u
miss = [m for m in ("zmq", "msgspec") if u.find_spec(m) is None]
if all(u.find_spec(m) is None for m in ("nixl_cu13", "nixl_cu12")):
    miss.append("nixl")
print(" ".join(miss))
PYEOF
)
if [ -n "$missing" ]; then
    SITE=${KVB_GPU_SITE:-/tmp/kvbridge-gpu-site}
    if [ -d "$SITE" ] && PYTHONPATH="$SITE" "$PY" -c "import zmq, msgspec" 2>/dev/null; then
        echo "pyenv: using $SITE (installed before)"
    elif ! ls benchmarks/gpu/wheels/*.whl >/dev/null 2>&1; then
        echo "pyenv: missing Python packages ($missing) and no wheels in benchmarks/gpu/wheels/;" \
             "run benchmarks/gpu/fetch_wheels.sh on a machine with network and bring that folder along" >&2
        return 2
    else
        echo "pyenv: installing $missing from benchmarks/gpu/wheels/ into $SITE (--no-deps)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            benchmarks/gpu/wheels/*.whl || return 2
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
