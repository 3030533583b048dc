"""Fixtures of the engine integration tests (helpers live in ``engine_helpers``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from engine_logs import attach_engine_logs

from kvbridge.demo.model import build_tiny_model, default_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed (fix: make setup, or pip install 'kvbridge[vllm]')")
    return build_tiny_model(default_model_dir())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On a failure (test or fixture), report what the engine logs say (CI keeps only
    the console output)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        attach_engine_logs(item, report, since=call.start)
