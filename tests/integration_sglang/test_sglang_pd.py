"""SGLang prefill + decode with ``--disaggregation-transfer-backend kvbridge`` on CPU.

Real SGLang 0.5.23 servers on loopback (see docs/reference/sglang.md for the flags),
behind ``sglang_router.launch_router --pd-disaggregation --mini-lb``: the greedy output of
every prompt equals a colocated SGLang server started with the same flags, token for
token, over NIXL and over Mooncake (``KVBRIDGE_CONFIG``), each with per-chunk sends
(``layerwise: false``) and with per-layer streaming (``layerwise_min_tokens: 0``, so
every prompt streams); two of the pairs run a decode whose pages are 2 or 4 times the
prefill's, one a prefill whose pages are twice the decode's (``transfer_block_size``). The prefill's
per-room log line ("room R sent: L layer writes,
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
import threading
from pathlib import Path

import pytest

try:  # this directory runs in .venv-sglang only (make test); elsewhere: a clear error, not a skip
    import sglang  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh, then "
        ".venv-sglang/bin/python -m pytest tests/integration_sglang"
    ) from exc

from sglang_helpers import (
    FP8_MAX_DRIFT,
    MAX_NEW_TOKENS,
    PD,
    REQUEST_TIMEOUT_S,
    Proc,
    fp8_bytes,
    fp8_drift,
    generate_ids,
    generate_logprobs,
    generate_through,
    http,
    kv_bytes,
    kvbridge_metrics,
    pd_config,
    prompt_ids,
    reference_ids,
    reference_logprobs,
    sent_by_rank,
    server_env,
    start_pd,
    wait_counted,
    wait_received_bytes,
    wait_sent,
    wait_staging_idle,
)

PROMPTS = {
    "short": 12,  # less than one page
    "page_boundary": 32,  # exactly two pages
    "chunk_boundary": 64,  # exactly one chunk (four pages)
    "chunked": 200,  # four chunks, partial last page
}


# (transport, per-layer streaming, data path, secret, prefill page size, decode page
# size, decode radix cache): per-chunk keeps
# today's path exactly; per-layer with threshold 0 streams every prompt (the 12-token one
# too: its only page is partial but it is the last chunk); "packed" moves the exact
# values through the staging buffers (data_path: packed), so output and bytes must not
# change either; with a shared secret every kvbridge message carries a MAC (and nothing
# else changes). Page sizes other than 16: both servers run with transfer_block_size
# 16 and the one with larger pages addresses each as 2 or 4 transfer pages (the bytes
# moved are the prompt's 16-token pages, as between equal sizes): decodes of 32 and 64,
# and prefills of 32 (per layer, and per chunk on the packed path; their decodes without
# a radix cache: a hit would end inside one of the prefill's pages). Three decodes keep a
# radix cache of their own (--disaggregation-decode-enable-radix-cache, off by default in
# SGLang) and ask the prefill only for the pages past a hit.
PAGE = 16
PD_CONFIGS = [
    ("nixl", False, "direct", False, PAGE, PAGE, False),
    ("nixl", True, "direct", False, PAGE, PAGE, True),
    ("mooncake", False, "direct", False, PAGE, 32, True),
    ("mooncake", True, "direct", True, 32, PAGE, False),
    ("nixl", True, "packed", False, PAGE, 64, True),
    ("nixl", False, "packed", False, 32, PAGE, False),
]
# run by `make test-all` only (indices into PD_CONFIGS): NIXL per chunk on the direct path
# (per chunk runs over Mooncake here, the mode does not depend on the transport), and
# larger prefill pages on the packed path (test_sglang_prefill_pages and test_sglang_swa
# cut larger pages too)
EXTENDED_PD = {0, 5}
# Indices into PD_CONFIGS whose servers start their scheduler and detokenizer as SGLang
# does, spawned (each loads the plugins itself); the others fork them from the server
# (tests/sglang_stubs/sglang_fork_children, test speed), inheriting the hooks that the
# server's plugins applied, so only a spawned pair would show a plugin that registers in
# the server's process and not in the scheduler's.
SPAWNED = {1}


def _pd_id(
    transport: str, layerwise: bool, path: str, secret: bool, p_page: int, d_page: int, radix: bool
) -> str:
    return (
        f"{transport}-{'layer' if layerwise else 'chunk'}"
        + ("-packed" if path == "packed" else "")
        + ("-secret" if secret else "")
        + (f"-prefill-pages-{p_page}" if p_page != PAGE else "")
        + (f"-decode-pages-{d_page}" if d_page != PAGE else "")
        + ("-decode-radix" if radix else "")
    )


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(c, id=_pd_id(*c), marks=[pytest.mark.extended] if i in EXTENDED_PD else [])
        for i, c in enumerate(PD_CONFIGS)
    ],
)
def pd_router(
    request: pytest.FixtureRequest,
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    colocated: Proc,
):
    transport, layerwise, path, secret, p_page, d_page, radix = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{_pd_id(*request.param)}")
    config = {
        **pd_config(transport, layerwise),
        "data_path": path,
        **({"secret": "shared by prefill and decode"} if secret else {}),
    }
    if p_page != d_page:
        config["transfer_block_size"] = min(p_page, d_page)
    decode_args = [
        "--page-size",
        str(d_page),
        *(["--disaggregation-decode-enable-radix-cache"] if radix else []),
    ]
    env = server_env(config)
    if PD_CONFIGS.index(request.param) in SPAWNED:
        env["KVBRIDGE_TEST_SGLANG_FORK"] = "0"
    yield from start_pd(
        model,
        log_dir,
        env,
        layerwise,
        prefill_args=["--page-size", str(p_page)],
        decode_args=decode_args,
    )


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_output_equals_colocated(pd_router: PD, colocated: Proc, prompt: str) -> None:
    _router, prefill, _decode, layerwise = pd_router
    input_ids = prompt_ids(PROMPTS[prompt], seed=len(prompt))
    want = reference_ids(colocated, input_ids)
    before = sent_by_rank(prefill)
    got = generate_through(pd_router, input_ids)
    assert len(want) == MAX_NEW_TOKENS
    assert got == want, (
        f"{prompt} ({PROMPTS[prompt]} tokens): disaggregated {got} != colocated {want}"
    )
    (sent,) = wait_sent(prefill, before)
    if layerwise:
        # Every page went out from the attention hook; the chunk sends found nothing left
        # (random prompts: no radix-cache hits on the prefill).
        assert sent.layer_writes > 0 and sent.chunk_writes == 0, f"not all streamed: {sent}"
    else:
        assert sent.layer_writes == 0 and sent.chunk_writes > 0, f"not per chunk: {sent}"


def test_plugin_registers_backend() -> None:
    """The entry point is installed and adds ``kvbridge`` to SGLang's backends."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvbridge") == "kvbridge.adapters.sglang:register"


def test_metrics_count_each_request_and_its_bytes(
    pd_router: PD, model: Path, request: pytest.FixtureRequest
) -> None:
    router, prefill, decode, _ = pd_router
    packed = request.node.callspec.params["pd_router"][2] == "packed"
    input_ids = prompt_ids(PROMPTS["chunked"], seed=4242)  # not sent before: no radix-cache hit
    p0, d0 = kvbridge_metrics(prefill.url), kvbridge_metrics(decode.url)
    generate_ids(router.url, input_ids)

    def delta(now: dict[str, float], before: dict[str, float], name: str) -> float:
        return now.get(f"sglang:kvbridge_{name}", 0.0) - before.get(f"sglang:kvbridge_{name}", 0.0)

    p1 = wait_counted(prefill.url, p0, "requests_sent_total")
    d1 = wait_counted(decode.url, d0, "requests_received_total")
    want = kv_bytes(model, prefill, len(input_ids))
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


def test_decode_fetches_only_what_its_prefix_cache_lacks(
    pd_router: PD, colocated: Proc, model: Path, request: pytest.FixtureRequest
) -> None:
    """A decode with its own radix cache keeps a finished request's pages; a prompt that
    shares their first tokens is served from the first page past the hit (SGLang aligns
    a hit to the decode's page size), so the decode receives only the rest, and decodes
    as colocated does. A decode without it receives the whole prompt again (the
    prefill, whose own radix cache hits, still sends every page)."""
    d_page, radix = request.node.callspec.params["pd_router"][5:7]
    shared = prompt_ids(300, seed=31)
    first, second = shared + prompt_ids(50, seed=32), shared + prompt_ids(70, seed=33)
    generate_through(pd_router, first)
    before = kvbridge_metrics(pd_router.decode.url)
    got = generate_through(pd_router, second)
    assert got == reference_ids(colocated, second)
    hit = len(shared) // d_page * d_page if radix else 0
    want = kv_bytes(model, pd_router.prefill, len(second)) - kv_bytes(model, pd_router.prefill, hit)
    received = wait_received_bytes(pd_router.decode.url, before, want)
    assert received == want, (
        f"the decode received {received} bytes; the {len(second) - hit} tokens past a {hit}-token "
        f"hit are {want}"
    )


def test_parallel_sampling_moves_the_prompt_once_into_a_decode_radix_cache(
    pd_router: PD, colocated: Proc, model: Path, request: pytest.FixtureRequest
) -> None:
    """``n = 4``: SGLang runs the prefix primer and then each sample on the request's
    one bootstrap room, each a transfer of its own (``adapters/sglang/lanes.py``). A
    decode with its own radix cache keeps the primer's pages, so each sample finds
    them and receives only the pages past the hit (SGLang never matches a prompt's last
    token); without one, each sample receives the whole prompt again. Greedy: every
    sample decodes as colocated does."""
    d_page, radix = request.node.callspec.params["pd_router"][5:7]
    n, input_ids = 4, prompt_ids(300, seed=4343)  # not sent before: the primer moves it all
    want = reference_ids(colocated, input_ids)
    before = kvbridge_metrics(pd_router.decode.url)
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "n": n},
    }
    status, data = http(f"{pd_router.router.url}/generate", body, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, f"{status}: {data[:500]!r}"
    samples = [out["output_ids"] for out in json.loads(data)]
    assert samples == [want] * n, f"{samples} != {n} x colocated {want}"
    whole = kv_bytes(model, pd_router.prefill, len(input_ids))
    hit = (len(input_ids) - 1) // d_page * d_page if radix else 0
    per_sample = whole - kv_bytes(model, pd_router.prefill, hit)
    expected = whole + n * per_sample
    received = wait_received_bytes(pd_router.decode.url, before, expected)
    assert received == expected, (
        f"the decode received {received} bytes: the primer's {whole} and {n} samples past a "
        f"{hit}-token hit are {expected}"
    )


# --- wire_dtype fp8 ---------------------------------------------------------------------
# The KV crosses as FP8 (values) + float32 scales (one per token and head), packed by the
# torch reference ops on the prefill, unpacked into the decode's pages before SGLang sees
# the room received. SGLang's first output token comes from the prefill; the second is
# the first the decode computes from the transferred KV, so its top-5 logprobs are compared
# with the colocated (exact) server's: FP8 noise moves them by well under 0.6 (a page or
# a layer in the wrong place moves them by more than 1). Bytes: from the model's config
# and the packed format (csrc/PACKED_FORMAT.md), not from kvbridge's code.

FP8_CONFIGS = [("nixl", True), ("mooncake", False)]
FP8_PROMPTS = [prompt_ids(n, seed=900 + n) for n in (12, 64, 200)]
# The decode's staging: 1 MiB holds 455 packed pages of one layer (2 x 16 tokens x 2
# heads x (32 FP8 bytes + a 4-byte scale), csrc/PACKED_FORMAT.md), so one 2000-token
# request (125 pages x 2 layers) fits and two do not: concurrent ones must wait.
DECODE_STAGING_MB = 1
LONG_PROMPTS = [prompt_ids(2000, seed=950 + i) for i in range(3)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            c,
            id=f"{c[0]}-{'layer' if c[1] else 'chunk'}",
            marks=[pytest.mark.extended] if i else [],
        )
        for i, c in enumerate(FP8_CONFIGS)
    ],  # FP8 over Mooncake (test-all only here) runs in test_sglang_state_space
)
def fp8_pd(
    request: pytest.FixtureRequest,
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    colocated: Proc,
):
    transport, layerwise = request.param
    log_dir = tmp_path_factory.mktemp(f"fp8-{transport}")
    config = {**pd_config(transport, layerwise), "wire_dtype": "fp8", "staging_mb": 64}
    decode_env = server_env({**config, "staging_mb": DECODE_STAGING_MB})
    yield from start_pd(model, log_dir, server_env(config), layerwise, decode_env)


def test_fp8_on_the_wire_stays_within_fp8_noise_and_moves_fewer_bytes(
    fp8_pd: PD, colocated: Proc, model: Path, record_property
) -> None:
    router, prefill, decode, layerwise = fp8_pd
    worst, same = 0.0, 0
    for input_ids in FP8_PROMPTS:
        want, want_tops = reference_logprobs(colocated, input_ids)
        d0 = kvbridge_metrics(decode.url)
        before = sent_by_rank(prefill)
        got, got_tops = generate_logprobs(router.url, input_ids)
        assert len(got) == MAX_NEW_TOKENS and got[0] == want[0], (
            f"the prefill's token differs: {got} vs {want}"
        )
        # the decode's first token from the transferred KV
        drift = fp8_drift(want_tops[1], got_tops[1])
        assert drift < FP8_MAX_DRIFT, (
            f"{len(input_ids)} tokens: logprobs moved by {drift:.2f}\n{decode.log_tail()}"
        )
        worst, same = max(worst, drift), same + (got == want)
        (sent,) = wait_sent(prefill, before)
        assert (sent.layer_writes > 0) == layerwise, sent
        assert sent.chunk_writes + sent.layer_writes > 0, sent
        d1 = wait_counted(decode.url, d0, "bytes_received_total")
        received = d1.get("sglang:kvbridge_bytes_received_total", 0.0) - d0.get(
            "sglang:kvbridge_bytes_received_total", 0.0
        )
        want_bytes = fp8_bytes(model, len(input_ids))
        assert received == want_bytes, (
            f"{received} bytes on the wire, FP8 of {len(input_ids)} tokens is {want_bytes}"
        )
        exact = kv_bytes(model, prefill, len(input_ids))
        # the test model: float16, head_dim 32: 64 bytes per row vs 36
        assert exact / received > 1.7
    record_property("fp8_max_logprob_drift", worst)
    print(
        f"\nSGLang FP8 on the wire: greedy output equal to colocated for {same}/{len(FP8_PROMPTS)} "
        f"prompts; logprobs within {worst:.2f}"
    )


def test_fp8_requests_wait_for_room_in_the_decode_staging_buffer(fp8_pd: PD) -> None:
    """Three 2000-token prompts at once into a decode staging buffer that holds one: the
    rooms that find it full wait for runs to free up (their destinations are held, not
    refused), and each output equals that prompt's output when sent alone (FP8 KV is
    deterministic on SGLang's per-token layout). Before rooms waited, the prefill failed
    the ones that found no run."""
    router, _, decode, _ = fp8_pd
    alone = [generate_ids(router.url, ids) for ids in LONG_PROMPTS]
    offset = decode.log_path.stat().st_size
    results: dict[int, list[int] | BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = generate_ids(router.url, LONG_PROMPTS[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(LONG_PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    for i, want in enumerate(alone):
        got = results.get(i)
        assert not isinstance(got, BaseException) and got is not None, (
            f"prompt {i}: {got!r}\n{decode.log_tail()}"
        )
        assert got == want, f"prompt {i}: {got} concurrently vs {want} alone"
    with open(decode.log_path, "rb") as f:
        f.seek(offset)
        waited = f.read().count(b"waits for room in the staging buffer")
    assert waited >= 1, "no room waited: the test did not fill the decode's staging buffer"
    wait_staging_idle(decode)
