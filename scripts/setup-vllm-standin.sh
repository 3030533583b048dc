#!/usr/bin/env bash
# The environment of the vLLM stand-in tier (issue 48) for one vLLM release:
#
#   scripts/setup-vllm-standin.sh 0.33.0 [VENV]     (default VENV: .venv-vllm-0.33)
#
# vLLM's wheel is a CUDA build that pins CUDA torch and 9.5 GB of GPU packages. The tier
# never calls vLLM's compiled ops (the stand-in platform replaces the forward pass), so it
# installs vLLM without its dependencies, the CPU torch 2.13.0 wheel, and vLLM's pure-Python
# requirements (tests/vllm_standin/requirements/vllm-X.Y.txt, from the wheel's metadata);
# then kvbridge with its transports and the stand-in plugin, both editable.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: scripts/setup-vllm-standin.sh VLLM_VERSION [VENV]}
MINOR=$(echo "$VERSION" | cut -d. -f1,2)
VENV=${2:-.venv-vllm-$MINOR}
REQS=tests/vllm_standin/requirements/vllm-$MINOR.txt
[ -f "$REQS" ] || { echo "no $REQS: vLLM $MINOR is not a release the tier knows" >&2; exit 2; }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm") == sys.argv[1] and version("kvbridge-test-vllm-standin") else 1)
EOF
  exit 0  # already set up
fi

start=$(date +%s)
python3 -m venv "$VENV"
# shellcheck source=scripts/uv.sh
source scripts/uv.sh
ensure_uv
uv_install "$VENV" torch==2.13.0
uv_install "$VENV" --no-deps "vllm==$VERSION" xgrammar==0.2.8
uv_install "$VENV" -r "$REQS"
uv_install "$VENV" "nixl==1.5.1" "mooncake-transfer-engine-non-cuda>=0.3.13" rich "pytest>=8" \
  "pytest-timeout>=2.3"
mkdir -p build  # one editable install at a time (scripts/setup.sh says why)
{
  flock -w 1200 9 || { echo "waited 20 min for build/.editable-install.lock (another setup script holds it); let it finish or stop it, then run this again" >&2; exit 1; }
  uv_install "$VENV" --no-deps -e . -e tests/vllm_standin
} 9>build/.editable-install.lock
echo "(vLLM's GPU requirements left out on purpose: the stand-in never calls them)"
echo "vLLM $VERSION stand-in environment in $VENV: $(( $(date +%s) - start )) s," \
  "$(du -sh "$VENV" | cut -f1)"
