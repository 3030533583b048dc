"""SGLang prefill and decode of different attention TP sizes, kvbridge backend, on CPU.

SGLang pairs the ranks itself (a decode rank bootstraps from the prefill rank holding
its KV heads, or from every prefill rank holding some of them); kvbridge moves each
pairing's heads through the packed path (``data_path: packed``: exact values), since an
SGLang page holds all of its rank's heads token by token and cannot be cut by head on
the direct path:

- prefill TP 2 -> decode TP 1 (the decode rank's run holds one part per prefill rank,
  each unpacked into its heads when that rank's ``Done`` lands) and TP 1 -> TP 2 (the
  prefill rank packs each decode rank's heads apart), per-layer streaming, NIXL;
- TP 2 -> TP 2 on the direct path (SGLang pairs the ranks one to one; whole pages);
- the greedy output equals a colocated TP 1 server's token for token (prompts across
  pages and chunks), every prefill rank logs the room sent, the decode side receives
  exactly the prompt's KV bytes (all heads once), and on the packed path both sides'
  staging slots all come back;
- FP8 between TP sizes and the direct path's refusal: test_sglang_tp_fp8.py (its own
  module: an idle SGLang scheduler spins on its core, so no two server sets are kept
  alive at once).

Two TP ranks on this two-core machine: each rank is bound to one core
(``SGLANG_CPU_OMP_THREADS_BIND``; SGLang's CPU all-reduce falls back to gloo without
AMX). TP 1 and TP 2 prefills round differently (the all-reduce), so a greedy tie could
tip either way; these prompts have none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_helpers import (
    MAX_NEW_TOKENS,
    PD,
    Proc,
    generate_through,
    kv_bytes,
    kvbridge_metrics,
    prompt_ids,
    reference_ids,
    sent_by_rank,
    start_pd,
    tp_sides,
    wait_received_bytes,
    wait_sent,
    wait_staging_idle,
)

# (prefill TP, decode TP, data path): equal sizes pair rank for rank on the direct path
PAIRS = [(2, 1, "packed"), (1, 2, "packed"), (2, 2, "direct")]
CONFIG = {"transport": "nixl", "layerwise_min_tokens": 0, "staging_mb": 16}
PROMPTS = {"short": 12, "page_boundary": 32, "chunked": 200}
SEED = 31


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            c, id=f"p{c[0]}-d{c[1]}-{c[2]}", marks=[pytest.mark.extended] if c[:2] == (1, 2) else []
        )
        for c in PAIRS
    ],  # TP 1 -> 2 (test-all only here) runs in test_sglang_state_space and test_sglang_swa
)
def tp_pd(
    request: pytest.FixtureRequest,
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    colocated: Proc,
):
    p_tp, d_tp, path = request.param
    log_dir = tmp_path_factory.mktemp(f"tp-p{p_tp}-d{d_tp}-{path}")
    sides = tp_sides({**CONFIG, "data_path": path}, p_tp, d_tp)
    env = sides.pop("env")
    for pd in start_pd(model, log_dir, env, True, **sides):
        yield pd, p_tp, d_tp, path


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_output_between_tp_sizes_equals_colocated(
    tp_pd: tuple[PD, int, int, str], colocated: Proc, model: Path, prompt: str
) -> None:
    (_router, prefill, decode, _), p_tp, d_tp, path = tp_pd
    input_ids = prompt_ids(PROMPTS[prompt], seed=SEED + PROMPTS[prompt])
    want = reference_ids(colocated, input_ids)
    d0 = kvbridge_metrics(decode.url)
    sent_before = sent_by_rank(prefill)
    got = generate_through(tp_pd[0], input_ids)
    assert len(want) == MAX_NEW_TOKENS
    assert got == want, (
        f"{prompt} ({PROMPTS[prompt]} tokens), prefill TP {p_tp} -> decode TP {d_tp}: {got} != "
        f"colocated {want}"
    )
    sent = wait_sent(prefill, sent_before, ranks=p_tp)  # one request on each prefill rank
    assert all(s.layer_writes > 0 for s in sent), f"not streamed on every rank: {sent}"
    expected = kv_bytes(model, prefill, len(input_ids))
    received = wait_received_bytes(decode.url, d0, expected)
    assert received == expected, (
        "the decode ranks together must receive every head of every page once"
    )
    for s in (prefill, decode) if path == "packed" else ():
        wait_staging_idle(s)
