"""``kvbridge proxy``: an OpenAI-compatible front for prefill/decode instances.

Per request (``/v1/completions``, ``/v1/chat/completions``, streaming or not):

- layer-wise push (default): a transfer id is minted; the request goes to a prefill
  instance (``max_tokens=1``, not streamed) and to a decode instance at the same time,
  each told its role; the decode instance's answer is relayed to the client as it
  comes. A prefill that fails before the decode answers cancels the decode request
  (closing it makes vLLM abort it, and the decode side tells the prefill side);
- P-first (``--flow pull``): vLLM's protocol: prefill with ``do_remote_decode``, then
  decode with the ``kv_transfer_params`` the prefill returned (kvbridge, vLLM's
  NixlConnector);
- sequential (``--flow sequential``): the same, but a prefill that returns no
  ``kv_transfer_params`` is not an error: for connectors that share KV through storage
  and find it by the prompt (vLLM's ExampleConnector, LMCache).

Everything else in the body (sampling extensions, token-id prompts, ...) passes through
unchanged. Several instances per role are balanced by requests in flight; an instance
that cannot be reached is skipped for a few seconds. In the push flow a prefill
instance's data-parallel ranks (vLLM's ``--data-parallel-size``) are probed at its
first request and taken in turn, each prefill request routed (``X-data-parallel-rank``)
to the rank whose side channel the decode is told of. A request goes to another prefill
instance, once, when its prefill cannot be reached or dies before anything reached the
client: before answering, or after it (its KV lost) when the decode then fails the
request and the prefill no longer answers ``/health``. Errors the client sees name the
instance and the cause; every upstream call has a timeout, so no request hangs: an
upstream that sends nothing for ``read_timeout`` seconds fails the request, however long
a healthy stream runs (``timeout``, off by default, caps a request's whole length). A
decode that fails after its stream started ends the stream with an SSE error event and
``[DONE]`` (what vLLM's own server sends), never a second status line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable
from typing import Any

import aiohttp
from aiohttp import web

from kvbridge.proxy import firsttoken
from kvbridge.proxy.pool import Instance, Pool
from kvbridge.wire.auth import new_ticket
from kvbridge.wire.codec import describe

log = logging.getLogger(__name__)

FLOWS = ("push", "pull", "sequential")

PROBE_S = 1.0
"""How often an instance marked down is probed (``GET /health``) until it answers."""

DP_HEADER = "X-data-parallel-rank"
"""vLLM's request header naming the data-parallel rank that serves a request."""

LOST_PROBE_S = 2.0
"""How long the proxy waits for a prefill's ``/health`` when it asks whether the prefill
died (:meth:`Proxy._retry_if_lost`)."""

MAX_DP_RANKS = 256
"""The most data-parallel ranks of one prefill instance the proxy probes."""

MAX_BODY_BYTES = 64 << 20
"""The largest request body the proxy reads (a prompt of a million tokens as ids is ~8 MB)."""


class UpstreamError(Exception):
    """An instance failed: ``status`` and ``body`` go to the client as they are."""

    def __init__(
        self,
        status: int,
        body: bytes | dict,
        content_type: str = "application/json",
        *,
        retry: bool = False,
    ) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retry = retry
        """The prefill could not be reached or died before the client got anything:
        the request may go to another prefill instance."""

    def response(self) -> web.Response:
        if isinstance(self.body, dict):
            return web.json_response(self.body, status=self.status)
        return web.Response(
            body=self.body, status=self.status, content_type=self.content_type.split(";")[0]
        )


def _error(status: int, message: str, *, retry: bool = False) -> UpstreamError:
    return UpstreamError(
        status,
        {"error": {"message": message, "type": "kvbridge_proxy_error", "code": status}},
        retry=retry,
    )


def parse_request(data: bytes) -> dict[str, Any]:
    """A client's request body, which must be a JSON object; else a 400 saying why."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise _error(400, f"request body is not JSON: {describe(exc)}") from None
    if not isinstance(body, dict):
        raise _error(400, "request body must be a JSON object")
    return body


def _side_channel(result: dict[str, Any]) -> dict[str, Any] | None:
    """The kvbridge side-channel address a prefill response carries, if any: an object
    with a string ``address`` and, if given, a ``dp_rank`` the proxy routes over
    (anything else in it passes to the decode as it is)."""
    kb = (result.get("kv_transfer_params") or {}).get("kvbridge") or {}
    address = kb.get("prefill") if isinstance(kb, dict) else None
    if not isinstance(address, dict) or "address" not in address:
        return None
    rank = address.get("dp_rank", 0)
    if (
        not isinstance(address["address"], str)
        or not isinstance(rank, int)
        or isinstance(rank, bool)
        or not 0 <= rank < MAX_DP_RANKS
    ):
        raise _error(
            502,
            f"answered with a malformed kvbridge side-channel address {repr(address)[:200]} (it "
            f"needs a string address and a DP rank below {MAX_DP_RANKS})",
        )
    return address


def read_prefill_answer(p: Instance, data: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A prefill's answer and the side-channel address it carries (None: none); a 502
    naming the instance for an answer that is not a JSON object, a ``kv_transfer_params``
    that is not one, or a malformed address."""
    result = _prefill_result(p, data)
    try:
        return result, _side_channel(result)
    except UpstreamError as exc:
        message = exc.body["error"]["message"] if isinstance(exc.body, dict) else exc.status
        raise _error(exc.status, f"prefill instance {p.url} {message}") from None


def _prefill_result(p: Instance, data: bytes) -> dict[str, Any]:
    """A prefill's answer, which must be a JSON object whose ``kv_transfer_params`` (if
    any) is an object; else a 502 naming the instance."""
    try:
        result = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _error(
            502, f"prefill instance {p.url} answered with a body that is not JSON: {describe(exc)}"
        ) from None
    if not isinstance(result, dict):
        raise _error(
            502,
            f"prefill instance {p.url} answered with a JSON {type(result).__name__}, not an object",
        )
    params = result.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise _error(
            502,
            f"prefill instance {p.url} answered with kv_transfer_params of type "
            f"{type(params).__name__}, not an object (is it running a KV connector as "
            "kv_producer?)",
        )
    return result


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance computes the prompt's KV and one token nobody reads."""
    out = {
        k: v
        for k, v in body.items()
        if k not in ("stream", "stream_options", "min_tokens", "n", "best_of")
    }
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = kv_transfer_params
    return out


class Proxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        flow: str = "push",
        timeout: float | None = None,
        read_timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 4096,
        first_token: int = 0,
    ) -> None:
        """``timeout``: seconds a request may take end to end (None: no cap);
        ``read_timeout``: seconds an upstream may send nothing; ``max_connections``: open
        upstream connections at most (aiohttp's default, 100, queued the 101st concurrent
        request behind the others); ``first_token``: in the push flow, streamed
        completions whose prompt is at most this long take their first token from the
        prefill (:mod:`kvbridge.proxy.firsttoken`; 0: none do)."""
        if flow not in FLOWS:
            raise ValueError(f"flow must be one of {', '.join(FLOWS)}, got {flow!r}")
        if first_token < 0:
            raise ValueError(f"first_token must be 0 or more tokens, got {first_token}")
        self.first_token = first_token
        self.prefill = Pool("prefill", prefill)
        self.decode = Pool("decode", decode)
        self.flow = flow
        self._timeout = aiohttp.ClientTimeout(
            total=timeout or None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._probing: dict[str, asyncio.Task[None]] = {}
        """Prefill URL -> the probe of its DP ranks in flight (:meth:`_probe_once`)."""
        self._watching: dict[tuple[str, str], asyncio.Task[None]] = {}
        """(role, URL) -> the background probe of an instance marked down (:meth:`_down`)."""

    # --- application ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_connections)
        )

    async def _stop(self, app: web.Application) -> None:
        for task in list(self._watching.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def _down(self, i: Instance, error: str) -> None:
        """``i`` failed: no client's request goes to it until a background probe of its
        ``/health`` answers 200 (every :data:`PROBE_S` seconds)."""
        i.mark_down(error)
        key = (i.role, i.url)
        if key not in self._watching:
            task = asyncio.create_task(self._watch(i))
            self._watching[key] = task
            task.add_done_callback(lambda _: self._watching.pop(key, None))

    async def _watch(self, i: Instance) -> None:
        while not i.up:
            await asyncio.sleep(PROBE_S)  # polling another process: it sends no event
            if await self._unhealthy(i, 2 * PROBE_S) is None:
                if i.role == "prefill":  # a restarted prefill has new side channels
                    i.addresses.clear()
                    i.dp_size = None
                log.info("%s instance %s answers again", i.role, i.url)
                i.mark_up()

    async def _unhealthy(self, i: Instance, timeout_s: float) -> str | None:
        """Why ``i``'s ``/health`` did not answer 200 within ``timeout_s``; None if it did."""
        probe = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.get(f"{i.url}/health", timeout=probe) as resp:
                return None if resp.status == 200 else f"/health answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "proxy not started"
        return self._session

    # --- handlers ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def models(self, request: web.Request) -> web.Response:
        d = self.decode.pick()
        assert d is not None
        try:
            async with self.session.get(f"{d.url}/v1/models") as resp:
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type="application/json"
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._down(d, str(exc))
            return _error(502, f"decode instance {d.url} unreachable: {exc}").response()

    async def health(self, request: web.Request) -> web.Response:
        ok = any(i.up for i in self.prefill.instances) and any(i.up for i in self.decode.instances)
        return web.json_response(
            {
                "ok": ok,
                "flow": self.flow,
                "prefill": self.prefill.states(),
                "decode": self.decode.states(),
            },
            status=200 if ok else 503,
        )

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = parse_request(await request.read())
        except UpstreamError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes").response()
        p, d = self.prefill.pick(), self.decode.pick()
        assert p is not None and d is not None
        d.inflight += 1
        retried = False
        try:
            while True:
                p.inflight += 1
                try:
                    if self.flow in ("pull", "sequential"):
                        return await self._pull(request, path, body, p, d)
                    if firsttoken.eligible(path, body, self.first_token):
                        return await self._first_token(request, path, body, p, d)
                    return await self._push(request, path, body, p, d)
                except UpstreamError as exc:
                    other = None if retried or not exc.retry else self.prefill.pick(avoid=p)
                    if other is None or other is p or not other.up:
                        return exc.response()
                    log.warning(
                        "prefill instance %s failed before the client got anything; the "
                        "request goes to %s",
                        p.url,
                        other.url,
                    )
                finally:
                    p.inflight -= 1
                p, retried = other, True
        finally:
            d.inflight -= 1

    # --- flows ---------------------------------------------------------------------------

    async def _push(
        self, request: web.Request, path: str, body: dict[str, Any], p: Instance, d: Instance
    ) -> web.StreamResponse:
        address, dp_rank = await self._address(p)
        tid, ticket = uuid.uuid4().hex, new_ticket()
        p_body = prefill_body(
            body, {"kvbridge": {"transfer_id": tid, "role": "prefill", "ticket": ticket}}
        )
        d_body = dict(
            body,
            kv_transfer_params={
                "kvbridge": {
                    "transfer_id": tid,
                    "role": "decode",
                    "prefill": address,
                    "ticket": ticket,
                }
            },
        )
        p_task = asyncio.create_task(self._call_prefill(p, path, p_body, dp_rank=dp_rank))
        d_task = asyncio.create_task(self._open(d, path, d_body))
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                d_task.cancel()  # nothing will come for it: abort the decode request
                raise p_task.exception()  # type: ignore[misc]
            d_resp, first = await self._decode_answer(p, d, d_task, p_task)
            try:
                return await self._relay(request, d, d_resp, first)
            finally:
                d_resp.release()
        finally:
            for task in (p_task, d_task):
                if not task.done():
                    task.cancel()
            if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
                log.warning("prefill for %s failed: %s", tid, p_task.exception())

    async def _decode_answer(
        self,
        p: Instance,
        d: Instance,
        opening: Awaitable[aiohttp.ClientResponse],
        p_task: asyncio.Task[Any] | None = None,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Decode ``d``'s answer (``opening``: :meth:`_open` of it) and, for a stream, its
        first bytes (:meth:`_first_event`), before the client gets anything. A failure
        there (a 5xx, or an error event first) is retried elsewhere if prefill ``p`` died
        (:meth:`_retry_if_lost`). The caller releases the answer; on a raise it is
        released here."""
        try:
            d_resp = await opening
        except UpstreamError as exc:
            if exc.status >= 500:
                await self._retry_if_lost(p, d)
            raise
        try:
            first = await self._first_event(d, d_resp, p_task)
            if _is_error_event(first):
                await self._retry_if_lost(p, d)
        except BaseException:
            d_resp.release()
            raise
        return d_resp, first

    async def _retry_if_lost(self, p: Instance, d: Instance) -> None:
        """Decode ``d`` failed a request (a 5xx, or a stream's first event an error)
        before anything of it reached the client, and prefill ``p`` had answered: if
        ``p`` is gone (down already, or its ``/health`` does not answer 200 within
        :data:`LOST_PROBE_S`), its KV went with it, so raise an error the caller retries
        on another prefill: a prefill killed while its KV waited for the decode costs
        the client a retry, not an error. A prefill that answers leaves the failure the
        decode's, and the client gets it."""
        if p.up:
            error = await self._unhealthy(p, LOST_PROBE_S)
            if error is None:
                return
            self._down(p, error)
        raise _error(
            502,
            f"prefill instance {p.url} died before decode instance {d.url} had the request's KV",
            retry=True,
        )

    async def _pull(
        self, request: web.Request, path: str, body: dict[str, Any], p: Instance, d: Instance
    ) -> web.StreamResponse:
        result = await self._call_prefill(p, path, prefill_body(body, {"do_remote_decode": True}))
        params = result.get("kv_transfer_params")
        if not params and self.flow == "pull":
            raise _error(
                502,
                f"prefill instance {p.url} returned no kv_transfer_params (is it running with "
                "kvbridge or NixlConnector as "
                "kv_producer? connectors that share KV through storage need --flow sequential)",
            )
        return await self._decode_from(request, path, body, params, p, d)

    async def _decode_from(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        p: Instance,
        d: Instance,
    ) -> web.StreamResponse:
        """Decode ``d`` answers the client's request whole from prefill ``p``'s KV
        (``params``: the prefill's ``kv_transfer_params``), relayed to the client: the
        P-first flows' second half."""
        d_resp, first = await self._decode_answer(
            p, d, self._open(d, path, dict(body, kv_transfer_params=params) if params else body)
        )
        try:
            return await self._relay(request, d, d_resp, first)
        finally:
            d_resp.release()

    # --- upstream calls ------------------------------------------------------------------

    async def _address(self, p: Instance) -> tuple[dict[str, Any], int | None]:
        """The side channel of the prefill DP rank that ``p``'s next push-flow request goes
        to, and that rank (None: send it unrouted). The DP ranks are round robin; a prefill
        instance's are probed once, at its first push-flow request (:meth:`_probe`), which
        leaves the address of every rank it routes over in ``p.addresses``."""
        if p.dp_size is None:
            await self._probe_once(p)
        rank = p.next_dp_rank()
        if rank is None:
            return p.addresses[min(p.addresses)], None
        return p.addresses[rank], rank

    async def _probe_once(self, p: Instance) -> None:
        """:meth:`_probe` ``p`` once however many requests wait for it: a cold proxy that
        gets many requests at once probes each prefill instance once. A failure fails its
        waiters; the next request probes again."""
        task = self._probing.get(p.url)
        if task is None:
            task = asyncio.create_task(self._probe(p))
            self._probing[p.url] = task

            def forget(done: asyncio.Task[None], url: str = p.url) -> None:
                self._probing.pop(url, None)
                if not done.cancelled():
                    done.exception()  # retrieved here too: its waiters may all be gone

            task.add_done_callback(forget)
        # shielded: a client that disconnects cancels its own wait, not the others'
        await asyncio.shield(task)

    async def _probe(self, p: Instance) -> None:
        """Learn ``p``'s data-parallel ranks: discover DP rank 0, 1, ... (routed by vLLM's
        ``X-data-parallel-rank`` header) until the instance refuses a rank (vLLM answers
        4xx for a rank beyond its ``--data-parallel-size``) or answers from another one.
        An instance that routes not even rank 0 gets its requests unrouted."""
        rank = 0
        while rank < MAX_DP_RANKS:
            try:
                answered = await self._discover(p, rank)
            except UpstreamError as exc:
                if not 400 <= exc.status < 500 or exc.status == 404:
                    raise
                break
            if answered != rank:
                break
            rank += 1
        if not p.addresses:
            await self._discover(p, None)
        p.dp_size = rank
        if rank > 1:
            log.info("prefill instance %s: %d data-parallel ranks", p.url, rank)

    async def _discover(self, p: Instance, rank: int | None) -> int:
        """Ask prefill ``p`` (its DP rank ``rank``, when given) where its side channel is;
        the answer is recorded in ``p.addresses`` (:meth:`_call_prefill`). Returns the DP
        rank that answered."""
        body = {
            "prompt": [1, 2, 3],
            "max_tokens": 1,
            "kv_transfer_params": {
                "kvbridge": {"transfer_id": uuid.uuid4().hex, "role": "prefill", "flow": "discover"}
            },
        }
        result = await self._call_prefill(p, "/v1/completions", body, serving=False, dp_rank=rank)
        address = _side_channel(result)
        if address is None:
            raise _error(
                502,
                f"prefill instance {p.url} did not say where its kvbridge side channel is (is it "
                "running with kvbridge as kv_producer?)",
            )
        return int(address.get("dp_rank", 0))

    async def _call_prefill(
        self,
        p: Instance,
        path: str,
        body: dict[str, Any],
        *,
        serving: bool = True,
        dp_rank: int | None = None,
    ) -> dict[str, Any]:
        """POST ``body`` to prefill ``p``; ``serving``: for a client's request (counted in
        ``served``), not the proxy's own discovery; ``dp_rank``: to that data-parallel
        rank of ``p`` (vLLM's ``X-data-parallel-rank``), else wherever ``p`` puts it."""
        headers = {DP_HEADER: str(dp_rank)} if dp_rank is not None else None
        try:
            async with self.session.post(f"{p.url}{path}", json=body, headers=headers) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    raise UpstreamError(
                        resp.status, data, resp.headers.get("Content-Type", "application/json")
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._down(p, f"{type(exc).__name__}: {exc}")
            raise _error(
                502,
                f"prefill instance {p.url} unreachable: {type(exc).__name__}: {exc}",
                retry=True,
            ) from exc
        p.mark_up()
        if serving:
            p.served += 1
        result, address = read_prefill_answer(p, data)
        if address is not None:
            p.learn(address)
        return result

    async def _open(self, d: Instance, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            resp = await self.session.post(f"{d.url}{path}", json=body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._down(d, f"{type(exc).__name__}: {exc}")
            raise _error(
                502, f"decode instance {d.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status >= 400:
            data = await resp.read()
            resp.release()
            raise UpstreamError(
                resp.status, data, resp.headers.get("Content-Type", "application/json")
            )
        d.mark_up()
        return resp

    async def _first_event(
        self,
        d: Instance,
        upstream: aiohttp.ClientResponse,
        p_task: asyncio.Task[Any] | None = None,
    ) -> bytes:
        """A streamed decode answer's first bytes (b"" for an answer that is not a stream),
        read before the client gets its status line: until they come, the request can
        still go to another prefill. The decode answers its headers at once and its first
        event with the first token, once the KV is in; if the prefill (``p_task``, the
        push flow's, still running) fails first, its error is raised, and the caller's
        release of ``upstream`` closes the decode's request (vLLM aborts it)."""
        if "text/event-stream" not in upstream.headers.get("Content-Type", ""):
            return b""
        read = asyncio.ensure_future(upstream.content.readany())
        waits = {read} if p_task is None else {read, p_task}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not read.done() and p_task is not None and p_task.exception() is not None:
                raise p_task.exception()  # type: ignore[misc]
            return await read
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._down(d, f"{type(exc).__name__}: {exc}")
            raise _error(
                502, f"decode instance {d.url} failed before its first event: {describe(exc)}"
            ) from exc
        finally:
            read.cancel()

    async def _relay(
        self,
        request: web.Request,
        d: Instance,
        upstream: aiohttp.ClientResponse,
        first: bytes = b"",
    ) -> web.StreamResponse:
        """Relay the decode's answer to the client, a stream after its ``first`` bytes
        (already read: :meth:`_first_event`)."""
        content_type = upstream.headers.get("Content-Type", "application/json")
        try:
            if "text/event-stream" not in content_type:
                data = await upstream.read()
                d.served += 1
                return web.Response(
                    body=data, status=upstream.status, content_type=content_type.split(";")[0]
                )
            out = web.StreamResponse(
                status=upstream.status,
                headers={"Content-Type": content_type, "Cache-Control": "no-cache"},
            )
            await out.prepare(request)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._down(d, f"{type(exc).__name__}: {exc}")
            raise _error(
                502, f"decode instance {d.url} failed mid-response: {type(exc).__name__}: {exc}"
            ) from exc
        await self._pump(out, d, upstream, first)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out

    async def _pump(
        self,
        out: web.StreamResponse,
        d: Instance,
        upstream: aiohttp.ClientResponse,
        first: bytes = b"",
        stitch: firsttoken.Stitch | None = None,
    ) -> None:
        """Copy decode ``d``'s stream to the client's (``out``, prepared), after its
        ``first`` bytes, through ``stitch`` when given. The decode failing ends the
        client's stream with an error event (:meth:`_end_stream`); the client hanging up
        ends the copy (the caller's release of ``upstream`` makes vLLM abort it)."""
        tail = b"\n\n"  # the stream's last bytes: whether it stopped between two events
        try:
            if first:
                await _to_client(out, first)
                tail = (tail + first)[-2:]
            async for chunk in upstream.content.iter_any():
                data = chunk if stitch is None else stitch.feed(chunk)
                if data:
                    await _to_client(out, data)
                    tail = (tail + data)[-2:]
            if stitch is not None and (rest := stitch.rest()):
                await _to_client(out, rest)
                tail = (tail + rest)[-2:]
        except _ClientGone:
            # the client hung up: not the decode's failure; leaving closes the upstream
            # request, which makes the decode abort it
            log.debug("a client of %s hung up mid-stream", d.url)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # the status line is sent: end the stream as vLLM's server ends a failed one
            self._down(d, f"{type(exc).__name__}: {exc}")
            message = f"decode instance {d.url} failed mid-stream: {type(exc).__name__}: {exc}"
            await _end_stream(out, message, tail)
        except firsttoken.OversizedEvent as exc:
            await _end_stream(out, f"decode instance {d.url} {exc}", tail)
        else:
            d.served += 1

    async def _first_token(
        self, request: web.Request, path: str, body: dict[str, Any], p: Instance, d: Instance
    ) -> web.StreamResponse:
        """The prefill's first token (:mod:`kvbridge.proxy.firsttoken`): prefill ``p``
        first; its token streamed to the client at once; then decode ``d`` continues
        from it. Until the client has the token a failure is the prefill's (retried
        elsewhere as in the other flows); after, it ends the stream with an error event.
        A client gone before the decode opened, or a decode that refuses the request
        outright (an HTTP error before any event), leaves the prefill's blocks to its
        lease, as in the P-first flow. A first token that is part of a character is not
        streamed: the decode then answers the client's request whole (P-first)."""
        result = await self._call_prefill(p, path, firsttoken.prefill_body(body, uuid.uuid4().hex))
        try:
            first = firsttoken.First(result)
        except firsttoken.MalformedAnswer as exc:
            raise _error(502, f"prefill instance {p.url} answered with {exc}") from None
        if not first.last and not first.whole:
            # part of a character (First.whole): nothing sent yet; the decode computes
            # the first token itself from the prefill's KV, as in the P-first flow
            return await self._decode_from(request, path, body, first.params, p, d)
        stitch = firsttoken.Stitch(body, first)
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            },
        )
        await out.prepare(request)
        try:
            await _to_client(out, stitch.opening())
            if not first.last:
                try:
                    d_resp = await self._open(d, path, firsttoken.decode_body(body, first))
                except UpstreamError as exc:
                    await _end_stream(out, _message(exc, f"decode instance {d.url}"))
                else:
                    try:
                        await self._pump(out, d, d_resp, stitch=stitch)
                    finally:
                        d_resp.release()
        except _ClientGone:
            log.debug("a client hung up after its first token")
            return out
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out


def _message(exc: UpstreamError, who: str) -> str:
    """What an upstream's error says, for an error event, prefixed with ``who``."""
    body = exc.body
    if isinstance(body, bytes):
        with contextlib.suppress(ValueError, RecursionError):
            body = json.loads(body)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"].get("message", body)
    return f"{who} answered {exc.status}: {str(body)[:1000]}"


async def _end_stream(out: web.StreamResponse, message: str, tail: bytes = b"\n\n") -> None:
    """End the client's stream (its status line sent) with an error event and
    ``[DONE]``, as vLLM's server ends a failed stream; ``tail``: the stream's last two
    bytes so far (an event cut short is ended first)."""
    log.warning("%s", message)
    event = b"data: " + json.dumps(_error(502, message).body).encode()
    event += b"\n\ndata: [DONE]\n\n"
    with contextlib.suppress(_ClientGone):
        await _to_client(out, event if tail == b"\n\n" else b"\n\n" + event)


def _is_error_event(first: bytes) -> bool:
    """Whether a decode stream's first bytes (:meth:`Proxy._first_event`) are an error
    event (vLLM's ``{"error": ...}``, or an older ``"object": "error"``)."""
    if not first.startswith(b"data: "):
        return False
    try:
        event = json.loads(first[6:].split(b"\n\n", 1)[0])
    except (ValueError, RecursionError):
        return False
    return isinstance(event, dict) and ("error" in event or event.get("object") == "error")


class _ClientGone(Exception):
    """Writing to the client failed: it hung up (:func:`_to_client`)."""


async def _to_client(out: web.StreamResponse, data: bytes) -> None:
    """Write ``data`` to the client; its hang-up raises :class:`_ClientGone`, which the
    relay must not take for a failure of the decode (aiohttp raises
    ``ClientConnectionResetError``, an ``aiohttp.ClientError`` like the upstream's)."""
    try:
        await out.write(data)
    except ConnectionError as exc:
        raise _ClientGone from exc


async def serve(proxy: Proxy, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled. Client disconnects cancel their handler (and so the
    upstream requests, which makes vLLM abort them)."""
    runner = web.AppRunner(proxy.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info(
        "kvbridge proxy on http://%s:%d (%s flow), prefill %s, decode %s",
        host,
        port,
        proxy.flow,
        [i.url for i in proxy.prefill.instances],
        [i.url for i in proxy.decode.instances],
    )
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["Proxy", "prefill_body", "serve"]
