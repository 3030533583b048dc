"""The vLLM scheduler side's view of its workers (where decode instances reach them) and
the parallel layouts the connector accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.adapters.vllm.connector import check_parallelism
from kvbridge.adapters.vllm.metadata import KVBridgeHandshake
from kvbridge.adapters.vllm.params import PrefillAddress, RankAddress
from kvbridge.adapters.vllm.scheduler import SchedulerSide
from kvbridge.demo.servers import random_prompt
from kvbridge.errors import KVBridgeError


def _discover(s: SchedulerSide, rid: str) -> dict | None:
    req = SimpleNamespace(request_id=rid, kv_transfer_params={"kvbridge": {"transfer_id": rid, "role": "prefill", "flow": "discover"}})
    assert s.matched_tokens(req, 0) == (0, False)  # vLLM's first call; the prefill loads nothing
    held, params = s.request_finished(req, [])
    assert not held, "discover holds nothing"
    return params


def test_discover_lists_every_tp_rank_once_all_reported() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    # vLLM merges the workers' {(pp_rank, tp_rank): metadata} dicts in any order
    s.set_handshake({(0, 1): KVBridgeHandshake(address="h:7001", epoch="e1", engine_id="eng")})
    assert _discover(s, "r0") is None, "rank 0 has not reported: no address to give out"
    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    params = _discover(s, "r1")
    assert params is not None
    got = PrefillAddress(**{**params["kvbridge"]["prefill"], "ranks": [RankAddress(**r) for r in params["kvbridge"]["prefill"]["ranks"]]})
    assert got.address == "h:7000" and got.epoch == "e0" and got.engine_id == "eng"
    assert got.sources(0, 2, 4) == [RankAddress("h:7000", "e0")]
    assert got.sources(1, 2, 4) == [RankAddress("h:7001", "e1")]


def test_a_decode_request_carries_every_prefill_rank_to_the_workers() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    prefill = {"address": "h:7000", "epoch": "e0", "ranks": [{"address": "h:7000", "epoch": "e0"}, {"address": "h:7001", "epoch": "e1"}]}
    req = SimpleNamespace(
        request_id="d1", num_prompt_tokens=40, prompt_token_ids=random_prompt(40),
        kv_transfer_params={"kvbridge": {"transfer_id": "t1", "role": "decode", "prefill": prefill}},
    )
    assert s.matched_tokens(req, 0) == (40, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],), get_unhashed_block_ids=lambda: [3, 4, 5])
    s.after_alloc(req, blocks, 40)
    task = s.build_meta(SimpleNamespace(total_num_scheduled_tokens=0)).recv[0]
    assert task.block_ids == [3, 4, 5] and task.num_tokens == 40
    assert task.prefill.sources(1, 2, 4) == [RankAddress("h:7001", "e1")]


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"])
def test_parallelism_other_than_tensor_parallel_is_refused(name: str) -> None:
    sizes = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "prefill_context_parallel_size": 1, "decode_context_parallel_size": 1}
    check_parallelism(SimpleNamespace(**sizes))  # TP alone is fine
    with pytest.raises(KVBridgeError, match=f"runs {name} 2") as err:
        check_parallelism(SimpleNamespace(**{**sizes, name: 2}))
    assert "-".join(name.split("_")) in err.value.fix
