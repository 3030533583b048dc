"""The vLLM worker side's bookkeeping between kvbridge's runtime and vLLM's
``get_finished`` contract (every held request reported in ``finished_sending`` exactly
once, whatever the order of events), on real runtime endpoints over the loopback
transport."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from runtime_pair import DeviceEvent, L, endpoint, eventually, make_cache

from kvbridge.adapters.vllm.metadata import KVBridgeMetadata, RecvTask, SendStep
from kvbridge.adapters.vllm.params import PrefillAddress, RankAddress
from kvbridge.adapters.vllm.worker import WorkerSide
from kvbridge.config import load_config
from kvbridge.errors import IncompatiblePeerError
from kvbridge.wire.messages import Abort, Destination, Heartbeat


def worker(ep, rank: int = 0, tp_size: int = 1) -> WorkerSide:
    ws = WorkerSide(
        load_config({}),
        "e",
        rank,
        "m",
        tp_size,
        16,
        send=ep.sender is not None,
        receive=ep.receiver is not None,
        total_kv_heads=4,
    )
    ws.endpoint = ep
    return ws


@pytest.fixture
def pd() -> Iterator[tuple[WorkerSide, WorkerSide]]:
    p_ep, d_ep = endpoint("P", make_cache(1)), endpoint("D", make_cache(None))
    yield worker(p_ep), worker(d_ep)
    d_ep.close()
    p_ep.close()


def _until(
    ws: WorkerSide, finished: set[str], want: str, which: int, steps: int = 500
) -> list[tuple[set[str], set[str], set[str]]]:
    """Run idle steps until ``want`` shows up in result ``which`` (0 sending, 1 recving)."""
    seen = []
    for _ in range(steps):
        out = ws.results(finished, idle=True)
        finished = set()
        seen.append(out)
        if want in out[which]:
            return seen
    raise AssertionError(f"{want} never reported; saw {seen[-3:]}")


def _push(p: WorkerSide, d: WorkerSide, tid: str, prefill: PrefillAddress | None = None) -> None:
    prefill = prefill or PrefillAddress(p.endpoint.address)
    d.bind_recv(KVBridgeMetadata(recv=[RecvTask("rd", tid, "push", prefill, [1, 2], 20, 0)]))
    p.bind_send(KVBridgeMetadata(send=[SendStep("rp", tid, "push", 20, [5, 6], 0, 20, True)]))
    for layer in range(L):  # what save_kv_layer does, by layer index
        p.endpoint.sender.layer_done(tid, layer, 20)
    p.after_forward()


def test_release_before_the_scheduler_finishes_the_request_is_still_reported(pd) -> None:
    p, d = pd
    _push(p, d, "t1")
    # the release is taken in a step before vLLM reports the request finished
    for _ in range(1000):
        if not p._send_req:
            break
        assert p.results(set(), idle=True)[0] == set(), "reported before the scheduler finished it"
    assert not p._send_req, "the sender never released"
    sending, _, _ = p.results({"rp"})
    assert sending == {"rp"}
    assert p.results(set())[0] == set(), "reported twice"


def test_release_after_the_scheduler_finishes_the_request(pd) -> None:
    p, d = pd
    _push(p, d, "t2")
    seen = _until(p, {"rp"}, "rp", 0)
    assert sum("rp" in s for s, _, _ in seen) == 1


def test_decode_abort_after_the_load_was_reported_reports_nothing_more(pd) -> None:
    """vLLM frees a finished request's blocks itself when its load is reported in
    ``finished_recving``; a second report (in either set) kills the engine."""
    p, d = pd
    _push(p, d, "t3")
    _until(d, set(), "rd", 1)  # the load finished and was reported
    # the scheduler finished (aborted) the request in the same step: it asks to abort
    d.bind_recv(KVBridgeMetadata(abort_recv={"rd": "t3"}))
    for _ in range(20):
        assert d.results(set(), idle=True) == (set(), set(), set())


def test_decode_abort_while_loading_frees_the_blocks_once_the_load_stops(pd) -> None:
    p, d = pd
    d.bind_recv(
        KVBridgeMetadata(
            recv=[RecvTask("rd", "t4", "push", PrefillAddress(p.endpoint.address), [1, 2], 20, 0)]
        )
    )
    d.bind_recv(KVBridgeMetadata(abort_recv={"rd": "t4"}))
    seen = _until(d, set(), "rd", 0)
    assert all("rd" not in r for _, r, _ in seen), (
        "an aborted load must not be reported as received"
    )


def test_a_preempted_prefill_s_transfer_is_aborted_and_never_reported(pd) -> None:
    """vLLM freed a preempted request's blocks itself and asserts that every id in
    ``finished_sending`` is a live request: the workers abort the transfer (the decode
    side's load fails) and report nothing for it, even once the request finishes."""
    p, d = pd
    d.bind_recv(
        KVBridgeMetadata(
            recv=[RecvTask("rd", "t5", "push", PrefillAddress(p.endpoint.address), [1, 2], 20, 0)]
        )
    )
    p.bind_send(KVBridgeMetadata(send=[SendStep("rp", "t5", "push", 20, [5, 6], 0, 16, True)]))
    p.endpoint.sender.layer_done("t5", 0, 16)
    p.after_forward()
    # P knows where D is (so it can tell D)
    eventually(lambda: bool(p.endpoint.sender._out["t5"].dests))
    p.bind_send(KVBridgeMetadata(drop_send={"rp": "t5"}))
    seen = _until(d, set(), "rd", 2)  # D's load failed
    assert all("rd" not in s for s, _, _ in seen)
    finished = {"rp"}  # the resumed request, computed as a plain one, finishes
    for _ in range(50):
        assert p.results(finished, idle=True) == (set(), set(), set())
        finished = set()
    eventually(lambda: p.endpoint.sender.pending == 0)  # the sender let go of the aborted transfer
    assert p.results(set()) == (set(), set(), set())


def test_a_second_request_for_a_transfer_id_in_use_fails_alone_and_the_first_goes_through(
    pd,
) -> None:
    """The scheduler side never lets two requests share a transfer id; should it ever,
    the workers fail the newcomer (reported to vLLM like any failed load, or as sent
    with nothing held) instead of raising inside vLLM's step, and the first request's
    transfer is untouched."""
    p, d = pd
    prefill = PrefillAddress(p.endpoint.address)
    d.bind_recv(
        KVBridgeMetadata(
            recv=[
                RecvTask("rd", "t6", "push", prefill, [1, 2], 20, 0),
                RecvTask("rd2", "t6", "push", prefill, [3, 4], 20, 0),
            ]
        )
    )
    assert d.results(set()) == (set(), {"rd2"}, {"rd2"})
    p.bind_send(
        KVBridgeMetadata(
            send=[
                SendStep("rp", "t6", "push", 20, [5, 6], 0, 16, True),
                SendStep("rp2", "t6", "push", 20, [7, 8], 0, 16, True),
            ]
        )
    )
    for layer in range(L):
        p.endpoint.sender.layer_done("t6", layer, 16)
    p.after_forward()
    # the refused request's later step must not add its blocks to the other's transfer
    p.bind_send(
        KVBridgeMetadata(
            send=[
                SendStep("rp", "t6", "push", 20, [], 16, 20, False),
                SendStep("rp2", "t6", "push", 20, [9], 16, 20, False),
            ]
        )
    )
    assert p.endpoint.sender._out["t6"].blocks == [5, 6]
    for layer in range(L):
        p.endpoint.sender.layer_done("t6", layer, 20)
    p.after_forward()
    _until(d, set(), "rd", 1)  # the first load completes
    seen = _until(p, {"rp", "rp2"}, "rp", 0)
    reported = [r for s, _, _ in seen for r in s]
    assert sorted(reported) == ["rp", "rp2"], f"each reported exactly once: {reported}"


def test_a_decode_worker_reads_from_the_prefill_worker_of_its_own_tp_rank() -> None:
    """TP 2 on both sides: decode rank 1 must ask prefill rank 1 (same KV heads), not
    the address every rank shares in ``kv_transfer_params`` (rank 0's)."""
    caches = make_cache(1), make_cache(None)  # kept alive while the endpoints use them
    p_ep, d_ep = endpoint("P", caches[0]), endpoint("D", caches[1])
    try:
        p, d = worker(p_ep, rank=1, tp_size=2), worker(d_ep, rank=1, tp_size=2)
        # rank 0's address is a closed port: asking it fails the load
        prefill = PrefillAddress(
            "127.0.0.1:9", ranks=[RankAddress("127.0.0.1:9"), RankAddress(p_ep.address, p_ep.epoch)]
        )
        _push(p, d, "t5", prefill)
        seen = _until(d, set(), "rd", 1)
        assert all("rd" not in f for _, _, f in seen), "the load failed"
        assert d_ep.node.knows(p_ep.node.id)
        assert (caches[1][0][:, [1, 2]] == caches[0][0][:, [5, 6]]).all(), "the KV did not land"
    finally:
        d_ep.close()
        p_ep.close()


@pytest.mark.parametrize(
    ("ranks", "match"),
    [(3, "size 3 does not split 4 KV heads"), (6, "size 6 does not split 4 KV heads")],
)
def test_a_prefill_whose_tp_size_cannot_pair_fails_the_load_naming_the_fix(
    ranks: int, match: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache(None)
    d_ep = endpoint("D", cache)
    try:
        d = worker(d_ep, rank=1, tp_size=2)
        prefill = PrefillAddress(
            "127.0.0.1:9", ranks=[RankAddress(f"127.0.0.1:{9 + r}") for r in range(ranks)]
        )
        d.bind_recv(KVBridgeMetadata(recv=[RecvTask("rd", "t6", "push", prefill, [1, 2], 20, 0)]))
        seen = _until(d, set(), "rd", 2)
        assert sum("rd" in r for _, r, _ in seen) == 1, (
            "a failed load is reported in finished_recving too, once"
        )
        assert d_ep.stats.take().failures == 1
        assert match in caplog.text and "--tensor-parallel-size" in caplog.text
    finally:
        d_ep.close()


def test_prefill_address_sources() -> None:
    single = PrefillAddress("h:1", epoch="e0")
    assert single.sources(0, 1, 4) == [RankAddress("h:1", "e0")]
    assert single.sources(1, 2, 4) == [RankAddress("h:1", "e0")], (
        "TP 1 -> TP 2: both decode ranks read from the one prefill rank"
    )
    both = PrefillAddress(
        "h:1", epoch="e0", ranks=[RankAddress("h:1", "e0"), RankAddress("h:2", "e1")]
    )
    assert both.sources(1, 2, 4) == [RankAddress("h:2", "e1")]
    assert [[a.address for a in both.sources(r, 4, 4)] for r in range(4)] == [
        ["h:1"],
        ["h:1"],
        ["h:2"],
        ["h:2"],
    ]
    assert both.sources(0, 1, 4) == [RankAddress("h:1", "e0"), RankAddress("h:2", "e1")], (
        "TP 2 -> TP 1: half the heads from each"
    )
    with pytest.raises(
        IncompatiblePeerError, match="tensor parallel size 2, this decode instance 3"
    ) as err:
        both.sources(0, 3, 6)
    assert err.value.fix and "--tensor-parallel-size" in err.value.fix
    assert [both.idle(r, 4, 4) for r in range(4)] == [[]] * 4 and both.idle(0, 1, 4) == [], (
        "every prefill rank holds heads a decode rank reads"
    )
    # MLA (one latent "head" on every rank): a decode reads from one prefill rank each and
    # releases the replicas nobody reads, each idle rank by exactly one decode rank
    four = PrefillAddress("h:0", ranks=[RankAddress(f"h:{r}", f"e{r}") for r in range(4)])
    assert [(four.sources(d, 2, 1), four.idle(d, 2, 1)) for d in range(2)] == [
        ([RankAddress("h:0", "e0")], [RankAddress("h:2", "e2")]),
        ([RankAddress("h:1", "e1")], [RankAddress("h:3", "e3")]),
    ]
    assert (both.sources(0, 1, 1), both.idle(0, 1, 1)) == (
        [RankAddress("h:1", "e0")],
        [RankAddress("h:2", "e1")],
    )


def test_staging_levels_reach_the_vllm_gauges_summed_over_ranks() -> None:
    """``wire_dtype: fp8``: each worker reports its staging slots held in the steps where
    that changes or slots are held (so a rank that does not report holds none), and the
    instance's total; vLLM merges the ranks' snapshots and the connector's Prometheus
    hook sets ``vllm:kvbridge_staging_slots`` / ``..._used``. Idle steps report nothing."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from test_runtime_packed import endpoint as fp8_endpoint
    from test_runtime_packed import make_cache as fp8_cache

    from kvbridge.adapters.vllm.stats import KVBridgePromMetrics, KVBridgeStats

    eps = [fp8_endpoint("D", fp8_cache(None)) for _ in range(2)]
    try:
        ranks = [worker(ep, rank=r, tp_size=2) for r, ep in enumerate(eps)]
        allocators = [ep.node.packed.allocator for ep in eps]
        total = 2 * allocators[0].num_slots
        first = [ws.stats() for ws in ranks]
        assert all(
            s is not None and (s.staging_slots, s.staging_slots_used) == (total, 0) for s in first
        )
        assert [ws.stats() for ws in ranks] == [None, None], "idle and unchanged: nothing to report"
        held = allocators[0].alloc(7), allocators[1].alloc(3)
        snaps = [ws.stats() for ws in ranks]
        merged = KVBridgeStats(snaps[0].to_dict()).aggregate(KVBridgeStats(snaps[1].to_dict()))
        assert (merged.data["staging_slots"], merged.data["staging_slots_used"]) == (total, 10)
        assert merged.is_empty(), "levels alone are not transfer activity to log"
        allocators[1].free(held[1], 3)
        snaps = [ws.stats() for ws in ranks]  # rank 0 still holds 7, rank 1 reports its 0 once
        assert snaps[0].staging_slots_used == 7 and snaps[1].staging_slots_used == 0
        assert ranks[1].stats() is None and ranks[0].stats().staging_slots_used == 7
        allocators[0].free(held[0], 7)

        registry = CollectorRegistry()
        types = {
            cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
        }
        prom = KVBridgePromMetrics(
            SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
        )
        prom.observe(merged.data, 0)
        assert registry.get_sample_value("vllm:kvbridge_staging_slots", {"engine": "0"}) == total
        assert registry.get_sample_value("vllm:kvbridge_staging_slots_used", {"engine": "0"}) == 10
        # a step without levels
        prom.observe(
            KVBridgeStats({**merged.data, "staging_slots": 0, "staging_slots_used": 0}).data, 0
        )
        assert (
            registry.get_sample_value("vllm:kvbridge_staging_slots_used", {"engine": "0"}) == 10
        ), "a step without levels keeps the gauge"
    finally:
        for ep in eps:
            ep.close()


def test_requests_in_flight_reach_the_vllm_gauges_by_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker reports its requests per lifecycle phase in every snapshot it returns
    (and returns one while any is in flight or after a change): a prefill request held
    without a destination, then sending; the decode's request waiting for its first KV;
    all back to 0, reported once, after the transfer. vLLM merges ranks by maximum
    (every rank tracks every request) and the Prometheus hook sets the gauges."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvbridge.adapters.vllm import worker as worker_module
    from kvbridge.adapters.vllm.stats import KVBridgePromMetrics, KVBridgeStats

    def levels(ws: WorkerSide) -> tuple[int, ...] | None:
        snap = ws.stats()
        return (
            None
            if snap is None
            else (
                snap.sends_held,
                snap.sends_sending,
                snap.receives_allocated,
                snap.receives_waiting,
                snap.receives_receiving,
            )
        )

    recorded: list[DeviceEvent] = []
    monkeypatch.setattr(
        worker_module, "record_device_event", lambda: recorded.append(DeviceEvent()) or recorded[-1]
    )
    p_ep, d_ep = endpoint("P", make_cache(1)), endpoint("D", make_cache(None))
    try:
        p, d = worker(p_ep), worker(d_ep)
        assert (levels(p), levels(d)) == ((0, 0, 0, 0, 0), (0, 0, 0, 0, 0)), (
            "the first step reports the levels once"
        )
        assert (p.stats(), d.stats()) == (None, None), "nothing in flight, nothing changed"
        p._on_device = True  # layers gated by compute events: the request stays in flight
        p._layer_index = {f"model.layers.{i}.attn": i for i in range(L)}
        p.bind_send(KVBridgeMetadata(send=[SendStep("rp", "t7", "push", 20, [5, 6], 0, 20, True)]))
        for layer in range(L):
            p.save_layer(f"model.layers.{layer}.attn")
        p.after_forward()
        assert levels(p) == (1, 0, 0, 0, 0), "computed, no destination yet: held"
        assert levels(p) == (1, 0, 0, 0, 0), "reported in every step while in flight"
        d.bind_recv(
            KVBridgeMetadata(
                recv=[RecvTask("rd", "t7", "push", PrefillAddress(p_ep.address), [1, 2], 20, 0)]
            )
        )
        eventually(lambda: p_ep.sender.phase("t7").value == "sending")
        assert levels(p) == (0, 1, 0, 0, 0)
        eventually(lambda: d_ep.receiver.phase("t7").value == "waiting")  # P's reply reached D
        assert levels(d) == (0, 0, 0, 1, 0), "destination at P, nothing arrived"
        sender_rank = KVBridgeStats(p.stats().to_dict())
        merged = sender_rank.aggregate(KVBridgeStats(p.stats().to_dict()))
        assert merged.data["sends_sending"] == 1, "ranks tracking the same request count it once"
        for event in recorded:
            event.complete()
        _until(d, set(), "rd", 1)
        assert levels(d) == (0, 0, 0, 0, 0), (
            "the step that reports the load reports the level it leaves"
        )
        _until(p, {"rp"}, "rp", 0)
        assert levels(p) == (0, 0, 0, 0, 0)
        assert (p.stats(), d.stats()) == (None, None), "0 is reported once"

        registry = CollectorRegistry()
        types = {
            cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
        }
        prom = KVBridgePromMetrics(
            SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
        )
        prom.observe(merged.data, 0)
        assert registry.get_sample_value("vllm:kvbridge_sends_sending", {"engine": "0"}) == 1
        assert registry.get_sample_value("vllm:kvbridge_sends_held", {"engine": "0"}) == 0
        prom.observe(KVBridgeStats().data, 0)
        assert registry.get_sample_value("vllm:kvbridge_sends_sending", {"engine": "0"}) == 0
    finally:
        d_ep.close()
        p_ep.close()


def test_on_a_gpu_each_hooked_layer_and_the_forward_s_end_wait_for_a_compute_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM calls ``save_kv_layer`` when the host has queued a layer's kernels: on a
    GPU cache the worker records one event per call (and one in ``wait_for_save``) and
    the sender writes nothing before they complete."""
    from kvbridge.adapters.vllm import worker as worker_module

    recorded: list[DeviceEvent] = []
    monkeypatch.setattr(
        worker_module, "record_device_event", lambda: recorded.append(DeviceEvent()) or recorded[-1]
    )
    p_cache, d_cache = make_cache(1), make_cache(None)
    p_ep, d_ep = endpoint("P", p_cache), endpoint("D", d_cache)
    try:
        p, d = worker(p_ep), worker(d_ep)
        p._on_device = True  # what register() sets for a cache in GPU memory
        p._layer_index = {f"model.layers.{i}.attn": i for i in range(L)}
        d.bind_recv(
            KVBridgeMetadata(
                recv=[RecvTask("rd", "t9", "push", PrefillAddress(p_ep.address), [1, 2], 20, 0)]
            )
        )
        # the first block is a prefix-cache hit: an earlier forward may still be writing it
        p.bind_send(KVBridgeMetadata(send=[SendStep("rp", "t9", "push", 20, [5, 6], 16, 20, True)]))
        for layer in range(L):
            p.save_layer(f"model.layers.{layer}.attn")
        p.after_forward()
        assert len(recorded) == 1 + L + 1, (
            "one event for the cached prefix, one per hooked layer, one for the forward's end"
        )
        for event in recorded[:-1]:
            event.complete()
        eventually(lambda: p_ep.sender.phase("t9").value == "sending")  # the destination came
        assert recorded[-1].polled_again()
        assert not d_cache[0].any(), "written before the forward's kernels finished"
        recorded[-1].complete()
        _until(d, set(), "rd", 1)
        np.testing.assert_array_equal(d_cache[0][:, [1, 2]], p_cache[0][:, [5, 6]])
    finally:
        d_ep.close()
        p_ep.close()


def _register(cache_config: dict, kv_caches: dict, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run ``register`` on a packed-path worker of vLLM block size 16, recording what it
    hands the runtime instead of starting an endpoint."""
    seen: dict = {}

    class Recorder:
        def __init__(self, config, geometry, compat, *args, planes=None, **kwargs) -> None:
            seen.update(geometry=geometry, compat=compat, planes=planes)
            self.address = "recorded"

    monkeypatch.setattr("kvbridge.adapters.vllm.worker.Endpoint", Recorder)
    ws = WorkerSide(
        load_config({"data_path": "packed", **cache_config}),
        "e",
        0,
        "m",
        1,
        16,
        send=True,
        receive=False,
    )
    ws.register(kv_caches)
    return seen


def test_an_nhd_cache_is_addressed_in_transfer_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 6, 16, 2, 8) for i in range(2)}
    seen = _register({"transfer_block_size": 4}, caches, monkeypatch)
    geo, planes = seen["geometry"], seen["planes"]
    assert (geo.spec.block_size, geo.num_blocks, seen["compat"].block_size) == (4, 24, 4)
    # transfer block 4b + k is tokens 4k .. 4k + 3 of vLLM block b, in the geometry and the planes
    k0 = caches["model.layers.0.self_attn.attn"][0]
    assert geo.slot_address(geo.slot(0, 0, 4 * 5 + 2)) == k0[5, 8].data_ptr()
    assert torch.equal(planes[0][0][4 * 5 + 2], k0[5, 8:12])


def test_a_transfer_block_size_on_vllm_s_cpu_cache_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from kvbridge.errors import ConfigError

    # fused: (blocks, heads, block_size, 2 * dim)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(6, 2, 16, 32) for i in range(2)}
    with pytest.raises(ConfigError, match="does not store a block token by token") as err:
        _register({"transfer_block_size": 8}, caches, monkeypatch)
    assert err.value.key == "transfer_block_size"


def _register_groups(
    cache_config: dict, kv_caches: dict, groups, monkeypatch: pytest.MonkeyPatch
) -> dict:
    seen: dict = {}

    class Recorder:
        def __init__(self, config, geometry, compat, *args, planes=None, **kwargs) -> None:
            seen.update(geometry=geometry, compat=compat)
            self.address = "recorded"

    monkeypatch.setattr("kvbridge.adapters.vllm.worker.Endpoint", Recorder)
    ws = WorkerSide(
        load_config(cache_config), "e", 0, "m", 1, 32, send=True, receive=False, groups=groups
    )
    ws.register(kv_caches)
    return seen


def test_each_layer_names_its_kv_cache_group_in_the_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's hybrid manager: layers alias the same memory across groups (the i-th layer
    of each); the handshake's compat info carries every layer's group and the groups'
    windows in model order, whatever order vLLM listed the groups in, on either path."""
    import torch

    from kvbridge.adapters.vllm.compat import CacheGroup
    from kvbridge.errors import ConfigError

    # fused CPU layout; layers 2i and 2i+1 alias
    shared = [torch.zeros(6, 2, 32, 64) for _ in range(2)]
    caches = {f"model.layers.{i}.self_attn.attn": shared[i // 2] for i in range(4)}
    groups = [
        CacheGroup([f"model.layers.{i}.self_attn.attn" for i in (1, 3)], 32, 40),
        CacheGroup([f"model.layers.{i}.self_attn.attn" for i in (0, 2)], 32, 0),
    ]
    for config in ({}, {"wire_dtype": "fp8"}):
        compat = _register_groups(config, caches, groups, monkeypatch)["compat"]
        assert compat.layer_groups == (1, 0, 1, 0) and compat.group_windows == (40, 0)
    with pytest.raises(
        ConfigError, match=r"KV cache layers \['model.layers.3.self_attn.attn'\] are in none"
    ):
        _register_groups(
            {},
            caches,
            [groups[0]._replace(layer_names=groups[0].layer_names[:1]), groups[1]],
            monkeypatch,
        )


def test_state_space_layers_register_their_state_and_refuse_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Mamba layer beside an attention layer: the geometry moves its state's bytes, the
    handshake names each group's state (peers must agree), and the packed path, which
    packs attention heads, is refused naming what to leave as it was."""
    import torch

    from kvbridge.adapters.vllm.compat import CacheGroup
    from kvbridge.errors import ConfigError

    buf = torch.zeros(6, 2, 32, 64)
    state = buf.view(torch.int8).view(6, -1)[:, :4000].view(6, 1, 1, 4000)
    caches = {"model.layers.0.mixer": state, "model.layers.1.self_attn.attn": buf}
    groups = [
        CacheGroup(["model.layers.0.mixer"], 1024, 0, "mamba2 float32(3, 8) conv SD"),
        CacheGroup(["model.layers.1.self_attn.attn"], 32, 0),
    ]
    seen = _register_groups({}, caches, groups, monkeypatch)
    assert seen["geometry"].layer_bytes == (4000, buf[0].numel() * 4)
    assert seen["compat"].layer_groups == (0, 1) and seen["compat"].group_states == (
        "mamba2 float32(3, 8) conv SD",
        "",
    )
    for config, key in (
        ({"wire_dtype": "fp8"}, "wire_dtype"),
        ({"data_path": "packed"}, "data_path"),
    ):
        with pytest.raises(ConfigError, match="this model has state-space layers") as err:
            _register_groups(config, caches, groups, monkeypatch)
        assert err.value.key == key and "direct, exact" in err.value.fix
    with pytest.raises(
        ConfigError,
        match="transfer_block_size 16: a cache with state-space layers keeps one state per request",
    ):
        _register_groups({"transfer_block_size": 16}, caches, groups, monkeypatch)


def test_vllm_s_cache_groups_are_read_and_groups_kvbridge_cannot_move_are_refused() -> None:
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvbridge.adapters.vllm.compat import cache_groups
    from kvbridge.errors import KVBridgeError

    def group(spec, *names):
        return SimpleNamespace(layer_names=list(names), kv_cache_spec=spec, enable_kv_transfer=True)

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=40
    )
    got = cache_groups(SimpleNamespace(kv_cache_groups=[group(window, "b"), group(full, "a")]))
    assert [(g.layer_names, g.block_size, g.window) for g in got] == [
        (["b"], 32, 40),
        (["a"], 32, 0),
    ]
    mamba = MambaSpec(
        block_size=1024, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32)
    )
    got = cache_groups(SimpleNamespace(kv_cache_groups=[group(mamba, "m"), group(full, "a")]))
    assert [(g.layer_names, g.block_size, g.window) for g in got] == [
        (["m"], 1024, 0),
        (["a"], 32, 0),
    ]
    assert (
        got[0].state.startswith("mamba2 float32(3, 8)+float32(2, 4, 4) conv ")
        and got[1].state == ""
    )
    aligned = MambaSpec(
        block_size=32, shapes=((3, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    with pytest.raises(KVBridgeError, match=r"group 1 per block .mamba_cache_mode 'align'") as err:
        cache_groups(SimpleNamespace(kv_cache_groups=[group(full, "a"), group(aligned, "m")]))
    assert err.value.fix == "start both instances with --no-enable-prefix-caching"
    drafts = MambaSpec(
        block_size=32,
        shapes=((5, 8), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=2,
    )
    with pytest.raises(
        KVBridgeError,
        match="2 speculative-decoding states per request beside each state of KV cache group 1",
    ) as err:
        cache_groups(SimpleNamespace(kv_cache_groups=[group(full, "a"), group(drafts, "m")]))
    assert err.value.fix == "start both instances of this model without --speculative-config"
    with pytest.raises(KVBridgeError, match="no attention layers"):
        cache_groups(SimpleNamespace(kv_cache_groups=[group(mamba, "m")]))
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(
        KVBridgeError,
        match=(
            r"group 1 .* is CrossAttentionSpec; kvbridge moves full-attention, sliding-window and "
            r"state-space"
        ),
    ) as err:
        cache_groups(SimpleNamespace(kv_cache_groups=[group(full, "a"), group(cross, "x")]))
    assert "--disable-hybrid-kv-cache-manager" in str(err.value)
    assert cache_groups(SimpleNamespace(kv_cache_groups=[group(full, "a")])) == []
    assert [
        g.window for g in cache_groups(SimpleNamespace(kv_cache_groups=[group(window, "b")]))
    ] == [40], "one sliding group: told apart"
    bigger = SlidingWindowSpec(
        block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=40
    )
    with pytest.raises(KVBridgeError, match=r"different block sizes \[32, 64\]"):
        cache_groups(SimpleNamespace(kv_cache_groups=[group(full, "a"), group(bigger, "b")]))


def test_messages_kept_for_requests_not_tracked_yet_reach_a_gauge() -> None:
    """Bounds the operator can watch: decode messages that wait for their request, the
    block ids they carry, the peers."""

    p_ep, d_ep = endpoint("P", make_cache(1)), endpoint("D", make_cache(None))
    try:
        p = worker(p_ep)
        assert p.stats().sends_early == 0
        d_ep.node.connect(p_ep.address)
        for tid in ("a", "b"):
            abort = Abort(transfer_id=tid, peer=d_ep.node.id)
            assert d_ep.node.client.request(p_ep.address, abort, 5).ok
        snap = p.stats()
        assert snap is not None and snap.sends_early == 2
        assert snap.sends_early_block_ids == 0 and snap.peers == 1
        dest = Destination(transfer_id="c", peer=d_ep.node.id, block_ids=[1, 2, 3], num_tokens=48)
        assert d_ep.node.client.request(p_ep.address, dest, 5).ok
        snap = p.stats()
        assert snap is not None and (snap.sends_early, snap.sends_early_block_ids) == (3, 3)
    finally:
        d_ep.close()
        p_ep.close()


def test_the_replay_set_of_a_prefill_with_a_secret_reaches_a_gauge() -> None:
    p_ep = endpoint("P", make_cache(1), secret="s")
    d_ep = endpoint("D", make_cache(None), secret="s")
    try:
        p = worker(p_ep)
        assert p.stats().replay_entries == 0
        d_ep.node.connect(p_ep.address)  # one authenticated request: the Hello
        assert d_ep.node.client.request(p_ep.address, Heartbeat(peer=d_ep.node.id), 5).ok
        snap = p.stats()
        assert snap is not None and snap.replay_entries == 2 and snap.peers == 1
    finally:
        d_ep.close()
        p_ep.close()


def _forward(p: WorkerSide, d: WorkerSide, meta: KVBridgeMetadata, deferred: bool, finished):
    """One engine step of both workers in Model Runner V2's order: bind, the forward's
    layers, then ``post_forward`` (``wait_for_save`` first unless ``deferred``, then the
    transfer results) and, if deferred, ``finalize_step`` (``wait_for_save``) after it,
    where a speculator's propose runs between the two. Returns both workers' results."""
    p.bind_send(meta)
    d.bind_recv(KVBridgeMetadata())
    for step in meta.send:
        for layer in range(L):  # save_kv_layer, by layer index
            p.endpoint.sender.layer_done(step.transfer_id, layer, step.computed_after)
    if not deferred:
        p.after_forward()
    out = p.results(finished), d.results(set())
    if deferred:
        p.after_forward()
    return out


@pytest.mark.parametrize("deferred", [False, True], ids=["plain", "deferred-finalize"])
def test_mrv2_s_deferred_finalize_reports_each_outcome_once_and_not_a_step_late(
    pd, deferred: bool
) -> None:
    """MRV2 with a speculator asks for transfer results before ``wait_for_save`` (the
    forward's end) and clears the metadata after the drafter. A two-chunk prefill pushed
    to a decode: the load is reported once, as soon as it has completed; the prefill
    request in the first step after both its release and the scheduler's finish (vLLM
    frees its blocks then: a report a step late holds them a step, a second one kills
    the engine), whichever order the steps take."""
    p, d = pd
    tid = "t-deferred"
    prefill = PrefillAddress(p.endpoint.address)
    d.bind_recv(KVBridgeMetadata(recv=[RecvTask("rd", tid, "push", prefill, [1, 2], 20, 0)]))
    chunks = [
        SendStep("rp", tid, "push", 20, [5, 6], 0, 16, True),
        SendStep("rp", tid, "push", 20, [], 16, 20, False),
    ]
    reports: list[tuple[set[str], set[str]]] = []
    for step in chunks:
        (sending, _, _), (_, recving, _) = _forward(
            p, d, KVBridgeMetadata(send=[step]), deferred, set()
        )
        reports.append((sending, recving))
    # the decode's load completes and its release reaches the prefill's sender
    eventually(lambda: p.endpoint.sender._released or not p._send_req)
    # the scheduler finished the prefill request with the last chunk: the next step says so
    finished = {"rp"}
    for _ in range(5):
        (sending, _, _), (_, recving, _) = _forward(p, d, KVBridgeMetadata(), deferred, finished)
        reports.append((sending, recving))
        finished = set()
    sent = [i for i, (s, _) in enumerate(reports) if "rp" in s]
    assert sent == [2], f"the prefill request reported in steps {sent}, not once in step 2"
    loaded = [i for i, (_, r) in enumerate(reports) if "rd" in r]
    if not loaded:  # the decode's notifications may still be on their way: idle steps
        _until(d, set(), "rd", 1)
        loaded = [len(reports)]
    for _ in range(5):
        assert "rd" not in d.results(set(), idle=True)[1], "the load reported twice"
    assert len(loaded) == 1, f"the load reported in steps {loaded}, not once"


def test_a_transfer_the_prefill_never_sent_fails_the_decode_s_load_at_once(pd) -> None:
    """The prefill's scheduler says a pushed request ended before it was computed
    (``never_sent``): the decode waiting for it reports the load failed now, not at
    ``receive_s``; the prefill reports nothing (vLLM holds nothing for it)."""
    p, d = pd
    tid = "t-never"
    prefill = PrefillAddress(p.endpoint.address)
    d.bind_recv(KVBridgeMetadata(recv=[RecvTask("rd", tid, "push", prefill, [1, 2], 20, 0)]))
    eventually(lambda: p.endpoint.sender.early == 1)  # its destination waits at the prefill
    p.bind_send(KVBridgeMetadata(never_sent={tid: "the prefill request ended (ABORTED)"}))
    seen = _until(d, set(), "rd", 2, steps=100)  # 100 idle steps: at most half a second
    # vLLM's contract: a failed load is finished (recving) and failed, in the same step
    assert "rd" in seen[-1][1] and sum("rd" in r for _, r, _ in seen) == 1
    assert all(p.results({"rp"}, idle=True) == (set(), set(), set()) for _ in range(5))
