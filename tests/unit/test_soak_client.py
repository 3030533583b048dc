"""The soak benchmark's clients (``benchmarks/soak.py``) through a real ``kvbridge proxy``
(in process) in front of stand-in instances: what they count as completed, hung up,
failed and wrong, so that a soak's verdict means what it says. The soak itself runs on
real vLLM (``benchmarks/run.py soak``)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from upstreams import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak  # benchmarks/ is not a package: on sys.path above

from kvbridge.proxy.app import Proxy

ADDRESS = {"address": "127.0.0.1:1", "engine_id": "p", "epoch": "e1"}


def output(prompt: list[int], n: int) -> list[int]:
    """The stand-in model: a function of the prompt."""
    return [(sum(prompt) + 7 * i) % 2048 for i in range(n)]


class StandIns:
    """A prefill and a decode stand-in; the decode streams one token every ``token_s``,
    answers ``wrong_for`` prompts with other tokens and fails requests whose prompt
    is ``fail_for`` long. ``cancelled`` counts the decode requests whose client went
    away (the proxy closed them)."""

    def __init__(self, token_s: float = 0.01, wrong_for: int = -1, fail_for: int = -1) -> None:
        self.token_s, self.wrong_for, self.fail_for = token_s, wrong_for, fail_for
        self.cancelled = 0
        self.runners: list[web.AppRunner] = []

    async def prefill(self, request: web.Request) -> web.Response:
        await request.json()
        return web.json_response(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"kvbridge": {"prefill": ADDRESS}}}
        )

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = output(prompt, body["max_tokens"])
        if len(prompt) == self.wrong_for:
            ids = [i + 1 for i in ids]
        if len(prompt) == self.fail_for:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.token_s * len(ids))
                return web.json_response({"choices": [{"text": "", "token_ids": ids}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in ids:
                await asyncio.sleep(self.token_s)
                event = {"choices": [{"text": "t", "token_ids": [i]}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_running 0.0\n")

    async def serve(self, app: web.Application) -> str:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.metrics)
        runner, url = await serve(app, handler_cancellation=True)
        self.runners.append(runner)
        return url

    async def soak(self, duration: float, clients: int, timeout: float = 10.0) -> soak.Tally:
        p_app, d_app = web.Application(), web.Application()
        p_app.router.add_post("/v1/completions", self.prefill)
        d_app.router.add_post("/v1/completions", self.decode)
        p_url, d_url = await self.serve(p_app), await self.serve(d_app)
        proxy = await self.serve(Proxy([p_url], [d_url]).app())
        pool = soak.pool_prompts(3)
        refs = [output(p, soak.POOL_TOKENS) for p in pool]
        servers: dict[str, Any] = {"prefill": SimpleNamespace(url=p_url)}
        try:
            tally, timeline, _ = await soak.drive(
                proxy, servers, pool, refs, duration, clients, timeout, seed=3
            )
        finally:
            for runner in self.runners:
                await runner.cleanup()
        assert timeline and timeline[0]["prefill"]["vllm:kv_cache_usage_perc"] == 0.0
        return tally


def test_a_clean_soak_counts_completions_and_hang_ups_and_no_error() -> None:
    stand_ins = StandIns(token_s=0.04)  # slow enough for a hang-up before the answer
    t = asyncio.run(stand_ins.soak(duration=4.0, clients=16))
    assert t.failed == 0 and t.wrong == 0, (t.first_errors, t.first_wrong)
    # how many complete in 4 s depends on the machine's load (CI: 30 beside engine tests)
    assert t.sent == t.completed + t.hung_up and t.completed >= 16 and t.checked >= 5
    assert t.hung_up_mid >= 1 and t.hung_up > t.hung_up_mid, "both kinds of hang-up happen"
    assert stand_ins.cancelled >= t.hung_up_mid, "a hang-up reaches the decode as a disconnect"
    assert len(t.latency_ms) == t.completed and t.ttft_ms


def test_wrong_outputs_and_errors_are_counted_with_their_text() -> None:
    pool = soak.pool_prompts(3)
    stand_ins = StandIns(wrong_for=len(pool[0]), fail_for=len(pool[1]))
    t = asyncio.run(stand_ins.soak(duration=3.0, clients=12))
    assert t.wrong and t.first_wrong[0]["pool"] == 0
    assert (
        t.failed
        and "HTTP 500" in t.first_errors[0]["error"]
        and "boom" in t.first_errors[0]["error"]
    )


def test_a_request_past_its_deadline_fails() -> None:
    t = asyncio.run(StandIns(token_s=0.5).soak(duration=1.0, clients=4, timeout=0.3))
    assert t.failed and all("deadline" in e["error"] for e in t.first_errors)


def test_the_mix_is_mostly_short_half_streamed_and_hangs_up_sometimes() -> None:
    rng, pool = random.Random(0), soak.pool_prompts(1)
    plans = [soak.plan(rng, pool) for _ in range(4000)]
    long = sum(len(p.prompt) >= soak.LONG[0] for p in plans) / len(plans)
    assert 0.05 < long < 0.3  # the pool has its own few long ones
    assert 0.45 < sum(p.stream for p in plans) / len(plans) < 0.55
    assert 0.45 < sum(p.pool is not None for p in plans) / len(plans) < 0.55
    assert all(p.stream and 1 <= p.hang_tokens < p.max_tokens for p in plans if p.hang == "mid")
    assert 0.02 < sum(p.hang == "early" for p in plans) / len(plans) < 0.08
    assert soak.pool_prompts(1) == pool and len({len(p) for p in pool}) > 3
    assert soak.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and soak.percentile([], 99) is None


class StepGauges:
    """An instance that, like vLLM, exports its gauges as of its last engine step (a
    request), while what it holds falls on its own: ``held`` messages kept early,
    dropped (the level falls to 0) once ``expire`` is set, with no step."""

    def __init__(self) -> None:
        self.expire = threading.Event()
        self.reported = 1.0  # the gauge as of the last step: one message kept early
        self.steps = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # /metrics
                self.answer(
                    f"vllm:kv_cache_usage_perc 0.0\nvllm:kvbridge_sends_early {outer.reported}\n"
                )

            def do_POST(self) -> None:  # /v1/completions: one engine step
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.steps += 1
                outer.reported = 0.0 if outer.expire.is_set() else 1.0
                self.answer(json.dumps({"choices": [{"text": "", "token_ids": [1]}]}))

            def answer(self, text: str) -> None:
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_idle_check_makes_an_idle_engine_report_a_level_that_fell_without_a_step() -> None:
    instance = StepGauges()
    try:
        servers: dict[str, Any] = {"prefill": instance}
        baseline = {"prefill": soak.watched(instance.url)}
        done, after, _ = soak.back_to_baseline(servers, baseline, timeout=1.0)
        assert not done and after["prefill"]["vllm:kvbridge_sends_early"] == 1.0, (
            "a message still held is not at rest"
        )
        instance.expire.set()  # dropped after the lease, the engine idle
        done, after, _ = soak.back_to_baseline(servers, baseline, timeout=5.0)
        assert done and after["prefill"]["vllm:kvbridge_sends_early"] == 0.0
        assert instance.steps >= 1
    finally:
        instance.server.shutdown()
        instance.server.server_close()
