"""What the SGLang integration tests share: the servers' flags, prompts, requests, a
prefill + decode + router trio, kvbridge's metrics and log lines, KV byte counts from
the model's config. Imported by the test modules and conftest.py of this directory
(run in .venv-sglang)."""

from __future__ import annotations

import functools
import json
import math
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from kvbridge.demo.run import prom
from kvbridge.demo.servers import ServerProcess as Proc
from kvbridge.demo.servers import free_port, start_all
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer

# Page 16 and 64-token chunks: prompts cross pages and chunks (the notes' chunked setting).
ENGINE_FLAGS = ["--page-size", "16", "--chunked-prefill-size", "64"]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MAX_NEW_TOKENS = 16


def prompt_ids(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(num_tokens)]


def http(
    url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        return 0, str(exc).encode()


def server_env(config: dict | None = None) -> dict[str, str]:
    """kvbridge's config for a server; SglangServer adds SGLang's CPU environment (CPU_ENV)."""
    return {} if config is None else {"KVBRIDGE_CONFIG": json.dumps(config)}


def start_server(
    name: str, model: Path, log_dir: Path, extra: list[str], env: dict[str, str]
) -> SglangServer:
    log = log_dir / f"{name}.log"
    return SglangServer(
        model, extra_args=ENGINE_FLAGS + extra, env=env, log_path=log, nice=19
    ).start()


def generate_ids(url: str, input_ids: list[int]) -> list[int]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
    }
    status, data = http(f"{url}/generate", body)
    assert status == 200, f"{url}/generate -> {status}: {data[:500]!r}"
    out = json.loads(data)
    return list(out["output_ids"])


@functools.cache
def _reference(url: str, pid: int, input_ids: tuple[int, ...], logprobs: bool):
    if logprobs:
        return generate_logprobs(url, list(input_ids))
    return generate_ids(url, list(input_ids))


def reference_ids(colocated: Proc, input_ids: list[int]) -> list[int]:
    """A colocated server's greedy output for ``input_ids``, asked once per session
    (greedy decoding of a server that runs no kvbridge does not change between asks)."""
    return list(_reference(colocated.url, colocated.pid, tuple(input_ids), False))


def reference_logprobs(
    colocated: Proc, input_ids: list[int]
) -> tuple[list[int], list[dict[int, float]]]:
    """:func:`generate_logprobs` of a colocated server, asked once per session."""
    return _reference(colocated.url, colocated.pid, tuple(input_ids), True)


class PD(NamedTuple):
    router: Proc
    prefill: Proc
    decode: Proc
    layerwise: bool


PD_FLAGS = ["--enable-metrics"]
LOG_LINE_TIMEOUT_S = 30.0


def pd_config(transport: str, layerwise: bool) -> dict:
    return (
        {"transport": transport, "layerwise_min_tokens": 0}
        if layerwise
        else {"transport": transport, "layerwise": False}
    )


def start_pd(
    model: Path,
    log_dir: Path,
    env: dict[str, str],
    layerwise: bool,
    decode_env: dict[str, str] | None = None,
    *,
    prefill_env: dict[str, str] | None = None,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
):
    """Prefill + decode (with ``--enable-metrics``) + router; yields the :class:`PD`,
    kills all three at the end. ``decode_env`` / ``prefill_env``: a side's, if not
    ``env``; ``prefill_args`` / ``decode_args``: more flags for one side (``--tp 2``)."""
    bootstrap = free_port()
    procs: list[Proc] = []
    try:
        prefill = start_server(
            "prefill",
            model,
            log_dir,
            [
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-transfer-backend",
                "kvbridge",
                "--disaggregation-bootstrap-port",
                str(bootstrap),
                *PD_FLAGS,
                *prefill_args,
            ],
            env if prefill_env is None else prefill_env,
        )
        procs.append(prefill)
        decode = start_server(
            "decode",
            model,
            log_dir,
            [
                "--disaggregation-mode",
                "decode",
                "--disaggregation-transfer-backend",
                "kvbridge",
                "--disaggregation-decode-retraction-backup",
                "cpu_tensor",
                *PD_FLAGS,
                *decode_args,
            ],
            env if decode_env is None else decode_env,
        )
        procs.append(decode)
        # The mini load balancer does not contact the servers until a request comes:
        # started beside them, its import overlaps theirs.
        router = SglangRouter(
            prefill.url, bootstrap, decode.url, env=env, log_path=log_dir / "router.log", nice=19
        ).start()
        procs.append(router)
        start_all(procs, START_TIMEOUT_S)
        yield PD(router, prefill, decode, layerwise)
    finally:
        for proc in reversed(procs):
            proc.kill()


REFUSAL_ANSWER_S = 60.0
"""A request kvbridge refuses is answered once both sides failed it: well before
SGLang's own 300 s bootstrap and waiting timeouts."""


def expect_refused(pd: PD, what: str) -> str:
    """Send one request through ``pd``'s router that kvbridge must refuse (``what``:
    why, for the messages); assert the router answers, not with 200, within
    :data:`REFUSAL_ANSWER_S`. Returns the answer and the decode's log (SGLang gives the
    reason in one or the other)."""
    started = time.monotonic()
    body_in = {"input_ids": prompt_ids(40, seed=5), "sampling_params": {"max_new_tokens": 4}}
    status, body = http(f"{pd.router.url}/generate", body_in, timeout=REFUSAL_ANSWER_S)
    assert status != 0, (
        f"no answer within {REFUSAL_ANSWER_S:.0f} s (both sides must fail the request): "
        f"{body[:300]!r}\n{pd.prefill.log_tail()}"
    )
    assert status != 200, f"{what}: a request was served: {body[:300]!r}"
    print(f"\n{what}: refused request answered {status} after {time.monotonic() - started:.1f} s")
    return body.decode(errors="replace") + pd.decode.log_path.read_text(errors="replace")


KV_DTYPE_LINE = re.compile(rb"KV Cache is allocated\. dtype: torch\.(\w+)")
METRICS_TIMEOUT_S = 30.0
SCRAPE_TIMEOUT_S = REQUEST_TIMEOUT_S
"""One scrape of ``/metrics``: the servers run at nice 19, and beside the other test
stream's work at nice 0 (conformance's transfers, the kernels' unit tests) a server's
answer once took over 10 s."""


def kvbridge_metrics(url: str) -> dict[str, float]:
    """``sglang:kvbridge_*`` samples of a server's ``/metrics``, summed over labels. A
    scrape that races a rank creating its metrics file fails in prometheus_client's
    multiprocess reader (HTTP 500, "unpack_from requires a buffer of at least 4 bytes":
    seen once on a TP 2 decode's first request) and is retried, as a scraper's next
    interval would be."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        try:
            return prom(url, prefix="sglang:kvbridge_", timeout=SCRAPE_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            if exc.code != 500 or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


RANK_SAMPLE = re.compile(r"^sglang:kvbridge_(\w+)_total\{([^}]*)\} ([0-9.e+\-]+)$", re.MULTILINE)


class Sent(NamedTuple):
    """What one prefill rank counted sent (``sglang:kvbridge_*_total{tp_rank=...}``):
    requests, and the writes they were posted in, per layer (streamed) and per chunk."""

    tp_rank: int
    requests: float = 0.0
    layer_writes: float = 0.0
    chunk_writes: float = 0.0

    def minus(self, before: Sent | None) -> Sent:
        if before is None:
            return self
        return Sent(self.tp_rank, *(a - b for a, b in zip(self[1:], before[1:], strict=True)))


def sent_by_rank(prefill: Proc) -> dict[int, Sent]:
    """The prefill's :class:`Sent` counters per TP rank, from its ``/metrics`` (one
    scrape, retried as :func:`kvbridge_metrics` is)."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        try:
            url = f"{prefill.url}/metrics"
            body = urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S).read().decode()
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 500 or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)
    fields = {
        "requests_sent": "requests",
        "layer_writes": "layer_writes",
        "chunk_writes": "chunk_writes",
    }
    out: dict[int, dict[str, float]] = {}
    for name, labels, value in RANK_SAMPLE.findall(body):
        rank = re.search(r'tp_rank="(\d+)"', labels)
        if name in fields and rank:
            counts = out.setdefault(int(rank.group(1)), {})
            counts[fields[name]] = counts.get(fields[name], 0.0) + float(value)
    return {rank: Sent(rank, **counts) for rank, counts in out.items()}


def wait_sent(prefill: Proc, before: dict[int, Sent], ranks: int = 1) -> list[Sent]:
    """What each prefill rank counted sent since ``before`` (:func:`sent_by_rank`), once
    ``ranks`` of them counted a request (one per prefill rank the room went through;
    each counts just after notifying the decode, so it may trail the response by a
    moment: polled). Asserts that exactly ``ranks`` ranks counted one request each. A
    rank counts a request's writes before the request (``COUNTERS``' order), so the
    scrape that shows the request shows its writes."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        now = sent_by_rank(prefill)
        sent = [
            d
            for rank, counts in sorted(now.items())
            if (d := counts.minus(before.get(rank))).requests
        ]
        if len(sent) >= ranks or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert len(sent) == ranks and all(d.requests == 1 for d in sent), (
        f"expected {ranks} prefill ranks to count one request sent each, got {sent}:\n"
        f"{prefill.log_tail()}"
    )
    return sent


def kv_rows(model: Path, num_tokens: int) -> tuple[int, int]:
    """``(rows, head_dim)`` of a prompt's pages, from the model's config: one row is one
    token's one head of K or V, for every layer; the last page counts whole."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])
    rows = (
        math.ceil(num_tokens / page)
        * page
        * 2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
    )
    return rows, head_dim


def kv_itemsize(server: Proc) -> int:
    """Bytes per KV value of ``server``, from the KV dtype SGLang logged."""
    match = KV_DTYPE_LINE.search(server.log_path.read_bytes())
    assert match, f"SGLang did not log its KV dtype:\n{server.log_tail()}"
    return torch.empty(0, dtype=getattr(torch, match.group(1).decode())).element_size()


def kv_bytes(model: Path, server: Proc, num_tokens: int) -> int:
    """KV bytes of a prompt's pages, from the model's config and the KV dtype SGLang logged."""
    rows, head_dim = kv_rows(model, num_tokens)
    return rows * head_dim * kv_itemsize(server)


def latent_rows(model: Path, num_tokens: int) -> tuple[int, int]:
    """MLA: ``(rows, latent)`` of a prompt's latent pages, from the model's config: one
    row of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer; the last page
    counts whole."""
    cfg = json.loads((model / "config.json").read_text())
    page = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])
    return math.ceil(num_tokens / page) * page * cfg["num_hidden_layers"], cfg[
        "kv_lora_rank"
    ] + cfg["qk_rope_head_dim"]


def latent_bytes(model: Path, server: Proc, num_tokens: int) -> int:
    """MLA: bytes of a prompt's latent pages, in the KV dtype ``server`` logged."""
    rows, latent = latent_rows(model, num_tokens)
    return rows * latent * kv_itemsize(server)


def wait_counted(url: str, before: dict[str, float], name: str) -> dict[str, float]:
    """A server's kvbridge metrics once ``sglang:kvbridge_<name>`` grew past ``before``'s
    (kvbridge counts just after notifying: polled), or as they are at the deadline."""
    key = f"sglang:kvbridge_{name}"
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        now = kvbridge_metrics(url)
        if now.get(key, 0.0) > before.get(key, 0.0) or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)


STAGING_USED = "sglang:kvbridge_staging_slots_used"


def wait_staging_idle(server: Proc, timeout: float = 30.0) -> None:
    """Assert that every staging slot of ``server`` (packed path) comes back within
    ``timeout``: a room's run is freed after its last write or unpack, a decode's
    retired run when its hold ends (polled on ``/metrics``)."""
    deadline = time.monotonic() + timeout
    used = kvbridge_metrics(server.url).get(STAGING_USED)
    while used != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        used = kvbridge_metrics(server.url).get(STAGING_USED)
    assert used == 0, f"{server.log_path.stem} still holds {used} staging slots"


def generate_logprobs(url: str, input_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    status, data = http(f"{url}/generate", body)
    assert status == 200, f"{url}/generate -> {status}: {data[:500]!r}"
    out = json.loads(data)
    tops = [
        {int(tok): float(lp) for lp, tok, *_ in step}
        for step in out["meta_info"]["output_top_logprobs"]
    ]
    return list(out["output_ids"]), tops


def fp8_bytes(model: Path, num_tokens: int) -> int:
    """Packed bytes of a prompt's pages: 1 byte per value plus a float32 scale per row
    (token and head), for K and V of every layer (csrc/PACKED_FORMAT.md)."""
    rows, head_dim = kv_rows(model, num_tokens)
    return rows * (head_dim + 4)


def generate_through(pd: PD, input_ids: list[int]) -> list[int]:
    """:func:`generate_ids` through the pair's router; a failure quotes both servers' logs."""
    try:
        return generate_ids(pd.router.url, input_ids)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n--- prefill ---\n{pd.prefill.log_tail()}\n--- decode "
            f"---\n{pd.decode.log_tail()}"
        ) from None


FP8_MAX_DRIFT = 0.6
"""How far FP8 KV may move the top-5 logprobs of the decode's first computed token (a
page or a layer in the wrong place moves them by more than 1)."""

TP_MAX_DRIFT = 0.05
"""How far computing at another TP size (SGLang's all-reduce sums in another order) may
move them: 0.008 measured on the tiny LFM2, enough to flip a near-tied greedy token."""


def fp8_drift(want: dict[int, float], got: dict[int, float]) -> float:
    """Largest logprob difference over the tokens two top-5 lists share (at least 3)."""
    common = set(want) & set(got)
    assert len(common) >= 3, f"top-5 barely overlap: {want} vs {got}"
    return max(abs(want[t] - got[t]) for t in common)


def generate_as_colocated(
    pd: PD, colocated: Proc, input_ids: list[int], *, max_drift: float | None = None
) -> list[int]:
    """Assert that ``pd`` answers ``input_ids`` as ``colocated`` does: greedy output
    token for token, or with ``max_drift`` (FP8 KV, or another TP size, moves near-tied
    tokens of the random-weight models: :data:`FP8_MAX_DRIFT`, :data:`TP_MAX_DRIFT`)
    the prefill's token equal and the decode's first computed token's top-5 logprobs
    within it. Returns ``pd``'s output."""
    n = len(input_ids)
    if max_drift is not None:
        want, want_tops = reference_logprobs(colocated, input_ids)
        got, got_tops = generate_logprobs(pd.router.url, input_ids)
        assert len(got) == MAX_NEW_TOKENS and got[0] == want[0], (
            f"the prefill's token differs: {got} vs {want}"
        )
        drift = fp8_drift(want_tops[1], got_tops[1])  # the decode's first token
        assert drift < max_drift, (
            f"{n} tokens: logprobs moved by {drift:.2f}\n{pd.decode.log_tail()}"
        )
    else:
        want = reference_ids(colocated, input_ids)
        assert len(want) == MAX_NEW_TOKENS
        got = generate_through(pd, input_ids)
        assert got == want, f"{n} tokens: disaggregated {got} != colocated {want}"
    return got


def check_sent(pd: PD, before: dict[int, Sent], ranks: int) -> None:
    """Each of the prefill's ``ranks`` counted the request sent (since ``before``:
    :func:`sent_by_rank`) by the pair's path: per layer, some layer writes; per chunk,
    chunk writes only."""
    for sent in wait_sent(pd.prefill, before, ranks):
        if pd.layerwise:
            assert sent.layer_writes > 0, f"not streamed: {sent}"
        else:
            assert sent.layer_writes == 0 and sent.chunk_writes > 0, f"not per chunk: {sent}"


def check_hit(turn: int, received: float, moved: dict[int, int], most: int) -> int:
    """A conversation turn's decode hit, read from the bytes it ``received``: ``moved``
    maps each possible hit (tokens, up to ``most``) to the bytes the turn moves past it.
    Asserts that one matches, and that it is a hit exactly where one is possible."""
    hits = [hit for hit, nbytes in moved.items() if nbytes == received]
    assert hits, (
        f"turn {turn}: the decode received {received} bytes; past a hit of up to {most} "
        f"tokens the turn moves one of {moved}"
    )
    assert (hits[0] > 0) == (most > 0), (
        f"turn {turn}: {received} bytes are a {hits[0]}-token hit, the most is {most}"
    )
    return hits[0]


def wait_received_bytes(url: str, before: dict[str, float], expected: float) -> float:
    """KV bytes a decode server received since ``before`` (its kvbridge metrics), once
    they reach ``expected`` (each decode rank counts just after its notification:
    polled), or as they are at the deadline."""
    name = "sglang:kvbridge_bytes_received_total"
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        got = kvbridge_metrics(url).get(name, 0.0) - before.get(name, 0.0)
        if got >= expected or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
"""A TP 2 server's environment on this machine: SGLang on CPU binds each rank to cores
and, unless told how, asserts ranks <= NUMA nodes."""


def new_colocated(model: Path, log_dir: Path, tp: int = 1, extra: Sequence[str] = ()) -> Proc:
    """A colocated server of TP ``tp`` (1 or 2) with the tests' engine flags (and
    ``extra``), ready; the caller kills it."""
    args, env = (["--tp", "2"], dict(TWO_RANKS)) if tp == 2 else ([], {})
    proc = start_server(f"colocated-tp{tp}", model, log_dir, [*args, *extra], env)
    try:
        proc.wait_ready(START_TIMEOUT_S)
    except BaseException:
        proc.kill()
        raise
    return proc


def start_colocated(
    model: Path, log_dir: Path, tp: int = 1, extra: Sequence[str] = ()
) -> Iterator[Proc]:
    """:func:`new_colocated`, yielded; killed at the end."""
    proc = new_colocated(model, log_dir, tp, extra)
    try:
        yield proc
    finally:
        proc.kill()


def tp_sides(config: dict, p_tp: int, d_tp: int) -> dict:
    """:func:`start_pd`'s keyword arguments (``env`` too) for a prefill of TP ``p_tp``
    and a decode of TP ``d_tp`` (1 or 2) with kvbridge ``config``: two ranks bound one
    per core (:data:`TWO_RANKS`)."""
    env = server_env(config)

    def side(tp: int) -> tuple[list[str], dict[str, str]]:
        return (["--tp", str(tp)], {**env, **TWO_RANKS}) if tp == 2 else ([], env)

    (p_args, p_env), (d_args, d_env) = side(p_tp), side(d_tp)
    return {
        "env": env,
        "prefill_env": p_env,
        "decode_env": d_env,
        "prefill_args": p_args,
        "decode_args": d_args,
    }


def room_of(residue: int, dp: int, seed: int) -> int:
    """A bootstrap room as sglang_router draws one (a random 63-bit number) that SGLang's
    ``follow_bootstrap_room`` balancing sends to DP rank ``residue`` of ``dp``."""
    room = random.Random(seed).randrange(2**63 - dp)
    return room - room % dp + residue


def routed_body(input_ids: list[int], bootstrap_port: int, room: int) -> dict:
    """A greedy ``/generate`` body for both servers of a pair: the prefill at
    ``127.0.0.1:bootstrap_port``, bootstrap room ``room`` (what a router adds)."""
    return {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }


class Routed(NamedTuple):
    prefill: tuple[int, bytes]
    decode: tuple[int, bytes]


def route(
    prefill: Proc,
    bootstrap_port: int,
    decode: Proc,
    input_ids: list[int],
    room: int,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Routed:
    """One greedy request as sglang_router's mini_lb sends it, with the caller's
    bootstrap ``room`` (so a test knows which DP rank of the prefill serves it, and
    which decode server it goes to): the same body plus ``bootstrap_host/port/room`` to
    both servers at once; both ``(status, body)`` answers."""
    return route_body(prefill, decode, routed_body(input_ids, bootstrap_port, room), timeout)


def route_body(
    prefill: Proc, decode: Proc, body: dict, timeout: float = REQUEST_TIMEOUT_S
) -> Routed:
    """:func:`route` with a body of the caller's (:func:`routed_body`, changed)."""
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(http, f"{s.url}/generate", body, timeout) for s in (prefill, decode)]
        return Routed(*(a.result() for a in answers))


def generate_routed(
    prefill: Proc, bootstrap_port: int, decode: Proc, input_ids: list[int], room: int
) -> list[int]:
    """:func:`route`'s decode output ids; a failure quotes both servers' logs."""
    answer = route(prefill, bootstrap_port, decode, input_ids, room)
    status, data = answer.decode
    assert status == 200, (
        f"room {room}: decode -> {status}: {data[:500]!r} (prefill -> {answer.prefill[0]})\n"
        f"--- prefill ---\n{prefill.log_tail()}\n--- decode ---\n{decode.log_tail()}"
    )
    return list(json.loads(data)["output_ids"])


DP_SENT_LINE = re.compile(rb"\[[^\]\n]* DP(\d+)[^\]\n]*\] kvbridge: room (\d+) sent: ")
DP_PEER_LINE = re.compile(rb"\[[^\]\n]* DP(\d+)[^\]\n]*\] kvbridge: registered decode peer (\S+)")


def sends_by_dp_rank(prefill: Proc, offset: int, rooms: Sequence[int]) -> dict[int, int]:
    """Which DP rank of ``prefill`` (its log lines' ``DP<r>`` tag) logged each of
    ``rooms`` sent after ``offset`` of its log, once all have (polled); asserts each
    room was sent by exactly one rank."""
    deadline = time.monotonic() + LOG_LINE_TIMEOUT_S
    while True:
        with open(prefill.log_path, "rb") as f:
            f.seek(offset)
            lines = [(int(r), int(dp)) for dp, r in DP_SENT_LINE.findall(f.read())]
        if {r for r, _ in lines} >= set(rooms) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    got = {r: [dp for room, dp in lines if room == r] for r in rooms}
    assert all(len(ranks) == 1 for ranks in got.values()), (
        f"each room must be sent by one DP rank: {got}\n{prefill.log_tail()}"
    )
    return {r: ranks[0] for r, ranks in got.items()}


def peers_by_dp_rank(prefill: Proc) -> dict[int, set[str]]:
    """The decode agents each DP rank of ``prefill`` registered (its whole log)."""
    peers: dict[int, set[str]] = {}
    for dp, agent in DP_PEER_LINE.findall(prefill.log_path.read_bytes()):
        peers.setdefault(int(dp), set()).add(agent.decode())
    return peers
