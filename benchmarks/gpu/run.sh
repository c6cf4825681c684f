#!/usr/bin/env bash
# The GPU suite in one command: prefill TP4 and decode TP2 rank processes on the GPU(s) here, KV caches
# allocated with torch on the device in engine layouts, moved through NIXL (VRAM) on every path, every decode
# byte checked on the device, GB/s against a device-to-device copy and NIXL's own READ.
#
#   bash benchmarks/gpu/run.sh --quick               # every pair and path, bounded (about 2-4 min on one GPU)
#   bash benchmarks/gpu/run.sh                       # --device cuda, full sizes (benchmarks/gpu/README.md)
#   bash benchmarks/gpu/run.sh --small --reps 2      # tiny models: a quick end-to-end check
#   bash benchmarks/gpu/run.sh --device cpu --quick  # the same code on CPU torch (what tests/test_gpu_suite.py runs)
#
# Missing NIXL, pyzmq or msgspec are installed from benchmarks/gpu/wheels/ (pyenv.sh). Output: a rich table,
# and JSON under $OUT if set (else benchmarks/out/gpu/), written after every row. Exit status 1 if any
# decode byte was wrong.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/pyenv.sh
"$PY" -c "import sys, torch; n = torch.cuda.device_count(); print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'gpus', [torch.cuda.get_device_name(i) for i in range(n)])" || echo "run.sh: no torch here"
exec "$PY" benchmarks/gpu/driver.py "$@"
