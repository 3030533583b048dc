"""Fixtures shared by the SGLang integration tests (run in .venv-sglang)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_logs import pytest_runtest_makereport  # noqa: F401 - the hook: engine logs in failure reports
from sglang_helpers import START_TIMEOUT_S, server_env, start_server

from kvbridge.demo.servers import ServerProcess


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama every SGLang server of the session loads."""
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight DeepSeek-V2 (MLA) of the MLA tests."""
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "mla-deepseek-v2", shape="mla")


@pytest.fixture(scope="session")
def colocated(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A colocated SGLang server (TP 1, the tests' engine flags): the reference output."""
    proc = start_server("colocated", model, tmp_path_factory.mktemp("colocated"), [], server_env())
    try:
        proc.wait_ready(START_TIMEOUT_S)
        yield proc
    finally:
        proc.kill()
