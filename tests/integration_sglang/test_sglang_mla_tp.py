"""MLA between SGLang servers of different TP sizes (NIXL, per layer). Every TP rank of
an MLA model holds the whole latent cache, so kvbridge moves whole pages and SGLang's
own rank mapping says who reads from whom:

- TP 1 -> TP 2: both decode ranks bootstrap from the one prefill rank, which writes the
  whole latent pages to each (SGLang's ``required_dst_info_num`` 2);
- TP 2 -> TP 1: the decode sends its destination to both prefill ranks, one real and
  one dummy; the real one writes, the dummy one writes nothing and lets its request go
  (a second request finds both free).

Both also on the packed path (exact values through the staging buffers), whose parts
follow SGLang's rank mapping (:func:`kvbridge.adapters.sglang.packed.latent_sources`).

Greedy output equals a colocated server of the decode's TP size token for token, and the
decode received exactly the prompt's latent pages per rank. Each test starts its own
servers (and stops them before the next: an idle SGLang scheduler spins a core)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
from sglang_helpers import (
    generate_ids,
    generate_through,
    kvbridge_metrics,
    latent_bytes,
    pd_config,
    prompt_ids,
    sent_by_rank,
    start_colocated,
    start_pd,
    tp_sides,
    wait_received_bytes,
    wait_sent,
    wait_staging_idle,
)

PROMPTS = [40, 200]  # three pages in one chunk; four chunks with a partial page

pytestmark = pytest.mark.timeout(900)
# servers killed on any exit
colocated, pd_pair = (
    contextmanager(start_colocated),
    contextmanager(start_pd),
)


# one path per direction in `make test` (`make test-all`: both in both)
@pytest.mark.parametrize(
    "data_path", ["direct", pytest.param("packed", marks=pytest.mark.extended)]
)
def test_mla_tp1_prefill_writes_the_whole_latent_pages_to_both_decode_ranks(
    data_path: str, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir = tmp_path_factory.mktemp(f"mla-tp1-2-{data_path}")
    with colocated(mla_model, log_dir, tp=2) as ref:
        want = {n: generate_ids(ref.url, prompt_ids(n, seed=800 + n)) for n in PROMPTS}
    config = {**pd_config("nixl", True), "data_path": data_path}
    with pd_pair(mla_model, log_dir, layerwise=True, **tp_sides(config, p_tp=1, d_tp=2)) as pd:
        for n in PROMPTS:
            sent_before = sent_by_rank(pd.prefill)
            before = kvbridge_metrics(pd.decode.url)
            assert generate_through(pd, prompt_ids(n, seed=800 + n)) == want[n], f"{n} tokens"
            (sent,) = wait_sent(pd.prefill, sent_before)
            assert sent.layer_writes > 0, f"not streamed: {sent}"
            expected = 2 * latent_bytes(mla_model, pd.decode, n)  # each decode rank holds all of it
            assert wait_received_bytes(pd.decode.url, before, expected) == expected
        if data_path == "packed":
            for server in (pd.prefill, pd.decode):
                wait_staging_idle(server)


@pytest.mark.parametrize(
    "data_path", [pytest.param("direct", marks=pytest.mark.extended), "packed"]
)
def test_mla_tp2_prefill_sends_from_one_rank_and_the_dummy_rank_lets_go(
    data_path: str, mla_model: Path, tmp_path_factory: pytest.TempPathFactory, shared_colocated
) -> None:
    log_dir = tmp_path_factory.mktemp(f"mla-tp2-1-{data_path}")
    ref = shared_colocated(mla_model)
    want = {n: generate_ids(ref.url, prompt_ids(n, seed=900 + n)) for n in PROMPTS}
    config = {**pd_config("nixl", True), "data_path": data_path}
    with pd_pair(mla_model, log_dir, layerwise=True, **tp_sides(config, p_tp=2, d_tp=1)) as pd:
        for n in PROMPTS:
            for attempt in range(2):  # the second request finds both prefill ranks free again
                sent_before = sent_by_rank(pd.prefill)
                before = kvbridge_metrics(pd.decode.url)
                assert generate_through(pd, prompt_ids(n, seed=900 + n)) == want[n], (
                    f"{n} tokens, request {attempt}"
                )
                sent = wait_sent(pd.prefill, sent_before, ranks=2)  # both ranks finish the room
                writes = sorted(s.layer_writes + s.chunk_writes for s in sent)
                assert writes[0] == 0 and writes[1] > 0, (
                    f"exactly one prefill rank writes, the dummy one nothing: {sent}"
                )
                expected = latent_bytes(mla_model, pd.decode, n)
                assert wait_received_bytes(pd.decode.url, before, expected) == expected
        if data_path == "packed":  # every room's staging run came back, the dummy rank's included
            for server in (pd.prefill, pd.decode):
                wait_staging_idle(server)
