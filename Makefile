# The two commands of the README: `make demo` and `make test`. Each sets up what it needs.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test unit conformance demo bench doctor clean

setup:
	@bash scripts/setup.sh

## the whole test suite (what CI runs)
test: setup
	$(BIN)/python -m pytest tests -ra

unit: setup
	$(BIN)/python -m pytest tests/unit -q

conformance: setup
	$(BIN)/python -m pytest tests/conformance -ra

## the demonstration: prefill + decode vLLM instances, proxy, colocated reference
demo: setup
	$(BIN)/kvbridge demo

## both benchmarks (transfer: ~5 min; serving: ~30 min on 2 cores)
bench: setup
	$(BIN)/python benchmarks/run.py transfer
	$(BIN)/python benchmarks/run.py serving

doctor: setup
	$(BIN)/kvbridge doctor

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache benchmarks/results
