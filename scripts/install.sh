#!/usr/bin/env bash
# Create .venv and install kvbridge with NIXL (UCX backend), without pulling torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q -e ".[test]"
# nixl-cu12 declares torch as a dependency but never imports it: --no-deps keeps CUDA torch off CPU
# machines (pip then notes that torch "is not installed"; that is expected).
.venv/bin/pip install -q --no-deps "nixl-cu12==1.5.1" 2>&1 | grep -v -e "dependency resolver" -e "requires torch" || true
.venv/bin/python -c "import nixl_cu12._api" || { echo "NIXL failed to import" >&2; exit 1; }
