#!/usr/bin/env bash
# kvbridge under a real vLLM on a GPU, in one command, for a machine with CUDA and vLLM
# 0.32-0.34 installed (with kvbridge: pip install -e '.[vllm,nixl,mooncake]'); CI has no
# GPU, and this has NOT run yet (README, compatibility page):
#
#   scripts/gpu-vllm-check.sh            results in $OUT (default build/gpu-vllm-check)
#
# For each transport (NIXL, and Mooncake when installed) and flow (layer-wise push through
# kvbridge's proxy, P-first pull), `kvbridge demo` starts a prefill, a decode and a
# colocated instance of the tiny demo model with vLLM's default model runner (Model
# Runner V2 on a GPU), sends prompts of 64 to 2,048 tokens with greedy sampling, and exits
# non-zero unless every disaggregated output equals the colocated one token for token.
# The three instances share the GPU (KVBRIDGE_VLLM_ARGS: a quarter of its memory each).
# Writes $OUT/summary.json (one entry per run: transport, flow, exit status, seconds) and
# each run's instance logs; exit status non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-vllm-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' ||
  { echo "no CUDA device visible to torch" >&2; exit 1; }
"$PY" -c 'import vllm, kvbridge' || { echo "vLLM and kvbridge must be installed" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c 'import vllm; print("vLLM", vllm.__version__)' | tee -a "$OUT/gpu.txt"
export KVBRIDGE_VLLM_ARGS=${KVBRIDGE_VLLM_ARGS:---gpu-memory-utilization 0.25}

transports=(nixl)
"$PY" -c 'import mooncake.engine' 2>/dev/null && transports+=(mooncake)
status=0
runs=()
for transport in "${transports[@]}"; do
  for flow in push pull; do
    logs="$OUT/$transport-$flow"
    start=$(date +%s)
    "$PY" -m kvbridge.cli demo --transport "$transport" --flow "$flow" --logs "$logs" \
      2>&1 | tee "$logs.out"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
    runs+=("{\"transport\": \"$transport\", \"flow\": \"$flow\", \"exit_status\": $rc, \"seconds\": $(( $(date +%s) - start ))}")
    # which model runner each instance used, as vLLM logged it
    grep -hio "model runner v2[^\"]*\|V2 model runner[^\"]*" "$logs"/*.log 2>/dev/null | sort | uniq -c
  done
done
(IFS=,; echo "[${runs[*]}]") >"$OUT/summary.json"
cat "$OUT/summary.json"
exit $status
