"""The proxy's P-first flows against stand-in upstreams that record what they were
sent (the protocol only: engine behaviour is tested on real vLLM in
tests/integration/test_proxy.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from upstreams import serve as _serve

from kvbridge.proxy.app import Proxy, UpstreamError


async def _upstream(seen: list[dict[str, Any]], reply: dict[str, Any]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response(reply)

    return await _serve(_completions_app(handle))


def _completions_app(handle: Any) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


async def _through_proxy(
    flow: str, prefill_reply: dict[str, Any], health: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], list[dict], list[dict]]:
    """One request through a proxy in front of stand-in upstreams; ``health``, when given,
    is filled with the proxy's ``/health`` afterwards."""
    p_seen: list[dict] = []
    d_seen: list[dict] = []
    p_runner, p_url = await _upstream(p_seen, prefill_reply)
    d_runner, d_url = await _upstream(d_seen, {"choices": [{"text": "decoded"}]})
    runner, url = await _serve(Proxy([p_url], [d_url], flow=flow, timeout=10).app())
    try:
        async with aiohttp.ClientSession() as client:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "repetition_penalty": 1.1}
            async with client.post(f"{url}/v1/completions", json=body) as resp:
                status, out = resp.status, await resp.json()
            if health is not None:
                async with client.get(f"{url}/health") as resp:
                    health.update(await resp.json())
            return status, out, p_seen, d_seen
    finally:
        for r in (runner, p_runner, d_runner):
            await r.cleanup()


def test_pull_passes_the_prefill_params_to_decode() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4]}
    status, out, p_seen, d_seen = asyncio.run(
        _through_proxy("pull", {"choices": [{"text": "x"}], "kv_transfer_params": params})
    )
    assert status == 200 and out["choices"][0]["text"] == "decoded"
    assert p_seen[0]["max_tokens"] == 1 and p_seen[0]["kv_transfer_params"] == {
        "do_remote_decode": True
    }
    assert d_seen[0]["kv_transfer_params"] == params
    assert d_seen[0]["max_tokens"] == 9 and d_seen[0]["repetition_penalty"] == 1.1, (
        "fields pass through"
    )


def test_pull_without_prefill_params_names_the_sequential_flow() -> None:
    status, out, _, d_seen = asyncio.run(_through_proxy("pull", {"choices": [{"text": "x"}]}))
    assert status == 502 and "--flow sequential" in out["error"]["message"]
    assert d_seen == [], "decode must not run without the prefill's parameters"


@pytest.mark.parametrize("params", [None, {"k": 1}])
def test_sequential_runs_decode_after_prefill_with_or_without_params(params: dict | None) -> None:
    reply: dict[str, Any] = {"choices": [{"text": "x"}]}
    if params is not None:
        reply["kv_transfer_params"] = params
    status, out, p_seen, d_seen = asyncio.run(_through_proxy("sequential", reply))
    assert status == 200 and out["choices"][0]["text"] == "decoded"
    assert len(p_seen) == 1 and len(d_seen) == 1
    assert d_seen[0].get("kv_transfer_params") == params


PREFILL_ADDRESS = {"address": "127.0.0.1:1", "engine_id": "p", "epoch": "e1"}


def test_push_discovers_then_counts_only_the_client_s_request_as_served() -> None:
    reply = {
        "choices": [{"text": "x"}],
        "kv_transfer_params": {"kvbridge": {"prefill": PREFILL_ADDRESS}},
    }
    health: dict[str, Any] = {}
    status, out, p_seen, d_seen = asyncio.run(_through_proxy("push", reply, health))
    assert status == 200 and out["choices"][0]["text"] == "decoded"
    flows = [b["kv_transfer_params"]["kvbridge"].get("flow") for b in p_seen]
    # the probe of DP ranks: rank 1 answered as rank 0 (the stand-in ignores the header)
    assert flows == ["discover", "discover", None], "the probe, then the request itself"
    assert d_seen[0]["kv_transfer_params"]["kvbridge"]["prefill"] == PREFILL_ADDRESS
    # both sides get the transfer's ticket, and nobody else: the prefill acts only on it
    ticket = d_seen[0]["kv_transfer_params"]["kvbridge"]["ticket"]
    assert len(ticket) >= 20 and p_seen[-1]["kv_transfer_params"]["kvbridge"]["ticket"] == ticket
    assert [i["served"] for i in health["prefill"]] == [1], health
    assert [i["served"] for i in health["decode"]] == [1], health


class _Discovery:
    """Stands in for :meth:`Proxy._discover` against a prefill without data parallelism:
    counts calls, answers when released, refuses DP ranks past 0 as vLLM does (400)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self, p: Any, rank: int | None) -> int:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("prefill unreachable")
        if rank:
            raise UpstreamError(
                400, {"error": {"message": f"data_parallel_rank {rank} out of range"}}
            )
        p.learn(dict(PREFILL_ADDRESS))
        return 0


async def _waiters(proxy: Proxy, n: int) -> list[asyncio.Task]:
    instance = proxy.prefill.instances[0]
    tasks = [asyncio.create_task(proxy._address(instance)) for _ in range(n)]
    for _ in range(3):  # let every task reach its wait (loop turns, not time)
        await asyncio.sleep(0)
    return tasks


def test_requests_waiting_for_an_unknown_prefill_address_share_one_discovery() -> None:
    async def main() -> None:
        proxy = Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
        proxy._discover = discovery = _Discovery()  # type: ignore[method-assign]
        tasks = await _waiters(proxy, 8)
        tasks[0].cancel()  # a client gone: the others still get the address
        discovery.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert discovery.calls == 2, "one probe: DP rank 0, then rank 1 (refused)"
        assert isinstance(results[0], asyncio.CancelledError)
        assert results[1:] == [(PREFILL_ADDRESS, 0)] * 7
        assert await proxy._address(proxy.prefill.instances[0]) == (PREFILL_ADDRESS, 0)
        assert discovery.calls == 2, "a known address needs no discovery"

    asyncio.run(main())


def test_a_failed_discovery_fails_its_waiters_and_the_next_request_asks_again() -> None:
    async def main() -> None:
        proxy = Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
        proxy._discover = discovery = _Discovery(fail=True)  # type: ignore[method-assign]
        tasks = await _waiters(proxy, 4)
        discovery.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results), results
        discovery.fail = False
        assert await proxy._address(proxy.prefill.instances[0]) == (PREFILL_ADDRESS, 0)
        assert discovery.calls == 3, "the failed probe once, then rank 0 and rank 1"

    asyncio.run(main())


def test_push_sends_each_request_to_the_prefill_dp_rank_whose_address_the_decode_gets() -> None:
    """A prefill with two DP ranks (as vLLM's ``--data-parallel-size 2``): each rank answers
    with its own side channel and a third rank is refused; the proxy learns both,
    alternates, and routes every prefill request by ``X-data-parallel-rank`` to the rank
    the decode is told of."""

    async def main() -> tuple[list[tuple[str | None, dict]], list[dict]]:
        p_seen: list[tuple[str | None, dict]] = []
        d_seen: list[dict] = []

        async def prefill(request: web.Request) -> web.Response:
            body = await request.json()
            header = request.headers.get("X-data-parallel-rank")
            p_seen.append((header, body))
            rank = int(header) if header is not None else 1  # unrouted: whichever
            if rank >= 2:  # as vLLM with --data-parallel-size 2
                return web.json_response({"error": "data_parallel_rank out of range"}, status=400)
            address = {"address": f"tcp://p:{rank}", "dp_rank": rank}
            return web.json_response(
                {
                    "choices": [{"text": "x"}],
                    "kv_transfer_params": {"kvbridge": {"prefill": address}},
                }
            )

        async def decode(request: web.Request) -> web.Response:
            d_seen.append(await request.json())
            return web.json_response({"choices": [{"text": "decoded"}]})

        served = [await _serve(_completions_app(h)) for h in (prefill, decode)]
        runners, urls = [r for r, _ in served], [u for _, u in served]
        runner, url = await _serve(Proxy([urls[0]], [urls[1]], flow="push", timeout=10).app())
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(4):
                    body = {"prompt": [5, 6], "max_tokens": 3}
                    async with client.post(f"{url}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
        finally:
            for r in (runner, *runners):
                await r.cleanup()
        return p_seen, d_seen

    p_seen, d_seen = asyncio.run(main())
    discoveries = [h for h, b in p_seen if b["kv_transfer_params"]["kvbridge"].get("flow")]
    assert discoveries == ["0", "1", "2"], "the probe: ranks 0 and 1 answer, 2 is refused"
    prefills = [h for h, b in p_seen if not b["kv_transfer_params"]["kvbridge"].get("flow")]
    told = [b["kv_transfer_params"]["kvbridge"]["prefill"]["dp_rank"] for b in d_seen]
    assert prefills == ["0", "1", "0", "1"], "round robin over the DP ranks"
    assert told == [0, 1, 0, 1], "each decode is told the rank its prefill request went to"
