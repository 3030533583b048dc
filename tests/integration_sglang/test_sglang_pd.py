"""SGLang prefill + decode with ``--disaggregation-transfer-backend kvbridge`` on CPU.

Real SGLang 0.5.23 servers on loopback (see docs/sglang-backend-notes.md for the flags),
behind ``sglang_router.launch_router --pd-disaggregation --mini-lb``: the greedy output of
every prompt equals a colocated SGLang server started with the same flags, token for
token, over NIXL and over Mooncake (``KVBRIDGE_CONFIG``), each with per-chunk sends
(``layerwise: false``) and with per-layer streaming (``layerwise_min_tokens: 0``, so
every prompt streams). The prefill's per-room log line ("room R sent: L layer writes,
C chunk writes") shows which path each request took. The disaggregated servers run with
``--enable-metrics``: kvbridge's ``sglang:kvbridge_*`` metrics on their ``/metrics``
count each request once and exactly its KV bytes (computed from the model's config and
the KV dtype SGLang logs).

Run in the SGLang environment (``bash scripts/setup-sglang.sh``)::

    .venv-sglang/bin/python -m pytest tests/integration_sglang

Servers run in their own process groups and are SIGKILLed as a group at teardown (a
disaggregated SGLang server drains in-flight requests on SIGTERM, possibly forever).
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

try:  # this directory runs in .venv-sglang only (make test); elsewhere: a clear error, not a skip
    import sglang  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise RuntimeError("tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh, then .venv-sglang/bin/python -m pytest tests/integration_sglang") from exc

from kvbridge.demo.run import prom  # noqa: E402
from kvbridge.demo.servers import ServerProcess as Proc  # noqa: E402
from kvbridge.demo.servers import free_port as _free_port  # noqa: E402
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer  # noqa: E402

# Page 16 and 64-token chunks: prompts cross pages and chunks (the notes' chunked setting).
ENGINE_FLAGS = ["--page-size", "16", "--chunked-prefill-size", "64"]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MAX_NEW_TOKENS = 16

PROMPTS = {
    "short": 12,  # less than one page
    "page_boundary": 32,  # exactly two pages
    "chunk_boundary": 64,  # exactly one chunk (four pages)
    "chunked": 200,  # four chunks, partial last page
}


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(num_tokens)]


def _http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        return 0, str(exc).encode()


def _server_env(config: dict | None = None) -> dict[str, str]:
    """kvbridge's config for a server; SglangServer adds SGLang's CPU environment (CPU_ENV)."""
    return {} if config is None else {"KVBRIDGE_CONFIG": json.dumps(config)}


def _server(name: str, model: Path, log_dir: Path, extra: list[str], env: dict[str, str]) -> SglangServer:
    log = log_dir / f"{name}.log"
    return SglangServer(model, extra_args=ENGINE_FLAGS + extra, env=env, log_path=log, nice=19).start()


def _generate(url: str, input_ids: list[int]) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    status, data = _http(f"{url}/generate", body)
    assert status == 200, f"{url}/generate -> {status}: {data[:500]!r}"
    out = json.loads(data)
    return list(out["output_ids"])


@pytest.fixture(scope="session")
def colocated(model: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = _server("colocated", model, tmp_path_factory.mktemp("colocated"), [], _server_env())
    try:
        proc.wait_ready(START_TIMEOUT_S)
        yield proc
    finally:
        proc.kill()


class PD(NamedTuple):
    router: Proc
    prefill: Proc
    decode: Proc
    layerwise: bool


# (transport, per-layer streaming, data path): per-chunk keeps today's path exactly;
# per-layer with threshold 0 streams every prompt (the 12-token one too: its only page
# is partial but it is the last chunk); "packed" moves the exact values through the
# staging buffers (data_path: packed), so output and bytes must not change either.
PD_CONFIGS = [("nixl", False, "direct"), ("nixl", True, "direct"), ("mooncake", False, "direct"), ("mooncake", True, "direct"), ("nixl", True, "packed")]
PD_FLAGS = ["--enable-metrics"]
SENT_LINE = re.compile(rb"kvbridge: room (\d+) sent: (\d+) layer writes, (\d+) chunk writes")
LOG_LINE_TIMEOUT_S = 30.0


def _pd_config(transport: str, layerwise: bool) -> dict:
    return {"transport": transport, "layerwise_min_tokens": 0} if layerwise else {"transport": transport, "layerwise": False}


def _start_pd(model: Path, log_dir: Path, env: dict[str, str], layerwise: bool, decode_env: dict[str, str] | None = None):
    """Prefill + decode (with ``--enable-metrics``) + router; yields the :class:`PD`,
    kills all three at the end. ``decode_env``: the decode's, if not ``env``."""
    bootstrap = _free_port()
    procs: list[Proc] = []
    try:
        prefill = _server(
            "prefill", model, log_dir,
            ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvbridge",
             "--disaggregation-bootstrap-port", str(bootstrap), *PD_FLAGS],
            env,
        )
        procs.append(prefill)
        decode = _server(
            "decode", model, log_dir,
            ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvbridge",
             "--disaggregation-decode-retraction-backup", "cpu_tensor", *PD_FLAGS],
            env if decode_env is None else decode_env,
        )
        procs.append(decode)
        deadline = time.monotonic() + START_TIMEOUT_S
        prefill.wait_ready(deadline=deadline)
        decode.wait_ready(deadline=deadline)
        router = SglangRouter(prefill.url, bootstrap, decode.url, env=env, log_path=log_dir / "router.log", nice=19).start()
        procs.append(router)
        router.wait_ready(60)
        yield PD(router, prefill, decode, layerwise)
    finally:
        for proc in reversed(procs):
            proc.kill()


def _pd_id(transport: str, layerwise: bool, path: str) -> str:
    return f"{transport}-{'layer' if layerwise else 'chunk'}" + ("-packed" if path == "packed" else "")


@pytest.fixture(scope="module", params=PD_CONFIGS, ids=[_pd_id(*c) for c in PD_CONFIGS])
def pd_router(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    transport, layerwise, path = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{_pd_id(*request.param)}")
    yield from _start_pd(model, log_dir, _server_env({**_pd_config(transport, layerwise), "data_path": path}), layerwise)


def _sent_lines(prefill: Proc, offset: int) -> list[tuple[int, int, int]]:
    with open(prefill.log_path, "rb") as f:
        f.seek(offset)
        return [tuple(int(g) for g in m.groups()) for m in SENT_LINE.finditer(f.read())]


def _wait_sent_line(prefill: Proc, offset: int) -> tuple[int, int, int]:
    """The prefill's "room R sent" line logged after ``offset``: it is written just after
    the decode was notified, so it may trail the response by a moment; poll for it."""
    deadline = time.monotonic() + LOG_LINE_TIMEOUT_S
    while True:
        lines = _sent_lines(prefill, offset)
        if lines or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 1, f"expected one 'room R sent' line in the prefill log, got {lines}:\n{prefill.log_tail()}"
    return lines[0]


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_output_equals_colocated(pd_router: PD, colocated: Proc, prompt: str) -> None:
    router, prefill, decode, layerwise = pd_router
    input_ids = _prompt(PROMPTS[prompt], seed=len(prompt))
    want = _generate(colocated.url, input_ids)
    offset = prefill.log_path.stat().st_size
    try:
        got = _generate(router.url, input_ids)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- prefill ---\n{prefill.log_tail()}\n--- decode ---\n{decode.log_tail()}") from None
    assert len(want) == MAX_NEW_TOKENS
    assert got == want, f"{prompt} ({PROMPTS[prompt]} tokens): disaggregated {got} != colocated {want}"
    room, layer_writes, chunk_writes = _wait_sent_line(prefill, offset)
    if layerwise:
        # Every page went out from the attention hook; the chunk sends found nothing left
        # (random prompts: no radix-cache hits on the prefill).
        assert layer_writes > 0 and chunk_writes == 0, f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk writes"
    else:
        assert layer_writes == 0 and chunk_writes > 0, f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk writes"


def test_plugin_registers_backend() -> None:
    """The entry point is installed and adds ``kvbridge`` to SGLang's backends."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvbridge") == "kvbridge.adapters.sglang:register"


KV_DTYPE_LINE = re.compile(rb"KV Cache is allocated\. dtype: torch\.(\w+)")
METRICS_TIMEOUT_S = 30.0


def _kvbridge_metrics(url: str) -> dict[str, float]:
    """``sglang:kvbridge_*`` samples of a server's ``/metrics``, summed over labels."""
    return prom(url, prefix="sglang:kvbridge_")


def _kv_rows(model: Path, num_tokens: int) -> tuple[int, int]:
    """``(rows, head_dim)`` of a prompt's pages, from the model's config: one row is one
    token's one head of K or V, for every layer; the last page counts whole."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])
    rows = math.ceil(num_tokens / page) * page * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
    return rows, head_dim


def _kv_bytes(model: Path, server: Proc, num_tokens: int) -> int:
    """KV bytes of a prompt's pages, from the model's config and the KV dtype SGLang logged."""
    match = KV_DTYPE_LINE.search(server.log_path.read_bytes())
    assert match, f"SGLang did not log its KV dtype:\n{server.log_tail()}"
    itemsize = torch.empty(0, dtype=getattr(torch, match.group(1).decode())).element_size()
    rows, head_dim = _kv_rows(model, num_tokens)
    return rows * head_dim * itemsize


def _wait_counted(url: str, before: dict[str, float], name: str) -> dict[str, float]:
    """A server's kvbridge metrics once ``sglang:kvbridge_<name>`` grew past ``before``'s
    (kvbridge counts just after notifying: polled), or as they are at the deadline."""
    key = f"sglang:kvbridge_{name}"
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        now = _kvbridge_metrics(url)
        if now.get(key, 0.0) > before.get(key, 0.0) or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)


def test_metrics_count_each_request_and_its_bytes(pd_router: PD, model: Path, request: pytest.FixtureRequest) -> None:
    router, prefill, decode, _ = pd_router
    packed = request.node.callspec.params["pd_router"][2] == "packed"
    input_ids = _prompt(PROMPTS["chunked"], seed=4242)  # not sent before: no radix-cache hit
    p0, d0 = _kvbridge_metrics(prefill.url), _kvbridge_metrics(decode.url)
    _generate(router.url, input_ids)

    def delta(now: dict[str, float], before: dict[str, float], name: str) -> float:
        return now.get(f"sglang:kvbridge_{name}", 0.0) - before.get(f"sglang:kvbridge_{name}", 0.0)

    p1 = _wait_counted(prefill.url, p0, "requests_sent_total")
    d1 = _wait_counted(decode.url, d0, "requests_received_total")
    want = _kv_bytes(model, prefill, len(input_ids))
    assert delta(p1, p0, "requests_sent_total") == 1, p1
    assert delta(d1, d0, "requests_received_total") == 1, d1
    assert delta(p1, p0, "bytes_sent_total") == want
    assert delta(d1, d0, "bytes_received_total") == want
    assert delta(p1, p0, "transfers_total") >= 1
    assert delta(p1, p0, "exposed_transfer_seconds_count") == 1
    assert delta(p1, p0, "request_transfer_seconds_count") == 1
    assert delta(p1, p0, "failures_total") == 0 and delta(d1, d0, "failures_total") == 0
    for now in (p1, d1):  # the packed path's staging gauges exist on its servers only
        assert (now.get("sglang:kvbridge_staging_slots", 0.0) > 0) == packed, now


# --- wire_dtype fp8 ---------------------------------------------------------------------
# The KV crosses as FP8 (values) + float32 scales (one per token and head), packed by the
# torch reference ops on the prefill, unpacked into the decode's pages before SGLang sees
# the room received. SGLang's first output token comes from the prefill; the second is
# the first the decode computes from the transferred KV, so its top-5 logprobs are compared
# with the colocated (exact) server's: FP8 noise moves them by well under 0.6 (a page or
# a layer in the wrong place moves them by more than 1). Bytes: from the model's config
# and the packed format (csrc/PACKED_FORMAT.md), not from kvbridge's code.

FP8_CONFIGS = [("nixl", True), ("mooncake", False)]
FP8_PROMPTS = [_prompt(n, seed=900 + n) for n in (12, 64, 200)]
FP8_MAX_DRIFT = 0.6
# The decode's staging: 1 MiB holds 455 packed pages of one layer (2 x 16 tokens x 2
# heads x (32 FP8 bytes + a 4-byte scale), csrc/PACKED_FORMAT.md), so one 2000-token
# request (125 pages x 2 layers) fits and two do not: concurrent ones must wait.
DECODE_STAGING_MB = 1
LONG_PROMPTS = [_prompt(2000, seed=950 + i) for i in range(3)]


@pytest.fixture(scope="module", params=FP8_CONFIGS, ids=[f"{t}-{'layer' if lw else 'chunk'}" for t, lw in FP8_CONFIGS])
def fp8_pd(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    transport, layerwise = request.param
    log_dir = tmp_path_factory.mktemp(f"fp8-{transport}")
    config = {**_pd_config(transport, layerwise), "wire_dtype": "fp8", "staging_mb": 64}
    decode_env = _server_env({**config, "staging_mb": DECODE_STAGING_MB})
    yield from _start_pd(model, log_dir, _server_env(config), layerwise, decode_env)


def _generate_logprobs(url: str, input_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    body = {
        "input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        "return_logprob": True, "top_logprobs_num": 5,
    }  # fmt: skip
    status, data = _http(f"{url}/generate", body)
    assert status == 200, f"{url}/generate -> {status}: {data[:500]!r}"
    out = json.loads(data)
    tops = [{int(tok): float(lp) for lp, tok, *_ in step} for step in out["meta_info"]["output_top_logprobs"]]
    return list(out["output_ids"]), tops


def _fp8_bytes(model: Path, num_tokens: int) -> int:
    """Packed bytes of a prompt's pages: 1 byte per value plus a float32 scale per row
    (token and head), for K and V of every layer (csrc/PACKED_FORMAT.md)."""
    rows, head_dim = _kv_rows(model, num_tokens)
    return rows * (head_dim + 4)


def test_fp8_on_the_wire_stays_within_fp8_noise_and_moves_fewer_bytes(fp8_pd: PD, colocated: Proc, model: Path, record_property) -> None:
    router, prefill, decode, layerwise = fp8_pd
    worst, same = 0.0, 0
    for input_ids in FP8_PROMPTS:
        want, want_tops = _generate_logprobs(colocated.url, input_ids)
        d0 = _kvbridge_metrics(decode.url)
        offset = prefill.log_path.stat().st_size
        got, got_tops = _generate_logprobs(router.url, input_ids)
        assert len(got) == MAX_NEW_TOKENS and got[0] == want[0], f"the prefill's token differs: {got} vs {want}"
        a, b = want_tops[1], got_tops[1]  # the decode's first token from the transferred KV
        common = set(a) & set(b)
        assert len(common) >= 3, f"{len(input_ids)} tokens: top-5 barely overlap: {a} vs {b}"
        drift = max(abs(a[t] - b[t]) for t in common)
        assert drift < FP8_MAX_DRIFT, f"{len(input_ids)} tokens: logprobs moved by {drift:.2f}: {a} vs {b}\n{decode.log_tail()}"
        worst, same = max(worst, drift), same + (got == want)
        room, layer_writes, chunk_writes = _wait_sent_line(prefill, offset)
        assert (layer_writes > 0) == layerwise and chunk_writes + layer_writes > 0
        d1 = _wait_counted(decode.url, d0, "bytes_received_total")
        received = d1.get("sglang:kvbridge_bytes_received_total", 0.0) - d0.get("sglang:kvbridge_bytes_received_total", 0.0)
        want_bytes = _fp8_bytes(model, len(input_ids))
        assert received == want_bytes, f"room {room}: {received} bytes on the wire, FP8 of {len(input_ids)} tokens is {want_bytes}"
        exact = _kv_bytes(model, prefill, len(input_ids))
        assert exact / received > 1.7  # the test model: float16, head_dim 32: 64 bytes per row vs 36
    record_property("fp8_max_logprob_drift", worst)
    print(f"\nSGLang FP8 on the wire: greedy output equal to colocated for {same}/{len(FP8_PROMPTS)} prompts; logprobs within {worst:.2f}")


def test_fp8_requests_wait_for_room_in_the_decode_staging_buffer(fp8_pd: PD) -> None:
    """Three 2000-token prompts at once into a decode staging buffer that holds one: the
    rooms that find it full wait for runs to free up (their destinations are held, not
    refused), and each output equals that prompt's output when sent alone (FP8 KV is
    deterministic on SGLang's per-token layout). Before rooms waited, the prefill failed
    the ones that found no run."""
    router, _, decode, _ = fp8_pd
    alone = [_generate(router.url, ids) for ids in LONG_PROMPTS]
    offset = decode.log_path.stat().st_size
    results: dict[int, list[int] | BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = _generate(router.url, LONG_PROMPTS[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(LONG_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    for i, want in enumerate(alone):
        got = results.get(i)
        assert not isinstance(got, BaseException) and got is not None, f"prompt {i}: {got!r}\n{decode.log_tail()}"
        assert got == want, f"prompt {i}: {got} concurrently vs {want} alone"
    with open(decode.log_path, "rb") as f:
        f.seek(offset)
        waited = f.read().count(b"waits for room in the staging buffer")
    assert waited >= 1, "no room waited: the test did not fill the decode's staging buffer"
    used = _kvbridge_metrics(decode.url).get("sglang:kvbridge_staging_slots_used")
    deadline = time.monotonic() + 30
    while used != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        used = _kvbridge_metrics(decode.url).get("sglang:kvbridge_staging_slots_used")
    assert used == 0, f"the decode still holds {used} staging slots"
