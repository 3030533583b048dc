"""Which peers are new and which rooms are dead: restart and abort bookkeeping of the
SGLang backend. Pure (no SGLang, no I/O); :mod:`.decode` and :mod:`.bootstrap` do the
HTTP and the threads.

Restarts (the decode side). SGLang's decode caches each prefill's bootstrap info (rank
addresses) and keeps it while the prefill's ``/health`` answers; a prefill restarted on
the same bootstrap port answers again, with new rank ports, so a decode that did not see
two failed heartbeats in between keeps sending to ports nobody reads and its requests
hang until SGLang's waiting timeout (300 s). kvbridge's bootstrap server therefore serves
an :class:`InstanceEpoch` at :data:`EPOCH_PATH`: a fresh id per bootstrap-server start
plus the epoch each prefill rank registered with. The decode records it at first
contact (:meth:`EpochWatcher.remember`) and polls it every ``timeouts.heartbeat_s``
(:meth:`EpochWatcher.observe`); a different instance, or a port that refuses
connections twice in a row, means the cached info is stale: the manager drops it
(failing that prefill's in-flight rooms at once) and the next request bootstraps anew.

Aborts and failures (the prefill side). A request may be aborted or failed on the
prefill before the decode's destination for its room arrives; :class:`Tombstones`
remembers recently failed rooms so that a late destination is answered with the failure
instead of waiting for a transfer that will never start.

>>> w = EpochWatcher()
>>> w.remember("p:8998", InstanceEpoch(instance="a", ranks={"dp0/cp0/tp0/pp0": "x"}))
>>> w.observe("p:8998", InstanceEpoch(instance="a", ranks={"dp0/cp0/tp0/pp0": "x"}))
<Verdict.SAME: 'same'>
>>> w.observe("p:8998", InstanceEpoch(instance="b"))
<Verdict.RESTARTED: 'restarted'>
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict

import msgspec

from kvbridge.errors import WireError

EPOCH_PATH = "/kvbridge/epoch"
"""GET on a kvbridge prefill's bootstrap server: its :class:`InstanceEpoch` as JSON."""


class InstanceEpoch(msgspec.Struct, frozen=True, kw_only=True):
    """Identity of one prefill instance, as its bootstrap server reports it."""

    instance: str
    """Fresh per bootstrap-server start (a restarted prefill has a new one)."""
    ranks: dict[str, str] = {}
    """``"dp{d}/cp{c}/tp{t}/pp{p}"`` -> the epoch that rank's manager registered with."""
    ready: bool = True
    """Every rank the instance expects has registered."""


_epoch_decoder = msgspec.json.Decoder(InstanceEpoch)


def decode_epoch(body: bytes) -> InstanceEpoch:
    """Parse a bootstrap server's answer (raises :class:`WireError` on anything else)."""
    try:
        return _epoch_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed kvbridge epoch document: {exc}") from exc


def encode_epoch(epoch: InstanceEpoch) -> bytes:
    return msgspec.json.encode(epoch)


def rank_key(*, dp: int, cp: int, tp: int, pp: int) -> str:
    return f"dp{dp}/cp{cp}/tp{tp}/pp{pp}"


class Verdict(enum.Enum):
    FIRST = "first"
    """Nothing recorded for this address yet; now recorded."""
    SAME = "same"
    RESTARTED = "restarted"
    """Another instance answers on the address: drop the cached info."""
    DOWN = "down"
    """The address refused connections ``refusals_for_down`` polls in a row."""
    UNANSWERED = "unanswered"
    """No answer in time (busy, or dying): left to SGLang's heartbeat."""


class EpochWatcher:
    """The decode's record of each prefill instance it talks to.

    Who calls: the decode manager; :meth:`remember` on the scheduler thread at first
    contact with a prefill, :meth:`observe` from its epoch thread once per poll and
    address, :meth:`forget` when SGLang drops the prefill. Not thread-safe by itself:
    the manager serializes calls with one lock.
    """

    def __init__(self, refusals_for_down: int = 2) -> None:
        self.refusals_for_down = refusals_for_down
        self._known: dict[str, InstanceEpoch] = {}
        self._refusals: dict[str, int] = {}

    def remember(self, addr: str, epoch: InstanceEpoch) -> None:
        self._known.setdefault(addr, epoch)
        self._refusals.pop(addr, None)

    def forget(self, addr: str) -> None:
        self._known.pop(addr, None)
        self._refusals.pop(addr, None)

    def known(self, addr: str) -> InstanceEpoch | None:
        return self._known.get(addr)

    def addresses(self) -> set[str]:
        return set(self._known) | set(self._refusals)

    def observe(self, addr: str, epoch: InstanceEpoch | None, *, refused: bool = False) -> Verdict:
        """One poll's outcome: ``epoch`` when the address answered, else ``refused``
        (connection refused) or neither (timed out). RESTARTED and DOWN forget the
        address (the manager drops it from SGLang's tables too)."""
        if epoch is None:
            if not refused:
                return Verdict.UNANSWERED
            self._refusals[addr] = self._refusals.get(addr, 0) + 1
            if self._refusals[addr] < self.refusals_for_down:
                return Verdict.UNANSWERED
            self.forget(addr)
            return Verdict.DOWN
        self._refusals.pop(addr, None)
        before = self._known.get(addr)
        if before is None:
            if epoch.ready:
                self._known[addr] = epoch
            return Verdict.FIRST
        if epoch.instance != before.instance or (epoch.ready and epoch.ranks != before.ranks):
            self.forget(addr)
            return Verdict.RESTARTED
        return Verdict.SAME


class Tombstones:
    """Rooms this prefill failed: aborted here, their destination refused (an
    incompatible decode, no staging run), or any failure SGLang recorded (its bootstrap
    timeout, a DP rank that does not match the room); most recent ``capacity`` of them.

    Who calls: the prefill's sender (:meth:`add` on abort, :meth:`reason` when it is
    made: a refusal may come first) on the scheduler thread, its manager's
    ``record_failure`` (:meth:`add`, any thread), and its control thread (:meth:`add`
    on a refusal, :meth:`reason` when a destination arrives). Bounded: old entries go
    first. Thread-safe.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, room: int, reason: str) -> None:
        with self._lock:
            self._rooms[room] = reason
            self._rooms.move_to_end(room)
            while len(self._rooms) > self.capacity:
                self._rooms.popitem(last=False)

    def reason(self, room: int) -> str | None:
        """Why ``room`` failed, or None when it did not (recently)."""
        with self._lock:
            return self._rooms.get(room)

    def __len__(self) -> int:
        return len(self._rooms)


__all__ = [
    "EPOCH_PATH",
    "EpochWatcher",
    "InstanceEpoch",
    "Tombstones",
    "Verdict",
    "decode_epoch",
    "encode_epoch",
    "rank_key",
]
