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
- ``wire_dtype: fp8`` from prefill TP 1 to decode TP 2 over Mooncake, per chunk: the
  decode's first token from the transferred KV within FP8 noise of colocated (top-5
  logprobs within 0.6, as in test_sglang_pd.py) and exactly the packed format's bytes;
- the direct path between TP sizes is refused at registration, and the request fails
  with the reason, naming ``data_path 'packed'``.

Two TP ranks on this two-core machine: each rank is bound to one core
(``SGLANG_CPU_OMP_THREADS_BIND``; SGLang's CPU all-reduce falls back to gloo without
AMX). TP 1 and TP 2 prefills round differently (the all-reduce), so a greedy tie could
tip either way; these prompts have none.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sglang_helpers import (
    FP8_MAX_DRIFT,
    MAX_NEW_TOKENS,
    PD,
    Proc,
    fp8_bytes,
    fp8_drift,
    generate_ids,
    generate_logprobs,
    generate_through,
    http,
    kv_bytes,
    kvbridge_metrics,
    prompt_ids,
    server_env,
    start_pd,
    wait_received_bytes,
    wait_sent_lines,
)

# (prefill TP, decode TP, data path): equal sizes pair rank for rank on the direct path
PAIRS = [(2, 1, "packed"), (1, 2, "packed"), (2, 2, "direct")]
CONFIG = {"transport": "nixl", "layerwise_min_tokens": 0, "staging_mb": 16}
TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = {"short": 12, "page_boundary": 32, "chunked": 200}
SEED = 31


def _sides(config: dict, p_tp: int, d_tp: int) -> dict:
    """start_pd's per-side flags and environments for these TP sizes."""
    env = server_env(config)

    def side(tp: int) -> tuple[list[str], dict[str, str]]:
        return (["--tp", str(tp)], {**env, **TWO_RANKS}) if tp == 2 else ([], env)

    (p_args, p_env), (d_args, d_env) = side(p_tp), side(d_tp)
    return {"env": env, "prefill_env": p_env, "decode_env": d_env, "prefill_args": p_args, "decode_args": d_args}


@pytest.fixture(scope="module", params=PAIRS, ids=[f"p{p}-d{d}-{path}" for p, d, path in PAIRS])
def tp_pd(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    p_tp, d_tp, path = request.param
    log_dir = tmp_path_factory.mktemp(f"tp-p{p_tp}-d{d_tp}-{path}")
    sides = _sides({**CONFIG, "data_path": path}, p_tp, d_tp)
    env = sides.pop("env")
    for pd in start_pd(model, log_dir, env, True, **sides):
        yield pd, p_tp, d_tp, path


def _staging_used(url: str) -> float | None:
    return kvbridge_metrics(url).get("sglang:kvbridge_staging_slots_used")


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_output_between_tp_sizes_equals_colocated(tp_pd: tuple[PD, int, int, str], colocated: Proc, model: Path, prompt: str) -> None:
    (router, prefill, decode, _), p_tp, d_tp, path = tp_pd
    input_ids = prompt_ids(PROMPTS[prompt], seed=SEED + PROMPTS[prompt])
    want = generate_ids(colocated.url, input_ids)
    d0 = kvbridge_metrics(decode.url)
    offset = prefill.log_path.stat().st_size
    got = generate_through(tp_pd[0], input_ids)
    assert len(want) == MAX_NEW_TOKENS
    assert got == want, f"{prompt} ({PROMPTS[prompt]} tokens), prefill TP {p_tp} -> decode TP {d_tp}: {got} != colocated {want}"
    lines = wait_sent_lines(prefill, offset, count=p_tp)  # one per prefill rank
    assert len({room for room, _, _ in lines}) == 1 and all(layer > 0 for _, layer, _ in lines), lines
    expected = kv_bytes(model, prefill, len(input_ids))
    received = wait_received_bytes(decode.url, d0, expected)
    assert received == expected, "the decode ranks together must receive every head of every page once"
    for s in (prefill, decode) if path == "packed" else ():
        used = _staging_used(s.url)
        deadline = time.monotonic() + 30
        while used != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            used = _staging_used(s.url)
        assert used == 0, f"{s.log_path.stem} still holds {used} staging slots"


REFUSAL_ANSWER_S = 60.0
"""The router answers once both sides failed the request: well before SGLang's own
300 s bootstrap and waiting timeouts."""


def test_fp8_between_tp_sizes_stays_within_fp8_noise(model: Path, colocated: Proc, tmp_path_factory: pytest.TempPathFactory) -> None:
    sides = _sides({"transport": "mooncake", "layerwise": False, "wire_dtype": "fp8", "staging_mb": 16}, 1, 2)
    env = sides.pop("env")
    pairs = start_pd(model, tmp_path_factory.mktemp("tp-fp8"), env, False, **sides)
    router, prefill, decode, _ = next(pairs)
    try:
        for n in (12, 64, 200):
            input_ids = prompt_ids(n, seed=SEED + 7 * n)
            want, want_tops = generate_logprobs(colocated.url, input_ids)
            d0 = kvbridge_metrics(decode.url)
            got, got_tops = generate_logprobs(router.url, input_ids)
            assert len(got) == MAX_NEW_TOKENS and got[0] == want[0], f"the prefill's token differs: {got} vs {want}"
            drift = fp8_drift(want_tops[1], got_tops[1])  # the decode's first token from the transferred KV
            assert drift < FP8_MAX_DRIFT, f"{n} tokens: logprobs moved by {drift:.2f}\n{decode.log_tail()}"
            received = wait_received_bytes(decode.url, d0, fp8_bytes(model, n))
            assert received == fp8_bytes(model, n), f"{n} tokens: {received} bytes, not the FP8 bytes of every head of every page"
    finally:
        pairs.close()


def test_direct_path_between_tp_sizes_is_refused_naming_the_fix(model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    sides = _sides({"transport": "nixl"}, 2, 1)
    env = sides.pop("env")
    log_dir = tmp_path_factory.mktemp("tp-direct")
    pairs = start_pd(model, log_dir, env, False, **sides)
    router, prefill, decode, _ = next(pairs)
    try:
        started = time.monotonic()
        body_in = {"input_ids": prompt_ids(40, seed=5), "sampling_params": {"max_new_tokens": 4}}
        status, body = http(f"{router.url}/generate", body_in, timeout=REFUSAL_ANSWER_S)
        assert status != 0, f"no answer within {REFUSAL_ANSWER_S:.0f} s (both sides must fail the request): {body[:300]!r}\n{prefill.log_tail()}"
        assert status != 200, f"the direct path between TP 2 and TP 1 served a request: {body[:300]!r}"
        print(f"\nrefused request answered {status} after {time.monotonic() - started:.1f} s")
        logs = prefill.log_path.read_bytes()
        assert b"refused decode" in logs and b"data_path 'packed'" in logs, prefill.log_tail()
        text = body.decode(errors="replace") + decode.log_path.read_text(errors="replace")
        assert "data_path 'packed'" in text, f"the failed request does not name the fix: {body[:500]!r}\n{decode.log_tail()}"
    finally:
        pairs.close()
