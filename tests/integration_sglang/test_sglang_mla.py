"""MLA (DeepSeek-V2's multi-head latent attention) through kvbridge between real SGLang
servers: SGLang's MLA pool holds one latent row (kv_lora_rank 512 + rope 64 values) per
token and layer, the same on every TP rank (kvbridge's ``latent`` layout).

TP 1 -> TP 1, NIXL per layer and Mooncake per chunk: greedy output equals a colocated
server token for token, the prefill's log shows the path each request took, and the
decode received exactly the prompt's latent pages (between TP sizes:
test_sglang_mla_tp.py). SGLang runs MLA on this CPU through the test plugin
``tests/sglang_stubs/sglang_cpu_mla`` (its AMX backend needs AMX)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_helpers import (
    MAX_NEW_TOKENS,
    PD,
    Proc,
    generate_ids,
    generate_through,
    kvbridge_metrics,
    latent_bytes,
    pd_config,
    prompt_ids,
    server_env,
    start_colocated,
    start_pd,
    wait_received_bytes,
    wait_sent_line,
)

PROMPTS = [12, 32, 64, 200]  # under a page, two pages, one chunk, four chunks with a partial page


@pytest.fixture(scope="module")
def colocated_mla(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from start_colocated(mla_model, tmp_path_factory.mktemp("mla-colocated"))


PD_CONFIGS = [("nixl", True), ("mooncake", False)]


@pytest.fixture(scope="module", params=PD_CONFIGS, ids=[f"{t}-{'layer' if lw else 'chunk'}" for t, lw in PD_CONFIGS])
def mla_pd(request: pytest.FixtureRequest, mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    transport, layerwise = request.param
    log_dir = tmp_path_factory.mktemp(f"mla-{transport}")
    yield from start_pd(mla_model, log_dir, server_env(pd_config(transport, layerwise)), layerwise)


@pytest.mark.parametrize("n", PROMPTS)
def test_mla_greedy_output_equals_colocated(mla_pd: PD, colocated_mla: Proc, mla_model: Path, n: int) -> None:
    input_ids = prompt_ids(n, seed=700 + n)
    want = generate_ids(colocated_mla.url, input_ids)
    assert len(want) == MAX_NEW_TOKENS
    offset = mla_pd.prefill.log_path.stat().st_size
    before = kvbridge_metrics(mla_pd.decode.url)
    got = generate_through(mla_pd, input_ids)
    assert got == want, f"{n} tokens: disaggregated {got} != colocated {want}"
    room, layer_writes, chunk_writes = wait_sent_line(mla_pd.prefill, offset)
    if mla_pd.layerwise:
        assert layer_writes > 0 and chunk_writes == 0, f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk writes"
    else:
        assert layer_writes == 0 and chunk_writes > 0, f"room {room}: {layer_writes} layer writes, {chunk_writes} chunk writes"
    expected = latent_bytes(mla_model, mla_pd.decode, n)
    got_bytes = wait_received_bytes(mla_pd.decode.url, before, expected)
    assert got_bytes == expected, f"the decode received {got_bytes} bytes, the prompt's latent pages are {expected}"
