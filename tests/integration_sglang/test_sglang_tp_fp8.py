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

from pathlib import Path

import pytest
from sglang_helpers import (
    FP8_MAX_DRIFT,
    MAX_NEW_TOKENS,
    Proc,
    expect_refused,
    fp8_bytes,
    fp8_drift,
    generate_logprobs,
    kvbridge_metrics,
    prompt_ids,
    reference_logprobs,
    start_pd,
    tp_sides,
    wait_received_bytes,
)

SEED = 31
pytestmark = pytest.mark.timeout(600)  # each test starts its servers (a minute or two on 2 cores)


@pytest.mark.extended  # `make test-all` only: FP8 into a decode of TP 2 runs in test_sglang_swa
def test_fp8_between_tp_sizes_stays_within_fp8_noise(
    model: Path, colocated: Proc, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sides = tp_sides(
        {"transport": "mooncake", "layerwise": False, "wire_dtype": "fp8", "staging_mb": 16}, 1, 2
    )
    env = sides.pop("env")
    pairs = start_pd(model, tmp_path_factory.mktemp("tp-fp8"), env, False, **sides)
    router, _prefill, decode, _ = next(pairs)
    try:
        for n in (12, 64, 200):
            input_ids = prompt_ids(n, seed=SEED + 7 * n)
            want, want_tops = reference_logprobs(colocated, input_ids)
            d0 = kvbridge_metrics(decode.url)
            got, got_tops = generate_logprobs(router.url, input_ids)
            assert len(got) == MAX_NEW_TOKENS and got[0] == want[0], (
                f"the prefill's token differs: {got} vs {want}"
            )
            # the decode's first token from the transferred KV
            drift = fp8_drift(want_tops[1], got_tops[1])
            assert drift < FP8_MAX_DRIFT, (
                f"{n} tokens: logprobs moved by {drift:.2f}\n{decode.log_tail()}"
            )
            received = wait_received_bytes(decode.url, d0, fp8_bytes(model, n))
            assert received == fp8_bytes(model, n), (
                f"{n} tokens: {received} bytes, not the FP8 bytes of every head of every page"
            )
    finally:
        pairs.close()


def test_direct_path_between_tp_sizes_is_refused_naming_the_fix(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sides = tp_sides({"transport": "nixl"}, 2, 1)
    env = sides.pop("env")
    log_dir = tmp_path_factory.mktemp("tp-direct")
    pairs = start_pd(model, log_dir, env, False, **sides)
    pd = next(pairs)
    try:
        text = expect_refused(pd, "the direct path between TP 2 and TP 1")
        logs = pd.prefill.log_path.read_bytes()
        assert b"refused decode" in logs and b"data_path 'packed'" in logs, pd.prefill.log_tail()
        assert "data_path 'packed'" in text, (
            f"the failed request does not name the fix: {text[-2000:]}"
        )
    finally:
        pairs.close()
