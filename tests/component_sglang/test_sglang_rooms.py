"""Bootstrap rooms (``adapters/sglang/rooms.py``): the holder bookkeeping of kvbridge's
sender and receiver, on an endpoint that does what SGLang's
``CommonKVSender/Receiver.__init__`` and ``clear`` do to the manager's status table.
The real servers' behaviour (``n > 1`` requests answered through lanes, in bursts too)
is in ``test_sglang_failures.py``, the lanes' unit tests in
``tests/unit/test_sglang_adapter.py``. Runs in .venv-sglang (``rooms`` imports
SGLang's classes)."""

from __future__ import annotations

import gc
import logging
import weakref
from types import MethodType, SimpleNamespace

import pytest

try:
    from kvbridge.adapters.sglang import compat
    from kvbridge.adapters.sglang.rooms import KVPoll, SoleHolder, _c
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

ROOM = 12345


class Manager:
    """The parts of SGLang's ``CommonKVManager`` that ``rooms`` uses."""

    def __init__(self) -> None:
        self.request_status: dict[int, KVPoll] = {}
        self.failure_records: dict[int, str] = {}
        self.room_holders = weakref.WeakValueDictionary()
        self.room_status = compat.RoomStatus(self)  # as KVBridgeKVManager makes them
        self.destinations = compat.RoomDestinations(self)
        self.wakes = 0
        self.transport = SimpleNamespace(wake=self._wake)  # kvbridge's, told of each room

    def _wake(self) -> None:
        self.wakes += 1

    def record_failure(self, room: int, reason: str) -> None:
        self.failure_records[room] = reason

    def update_status(self, room: int, status: KVPoll) -> None:
        self.request_status[room] = (
            status
            if status == KVPoll.Failed
            else max(self.request_status.get(room, status), status)
        )


class SGLangEndpoint:
    """What SGLang's endpoint does to the room (early allocation policy)."""

    def __init__(self, mgr: Manager, room: int) -> None:
        self.kv_mgr, self.bootstrap_room = mgr, room
        self.conclude_state = None
        self._owns_bootstrap_room = True
        mgr.update_status(room, KVPoll.Bootstrapping)

    def clear(self) -> None:
        if self._owns_bootstrap_room:
            self.kv_mgr.request_status.pop(self.bootstrap_room, None)

    def failure_exception(self):
        raise _c.KVTransferError(
            self.bootstrap_room, self.kv_mgr.failure_records.pop(self.bootstrap_room, "unknown")
        )


class Endpoint(SoleHolder, SGLangEndpoint):
    """kvbridge's pattern (``decode.KVBridgeKVReceiver``)."""

    def __init__(self, mgr: Manager, room: int) -> None:
        holder = self._holder(mgr, room)
        super().__init__(mgr, room)
        self.refused = self._hold_or_refuse(holder, "decode")

    def clear(self) -> None:
        if not self._clear_once():
            return
        self._let_go()
        super().clear()


def test_a_second_request_on_a_held_room_fails_and_so_does_the_holder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mgr = Manager()
    first = Endpoint(mgr, ROOM)
    assert first.refused is None and mgr.room_holders[ROOM] is first
    assert mgr.wakes == 1, "a room that holds wakes the transport's pump"
    with caplog.at_level(logging.WARNING):
        second = Endpoint(mgr, ROOM)
    assert (
        second.refused is not None
        and "give every request its own bootstrap room" in second.refused
        and "on this decode" in second.refused
    )
    assert second.refused in caplog.text
    assert second.conclude_state == KVPoll.Failed and not second._owns_bootstrap_room
    assert mgr.request_status[ROOM] == KVPoll.Failed  # the holder polls Failed ...
    assert mgr.failure_records[ROOM] == second.refused  # ... with the same reason
    with pytest.raises(_c.KVTransferError, match="its own bootstrap room"):
        second.failure_exception()
    assert ROOM in mgr.failure_records  # the holder's record stays for the holder
    second.clear()
    assert mgr.request_status[ROOM] == KVPoll.Failed and mgr.room_holders[ROOM] is first
    with pytest.raises(_c.KVTransferError, match="its own bootstrap room"):
        first.failure_exception()
    first.clear()
    assert ROOM not in mgr.request_status and ROOM not in mgr.room_holders


def test_a_holder_whose_transfer_succeeded_is_left_alone() -> None:
    mgr = Manager()
    first = Endpoint(mgr, ROOM)
    mgr.update_status(ROOM, KVPoll.Success)
    second = Endpoint(mgr, ROOM)
    assert second.refused is not None and second.conclude_state == KVPoll.Failed
    assert mgr.request_status[ROOM] == KVPoll.Success and ROOM not in mgr.failure_records
    assert mgr.room_holders[ROOM] is first


def test_a_room_can_be_used_again_once_its_holder_is_cleared() -> None:
    """SGLang's prefix primer and then a sample: one after the other on one room."""
    mgr = Manager()
    primer = Endpoint(mgr, ROOM)
    mgr.update_status(ROOM, KVPoll.Success)
    primer.clear()
    sample = Endpoint(mgr, ROOM)
    assert sample.refused is None and mgr.room_holders[ROOM] is sample


def test_a_status_made_before_the_request_is_not_a_holder() -> None:
    """A decode's destination can create a room's status on the prefill before the
    prefill's own request arrives."""
    mgr = Manager()
    mgr.update_status(ROOM, KVPoll.WaitingForInput)
    assert Endpoint(mgr, ROOM).refused is None


def test_an_endpoint_dropped_without_clear_lets_go() -> None:
    mgr = Manager()
    Endpoint(mgr, ROOM)  # nobody keeps it
    gc.collect()
    mgr.request_status.clear()
    assert ROOM not in mgr.room_holders
    assert Endpoint(mgr, ROOM).refused is None


def test_a_second_clear_leaves_the_rooms_next_holder_alone() -> None:
    """SGLang clears a failed receiver in ``failure_exception`` and again when it
    releases the pages (after a deferred release: later). In between another sample
    takes the room; the repeat clear must not pop that sample's status (its poll
    raised ``KeyError`` in SGLang's scheduler and killed the decode)."""
    mgr = Manager()
    failed = Endpoint(mgr, ROOM)
    mgr.update_status(ROOM, KVPoll.Failed)
    failed.clear()  # from failure_exception
    sample = Endpoint(mgr, ROOM)
    assert sample.refused is None and mgr.room_holders[ROOM] is sample
    failed.clear()  # the deferred release resolved
    assert mgr.request_status[ROOM] == KVPoll.Bootstrapping
    assert mgr.room_holders[ROOM] is sample
    sample.clear()
    assert ROOM not in mgr.request_status and ROOM not in mgr.room_holders


def test_a_done_for_an_earlier_request_of_the_room_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each holder of a room gets its own nonce; the decode names it in its destination
    and the prefill's ``Done`` echoes it. A ``Done`` naming a failed, cleared request of
    the room reaches neither SGLang's status table nor the packed path's unpack once
    another sample holds the room (``DecodeSide._meant_for_holder``)."""
    from kvbridge.adapters.sglang.decode import DecodeSide
    from kvbridge.wire import room_messages as wire

    mgr = Manager()
    side = SimpleNamespace(room_holders=mgr.room_holders)
    side._holder_nonce = MethodType(DecodeSide._holder_nonce, side)

    def meant(nonce):
        done = wire.Done(room=ROOM, prefill_rank=0, epoch="e", nonce=nonce)
        return DecodeSide._meant_for_holder(side, done)

    failed = Endpoint(mgr, ROOM)
    mgr.update_status(ROOM, KVPoll.Failed)
    failed.clear()
    sample = Endpoint(mgr, ROOM)
    assert None not in (failed.nonce, sample.nonce) and failed.nonce != sample.nonce
    assert meant(sample.nonce)
    with caplog.at_level(logging.WARNING):
        assert not meant(failed.nonce)
    assert "meant for an earlier request" in caplog.text
    assert meant(None)  # a prefill of an older kvbridge: not checked
    duplicate = Endpoint(mgr, ROOM)  # refused: no nonce, never sends a destination
    assert duplicate.refused is not None and duplicate.nonce is None
    sample.clear()
    assert not meant(sample.nonce)  # nobody holds the room


def test_a_destination_from_another_request_of_the_room_is_told_apart() -> None:
    """On the prefill: a sample's destination must not replace the one an earlier
    request of the room (same decode rank) still writes to; the prefill refuses it
    (``Admission.another_request_of``, used by ``Admission.destination``)."""
    import numpy as np

    from kvbridge.adapters.sglang.admission import Admission, DecodeDestination

    def dest(agent: str, nonce: int | None) -> DecodeDestination:
        return DecodeDestination(
            agent=agent,
            endpoint="127.0.0.1",
            dst_port=1,
            pages=np.array([1]),
            aux_index=0,
            required_dst_info_num=1,
            decode_prefix_len=None,
            is_dummy=False,
            nonce=nonce,
        )

    side = SimpleNamespace(transfer_infos={ROOM: {"d0": dest("d0", 1)}})
    admission = Admission(
        registrations=SimpleNamespace(peers={}, refused={}),
        destinations=compat.RoomDestinations(side),
        room_status=None,
        tombstones=None,
        holder=lambda room: None,
        send_status=None,
        count=None,
        epoch="e",
        packed=False,
        states=False,
        lease_s=60.0,
    )

    def another(d: DecodeDestination, room: int = ROOM) -> bool:
        return admission.another_request_of(room, d)

    assert another(dest("d0", 2))  # same decode rank, another request
    assert not another(dest("d0", 1))  # the same request again
    assert not another(dest("d1", 2))  # another decode rank (TP): its own destination
    assert not another(dest("d0", None))  # a decode of an older kvbridge: not compared
    assert not another(dest("d0", 2), room=ROOM + 1)  # no destination kept for the room
