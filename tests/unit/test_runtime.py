"""The engine-agnostic runtime (side channel, handshake, sender, receiver) on the
in-process loopback transport, with real numpy KV caches on both sides
(``tests/support/runtime_pair.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from runtime_pair import SPEC, DeviceEvent, L, endpoint, eventually, make_cache

from kvbridge.core.blocks import NONE, BlockTable
from kvbridge.core.lifecycle import RecvPhase
from kvbridge.runtime import node as node_module


@pytest.fixture
def pd() -> Iterator[tuple]:
    p_cache, d_cache = make_cache(1), make_cache(None)
    P, D = endpoint("P", p_cache), endpoint("D", d_cache)
    yield P, D, p_cache[0], d_cache[0]
    D.close()
    P.close()


def outcomes(D, count: int, timeout: float = 10.0) -> tuple[list[str], list[str]]:
    """The next ``count`` transfers ``D`` finished or failed (sorted), within ``timeout``."""
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < count and time.monotonic() < deadline:
        ok, bad = D.receiver.wait_finished(deadline - time.monotonic())
        done += ok
        failed += bad
    return sorted(done), sorted(failed)


def test_layerwise_push_streams_layer_by_layer_across_chunks(pd) -> None:
    P, D, pa, da = pd
    n, pblocks, dblocks = 200, list(range(13)), list(range(30, 43))  # 200 tokens: 13 blocks
    D.receiver.expect_push("r", P.address, dblocks, n)
    P.sender.track("r", pblocks, n)
    # chunk 1: 64 tokens = 4 full blocks, layer by layer; each layer lands before the next is
    # computed
    for layer in range(L):
        P.sender.layer_done("r", layer, 64)
        eventually(
            lambda layer=layer: np.array_equal(da[layer, dblocks[:4]], pa[layer, pblocks[:4]])
        )
        assert not da[layer, dblocks[4:]].any(), "blocks not computed yet were sent"
        if layer + 1 < L:
            assert not da[layer + 1].any(), "a layer was sent before it was computed"
    # chunk 2 (the rest, last block partial) completes the prompt
    for layer in range(L):
        P.sender.layer_done("r", layer, n)
    P.sender.prefill_done("r")
    assert D.receiver.wait_finished(5) == (["r"], [])
    np.testing.assert_array_equal(da[:, dblocks], pa[:, pblocks])
    assert P.sender.wait_released(5) == ["r"]
    stats = P.stats.take()
    # chunk 1: one transfer per layer (each awaited); chunk 2: layers that became ready
    # together may share a transfer
    assert L + 1 <= stats.transfers <= 2 * L
    assert stats.requests_sent == 1 and stats.bytes_sent == L * 13 * SPEC.block_bytes
    assert D.stats.take().bytes_received == L * 13 * SPEC.block_bytes


def test_two_kv_both_workers_swap_roles_while_a_request_streams() -> None:
    """A prefills for B; halfway through A's request, B prefills for A. The second
    handshake between the two (each side adds the other's metadata again) must leave
    the connection and the tables A's streaming request writes with intact, and a
    handshake again in a known role must not prepare more tables."""
    a_cache, b_cache = make_cache(1), make_cache(2)
    a_orig, b_orig = a_cache[0].copy(), b_cache[0].copy()
    A, B = endpoint("PD", a_cache), endpoint("PD", b_cache)
    try:
        n, a_blocks, b_dst = 200, list(range(13)), list(range(30, 43))
        B.receiver.expect_push("a->b", A.address, b_dst, n)
        A.sender.track("a->b", a_blocks, n)
        A.sender.layer_done("a->b", 0, n)
        eventually(lambda: np.array_equal(b_cache[0][0, b_dst], a_orig[0, a_blocks]))
        # the other way round, while a->b waits for its next layers
        A.receiver.expect_push("b->a", B.address, [20, 21], 20)
        B.sender.track("b->a", [0, 1], 20)
        for layer in range(L):
            B.sender.layer_done("b->a", layer, 20)
        B.sender.prefill_done("b->a")
        assert A.receiver.wait_finished(5) == (["b->a"], [])
        for layer in range(1, L):
            A.sender.layer_done("a->b", layer, n)
        A.sender.prefill_done("a->b")
        assert B.receiver.wait_finished(5) == (["a->b"], [])
        np.testing.assert_array_equal(b_cache[0][:, b_dst], a_orig[:, a_blocks])
        np.testing.assert_array_equal(a_cache[0][:, [20, 21]], b_orig[:, [0, 1]])
        assert A.sender.wait_released(5) == ["a->b"] and B.sender.wait_released(5) == ["b->a"]
        # one more handshake in a role B already has with A prepares nothing new
        known = B.node.connect(A.address)
        again = B.node.connect(A.address, fresh=True)
        assert again is not known and (again.table, again.staging) == (known.table, known.staging)
    finally:
        A.close()
        B.close()


def test_short_prompt_goes_in_one_transfer_after_prefill(pd) -> None:
    P, D, pa, da = pd
    P.sender.track("s", [5, 6], 20)  # below layerwise_min_tokens
    D.receiver.expect_push("s", P.address, [1, 2], 20)
    for layer in range(L):
        P.sender.layer_done("s", layer, 20)
    P.sender.prefill_done("s")
    assert D.receiver.wait_finished(5) == (["s"], [])
    np.testing.assert_array_equal(da[:, [1, 2]], pa[:, [5, 6]])
    assert P.stats.take().transfers == 1


def test_pull_flow_reads_then_releases(pd) -> None:
    P, D, pa, da = pd
    P.sender.track("q", [7, 8, 9], 40, pull=True)
    P.sender.prefill_done("q")
    assert P.sender.wait_released(0.2) == [], "held until the decode side read them"
    # D has block 0 cached
    D.receiver.expect_pull("q", P.address, P.epoch, [7, 8, 9], [8, 9], 40, skip_tokens=16)
    assert D.receiver.wait_finished(5) == (["q"], [])
    np.testing.assert_array_equal(da[:, [8, 9]], pa[:, [8, 9]])
    assert P.sender.wait_released(5) == ["q"]


def test_a_prefill_wants_transport_progress_only_while_a_decode_may_read(pd) -> None:
    """The prefill's transport polls at its busy pace while a P-first decode may read its
    blocks (over UCX's TCP a read needs the target's progress), not while the prompt is
    computed: a pump polling through the forward takes the prefill's core from it."""
    P, D, _, _ = pd
    busy = P.node.transport._busy
    assert not busy(), "nothing tracked"
    P.sender.track("q", [7, 8, 9], 40, pull=True)
    P.sender.track("w", [1, 2], 40)  # push: its writes keep the transport busy themselves
    for layer in range(L):
        P.sender.layer_done("q", layer, 40)
        P.sender.layer_done("w", layer, 40)
    assert not busy(), "still computing: no decode can read yet"
    P.sender.prefill_done("q")
    assert busy(), "computed and handed over: the decode may read now"
    D.receiver.expect_pull("q", P.address, P.epoch, [7, 8, 9], [7, 8, 9], 40)
    assert D.receiver.wait_finished(5) == (["q"], [])
    assert P.sender.wait_released(5) == ["q"]
    assert not busy(), "released: nothing left to read"


def test_destination_before_the_prefill_starts(pd) -> None:
    P, D, pa, da = pd
    D.receiver.expect_push("e", P.address, [40, 41], 64, skip_tokens=32)
    eventually(lambda: D.receiver.phase("e").value == "waiting")  # P has the destination
    P.sender.track("e", [12, 13, 14, 15], 64)
    for layer in range(L):
        P.sender.layer_done("e", layer, 64)
    P.sender.prefill_done("e")
    assert D.receiver.wait_finished(5) == (["e"], [])
    np.testing.assert_array_equal(da[:, [40, 41]], pa[:, [14, 15]])


def test_a_layer_queued_on_a_device_is_sent_only_once_its_event_completed(pd) -> None:
    """On a GPU the host reports a layer when it has queued its kernels: nothing of it
    may be written before its compute event completes, layer by layer."""
    P, D, pa, da = pd
    # streamed: >= layerwise_min_tokens
    n, pblocks, dblocks = (
        128,
        list(range(3, 11)),
        list(range(20, 28)),
    )
    D.receiver.expect_push("g", P.address, dblocks, n)
    P.sender.track("g", pblocks, n)
    eventually(lambda: P.sender.phase("g").value == "sending")  # the destination came
    events = [DeviceEvent() for _ in range(L)]
    for layer in range(L):
        P.sender.layer_done("g", layer, n, ready=events[layer])
    for layer in range(L):
        assert events[layer].polled.wait(5), "the sender stopped polling the layer's event"
        assert not da[layer:].any(), (
            f"layer {layer} or a later one was written before its compute finished"
        )
        events[layer].complete()
        eventually(lambda layer=layer: np.array_equal(da[layer, dblocks], pa[layer, pblocks]))
    P.sender.prefill_done("g", ready=DeviceEvent())  # its event does not hold back what was sent
    assert D.receiver.wait_finished(5) == (["g"], [])
    np.testing.assert_array_equal(da[:, dblocks], pa[:, pblocks])


def test_a_cached_prefix_waits_for_the_device_event_given_with_it(pd) -> None:
    """A prefix-cache hit may be blocks an earlier forward, still running on the GPU,
    writes: with ``ready`` they are not sent before it completes."""
    P, D, pa, da = pd
    n, pblocks, dblocks = 128, list(range(3, 11)), list(range(20, 28))
    D.receiver.expect_push("x", P.address, dblocks, n)
    earlier = DeviceEvent()
    P.sender.track("x", pblocks, n, computed_tokens=64, ready=earlier)
    eventually(lambda: P.sender.phase("x").value == "sending")  # the destination came
    assert earlier.polled_again()
    assert not da.any(), "cached blocks were sent before the forward writing them finished"
    earlier.complete()
    eventually(lambda: np.array_equal(da[:, dblocks[:4]], pa[:, pblocks[:4]]))
    assert not da[:, dblocks[4:]].any()
    for layer in range(L):
        P.sender.layer_done("x", layer, n)
    P.sender.prefill_done("x")
    assert D.receiver.wait_finished(5) == (["x"], [])
    np.testing.assert_array_equal(da[:, dblocks], pa[:, pblocks])


def test_a_prompt_sent_after_its_prefill_waits_for_the_forward_s_device_event(pd) -> None:
    P, D, pa, da = pd
    P.sender.track("f", [5, 6], 20)  # below layerwise_min_tokens: one transfer after the prefill
    D.receiver.expect_push("f", P.address, [1, 2], 20)
    layer_events = [DeviceEvent() for _ in range(L)]
    for layer in range(L):
        P.sender.layer_done("f", layer, 20, ready=layer_events[layer])
    done = DeviceEvent()
    P.sender.prefill_done("f", ready=done)
    eventually(lambda: P.sender.phase("f").value == "sending")  # the destination came
    assert done.polled_again()
    assert not da.any() and P.sender.wait_released(0) == [], (
        "sent before the forward's kernels finished"
    )
    done.complete()
    assert D.receiver.wait_finished(5) == (["f"], [])
    np.testing.assert_array_equal(da[:, [1, 2]], pa[:, [5, 6]])
    assert P.sender.wait_released(5) == ["f"]
    assert all(e.queries == 0 for e in layer_events), (
        "a prompt sent after its prefill needs no per-layer events"
    )


def test_a_device_event_that_never_completes_fails_the_request_at_transfer_s() -> None:
    P, D = endpoint("P", make_cache(1), {"transfer_s": 0.3}), endpoint("D", make_cache(None))
    try:
        P.sender.track("w", [1, 2], 30)
        D.receiver.expect_push("w", P.address, [3, 4], 30)
        stuck = DeviceEvent()
        P.sender.prefill_done("w", ready=stuck)
        start = time.monotonic()
        assert P.sender.wait_released(5) == ["w"], (
            "the prefill kept the blocks of a request it cannot send"
        )
        assert time.monotonic() - start < 3
        assert D.receiver.wait_finished(5) == ([], ["w"])
        assert P.stats.take().failures == 1
    finally:
        D.close()
        P.close()


def test_lease_expires_when_the_decode_side_never_comes() -> None:
    p_cache = make_cache(1)
    P = endpoint("P", p_cache, {"lease_s": 0.3})
    try:
        P.sender.track("x", [1], 10)
        P.sender.prefill_done("x")
        assert P.sender.wait_released(5) == ["x"]
        assert P.stats.take().leases_expired == 1
    finally:
        P.close()


def test_silent_prefill_fails_the_load_at_receive_s() -> None:
    P, D = endpoint("P", make_cache(1)), endpoint("D", make_cache(None), {"receive_s": 0.5})
    try:
        start = time.monotonic()
        D.receiver.expect_push("z", P.address, [1], 10)  # P never computes it
        assert D.receiver.wait_finished(5) == ([], ["z"])
        assert 0.4 < time.monotonic() - start < 3
    finally:
        D.close()
        P.close()


def test_dead_prefill_is_detected_by_heartbeats_long_before_receive_s() -> None:
    P, D = (
        endpoint("P", make_cache(1)),
        endpoint("D", make_cache(None), {"receive_s": 60, "heartbeat_s": 0.2}),
    )
    try:
        D.receiver.expect_push("h", P.address, [1], 10)
        eventually(lambda: D.receiver.phase("h").value == "waiting")
        P.close()  # the prefill process goes away
        start = time.monotonic()
        assert D.receiver.wait_finished(10) == ([], ["h"])
        assert time.monotonic() - start < 3, "heartbeats should notice within a few beats"
    finally:
        D.close()


def test_decode_abort_releases_prefill_blocks(pd) -> None:
    P, D, _, _ = pd
    P.sender.track("a", [1, 2], 30)
    D.receiver.expect_push("a", P.address, [3, 4], 30)
    eventually(lambda: D.receiver.phase("a").value == "waiting")
    D.receiver.abort("a", "client disconnected")
    assert P.sender.wait_released(5) == ["a"]
    assert D.receiver.wait_finished(5) == ([], ["a"])


def test_prefill_abort_fails_the_decode_side_at_once(pd) -> None:
    P, D, _, _ = pd
    P.sender.track("b", [1, 2], 30)
    D.receiver.expect_push("b", P.address, [3, 4], 30)
    eventually(lambda: P.sender.phase("b").value == "sending")
    P.sender.abort("b", "engine aborted the request")
    start = time.monotonic()
    assert D.receiver.wait_finished(5) == ([], ["b"])
    assert time.monotonic() - start < 2
    assert P.sender.wait_released(5) == ["b"]


def test_a_destination_after_the_prefill_gave_up_fails_the_load_at_once(pd) -> None:
    """The engine aborted (or preempted) the request on P before D's destination came:
    D hears that the transfer ended instead of waiting for data until receive_s."""
    P, D, _, _ = pd
    P.sender.track("late", [1, 2], 30)
    P.sender.abort("late", "vLLM preempted the prefill request and freed its blocks")
    assert P.sender.wait_released(5) == ["late"]
    start = time.monotonic()
    D.receiver.expect_push("late", P.address, [3, 4], 30)
    assert D.receiver.wait_finished(5) == ([], ["late"])
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("order", ["decode first", "prefill first"])
def test_a_decode_that_forgoes_a_transfer_frees_the_prefill_blocks_at_once(pd, order: str) -> None:
    """D computes the prompt itself (vLLM does for prompt logprobs): P lets go of the
    blocks when told, whether it tracks the request yet or not, long before its lease."""
    P, D, _, _ = pd
    if order == "prefill first":  # P-first: P holds the finished prompt
        P.sender.track("fg", [1, 2], 30, pull=True)
        P.sender.prefill_done("fg")
    futures = D.receiver.forgo("fg", [P.address], [None], "the decode computes the prompt itself")
    assert all(f.result(5) is None for f in futures)
    if order == "decode first":  # push: the abort waits at P for the request
        P.sender.track("fg", [1, 2], 30)
    start = time.monotonic()
    assert P.sender.wait_released(5) == ["fg"]
    assert time.monotonic() - start < 2, "released by the lease, not by the decode's word"
    assert P.stats.take().aborted == 1


def test_destination_that_does_not_fit_fails_both_sides(pd) -> None:
    P, D, _, _ = pd
    P.sender.track("m", [1, 2, 3], 40)
    D.receiver.expect_push("m", P.address, [5], 40)  # 1 block for 3 blocks of prompt
    assert D.receiver.wait_finished(5) == ([], ["m"])
    assert P.sender.wait_released(5) == ["m"]


def test_a_destination_that_came_early_and_does_not_fit_fails_the_decode_at_once() -> None:
    """Decode first: the destination waits at the prefill for its request; when the
    request comes and the destination does not fit, the decode hears so at once, not
    at its ``receive_s``."""
    P, D = endpoint("P", make_cache(1)), endpoint("D", make_cache(None), {"receive_s": 60})
    try:
        D.receiver.expect_push("m", P.address, [5], 40)  # 1 block for 3 blocks of prompt
        eventually(lambda: D.receiver.phase("m") == RecvPhase.WAITING)
        P.sender.track("m", [1, 2, 3], 40)
        start = time.monotonic()
        assert outcomes(D, 1) == ([], ["m"])
        assert time.monotonic() - start < 3, "failed by its deadline, not by the prefill's word"
        assert P.sender.wait_released(5) == ["m"]
    finally:
        D.close()
        P.close()


def test_a_destination_for_a_p_first_request_is_refused_on_the_direct_path(
    pd, caplog: pytest.LogCaptureFixture
) -> None:
    """On the direct path the decode side reads P-first requests itself: a destination
    for one is a confused decode, refused on both sides (the packed path accepts it)."""
    P, D, _, _ = pd
    P.sender.track("f", [1, 2, 3], 40, pull=True)
    P.sender.prefill_done("f")
    D.receiver.expect_push("f", P.address, [5, 6, 7], 40)
    assert D.receiver.wait_finished(5) == ([], ["f"])
    assert P.sender.wait_released(5) == ["f"]
    assert any("the request is P-first" in r.getMessage() for r in caplog.records)


def test_pull_from_a_restarted_prefill_fails_at_once(pd) -> None:
    P, D, _, _ = pd
    D.receiver.expect_pull("w", P.address, "an-old-epoch", [1], [1], 10)
    assert D.receiver.wait_finished(5) == ([], ["w"])


@pytest.mark.parametrize("secret", [None, "s"], ids=["no-secret", "secret"])
def test_incompatible_peer_is_refused_naming_what_differs(
    caplog: pytest.LogCaptureFixture, secret: str | None
) -> None:
    """The decode's error names each property that differs, with its own value and the
    fix; the prefill's values only when the decode is authenticated (a secret): others
    learn that they differ, from digests (issue 46: an incompatible peer was answered
    with the prefill's whole compatibility info, model name included)."""
    other = msgspec.structs.replace(SPEC, block_size=32)
    cfg = {} if secret is None else {"secret": secret}
    P = endpoint("P", make_cache(1), **cfg)
    D = endpoint("D", make_cache(None, other), spec=other, **cfg)
    try:
        D.receiver.expect_push("i", P.address, [1], 10)
        assert D.receiver.wait_finished(5) == ([], ["i"])
        failures = [
            r.getMessage() for r in caplog.records if "receiving i failed" in r.getMessage()
        ]
        assert failures and "fix: start prefill and decode with identical block_size" in failures[0]
        if secret is None:
            assert "block_size: ours=32, peer's differs" in failures[0]
            assert "peer=16" not in failures[0]
        else:
            assert any("block_size: ours=32, peer=16" in r.getMessage() for r in caplog.records)
    finally:
        D.close()
        P.close()


def test_an_incompatible_peer_learns_what_differs_not_the_prefill_s_values() -> None:
    """What a stranger gets for a Hello of another compatibility class: the names of the
    properties that differ and per-property digests, none of the prefill's values."""
    from kvbridge.errors import IncompatiblePeerError
    from kvbridge.runtime.node import Node
    from kvbridge.wire.codec import Codec
    from kvbridge.wire.messages import Hello, Reply

    P = endpoint("P", make_cache(1))
    try:
        theirs = msgspec.structs.replace(P.node.codec.compat, model="guess", block_size=32)
        hello = Node._hello(P.node, Hello)
        hello = msgspec.structs.replace(hello, compat=theirs)
        reply = P.server._answer(b"1", Codec(theirs).encode(hello), [])
        assert isinstance(reply, Reply) and reply.code == "incompatible"
        assert reply.compat is None and len(reply.salt) == 16
        assert set(reply.digests) >= {"model", "block_size", "dtype", "layout"}
        assert "block_size, model differ" in reply.detail
        assert "ours=" not in reply.detail and "peer=" not in reply.detail
        encoded = P.node.codec.encode(reply)
        assert msgspec.msgpack.encode(P.node.codec.compat) not in encoded
        with pytest.raises(IncompatiblePeerError, match=r"model: ours='guess', peer's differs"):
            Codec(theirs).decode(encoded)
    finally:
        P.close()


def test_each_slow_handshake_step_is_logged_by_name(
    pd, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handshake past the threshold says where its time went: on the decode side the
    wait for another handshake, the reply and adding the peer, its transport work on
    either side, the Welcome on the prefill side (all "slow" at a threshold of 0)."""
    monkeypatch.setattr(node_module, "_SLOW_HANDSHAKE_S", 0.0)
    P, D, _, _ = pd
    caplog.set_level(logging.WARNING, logger=node_module.__name__)
    D.node.connect(P.address)
    messages = [r.getMessage() for r in caplog.records]
    for step in (
        f"the handshake with {P.address} took",
        f"adding peer {P.node.id} to the loopback transport",
        f"adding peer {D.node.id} to the loopback transport",
        f"writing the Welcome for {D.node.id}",
    ):
        assert any(step in m for m in messages), (step, messages)


def test_a_shared_secret_authenticates_the_handshake_and_a_different_one_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p_cache, d_cache = make_cache(1), make_cache(None)
    P = endpoint("P", p_cache, secret="ours")
    D, E = endpoint("D", d_cache, secret="ours"), endpoint("D", make_cache(None), secret="not ours")
    try:
        D.receiver.expect_push("a", P.address, [3, 4], 20)
        P.sender.track("a", [7, 8], 20)
        P.sender.prefill_done("a")
        # MACs on requests, replies and notifications
        assert D.receiver.wait_finished(5) == (
            ["a"],
            [],
        )
        np.testing.assert_array_equal(d_cache[0][:, [3, 4]], p_cache[0][:, [7, 8]])
        E.receiver.expect_push("b", P.address, [3], 10)
        assert E.receiver.wait_finished(5) == ([], ["b"])
        assert any(
            "failed authentication" in r.getMessage() and "same 'secret'" in r.getMessage()
            for r in caplog.records
        )
    finally:
        for e in (E, D, P):
            e.close()


def test_with_a_secret_a_notification_without_its_mac_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forged ``LayerDone`` would make the decode take blocks nobody wrote as received."""
    from kvbridge.wire.messages import LayerDone

    p_cache, d_cache = make_cache(1), make_cache(None)
    P, D = endpoint("P", p_cache, secret="s"), endpoint("D", d_cache, secret="s")
    try:
        D.receiver.expect_push("f", P.address, [1], 10)  # the prefill never tracks it
        eventually(lambda: P.node.knows(D.node.id))  # the destination went out: D shook hands
        forged = LayerDone(transfer_id="f", layers=list(range(L)), first_block=0, num_blocks=1)
        P.node.transport.notify(D.node.transport.agent_name, P.node.codec.encode(forged))
        eventually(lambda: any("failed authentication" in r.getMessage() for r in caplog.records))
        assert D.receiver.take_finished() == ([], [])
        assert D.receiver.phase("f").value != "received"
        # the same message with its MAC is taken
        P.node.transport.notify(
            D.node.transport.agent_name, P.node.encode_note(forged, D.node.transport.agent_name)
        )
        assert D.receiver.wait_finished(5) == (["f"], [])
    finally:
        D.close()
        P.close()


@pytest.mark.parametrize(
    "field",
    [
        "bytes_received",
        "requests_sent",
        "descriptors",
        "exposed_s",
        "request_transfer_s",
        "transfer_s",
    ],
)
def test_a_snapshot_with_any_single_record_is_not_empty(field: str) -> None:
    """Workers drop empty snapshots after taking them: nothing recorded may be dropped."""
    from kvbridge.runtime.stats import TransferStats

    stats = TransferStats()
    if field.endswith("_s"):
        stats.observe(field, 0.25)
    else:
        stats.add(**{field: 1})
    snap = stats.take()
    assert not snap.is_empty()
    assert stats.take().is_empty()


def test_activity_is_set_by_every_outcome_and_only_then(pd) -> None:
    """The vLLM adapter sleeps on ``Endpoint.activity`` in idle steps: every release and
    every finished receive must set it, and nothing else may."""
    P, D, _, _ = pd
    P.activity.clear()
    D.activity.clear()
    D.receiver.expect_push("a", P.address, [1, 2], 20)
    P.sender.track("a", [5, 6], 20)
    for layer in range(L):
        P.sender.layer_done("a", layer, 10)
    assert not D.activity.wait(0.2) and not P.activity.is_set(), "set before anything finished"
    P.sender.prefill_done("a")
    assert D.activity.wait(5), "a finished receive did not set it"
    assert P.activity.wait(5), "a release did not set it"
    assert D.receiver.take_finished() == (["a"], []) and P.sender.take_released() == ["a"]


def _heartbeats_held_until(event, P):
    """A side-channel handler for ``P`` that holds each heartbeat until ``event`` is
    set (at most 10 s; the server thread waits meanwhile) and passes other messages
    through; install it as ``P.server._handler``."""
    from kvbridge.wire.messages import Heartbeat

    original = P.server._handler

    def slow(msg):
        if isinstance(msg, Heartbeat):
            event.wait(10)
        return original(msg)

    return slow


def test_heartbeats_to_a_slow_prefill_do_not_pile_up() -> None:
    """A prefill whose side channel answers late: the decode side's heartbeats to it
    (one due every ``heartbeat_s``, each waiting up to three of them) must not queue up
    in its I/O pool, where destinations and releases would wait behind them (seen in
    CI: a destination never left in 120 s). One beat in flight per prefill at a time."""
    import threading

    P, D = (
        endpoint("P", make_cache(1)),
        endpoint("D", make_cache(None), {"receive_s": 30, "heartbeat_s": 0.1}),
    )
    stuck = threading.Event()
    slow = _heartbeats_held_until(stuck, P)
    lock, running, most, beats = threading.Lock(), [0], [0], [0]
    beat = D.receiver._heartbeat

    def counted(*args):
        with lock:
            running[0] += 1
            beats[0] += 1
            most[0] = max(most[0], running[0])
        try:
            beat(*args)
        finally:
            with lock:
                running[0] -= 1

    D.receiver._heartbeat = counted  # type: ignore[method-assign]
    try:
        D.receiver.expect_push("h", P.address, [1], 10)
        eventually(lambda: D.receiver.phase("h").value == "waiting")
        P.server._handler = slow  # type: ignore[union-attr]
        assert D.receiver.wait_finished(1.5) == ([], [])  # 15 beats due meanwhile
        assert beats[0] >= 2, "no heartbeat while the prefill was slow"
        assert most[0] == 1, f"{most[0]} heartbeats to one prefill ran at once"
    finally:
        stuck.set()
        D.close()
        P.close()


def test_busy_prefill_is_not_declared_dead_while_it_still_listens() -> None:
    """A prefill whose side-channel thread is stuck (the GIL held through a compilation)
    misses heartbeats but still accepts connections: its transfers go on (and keep their
    own deadlines) instead of failing as if it were dead."""
    import threading

    P, D = (
        endpoint("P", make_cache(1)),
        endpoint("D", make_cache(None), {"receive_s": 30, "heartbeat_s": 0.2}),
    )
    stuck = threading.Event()
    slow = _heartbeats_held_until(stuck, P)
    try:
        D.receiver.expect_push("b", P.address, [1], 10)
        eventually(lambda: D.receiver.phase("b").value == "waiting")
        P.server._handler = slow  # type: ignore[union-attr]
        assert D.receiver.wait_finished(2.0) == ([], []), (
            "a busy but listening prefill was declared dead"
        )
        P.sender.track("b", [4], 10)
        for layer in range(L):
            P.sender.layer_done("b", layer, 10)
        P.sender.prefill_done("b")
        assert D.receiver.wait_finished(5) == (["b"], [])
    finally:
        stuck.set()
        D.close()
        P.close()


GROUPS = ((0, 1, 0, 1), (0, 40))
"""Layers 0 and 2 full attention (group 0), 1 and 3 a sliding window (group 1)."""


@pytest.fixture
def hybrid() -> Iterator[tuple]:
    p_cache, d_cache = make_cache(1), make_cache(None)
    P, D = endpoint("P", p_cache, groups=GROUPS), endpoint("D", d_cache, groups=GROUPS)
    yield P, D, p_cache[0], d_cache[0]
    D.close()
    P.close()


def test_sliding_layers_move_only_the_blocks_the_decode_holds(hybrid) -> None:
    """Layer-wise push of a 200-token prompt (13 blocks) whose sliding group the decode
    holds from block 10 on: full layers land whole, sliding layers only there. The first
    chunk's sliding layers have nothing to write (a bare notification covers them)."""
    P, D, pa, da = hybrid
    n, full, sliding = 200, list(range(13)), list(range(13, 26))
    d_full, d_sliding = list(range(30, 43)), [NONE] * 10 + [43, 44, 45]
    D.receiver.expect_push("h", P.address, BlockTable.grouped([d_full, d_sliding]), n)
    P.sender.track("h", BlockTable.grouped([full[:4], sliding[:4]]), n)
    for layer in (1, 3):  # the sliding layers first: a post of their own, all before the window
        P.sender.layer_done("h", layer, 64)
    # its notification arrived, with nothing written
    eventually(lambda: D.receiver.phase("h") is RecvPhase.RECEIVING)
    assert not da.any()
    for layer in (0, 2):
        P.sender.layer_done("h", layer, 64)
    eventually(lambda: np.array_equal(da[2, d_full[:4]], pa[2, full[:4]]))
    P.sender.add_blocks("h", BlockTable.grouped([full[4:], sliding[4:]]))
    for layer in range(L):
        P.sender.layer_done("h", layer, n)
    P.sender.prefill_done("h")
    assert D.receiver.wait_finished(5) == (["h"], [])
    for layer in (0, 2):
        np.testing.assert_array_equal(da[layer, d_full], pa[layer, full])
    for layer in (1, 3):
        np.testing.assert_array_equal(da[layer, [43, 44, 45]], pa[layer, sliding[10:]])
        untouched = [b for b in range(da.shape[1]) if b not in (43, 44, 45)]
        assert not da[layer, untouched].any(), "a sliding layer received blocks outside the window"
    assert P.sender.wait_released(5) == ["h"]
    moved = (2 * 13 + 2 * 3) * SPEC.block_bytes
    assert P.stats.take().bytes_sent == moved
    assert D.stats.take().bytes_received == moved


def test_pull_reads_each_group_s_blocks_into_the_decode_s(hybrid) -> None:
    P, D, pa, da = hybrid
    # the prefill freed its first sliding block
    P.sender.track("g", BlockTable.grouped([[7, 8, 9], [NONE, 10, 11]]), 40, pull=True)
    P.sender.prefill_done("g")
    D.receiver.expect_pull(
        "g",
        P.address,
        P.epoch,
        BlockTable.grouped([[7, 8, 9], [NONE, 10, 11]]),
        BlockTable.grouped([[1, 2, 3], [NONE, 4, 5]]),
        40,
    )
    assert D.receiver.wait_finished(5) == (["g"], [])
    for layer in (0, 2):
        np.testing.assert_array_equal(da[layer, [1, 2, 3]], pa[layer, [7, 8, 9]])
    for layer in (1, 3):
        np.testing.assert_array_equal(da[layer, [4, 5]], pa[layer, [10, 11]])
        assert not da[layer, [1, 2, 3]].any()
    assert P.sender.wait_released(5) == ["g"]


def test_a_decode_expecting_blocks_the_prefill_freed_fails_cleanly(
    hybrid, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode holds a sliding block the prefill no longer has: the write fails with
    the reason, on both sides; nothing is read from a freed block."""
    P, D, _pa, da = hybrid
    D.receiver.expect_push("f", P.address, BlockTable.grouped([[30, 31], [32, 33]]), 20)
    P.sender.track("f", BlockTable.grouped([[1, 2], [NONE, 3]]), 20)
    for layer in range(L):
        P.sender.layer_done("f", layer, 20)
    P.sender.prefill_done("f")
    assert D.receiver.wait_finished(5) == ([], ["f"])
    assert P.sender.wait_released(5) == ["f"]
    assert not da[[1, 3]][:, [32]].any()
    assert any(
        "expects position 0 of the request's blocks, which the source no longer holds"
        in r.getMessage()
        for r in caplog.records
    )


def test_a_destination_with_other_kv_cache_groups_is_refused(
    hybrid, caplog: pytest.LogCaptureFixture
) -> None:
    P, D, _, _ = hybrid
    P.sender.track("x", BlockTable.grouped([[1, 2], [3, 4]]), 20)
    D.receiver.expect_push("x", P.address, [30, 31], 20)  # one group, where the prefill has two
    assert D.receiver.wait_finished(5) == ([], ["x"])
    assert P.sender.wait_released(5) == ["x"]
    assert any(
        "blocks of 1 KV cache groups, this prefill's request 2" in r.getMessage()
        for r in caplog.records
    )


def test_one_sliding_group_moves_only_its_window() -> None:
    """Every layer in one sliding-window group (a model whose layers all slide)."""
    p_cache, d_cache = make_cache(1), make_cache(None)
    P, D = (
        endpoint("P", p_cache, groups=((0,) * L, (40,))),
        endpoint("D", d_cache, groups=((0,) * L, (40,))),
    )
    pa, da = p_cache[0], d_cache[0]
    try:
        D.receiver.expect_push(
            "o", P.address, BlockTable.grouped([[NONE] * 10 + [40, 41, 42]]), 200
        )
        P.sender.track("o", BlockTable.grouped([list(range(13))]), 200)
        for layer in range(L):
            P.sender.layer_done("o", layer, 200)
        P.sender.prefill_done("o")
        assert D.receiver.wait_finished(5) == (["o"], [])
        np.testing.assert_array_equal(da[:, 40:43], pa[:, 10:13])
        assert not da[:, :40].any() and not da[:, 43:].any()
        assert D.stats.take().bytes_received == L * 3 * SPEC.block_bytes
    finally:
        D.close()
        P.close()


STATE = 1000
"""Bytes of a state-space layer's state: the start of its block (``layer_bytes``)."""


def test_state_layers_write_their_state_block_once_the_prompt_is_computed() -> None:
    """Layers 1 and 3 are state-space layers (group 0, one state per request, held at
    the request's last position), 0 and 2 attention (group 1). A 200-token push streams
    the attention layers per chunk; a state layer (which reports no ``layer_done``:
    vLLM's save hook runs after attention layers only) writes its state's bytes, and
    only those, into the decode's state block when the prefill is done."""
    p_cache, d_cache = make_cache(1), make_cache(None)
    lb = tuple(STATE if layer % 2 else SPEC.block_bytes for layer in range(L))
    groups = ((1, 0, 1, 0), (0, 0))
    P = endpoint(
        "P", (p_cache[0], msgspec.structs.replace(p_cache[1], layer_bytes=lb)), groups=groups
    )
    D = endpoint(
        "D", (d_cache[0], msgspec.structs.replace(d_cache[1], layer_bytes=lb)), groups=groups
    )
    pa, da = p_cache[0], d_cache[0]

    def raw(a: np.ndarray, layer: int, block: int) -> np.ndarray:
        return a[layer, block].view(np.uint8).reshape(-1)

    try:
        n, attn, d_attn = 200, list(range(13)), list(range(30, 43))
        D.receiver.expect_push("s", P.address, BlockTable.grouped([[NONE] * 12 + [44], d_attn]), n)
        P.sender.track("s", BlockTable.grouped([[NONE] * 4, attn[:4]]), n)
        for layer in (0, 2):
            P.sender.layer_done("s", layer, 64)
        eventually(lambda: np.array_equal(da[2, d_attn[:4]], pa[2, attn[:4]]))
        P.sender.add_blocks("s", BlockTable.grouped([[NONE] * 8 + [20], attn[4:]]))
        for layer in (0, 2):
            P.sender.layer_done("s", layer, n)
        eventually(lambda: np.array_equal(da[2, d_attn], pa[2, attn]))
        assert not da[[1, 3]].any(), "a state was written before the prefill was done"
        P.sender.prefill_done("s")
        assert D.receiver.wait_finished(5) == (["s"], [])
        for layer in (1, 3):
            np.testing.assert_array_equal(raw(da, layer, 44)[:STATE], raw(pa, layer, 20)[:STATE])
            assert (
                not raw(da, layer, 44)[STATE:].any() and not np.delete(da[layer], 44, axis=0).any()
            ), "bytes beyond the state moved"
        assert P.sender.wait_released(5) == ["s"]
        moved = 2 * 13 * SPEC.block_bytes + 2 * STATE
        assert P.stats.take().bytes_sent == moved
        assert D.stats.take().bytes_received == moved
    finally:
        D.close()
        P.close()


@pytest.fixture(params=["same", "new"], ids=["same-engine-id", "new-engine-id"])
def restarted(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """A decode waiting for the KV of transfer "old" from a prefill that then restarts
    on its side-channel port: yields the decode and the new prefill (whose epoch
    differs, and whose engine id is the same, or new as vLLM draws one at each start);
    the decode heartbeats every 0.3 s and would wait 60 s for "old"."""
    from kvbridge.demo.servers import free_port

    port = free_port()
    P1 = endpoint("P", make_cache(1), side_channel_port=port)
    D = endpoint("D", make_cache(None), {"receive_s": 60, "heartbeat_s": 0.3})
    P2 = None
    try:
        D.receiver.expect_push("old", P1.address, [1], 10)
        eventually(lambda: D.receiver.phase("old") == RecvPhase.WAITING)
        P1.close()
        engine_id = "P" if request.param == "same" else "P-restarted"
        P2 = endpoint("P", make_cache(2), side_channel_port=port, engine_id=engine_id)
        assert P2.address == P1.address and P2.epoch != P1.epoch
        yield D, P2
    finally:
        D.close()
        if P2 is not None:
            P2.close()


def _stream_new(D, P2, wait: bool) -> None:
    """Transfer "new" of 40 tokens (3 blocks of 16) from ``P2`` to ``D``, decode first;
    ``wait``: once the decode waits for it, until a heartbeat has failed "old"."""
    n, pblocks, dblocks = 40, [1, 2, 3], [20, 21, 22]
    D.receiver.expect_push("new", P2.address, dblocks, n)
    P2.sender.track("new", pblocks, n)
    if wait:
        eventually(lambda: D.receiver.phase("new") == RecvPhase.WAITING)
        # a beat is due every 0.3 s: one finds the new epoch before the prefill finishes
        eventually(lambda: D.receiver.phase("old") != RecvPhase.WAITING, timeout=5)
    for layer in range(L):
        P2.sender.layer_done("new", layer, n)
    P2.sender.prefill_done("new")


def test_a_restart_on_the_same_port_fails_only_the_old_instance_s_transfers(restarted) -> None:
    """A prefill restarts on its port while the decode waits for the old instance's KV
    and already streams from the new one: the heartbeat that finds the new epoch fails
    the old instance's transfer only; the new one's completes (its handshake and
    transport peer stay). Found by the vLLM 0.34 stand-in tier: a decode's first
    handoff after a prefill restart failed and was computed again."""
    D, P2 = restarted
    _stream_new(D, P2, wait=True)
    assert outcomes(D, 2) == (["new"], ["old"])


def test_handshakes_count_each_peer_once_and_a_restart_as_a_replacement(restarted) -> None:
    """``peers_registered`` and ``peers_replaced`` (exported as metrics, read by the
    engine tests instead of log lines): the decode shook hands with the first prefill,
    then with the restarted one, which replaced it (whether its engine id is the same or
    new: a restart must not leave its old self among the peers, which are bounded by
    ``MAX_PEERS``); a repeated handshake with a known peer counts nothing."""
    D, P2 = restarted
    _stream_new(D, P2, wait=True)
    assert outcomes(D, 2) == (["new"], ["old"])
    D.node.connect(P2.address, fresh=True)
    d, p = D.stats.take(), P2.stats.take()
    assert (d.peers_registered, d.peers_replaced) == (2, 1)
    assert (p.peers_registered, p.peers_replaced) == (1, 0)
    assert [k[0] for k in D.node._peers] == [P2.node.id.engine_id], D.node._peers


def test_a_restart_a_heartbeat_finds_first_counts_as_one_replacement(restarted) -> None:
    """The other order: the decode's heartbeat finds the new instance first and drops
    the old handshake then (not at a new handshake); counted once all the same."""
    D, P2 = restarted
    eventually(lambda: D.receiver.phase("old") != RecvPhase.WAITING, timeout=5)
    assert D.node.num_peers == 0, "the old instance's handshake is kept"
    _stream_new(D, P2, wait=False)
    assert outcomes(D, 2) == (["new"], ["old"])
    d = D.stats.take()
    assert (d.peers_registered, d.peers_replaced) == (2, 1)


def test_a_destination_on_its_way_to_a_restarted_prefill_is_not_failed_by_a_heartbeat(
    restarted,
) -> None:
    """The decode's cached handshake is still the old instance's when a new request
    starts: its destination goes out addressed from that handshake, and a heartbeat
    that finds the new epoch meanwhile must leave it to the destination's own answer
    (``unknown_peer``: shake hands again), not fail it. Held in that order here: the
    destination waits until a heartbeat has answered with the new epoch."""
    from kvbridge.wire.messages import Destination, Heartbeat

    D, P2 = restarted
    new_epoch_seen = threading.Event()
    request = D.node.client.request

    def ordered(address, msg, timeout):
        if isinstance(msg, Destination) and msg.transfer_id == "new":
            assert new_epoch_seen.wait(10), "no heartbeat reached the new instance"
        reply = request(address, msg, timeout)
        if isinstance(msg, Heartbeat) and getattr(reply, "epoch", None) == P2.epoch:
            new_epoch_seen.set()
        return reply

    D.node.client.request = ordered
    _stream_new(D, P2, wait=False)
    assert outcomes(D, 2) == (["new"], ["old"])


@pytest.mark.parametrize("destination", ["before", "after"])
def test_a_request_the_prefill_s_engine_never_computed_ends_its_decode_at_once_as_aborted(
    destination: str,
) -> None:
    """The prefill's engine ended a pushed request while it was queued (its client went
    away: the proxy closed the prefill request). Its decode, whose destination reached
    the prefill before that or comes after it, used to wait out ``receive_s`` holding its
    blocks (the soak's minute-long holds); it now ends at once, counted as aborted and
    not as a failure, and the prefill keeps nothing for it."""
    P, D = endpoint("P", make_cache(1)), endpoint("D", make_cache(None), {"receive_s": 60})
    try:
        if destination == "before":
            D.receiver.expect_push("q", P.address, [5, 6, 7], 40)
            eventually(lambda: D.receiver.phase("q") == RecvPhase.WAITING)
            assert P.sender.early == 1
        P.sender.never_sent("q", "the prefill request ended before it was computed (ABORTED)")
        if destination == "after":
            D.receiver.expect_push("q", P.address, [5, 6, 7], 40)
        start = time.monotonic()
        assert outcomes(D, 1) == ([], ["q"])
        assert time.monotonic() - start < 3, "ended by its deadline, not by the prefill's word"
        counted = D.stats.take()
        assert (counted.aborted, counted.failures) == (1, 0)
        assert P.sender.early == 0
        assert P.sender.take_released() == [], "nothing was held for it: nothing to release"
    finally:
        D.close()
        P.close()
