"""Bootstrap rooms shared by several requests: SGLang's parallel sampling, and what
kvbridge's SGLang sender and receiver do when a second request arrives on a room that
another one holds.

SGLang keys every piece of a transfer by its bootstrap room (the manager's status
table, the decode's destinations, failure reasons, abort acknowledgements), so a room
can carry one request at a time on each server. SGLang 0.5.23 breaks that with
parallel sampling in disaggregated mode: the tokenizer manager sends a prefix primer
and then each of the ``n`` samples under the request's one room, on both servers.
With SGLang's own backends such a request hangs until the timeouts (measured: no
answer in 120 s).

*Lanes* (:mod:`.lanes`): each server creates the endpoints of a room in the same
order (the primer, then the samples, as its tokenizer sends them; every attention TP
rank alike), so the ``k``-th sender of a room on the prefill and the ``k``-th receiver
of that room on the decode are partners. kvbridge gives the ``k``-th endpoint of room
``R`` its own room id, :func:`.lanes.lane_room` ``(R, k)`` (``R`` itself for the first, so a
request with ``n = 1`` keeps its room), under which SGLang's tables and kvbridge's
messages keep it apart from the other samples. Every sample has the same prompt, so
whichever prefill sample a decode sample pairs with gives it the same KV and a first
token sampled from the same distribution. This relies on rooms being unique per
request (SGLang's router draws a random 63-bit room for each), as SGLang itself does,
and, with SGLang's data parallelism, on each server handing all requests of a room to
one DP rank (its ``follow_bootstrap_room`` balancing; not run here).

Should a lane's room be held by another endpoint still (only if two requests share a
room, against that rule), kvbridge makes the second fail at once, on either side,
naming the cause. It never holds the room: its ``clear`` and ``abort`` touch none of
the room's state and its ``failure_exception`` raises its own reason. The holder fails
too, with the same reason, unless its transfer already succeeded: its partner on the
other side cannot tell which request it pairs with. On the decode, SGLang then
releases the holder's pages only after the prefill acknowledged the abort (deferred
release), so no write lands in reused pages. Each holder's :attr:`SoleHolder.nonce`
keeps an earlier request's destination and ``Done`` from reaching a later holder of
the same room.

Who calls: :class:`~.prefill.KVBridgeKVSender` and :class:`~.decode.KVBridgeKVReceiver`
(SGLang's scheduler thread), at construction and from SGLang's calls.
"""

from __future__ import annotations

import itertools
import logging

from kvbridge.adapters.sglang import compat

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll
_nonces = itertools.count(1)


def duplicate_reason(room: int, side: str) -> str:
    return (
        f"kvbridge: bootstrap room {room} already carries another request on this {side}: "
        "a room pairs the requests of one prompt (its samples one by one); give every "
        "request its own bootstrap room (SGLang's router draws a random one)"
    )


class SoleHolder:
    """Mixed into kvbridge's sender and receiver, before SGLang's class. The subclass
    takes its lane's room id (:class:`.lanes.RoomLanes`; ``bootstrap_room`` is that id
    from then on), calls :meth:`_holder` before SGLang's ``__init__`` and
    :meth:`_hold_or_refuse` after it, and :meth:`_clear_once` then :meth:`_let_go`
    from ``clear`` (the sender from ``abort`` too; a receiver holds its room through an
    abort until SGLang first clears it).

    Holders are kept in the manager's ``room_holders`` (a weak mapping: an endpoint
    SGLang drops without clearing lets go too). SGLang's status table does not tell:
    a decode's destination can create a room's status before the prefill's request
    arrives."""

    duplicate: str | None = None
    """Why this endpoint was refused as a second request on its room (None: it holds
    the room, or failed otherwise)."""

    nonce: int | None = None
    """Set when this endpoint becomes its room's holder, unique in this process: a
    decode names it in its destination and the prefill's ``Done`` echoes it, so a
    ``Done`` meant for an earlier request of the room is told apart
    (:meth:`.decode.DecodeSide._meant_for_holder`)."""

    _cleared: bool = False

    @staticmethod
    def _holder(mgr, room) -> SoleHolder | None:
        """The endpoint of ``mgr`` holding ``room`` now, if any."""
        return None if room is None else mgr.room_holders.get(room)

    def _hold_or_refuse(self, holder: SoleHolder | None, side: str) -> str | None:
        """Hold this endpoint's room, or, when ``holder`` (read before SGLang's
        ``__init__``) holds it, fail this endpoint and the holder unless the holder's
        transfer succeeded. The reason, or None when it holds. An endpoint SGLang
        failed in its ``__init__`` neither holds nor is refused."""
        room, mgr = self.bootstrap_room, self.kv_mgr
        if self.conclude_state is not None or room is None:
            return None
        if holder is None:
            mgr.room_holders[room] = self
            self.nonce = next(_nonces)
            mgr.transport.wake()  # the room's KV and notifications are to come
            return None
        reason = duplicate_reason(room, side)
        self.duplicate = reason
        self._owns_bootstrap_room = False  # SGLang's own flag: its clear/abort skip the room
        self.conclude_state = KVPoll.Failed
        if not mgr.room_status.concluded(room):
            self._fail_holder(reason)
        log.warning("%s", reason)
        return reason

    def _fail_holder(self, reason: str) -> None:
        self.kv_mgr.room_status.mark_failed(self.bootstrap_room, reason)

    def _clear_once(self) -> bool:
        """True at an endpoint's first ``clear`` (the caller clears it), False after.

        SGLang clears a failed decode receiver twice: in ``failure_exception`` and
        again when it releases the request's pages, which after a deferred release
        comes later (once the prefill acknowledged the abort). The first clear lets go
        of the room, so by the second another request may hold it; SGLang's clear pops
        the room's status and response trackers, which are then that request's, and
        its next poll raised in SGLang's scheduler (``KeyError`` in ``check_status``),
        killing the decode. SGLang's own ``prefill_complete`` policy makes clear
        one-shot the same way (``_owns_bootstrap_room``)."""
        if self._cleared:
            return False
        self._cleared = True
        return True

    def _let_go(self) -> None:
        holders = self.kv_mgr.room_holders
        if holders.get(self.bootstrap_room) is self:
            del holders[self.bootstrap_room]

    def failure_exception(self):
        if self.duplicate is None:
            return super().failure_exception()
        # SGLang's pops the room's failure record, which is the holder's
        raise _c.KVTransferError(self.bootstrap_room, self.duplicate)


__all__ = ["SoleHolder", "duplicate_reason"]
