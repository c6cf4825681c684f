#!/usr/bin/env bash
# Create .venv and install kvbridge with NIXL (UCX backend), without pulling torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
# nixl-cu12 declares torch as a dependency but never imports it: --no-deps keeps CUDA torch off CPU machines.
.venv/bin/pip install -q --no-deps "nixl-cu12==1.5.1"
.venv/bin/pip install -q -e ".[test]"
