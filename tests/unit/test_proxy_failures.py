"""The proxy against stand-in upstreams that fail the ways real ones do (a decode that dies
mid-stream or stalls, a prefill that answers garbage) and against hostile or heavy
clients: every answer stays well-formed HTTP with an error that names the cause."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from test_proxy_flows import _completions_app, _serve

from kvbridge.proxy.app import Proxy

BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "stream": True}


def _event(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n"


async def _streaming_decode(
    events: int, gap_s: float, then: str, release: asyncio.Event | None = None
) -> tuple[web.AppRunner, str]:
    """A decode that streams ``events`` SSE events ``gap_s`` apart, then ``then``: ``done``
    (``[DONE]``, a clean end), ``die`` (closes the connection mid-stream) or ``stall``
    (sends nothing more until ``release`` is set)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(events):
            await out.write(_event(i))
            await asyncio.sleep(gap_s)  # the upstream's pace is what is under test
        if then == "die":
            request.transport.close()
        elif then == "stall":
            assert release is not None
            await release.wait()
        await out.write(b"data: [DONE]\n\n")
        return out

    return await _serve(_completions_app(handle))


async def _prefill(
    reply: bytes, answered: asyncio.Event | None = None
) -> tuple[web.AppRunner, str]:
    """A prefill that answers every request with ``reply`` (setting ``answered``) and
    ``/health`` with 200."""

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if answered is not None:
            answered.set()
        return web.Response(body=reply, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = _completions_app(handle)
    app.router.add_get("/health", health)
    return await _serve(app)


async def _stream_through(
    events: int, gap_s: float, then: str, **proxy_kw: Any
) -> tuple[int, list[str]]:
    """One streamed request through a P-first proxy in front of :func:`_streaming_decode`:
    the status and the SSE events' data as the client read them."""
    release = asyncio.Event()
    d_runner, d_url = await _streaming_decode(events, gap_s, then, release)
    p_runner, p_url = await _prefill(b'{"choices": [], "kv_transfer_params": {"x": 1}}')
    runner, url = await _serve(Proxy([p_url], [d_url], flow="pull", **proxy_kw).app())
    try:
        timeout = aiohttp.ClientTimeout(total=20)
        async with (
            aiohttp.ClientSession(timeout=timeout) as client,
            client.post(f"{url}/v1/completions", json=BODY) as resp,
        ):
            body = await resp.read()  # raises on a broken chunked encoding
            return resp.status, [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    finally:
        release.set()
        for r in (runner, p_runner, d_runner):
            await r.cleanup()


def _error_event(events: list[str]) -> str:
    assert events[-1] == "[DONE]", events
    return json.loads(events[-2])["error"]["message"]


def test_a_decode_that_dies_mid_stream_ends_the_stream_with_an_error_event() -> None:
    """Before: a second ``HTTP/1.1 502`` status line inside the chunked 200 body (curl: a
    broken chunked encoding; an aiohttp client hung until its own timeout)."""
    status, events = asyncio.run(_stream_through(2, 0.0, "die"))
    assert status == 200
    assert events[:2] == [json.dumps({"choices": [{"text": f"t{i}"}]}) for i in range(2)]
    assert "failed mid-stream" in _error_event(events) and len(events) == 4


def test_a_stream_longer_than_the_read_timeout_is_not_cut() -> None:
    status, events = asyncio.run(_stream_through(6, 0.1, "done", read_timeout=0.4))
    assert status == 200 and len(events) == 7 and events[-1] == "[DONE]"


def test_a_decode_that_stalls_mid_stream_fails_at_the_read_timeout() -> None:
    status, events = asyncio.run(_stream_through(1, 0.0, "stall", read_timeout=0.5))
    assert status == 200 and len(events) == 3
    assert "Timeout" in _error_event(events)


def test_a_client_hanging_up_mid_stream_is_not_the_decode_s_failure() -> None:
    """Found by the soak (benchmarks/soak.py): writing to a departed client raises
    aiohttp's ``ClientConnectionResetError``, an ``aiohttp.ClientError`` like an upstream
    failure's, and the proxy marked the healthy decode down (and wrote an error event
    and an end into the closed connection, which raised again)."""

    async def run() -> Any:
        decode_done = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            await request.json()
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            try:
                for i in range(500):  # until the proxy, its client gone, closes this request
                    await out.write(_event(i))
                    await asyncio.sleep(0.01)  # the upstream's pace is part of the case
                await out.write(b"data: [DONE]\n\n")
            finally:
                decode_done.set()
            return out

        d_runner, d_url = await _serve(_completions_app(handle))
        p_runner, p_url = await _prefill(b'{"choices": [], "kv_transfer_params": {"x": 1}}')
        proxy = Proxy([p_url], [d_url], flow="pull")
        runner, url = await _serve(proxy.app())
        try:
            async with aiohttp.ClientSession() as client:
                resp = await client.post(f"{url}/v1/completions", json=BODY)
                assert resp.status == 200
                assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
                resp.close()  # hang up after the first event
            await asyncio.wait_for(decode_done.wait(), 30)
            return proxy.decode.instances[0]
        finally:
            for r in (runner, p_runner, d_runner):
                await r.cleanup()

    decode = asyncio.run(run())
    assert decode.up and decode.failures == 0, decode.last_error


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"<html>busy</html>", "not JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"choices": [], "kv_transfer_params": "oops"}', "kv_transfer_params of type str"),
        (
            b'{"kv_transfer_params": {"kvbridge": {"prefill": {"dp_rank": 1e999, "address": 1}}}}',
            "malformed kvbridge side-channel address",
        ),
    ],
    ids=["not-json", "array", "params-not-object", "dp-rank-infinite"],
)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_prefill_answering_garbage_gets_a_502_naming_it(
    reply: bytes, says: str, flow: str
) -> None:
    async def run() -> tuple[int, dict[str, Any]]:
        d_runner, d_url = await _streaming_decode(1, 0.0, "done")
        p_runner, p_url = await _prefill(reply)
        runner, url = await _serve(Proxy([p_url], [d_url], flow=flow, timeout=10).app())
        try:
            async with aiohttp.ClientSession() as client:
                body = dict(BODY, stream=False)
                async with client.post(f"{url}/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()
        finally:
            for r in (runner, p_runner, d_runner):
                await r.cleanup()

    status, out = asyncio.run(run())
    assert status == 502, out
    assert says in out["error"]["message"] and p_url_named(out)


def p_url_named(out: dict[str, Any]) -> bool:
    return "prefill instance http://127.0.0.1:" in out["error"]["message"]


def test_a_request_body_nested_100k_levels_gets_a_400() -> None:
    async def run() -> tuple[int, dict[str, Any]]:
        runner, url = await _serve(Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]).app())
        try:
            async with aiohttp.ClientSession() as client:
                data = b"[" * 100_000 + b"]" * 100_000
                async with client.post(f"{url}/v1/completions", data=data) as resp:
                    return resp.status, await resp.json()
        finally:
            await runner.cleanup()

    status, out = asyncio.run(run())
    assert status == 400 and "not JSON" in out["error"]["message"]


def test_more_concurrent_requests_than_aiohttp_s_default_connection_limit_all_proceed() -> None:
    """The decode answers none until all of them arrived: behind aiohttp's default limit
    of 100 connections the 101st never would."""
    n = 150

    async def run() -> list[int]:
        arrived, everyone = 0, asyncio.Event()

        async def handle(request: web.Request) -> web.Response:
            nonlocal arrived
            await request.read()
            arrived += 1
            if arrived == n:
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 15)
            return web.json_response({"choices": [{"text": "x"}]})

        d_runner, d_url = await _serve(_completions_app(handle))
        p_runner, p_url = await _prefill(b'{"choices": [], "kv_transfer_params": {"x": 1}}')
        runner, url = await _serve(Proxy([p_url], [d_url], flow="pull").app())
        try:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as client:

                async def one() -> int:
                    async with client.post(
                        f"{url}/v1/completions", json=dict(BODY, stream=False)
                    ) as resp:
                        return resp.status

                return await asyncio.gather(*(one() for _ in range(n)))
        finally:
            for r in (runner, p_runner, d_runner):
                await r.cleanup()

    assert asyncio.run(run()) == [200] * n


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_dead_prefill_among_healthy_ones_costs_clients_nothing(flow: str) -> None:
    """Before: each such request failed with 502, and after a 5 s back-off a client's
    request went to the dead instance again (56 failures in one run under load). Now the
    request goes to the other prefill, and the dead one is probed in the background
    until it answers again (its side channel then learnt anew)."""
    address = {"address": "tcp://127.0.0.1:1", "engine_id": "p", "epoch": "e1"}
    reply = {"choices": [{"text": "x"}], "kv_transfer_params": {"kvbridge": {"prefill": address}}}
    health_ok = asyncio.Event()

    async def run() -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(reply)

        async def health(request: web.Request) -> web.Response:
            health_ok.set()
            return web.json_response({})

        live = _completions_app(handle)
        p_runner, p_url = await _serve(live)
        d_runner, d_url = await _serve(_completions_app(handle))
        dead_runner, dead_url = await _serve(_completions_app(handle))
        await dead_runner.cleanup()  # its port now refuses connections
        proxy = Proxy([dead_url, p_url], [d_url], flow=flow)
        runner, url = await _serve(proxy.app())
        try:
            async with aiohttp.ClientSession() as client:

                async def one() -> int:
                    body = dict(BODY, stream=False)
                    async with client.post(f"{url}/v1/completions", json=body) as resp:
                        return resp.status

                statuses = [await one() for _ in range(6)]
                async with client.get(f"{url}/health") as resp:
                    before = await resp.json()
                # the dead instance comes back on its port: the background probe finds it
                port = int(dead_url.rsplit(":", 1)[1])
                back = _completions_app(handle)
                back.router.add_get("/health", health)
                revived = web.AppRunner(back)
                await revived.setup()
                await web.TCPSite(revived, "127.0.0.1", port).start()
                try:
                    await asyncio.wait_for(health_ok.wait(), 10)
                    dead = proxy.prefill.instances[0]
                    for _ in range(100):  # the probe's answer is applied after it returns
                        if dead.up:
                            break
                        await asyncio.sleep(0.01)
                    async with client.get(f"{url}/health") as resp:
                        after = await resp.json()
                finally:
                    await revived.cleanup()
                return statuses, before, after
        finally:
            for r in (runner, p_runner, d_runner):
                await r.cleanup()

    statuses, before, after = asyncio.run(run())
    assert statuses == [200] * 6
    dead_before, live_before = before["prefill"]
    assert dead_before["failures"] == 1 and not dead_before["up"], before
    assert live_before["served"] == 6
    assert after["prefill"][0]["up"], after


def test_a_streamed_push_request_whose_prefill_dies_before_any_token_is_retried() -> None:
    """Push flow, streamed: the decode answers its headers at once and then waits for the
    KV. A prefill that dies then (SIGKILLed mid-forward) left the client with a 200 and,
    once the decode gave up, an error event: the proxy had relayed the headers. Nothing
    had reached the client, so the request goes to the other prefill with a new transfer
    id, the decode's request for the dead transfer is closed (vLLM aborts it), and the
    client sees only the second attempt's tokens."""
    address = {"address": "tcp://127.0.0.1:1", "engine_id": "p", "epoch": "e1"}
    reply = {"choices": [{"text": "x"}], "kv_transfer_params": {"kvbridge": {"prefill": address}}}
    waiting: dict[str, asyncio.Event] = {}  # transfer id -> the decode holds its request
    computed: dict[str, asyncio.Event] = {}  # transfer id -> its prefill answered
    closed: list[str] = []  # transfer ids whose decode request the proxy closed
    dying: list[str] = []

    def ticket(tid: str) -> tuple[asyncio.Event, asyncio.Event]:
        return waiting.setdefault(tid, asyncio.Event()), computed.setdefault(tid, asyncio.Event())

    async def run() -> tuple[int, list[str]]:
        async def prefill(request: web.Request, dies: bool) -> web.Response:
            tid = (await request.json())["kv_transfer_params"]["kvbridge"]["transfer_id"]
            held, done = ticket(tid)
            await held.wait()  # the decode already answered its headers
            if dies:  # no KV will come for this transfer
                dying.append(tid)
                request.transport.close()
            else:
                done.set()
            return web.json_response(reply)

        async def decode(request: web.Request) -> web.StreamResponse:
            tid = (await request.json())["kv_transfer_params"]["kvbridge"]["transfer_id"]
            held, done = ticket(tid)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            held.set()
            try:
                await asyncio.wait_for(done.wait(), 5)  # the KV arrives, or the load fails
            except asyncio.CancelledError:
                closed.append(tid)
                raise
            except TimeoutError:
                await out.write(b'data: {"error": {"message": "load failed"}}\n\n')
            else:
                for i in range(3):
                    await out.write(_event(i))
            await out.write(b"data: [DONE]\n\n")
            return out

        dead_runner, dead_url = await _serve(_completions_app(lambda r: prefill(r, True)))
        live_runner, live_url = await _serve(_completions_app(lambda r: prefill(r, False)))
        # cancelled when its client goes, as vLLM's server aborts a request then
        d_runner, d_url = await _serve(_completions_app(decode), handler_cancellation=True)
        proxy = Proxy([dead_url, live_url], [d_url], flow="push")
        for instance in proxy.prefill.instances:  # probed already: no discovery request
            instance.learn(address)
            instance.dp_size = 0
        runner, url = await _serve(proxy.app())
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as client,
                client.post(f"{url}/v1/completions", json=BODY) as resp,
            ):
                body = await resp.read()
                return resp.status, [e for e in body.decode().split("\n\n") if e]
        finally:
            for r in (runner, dead_runner, live_runner, d_runner):
                await r.cleanup()

    status, events = asyncio.run(run())
    assert len(dying) == 1, "the request did not go to the dying prefill first"
    assert status == 200
    assert events == [_event(i).decode().strip() for i in range(3)] + ["data: [DONE]"], events
    assert closed == dying, "the decode's request for the dead transfer was not closed"


def _kvbridge_prefill(body: dict[str, Any]) -> str:
    """Which prefill stand-in (its address's ``engine_id``) a decode request's KV is from."""
    return body["kv_transfer_params"]["kvbridge"]["prefill"]["engine_id"]


async def _decode_failing_loads_from(
    lost: str, stream: bool, before_failing: Any = None
) -> tuple[web.AppRunner, str, list[str]]:
    """A decode that fails (vLLM's fail policy: a 500, or a stream's first event an error)
    every request whose KV is on prefill ``lost``, after ``await before_failing()``, and
    serves the others; returns the prefills whose KV its requests named, in order."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        source = _kvbridge_prefill(await request.json())
        seen.append(source)
        failed = source == lost
        if failed and before_failing is not None:
            await before_failing()
        if not stream:
            if failed:
                return web.json_response({"error": {"message": "load failed"}}, status=500)
            return web.json_response({"choices": [{"text": "ok"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if failed:
            await out.write(b'data: {"error": {"message": "load failed", "code": 500}}\n\n')
        else:
            await out.write(_event(0))
        await out.write(b"data: [DONE]\n\n")
        return out

    runner, url = await _serve(_completions_app(handle))
    return runner, url, seen


async def _prefill_named(engine_id: str, answered: asyncio.Event | None = None):
    """A prefill stand-in (:func:`_prefill`) whose answers carry a kvbridge address of
    ``engine_id`` (the push flow reads it from ``learn``, the pull flow from the answer)."""
    address = {"address": "tcp://127.0.0.1:1", "engine_id": engine_id, "epoch": "e1"}
    reply = {"choices": [{"text": "x"}], "kv_transfer_params": {"kvbridge": {"prefill": address}}}
    runner, url = await _prefill(json.dumps(reply).encode(), answered)
    return runner, url, address


async def _one_request(
    flow: str, stream: bool, prefills: list[tuple[str, dict]], d_url: str
) -> tuple[int, bytes, dict[str, Any]]:
    """One request through a proxy over ``prefills`` (url, address) and ``d_url``: the
    client's status and body, and the proxy's /health after it."""
    proxy = Proxy([u for u, _ in prefills], [d_url], flow=flow)
    for instance, (_, address) in zip(proxy.prefill.instances, prefills, strict=True):
        instance.learn(address)  # probed already: no discovery request
        instance.dp_size = 0
    runner, url = await _serve(proxy.app())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as client:
            async with client.post(f"{url}/v1/completions", json=dict(BODY, stream=stream)) as resp:
                status, body = resp.status, await resp.read()
            async with client.get(f"{url}/health") as resp:
                return status, body, await resp.json()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_request_whose_prefill_dies_after_answering_goes_to_another(
    flow: str, stream: bool
) -> None:
    """The prefill answered (its KV held for the decode), then died: the decode's load
    fails (vLLM's fail policy answers 500, or a stream's first event is an error). The
    CI run of 8c0637e showed such a request in flight at a prefill's SIGKILL fail 12.9 s
    later. Nothing had reached the client, and the prefill no longer answers: the proxy
    sends the request to the other prefill, and the client gets its answer."""

    async def run() -> tuple[int, bytes, dict[str, Any], list[str]]:
        answered = asyncio.Event()
        dying, dying_url, dying_address = await _prefill_named("dying", answered)
        live, live_url, live_address = await _prefill_named("live")

        async def kill() -> None:  # the prefill's answer went out; now its port refuses
            await answered.wait()
            await dying.cleanup()

        d_runner, d_url, seen = await _decode_failing_loads_from("dying", stream, kill)
        try:
            status, body, health = await _one_request(
                flow, stream, [(dying_url, dying_address), (live_url, live_address)], d_url
            )
            return status, body, health, seen
        finally:
            for r in (live, d_runner):
                await r.cleanup()

    status, body, health, seen = asyncio.run(run())
    assert seen == ["dying", "live"], f"the decode's requests named the prefills {seen}"
    assert status == 200, body
    assert b"error" not in body, body
    dead = health["prefill"][0]  # it had answered: the decode's failure was the lost KV
    assert dead["served"] == 1 and not dead["up"], health


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_failure_with_its_prefill_alive_is_the_client_s_answer(stream: bool) -> None:
    """The other side of the rule above: a decode that fails a request whose prefill
    still answers is not retried (it would run the request twice for a failure that is
    the decode's): the client gets the decode's error."""

    async def run() -> tuple[int, bytes, list[str]]:
        alive, alive_url, alive_address = await _prefill_named("alive")
        other, other_url, other_address = await _prefill_named("other")
        d_runner, d_url, seen = await _decode_failing_loads_from("alive", stream)
        try:
            prefills = [(alive_url, alive_address), (other_url, other_address)]
            status, body, _ = await _one_request("push", stream, prefills, d_url)
            return status, body, seen
        finally:
            for r in (alive, other, d_runner):
                await r.cleanup()

    status, body, seen = asyncio.run(run())
    assert seen == ["alive"], f"the request was sent again: {seen}"
    assert b"load failed" in body, body
    assert status == (200 if stream else 500), body
