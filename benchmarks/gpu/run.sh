#!/usr/bin/env bash
# The GPU suite in one command (issue 24): prefill TP4 and decode TP2 rank processes on the GPU(s) here, KV
# caches allocated with torch on the device in engine layouts, moved through NIXL (VRAM) in direct and staged
# modes, every decode byte checked on the device, GB/s against a device-to-device copy and NIXL's own READ.
#
#   bash benchmarks/gpu/run.sh                       # --device cuda, full sizes (benchmarks/gpu/README.md)
#   bash benchmarks/gpu/run.sh --small --reps 2      # tiny models: a quick end-to-end check
#   bash benchmarks/gpu/run.sh --device cpu --small  # the same code on CPU torch (what tests/test_gpu_suite.py runs)
#
# Where NIXL, pyzmq or msgspec are missing, the wheels in benchmarks/gpu/wheels/ (fetch_wheels.sh) are
# installed with --no-deps into a private target directory ($KVB_GPU_SITE, default /tmp/kvbridge-gpu-site):
# the machine's own torch and numpy are used as they are. Output: a rich table, and JSON under $OUT if set
# (else benchmarks/out/gpu/). Exit status 1 if any decode byte was wrong.
set -euo pipefail
cd "$(dirname "$0")/../.."
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
    if ! ls benchmarks/gpu/wheels/*.whl >/dev/null 2>&1; then
        echo "run.sh: missing Python packages ($missing) and no wheels in benchmarks/gpu/wheels/;" \
             "run benchmarks/gpu/fetch_wheels.sh on a machine with network and bring that folder along" >&2
        exit 2
    fi
    SITE=${KVB_GPU_SITE:-/tmp/kvbridge-gpu-site}
    echo "run.sh: installing $missing from benchmarks/gpu/wheels/ into $SITE (--no-deps)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        benchmarks/gpu/wheels/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c "import sys, torch; n = torch.cuda.device_count(); print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'gpus', [torch.cuda.get_device_name(i) for i in range(n)])" || echo "run.sh: no torch here"
exec "$PY" benchmarks/gpu/driver.py "$@"
