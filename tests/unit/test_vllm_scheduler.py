"""The vLLM scheduler side's view of its workers (where decode instances reach them) and
the parallel layouts the connector accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.adapters.vllm.compat import FINISHED_OK
from kvbridge.adapters.vllm.connector import check_parallelism
from kvbridge.adapters.vllm.metadata import KVBridgeHandshake
from kvbridge.adapters.vllm.params import PrefillAddress, RankAddress
from kvbridge.adapters.vllm.scheduler import SchedulerSide
from kvbridge.demo.servers import random_prompt
from kvbridge.errors import ConfigError, KVBridgeError


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


def _output(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    """A SchedulerOutput of new requests ``(req_id, computed, block_ids)`` and cached
    ones ``(req_id, computed, new_block_ids)``; ``scheduled``: tokens per request."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(b,)) for r, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached],
            new_block_ids=[(b,) for _, _, b in cached], resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(),
    )


def test_transfer_blocks_cut_each_vllm_block_on_the_decode_side() -> None:
    # vLLM blocks of 64 tokens moved as blocks of 16: block b is 4b .. 4b + 3
    s = SchedulerSide(64, "eng", "127.0.0.1", transfer_block_size=16)
    prefill = {"address": "h:7000", "epoch": "e0", "ranks": [{"address": "h:7000", "epoch": "e0"}]}
    req = SimpleNamespace(
        request_id="d1", num_prompt_tokens=150, prompt_token_ids=random_prompt(150),
        kv_transfer_params={"kvbridge": {"transfer_id": "t1", "role": "decode", "prefill": prefill}},
    )
    assert s.matched_tokens(req, 64) == (86, True)  # one block of prefix-cache hits
    blocks = SimpleNamespace(get_block_ids=lambda: ([9, 3, 4],), get_unhashed_block_ids=lambda: [3, 4])
    s.after_alloc(req, blocks, 86)
    task = s.build_meta(_output()).recv[0]
    # tokens 64..149 fill 6 blocks of 16: all of vLLM block 3, half of block 4
    assert task.block_ids == [12, 13, 14, 15, 16, 17]
    assert task.skip_tokens == 64 and task.num_tokens == 150


def test_transfer_blocks_cut_each_vllm_block_on_the_prefill_side_in_both_flows() -> None:
    s = SchedulerSide(32, "eng", "127.0.0.1", transfer_block_size=8)
    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    reqs = {}
    for rid, flow in (("push", "push"), ("pull", "pull")):
        reqs[rid] = SimpleNamespace(
            request_id=rid, num_prompt_tokens=70, status=FINISHED_OK[0],
            kv_transfer_params={"kvbridge": {"transfer_id": f"t-{rid}", "role": "prefill", "flow": flow}},
        )
        assert s.matched_tokens(reqs[rid], 0) == (0, False)
        s.after_alloc(reqs[rid], None, 0)
    # a chunked prefill: 40 tokens in 2 blocks, then 30 more in 1 new block
    first = s.build_meta(_output(new=[(r, 0, [5, 2]) for r in reqs], scheduled={r: 40 for r in reqs})).send
    assert [st.new_blocks for st in first] == [[20, 21, 22, 23, 8, 9, 10, 11]] * 2
    second = s.build_meta(_output(cached=[(r, 40, [7]) for r in reqs], scheduled={r: 30 for r in reqs})).send
    # 70 tokens fill 9 blocks of 8: the 9th is the first of vLLM block 7
    assert [st.new_blocks for st in second] == [[28]] * 2
    held, params = s.request_finished(reqs["pull"], [5, 2, 7])
    assert held and params["kvbridge"]["remote_blocks"] == [20, 21, 22, 23, 8, 9, 10, 11, 28]


def test_a_transfer_block_size_that_does_not_divide_the_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not divide vLLM's block size 16") as err:
        SchedulerSide(16, "eng", "127.0.0.1", transfer_block_size=12)
    assert err.value.key == "transfer_block_size"


def _vllm_config(extra: dict, mla: bool = False, block_size: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla), cache_config=SimpleNamespace(block_size=block_size),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
    )


def test_the_connector_asks_vllm_for_the_cache_order_it_can_cut() -> None:
    from kvbridge.adapters.vllm.connector import KVBridgeConnector

    ask = KVBridgeConnector.get_required_kvcache_layout
    assert ask(_vllm_config({})) == "LBHNC"  # heads apart: TP head ranges on the direct path
    assert ask(_vllm_config({"transfer_block_size": 8})) == "LBNHC"  # tokens first: smaller blocks
    assert ask(_vllm_config({"transfer_block_size": 16})) == "LBHNC"  # that is the block size
    assert ask(_vllm_config({}, mla=True)) is None
    with pytest.raises(ConfigError, match="transfer_blok_size"):
        ask(_vllm_config({"transfer_blok_size": 8}))
