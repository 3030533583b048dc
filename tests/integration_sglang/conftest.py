"""Fixtures shared by the SGLang integration tests (run in .venv-sglang).

Colocated reference servers that several modules need come from one session pool
(``tests/support/engine_pool.py``, :func:`shared_colocated`), keyed by model, TP size and
arguments, so each is started once per session."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from engine_logs import pytest_runtest_makereport  # noqa: F401 - the hook: engine logs in failure reports
from engine_pool import EnginePool
from sglang_helpers import START_TIMEOUT_S, Proc, http, new_colocated, server_env, start_server

from kvbridge.demo.servers import ServerProcess
from kvbridge.demo.sglang_servers import CPU_ENV, SglangServer

ServerProcess.omp_threads = 1
"""One OpenMP thread per engine process, as in tests/integration/conftest.py (a TP rank
that SGLang binds to one core has one anyway)."""
ServerProcess.preload = True
"""Servers and routers fork from a fork server that has imported SGLang's launcher (or
the router's) once, as in tests/integration/conftest.py."""
SglangServer.default_env = {**CPU_ENV, "KVBRIDGE_TEST_SGLANG_FORK": "1"}
SglangServer.preload_also = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)
"""SGLang's scheduler and detokenizer fork from the server, which forked from a fork
server that imported them (tests/sglang_stubs/sglang_fork_children): they import
nothing at start-up (about 17 of a server's CPU-seconds)."""


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


@pytest.fixture(scope="session")
def sglang_pool() -> Iterator[EnginePool[Proc]]:
    """The session's shared SGLang servers (the pool stops them at the end)."""
    pool: EnginePool[Proc] = EnginePool(alive=Proc.alive, stop=Proc.kill)
    yield pool
    pool.close()


def _answers(proc: Proc) -> None:
    """Between two modules: the reference server still serves (it runs no kvbridge)."""
    status, _ = http(f"{proc.url}/health", timeout=30)
    assert status == 200, f"pooled colocated server {proc.url} answers /health with {status}"


@pytest.fixture(scope="module")
def shared_colocated(
    sglang_pool: EnginePool[Proc], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Proc]]:
    """``shared_colocated(model, tp=1, extra=())``: the colocated reference server of that
    model, TP size and extra arguments (:func:`sglang_helpers.new_colocated`), from the
    session's pool, started on first use and leased until this module ends."""
    with contextlib.ExitStack() as leases:

        def get(model: Path, tp: int = 1, extra: Sequence[str] = ()) -> Proc:
            key = ("sglang-colocated", str(model), tp, tuple(extra))

            def make() -> Proc:
                log_dir = tmp_path_factory.mktemp(f"pooled-colocated-{model.name}-tp{tp}")
                return new_colocated(model, log_dir, tp, extra)

            return leases.enter_context(sglang_pool.lease(key, make, idle=_answers))

        yield get
