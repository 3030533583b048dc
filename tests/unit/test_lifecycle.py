from __future__ import annotations

import pytest

from kvbridge.config import Timeouts
from kvbridge.core.lifecycle import (
    EndedTransfers,
    RecvPhase,
    RecvRequest,
    RequestTable,
    SendPhase,
    SendRequest,
)
from kvbridge.errors import StateError

T = Timeouts(handshake_s=1, transfer_s=2, lease_s=10, receive_s=20, abort_ack_s=3)


def test_send_happy_path_with_chunks_and_layers() -> None:
    r = SendRequest("a", [1, 2], T, now=0)
    assert r.phase is SendPhase.HELD and r.deadline == 10
    r.hold([3])  # second chunk
    r.start_sending(now=1)
    assert r.deadline == 3
    for layer in range(4):
        r.posted(layer)
    r.settled(0, now=2.5)
    assert r.deadline == 4.5, "progress refreshes the transfer deadline"
    r.finish(now=2.6)
    assert r.phase is SendPhase.SENDING and not r.releasable, (
        "not done while transfers are in flight"
    )
    for layer in (1, 2, 3):
        r.settled(layer, now=3)
    assert r.phase is SendPhase.DONE and r.releasable
    assert r.release() == (1, 2, 3)
    with pytest.raises(StateError, match="released twice"):
        r.release()


def test_lease_expires_when_decode_never_comes() -> None:
    r = SendRequest("a", [7], T, now=0)
    assert not r.poll(9.99)
    assert r.poll(10.0)
    assert r.phase is SendPhase.EXPIRED and "lease" in (r.reason or "")
    assert r.release() == (7,)
    assert not r.poll(100), "a terminal request does not end twice"


def test_stalled_sending_fails() -> None:
    r = SendRequest("a", [7], T, now=0)
    r.start_sending(now=0)
    r.posted("x")
    assert r.poll(2.0)
    assert r.phase is SendPhase.FAILED and "no transfer progress" in (r.reason or "")
    assert not r.releasable, "in-flight transfer still reads the blocks"
    r.settled("x", now=2.1)
    assert r.release() == (7,)


def test_abort_waits_for_inflight_then_drain_deadline() -> None:
    r = SendRequest("a", [1], T, now=0)
    r.start_sending(now=0)
    r.posted("x")
    assert r.abort("client went away", now=1)
    assert not r.abort("again", now=1.1), "only the first ending counts"
    assert r.phase is SendPhase.ABORTED and r.reason == "client went away"
    with pytest.raises(StateError, match="in flight"):
        r.release()
    assert not r.poll(3.9)
    assert r.poll(4.0), "drain deadline (abort_ack_s) abandons the transfer"
    assert r.releasable and r.release() == (1,)


def test_illegal_send_transitions() -> None:
    r = SendRequest("a", [1], T, now=0)
    with pytest.raises(StateError, match="finish"):
        r.finish(now=0)
    with pytest.raises(StateError, match="while held"):
        r.release()
    r.start_sending(now=0)
    with pytest.raises(StateError, match="cannot go from sending to sending"):
        r.start_sending(now=0)
    r.posted("x")
    with pytest.raises(StateError, match="posted twice"):
        r.posted("x")
    r.settled("x", now=0)
    r.finish(now=0)
    with pytest.raises(StateError, match="after the request ended"):
        r.posted("y")
    with pytest.raises(StateError, match="after the request ended"):
        r.hold([9])


def test_recv_happy_path_and_deadlines() -> None:
    r = RecvRequest("b", [4, 5], T, now=0)
    # receive_s: may wait for staging room
    assert r.phase is RecvPhase.ALLOCATED and r.deadline == 20
    r.destination_sent(now=0.5)
    assert r.deadline == 20.5
    r.layer_arrived(now=3)
    assert r.phase is RecvPhase.RECEIVING and r.deadline == 5
    r.layer_arrived(now=4)
    assert r.layers_arrived == 2 and r.deadline == 6
    assert r.complete(now=4.5)
    assert r.phase is RecvPhase.RECEIVED and r.release() == (4, 5)


def test_data_arriving_before_the_destination_s_reply_counts_as_receiving() -> None:
    """A source may write as soon as it has the destination, before its reply reaches
    the decode side: the request is receiving from then on, not waiting."""
    r = RecvRequest("b", [4, 5], T, now=0)
    r.layer_arrived(now=1)
    assert r.phase is RecvPhase.ALLOCATED
    r.destination_sent(now=1.5)
    assert r.phase is RecvPhase.RECEIVING and r.deadline == 3.5  # transfer_s from now


@pytest.mark.parametrize(
    ("steps", "at", "why"),
    [
        ([], 20.0, "sending the destination"),
        (["sent"], 20.0, "the first KV data"),
        (["sent", "layer"], 3.0, "the next KV data"),
    ],
)
def test_recv_times_out_in_every_waiting_phase(steps: list[str], at: float, why: str) -> None:
    r = RecvRequest("b", [1], T, now=0)
    if "sent" in steps:
        r.destination_sent(now=0)
    if "layer" in steps:
        r.layer_arrived(now=1)
    assert not r.poll(at - 0.01)
    assert r.poll(at)
    assert r.phase is RecvPhase.FAILED and why in (r.reason or "")
    assert r.release() == (1,)


def test_late_data_for_failed_request_is_ignored() -> None:
    r = RecvRequest("b", [1], T, now=0)
    r.fail("peer died", now=0)
    r.layer_arrived(now=1)
    assert r.phase is RecvPhase.FAILED and r.layers_arrived == 0
    assert not r.complete(now=1)


def test_table_polls_and_pops_releasable() -> None:
    table: RequestTable[SendRequest] = RequestTable()
    a = table.add(SendRequest("a", [1], T, now=0))
    b = table.add(SendRequest("b", [2], T, now=5))
    with pytest.raises(StateError, match="already tracked"):
        table.add(SendRequest("a", [3], T, now=0))
    assert table.poll(10) == [a]
    assert [r.transfer_id for r in table.pop_releasable()] == ["a"]
    assert "a" not in table and "b" in table and len(table) == 1
    assert table.pop_releasable() == []
    assert table.poll(15) == [b]
    assert table.pop_releasable() == [b] and len(table) == 0


def test_ended_transfers_are_remembered_up_to_a_bound() -> None:
    ended = EndedTransfers(size=2)
    ended.add("a", "aborted: client gone")
    ended.add("b")
    ended.add("a", "aborted: again")  # "a" is the newest now, "b" the oldest
    ended.add("c", "done")
    assert "b" not in ended and ended.get("b") is None
    assert ended.get("a") == "aborted: again" and ended.get("c") == "done"
