"""The vLLM scheduler side's view of its workers (where decode instances reach them) and
the parallel layouts the connector accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.adapters.vllm.compat import FINISHED_OK, RequestStatus, block_updates
from kvbridge.adapters.vllm.connector import KVBridgeConnector, check_parallelism
from kvbridge.adapters.vllm.metadata import KVBridgeHandshake
from kvbridge.adapters.vllm.params import PrefillAddress, RankAddress
from kvbridge.adapters.vllm.scheduler import SchedulerSide
from kvbridge.demo.servers import random_prompt
from kvbridge.errors import ConfigError, KVBridgeError


def _discover(s: SchedulerSide, rid: str) -> dict | None:
    req = SimpleNamespace(
        request_id=rid,
        kv_transfer_params={
            "kvbridge": {"transfer_id": rid, "role": "prefill", "flow": "discover"}
        },
    )
    assert s.matched_tokens(req, 0) == (0, False)  # vLLM's first call; the prefill loads nothing
    held, params = s.request_finished(req, ([],))
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
    got = PrefillAddress(
        **{
            **params["kvbridge"]["prefill"],
            "ranks": [RankAddress(**r) for r in params["kvbridge"]["prefill"]["ranks"]],
        }
    )
    assert got.address == "h:7000" and got.epoch == "e0" and got.engine_id == "eng"
    assert got.sources(0, 2, 4) == [RankAddress("h:7000", "e0")]
    assert got.sources(1, 2, 4) == [RankAddress("h:7001", "e1")]


def test_a_decode_request_carries_every_prefill_rank_to_the_workers() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    prefill = {
        "address": "h:7000",
        "epoch": "e0",
        "ranks": [{"address": "h:7000", "epoch": "e0"}, {"address": "h:7001", "epoch": "e1"}],
    }
    req = SimpleNamespace(
        request_id="d1",
        num_prompt_tokens=40,
        prompt_token_ids=random_prompt(40),
        kv_transfer_params={
            "kvbridge": {"transfer_id": "t1", "role": "decode", "prefill": prefill}
        },
    )
    assert s.matched_tokens(req, 0) == (40, True)
    blocks = SimpleNamespace(
        get_block_ids=lambda: ([3, 4, 5],), get_unhashed_block_ids=lambda: [3, 4, 5]
    )
    s.after_alloc(req, blocks, 40)
    task = s.build_meta(SimpleNamespace(total_num_scheduled_tokens=0)).recv[0]
    assert task.block_ids == [3, 4, 5] and task.num_tokens == 40
    assert task.prefill.sources(1, 2, 4) == [RankAddress("h:7001", "e1")]


@pytest.mark.parametrize(
    "name",
    ["pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"],
)
def test_parallelism_other_than_tensor_parallel_is_refused(name: str) -> None:
    sizes = {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "decode_context_parallel_size": 1,
    }
    check_parallelism(SimpleNamespace(**sizes))  # TP alone is fine
    with pytest.raises(KVBridgeError, match=f"runs {name} 2") as err:
        check_parallelism(SimpleNamespace(**{**sizes, name: 2}))
    assert "-".join(name.split("_")) in err.value.fix


def _output(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    """A SchedulerOutput of new requests ``(req_id, computed, block_ids)`` and cached
    ones ``(req_id, computed, new_block_ids)``; ``scheduled``: tokens per request."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(b,)) for r, c, b in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            num_computed_tokens=[c for _, c, _ in cached],
            new_block_ids=[(b,) for _, _, b in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(),
    )


def test_transfer_blocks_cut_each_vllm_block_on_the_decode_side() -> None:
    # vLLM blocks of 64 tokens moved as blocks of 16: block b is 4b .. 4b + 3
    s = SchedulerSide(64, "eng", "127.0.0.1", transfer_block_size=16)
    prefill = {"address": "h:7000", "epoch": "e0", "ranks": [{"address": "h:7000", "epoch": "e0"}]}
    req = SimpleNamespace(
        request_id="d1",
        num_prompt_tokens=150,
        prompt_token_ids=random_prompt(150),
        kv_transfer_params={
            "kvbridge": {"transfer_id": "t1", "role": "decode", "prefill": prefill}
        },
    )
    assert s.matched_tokens(req, 64) == (86, True)  # one block of prefix-cache hits
    blocks = SimpleNamespace(
        get_block_ids=lambda: ([9, 3, 4],), get_unhashed_block_ids=lambda: [3, 4]
    )
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
            request_id=rid,
            num_prompt_tokens=70,
            status=FINISHED_OK[0],
            kv_transfer_params={
                "kvbridge": {"transfer_id": f"t-{rid}", "role": "prefill", "flow": flow}
            },
        )
        assert s.matched_tokens(reqs[rid], 0) == (0, False)
        s.after_alloc(reqs[rid], None, 0)
    # a chunked prefill: 40 tokens in 2 blocks, then 30 more in 1 new block
    first = s.build_meta(
        _output(new=[(r, 0, [5, 2]) for r in reqs], scheduled=dict.fromkeys(reqs, 40))
    ).send
    assert [st.new_blocks for st in first] == [[20, 21, 22, 23, 8, 9, 10, 11]] * 2
    second = s.build_meta(
        _output(cached=[(r, 40, [7]) for r in reqs], scheduled=dict.fromkeys(reqs, 30))
    ).send
    # 70 tokens fill 9 blocks of 8: the 9th is the first of vLLM block 7
    assert [st.new_blocks for st in second] == [[28]] * 2
    held, params = s.request_finished(reqs["pull"], ([5, 2, 7],))
    assert held and params["kvbridge"]["remote_blocks"] == [20, 21, 22, 23, 8, 9, 10, 11, 28]
    assert params["kvbridge"]["remote_tokens"] == params["remote_num_tokens"] == 70


@pytest.mark.parametrize(
    ("status", "first_token", "held"),
    [
        (RequestStatus.FINISHED_STOPPED, True, False),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True, True),
        (RequestStatus.FINISHED_STOPPED, False, True),
    ],
)
def test_a_first_token_prefill_that_stopped_at_its_token_hands_nothing_over(
    status: RequestStatus, first_token: bool, held: bool
) -> None:
    """A P-first prefill whose decode continues from its first token (``first_token``,
    the proxy's first-token flow) and which that token ended (a stop token): no decode
    comes, so its transfer is given up at once (the workers free the blocks) and it
    returns no parameters. One capped at its ``max_tokens`` hands over; and a plain
    P-first prefill that stopped does too (its decode computes its own first token)."""
    s = SchedulerSide(32, "eng", "127.0.0.1")
    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    kb = {"transfer_id": "t", "role": "prefill", "flow": "pull", "first_token": first_token}
    req = SimpleNamespace(
        request_id="p", num_prompt_tokens=40, status=status, kv_transfer_params={"kvbridge": kb}
    )
    assert s.matched_tokens(req, 0) == (0, False)
    s.after_alloc(req, None, 0)
    s.build_meta(_output(new=[("p", 0, [5, 2])], scheduled={"p": 40}))
    kept, params = s.request_finished(req, ([5, 2],))
    assert kept, "the blocks stay held until the workers let go of them"
    aborted = s.build_meta(_output()).abort_send
    if held:
        assert aborted == {} and params["kvbridge"]["remote_tokens"] == 40
    else:
        assert aborted == {"p": "t"} and params is None


def test_a_p_first_decode_prompt_extending_the_prefill_s_loads_what_the_prefill_holds() -> None:
    """A decode asked to continue from the prefill's first token (its prompt is the
    prefill's and that token) loads the prefill's 64 tokens and computes the 65th; it
    asked for 65, one block more than the prefill's table, and its read failed."""
    s = SchedulerSide(32, "eng", "127.0.0.1")
    req = SimpleNamespace(
        request_id="d",
        num_prompt_tokens=65,
        status=FINISHED_OK[0],
        kv_transfer_params={
            "kvbridge": {
                "transfer_id": "t",
                "role": "decode",
                "flow": "pull",
                "prefill": _PREFILL,
                "remote_blocks": [4, 9],
                "remote_tokens": 64,
            }
        },
    )
    assert s.matched_tokens(req, 0) == (64, True)
    s.after_alloc(req, _blocks([1, 2, 3]), 64)
    task = s.build_meta(_output()).recv[0]
    assert task.block_ids == [1, 2] and task.num_tokens == 64 and task.remote_blocks == [4, 9]


def test_a_transfer_block_size_that_does_not_divide_the_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not divide vLLM's block size 16") as err:
        SchedulerSide(16, "eng", "127.0.0.1", transfer_block_size=12)
    assert err.value.key == "transfer_block_size"


def _vllm_config(extra: dict, mla: bool = False, block_size: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        cache_config=SimpleNamespace(block_size=block_size),
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


# --- one request per transfer id: n > 1 siblings, duplicates, preemption ---------------

_PREFILL = {"address": "h:7000", "epoch": "e0", "ranks": [{"address": "h:7000", "epoch": "e0"}]}


def _decode_req(rid: str, tid: str = "t1", n: int = 40) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=n,
        status=FINISHED_OK[0],
        kv_transfer_params={
            "kvbridge": {"transfer_id": tid, "role": "decode", "prefill": _PREFILL}
        },
    )


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,), get_unhashed_block_ids=lambda: ids)


def test_decode_siblings_of_one_transfer_load_it_once_then_read_the_prefix_cache() -> None:
    """vLLM fans ``n=2`` out into two requests with the same kv_transfer_params: the
    first loads, the second waits (None: vLLM asks again) until that load ends."""
    s = SchedulerSide(16, "eng", "127.0.0.1")
    a, b = _decode_req("0_r"), _decode_req("1_r")
    assert s.matched_tokens(a, 0) == (40, True)
    s.after_alloc(a, _blocks([3, 4, 5]), 40)  # vLLM allocates for a before it asks about b
    assert s.matched_tokens(b, 0) == (None, False), (
        "a second load of the same transfer would collide"
    )
    assert [t.req_id for t in s.build_meta(_output()).recv] == ["0_r"]
    assert s.matched_tokens(b, 0) == (None, False), "asked again while the load runs"
    s.update_output(None, {"0_r"})
    assert s.matched_tokens(b, 32) == (0, False), (
        "the load ended: b computes what the prefix cache lacks"
    )
    assert s.matched_tokens(b, 32) == (0, False)
    s.after_alloc(b, _blocks([6, 7, 8]), 0)
    assert s.build_meta(_output()).recv == []
    assert s.request_finished(b, ([6, 7, 8],)) == (False, None)
    assert s.request_finished(a, ([3, 4, 5],)) == (False, None)
    # a sibling that arrives after the load ended (vLLM submits them one by one) loads
    # nothing either: the prefill side has let go of the transfer
    assert s.matched_tokens(_decode_req("2_r"), 32) == (0, False)
    assert s.matched_tokens(_decode_req("3_r", tid="t2"), 0) == (40, True), (
        "other transfers load as before"
    )
    assert s.stats.take().requests_shared == 2, "each sibling counted once, however often asked"


def test_a_sibling_waits_for_an_aborted_owner_until_the_workers_let_go() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    a, b = _decode_req("0_r"), _decode_req("1_r")
    assert s.matched_tokens(a, 0) == (40, True)
    s.after_alloc(a, _blocks([3, 4, 5]), 40)
    s.build_meta(_output())
    assert s.matched_tokens(b, 0) == (None, False)
    a.status = "FINISHED_ABORTED"
    assert s.request_finished(a, ([3, 4, 5],)) == (True, None), (
        "held while the prefill side may still write"
    )
    assert s.build_meta(_output()).abort_recv == {"0_r": "t1"}
    assert s.matched_tokens(b, 0) == (None, False), "writes may still land: b must not start yet"
    s.update_output({"0_r"}, None)  # the workers report the aborted load stopped
    assert not s.has_pending_work()
    assert s.matched_tokens(b, 0) == (0, False)


def test_a_waiting_sibling_aborted_by_its_client_leaves_nothing_behind() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    a, b = _decode_req("0_r"), _decode_req("1_r")
    assert s.matched_tokens(a, 0) == (40, True)
    s.after_alloc(a, _blocks([3, 4, 5]), 40)
    assert s.matched_tokens(b, 0) == (None, False)
    assert s.request_finished(b, ([],)) == (False, None)
    assert not s._sharing and not s.has_pending_work()


def _prefill_req(rid: str, tid: str = "t1", flow: str = "push", n: int = 40) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=n,
        status=FINISHED_OK[0],
        kv_transfer_params={"kvbridge": {"transfer_id": tid, "role": "prefill", "flow": flow}},
    )


def test_a_second_prefill_request_naming_a_transfer_in_use_is_computed_without_a_handoff() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    a, b = _prefill_req("0_r"), _prefill_req("1_r")
    for r in (a, b):
        assert s.matched_tokens(r, 0) == (0, False)
        s.after_alloc(r, None, 0)
    steps = s.build_meta(
        _output(
            new=[("0_r", 0, [1, 2, 3]), ("1_r", 0, [4, 5, 6])], scheduled={"0_r": 40, "1_r": 40}
        )
    ).send
    assert [st.req_id for st in steps] == ["0_r"], "one sender per transfer id and worker"
    assert s.request_finished(b, ([4, 5, 6],)) == (False, None), "b holds nothing"
    held, _ = s.request_finished(a, ([1, 2, 3],))
    assert held
    s.update_output({"0_r"}, None)
    c = _prefill_req("2_r")  # a later sibling: t1 was sent already
    s.after_alloc(c, None, 0)
    assert s.build_meta(_output(new=[("2_r", 0, [7, 8, 9])], scheduled={"2_r": 40})).send == []
    assert s.request_finished(c, ([7, 8, 9],)) == (False, None)
    d = _prefill_req("3_r", tid="t2")
    s.after_alloc(d, None, 0)
    assert [
        st.req_id
        for st in s.build_meta(_output(new=[("3_r", 0, [7, 8, 9])], scheduled={"3_r": 40})).send
    ] == ["3_r"]


@pytest.mark.parametrize("allocated", [False, True], ids=["queued", "allocated"])
def test_a_pushed_prefill_request_ended_before_it_was_computed_tells_the_workers_once(
    allocated: bool,
) -> None:
    """The proxy closes the prefill request when its client hangs up; vLLM aborts it
    while it is queued (or allocated, before its first step), nothing was computed or is
    held, and ``request_finished`` is the last kvbridge hears of it. Its decode may
    already wait for the KV: the workers are told the transfer will never be sent, once.
    A P-first request has no decode waiting yet, and a sibling naming another request's
    transfer tells nothing."""
    s = SchedulerSide(16, "eng", "127.0.0.1")
    r = _prefill_req("r")
    assert s.matched_tokens(r, 0) == (0, False)
    if allocated:
        s.after_alloc(r, None, 0)
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, ([],)) == (False, None), "nothing is held"
    never_sent = s.build_meta(_output()).never_sent
    assert list(never_sent) == ["t1"] and "before it was computed" in never_sent["t1"]
    assert s.build_meta(_output()).never_sent == {}, "told once"
    assert not s.has_pending_work() and not s._send_owner
    pulled = _prefill_req("p", tid="t2", flow="pull")
    pulled.status = RequestStatus.FINISHED_ABORTED
    assert s.matched_tokens(pulled, 0) == (0, False)
    assert s.request_finished(pulled, ([],)) == (False, None)
    owner, sibling = _prefill_req("o", tid="t3"), _prefill_req("s", tid="t3")
    for q in (owner, sibling):
        assert s.matched_tokens(q, 0) == (0, False)
    s.after_alloc(owner, None, 0)
    sibling.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(sibling, ([],)) == (False, None)
    assert s.build_meta(_output()).never_sent == {}


def test_a_preempted_prefill_drops_its_transfer_and_resumes_as_a_plain_request() -> None:
    """vLLM frees a preempted request's blocks itself: the workers abort the transfer
    without reporting it (vLLM asserts every ``finished_sending`` id is a live request),
    and the resumed request does not start the same transfer again."""
    s = SchedulerSide(16, "eng", "127.0.0.1")
    r = _prefill_req("r", n=100)
    s.after_alloc(r, None, 0)
    first = s.build_meta(_output(new=[("r", 0, [1, 2, 3, 4])], scheduled={"r": 64}))
    assert [st.first for st in first.send] == [True]
    out = _output()
    out.preempted_req_ids = {"r"}
    meta = s.build_meta(out)
    assert meta.drop_send == {"r": "t1"} and meta.abort_send == {}
    s.after_alloc(r, None, 0)  # rescheduled later, from the start
    again = s.build_meta(_output(new=[("r", 0, [5, 6, 7, 8, 9, 10, 11])], scheduled={"r": 100}))
    assert again.send == [] and again.drop_send == {}
    assert s.request_finished(r, ([5, 6, 7, 8, 9, 10, 11],)) == (False, None)
    assert not s.has_pending_work() and not s._send_owner


def test_a_decode_request_vllm_computes_itself_lets_the_prefill_go() -> None:
    """vLLM asks the connector, then loads nothing for a request that wants prompt
    logprobs (``skip_reading_prefix_cache``): the prefill is told to let go of the
    transfer at once instead of holding its blocks until the lease runs out."""
    s = SchedulerSide(16, "eng", "127.0.0.1")
    r = _decode_req("r")
    assert s.matched_tokens(r, 0) == (40, True)
    s.after_alloc(r, _blocks([3, 4, 5]), 0)  # vLLM overrode the answer with 0
    meta = s.build_meta(_output())
    assert meta.recv == [] and [(f.req_id, f.transfer_id) for f in meta.forgo] == [("r", "t1")]
    assert meta.forgo[0].prefill.address == "h:7000"
    s.after_alloc(r, _blocks([3, 4, 5]), 0)  # rescheduled after a preemption
    assert s.build_meta(_output()).forgo == [], "let go of once"
    assert s.matched_tokens(_decode_req("1_r"), 0) == (0, False), "a later sibling computes too"
    assert s.request_finished(r, ([3, 4, 5],)) == (False, None)


def test_a_decode_request_ended_before_admission_lets_the_prefill_go() -> None:
    """vLLM 0.33+ submits a request its API server rejected (after the prefill already
    holds its blocks) as an ``abort_immediately`` marker: the scheduler adds it and
    finishes it at once, so ``request_finished`` is the first hook kvbridge sees. The
    prefill is told to let go of the transfer at the next step, once."""
    s = SchedulerSide(16, "eng", "127.0.0.1")
    r = _decode_req("r")
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, ([],)) == (False, None)
    forgo = s.build_meta(_output()).forgo
    assert [(f.req_id, f.transfer_id) for f in forgo] == [("r", "t1")]
    assert forgo[0].prefill.address == "h:7000" and "before its KV" in forgo[0].reason
    assert s.build_meta(_output()).forgo == [], "let go of once"
    assert not s.has_pending_work()


def test_a_decode_request_that_loaded_lets_nothing_go_when_it_ends() -> None:
    s = SchedulerSide(16, "eng", "127.0.0.1")
    r = _decode_req("r")
    assert s.matched_tokens(r, 0) == (40, True)
    s.after_alloc(r, _blocks([3, 4, 5]), 40)
    assert len(s.build_meta(_output()).recv) == 1
    s.update_output(None, {"r"})
    assert s.request_finished(r, ([3, 4, 5],)) == (False, None)
    assert s.build_meta(_output()).forgo == []


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_block_updates_mean_the_same_on_every_release(release: str) -> None:
    """Each release's scheduler output, as vLLM builds it: 0.34 lists a resumed request
    among the new ones (its whole table) and has no ``resumed_req_ids``."""
    out = _output(new=[("new", 0, [1, 2])], cached=[("running", 32, [3]), ("back", 0, [4, 5])])
    if release == "0.34":
        out.scheduled_new_reqs.append(SimpleNamespace(req_id="back", block_ids=([4, 5],)))
        cached = out.scheduled_cached_reqs
        cached.req_ids, cached.new_block_ids = ["running"], [([3],)]
        del cached.resumed_req_ids
    else:
        out.scheduled_cached_reqs.resumed_req_ids = {"back"}
    got = {r: (ids, whole) for r, ids, whole in block_updates(out)}
    assert got == {
        "new": (([1, 2],), True),
        "running": (([3],), False),
        "back": (([4, 5],), True),
    }


def test_the_connector_refuses_sleep_mode_and_declares_it_registers_the_cache() -> None:
    """vLLM refuses ``--enable-sleep-mode`` at start-up for a connector that says no
    (its registrations would point at unmapped memory); 0.34 allocates the cache in
    one physical piece per segment for one that registers it for RDMA."""
    assert KVBridgeConnector.supports_sleep_mode(None) is False
    access = KVBridgeConnector.kv_cache_access(None)
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # before 0.34
        assert access is None
    else:
        assert access == KVCacheAccess.REGISTERS and access.needs_single_chunk()


# --- KV cache groups (vLLM's hybrid manager) --------------------------------------------


def _hybrid_output(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    """:func:`_output` with one block list per KV cache group already in ``block_ids``."""
    out = _output(scheduled=scheduled)
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=b) for r, c, b in new
    ]
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[r for r, _, _ in cached],
        num_computed_tokens=[c for _, c, _ in cached],
        new_block_ids=[b for _, _, b in cached],
        resumed_req_ids=set(),
    )
    return out


def test_kv_cache_groups_reach_the_workers_as_tables_with_vllm_s_null_block_as_none() -> None:
    """Group 0 full attention, group 1 a 40-token window, blocks of 32: the decode's
    lists per group after a one-block prefix hit (vLLM pads the sliding one with its null
    block, id 0), the prefill's per step, and the P-first parameters of every group."""
    from kvbridge.adapters.vllm import params as kvparams
    from kvbridge.core.blocks import NONE, BlockTable

    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 40))
    req = _decode_req("d", n=150)
    assert s.matched_tokens(req, 32) == (117, True), (
        "the prefill sends 149 tokens, the decode has 32"
    )
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14], [0, 0, 0, 15, 16]))
    s.after_alloc(req, blocks, 117)
    task = s.build_meta(_output()).recv[0]
    assert (
        task.block_ids == BlockTable.grouped([[11, 12, 13, 14], [NONE, NONE, 15, 16]])
        and task.skip_tokens == 32
    )

    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    p = SimpleNamespace(
        request_id="p",
        num_prompt_tokens=150,
        status=FINISHED_OK[0],
        kv_transfer_params={"do_remote_decode": True},
    )
    s.after_alloc(p, None, 0)
    first = s.build_meta(
        _hybrid_output(new=[("p", 0, ([1, 2, 3], [4, 5, 6]))], scheduled={"p": 96})
    ).send[0]
    assert first.new_blocks == BlockTable.grouped([[1, 2, 3], [4, 5, 6]])
    second = s.build_meta(
        _hybrid_output(cached=[("p", 96, ([7, 8], [9, 10]))], scheduled={"p": 54})
    ).send[0]
    assert second.new_blocks == BlockTable.grouped([[7, 8], [9, 10]]) and second.last
    # vLLM freed what left the window
    held, params = s.request_finished(p, ([1, 2, 3, 7, 8], [0, 0, 0, 9, 10]))
    assert held and params["remote_block_ids"] == [1, 2, 3, 7, 8]
    handoff = kvparams.parse(params, "d2")
    assert handoff is not None and handoff.remote_table() == BlockTable.grouped(
        [[1, 2, 3, 7, 8], [NONE, NONE, NONE, 9, 10]]
    )
    # the ticket the prefill drew for the P-first request: its workers hold it, the decode
    # gets it with the blocks; one per request
    assert len(first.ticket) >= 20 and handoff.ticket == first.ticket
    assert kvparams.parse({"do_remote_decode": True}, "p").ticket != first.ticket


def test_a_first_token_request_to_a_sliding_window_prefill_is_computed_whole() -> None:
    """The prefill's token of a ``first_token`` request is the client's first: it must
    be sampled from the whole prompt. A model whose decode computes the last prompt
    token (``backoff``) then has nothing to hand off: the prefill computes the request
    as a plain one and answers parameters that make the decode compute the prompt."""
    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 40))
    kb = {"transfer_id": "t", "role": "prefill", "flow": "pull", "first_token": True}
    p = _prompt_req("p", 70, {"kvbridge": kb})
    s.on_new_request(p)
    s.after_alloc(p, None, 0)
    assert p.num_prompt_tokens == 70, "the whole prompt, not all but its last token"
    sent = s.build_meta(
        _hybrid_output(new=[("p", 0, ([1, 2, 3], [5, 6, 7]))], scheduled={"p": 70})
    ).send
    assert sent == []
    assert s.request_finished(p, ([1, 2, 3], [5, 6, 7])) == (
        False,
        {"do_remote_prefill": False, "do_remote_decode": False},
    )


def test_sliding_window_prefill_leaves_the_last_token_and_one_token_prompts_stay_local() -> None:
    """Every length is handed off, the window's edge (``N - W + 1`` a multiple of the
    block size) included: 103 tokens, the decode loads 102. A 1-token prompt is not:
    the decode computes it (no tokens to load), the prefill as a plain request (nothing
    held; P-first: parameters that make the decode compute it)."""
    from kvbridge.adapters.vllm import params as kvparams

    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 40))
    edge = 2 * 32 + 40 - 1
    assert s.backoff == 1 and SchedulerSide(32, "eng", "127.0.0.1").backoff == 0
    assert s.matched_tokens(_decode_req("d", n=edge), 0) == (edge - 1, True)
    assert s.matched_tokens(_decode_req("d1", tid="t1b", n=1), 0) == (0, False)
    p = _prompt_req("p", edge, {"kvbridge": {"transfer_id": "tp", "role": "prefill"}})
    s.on_new_request(p)
    s.after_alloc(p, None, 0)
    assert p.num_prompt_tokens == edge - 1
    assert (
        s.build_meta(
            _hybrid_output(new=[("p", 0, ([1, 2, 3, 4], [5, 6, 7, 8]))], scheduled={"p": edge - 1})
        )
        .send[0]
        .num_tokens
        == edge - 1
    )
    for flow_params in (
        {"kvbridge": {"transfer_id": "t1", "role": "prefill"}},
        {"do_remote_decode": True},
    ):
        one = _prompt_req("one", 1, flow_params)
        s.on_new_request(one)
        s.after_alloc(one, None, 0)
        assert one.num_prompt_tokens == 1
        assert (
            s.build_meta(_hybrid_output(new=[("one", 0, ([1], [2]))], scheduled={"one": 1})).send
            == []
        )
        held, params = s.request_finished(one, ([1], [2]))
        assert not held
        assert (
            (params is None)
            if "kvbridge" in flow_params
            else (params and kvparams.parse(params, "d") is None)
        )


def test_groups_out_of_step_give_the_transfer_up_not_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 40))
    p = SimpleNamespace(
        request_id="p",
        num_prompt_tokens=150,
        status=FINISHED_OK[0],
        kv_transfer_params={"kvbridge": {"transfer_id": "tp", "role": "prefill"}},
    )
    s.after_alloc(p, None, 0)
    meta = s.build_meta(_hybrid_output(new=[("p", 0, ([1, 2, 3], [4, 5]))], scheduled={"p": 96}))
    assert meta.send == [] and meta.drop_send == {"p": "tp"}
    assert "differ in length" in caplog.text
    assert s.request_finished(p, ([1, 2, 3], [4, 5])) == (False, None)


def test_one_sliding_window_group_is_told_apart_too() -> None:
    """A model whose layers all slide (one group, a sliding window): vLLM still pads the
    decode's list with its null block, so the lists travel as tables."""
    from kvbridge.core.blocks import NONE, BlockTable

    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(40,))
    req = _decode_req("d", n=150)
    assert s.matched_tokens(req, 0) == (149, True)
    s.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 0, 0, 15, 16],)), 149)
    assert s.build_meta(_output()).recv[0].block_ids == BlockTable.grouped(
        [[NONE, NONE, NONE, 15, 16]]
    )


def _prompt_req(rid: str, n: int, params: dict) -> SimpleNamespace:
    prompt = random_prompt(n)
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=n,
        prompt_token_ids=prompt,
        prompt_embeds=None,
        _all_token_ids=list(prompt),
        max_tokens=16,
        status=FINISHED_OK[0],
        kv_transfer_params=params,
    )


def test_a_prefill_with_state_space_layers_leaves_the_last_prompt_token_to_the_decode() -> None:
    """Group 0 a Mamba group (one state block per request), group 1 full attention: the
    prefill computes 149 of 150 tokens and stops after one output token; the decode
    loads 149. Prompts of one token, discover requests, plain requests and models of
    full attention only keep their prompts."""
    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 0), state_groups=[0])
    push = _prompt_req("p", 150, {"kvbridge": {"transfer_id": "tp", "role": "prefill"}})
    s.on_new_request(push)
    assert (
        push.num_prompt_tokens,
        len(push.prompt_token_ids),
        len(push._all_token_ids),
        push.max_tokens,
    ) == (149, 149, 149, 1)
    pull = _prompt_req("q", 150, {"do_remote_decode": True})
    s.on_new_request(pull)
    assert pull.num_prompt_tokens == 149 and pull.prompt_token_ids == pull._all_token_ids
    for req, sched in (
        (_prompt_req("one", 1, {"kvbridge": {"transfer_id": "t1", "role": "prefill"}}), s),
        (
            _prompt_req(
                "disc",
                150,
                {"kvbridge": {"transfer_id": "t2", "role": "prefill", "flow": "discover"}},
            ),
            s,
        ),
        (_prompt_req("plain", 150, {}), s),
        (
            _prompt_req("attn", 150, {"kvbridge": {"transfer_id": "t3", "role": "prefill"}}),
            SchedulerSide(32, "eng", "127.0.0.1"),
        ),
    ):
        before = list(req.prompt_token_ids)
        sched.on_new_request(req)
        assert (
            req.prompt_token_ids == before
            and req.num_prompt_tokens == len(before)
            and req.max_tokens == 16
        ), req.request_id
    assert s.matched_tokens(_decode_req("d", n=150), 0) == (149, True)
    assert s.matched_tokens(_decode_req("d1", tid="t9", n=1), 0) == (0, False), (
        "nothing to load: the decode computes a 1-token prompt"
    )


def test_a_state_space_group_s_row_holds_the_state_block_at_the_last_position_only() -> None:
    """The prefill's steps (chunked: 96 then 53 tokens of 149, blocks of 32), its P-first
    parameters and the decode's destination: the Mamba group's state block sits at
    position 4 (tokens 128-148), nothing elsewhere; vLLM lists it once, first step."""
    from kvbridge.adapters.vllm import params as kvparams
    from kvbridge.core.blocks import NONE, BlockTable

    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 0), state_groups=[0])
    s.set_handshake({(0, 0): KVBridgeHandshake(address="h:7000", epoch="e0", engine_id="eng")})
    p = _prompt_req("p", 150, {"do_remote_decode": True})
    s.on_new_request(p)
    s.after_alloc(p, None, 0)
    first = s.build_meta(
        _hybrid_output(new=[("p", 0, ([9], [1, 2, 3]))], scheduled={"p": 96})
    ).send[0]
    assert (
        first.new_blocks == BlockTable.grouped([[NONE, NONE, NONE], [1, 2, 3]])
        and first.num_tokens == 149
    )
    second = s.build_meta(
        _hybrid_output(cached=[("p", 96, ([], [4, 5]))], scheduled={"p": 53})
    ).send[0]
    assert second.new_blocks == BlockTable.grouped([[NONE, 9], [4, 5]]) and second.last
    held, params = s.request_finished(p, ([9], [1, 2, 3, 4, 5]))
    assert held and params["remote_num_tokens"] == 149
    handoff = kvparams.parse(params, "d2")
    assert handoff is not None and handoff.remote_table() == BlockTable.grouped(
        [[NONE] * 4 + [9], [1, 2, 3, 4, 5]]
    )

    req = _decode_req("d", n=150)
    assert s.matched_tokens(req, 0) == (149, True)
    s.after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([7], [10, 11, 12, 13, 14])), 149)
    task = s.build_meta(_output()).recv[0]
    assert task.num_tokens == 149 and task.block_ids == BlockTable.grouped(
        [[NONE] * 4 + [7], [10, 11, 12, 13, 14]]
    )


def test_a_prefill_given_no_state_block_gives_the_transfer_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = SchedulerSide(32, "eng", "127.0.0.1", windows=(0, 0), state_groups=[0])
    p = _prompt_req("p", 40, {"kvbridge": {"transfer_id": "tp", "role": "prefill"}})
    s.on_new_request(p)
    s.after_alloc(p, None, 0)
    meta = s.build_meta(_hybrid_output(new=[("p", 0, ([], [1, 2]))], scheduled={"p": 39}))
    assert meta.send == [] and meta.drop_send == {"p": "tp"}
    assert "no state block" in caplog.text
