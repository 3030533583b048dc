"""The peer table both engines' ranks keep (:mod:`kvbridge.runtime.peers`): bounded,
a restart replaces its seat's old peer, dropped peers leave the transport."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from kvbridge.errors import IncompatiblePeerError
from kvbridge.runtime.peers import PeerTable


@dataclass(frozen=True)
class _Peer:
    agent: str


class _Transport:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_peer(self, agent: str) -> None:
        self.removed.append(agent)


def _table(limit: int = 3) -> tuple[PeerTable[str, _Peer], _Transport, Counter[str]]:
    transport, counted = _Transport(), Counter()
    return PeerTable(transport, counted.update, limit=limit), transport, counted


def test_a_new_peer_in_a_kept_seat_replaces_the_old_one_and_only_it() -> None:
    table, transport, counted = _table()
    assert table.put("a1", "seat-a", _Peer("a1")) == []
    assert table.put("b1", "seat-b", _Peer("b1")) == []
    gone = table.put("a2", "seat-a", _Peer("a2"))  # a restart of a
    assert gone == [_Peer("a1")] and sorted(table) == ["a2", "b1"]
    assert transport.removed == [], "the caller retires what put dropped, outside its locks"
    table.retire(gone)
    assert transport.removed == ["a1"]
    assert table.put("a2", "seat-a", _Peer("a2")) == [], "the same peer again replaces nothing"
    assert (counted["peers_registered"], counted["peers_replaced"]) == (3, 1)


def test_peers_without_a_seat_replace_nothing_and_also_names_a_replacement() -> None:
    table, _, counted = _table()
    table.put("x", None, _Peer("x"))
    table.put("y", None, _Peer("y"))
    assert sorted(table) == ["x", "y"]
    assert table.put("z", None, _Peer("z"), also=["x", "unknown"]) == [_Peer("x")]
    assert sorted(table) == ["y", "z"]
    assert counted["peers_replaced"] == 1


def test_the_bound_refuses_a_new_peer_but_not_a_known_one_or_a_restart() -> None:
    table, _, _ = _table(limit=2)
    table.put("a1", "seat-a", _Peer("a1"))
    table.put("b1", "seat-b", _Peer("b1"))
    assert table.full_for("c1", "seat-c")
    assert table.full_for("c1", None)
    assert not table.full_for("a1", "seat-a"), "a known peer"
    assert not table.full_for("a2", "seat-a"), "a restart takes its old seat"


def test_drop_removes_the_peer_from_the_transport_once() -> None:
    table, transport, _ = _table()
    table.put("a", "s", _Peer("agent-a"))
    assert table.drop("a") == _Peer("agent-a")
    assert table.drop("a") is None
    assert transport.removed == ["agent-a"] and len(table) == 0 and "a" not in table


def test_a_peer_whose_metadata_names_a_kept_peer_s_agent_is_refused() -> None:
    table, _, _ = _table()
    table.put(("engine-a", 0, "e1"), ("engine-a", 0), _Peer("agent-a"))
    with pytest.raises(IncompatiblePeerError, match=r"agent 'agent-a'.*engine-a/0/e1.*secret"):
        table.check_agent(("engine-b", 0, "e2"), "agent-a", "engine-b#e2/r0")
    table.check_agent(("engine-a", 0, "e1"), "agent-a", "engine-a#e1/r0")  # its own, again
    table.check_agent(("engine-b", 0, "e2"), "agent-b", "engine-b#e2/r0")  # a new agent
