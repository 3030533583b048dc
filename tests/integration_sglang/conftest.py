"""Fixtures shared by the SGLang integration tests (run in .venv-sglang)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama every SGLang server of the session loads."""
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
