"""Which decode destinations and aborts one SGLang prefill rank acts on.

A decode rank sends a ``Destination`` per room (:mod:`kvbridge.wire.room_messages`)
to the prefill rank's control socket, and SGLang's abort frames arrive there too.
:class:`Admission` decides, before anything of the room changes, whether to keep the
destination (in SGLang's ``transfer_infos``, through :class:`.compat.RoomDestinations`),
answer it with the room's failure, refuse it (the room fails here and at the decode,
naming why), or drop it (a message that may not act on the room: logged and counted);
and whether an abort may fail its room. ``docs/user-guide/security.md`` says what these
checks promise.

Owner: the prefill side of the manager (:class:`~.prefill.PrefillSide`), one per rank,
built in its ``_init_prefill``. Thread: the rank's control thread only (the one writer
of destinations and of the early rooms); the transfer thread reads destinations through
:class:`.compat.RoomDestinations`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang.lifecycle import Tombstones
from kvbridge.adapters.sglang.registrations import Registrations
from kvbridge.adapters.sglang.rooms import duplicate_reason
from kvbridge.runtime.sender import MAX_EARLY_TRANSFERS as MAX_EARLY_ROOMS
from kvbridge.wire import room_messages as wire

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeDestination:
    """One decode rank's destination for a room (from a
    :class:`~kvbridge.wire.room_messages.Destination`), kept in SGLang's
    ``transfer_infos`` (through :class:`.compat.RoomDestinations`); SGLang's helpers
    read ``endpoint``, ``dst_port``, ``is_dummy`` and ``required_dst_info_num``."""

    agent: str
    endpoint: str
    dst_port: int
    pages: np.ndarray
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int | None
    is_dummy: bool
    staging_first: int | None = None
    window_pages: np.ndarray | None = None
    nonce: int | None = None
    state_row: int | None = None

    @classmethod
    def of(cls, msg: wire.Destination) -> DecodeDestination:
        return cls(
            agent=msg.agent,
            endpoint=msg.ip,
            dst_port=msg.port,
            pages=wire.decode_pages(msg.pages),
            aux_index=msg.aux_index,
            required_dst_info_num=msg.required_dst_info_num,
            decode_prefix_len=msg.decode_prefix_len,
            is_dummy=msg.is_dummy,
            staging_first=msg.staging_first,
            window_pages=None if msg.window_pages is None else wire.decode_pages(msg.window_pages),
            nonce=msg.nonce,
            state_row=msg.state_row,
        )


class Admission:
    """Destinations and aborts of one prefill rank (see the module).

    Args:
        registrations: the rank's registered and refused decode ranks.
        destinations: SGLang's ``transfer_infos`` by room.
        room_status: SGLang's status table, through the adapter's interface.
        tombstones: rooms this rank failed, with why.
        holder: the room's sender on this rank, or None (SGLang has no request for
            the room yet, or no longer).
        send_status: sends a status to decode control sockets (SGLang's
            ``send_kv_status_message``, keyword arguments).
        count: where refusals are counted (``messages_refused``).
        epoch: this rank's epoch (named when a decode registered with an earlier one).
        packed: whether this rank packs (a destination must name staging).
        states: whether this rank's pool has state-space layers (a destination must
            name a state slot).
        lease_s: how long a destination for a room without a request is kept.
    """

    def __init__(
        self,
        *,
        registrations: Registrations,
        destinations: compat.RoomDestinations,
        room_status: compat.RoomStatus,
        tombstones: Tombstones,
        holder: Callable[[int], object | None],
        send_status: Callable[..., None],
        count: Callable[..., None],
        epoch: str,
        packed: bool,
        states: bool,
        lease_s: float,
    ) -> None:
        self._registrations = registrations
        self._peers = registrations.peers
        self._destinations = destinations
        self._room_status = room_status
        self._tombstones = tombstones
        self._holder = holder
        self._send_status = send_status
        self._count = count
        self._epoch = epoch
        self._packed = packed
        self._states = states
        self.lease_s = lease_s
        """How long a destination for a room without a request is kept, seconds."""
        self.early: OrderedDict[int, float] = OrderedDict()
        """Rooms with a destination but no request here when it came -> when they are
        dropped (:meth:`keep_early`); bounded by :data:`MAX_EARLY_ROOMS`."""

    def destination(self, msg: wire.Destination) -> None:
        """Keep, answer, refuse or drop a decode rank's destination for its room."""
        room = msg.room
        dest = DecodeDestination.of(msg)
        failed = self._tombstones.reason(room)
        if failed is not None:
            self._send_status(
                targets=[(msg.ip, msg.port)],
                bootstrap_room=room,
                status=KVPoll.Failed,
                failure_reason=failed,
            )
            return
        if not self.allowed(msg):
            return
        reason = None
        refused = self._registrations.refused.get(msg.agent)
        if not msg.is_dummy and refused is not None:
            reason = f"kvbridge: this prefill refused decode {msg.agent}: {refused}"
        elif not msg.is_dummy and msg.agent not in self._peers:
            # A decode that registered with an earlier instance of this prefill.
            reason = (
                f"kvbridge: unknown decode peer {msg.agent} (this prefill restarted; epoch "
                f"{self._epoch})"
            )
        elif not msg.is_dummy and self._packed and msg.staging_first is None:
            reason = (
                "kvbridge: the decode's staging buffer had no room for this request (packed data "
                "path); raise staging_mb on the decode"
            )
        elif not msg.is_dummy and self._states and msg.state_row is None:
            reason = (
                "kvbridge: the decode named no state slot for this request's state-space layers "
                "(its log says why)"
            )
        elif self.another_request_of(room, dest):
            reason = duplicate_reason(room, "prefill")
        elif not self.keep_early(room):
            reason = (
                f"kvbridge: this prefill rank already keeps destinations for {MAX_EARLY_ROOMS} "
                "rooms it has no request for yet"
            )
        if reason is not None:
            self.refuse(msg, reason)
            return
        if self._destinations.add(room, msg.agent, dest, msg.required_dst_info_num):
            self._room_status.waiting_for_input(room)

    def allowed(self, msg: wire.Destination) -> bool:
        """Whether a destination may act on its room: it names the control socket its
        agent registered (statuses go there, not to whoever sent it), and the room's
        destinations so far came from the same decode server (the first one binds the
        room to its server). Otherwise it is dropped, logged and counted, and nothing of
        the room changes."""
        peer = self._peers.get(msg.agent)
        why = None
        if peer is not None and not msg.is_dummy and peer.control != (msg.ip, msg.port):
            why = (
                f"it names control socket {msg.ip}:{msg.port}, its agent registered "
                f"{peer.control[0]}:{peer.control[1]}"
            )
        elif peer is not None:
            owners = {
                self._peers[a].server
                for a in self._destinations.of(msg.room) or {}
                if a in self._peers and a != msg.agent
            }
            if owners and peer.server not in owners:
                why = f"the room belongs to decode server {', '.join(sorted(owners))}"
        if why is None:
            return True
        self._count(messages_refused=1)
        log.warning(
            "kvbridge: refused a destination for room %s from %s: %s", msg.room, msg.agent, why
        )
        return False

    def abort_allowed(self, frames: list[bytes]) -> bool:
        """Whether SGLang's abort frames may fail their room: once the room has
        destinations, only from one of their decode ranks (the abort names its control
        socket, SGLang 0.5.23 always does); before, it cannot be told (SGLang's own
        behaviour: the room's id is the secret). Otherwise dropped, logged and counted."""
        note = _c.AbortNotification.from_zmq(frames)
        if note is None:
            return True  # SGLang's handler drops it, logged
        dests = self._destinations.of(note.room)
        if not dests or (note.decode_ip, note.decode_port) in {
            (d.endpoint, d.dst_port) for d in dests.values()
        }:
            return True
        self._count(messages_refused=1)
        log.warning(
            "kvbridge: refused an abort of room %s from %s:%s, not one of the room's decode ranks",
            note.room,
            note.decode_ip,
            note.decode_port,
        )
        return False

    def keep_early(self, room: int) -> bool:
        """Whether a destination for ``room`` may be kept: always for a room this prefill
        has a request (a sender) for; for one it has not (yet: the decode may be first),
        within :data:`MAX_EARLY_ROOMS` such rooms, each dropped ``lease_s`` after its
        first destination unless a request took it by then, with the status SGLang
        opened for it (a destination makes its room wait for input)."""
        now = time.monotonic()
        early = self.early
        while early and next(iter(early.values())) <= now:
            old, _ = early.popitem(last=False)
            if self._holder(old) is None:
                self._destinations.forget(old)
                self._room_status.forget_waiting(old)
        if room in early or self._holder(room) is not None:
            return True
        if len(early) >= MAX_EARLY_ROOMS:  # forget those a request took meanwhile
            for taken in [r for r in early if self._holder(r) is not None]:
                del early[taken]
        if len(early) >= MAX_EARLY_ROOMS:
            return False
        early[room] = now + self.lease_s
        return True

    def another_request_of(self, room: int, dest: DecodeDestination) -> bool:
        """Whether this prefill still keeps a destination for ``room`` from the same
        decode rank but from another of its requests (their nonces differ): SGLang's
        parallel sampling sends every sample on one room, and a sample's destination
        must not replace the one an earlier request's writes and ``Done`` go to.
        Destinations without a nonce (older decodes) are not compared."""
        prior = self._destinations.get(room, dest.agent)
        if prior is None or None in (prior.nonce, dest.nonce):
            return False
        return prior.nonce != dest.nonce

    def refuse(self, msg: wire.Destination, reason: str) -> None:
        """Fail the room of a destination this prefill refuses: at the decode (a status
        to its control socket) and here too (SGLang's router waits for both answers):
        now, or, when its sender is not made yet, as it is (the tombstone)."""
        self._send_status(
            targets=[(msg.ip, msg.port)],
            bootstrap_room=msg.room,
            status=KVPoll.Failed,
            failure_reason=reason,
        )
        self._tombstones.add(msg.room, reason)
        self._room_status.fail(msg.room, reason)

    def refuse_unauthenticated(self, exc: wire.AuthenticationError) -> None:
        """A decode's message failed authentication (its ``secret`` differs from ours,
        or one side has none). Nothing in it is trusted or kept, with one exception so
        that a misconfigured pair fails at once naming the fix instead of at SGLang's
        timeouts: a destination fails the room it names (here and at the decode's
        address). Room ids are random 64-bit numbers the router draws, so a stranger
        cannot aim this at other requests."""
        msg = exc.unverified
        self._count(messages_refused=1)
        log.error(
            "kvbridge: refused a decode's %s: %s",
            type(msg).__name__ if msg is not None else "message",
            exc,
        )
        if isinstance(msg, wire.Destination) and not msg.is_dummy:
            self.refuse(msg, f"kvbridge: this prefill refused the decode's destination: {exc}")


__all__ = ["MAX_EARLY_ROOMS", "Admission", "DecodeDestination"]
