"""MLA (DeepSeek-V2's multi-head latent attention) through kvbridge between real SGLang
servers: SGLang's MLA pool holds one latent row (kv_lora_rank 512 + rope 64 values) per
token and layer, the same on every TP rank (kvbridge's ``latent`` layout).

TP 1 -> TP 1, NIXL per layer and Mooncake per chunk: greedy output equals a colocated
server token for token, the prefill's log shows the path each request took, and the
decode received exactly the prompt's latent pages (between TP sizes:
test_sglang_mla_tp.py). The packed path: exact values through staging (Mooncake, per
chunk) give colocated's tokens; FP8 (NIXL, per layer) gives the decode's first computed
token the logprobs of the model run in transformers on the FP8-rounded latent cache,
3.9x fewer bytes; every staging slot comes back. SGLang runs MLA on this CPU through the test plugin
``tests/sglang_stubs/sglang_cpu_mla`` (its AMX backend needs AMX)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mla_reference import fp8_latent_logprobs
from sglang_helpers import (
    MAX_NEW_TOKENS,
    PD,
    Proc,
    generate_logprobs,
    generate_through,
    kvbridge_metrics,
    latent_bytes,
    latent_rows,
    pd_config,
    prompt_ids,
    reference_ids,
    reference_logprobs,
    sent_by_rank,
    server_env,
    start_pd,
    wait_received_bytes,
    wait_sent,
    wait_staging_idle,
)

PROMPTS = [12, 32, 64, 200]  # under a page, two pages, one chunk, four chunks with a partial page


@pytest.fixture(scope="module")
def colocated_mla(mla_model: Path, shared_colocated) -> Proc:
    return shared_colocated(mla_model)


PD_CONFIGS = [("nixl", True), ("mooncake", False)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            c,
            id=f"{c[0]}-{'layer' if c[1] else 'chunk'}",
            # `make test-all` only: the latent pages do not depend on the transport, and
            # Mooncake per chunk runs in test_sglang_pd
            marks=[pytest.mark.extended] if c[0] == "mooncake" else [],
        )
        for c in PD_CONFIGS
    ],
)
def mla_pd(
    request: pytest.FixtureRequest, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    transport, layerwise = request.param
    log_dir = tmp_path_factory.mktemp(f"mla-{transport}")
    yield from start_pd(mla_model, log_dir, server_env(pd_config(transport, layerwise)), layerwise)


@pytest.mark.parametrize("n", PROMPTS)
def test_mla_greedy_output_equals_colocated(
    mla_pd: PD, colocated_mla: Proc, mla_model: Path, n: int
) -> None:
    input_ids = prompt_ids(n, seed=700 + n)
    want = reference_ids(colocated_mla, input_ids)
    assert len(want) == MAX_NEW_TOKENS
    sent_before = sent_by_rank(mla_pd.prefill)
    before = kvbridge_metrics(mla_pd.decode.url)
    got = generate_through(mla_pd, input_ids)
    assert got == want, f"{n} tokens: disaggregated {got} != colocated {want}"
    (sent,) = wait_sent(mla_pd.prefill, sent_before)
    if mla_pd.layerwise:
        assert sent.layer_writes > 0 and sent.chunk_writes == 0, f"not all streamed: {sent}"
    else:
        assert sent.layer_writes == 0 and sent.chunk_writes > 0, f"not per chunk: {sent}"
    expected = latent_bytes(mla_model, mla_pd.decode, n)
    got_bytes = wait_received_bytes(mla_pd.decode.url, before, expected)
    assert got_bytes == expected, (
        f"the decode received {got_bytes} bytes, the prompt's latent pages are {expected}"
    )


PACKED_CONFIGS = [("mooncake", False, "packed"), ("nixl", True, "fp8")]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            c, id=f"{c[2]}-{c[0]}", marks=[pytest.mark.extended] if c[2] == "packed" else []
        )
        for c in PACKED_CONFIGS
    ],  # "fp8" is on the packed path too
)
def mla_packed_pd(
    request: pytest.FixtureRequest, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PD, str]]:
    transport, layerwise, wire = request.param
    config = {
        **pd_config(transport, layerwise),
        **({"wire_dtype": "fp8"} if wire == "fp8" else {"data_path": "packed"}),
    }
    # FP8 is checked against a float32 transformers run: SGLang runs this model in float32 too (it
    # picks float16 otherwise)
    dtype = ["--dtype", "float32"] if wire == "fp8" else []
    for pd in start_pd(
        mla_model,
        tmp_path_factory.mktemp(f"mla-{wire}"),
        server_env(config),
        layerwise,
        prefill_args=dtype,
        decode_args=dtype,
    ):
        yield pd, wire


def test_mla_on_the_packed_path(
    mla_packed_pd: tuple[PD, str], colocated_mla: Proc, mla_model: Path, record_property
) -> None:
    pd, wire = mla_packed_pd
    worst = 0.0
    for n in (32, 200):
        input_ids = prompt_ids(n, seed=750 + n)
        before = kvbridge_metrics(pd.decode.url)
        got, got_tops = generate_logprobs(pd.router.url, input_ids)
        if wire == "fp8":
            # SGLang's first output token comes from the prefill; the decode computes the second on
            # the FP8 latent pages
            ref = fp8_latent_logprobs(mla_model, input_ids, got[0])
            assert got_tops[1].keys() == ref.keys(), (
                f"{n} tokens: top-5 {got_tops[1]} differ from the FP8 reference's {ref}"
            )
            off = max(abs(got_tops[1][t] - ref[t]) for t in ref)
            assert off < 0.01, (
                f"{n} tokens: logprobs {off:.3f} from the FP8 reference: {got_tops[1]} vs {ref}"
            )
            worst = max(worst, off)
            rows, latent = latent_rows(mla_model, n)
            expected = rows * (latent + 2 * 4)  # a byte a value, a float32 scale per half vector
        else:
            want, _ = reference_logprobs(colocated_mla, input_ids)
            assert got == want, f"{n} tokens: disaggregated {got} != colocated {want}"
            expected = latent_bytes(mla_model, pd.decode, n)
        received = wait_received_bytes(pd.decode.url, before, expected)
        assert received == expected, (
            f"{n} tokens: the decode received {received} bytes, expected {expected}"
        )
    for server in (pd.prefill, pd.decode):
        wait_staging_idle(server)
    if wire == "fp8":
        record_property("sglang_mla_fp8_reference_distance", worst)
        print(
            f"\nSGLang MLA, FP8 on the wire: the decode's logprobs within {worst:.4f} of the FP8 "
            "reference"
        )
