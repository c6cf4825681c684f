#!/usr/bin/env bash
# The GPU check in one bounded command (about 200 s of command time at most), for a lent GPU machine:
#
#   1. nvidia-smi -L
#   2. pack_bench.py: staged pack and scatter vs a device-to-device copy, the suite's full shapes
#      (JSON $OUT/pack_bench_cuda.json after every pair; at most PACK_S seconds)
#   3. ucx_probe.py with UCX_PROTO_INFO=y: one NIXL READ of device memory between two processes and the
#      UCX lanes chosen for it ($OUT/ucx_probe.log; at most PROBE_S seconds)
#   4. run.sh --quick: every pair and path, every byte checked, rows the cost model predicts past the bounds
#      skipped (JSON $OUT/gpu_suite_cuda_quick.json after every row; at most QUICK_S seconds)
#
# Each part runs under `timeout` (its whole process group is killed when it runs over) and the next part
# starts whatever the last one did; a summary of exit codes and times goes to $OUT/device_check.json.
# Exit status: 0 when every part exited 0. The first run installs NIXL, pyzmq and msgspec from
# benchmarks/gpu/wheels/ (git-ignored: carry it). DEVICE=cpu runs the same parts on CPU torch (no GPU),
# PYTHON= picks the interpreter.
#
#   run(carry=["benchmarks/gpu/wheels"], timeout_s=300, command="bash benchmarks/gpu/device_check.sh")
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$PWD/benchmarks/out/gpu}
PACK_S=${PACK_S:-35}
PROBE_S=${PROBE_S:-25}
QUICK_S=${QUICK_S:-120}
LAT_S=${LAT_S:-0}  # > 0: also benchmarks/latency.py (host memory, this machine's cores) for at most LAT_S s
mkdir -p "$OUT"
export OUT
T0=$(date +%s)
declare -A RC SECS
part() {  # part NAME SECONDS COMMAND...: run under a hard time bound, log to $OUT/NAME.log
    local name=$1 limit=$2 t=$(date +%s)
    shift 2
    echo "=== device_check: $name (at most ${limit} s, $(( t - T0 )) s in) ==="
    timeout -k 5 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    RC[$name]=$?
    SECS[$name]=$(( $(date +%s) - t ))
    echo "=== device_check: $name exit ${RC[$name]} after ${SECS[$name]} s$([ "${RC[$name]}" = 124 ] && echo ' (time bound reached)') ==="
}

if [ "$DEVICE" = cuda ]; then
    nvidia-smi -L || echo "device_check: nvidia-smi failed"
fi
uptime
source benchmarks/gpu/pyenv.sh || { echo "device_check: no Python environment (see above)"; exit 2; }

part pack_bench "$PACK_S" "$PY" benchmarks/gpu/pack_bench.py --device "$DEVICE" --budget-s $(( PACK_S - 15 )) \
    ${PACK_ARGS:-} --out "$OUT"
UCX_PROTO_INFO=y part ucx_probe "$PROBE_S" "$PY" benchmarks/gpu/ucx_probe.py --device "$DEVICE" ${PROBE_ARGS:-}
echo "--- UCX: the protocols and lanes chosen for remote memory reads (UCX_PROTO_INFO=y) ---"
grep -A5 "remote memory read" "$OUT/ucx_probe.log" | sed 's/^\[[^]]*\] \[[^]]*\] *//' \
    | grep -v -- "^--$\|+--\|Range" | awk '!seen[$0]++' | head -30
part quick "$QUICK_S" "$PY" benchmarks/gpu/driver.py --device "$DEVICE" --quick --budget-s $(( QUICK_S - 25 )) \
    ${QUICK_ARGS:-} --out "$OUT"

PARTS="pack_bench ucx_probe quick"
if [ "$LAT_S" -gt 0 ]; then
    BENCH_STAGING_MIB=${BENCH_STAGING_MIB:-600} part latency "$LAT_S" "$PY" benchmarks/latency.py ${LAT_ARGS:-} \
        --json "$OUT/latency.json"
    PARTS="$PARTS latency"
fi

RCS=""; SECSS=""
for k in $PARTS; do RCS="$RCS\"$k\": ${RC[$k]}, "; SECSS="$SECSS\"$k\": ${SECS[$k]}, "; done
"$PY" - "$OUT" <<PYEOF
import json, sys
rc = {${RCS}}
secs = {${SECSS}}
out = {"device": "$DEVICE", "exit_codes": rc, "seconds": secs, "total_s": $(( $(date +%s) - T0 ))}
open(sys.argv[1] + "/device_check.json", "w").write(json.dumps(out, indent=1))
print("device_check:", json.dumps(out))
PYEOF
for k in $PARTS; do [ "${RC[$k]}" = 0 ] || exit 1; done
exit 0
