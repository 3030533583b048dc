"""Soak: many concurrent clients through ``kvbridge proxy`` for a long time, and every
instance back to where it started afterwards (issue 46: zero errors, KV usage back to
baseline).

Set-up:

- the ``tiny`` model, block size 32, chunked prefill above 256 tokens (long prompts take
  several forwards), prefix caching on (vLLM's default: prompts of the pool below come
  back and hit it); a prefill (``kv_producer``) pinned to core 0 and a decode
  (``kv_consumer``, ``kv_load_failure_policy: fail``, so a failed load is an error and
  never a silent recompute) pinned to core 1, both ``KVBridgeConnector`` over NIXL with
  a :data:`KV_CACHE_MB` cache; ``kvbridge proxy`` (push flow) in front; a colocated
  reference (core 1) that computes the pool's outputs once and is stopped before the
  soak starts;
- baselines: each instance's ``vllm:kv_cache_usage_perc`` and kvbridge's gauges, read
  after the servers' warm-up and the references;
- ``clients`` asyncio clients (aiohttp) run back to back for ``duration`` seconds, each
  with a random generator of its own seed. A request (:func:`plan`): a prompt of a
  length drawn mostly short, sometimes long (:data:`SHORT`, :data:`LONG`); half of them
  from a pool of :data:`POOL` fixed prompts whose output is checked token for token
  against the colocated reference, the others fresh random prompts (checked for their
  length: ``ignore_eos``); half streamed; a share of the clients hang up on purpose,
  mid-stream after some tokens (:data:`HANG_MID`) or before the answer (:data:`HANG_EARLY`),
  closing their connection; every request has its own deadline (``request_timeout``);
- every :data:`SAMPLE_S` seconds both instances' metrics are sampled (the timeline);
- at the end, after the last request: each instance polled (it sends no event) until
  its KV usage is back at its baseline and no kvbridge request gauge counts a request,
  within :data:`IDLE_TIMEOUT_S`; then the counts, the first error texts, latency
  percentiles, usage and gauges before and after, and whether every process still runs.
  ``ok`` (the driver's exit status) needs no failure, no wrong output, every instance
  idle at its baseline and every process alive.

The servers' and the proxy's logs stay in ``<out>/soak-raw/``; the document counts the
lines of those logs that look like errors (:data:`LOG_PROBLEMS`) and quotes the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from serving import fresh_dir

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.run import prom
from kvbridge.demo.servers import (
    VllmServer,
    complete,
    random_prompt,
    start_all,
    start_proxy,
)
from kvbridge.runtime.stats import REQUEST_GAUGES

BLOCK = 32
CHUNK = 256
KV_CACHE_MB = 256
SHORT = (4, 160)
"""Token counts of a short prompt (uniform)."""
LONG = (300, 1500)
"""Token counts of a long prompt (uniform): several chunks of :data:`CHUNK`."""
LONG_SHARE = 0.15
POOL = 12
"""Fixed prompts whose output is checked (each computed once by the colocated reference)."""
POOL_SHARE = 0.5
POOL_TOKENS = 16
"""Output tokens of a pool prompt."""
OUTPUT = (1, 48)
"""Output tokens of a fresh prompt (uniform)."""
STREAM_SHARE = 0.5
HANG_MID = 0.08
"""Share of requests (streamed ones) that hang up after some tokens."""
HANG_EARLY = 0.05
"""Share of requests that hang up 0-1 s after sending (before the answer, unless it came)."""
THINK_S = 0.5
"""A client waits up to this long (uniform) between two requests."""
SAMPLE_S = 5.0
IDLE_TIMEOUT_S = 120.0
"""How long every instance has, after the last request, to come back to its baseline
(more than ``timeouts.lease_s``, 60 s: what a client hanging up early leaves)."""
TICK_TOKEN = 7
"""The prompt of :func:`tick`."""
USAGE = "vllm:kv_cache_usage_perc"
IN_FLIGHT = tuple(f"vllm:kvbridge_{name}" for name in REQUEST_GAUGES)
"""kvbridge's gauges of transfers in flight: 0 on an idle instance."""
WATCHED = (USAGE, "vllm:num_requests_running", "vllm:num_requests_waiting", *IN_FLIGHT)
COUNTED = ("requests_sent", "requests_received", "failures", "aborted", "leases_expired")
"""kvbridge counters whose growth during the run the summary shows (``_total``)."""
LOG_PROBLEMS = ("Traceback", "ERROR", "corrupted", "Segmentation fault", "core dumped")
"""Substrings of a log line counted as a problem (with their first lines quoted)."""
FIRST = 10
"""How many error texts (and wrong outputs, log lines) the document quotes."""


@dataclass(frozen=True)
class Plan:
    """One request: what to send and how the client behaves."""

    prompt: list[int]
    max_tokens: int
    stream: bool
    hang: str | None
    """``mid`` (after ``hang_tokens`` tokens), ``early`` (after ``hang_s``) or None."""
    hang_tokens: int = 0
    hang_s: float = 0.0
    pool: int | None = None
    """Index of the pool prompt (its output is checked), None for a fresh one."""


def prompt_length(rng: random.Random) -> int:
    return rng.randint(*(LONG if rng.random() < LONG_SHARE else SHORT))


def pool_prompts(seed: int) -> list[list[int]]:
    """The checked prompts: fixed for a seed, of the soak's mix of lengths (the first of
    each kind guaranteed)."""
    rng = random.Random(seed)
    lengths = [SHORT[0], LONG[1]] + [prompt_length(rng) for _ in range(POOL - 2)]
    return [random_prompt(n, seed=seed * 1000 + i) for i, n in enumerate(lengths)]


def plan(rng: random.Random, pool: list[list[int]]) -> Plan:
    """A request of the soak's mix, drawn from ``rng``."""
    stream = rng.random() < STREAM_SHARE
    if rng.random() < POOL_SHARE:
        k: int | None = rng.randrange(len(pool))
        prompt, max_tokens = pool[k], POOL_TOKENS
    else:
        k = None
        prompt = random_prompt(prompt_length(rng), seed=rng.getrandbits(48))
        max_tokens = rng.randint(*OUTPUT)
    roll = rng.random()
    if stream and max_tokens > 1 and roll < HANG_MID:
        return Plan(prompt, max_tokens, stream, "mid", hang_tokens=rng.randint(1, max_tokens - 1))
    if HANG_MID <= roll < HANG_MID + HANG_EARLY:
        return Plan(prompt, max_tokens, stream, "early", hang_s=rng.uniform(0.0, 1.0), pool=k)
    return Plan(prompt, max_tokens, stream, None, pool=k)


class Failed(Exception):
    """A request's answer was an error (status, error event, a stream cut short)."""


class HungUp(Exception):
    """The client closed the connection on purpose."""


@dataclass
class Tally:
    """What the clients saw; ``latency_ms``/``ttft_ms`` of completed requests only."""

    sent: int = 0
    completed: int = 0
    hung_up: int = 0
    hung_up_mid: int = 0
    failed: int = 0
    wrong: int = 0
    checked: int = 0
    streamed: int = 0
    long: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Error text (first 300 characters) -> how often."""
    first_errors: list[dict[str, Any]] = field(default_factory=list)
    first_wrong: list[dict[str, Any]] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)

    def fail(self, t: float, p: Plan, text: str) -> None:
        self.failed += 1
        text = text[:300]
        self.errors[text] = self.errors.get(text, 0) + 1
        if len(self.first_errors) < FIRST:
            self.first_errors.append(
                {"t_s": round(t, 2), "tokens": len(p.prompt), "stream": p.stream, "error": text}
            )


async def exchange(
    session: aiohttp.ClientSession, url: str, p: Plan, start: float
) -> tuple[list[int], float | None]:
    """Send ``p`` and read its answer: the output token ids and the time to the first
    one (streamed only). Raises :class:`Failed` for an error answer and :class:`HungUp`
    when ``p`` hangs up mid-stream (the connection closed)."""
    body: dict[str, Any] = {
        "prompt": p.prompt,
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if p.stream:
        body["stream"] = True
    loop = asyncio.get_running_loop()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise Failed(f"HTTP {resp.status}: {(await resp.text())[:250]}")
        if not p.stream:
            doc = await resp.json()
            return list(doc["choices"][0].get("token_ids") or []), None
        ids: list[int] = []
        ttft = None
        async for raw in resp.content:  # one SSE line at a time
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return ids, ttft
            event = json.loads(data)
            if "error" in event:
                raise Failed(f"error event in the stream: {json.dumps(event['error'])[:250]}")
            new = event["choices"][0].get("token_ids") or []
            if new and ttft is None:
                ttft = loop.time() - start
            ids += new
            if p.hang == "mid" and len(ids) >= p.hang_tokens:
                resp.close()  # not back to the pool: the proxy sees the connection go
                raise HungUp
        raise Failed(f"the stream ended without [DONE] after {len(ids)} tokens")


async def request(
    session: aiohttp.ClientSession,
    url: str,
    p: Plan,
    refs: list[list[int]],
    timeout: float,
    tally: Tally,
    t0: float,
) -> None:
    """One request of ``p``, its outcome counted in ``tally``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tally.sent += 1
    tally.streamed += p.stream
    tally.long += len(p.prompt) >= LONG[0]
    task = asyncio.ensure_future(exchange(session, url, p, start))
    try:
        async with asyncio.timeout(timeout):
            if p.hang == "early":
                done, _ = await asyncio.wait({task}, timeout=p.hang_s)
                if not done:
                    task.cancel()  # closes the connection before the answer
                    tally.hung_up += 1
                    return
            ids, ttft = await task
    except HungUp:
        tally.hung_up += 1
        tally.hung_up_mid += 1
        return
    except TimeoutError:
        tally.fail(start - t0, p, f"no answer within the request's deadline of {timeout:.0f} s")
        return
    except (Failed, aiohttp.ClientError, ValueError, LookupError, TypeError) as exc:
        tally.fail(start - t0, p, f"{type(exc).__name__}: {exc}")
        return
    finally:
        if not task.done():
            task.cancel()
    tally.completed += 1
    tally.latency_ms.append(round(1e3 * (loop.time() - start), 1))
    if ttft is not None:
        tally.ttft_ms.append(round(1e3 * ttft, 1))
    expected = refs[p.pool] if p.pool is not None else None
    if p.pool is not None:
        tally.checked += 1
    if (expected is not None and ids != expected) or len(ids) != p.max_tokens:
        tally.wrong += 1
        if len(tally.first_wrong) < FIRST:
            tally.first_wrong.append(
                {
                    "t_s": round(start - t0, 2),
                    "pool": p.pool,
                    "tokens": len(p.prompt),
                    "stream": p.stream,
                    "got": ids,
                    "expected": expected,
                    "max_tokens": p.max_tokens,
                }
            )


async def client(
    i: int,
    session: aiohttp.ClientSession,
    url: str,
    pool: list[list[int]],
    refs: list[list[int]],
    end: float,
    timeout: float,
    seed: int,
    tally: Tally,
    t0: float,
) -> None:
    rng = random.Random(seed * 100_003 + i)
    loop = asyncio.get_running_loop()
    await asyncio.sleep(rng.uniform(0.0, 2.0))  # not all at the same instant
    while loop.time() < end:
        await request(session, url, plan(rng, pool), refs, timeout, tally, t0)
        await asyncio.sleep(rng.uniform(0.0, THINK_S))


def watched(url: str) -> dict[str, Any]:
    """The instance's :data:`WATCHED` metrics and every kvbridge metric (``error``: its
    ``/metrics`` did not answer)."""
    try:
        got = prom(url, prefix="vllm:")
    except OSError as exc:  # URLError too
        return {"error": str(exc)[:200]}
    return {k: v for k, v in got.items() if k in WATCHED or k.startswith("vllm:kvbridge_")}


async def sampler(
    servers: dict[str, VllmServer],
    tally: Tally,
    t0: float,
    stop: asyncio.Event,
    timeline: list[dict[str, Any]],
) -> None:
    """Every :data:`SAMPLE_S` seconds: the clients' counts and each instance's
    :data:`WATCHED` metrics (``error`` when its ``/metrics`` did not answer)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        row: dict[str, Any] = {
            "t_s": round(loop.time() - t0, 1),
            "completed": tally.completed,
            "failed": tally.failed,
            "hung_up": tally.hung_up,
        }
        for name, s in servers.items():
            got = await asyncio.to_thread(watched, s.url)
            row[name] = got if "error" in got else {k: got.get(k, 0.0) for k in WATCHED}
        timeline.append(row)
        with contextlib.suppress(TimeoutError):  # the next sample is due
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


async def drive(
    url: str,
    servers: dict[str, VllmServer],
    pool: list[list[int]],
    refs: list[list[int]],
    duration: float,
    clients: int,
    timeout: float,
    seed: int,
) -> tuple[Tally, list[dict[str, Any]], float]:
    """Run the clients for ``duration`` seconds (then let their last requests end);
    returns the tally, the timeline and the seconds it all took."""
    tally, timeline = Tally(), []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(servers, tally, t0, stop, timeline))
    connector = aiohttp.TCPConnector(limit=0)  # one connection per client in flight
    no_cap = aiohttp.ClientTimeout(total=None)  # each request's own deadline rules
    async with aiohttp.ClientSession(connector=connector, timeout=no_cap) as session:
        await asyncio.gather(
            *(
                client(i, session, url, pool, refs, t0 + duration, timeout, seed, tally, t0)
                for i in range(clients)
            )
        )
    elapsed = loop.time() - t0
    stop.set()
    await sampling
    return tally, timeline, elapsed


def back_to_baseline(
    servers: dict[str, VllmServer], baseline: dict[str, dict[str, float]], timeout: float
) -> tuple[bool, dict[str, dict[str, float]], float]:
    """Poll every instance (another process: there is no event to wait on) until its KV
    usage is at most its baseline and no kvbridge gauge counts a request in flight, or
    ``timeout``; returns whether they all got there, their last metrics and the wait.

    vLLM exports a connector's gauges as of the engine's last step, and an idle engine
    does not step: a level that fell while it idled (a message kept early for a request
    that never came, dropped after ``timeouts.lease_s``) still reads as before. So each
    round, an instance not at rest gets a :func:`tick`, whose step reports the level of
    now: a gauge that stays up after it counts something still held."""
    start = time.monotonic()
    while True:
        after = {name: watched(s.url) for name, s in servers.items()}
        busy = [name for name in servers if not idle(baseline[name], after[name])]
        if not busy or time.monotonic() - start > timeout:
            return not busy, after, time.monotonic() - start
        for name in busy:
            tick(servers[name].url)
        time.sleep(0.5)


def tick(url: str) -> None:
    """One 1-token request of a 1-token prompt, no transfer (the instance computes it
    itself): one engine step, so the instance's gauges are current. A failure is left
    to the metrics that follow (``watched``)."""
    with contextlib.suppress(Exception):
        complete(url, [TICK_TOKEN], max_tokens=1, timeout=30)


def idle(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """KV usage at most ``before``'s, no kvbridge request in flight, metrics answered."""
    return (
        "error" not in after
        and after.get(USAGE, 0.0) <= before.get(USAGE, 0.0) + 1e-9
        and not any(after.get(g, 0.0) for g in IN_FLIGHT)
    )


def log_problems(path: Path) -> dict[str, Any]:
    """How many lines of the log at ``path`` contain one of :data:`LOG_PROBLEMS`, and the
    first :data:`FIRST` of them."""
    lines = []
    count = 0
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if any(word in line for word in LOG_PROBLEMS):
                    count += 1
                    if len(lines) < FIRST:
                        lines.append(line.rstrip()[:300])
    except OSError as exc:
        return {"count": None, "first": [f"cannot read {path}: {exc}"]}
    return {"count": count, "first": lines}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``; None when empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def run(
    duration: float,
    clients: int,
    request_timeout: float,
    seed: int,
    out: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The soak (module docstring); a document of what it measured, ``ok`` its verdict."""
    model = build_tiny_model(default_model_dir())
    logs = fresh_dir(out / "soak-raw")
    ncpu = len(os.sched_getaffinity(0))
    cores = ([0], [1]) if ncpu >= 2 else ([0], [0])
    common = ["--block-size", str(BLOCK), "--max-num-batched-tokens", str(CHUNK)]

    def kv(role: str, **extra: Any) -> list[str]:
        cfg = {
            "kv_connector": "KVBridgeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": "nixl"},
            **extra,
        }
        return ["--kv-transfer-config", json.dumps(cfg)]

    def server(name: str, args: list[str], cpus: list[int]) -> VllmServer:
        s = VllmServer(model, extra_args=common + args, log_path=logs / f"{name}.log", cpus=cpus)
        s.kv_cache_mb = KV_CACHE_MB
        return s

    servers = {
        "prefill": server("prefill", kv("kv_producer"), cores[0]),
        "decode": server("decode", kv("kv_consumer", kv_load_failure_policy="fail"), cores[1]),
    }
    reference = server("colocated", [], cores[1])
    proxy: subprocess.Popen[bytes] | None = None
    try:
        log(f"starting prefill (cores {cores[0]}), decode and colocated (cores {cores[1]})")
        start_all([*servers.values(), reference], timeout=600)
        startup = {n: s.startup_s for n, s in {**servers, "colocated": reference}.items()}
        pool = pool_prompts(seed)
        refs = [complete(reference.url, p, POOL_TOKENS, timeout=300).token_ids for p in pool]
        reference.stop()  # its compute goes to the decode from here on
        proxy, url = start_proxy(
            servers["prefill"].url, servers["decode"].url, "push", logs / "proxy.log"
        )
        baseline = {name: watched(s.url) for name, s in servers.items()}
        log(
            f"up in {max(v or 0 for v in startup.values()):.0f} s; {clients} clients for "
            f"{duration:.0f} s through {url}"
        )
        tally, timeline, elapsed = asyncio.run(
            drive(url, servers, pool, refs, duration, clients, request_timeout, seed)
        )
        log(
            f"{tally.sent} sent, {tally.completed} completed, {tally.hung_up} hung up, "
            f"{tally.failed} failed, {tally.wrong} wrong; waiting for the instances to idle"
        )
        is_idle, after, idle_wait = back_to_baseline(servers, baseline, IDLE_TIMEOUT_S)
        alive = {name: s.alive() for name, s in servers.items()}
        rss = {name: round(s.peak_rss_bytes() / 2**20) for name, s in servers.items()}
        alive["proxy"] = proxy.poll() is None
        try:
            health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
        except OSError as exc:
            health = {"error": str(exc)}
        # before the servers stop: what a shutdown logs is not the soak's
        problems = {name: log_problems(logs / f"{name}.log") for name in (*servers, "proxy")}
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        reference.stop()
        for s in servers.values():
            s.stop()
    reasons = []
    if tally.failed:
        reasons.append(f"{tally.failed} requests failed")
    if tally.wrong:
        reasons.append(f"{tally.wrong} wrong outputs")
    if not is_idle:
        reasons.append(f"not back to baseline within {IDLE_TIMEOUT_S:.0f} s")
    reasons += [f"{name} died" for name, up in alive.items() if not up]
    t = asdict(tally)
    return {
        "duration_s": duration,
        "elapsed_s": round(elapsed, 1),
        "clients": clients,
        "request_timeout_s": request_timeout,
        "seed": seed,
        "mix": {
            "short": SHORT,
            "long": LONG,
            "long_share": LONG_SHARE,
            "pool": POOL,
            "pool_share": POOL_SHARE,
            "pool_tokens": POOL_TOKENS,
            "output": OUTPUT,
            "stream_share": STREAM_SHARE,
            "hang_mid": HANG_MID,
            "hang_early": HANG_EARLY,
            "think_s": THINK_S,
        },
        "setup": {
            "transport": "nixl",
            "flow": "push",
            "block": BLOCK,
            "chunk": CHUNK,
            "kv_cache_mb": KV_CACHE_MB,
            "cores": {"prefill": cores[0], "decode": cores[1], "colocated": cores[1]},
            "startup_s": startup,
            "pool_lengths": [len(p) for p in pool],
        },
        "requests": {
            k: t[k]
            for k in (
                "sent",
                "completed",
                "hung_up",
                "hung_up_mid",
                "failed",
                "wrong",
                "checked",
                "streamed",
                "long",
            )
        },
        "errors": t["errors"],
        "first_errors": t["first_errors"],
        "first_wrong": t["first_wrong"],
        "latency": {
            "p50_ms": percentile(tally.latency_ms, 50),
            "p99_ms": percentile(tally.latency_ms, 99),
            "ttft_p50_ms": percentile(tally.ttft_ms, 50),
            "ttft_p99_ms": percentile(tally.ttft_ms, 99),
        },
        "baseline": baseline,
        "after": after,
        "idle": is_idle,
        "idle_wait_s": round(idle_wait, 1),
        "alive": alive,
        "peak_rss_mb": rss,
        "proxy_health": health,
        "log_problems": problems,
        "timeline": timeline,
        "latency_ms": tally.latency_ms,
        "ttft_ms": tally.ttft_ms,
        "ok": not reasons,
        "reasons": reasons,
    }


def rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The summary: what the clients saw, then each instance before and after."""
    r, lat = doc["requests"], doc["latency"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    head = ["measure", "value"]
    table = [
        ["requests sent", str(r["sent"])],
        ["completed", str(r["completed"])],
        ["hung up on purpose (mid-stream)", f"{r['hung_up']} ({r['hung_up_mid']})"],
        ["failed", str(r["failed"])],
        ["wrong outputs (of checked)", f"{r['wrong']} ({r['checked']})"],
        ["streamed / long prompts", f"{r['streamed']} / {r['long']}"],
        ["latency p50 / p99 ms", f"{ms(lat['p50_ms'])} / {ms(lat['p99_ms'])}"],
        ["TTFT p50 / p99 ms (streamed)", f"{ms(lat['ttft_p50_ms'])} / {ms(lat['ttft_p99_ms'])}"],
    ]
    for name in doc["baseline"]:
        before, after = doc["baseline"][name], doc["after"][name]
        usage = f"{before.get(USAGE, 0):.4f} / {after.get(USAGE, 0):.4f}"
        table.append([f"{name}: KV usage before / after", usage])
        busy = {g.removeprefix("vllm:kvbridge_"): after[g] for g in IN_FLIGHT if after.get(g)}
        table.append([f"{name}: kvbridge requests in flight after", str(busy or 0)])
        grew = [
            after.get(f"vllm:kvbridge_{c}_total", 0) - before.get(f"vllm:kvbridge_{c}_total", 0)
            for c in COUNTED
        ]
        table.append(
            [
                f"{name}: kvbridge {' / '.join(COUNTED)} during the run",
                " / ".join(f"{n:.0f}" for n in grew),
            ]
        )
    table.append([f"idle after (s, within {IDLE_TIMEOUT_S:.0f})", f"{doc['idle_wait_s']}"])
    alive = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in doc["alive"].items())
    table.append(["processes alive", alive])
    table.append(
        [
            "log lines with errors",
            ", ".join(f"{k} {v['count']}" for k, v in doc["log_problems"].items()),
        ]
    )
    for text, n in sorted(doc["errors"].items(), key=lambda e: -e[1])[:3]:
        table.append([f"error ({n}x)", text.replace("|", "/").replace("\n", " ")])
    table.append(["verdict", "ok" if doc["ok"] else "FAILED: " + "; ".join(doc["reasons"])])
    return head, table


def plot(doc: dict[str, Any], path: Path) -> None:
    """Completions per sample interval, and each instance's KV usage and running
    requests, over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = doc["timeline"]
    ts = [row["t_s"] for row in tl]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.2))
    for key in ("completed", "hung_up", "failed"):
        rate = [
            (b[key] - a[key]) / max(b["t_s"] - a["t_s"], 1e-9) for a, b in itertools.pairwise(tl)
        ]
        ax1.plot(ts[1:], rate, label=f"{key.replace('_', ' ')} / s")
    ax1.set_ylabel("requests / s")
    ax1.set_title("requests ending, per second", fontsize=10)
    for name in doc["baseline"]:
        pts = [(row["t_s"], row[name]) for row in tl if USAGE in row.get(name, {})]
        ax2.plot([t for t, _ in pts], [100 * m[USAGE] for _, m in pts], label=f"{name} KV usage")
        ax3.plot(
            [t for t, _ in pts],
            [m["vllm:num_requests_running"] for _, m in pts],
            label=f"{name} running",
        )
    ax2.set_ylabel("% of the KV cache")
    ax2.set_title("KV cache usage", fontsize=10)
    ax3.set_ylabel("requests")
    ax3.set_title("requests running", fontsize=10)
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("s since start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    r = doc["requests"]
    fig.suptitle(
        f"kvbridge soak: {doc['clients']} clients, {doc['elapsed_s']:.0f} s, {r['sent']} "
        f"requests, {r['failed']} failed, {r['wrong']} wrong "
        f"({doc['machine']['cpus']} CPUs, {doc['machine']['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["Plan", "plan", "plot", "pool_prompts", "rows", "run"]
