"""Who may act on an SGLang room (issue 46, requirements 2 and 3), on the prefill's and
the decode's own handlers with SGLang's status table stood in (no servers; runs in
.venv-sglang):

- a destination must name the control socket its agent registered, and once a room has
  one, another decode server's destinations for it are dropped; an abort from anyone but
  the room's decode ranks is dropped; a ``Done`` only counts from the room's prefill;
- with a secret, every message to a control socket and every ``Done`` is bound to its
  receiver, a time stamp and (a ``Done``) its sender: a captured one is refused again,
  later, and at another instance.

Each test fails on the code before: the stranger's message was taken, the replay
accepted."""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from types import SimpleNamespace

import msgspec
import pytest

try:
    from kvbridge.adapters.sglang import compat
    from kvbridge.adapters.sglang.decode import DecodeSide
    from kvbridge.adapters.sglang.manager import KVBridgeKVManager
    from kvbridge.adapters.sglang.prefill import KVPoll, PrefillSide, _c
    from kvbridge.adapters.sglang.registrations import DecodePeer, PrefillRank, Registrations
    from kvbridge.wire import room_messages as wire
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.adapters.sglang.lifecycle import Tombstones
from kvbridge.errors import IncompatiblePeerError
from kvbridge.transports.base import Notification
from kvbridge.wire.auth import FRESH_S, ReplayGuard, stamp

ROOM = 2**62 + 7
SECRET = b"shared"
PREFILL_AT = "tcp://10.0.0.1:7000"


_RANK = PrefillRank(
    transport="nixl", wire_dtype="exact", data_path="direct", compat=None, page_size=16,
    geometry=None, aux_layout=None,
)  # fmt: skip
"""The prefill rank registrations would be checked against (these tests never get there)."""


class _Prefill(PrefillSide):
    """A prefill rank's handlers over stand-ins for SGLang's manager state."""

    def __init__(self, secret: bytes | None = None, at: str = PREFILL_AT) -> None:
        self.secret, self.control_endpoint, self.replays = secret, at, ReplayGuard()
        self.added: list[wire.Registration] = []
        self.registrations = Registrations(_RANK, None, self._count, lambda *a: None)
        self.registrations.register = self.added.append  # what reaches it, recorded
        self.peers = self.registrations.peers  # as PrefillSide._init_prefill
        self.transfer_infos: dict[int, dict] = {}
        self.tombstones = Tombstones()
        self.packed = self.state_layout = self.deferred_bootstrap = None
        self.request_status: dict[int, KVPoll] = {ROOM: KVPoll.Bootstrapping}
        self.failure_records: dict[int, str] = {}
        self.room_status = compat.RoomStatus(self)  # as KVBridgeKVManager makes them
        self.destinations = compat.RoomDestinations(self)
        self.sent: list[dict] = []
        self.refused = 0
        self.enable_deferred_decode_kv_release = False
        self._staging_outstanding: dict[int, int] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.room_holders = weakref.WeakValueDictionary()  # room -> its sender
        self.epoch = "e"
        self.config = SimpleNamespace(timeouts=SimpleNamespace(lease_s=60.0))
        self.admission = self._new_admission()  # as PrefillSide._init_prefill makes it

    _authentic = KVBridgeKVManager._authentic

    def send_kv_status_message(self, **kw) -> None:
        self.sent.append(kw)

    def check_status(self, room: int) -> KVPoll:
        return self.request_status[room]

    def update_status(self, room: int, status: KVPoll) -> None:
        self.request_status[room] = status

    def record_failure(self, room: int, reason: str) -> None:
        self.failure_records[room] = reason

    def resolve_kv_replica_factor(self, infos) -> None:
        pass

    def _count(self, **fields) -> None:
        self.refused += fields.get("messages_refused", 0)


def _peer(agent: str, control: tuple[str, int], seat: str) -> DecodePeer:
    # the buffers are never posted to in these tests: no descriptor tables
    return DecodePeer(
        agent=agent,
        kv=None,
        aux=None,
        geometry=None,
        aux_layout=None,
        aux_count=1,
        seat=seat,
        control=control,
    )


def _destination(agent: str, ip: str, port: int, **kw) -> wire.Destination:
    return wire.Destination(
        room=ROOM,
        agent=agent,
        ip=ip,
        port=port,
        pages=wire.encode_pages([1, 2]),
        aux_index=0,
        required_dst_info_num=kw.pop("required", 1),
        **kw,
    )


@pytest.fixture
def prefill() -> _Prefill:
    p = _Prefill()
    p.peers.put(
        "d0",
        "10.0.0.2:30000 dp0.0 tp0 pp0",
        _peer("d0", ("10.0.0.2", 5000), "10.0.0.2:30000 dp0.0 tp0 pp0"),
    )
    p.peers.put(
        "d1",
        "10.0.0.2:30000 dp0.0 tp1 pp0",
        _peer("d1", ("10.0.0.2", 5001), "10.0.0.2:30000 dp0.0 tp1 pp0"),
    )
    p.peers.put(
        "e0",
        "10.0.0.9:30000 dp0.0 tp0 pp0",
        _peer("e0", ("10.0.0.9", 6000), "10.0.0.9:30000 dp0.0 tp0 pp0"),
    )
    return p


def test_a_destination_must_name_its_agent_s_control_socket(prefill) -> None:
    """Else the room's statuses would go to whoever sent it, and its KV to the agent's
    pages the sender chose."""
    prefill._prefill_handle(wire.encode(_destination("d0", "10.0.0.66", 5000)))
    assert prefill.transfer_infos == {} and prefill.refused == 1
    assert prefill.request_status[ROOM] == KVPoll.Bootstrapping, "the room is untouched"
    prefill._prefill_handle(wire.encode(_destination("d0", "10.0.0.2", 5000)))
    assert set(prefill.transfer_infos[ROOM]) == {"d0"}
    assert prefill.request_status[ROOM] == KVPoll.WaitingForInput


def test_a_room_s_destinations_come_from_one_decode_server(prefill) -> None:
    prefill._prefill_handle(wire.encode(_destination("d0", "10.0.0.2", 5000, required=2)))
    # another decode server (a mistaken or stale one, or a stranger) cannot join the room
    prefill._prefill_handle(wire.encode(_destination("e0", "10.0.0.9", 6000, required=2)))
    assert set(prefill.transfer_infos[ROOM]) == {"d0"} and prefill.refused == 1
    prefill._prefill_handle(wire.encode(_destination("d1", "10.0.0.2", 5001, required=2)))
    assert set(prefill.transfer_infos[ROOM]) == {"d0", "d1"}
    assert prefill.request_status[ROOM] == KVPoll.WaitingForInput


def _abort(ip: str, port: int) -> list[bytes]:
    return _c.AbortNotification(room=ROOM, decode_ip=ip, decode_port=port).to_zmq()


def test_only_the_room_s_decode_ranks_abort_it(prefill) -> None:
    prefill._prefill_handle(wire.encode(_destination("d0", "10.0.0.2", 5000)))
    prefill._prefill_handle(_abort("10.0.0.9", 6000))  # another decode server's rank
    assert prefill.request_status[ROOM] == KVPoll.WaitingForInput and prefill.refused == 1
    prefill._prefill_handle(_abort("10.0.0.2", 5000))
    assert prefill.request_status[ROOM] == KVPoll.Failed
    assert "abort" in prefill.failure_records[ROOM]


def test_with_a_secret_a_captured_control_message_is_refused_again_later_and_elsewhere() -> None:
    prefill, other = _Prefill(SECRET), _Prefill(SECRET, at="tcp://10.0.0.3:7000")
    dest = wire.encode(_destination("d0", "10.0.0.2", 5000, is_dummy=True))
    captured = wire.sign(dest, SECRET, PREFILL_AT)
    prefill._prefill_handle(captured)
    assert set(prefill.transfer_infos[ROOM]) == {"d0"}, "authentic: taken"
    prefill.transfer_infos.clear()
    prefill._prefill_handle(captured)  # again
    other._prefill_handle(captured)  # at another prefill with the same secret
    stale = wire.sign(dest, SECRET, PREFILL_AT, when=stamp(time.time() - 2 * FRESH_S))
    prefill._prefill_handle(stale)
    assert prefill.transfer_infos == {} and other.transfer_infos == {}
    assert (prefill.refused, other.refused) == (2, 1)
    assert prefill.request_status[ROOM] == KVPoll.WaitingForInput, "a replay fails no room"
    # SGLang's own frames too: an unsigned abort is refused, a signed one taken
    prefill._prefill_handle(_abort("10.0.0.2", 5000))
    assert prefill.request_status[ROOM] == KVPoll.WaitingForInput
    signed = wire.sign(_abort("10.0.0.2", 5000), SECRET, PREFILL_AT)
    prefill._prefill_handle(signed)
    assert prefill.request_status[ROOM] == KVPoll.Failed


class _Decode(DecodeSide):
    """A decode rank's notification handler over stand-ins."""

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret, self.note_replays = secret, ReplayGuard()
        self.transport = SimpleNamespace(agent_name="d0")
        self.packed = None
        self.room_holders = weakref.WeakValueDictionary()
        self.applied: list[int] = []

    def apply_prefill_status(self, *, bootstrap_room, status, prefill_rank, **kw) -> None:
        self.applied.append(bootstrap_room)

    def _count(self, **fields) -> None:
        pass


class _Holder:
    nonce = None

    def __init__(self, agents: list[str]) -> None:
        self.bootstrap_infos = [{"rank_ip": "x", "kvbridge_agent": a} for a in agents]


DONE = wire.Done(room=ROOM, prefill_rank=0, epoch="e", pages=2)


def test_a_done_counts_only_from_the_room_s_prefill() -> None:
    decode = _Decode()
    holder = _Holder(["p0"])
    decode.room_holders[ROOM] = holder
    with pytest.raises(wire.WireError, match="not one of the room's prefill ranks"):
        decode._on_note(Notification("stranger", wire.encode_payload(DONE)))
    assert decode.applied == []
    decode._on_note(Notification("p0", wire.encode_payload(DONE)))
    assert decode.applied == [ROOM]


def test_with_a_secret_a_captured_done_is_refused_again_and_as_from_another_sender() -> None:
    decode = _Decode(SECRET)
    holder = _Holder(["p0", "p1"])
    decode.room_holders[ROOM] = holder
    payload = wire.encode_payload(DONE, SECRET, sender="p0", receiver="d0")
    with pytest.raises(wire.AuthenticationError):
        decode._on_note(Notification("p1", payload))  # relayed as from another source
    decode._on_note(Notification("p0", payload))
    with pytest.raises(wire.AuthenticationError, match="replayed"):
        decode._on_note(Notification("p0", payload))
    other = _Decode(SECRET)
    other.transport.agent_name = "d9"
    other.room_holders[ROOM] = holder
    with pytest.raises(wire.AuthenticationError):
        other._on_note(Notification("p0", payload))  # sealed for d0
    assert decode.applied == [ROOM] and other.applied == []


def _reg(agent: str, seat: str, geometry, aux) -> SimpleNamespace:
    return SimpleNamespace(
        agent=agent, seat=seat, geometry=geometry, aux=aux, states=None, window=None
    )


def test_registrations_beyond_the_peer_bound_are_refused(monkeypatch) -> None:
    """A registration's tables (pages and metadata rows, 6 + 2 here) are built when it
    is added: its claim and the number of peers are bounded first."""
    from kvbridge.adapters.sglang import registrations as registrations_module

    p = _Prefill().registrations
    monkeypatch.setattr(p.peers, "limit", 2)
    p.peers.put("d0", "s0", _peer("d0", ("10.0.0.2", 5000), "s0"))
    p.peers.put("d1", "s1", _peer("d1", ("10.0.0.2", 5001), "s1"))
    geometry = SimpleNamespace(num_slots=6)
    aux = SimpleNamespace(ptrs=(1,), rows=2)
    with pytest.raises(IncompatiblePeerError, match="already has 2 decode peers"):
        p.admit(_reg("d2", "s2", geometry, aux))
    p.admit(_reg("d3", "s1", geometry, aux))  # restarted
    monkeypatch.setattr(registrations_module, "MAX_PEER_SLOTS", 7)
    with pytest.raises(IncompatiblePeerError, match="claims a cache of 8 slots"):
        p.admit(_reg("d0", "s0", geometry, aux))


def test_destinations_for_rooms_without_a_request_are_bounded_and_expire(
    prefill, monkeypatch
) -> None:
    """A destination may come before the prefill's request; such rooms were kept with no
    bound and no end (a stranger's destinations for made-up rooms, or a room whose
    request never reached this prefill)."""
    from kvbridge.adapters.sglang import admission as admission_module

    monkeypatch.setattr(admission_module, "MAX_EARLY_ROOMS", 2)
    for room in (1, 2):
        dest = msgspec.structs.replace(_destination("d0", "10.0.0.2", 5000), room=room)
        prefill._prefill_handle(wire.encode(dest))
    assert set(prefill.transfer_infos) == {1, 2} and len(prefill.admission.early) == 2
    third = msgspec.structs.replace(_destination("d0", "10.0.0.2", 5000), room=3)
    prefill._prefill_handle(wire.encode(third))
    assert 3 not in prefill.transfer_infos
    assert prefill.sent[-1]["status"] == KVPoll.Failed, "the decode is told at once"
    assert "rooms it has no request for yet" in prefill.sent[-1]["failure_reason"]
    sender = _Holder([])  # any object a weak reference reaches
    prefill.room_holders[1] = sender  # room 1's request arrived
    fourth = msgspec.structs.replace(third, room=4)
    prefill._prefill_handle(wire.encode(fourth))
    assert set(prefill.admission.early) == {2, 4}
    prefill.admission.lease_s = 0.0  # their time has come: dropped with the next one
    prefill.admission.early = OrderedDict((r, 0.0) for r in prefill.admission.early)
    prefill._prefill_handle(wire.encode(msgspec.structs.replace(third, room=5)))
    assert set(prefill.transfer_infos) == {1, 5}, "room 1 has its request: kept"
    assert set(prefill.request_status) == {ROOM, 1, 5}, "and so is SGLang's status of it"


def test_the_bounded_state_of_a_prefill_rank_reaches_its_gauges() -> None:
    """``peers``, ``replay_entries`` and ``early_rooms`` on SGLang's ``/metrics`` (with
    ``--enable-metrics``), as the transfer thread sets them every loop."""
    from prometheus_client import CollectorRegistry

    from kvbridge.adapters.sglang.metrics import PrometheusExport

    registry = CollectorRegistry()
    labels = {"engine_type": "prefill", "tp_rank": "0", "transport": "nixl"}
    p = _Prefill(SECRET)
    p._metrics = PrometheusExport(labels, registry=registry)
    p.note_replays = ReplayGuard()
    p.peers.put("d0", "s0", _peer("d0", ("10.0.0.2", 5000), "s0"))
    p._prefill_handle(
        wire.sign(wire.encode(_destination("d0", "10.0.0.2", 5000)), SECRET, PREFILL_AT)
    )
    p._prefill_handle(
        wire.sign(
            wire.encode(msgspec.structs.replace(_destination("d0", "10.0.0.2", 5000), room=3)),
            SECRET,
            PREFILL_AT,
        )
    )
    KVBridgeKVManager._report_limits(p)
    value = lambda name: registry.get_sample_value(f"sglang:kvbridge_{name}", labels)  # noqa: E731
    assert (value("peers"), value("replay_entries"), value("early_rooms")) == (1, 2, 2)
