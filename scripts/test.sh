#!/usr/bin/env bash
# `make test` / `make test-all`: the suite's two environments side by side.
#
#   scripts/test.sh [PYTEST ARGS...]      e.g. scripts/test.sh -m "not extended"
#
# The vLLM/transport/core suite runs in .venv and the SGLang suite in .venv-sglang (they pin
# different engines), at the same time: an engine test keeps about one of the two cores
# busy (a request goes prefill, then decode, one process at a time), so the two streams
# together take little longer than the longer one alone. The vLLM stream prints as it
# runs; the SGLang stream's output goes to build/test-sglang.log and is printed when both
# are done. Exit status: non-zero if either failed. Each stream's tiers are appended to
# build/test-tiers.jsonl (tests/support/tier_times.py), printed together at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

mkdir -p build
TIER_LOG=build/test-tiers.jsonl
SGLANG_LOG=build/test-sglang.log
rm -f "$TIER_LOG" "$SGLANG_LOG"
export KVBRIDGE_TIER_LOG=$TIER_LOG

# its own process group, so that an interrupted `make test` stops it and its engines too
setsid .venv-sglang/bin/python -m pytest tests/component_sglang tests/integration_sglang \
  -ra --durations=20 "$@" >"$SGLANG_LOG" 2>&1 &
sglang=$!
trap 'kill -- -"$sglang" 2>/dev/null' INT TERM

.venv/bin/python -m pytest tests -ra --durations=20 "$@" \
  --ignore=tests/integration_sglang --ignore=tests/component_sglang
main_rc=$?

wait "$sglang"
sglang_rc=$?
trap - INT TERM
printf '\n\033[1m===== SGLang suite (.venv-sglang, ran alongside; %s) =====\033[0m\n' "$SGLANG_LOG"
cat "$SGLANG_LOG"
.venv/bin/python tests/support/tier_times.py "$TIER_LOG"
echo "exit status: vLLM suite $main_rc, SGLang suite $sglang_rc"
[ "$main_rc" -eq 0 ] && [ "$sglang_rc" -eq 0 ]
