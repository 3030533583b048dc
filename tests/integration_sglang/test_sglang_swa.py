"""A sliding-window model through kvbridge between real SGLang servers: SGLang keeps
such a model (gpt-oss, Gemma 4, Laguna, ...) in its hybrid sliding-window pool, the
full-attention layers' KV in one sub-pool and the window layers' in another whose pages
hold only each request's last window. The test model: the tiny Laguna of
``kvbridge.demo.model`` (4 layers alternating full attention and a 40-token window).

Three pairs (:data:`PD_CONFIGS`): the direct path over NIXL per layer; the packed path
with exact values over Mooncake per chunk from a prefill of two attention TP ranks into
a decode of one (each prefill rank moves its half of the KV heads, of the window layers
too); FP8 on the wire over NIXL per layer from a prefill of one attention TP rank into a
decode of two (each decode rank receives its half). For prompts shorter and longer than the
window: greedy output equals a colocated server's token for token
(FP8: the decode's first computed token's logprobs stay within FP8 noise), the
prefill's log shows the path each request took, and the decode received exactly the
full layers' pages of the prompt plus the window layers' pages of its last window
(SGLang's window start, rounded down to a page), as bytes of the path's format
(csrc/PACKED_FORMAT.md for FP8). Two decodes keep a radix cache of their own: a
conversation's next turn moves only the pages past SGLang's hit and the new window's.
Two pairs run with other page sizes on each side (``transfer_block_size``), one with
the prefill's pages larger, one with the decode's; both compare greedy output exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from sglang_helpers import (
    ENGINE_FLAGS,
    FP8_MAX_DRIFT,
    PD,
    Proc,
    check_hit,
    check_sent,
    fp8_drift,
    generate_as_colocated,
    generate_logprobs,
    generate_through,
    kv_itemsize,
    kvbridge_metrics,
    pd_config,
    prompt_ids,
    reference_ids,
    reference_logprobs,
    sent_by_rank,
    start_colocated,
    start_pd,
    tp_sides,
    wait_received_bytes,
    wait_staging_idle,
)

# under a page, two pages (inside the window), one chunk, four chunks past the window;
# the last two's windows start in the second half of a 32-token page
PROMPTS = [12, 32, 64, 216]
PAGE = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "swa-laguna", shape="swa")


@pytest.fixture(scope="module")
def colocated_swa(swa_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from start_colocated(swa_model, tmp_path_factory.mktemp("swa-colocated"))


# (transport, per layer, wire, prefill TP, decode TP, prefill page, decode page, decode
# radix cache). Two pairs have other page sizes on each side (transfer_block_size 16:
# each side addresses its pages in 16-token transfer pages, and the larger pages' window
# list starts up to a page earlier than SGLang's window start rounded to 16, at
# positions no window attention reads). Direct over NIXL per layer, the prefill's pages
# twice the decode's (its earlier window pages go nowhere; no decode radix cache, whose
# hits would end inside the prefill's pages). Packed exact over Mooncake per chunk from
# a prefill of two attention TP ranks (each moves its half of the KV heads, window
# layers too) into a decode of one whose pages are twice the prefill's (the decode
# unpacks only the window pages the prefill wrote) and which keeps a radix cache of its
# own. FP8 over NIXL per layer between equal pages from a prefill of one rank into a
# decode of two (each receives its half), with a decode radix cache.
PD_CONFIGS = [
    ("nixl", True, "direct", 1, 1, 2 * PAGE, PAGE, False),
    ("mooncake", False, "packed", 2, 1, PAGE, 2 * PAGE, True),
    ("nixl", True, "fp8", 1, 2, PAGE, PAGE, True),
]
WIRE = {"direct": {}, "packed": {"data_path": "packed"}, "fp8": {"wire_dtype": "fp8"}}


class SwaPD(NamedTuple):
    pd: PD
    wire: str
    prefill_tp: int
    decode_page: int
    radix: bool


def _pd_id(transport, layerwise, wire, p_tp, d_tp, p_page, d_page, radix) -> str:
    return (
        f"{transport}-{'layer' if layerwise else 'chunk'}-{wire}-p{p_tp}d{d_tp}"
        + (f"-pages-{p_page}-{d_page}" if p_page != d_page else "")
        + ("-decode-radix" if radix else "")
    )


@pytest.fixture(scope="module", params=PD_CONFIGS, ids=[_pd_id(*c) for c in PD_CONFIGS])
def swa_pd(
    request: pytest.FixtureRequest, swa_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SwaPD]:
    transport, layerwise, wire, p_tp, d_tp, p_page, d_page, radix = request.param
    log_dir = tmp_path_factory.mktemp(f"swa-{transport}-{wire}")
    config = {**pd_config(transport, layerwise), **WIRE[wire]}
    if p_page != d_page:
        config["transfer_block_size"] = min(p_page, d_page)
    sides = tp_sides(config, p_tp, d_tp)
    env = sides.pop("env")
    sides["prefill_args"] = [*sides["prefill_args"], "--page-size", str(p_page)]
    # a decode radix cache keeps finished requests (random prompts: no hits but those of
    # test_a_conversation_s_next_turn_moves_only_what_the_decode_lacks)
    sides["decode_args"] = [
        *sides["decode_args"],
        "--page-size",
        str(d_page),
        *(["--disaggregation-decode-enable-radix-cache"] if radix else []),
    ]
    for pd in start_pd(swa_model, log_dir, env, layerwise, **sides):
        yield SwaPD(pd, wire, p_tp, d_page, radix)


def window_size(model: Path) -> int:
    """SGLang's sliding window of the test model: Laguna's ``sliding_window - 1`` (HF's
    inclusive window made exclusive)."""
    return json.loads((model / "config.json").read_text())["sliding_window"] - 1


def expected_bytes(model: Path, server: Proc, n: int, *, hit: int = 0, fp8: bool = False) -> int:
    """KV bytes of an ``n``-token prompt in SGLang's sliding-window pool whose first
    ``hit`` tokens (a page multiple) the decode holds already, from the model's config:
    each full-attention layer's pages of the prompt past the hit, and each window
    layer's pages from SGLang's window start (``n`` minus :func:`window_size`, or the hit
    if later, rounded down to a page) to the prompt's end; pages of :data:`PAGE` tokens,
    the smaller of the two sides' (the window's positions all lie in the smaller pages'
    window list, which is paired whole). A row (one token's one head of
    K or V) is ``head_dim`` values of the server's KV dtype, or with ``fp8`` as many FP8
    bytes and a float32 scale (csrc/PACKED_FORMAT.md)."""
    cfg = json.loads((model / "config.json").read_text())
    kinds = cfg["layer_types"]
    row = cfg["head_dim"] + 4 if fp8 else cfg["head_dim"] * kv_itemsize(server)
    page_bytes = PAGE * cfg["num_key_value_heads"] * row
    pages = math.ceil(n / PAGE)
    window_start = max(hit, n - window_size(model)) // PAGE
    full = kinds.count("full_attention") * (pages - hit // PAGE)
    window = kinds.count("sliding_attention") * (pages - window_start)
    return 2 * (full + window) * page_bytes  # K and V


@pytest.mark.parametrize("n", PROMPTS)
def test_sliding_window_output_equals_colocated(
    swa_pd: SwaPD, colocated_swa: Proc, swa_model: Path, n: int
) -> None:
    pd, fp8 = swa_pd.pd, swa_pd.wire == "fp8"
    input_ids = prompt_ids(n, seed=900 + n)
    sent_before = sent_by_rank(pd.prefill)
    before = kvbridge_metrics(pd.decode.url)
    generate_as_colocated(pd, colocated_swa, input_ids, max_drift=FP8_MAX_DRIFT if fp8 else None)
    # one line per prefill rank; per layer: the full-attention layers (the window
    # layers' pages go after the last chunk)
    check_sent(pd, sent_before, swa_pd.prefill_tp)
    expected = expected_bytes(swa_model, pd.decode, n, fp8=fp8)
    received = wait_received_bytes(pd.decode.url, before, expected)
    assert received == expected, (
        f"{n} tokens: the decode received {received} bytes, the prompt's full pages and last "
        f"window are {expected} (every head once)"
    )
    if swa_pd.wire != "direct":  # every staging run comes back on both sides
        wait_staging_idle(pd.prefill)
        wait_staging_idle(pd.decode)


def most_hit(model: Path, previous: int, n: int, page: int) -> int:
    """The most tokens of an ``n``-token prompt that SGLang's decode radix cache can
    serve after it finished a request of ``previous`` tokens (prompt and output) that
    the prompt extends: the previous request's KV (all but its last token, which no
    forward saw) in whole pages of the decode's ``page`` tokens, but no further than the
    last page before the decode's window tail (``n - 1 - max(window, page)`` rounded
    down to a page; the window layers' pages of that tail the decode allocates afresh
    and receives, ``disaggregation/decode.py::_swa_tail_len``). SGLang's tree may match
    less: it ends a match only where a whole window of window-layer slots precedes it
    (``unified_cache/components/swa.py``), which depends on how earlier inserts split
    its nodes."""
    cached = (previous - 1) // page * page
    tail_start = max(0, n - 1 - max(window_size(model), page)) // page * page
    return min(cached, tail_start)


# new tokens per turn: past the window (the hit ends at the previous request's last
# page), then under it (the window tail caps the hit)
TURNS = [216, 60, 100, 20]


def test_a_conversation_s_next_turn_moves_only_what_the_decode_lacks(
    swa_pd: SwaPD, colocated_swa: Proc, swa_model: Path
) -> None:
    """A conversation: each turn's prompt is the previous prompt, the pair's answer to
    it and new tokens. A decode with a radix cache of its own
    (``--disaggregation-decode-enable-radix-cache``) keeps each finished request's
    pages, full-attention and window layers, and matches the next turn against them: it
    receives only the pages past the hit (and the window layers' pages of the new
    window; the bytes tell how far SGLang matched, at most :func:`most_hit`, and must
    name a hit where one could be), yet decodes as a colocated server does (FP8: the
    decode's first computed token within FP8 noise). A hit that kvbridge wrote past,
    or whose window pages it sent to the wrong place, decodes other tokens. A decode
    without one receives each turn whole."""
    pd, fp8 = swa_pd.pd, swa_pd.wire == "fp8"
    prompt: list[int] = []
    previous, page = 0, swa_pd.decode_page
    for turn, new in enumerate(TURNS):
        prompt = prompt + prompt_ids(new, seed=5150 + turn)
        n = len(prompt)
        most = most_hit(swa_model, previous, n, page) if turn and swa_pd.radix else 0
        before = kvbridge_metrics(pd.decode.url)
        if fp8:
            want, want_tops = reference_logprobs(colocated_swa, prompt)
            got, got_tops = generate_logprobs(pd.router.url, prompt)
            drift = fp8_drift(want_tops[1], got_tops[1])
            assert drift < FP8_MAX_DRIFT, f"turn {turn}: logprobs moved by {drift:.2f}"
        else:
            want = reference_ids(colocated_swa, prompt)
            got = generate_through(pd, prompt)
            assert got == want, f"turn {turn} ({n} tokens): {got} != {want}"
        # the decode counted its bytes before SGLang saw the room received: final now
        least = expected_bytes(swa_model, pd.decode, n, hit=most, fp8=fp8)
        received = wait_received_bytes(pd.decode.url, before, least)
        moved = {
            hit: expected_bytes(swa_model, pd.decode, n, hit=hit, fp8=fp8)
            for hit in range(0, most + 1, page)
        }
        check_hit(turn, received, moved, most)
        previous = n + len(got)
        prompt = prompt + got
    if swa_pd.wire != "direct":
        wait_staging_idle(pd.prefill)
        wait_staging_idle(pd.decode)
