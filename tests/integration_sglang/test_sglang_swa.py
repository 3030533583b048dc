"""A sliding-window model through kvbridge between real SGLang servers: SGLang keeps
such a model (gpt-oss, Gemma 4, Laguna, ...) in its hybrid sliding-window pool, the
full-attention layers' KV in one sub-pool and the window layers' in another whose pages
hold only each request's last window. The test model: the tiny Laguna of
``kvbridge.demo.model`` (4 layers alternating full attention and a 40-token window).

NIXL per layer and Mooncake per chunk: greedy output equals a colocated server's token
for token for prompts shorter and longer than the window, the prefill's log shows the
path each request took, and the decode received exactly the full layers' pages of the
prompt plus the window layers' pages of its last window (SGLang's window start, rounded
down to a page). Options the window pool does not take yet (the packed path) are
refused when the server starts, naming the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import (
    ENGINE_FLAGS,
    MAX_NEW_TOKENS,
    PD,
    START_TIMEOUT_S,
    Proc,
    generate_ids,
    generate_through,
    kv_itemsize,
    kvbridge_metrics,
    pd_config,
    prompt_ids,
    server_env,
    start_colocated,
    start_pd,
    start_server,
    wait_received_bytes,
    wait_sent_line,
)

from kvbridge.demo.servers import ServerError

# under a page, two pages (inside the window), one chunk, four chunks past the window
PROMPTS = [12, 32, 64, 200]
PAGE = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "swa-laguna", shape="swa")


@pytest.fixture(scope="module")
def colocated_swa(swa_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from start_colocated(swa_model, tmp_path_factory.mktemp("swa-colocated"))


PD_CONFIGS = [("nixl", True), ("mooncake", False)]


@pytest.fixture(
    scope="module",
    params=PD_CONFIGS,
    ids=[f"{t}-{'layer' if lw else 'chunk'}" for t, lw in PD_CONFIGS],
)
def swa_pd(
    request: pytest.FixtureRequest, swa_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    transport, layerwise = request.param
    log_dir = tmp_path_factory.mktemp(f"swa-{transport}")
    yield from start_pd(swa_model, log_dir, server_env(pd_config(transport, layerwise)), layerwise)


def expected_bytes(model: Path, server: Proc, n: int) -> int:
    """KV bytes of an ``n``-token prompt in SGLang's sliding-window pool, from the model's
    config: every page of the prompt in each full-attention layer, and in each window
    layer the pages from SGLang's window start (``n`` minus its window of
    ``sliding_window - 1`` tokens, HF's inclusive window made exclusive, rounded down to
    a page) to the prompt's end."""
    cfg = json.loads((model / "config.json").read_text())
    kinds = cfg["layer_types"]
    page_bytes = PAGE * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_itemsize(server)
    pages = math.ceil(n / PAGE)
    window_start = max(0, n - (cfg["sliding_window"] - 1)) // PAGE
    full = kinds.count("full_attention") * pages
    window = kinds.count("sliding_attention") * (pages - window_start)
    return 2 * (full + window) * page_bytes  # K and V


@pytest.mark.parametrize("n", PROMPTS)
def test_sliding_window_greedy_output_equals_colocated(
    swa_pd: PD, colocated_swa: Proc, swa_model: Path, n: int
) -> None:
    input_ids = prompt_ids(n, seed=900 + n)
    want = generate_ids(colocated_swa.url, input_ids)
    assert len(want) == MAX_NEW_TOKENS
    offset = swa_pd.prefill.log_path.stat().st_size
    before = kvbridge_metrics(swa_pd.decode.url)
    got = generate_through(swa_pd, input_ids)
    assert got == want, f"{n} tokens: disaggregated {got} != colocated {want}"
    room, layer_writes, chunk_writes = wait_sent_line(swa_pd.prefill, offset)
    if swa_pd.layerwise:
        # the full-attention layers go per layer; the window layers' pages after the last chunk
        assert layer_writes > 0, f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk"
    else:
        assert layer_writes == 0 and chunk_writes > 0, (
            f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk writes"
        )
    expected = expected_bytes(swa_model, swa_pd.decode, n)
    received = wait_received_bytes(swa_pd.decode.url, before, expected)
    assert received == expected, (
        f"{n} tokens: the decode received {received} bytes, the prompt's full pages and last "
        f"window are {expected}"
    )


def test_the_packed_path_is_refused_at_start_naming_the_fix(
    swa_model: Path, tmp_path: Path
) -> None:
    server = start_server(
        "prefill-packed",
        swa_model,
        tmp_path,
        [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-transfer-backend",
            "kvbridge",
        ],
        server_env({"data_path": "packed"}),
    )
    try:
        with pytest.raises(ServerError):
            server.wait_ready(START_TIMEOUT_S)
        log = server.log_path.read_text(errors="replace")
        assert "does not take SGLang's sliding-window pools yet" in log, server.log_tail()
        assert "leave wire_dtype and data_path at their defaults" in log, server.log_tail()
    finally:
        server.kill()
