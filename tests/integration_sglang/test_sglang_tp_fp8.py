"""SGLang between different TP sizes, continued (test_sglang_tp.py has the exact pairs),
kvbridge backend, on CPU; each test starts its own prefill + decode + router:

- ``wire_dtype: fp8`` from prefill TP 1 to decode TP 2 over Mooncake, per chunk: the
  decode's first token from the transferred KV within FP8 noise of the colocated
  server's (top-5 logprobs within ``FP8_MAX_DRIFT``, as in test_sglang_pd.py) and
  exactly the packed format's bytes (every head of every page once, as two ranks'
  chunks);
- the direct path between TP sizes: refused at registration, and the request fails on
  both sides at once (the router answers within seconds, not at SGLang's 300 s
  timeouts) with the reason naming ``data_path 'packed'``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sglang_helpers import (
    FP8_MAX_DRIFT,
    MAX_NEW_TOKENS,
    Proc,
    fp8_bytes,
    fp8_drift,
    generate_logprobs,
    http,
    kvbridge_metrics,
    prompt_ids,
    start_pd,
    tp_sides,
    wait_received_bytes,
)

SEED = 31
pytestmark = pytest.mark.timeout(600)  # each test starts its servers (a minute or two on 2 cores)

REFUSAL_ANSWER_S = 60.0
"""The router answers once both sides failed the request: well before SGLang's own
300 s bootstrap and waiting timeouts."""


def test_fp8_between_tp_sizes_stays_within_fp8_noise(model: Path, colocated: Proc, tmp_path_factory: pytest.TempPathFactory) -> None:
    sides = tp_sides({"transport": "mooncake", "layerwise": False, "wire_dtype": "fp8", "staging_mb": 16}, 1, 2)
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
    sides = tp_sides({"transport": "nixl"}, 2, 1)
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
