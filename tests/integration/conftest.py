"""Fixtures of the engine integration tests (helpers live in ``engine_helpers``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvbridge.demo.model import build_tiny_model, default_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed (fix: make setup, or pip install 'kvbridge[vllm]')")
    return build_tiny_model(default_model_dir())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On a failure (test or fixture), attach the recent errors of every engine log of
    this session (CI keeps only the console output)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    base = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    for log in sorted(base.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        hits = [i for i, line in enumerate(lines) if "Traceback" in line or "ERROR" in line or "kvbridge" in line and "WARNING" in line]
        if hits:
            last = hits[-1]
            report.sections.append((f"engine log {log.relative_to(base)}", "\n".join(lines[max(0, last - 120) : last + 30])))
