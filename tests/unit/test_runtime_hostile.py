"""Hostile and mistaken peers against the runtime (side channel, sender, receiver) on the
loopback transport: no message kills a receive loop, and only the parties of a transfer's
handoff act on it (its ticket, its decode instance, its source). Each test fails on the
code before these defences: the frame killed the thread, the stranger's message was
taken."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq
from runtime_pair import L, endpoint, eventually, make_cache

from kvbridge.core.lifecycle import SendPhase
from kvbridge.errors import KVBridgeError
from kvbridge.runtime import node as node_module
from kvbridge.runtime import sender as sender_module
from kvbridge.runtime import sidechannel
from kvbridge.transports.base import decode_metadata, encode_metadata
from kvbridge.wire.auth import mac, stamp
from kvbridge.wire.messages import (
    Abort,
    Destination,
    Heartbeat,
    Hello,
    LayerDone,
    Release,
    Reply,
)
from kvbridge.wire.peer_compat import PROTOCOL_VERSION

TICKET = "the-handoff-s-ticket"


@pytest.fixture
def pde() -> Iterator[tuple]:
    """A prefill P, its decode D (the victim) and a stranger E: another decode instance
    that shook hands with P and knows the victim's transfer id, not its ticket."""
    p_cache, d_cache, e_cache = make_cache(1), make_cache(None), make_cache(None)
    P, D, E = endpoint("P", p_cache), endpoint("D", d_cache), endpoint("E", e_cache)
    E.node.connect(P.address)
    yield P, D, E, p_cache[0], d_cache[0], e_cache[0]
    for e in (E, D, P):
        e.close()


def _ask(E, P, msg) -> Reply:
    reply = E.node.client.request(P.address, msg, 5)
    assert isinstance(reply, Reply)
    return reply


def _refused(ep) -> int:
    return ep.stats.take().messages_refused


def _nested_frame(codec, depth: int = 1200) -> bytes:
    """A 1.2 KB frame whose body nests ``depth`` arrays: the decoder recurses per level."""
    body = msgspec.Raw(b"\x91" * depth + b"\x01")
    return msgspec.msgpack.encode([PROTOCOL_VERSION, codec.compat_hash, body])


def _send_raw(address: str, *messages: list[bytes]) -> list[bytes]:
    """Send ``messages`` on one connection (served in order) and return the reply to the
    last one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for frames in messages:
            sock.send_multipart(frames)
        assert sock.poll(5000), "the side channel did not answer"
        return sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def _destination_arrived(P, D, tid: str) -> None:
    """Wait until D's destination for ``tid`` reached P (kept early, P not tracking it)."""
    eventually(lambda: P.sender.early > 0 or D.receiver.phase(tid).value == "failed")
    assert D.receiver.phase(tid).value != "failed"


def _destination_accepted(P, D, tid: str) -> None:
    """Wait until P, tracking ``tid``, accepted D's destination for it."""
    eventually(
        lambda: P.sender.phase(tid) is SendPhase.SENDING or D.receiver.phase(tid).value == "failed"
    )
    assert D.receiver.phase(tid).value != "failed"


def _push_one(P, D, tid: str, pa, da, ticket: str = TICKET) -> None:
    """A whole layer-wise push of two blocks; asserts D got P's KV."""
    D.receiver.expect_push(tid, P.address, [3, 4], 20, ticket=ticket)
    P.sender.track(tid, [7, 8], 20, ticket=ticket)
    P.sender.prefill_done(tid)
    assert D.receiver.wait_finished(5) == ([tid], [])
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])
    assert P.sender.wait_released(5) == [tid]


def test_a_deeply_nested_frame_is_refused_and_the_side_channel_serves_on(pde) -> None:
    P, D, _, pa, da, _ = pde
    frame = _nested_frame(P.node.codec)
    assert len(frame) < 1300
    # before it, a request of one frame only and one whose request id is a payload of its
    # own: both dropped unanswered
    rid, out = _send_raw(P.address, [b"only"], [b"x" * 10_000, frame], [b"1", frame])
    reply = P.node.codec.decode(out)
    assert rid == b"1" and isinstance(reply, Reply) and reply.code == "error"
    assert "recursion" in reply.detail
    _push_one(P, D, "after", pa, da)
    assert _refused(P) == 3


def test_a_deeply_nested_notification_is_dropped_and_the_decode_receives_on(pde) -> None:
    P, D, _, pa, da, _ = pde
    D.node.connect(P.address)  # P adds D to its transport
    P.node.transport.notify(D.node.transport.agent_name, _nested_frame(P.node.codec))
    P.node.transport.notify(D.node.transport.agent_name, b"\xc1 not msgpack")
    _push_one(P, D, "after", pa, da)  # the notification thread still takes the writes' notes
    assert _refused(D) == 2


def test_a_handshake_with_a_kept_peer_s_transport_metadata_is_refused(pde) -> None:
    """The attack: shake hands with the victim's transport metadata and cache. Verbatim, the
    prefill wrote the stranger's transfers into the victim's memory and, when the stranger
    went, removed the victim from its transport; altered, it released the victim's tables
    at once."""
    P, D, E, pa, da, _ = pde
    D.node.connect(P.address)
    victim = D.node.transport.metadata()
    md = decode_metadata(victim, P.node.transport.name)
    altered = encode_metadata(msgspec.structs.replace(md, regions=md.regions[:1]))
    for metadata in (victim, altered):
        hello = msgspec.structs.replace(
            E.node._hello(Hello), transport_metadata=metadata, geometry=D.node.geometry
        )
        reply = _ask(E, P, hello)
        assert not reply.ok and "which another peer" in reply.detail, reply
    assert P.node.peer(E.node.id).agent == E.node.transport.agent_name
    assert P.node.peer(D.node.id).agent == D.node.transport.agent_name
    _push_one(P, D, "after", pa, da)


def test_a_stranger_s_early_destination_takes_no_kv_and_fails_nothing(pde) -> None:
    """The attack: send a Destination for another request's transfer id before its decode
    does; the prefill wrote that request's KV into the attacker's memory."""
    P, D, E, pa, da, ea = pde
    stolen = Destination(transfer_id="v", peer=E.node.id, block_ids=[1, 2], num_tokens=20)
    assert _ask(E, P, stolen).ok  # kept for later: P does not track "v" yet
    _push_one(P, D, "v", pa, da)
    assert not ea.any(), "the stranger received another request's KV"
    assert _refused(P) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda peer: Abort(transfer_id="v", peer=peer, reason="mine now"),
        lambda peer: Release(transfer_id="v", peer=peer),
        lambda peer: Destination(transfer_id="v", peer=peer, block_ids=[1], num_tokens=5),
    ],
    ids=["abort", "release", "misfit-destination"],
)
def test_a_stranger_cannot_abort_release_or_fail_a_tracked_transfer(pde, make) -> None:
    P, D, E, pa, da, ea = pde
    P.sender.track("v", [7, 8], 20, ticket=TICKET)
    reply = _ask(E, P, make(E.node.id))
    assert reply.code == "forbidden" and "ticket" in reply.detail
    # ... even with the ticket, from another decode instance than the destination's
    D.receiver.expect_push("v", P.address, [3, 4], 20, ticket=TICKET)
    _destination_accepted(P, D, "v")
    forged = msgspec.structs.replace(make(E.node.id), ticket=TICKET)
    reply = _ask(E, P, forged)
    assert reply.code == "forbidden" and "another decode instance" in reply.detail
    P.sender.prefill_done("v")
    assert D.receiver.wait_finished(5) == (["v"], [])
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])
    assert P.sender.wait_released(5) == ["v"] and not ea.any()
    assert _refused(P) == 2


def test_a_stranger_s_early_abort_voids_nothing_of_the_decode_s(pde) -> None:
    P, D, E, pa, da, _ = pde
    D.receiver.expect_push("v", P.address, [3, 4], 20, ticket=TICKET)
    _destination_arrived(P, D, "v")
    assert _ask(E, P, Abort(transfer_id="v", peer=E.node.id)).code == "stopped"
    P.sender.track("v", [7, 8], 20, ticket=TICKET)
    P.sender.prefill_done("v")
    assert D.receiver.wait_finished(5) == (["v"], [])
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])


def test_without_tickets_a_transfer_belongs_to_its_first_decode_instance(pde) -> None:
    P, D, E, pa, da, ea = pde
    D.receiver.expect_push("v", P.address, [3, 4], 20)
    P.sender.track("v", [7, 8], 20)
    _destination_accepted(P, D, "v")
    for msg in (
        Abort(transfer_id="v", peer=E.node.id),
        Destination(transfer_id="v", peer=E.node.id, block_ids=[1, 2], num_tokens=20),
    ):
        assert _ask(E, P, msg).code == "forbidden"
    P.sender.prefill_done("v")
    assert D.receiver.wait_finished(5) == (["v"], [])
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])
    assert not ea.any()


def test_a_layer_done_from_a_peer_that_is_not_the_source_is_dropped(pde) -> None:
    """The attack: a forged notification made the decode report KV nobody wrote."""
    P, D, E, pa, da, _ = pde
    D.receiver.expect_push("v", P.address, [3, 4], 20, ticket=TICKET)
    _destination_arrived(P, D, "v")
    forged = LayerDone(transfer_id="v", layers=list(range(L)), first_block=0, num_blocks=2)
    E.node.transport.add_peer(D.node.transport.metadata())  # E can reach D's transport
    E.node.transport.notify(
        D.node.transport.agent_name, E.node.encode_note(forged, D.node.transport.agent_name)
    )
    eventually(lambda: _refused(D) > 0)  # no event: the note is dropped on D's thread
    assert D.receiver.take_finished() == ([], []) and D.receiver.phase("v").value != "received"
    P.sender.track("v", [7, 8], 20, ticket=TICKET)
    P.sender.prefill_done("v")
    assert D.receiver.wait_finished(5) == (["v"], [])  # P's writes and notes, not E's
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])


def test_messages_for_untracked_transfers_are_bounded(pde, monkeypatch) -> None:
    P, _, E, *_ = pde
    monkeypatch.setattr(sender_module, "MAX_EARLY_TRANSFERS", 3)
    for i in range(sender_module.MAX_EARLY_PER_TRANSFER):
        assert _ask(E, P, Abort(transfer_id="t0", peer=E.node.id, ticket=str(i))).ok
    assert not _ask(E, P, Abort(transfer_id="t0", peer=E.node.id, ticket="one more")).ok
    for t in ("t1", "t2"):
        assert _ask(E, P, Abort(transfer_id=t, peer=E.node.id)).ok
    assert not _ask(E, P, Abort(transfer_id="t3", peer=E.node.id)).ok
    assert P.sender.early == sender_module.MAX_EARLY_PER_TRANSFER + 2
    assert _refused(P) == 2


def test_a_decode_whose_early_destination_has_another_ticket_fails_at_once(pde) -> None:
    """A mistaken (stale) decode is told when the prefill refuses its destination, instead
    of waiting for KV until ``timeouts.receive_s`` (5 s here)."""
    P, D, *_ = pde
    D.receiver.expect_push("v", P.address, [3, 4], 20, ticket="another")
    _destination_arrived(P, D, "v")
    P.sender.track("v", [7, 8], 20, ticket=TICKET)
    assert D.receiver.wait_finished(3) == ([], ["v"])


@pytest.fixture
def secret_pair() -> Iterator[tuple]:
    """Two prefills P and Q and a decode D sharing one secret."""
    p_cache, d_cache = make_cache(1), make_cache(None)
    P, Q = endpoint("P", p_cache, secret="s"), endpoint("P", make_cache(2), secret="s")
    D = endpoint("D", d_cache, secret="s")
    yield P, Q, D, p_cache[0], d_cache[0]
    for e in (D, Q, P):
        e.close()


def _signed(server: str, msg, codec, when: bytes | None = None) -> list[bytes]:
    """The frames a client with the secret sends ``server``: what an eavesdropper captures."""
    payload = codec.encode(msg)
    when = when or stamp()
    return [
        b"7",
        payload,
        mac(b"s", *sidechannel._request_parts(server, when, b"7", payload)),
        when,
    ]


def _detail(P, reply: list[bytes]) -> str:
    msg = P.node.codec.decode(reply[1])
    return msg.detail if isinstance(msg, Reply) else type(msg).__name__


def test_with_a_secret_a_captured_request_is_refused_again_later_and_elsewhere(
    secret_pair,
) -> None:
    P, Q, D, pa, da = secret_pair
    beat = Heartbeat(peer=D.node.id)
    frames = _signed(P.address, beat, P.node.codec)
    assert _detail(P, _send_raw(P.address, frames)) == ""  # authentic: taken
    assert "replayed" in _detail(P, _send_raw(P.address, frames))
    assert "authentication failed" in _detail(Q, _send_raw(Q.address, frames))  # another server
    old = (int.from_bytes(stamp(), "big") - 120_000).to_bytes(8, "big")
    assert "stamped more than" in _detail(
        P, _send_raw(P.address, _signed(P.address, beat, P.node.codec, old))
    )
    assert _refused(P) == 2 and _refused(Q) == 1
    _push_one(P, D, "after", pa, da)  # the client's own requests, each fresh, still pass


def test_with_a_secret_a_notification_sealed_for_another_receiver_is_dropped(secret_pair) -> None:
    P, Q, D, pa, da = secret_pair
    D.receiver.expect_push("v", P.address, [3, 4], 20, ticket=TICKET)
    _destination_arrived(P, D, "v")
    forged = LayerDone(transfer_id="v", layers=list(range(L)), first_block=0, num_blocks=2)
    # sealed by P for Q: the right sender, the secret, another receiver
    P.node.transport.notify(
        D.node.transport.agent_name, P.node.encode_note(forged, Q.node.transport.agent_name)
    )
    eventually(lambda: _refused(D) > 0)
    assert D.receiver.phase("v").value != "received"
    P.sender.track("v", [7, 8], 20, ticket=TICKET)
    P.sender.prefill_done("v")
    assert D.receiver.wait_finished(5) == (["v"], [])
    np.testing.assert_array_equal(da[:, [3, 4]], pa[:, [7, 8]])


def test_messages_for_untracked_transfers_are_bounded_in_block_ids(pde, monkeypatch) -> None:
    """A few early destinations of a million block ids each would hold gigabytes under the
    count bounds alone; past the block-id budget they are refused and counted."""
    P, _, E, *_ = pde
    monkeypatch.setattr(sender_module, "MAX_EARLY_BLOCK_IDS", 2_500)
    big = [1] * 1_000
    for t in ("a", "b"):
        reply = P.sender.on_destination(
            Destination(transfer_id=t, peer=E.node.id, block_ids=big, num_tokens=16_000)
        )
        assert reply.ok
    assert P.sender.early_block_ids == 2_000
    third = Destination(transfer_id="c", peer=E.node.id, block_ids=big, num_tokens=16_000)
    assert not P.sender.on_destination(third).ok
    assert P.sender.on_abort(Abort(transfer_id="c", peer=E.node.id)).ok, "an abort holds no ids"
    assert P.sender.early == 3 and P.sender.early_block_ids == 2_000
    assert _refused(P) == 1
    # an abort of the same party voids its destination and gives its ids back
    assert P.sender.on_abort(Abort(transfer_id="a", peer=E.node.id)).ok
    assert P.sender.early_block_ids == 1_000
    assert P.sender.on_destination(third).ok


def _apply_deadlines_s(sender) -> float:
    """The fastest of several turns of the sender thread's deadline pass."""
    best = float("inf")
    for _ in range(30):
        start = time.perf_counter()
        sender._apply_deadlines()
        best = min(best, time.perf_counter() - start)
    return best


def test_messages_kept_early_cost_the_sender_thread_nothing_until_they_expire(pde) -> None:
    """The sender thread's every turn (each 0.2 ms while writes or device events are
    pending) visited every message kept early: 20,000 aborts for unknown ids made it
    burn a third of a core. Now it visits only those whose time has come."""
    P, _, E, *_ = pde
    empty = _apply_deadlines_s(P.sender)
    for i in range(sender_module.MAX_EARLY_TRANSFERS):
        assert P.sender.on_abort(Abort(transfer_id=f"t{i}", peer=E.node.id)).ok
    full = _apply_deadlines_s(P.sender)
    assert full < 5 * empty + 200e-6, (
        f"a deadline pass over {sender_module.MAX_EARLY_TRANSFERS} early messages took "
        f"{full * 1e6:.0f} us, {empty * 1e6:.0f} us over none"
    )
    assert P.sender.early == sender_module.MAX_EARLY_TRANSFERS


def test_handshakes_beyond_the_peer_bound_are_refused_and_a_restart_still_replaces(
    pde, monkeypatch
) -> None:
    """Each handshake builds the peer's slot table (183 MB for a 587-byte Hello claiming
    2e6 blocks): the peers a worker keeps are bounded, and a peer's claimed cache too."""
    P, D, E, *_ = pde
    monkeypatch.setattr(P.node._peers, "limit", 2)
    D.node.connect(P.address)
    assert P.node.num_peers == 2
    F = endpoint("F", make_cache(None))
    E2 = endpoint("E", make_cache(None))  # E restarted: a new epoch of a known peer
    try:
        with pytest.raises(KVBridgeError, match=r"already keeps 2 peers.*fix: .*secret"):
            F.node.connect(P.address)
        E2.node.connect(P.address)
        assert P.node.num_peers == 2 and not P.node.knows(E.node.id) and P.node.knows(E2.node.id)
        monkeypatch.setattr(node_module, "MAX_PEER_SLOTS", D.node.geometry.num_slots - 1)
        with pytest.raises(KVBridgeError, match="claims a cache of"):
            D.node.connect(P.address, fresh=True)
    finally:
        F.close()
        E2.close()


def test_with_a_secret_a_captured_notification_is_refused_again_and_later(
    secret_pair, monkeypatch
) -> None:
    """Notifications carry a stamp under their MAC and the receiver keeps the MACs it
    took: the same LayerDone delivered twice, or one stamped two minutes ago, is dropped
    (issue 46: notifications were bound to both agents, not to freshness)."""
    P, _, D, *_ = secret_pair
    D.node.connect(P.address)
    to = D.node.transport.agent_name
    refused = [0]

    def refusals() -> int:
        refused[0] += _refused(D)
        return refused[0]

    note = LayerDone(transfer_id="gone", layers=[0], first_block=0, num_blocks=1)
    captured = P.node.encode_note(note, to)
    P.node.transport.notify(to, captured)
    P.node.transport.notify(to, captured)
    eventually(lambda: refusals() == 1)
    assert len(D.node.note_replays) == 1
    old = (int.from_bytes(stamp(), "big") - 120_000).to_bytes(8, "big")
    monkeypatch.setattr(node_module, "stamp", lambda: old)
    P.node.transport.notify(to, P.node.encode_note(note, to))
    eventually(lambda: refusals() == 2)
    assert len(D.node.note_replays) == 1
