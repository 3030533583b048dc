"""KVBridgeConnector under a real vLLM release (0.33, 0.34) whose forward pass is the
stand-in (``tests/vllm_standin``): the release's own API server, engine core, scheduler
and MRV2 connector glue, a prefill and a decode over real NIXL and Mooncake on loopback.

What this module adds to the engine modules of ``tests/integration`` (which run here
too): that the tier can fail. A decode request whose stand-in skips one loaded block
(``vllm_xargs`` ``kvbridge_standin_skip_block``) must answer differently from the
colocated instance,
else equal outputs would prove nothing. The Mooncake pair takes MRV2's deferred
finalize path (``post_forward(defer_finalize=True)``, then ``finalize_step``), as with
a speculator; the NIXL pair the plain one. And a decode request that its API server
rejects before admission: what the prefill's blocks do then (issue 48, difference 4).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_helpers import (
    BLOCK,
    BYTES_PER_BLOCK,
    CHUNK,
    COMMON_ARGS,
    USAGE,
    check_handoff,
    check_idle,
    check_parallel_sampling,
    discover,
    handoff,
    kv_args,
    metric,
    start_all,
    wait_metric,
)

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import ServerError, VllmServer, complete, random_prompt

LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 7, 2 * CHUNK + 88]
MAX_TOKENS = 12
SKIPPED = 1
"""The block the decode's stand-in zeroes after a load, in the faulty requests."""

# A busy 2-core machine once took over 300 s (pytest-timeout's default, which covers the
# fixture) to start four stand-in instances.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Instances:
    transport: str
    c: VllmServer
    p: VllmServer
    d: VllmServer
    address: dict[str, str]
    start_s: float


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model(default_model_dir())


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Instances]:
    transport = request.param
    logs = tmp_path_factory.mktemp(f"standin-{transport}")
    defer = {"KVBRIDGE_STANDIN_DEFER_FINALIZE": "1"} if transport == "mooncake" else {}

    def make(name: str, args: list[str], env: dict[str, str] | None = None) -> VllmServer:
        return VllmServer(
            model_dir,
            extra_args=COMMON_ARGS + args,
            env={**defer, **(env or {})},
            log_path=logs / f"{name}.log",
            max_model_len=1024,
        )

    c = make("C", [])
    p = make("P", kv_args("kv_producer", transport))
    d = make("D", kv_args("kv_consumer", transport, policy="fail"))
    t0 = time.monotonic()
    start_all([c, p, d])
    servers = Instances(transport, c, p, d, discover(p.url), start_s=time.monotonic() - t0)
    yield servers
    for s in (c, p, d):
        s.stop()


def fresh_prompt(n: int) -> list[int]:
    return random_prompt(n, seed=uuid.uuid4().int % 2**31)


def test_the_release_runs_the_standin_under_mrv2(pd: Instances) -> None:
    """The stand-in platform is what vLLM resolved, and the scheduler plans
    asynchronously (vLLM's default on a GPU), in every instance."""
    import vllm

    for s in (pd.c, pd.p, pd.d):
        log = s.log_path.read_text()
        assert f"kvbridge stand-in: vLLM {vllm.__version__}, MRV2" in log, s.log_path
        assert "async scheduling True" in log, s.log_path
    print(f"vLLM {vllm.__version__}: 3 stand-in instances healthy in {pd.start_s:.1f} s")


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_decode_equals_colocated(pd: Instances, flow: str, n: int) -> None:
    check_handoff(
        flow, pd.p.url, pd.d.url, pd.c.url, fresh_prompt(n), MAX_TOKENS, pd.address,
        BYTES_PER_BLOCK,
    )  # fmt: skip


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_skipped_block_changes_the_output(pd: Instances, flow: str) -> None:
    """The tier's test of itself: the same handoff to a decode that loses block
    :data:`SKIPPED` of the loaded prompt must not equal the colocated output."""
    good, faulty = fresh_prompt(3 * BLOCK + 5), fresh_prompt(3 * BLOCK + 5)
    for prompt, skip in ((good, {}), (faulty, {"kvbridge_standin_skip_block": SKIPPED})):
        ref = complete(pd.c.url, prompt, max_tokens=MAX_TOKENS)
        out = handoff(flow, pd.p.url, pd.d.url, prompt, MAX_TOKENS, pd.address, vllm_xargs=skip)
        if skip:
            assert out.token_ids != ref.token_ids, "a decode missing a KV block answered as C"
        else:
            assert out.token_ids == ref.token_ids


def test_the_decode_s_prefix_cache_serves_what_it_holds(pd: Instances) -> None:
    """A second prompt sharing a prefix with one the decode has seen: only the blocks it
    lacks move, and the output still equals the colocated one."""
    first = fresh_prompt(4 * BLOCK)
    check_handoff(
        "push", pd.p.url, pd.d.url, pd.c.url, first, MAX_TOKENS, pd.address, BYTES_PER_BLOCK
    )
    second = first + fresh_prompt(2 * BLOCK + 3)
    ref = complete(pd.c.url, second, max_tokens=MAX_TOKENS)
    out = handoff("push", pd.p.url, pd.d.url, second, MAX_TOKENS, pd.address)
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_parallel_sampling_loads_the_prompt_once(pd: Instances, flow: str) -> None:
    """``n > 1`` (engine_helpers.check_parallel_sampling): the stand-in samples as a
    function of the KV, so the samples are equal, and must equal the colocated ones."""
    check_parallel_sampling(flow, pd.p.url, pd.d.url, pd.c.url, pd.address, MAX_TOKENS)


def test_the_pairs_end_idle(pd: Instances) -> None:
    check_idle((pd.p, pd.d))


def test_a_decode_rejected_before_admission_frees_the_prefill_at_once(pd: Instances) -> None:
    """P-first: the prefill holds the prompt's blocks for the decode; the decode's API
    server rejects the request (max_tokens past the model length), and vLLM submits an
    ``abort_immediately`` marker (``notify_kv_transfer_request_rejected``) so that the
    connector can free the prefill's blocks: the decode tells the prefill to let go at
    once, well before its lease (60 s)."""
    prompt = fresh_prompt(3 * BLOCK)
    p = complete(pd.p.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert metric(pd.p.url, USAGE) > 0, "the prefill holds nothing for the decode"
    with pytest.raises(ServerError):
        complete(pd.d.url, prompt, max_tokens=4096, kv_transfer_params=p.kv_transfer_params)
    held = wait_metric(pd.p.url, USAGE, lambda v: v == 0.0, timeout=10)
    assert held == 0.0, f"the prefill still holds {held:.2%} of its KV cache"
