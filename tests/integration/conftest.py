"""Fixtures of the engine integration tests (helpers live in ``engine_helpers``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from engine_logs import pytest_runtest_makereport  # noqa: F401 - the hook: engine logs in failure reports

from kvbridge.demo.model import build_tiny_model, default_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed (fix: make setup, or pip install 'kvbridge[vllm]')")
    return build_tiny_model(default_model_dir())
