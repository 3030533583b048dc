"""Per-request state machines: who holds which blocks, until when.

One :class:`SendRequest` per request on the prefill side (P), one :class:`RecvRequest`
per request on the decode side (D). Pure bookkeeping: no threads, sockets or clocks.
Every method that can start or end a wait takes ``now`` (``time.monotonic()`` seconds)
and every non-terminal phase has a deadline, so a caller that calls :meth:`poll`
regularly (vLLM: every scheduler step) can never wait forever.

P: ``HELD -> SENDING -> DONE``, or ``EXPIRED`` (lease ran out before D came),
``ABORTED``, ``FAILED`` (a transfer failed or stalled).
D: ``ALLOCATED -> WAITING -> RECEIVING -> RECEIVED``, or ``FAILED``, ``ABORTED``.

Ownership: the engine owns the blocks. A request records which blocks it holds and
:meth:`_Request.release` hands them back exactly once, after the request is terminal
and no transfer is still reading or writing them (or the drain deadline has passed).
A second ``release`` raises :class:`~kvbridge.errors.StateError`.

Threading: a request is not thread-safe; the adapter that owns it serialises access.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import ClassVar, Generic, TypeVar

from kvbridge.config import Timeouts
from kvbridge.errors import StateError


class SendPhase(str, enum.Enum):
    HELD = "held"
    """Blocks held; where to send them is not known yet. Deadline: the lease."""
    SENDING = "sending"
    """Destination known; transfers are being posted. Deadline: transfer timeout,
    refreshed by every completed transfer."""
    DONE = "done"
    EXPIRED = "expired"
    ABORTED = "aborted"
    FAILED = "failed"


class RecvPhase(str, enum.Enum):
    ALLOCATED = "allocated"
    """Blocks allocated for the incoming KV; the destination is not sent yet.
    Deadline: handshake timeout."""
    WAITING = "waiting"
    """Destination sent; nothing arrived yet. Deadline: receive timeout (covers the
    prefill side's queueing and compute)."""
    RECEIVING = "receiving"
    """Some layers arrived. Deadline: transfer timeout, refreshed by every arrival."""
    RECEIVED = "received"
    FAILED = "failed"
    ABORTED = "aborted"


_SEND_TERMINAL = frozenset({SendPhase.DONE, SendPhase.EXPIRED, SendPhase.ABORTED, SendPhase.FAILED})
_RECV_TERMINAL = frozenset({RecvPhase.RECEIVED, RecvPhase.FAILED, RecvPhase.ABORTED})

P = TypeVar("P", SendPhase, RecvPhase)


class _Request(Generic[P]):
    """Shared mechanics: phase, deadline, in-flight transfers, exactly-once release."""

    _terminal: frozenset
    _transitions: dict

    def __init__(
        self, transfer_id: str, blocks: Sequence[int], phase: P, deadline: float, timeouts: Timeouts
    ) -> None:
        self.transfer_id = transfer_id
        self.timeouts = timeouts
        self.phase: P = phase
        self.deadline = deadline
        self.reason: str | None = None
        self._blocks: list[int] = list(blocks)
        self._inflight: set[Hashable] = set()
        self._drain_deadline: float | None = None
        self._released = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.transfer_id!r}, {self.phase.value}, "
            f"blocks={len(self._blocks)}, inflight={len(self._inflight)})"
        )

    # --- queries ---------------------------------------------------------------------------

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def terminal(self) -> bool:
        return self.phase in self._terminal

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def _inflight_keys(self) -> frozenset[Hashable]:
        return frozenset(self._inflight)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def releasable(self) -> bool:
        """Terminal, not yet released, and nothing in flight touches the blocks."""
        return self.terminal and not self._released and not self._inflight

    # --- transfers -------------------------------------------------------------------------

    def posted(self, key: Hashable) -> None:
        """A transfer touching this request's blocks was posted."""
        if self.terminal:
            raise StateError(
                f"{self.transfer_id}: transfer posted after the request ended ({self.phase.value})"
            )
        if key in self._inflight:
            raise StateError(f"{self.transfer_id}: transfer {key!r} posted twice")
        self._inflight.add(key)

    def settled(self, key: Hashable, now: float) -> None:
        """A posted transfer completed or failed; its blocks are no longer in use."""
        self._inflight.remove(key)
        if not self.terminal:
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        """Progress was made; subclasses move the deadline."""

    # --- endings ---------------------------------------------------------------------------

    def _move(self, to: P, now: float, deadline: float | None = None) -> None:
        allowed = self._transitions.get(self.phase, ())
        if to not in allowed:
            raise StateError(f"{self.transfer_id}: cannot go from {self.phase.value} to {to.value}")
        self.phase = to
        if deadline is not None:
            self.deadline = deadline
        if to in self._terminal:
            self.deadline = float("inf")
            if self._inflight:
                self._drain_deadline = now + self.timeouts.abort_ack_s

    def _end(self, to: P, reason: str | None, now: float) -> bool:
        """Move to terminal phase ``to`` unless already terminal; True if this call ended it."""
        if self.terminal:
            return False
        self.reason = reason
        self._move(to, now)
        return True

    def poll(self, now: float) -> bool:
        """Apply deadlines. Returns True when this call ended the request (it expired or
        timed out) or abandoned in-flight transfers after the drain deadline."""
        if self.terminal:
            if self._inflight and self._drain_deadline is not None and now >= self._drain_deadline:
                self._inflight.clear()
                return True
            return False
        if now >= self.deadline:
            self._on_deadline(now)
            return True
        return False

    def _on_deadline(self, now: float) -> None:
        raise NotImplementedError

    def release(self) -> tuple[int, ...]:
        """Hand the blocks back to the engine. Exactly once, only when :attr:`releasable`."""
        if self._released:
            raise StateError(f"{self.transfer_id}: blocks released twice")
        if not self.terminal:
            raise StateError(f"{self.transfer_id}: blocks released while {self.phase.value}")
        if self._inflight:
            raise StateError(
                f"{self.transfer_id}: blocks released with {len(self._inflight)} transfers in "
                "flight"
            )
        self._released = True
        return tuple(self._blocks)


class SendRequest(_Request[SendPhase]):
    """Prefill side of one transfer: blocks held under a lease until sent or given up.

    Who calls: the P adapter's worker/scheduler glue. ``hold`` when prefill produced
    blocks (again for each chunk of a chunked prefill), ``start_sending`` when D's
    destination arrives, ``posted``/``settled`` around every transfer, ``finish`` when
    the last chunk is posted. Then ``release`` once :attr:`releasable`.
    """

    _terminal = _SEND_TERMINAL
    _transitions: ClassVar[dict[SendPhase, tuple[SendPhase, ...]]] = {
        SendPhase.HELD: (SendPhase.SENDING, SendPhase.EXPIRED, SendPhase.ABORTED, SendPhase.FAILED),
        SendPhase.SENDING: (SendPhase.DONE, SendPhase.ABORTED, SendPhase.FAILED),
    }

    def __init__(
        self, transfer_id: str, blocks: Sequence[int], timeouts: Timeouts, now: float
    ) -> None:
        super().__init__(transfer_id, blocks, SendPhase.HELD, now + timeouts.lease_s, timeouts)
        self._finishing = False

    def hold(self, blocks: Iterable[int]) -> None:
        """Add blocks (a later chunk of a chunked prefill)."""
        if self.terminal:
            raise StateError(f"{self.transfer_id}: cannot hold blocks after the request ended")
        self._blocks.extend(blocks)

    def start_sending(self, now: float) -> None:
        """The destination is known: HELD -> SENDING."""
        self._move(SendPhase.SENDING, now, deadline=now + self.timeouts.transfer_s)

    def _refresh(self, now: float) -> None:
        if self.phase is SendPhase.SENDING:
            self.deadline = now + self.timeouts.transfer_s
            self._maybe_done(now)

    def finish(self, now: float) -> None:
        """Everything is posted; the request is DONE once nothing is in flight."""
        if self.phase is not SendPhase.SENDING:
            raise StateError(f"{self.transfer_id}: finish() while {self.phase.value}")
        self._finishing = True
        self._maybe_done(now)

    def _maybe_done(self, now: float) -> None:
        if self._finishing and not self._inflight:
            self._move(SendPhase.DONE, now)

    def abort(self, reason: str, now: float) -> bool:
        return self._end(SendPhase.ABORTED, reason, now)

    def fail(self, reason: str, now: float) -> bool:
        return self._end(SendPhase.FAILED, reason, now)

    def _on_deadline(self, now: float) -> None:
        if self.phase is SendPhase.HELD:
            self._end(
                SendPhase.EXPIRED,
                f"lease of {self.timeouts.lease_s:g}s expired before the decode side asked",
                now,
            )
        else:
            self._end(
                SendPhase.FAILED, f"no transfer progress for {self.timeouts.transfer_s:g}s", now
            )


class RecvRequest(_Request[RecvPhase]):
    """Decode side of one transfer: blocks allocated and waiting to be filled.

    Who calls: the D adapter. ``destination_sent`` after the Destination message left,
    ``layer_arrived`` per arrival, ``complete`` when P's Done came. On FAILED the
    adapter reports :attr:`blocks` to the engine as load errors.
    """

    _terminal = _RECV_TERMINAL
    _transitions: ClassVar[dict[RecvPhase, tuple[RecvPhase, ...]]] = {
        RecvPhase.ALLOCATED: (
            RecvPhase.WAITING,
            RecvPhase.RECEIVED,
            RecvPhase.FAILED,
            RecvPhase.ABORTED,
        ),
        RecvPhase.WAITING: (
            RecvPhase.RECEIVING,
            RecvPhase.RECEIVED,
            RecvPhase.FAILED,
            RecvPhase.ABORTED,
        ),
        RecvPhase.RECEIVING: (RecvPhase.RECEIVED, RecvPhase.FAILED, RecvPhase.ABORTED),
    }

    def __init__(
        self, transfer_id: str, blocks: Sequence[int], timeouts: Timeouts, now: float
    ) -> None:
        # ALLOCATED covers waiting for staging room, the handshake and the destination's
        # delivery; each network call has its own handshake_s bound, so the phase as a
        # whole gets the queueing bound
        super().__init__(
            transfer_id, blocks, RecvPhase.ALLOCATED, now + timeouts.receive_s, timeouts
        )
        self.layers_arrived = 0

    def destination_sent(self, now: float) -> None:
        """The source has our destination. A source may write (and its notifications
        arrive) before its reply reaches us: with layers arrived, the request is
        receiving, not waiting."""
        self._move(RecvPhase.WAITING, now, deadline=now + self.timeouts.receive_s)
        if self.layers_arrived:
            self._move(RecvPhase.RECEIVING, now, deadline=now + self.timeouts.transfer_s)

    def layer_arrived(self, now: float) -> None:
        if self.terminal:
            return  # late data for a failed/aborted request is ignored, never fatal
        self.layers_arrived += 1
        if self.phase is RecvPhase.WAITING:
            self._move(RecvPhase.RECEIVING, now)
        self.deadline = now + self.timeouts.transfer_s

    def complete(self, now: float) -> bool:
        return self._end(RecvPhase.RECEIVED, None, now)

    def fail(self, reason: str, now: float) -> bool:
        return self._end(RecvPhase.FAILED, reason, now)

    def abort(self, reason: str, now: float) -> bool:
        return self._end(RecvPhase.ABORTED, reason, now)

    def _on_deadline(self, now: float) -> None:
        waited = {
            RecvPhase.ALLOCATED: "sending the destination",
            RecvPhase.WAITING: "the first KV data",
            RecvPhase.RECEIVING: "the next KV data",
        }[self.phase]
        self._end(RecvPhase.FAILED, f"timed out waiting for {waited}", now)


R = TypeVar("R", SendRequest, RecvRequest)


class RequestTable(Generic[R]):
    """Requests of one side keyed by transfer id.

    :meth:`poll` applies every deadline in one O(n) pass; it is meant to run once per
    engine step, where n (requests in transfer) is at most a few hundred.
    """

    def __init__(self) -> None:
        self._reqs: dict[str, R] = {}

    def add(self, req: R) -> R:
        if req.transfer_id in self._reqs:
            raise StateError(f"transfer id {req.transfer_id!r} is already tracked")
        self._reqs[req.transfer_id] = req
        return req

    def get(self, transfer_id: str) -> R | None:
        return self._reqs.get(transfer_id)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._reqs.values()))

    def poll(self, now: float) -> list[R]:
        """Apply deadlines; return the requests this call ended or drained."""
        return [r for r in list(self._reqs.values()) if r.poll(now)]

    def pop_releasable(self) -> list[R]:
        """Remove and return every request whose blocks can be released now; the caller
        must call ``release()`` on each."""
        done = [r for r in self._reqs.values() if r.releasable]
        for r in done:
            del self._reqs[r.transfer_id]
        return done


ENDED_MEMORY = 4096
"""How many ended transfers an :class:`EndedTransfers` remembers."""


class EndedTransfers:
    """Transfer ids that ended here, with how, the last ``size`` of them (oldest
    forgotten first). A transfer id is single-use: whoever names one that ended (a late
    destination, the late sibling of a request with ``n > 1``) is answered from here
    instead of waiting for a transfer that will never come. Not thread-safe."""

    def __init__(self, size: int = ENDED_MEMORY) -> None:
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._size = size

    def add(self, transfer_id: str, how: str = "") -> None:
        self._ended[transfer_id] = how
        self._ended.move_to_end(transfer_id)
        if len(self._ended) > self._size:
            self._ended.popitem(last=False)

    def get(self, transfer_id: str) -> str | None:
        """How ``transfer_id`` ended, or None if it did not (or was forgotten)."""
        return self._ended.get(transfer_id)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._ended


__all__ = [
    "ENDED_MEMORY",
    "EndedTransfers",
    "RecvPhase",
    "RecvRequest",
    "RequestTable",
    "SendPhase",
    "SendRequest",
]
