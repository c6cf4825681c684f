#!/usr/bin/env bash
# Fetch the wheels the GPU machine lacks (it has CUDA torch 2.11 on CPython 3.12, numpy and rich, but no
# NIXL, pyzmq or msgspec) into benchmarks/gpu/wheels/ (git-ignored). benchmarks/gpu/run.sh installs them
# there with --no-deps. The NIXL wheel is then slimmed (slim_wheel.py: without the nixl_ep_cu13 package,
# which kvbridge never loads): 56 -> 29.4 MiB, all three 30.5 MiB, well under the 64 MiB a device call carries.
#
#   bash benchmarks/gpu/fetch_wheels.sh          # any Python with pip (PYTHON=...; the target platform is forced)
#   FULL=1 bash benchmarks/gpu/fetch_wheels.sh   # keep the NIXL wheel whole (57.1 MiB in all)
set -euo pipefail
PY=$(command -v "${PYTHON:-python3}")
cd "$(dirname "$0")"
mkdir -p wheels
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --no-deps -d wheels nixl-cu13==1.5.1 pyzmq msgspec
[ -n "${FULL:-}" ] || "$PY" slim_wheel.py wheels/nixl_cu13-1.5.1-*.whl
ls -l wheels
du -ch wheels/*.whl | tail -1
