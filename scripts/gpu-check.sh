#!/usr/bin/env bash
# The GPU checks of the CUDA kernels in one command, for a machine with CUDA torch and a
# GPU (CI has none; `make test` skips these tests there): build the kernels, run the GPU
# tests (both kernels against the torch reference, bit for bit, and compute-sanitizer's
# memcheck when it is installed), then the kernel benchmark and the host-work benchmark.
# Results go to $OUT (default benchmarks/results): ops.{json,md,png}, ops-host.{json,md,png}
# and the test log gpu-tests.log.
#
# Python packages kvbridge needs beside torch (msgspec, numpy, rich, pytest,
# pytest-timeout, hypothesis, matplotlib) come from the environment, or from wheels in
# ./.gpu-wheels when that folder exists (for a machine without a package index: fill it
# here with `pip download --only-binary=:all: --platform manylinux2014_x86_64
# --python-version <the machine's> -d .gpu-wheels msgspec rich pytest pytest-timeout
# hypothesis matplotlib` and carry it). About 3 minutes on an H100 after a kernel build of
# about one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export KVBRIDGE_CACHE_DIR=${KVBRIDGE_CACHE_DIR:-/tmp/kvbridge-kernels}
PY=${PYTHON:-python3}
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links .gpu-wheels --target /tmp/kvbridge-site \
    msgspec rich pytest pytest-timeout hypothesis matplotlib || exit 1
  export PYTHONPATH=/tmp/kvbridge-site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || { echo "no CUDA device visible to torch" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -m kvbridge.ops.jit || exit 1  # the kernel build, timed apart from the tests
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_ops.py tests/unit/test_tile_map.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" benchmarks/run.py ops --out "$OUT" | tail -30 || status=1
"$PY" benchmarks/run.py ops-host --out "$OUT" | tail -12 || status=1
exit $status
