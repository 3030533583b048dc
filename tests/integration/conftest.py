"""Fixtures of the engine integration tests (helpers live in ``engine_helpers``).

Servers that several modules need are shared through one session pool
(``tests/support/engine_pool.py``): a module leases the server it needs (``reference``:
the colocated tiny Llama every vLLM test compares against) and, at its end, hands it
back after an idle check, so that a test that leaks KV blocks fails its own module."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import COMMON_ARGS, check_idle, start_all
from engine_logs import pytest_runtest_makereport  # noqa: F401 - the hook: engine logs in failure reports
from engine_pool import EnginePool

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import VllmServer

VllmServer.kv_cache_mb = 256
"""Every test server's KV cache (the tiny models' prompts take a few MiB): a vLLM worker
holds about its KV cache plus 0.5 GB, and a TP 2 cluster runs seven engine processes
(1 GiB each: 1.55 GB a worker, 24 GB in use with the streams of make test side by side,
and the kernel killing workers)."""


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed (fix: make setup, or pip install 'kvbridge[vllm]')")
    return build_tiny_model(default_model_dir())


@pytest.fixture(scope="session")
def vllm_pool() -> Iterator[EnginePool[VllmServer]]:
    """The session's shared vLLM servers."""
    pool: EnginePool[VllmServer] = EnginePool(alive=VllmServer.alive, stop=VllmServer.stop)
    yield pool
    pool.close()


def _idle(server: VllmServer) -> None:
    """Between two modules: no request running (KV cache usage 0), none in kvbridge."""
    check_idle((server,), {server.url: 0.0})


@pytest.fixture(scope="module")
def reference(
    vllm_pool: EnginePool[VllmServer], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The colocated tiny Llama with the tests' common arguments, leased from the pool and
    perhaps not started yet: a module starts it together with its own servers
    (``start_all`` skips it when it runs). Use :func:`colocated` for it started."""

    def make() -> VllmServer:
        logs = tmp_path_factory.mktemp("pooled-colocated")
        return VllmServer(model_dir, extra_args=COMMON_ARGS, log_path=logs / "C.log")

    key = ("vllm", str(model_dir), tuple(COMMON_ARGS))
    with vllm_pool.lease(key, make, idle=_idle) as server:
        yield server


@pytest.fixture(scope="module")
def colocated(reference: VllmServer) -> VllmServer:
    """:func:`reference`, started."""
    start_all([reference])
    return reference
