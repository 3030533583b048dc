"""The proxy's P-first flows against stand-in upstreams that record what they were
sent (the protocol only: engine behaviour is tested on real vLLM in
tests/integration/test_proxy.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvbridge.proxy.app import Proxy


async def _upstream(seen: list[dict[str, Any]], reply: dict[str, Any]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _through_proxy(
    flow: str, prefill_reply: dict[str, Any]
) -> tuple[int, dict[str, Any], list[dict], list[dict]]:
    p_seen: list[dict] = []
    d_seen: list[dict] = []
    p_runner, p_url = await _upstream(p_seen, prefill_reply)
    d_runner, d_url = await _upstream(d_seen, {"choices": [{"text": "decoded"}]})
    proxy = Proxy([p_url], [d_url], flow=flow, timeout=10)
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as client:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "repetition_penalty": 1.1}
            async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                return resp.status, await resp.json(), p_seen, d_seen
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
