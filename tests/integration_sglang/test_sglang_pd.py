"""SGLang prefill + decode with ``--disaggregation-transfer-backend kvbridge`` on CPU.

Real SGLang 0.5.23 servers on loopback (see docs/sglang-backend-notes.md for the flags),
behind ``sglang_router.launch_router --pd-disaggregation --mini-lb``: the greedy output of
every prompt equals a colocated SGLang server started with the same flags, token for
token, over NIXL and over Mooncake (``KVBRIDGE_CONFIG``).

Run in the SGLang environment (``bash scripts/setup-sglang.sh``)::

    .venv-sglang/bin/python -m pytest tests/integration_sglang

Servers run in their own process groups and are SIGKILLed as a group at teardown (a
disaggregated SGLang server drains in-flight requests on SIGTERM, possibly forever).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:  # this directory runs in .venv-sglang only (make test); elsewhere: a clear error, not a skip
    import sglang  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise RuntimeError("tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh, then .venv-sglang/bin/python -m pytest tests/integration_sglang") from exc

from kvbridge.demo.servers import ServerProcess as Proc  # noqa: E402
from kvbridge.demo.servers import free_port as _free_port  # noqa: E402
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer  # noqa: E402

# Page 16 and 64-token chunks: prompts cross pages and chunks (the notes' chunked setting).
ENGINE_FLAGS = ["--page-size", "16", "--chunked-prefill-size", "64"]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MAX_NEW_TOKENS = 16

PROMPTS = {
    "short": 12,  # less than one page
    "page_boundary": 32,  # exactly two pages
    "chunk_boundary": 64,  # exactly one chunk (four pages)
    "chunked": 200,  # four chunks, partial last page
}


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(num_tokens)]


def _http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        return 0, str(exc).encode()


def _server_env(config: dict | None = None) -> dict[str, str]:
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
        "MC_LOG_LEVEL": "ERROR",
    }
    if config is not None:
        env["KVBRIDGE_CONFIG"] = json.dumps(config)
    return env


def _server(name: str, model: Path, log_dir: Path, extra: list[str], env: dict[str, str]) -> SglangServer:
    log = log_dir / f"{name}.log"
    return SglangServer(model, extra_args=ENGINE_FLAGS + extra, env=env, log_path=log, nice=19).start()


def _generate(url: str, input_ids: list[int]) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    status, data = _http(f"{url}/generate", body)
    assert status == 200, f"{url}/generate -> {status}: {data[:500]!r}"
    out = json.loads(data)
    return list(out["output_ids"])


@pytest.fixture(scope="session")
def colocated(model: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = _server("colocated", model, tmp_path_factory.mktemp("colocated"), [], _server_env())
    try:
        proc.wait_ready(START_TIMEOUT_S)
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd_router(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    transport = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{transport}")
    env = _server_env({"transport": transport})
    bootstrap = _free_port()
    procs: list[Proc] = []
    try:
        prefill = _server(
            "prefill", model, log_dir,
            ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvbridge",
             "--disaggregation-bootstrap-port", str(bootstrap)],
            env,
        )
        procs.append(prefill)
        decode = _server(
            "decode", model, log_dir,
            ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvbridge",
             "--disaggregation-decode-retraction-backup", "cpu_tensor"],
            env,
        )
        procs.append(decode)
        deadline = time.monotonic() + START_TIMEOUT_S
        prefill.wait_ready(deadline=deadline)
        decode.wait_ready(deadline=deadline)
        router = SglangRouter(prefill.url, bootstrap, decode.url, env=env, log_path=log_dir / "router.log", nice=19).start()
        procs.append(router)
        router.wait_ready(60)
        yield router, prefill, decode
    finally:
        for proc in reversed(procs):
            proc.kill()


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_output_equals_colocated(pd_router, colocated: Proc, prompt: str) -> None:
    router, prefill, decode = pd_router
    input_ids = _prompt(PROMPTS[prompt], seed=len(prompt))
    want = _generate(colocated.url, input_ids)
    try:
        got = _generate(router.url, input_ids)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- prefill ---\n{prefill.log_tail()}\n--- decode ---\n{decode.log_tail()}") from None
    assert len(want) == MAX_NEW_TOKENS
    assert got == want, f"{prompt} ({PROMPTS[prompt]} tokens): disaggregated {got} != colocated {want}"


def test_plugin_registers_backend() -> None:
    """The entry point is installed and adds ``kvbridge`` to SGLang's backends."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvbridge") == "kvbridge.adapters.sglang:register"
