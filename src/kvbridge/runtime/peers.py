"""The peers one rank keeps: bounded, each in a seat that a restart keeps.

Both engines keep a table of the peers a rank writes to or reads from, each with transport
descriptor tables prepared once: :class:`~kvbridge.runtime.node.Node` (vLLM, keyed by
engine id, rank and epoch; the seat is the engine id and rank) and the SGLang prefill
(keyed by the decode rank's transport agent; the seat is the decode rank's
``Registration.seat``). :class:`PeerTable` is what they share: the bound on peers
(:data:`MAX_PEERS`), admission, replacement of a restarted peer by its seat, and dropping a
peer with its transport peer (whose tables the transport releases).

Thread-safety: every method takes the table's lock; :meth:`retire` (which calls into the
transport) is to be called outside any lock of the caller's. Owner: one per rank, built by
the engine adapter's per-rank object (``Node``, the SGLang manager), closed with its
transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from kvbridge.errors import IncompatiblePeerError
from kvbridge.transports.base import Transport

MAX_PEERS = 1024
"""Peers one rank keeps (decode ranks of every decode instance that uses this prefill
rank, and the reverse); one more is refused, unless it takes the seat of one it replaces
(a restart)."""


class HasAgent(Protocol):
    @property
    def agent(self) -> str:
        """The peer's id at the transport (:meth:`Transport.add_peer`'s)."""
        ...


K = TypeVar("K", bound=Hashable)
P = TypeVar("P", bound=HasAgent)


class PeerTable(Generic[K, P]):
    """Peers by key, each in a seat (``None``: a peer no restart replaces).

    Args:
        transport: the rank's transport, whose peers :meth:`retire` removes.
        count: where registrations are counted: called as
            ``count(peers_registered=n, peers_replaced=m)`` by :meth:`put`
            (:meth:`kvbridge.runtime.stats.TransferStats.add`, or the adapter's own).
        limit: the most peers kept.
    """

    def __init__(
        self, transport: Transport, count: Callable[..., None], *, limit: int = MAX_PEERS
    ) -> None:
        self._transport = transport
        self._count = count
        self.limit = limit
        self._lock = threading.Lock()
        self._peers: dict[K, P] = {}
        self._seats: dict[K, Hashable] = {}

    # --- reading (any thread) ------------------------------------------------------------

    def get(self, key: K) -> P | None:
        with self._lock:
            return self._peers.get(key)

    def __getitem__(self, key: K) -> P:
        with self._lock:
            return self._peers[key]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._peers

    def __len__(self) -> int:
        """Peers kept (a level; any thread)."""
        with self._lock:
            return len(self._peers)

    def __iter__(self) -> Iterator[K]:
        """The keys, as of now (a copy)."""
        with self._lock:
            return iter(list(self._peers))

    def check_agent(self, key: K, agent: str, who: object) -> None:
        """Refuse peer ``key`` (``who``, for the message) whose transport metadata names
        ``agent`` when another kept peer holds that agent. Called before the transport
        sees the metadata: its ``add_peer`` would replace that peer (its tables
        released), and a later retirement of ``key`` would remove it. A restart brings a
        new agent (agents include the epoch), so no real peer takes another's.

        Raises:
            IncompatiblePeerError: naming both and the fix.
        """
        with self._lock:
            holder = next((k for k, p in self._peers.items() if p.agent == agent), key)
        if holder != key:
            raise IncompatiblePeerError(
                f"peer {who} sent the transport metadata of agent {agent!r}, which another "
                f"peer ({self._peers_name(holder)}) holds: refused",
                fix=(
                    "give each instance its own transport metadata; a peer that copies "
                    "another's is hostile: set a 'secret'"
                ),
            )

    @staticmethod
    def _peers_name(key: object) -> str:
        return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)

    # --- changing ------------------------------------------------------------------------

    def full_for(self, key: K, seat: Hashable | None) -> bool:
        """Whether a peer ``key`` in ``seat`` would exceed :attr:`limit`: it is new, and
        takes no seat a kept peer holds. Callers refuse it before building anything."""
        with self._lock:
            known = key in self._peers or (seat is not None and seat in self._seats.values())
            return not known and len(self._peers) >= self.limit

    def put(self, key: K, seat: Hashable | None, peer: P, *, also: Iterable[K] = ()) -> list[P]:
        """Keep ``peer`` as ``key`` (in place of a peer of the same key), dropping every
        other peer in its seat (a restart) and those keyed ``also`` (a caller's own reason
        for a replacement). Counts a new key and the replaced peers.

        Returns:
            The dropped peers, which the caller passes to :meth:`retire`.
        """
        with self._lock:
            new = key not in self._peers
            stale = [] if seat is None else [k for k, s in self._seats.items() if s == seat]
            stale = [k for k in stale if k != key]
            stale += [k for k in also if k != key and k in self._peers and k not in stale]
            gone = [self._pop(k) for k in stale]
            self._peers[key] = peer
            self._seats[key] = seat
        if new or gone:
            self._count(peers_registered=int(new), peers_replaced=len(gone))
        return gone

    def pop(self, key: K) -> P | None:
        """Forget peer ``key`` (None if unknown); the caller passes it to :meth:`retire`."""
        with self._lock:
            return self._pop(key) if key in self._peers else None

    def drop(self, key: K) -> P | None:
        """:meth:`pop` and :meth:`retire` peer ``key``; returns it (None if unknown)."""
        peer = self.pop(key)
        if peer is not None:
            self.retire([peer])
        return peer

    def retire(self, gone: Iterable[P]) -> None:
        """Remove dropped peers from the transport, which releases the tables prepared
        for them (outside any lock of the caller's: a transport may take its time)."""
        for peer in gone:
            self._transport.remove_peer(peer.agent)

    def _pop(self, key: K) -> P:
        del self._seats[key]
        return self._peers.pop(key)
