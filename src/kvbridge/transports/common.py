"""Shared implementation of the transport contract; backends fill in ``_hooks``.

:class:`TransportBase` does everything that is the same for every backend: argument
and descriptor validation (so a bad descriptor gets a clear error before the backend
sees it), bookkeeping of registrations, peers, prepared tables and live transfers (so
``close`` releases each exactly once), the notification inbox and the pump thread that
fills it, and bounded waiting.

Backend modules subclass it and implement the ``_`` hooks, mapping their exceptions to
kvbridge errors. Hooks are called with the base's bookkeeping already checked.
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvbridge.core.layout import MemoryKind, merge_regions
from kvbridge.core.plan import Regions, coalesce
from kvbridge.errors import (
    DeadlineExceeded,
    InvalidDescriptorError,
    KVBridgeError,
    PeerDisconnectedError,
    PeerUnreachableError,
    TransportError,
    UnknownPeerError,
)
from kvbridge.transports.base import (
    DescTable,
    Notification,
    Op,
    PeerMetadata,
    Registration,
    Xfer,
    as_descs,
    decode_metadata,
    encode_metadata,
)

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_WAIT_MAX_SLEEP = 1e-3
"""Longest sleep between two polls in :meth:`TransportBase.wait`."""
_WAIT_SLEEP_FRACTION = 1 / 32
"""Sleep at most this fraction of the time waited so far: completion is noticed within
~3% of the transfer's duration, and long transfers are polled rarely."""


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes (``/sys/class/infiniband``); empty without any."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


class RegionIndex:
    """Registered memory of one side, for vectorised "is this descriptor inside?" checks.

    Thread-safe: mutations hold a lock; lookups read an immutable snapshot.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._sorted: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def add(self, regions: Sequence[tuple[int, int]], memory: str, device: int) -> None:
        with self._lock:
            self._regions.setdefault((memory, device), []).extend(
                (int(a), int(n)) for a, n in regions
            )
            self._rebuild((memory, device))

    def remove(self, regions: Sequence[tuple[int, int]], memory: str, device: int) -> None:
        with self._lock:
            held = self._regions.get((memory, device), [])
            for a, n in regions:
                if (int(a), int(n)) in held:
                    held.remove((int(a), int(n)))
            self._rebuild((memory, device))

    def as_list(self) -> list[tuple[int, int, int, str]]:
        with self._lock:
            return [(a, n, dev, mem) for (mem, dev), held in self._regions.items() for a, n in held]

    def _rebuild(self, key: tuple[str, int]) -> None:
        # touching spans are merged so a descriptor crossing two adjacent registrations
        # (e.g. a coalesced run over two tensors) is accepted
        merged = merge_regions(self._regions.get(key, []))
        starts = np.array([a for a, _ in merged], dtype=np.uint64)
        ends = np.array([a + n for a, n in merged], dtype=np.uint64)
        self._sorted = {**self._sorted, key: (starts, ends)}

    def first_outside(self, descs: np.ndarray, memory: str) -> tuple[int, int] | None:
        """The first ``(address, length)`` of ``descs`` that is not inside a registered
        region of ``memory`` on its device, or ``None`` if all are inside."""
        if descs.shape[0] == 0:
            return None
        snapshot = self._sorted
        ok = np.zeros(descs.shape[0], dtype=bool)
        devices = descs[:, 2]
        one = bool((devices == devices[0]).all())  # the usual case: no per-device masks
        for dev, rows in (
            [(devices[0], slice(None))] if one else [(d, devices == d) for d in np.unique(devices)]
        ):
            starts, ends = snapshot.get((memory, int(dev)), (None, None))
            if starts is None or starts.size == 0:
                continue
            addr, length = descs[rows, 0], descs[rows, 1]
            pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
            inside = pos >= 0
            inside &= addr + length <= ends[np.where(inside, pos, 0)]
            ok[rows] = inside
        if ok.all():
            return None
        i = int(np.flatnonzero(~ok)[0])
        return int(descs[i, 0]), int(descs[i, 1])


class Inbox:
    """Notifications waiting to be taken; each is handed out exactly once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[Notification] = deque()
        self._closed = False

    def put(self, items: Sequence[Notification]) -> None:
        if not items:
            return
        with self._cond:
            self._items.extend(items)
            self._cond.notify_all()

    def take(self, timeout: float) -> list[Notification]:
        """Everything queued; waits up to ``timeout`` seconds for the first item."""
        with self._cond:
            if not self._items and timeout > 0 and not self._closed:
                self._cond.wait_for(lambda: self._items or self._closed, timeout)
            out = list(self._items)
            self._items.clear()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


IDLE_INTERVAL = 0.05
"""Seconds between a polled pump's steps while nothing is expected (:class:`Pump`)."""


class Pump:
    """A daemon thread calling ``step`` until stopped; ``step`` returns how much work it
    found.

    A ``blocking`` step waits for work itself (briefly, so stop stays prompt) and is
    called back to back. Otherwise steps are polled (NIXL has no blocking "wait for
    notification" call): after a step that found nothing the interval doubles from
    ``min_interval`` up to ``max_interval`` seconds while ``busy()`` says something is
    expected, up to ``idle_interval`` while it does not; :meth:`wake` makes the next
    step come at once. ``busy`` is called from the pump's thread after every empty step:
    cheap, thread-safe, never blocking; an exception counts as busy.
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], int],
        min_interval: float = 1e-4,
        max_interval: float = 2e-3,
        blocking: bool = False,
        idle_interval: float = IDLE_INTERVAL,
        busy: Callable[[], bool] = lambda: True,
    ) -> None:
        self._step = step
        self._busy = busy
        self._stopped = False
        self._wake = threading.Event()
        """Set to end the current wait: by :meth:`wake` and by :meth:`stop`."""
        self._min, self._max = (0.0, 0.0) if blocking else (min_interval, max_interval)
        self._idle = 0.0 if blocking else max(idle_interval, self._max)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._errors = 0
        self._probe_errors = 0
        self.steps = 0
        """Steps taken so far (read by benchmarks and tests)."""

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Take the next step now, and poll at the busy pace from there. Any thread."""
        self._wake.set()

    def _is_busy(self) -> bool:
        try:
            return bool(self._busy())
        except Exception:  # a broken probe must not slow notifications
            self._probe_errors += 1
            if self._probe_errors == 1 or self._probe_errors % 1000 == 0:
                log.exception(
                    "%s: the busy probe failed (%d so far)", self._thread.name, self._probe_errors
                )
            return True

    def _run(self) -> None:
        interval = self._min
        while not self._stopped:
            self.steps += 1
            try:
                found = self._step()
            except Exception:  # keep pumping: one bad poll must not stop notifications
                self._errors += 1
                if self._errors == 1 or self._errors % 1000 == 0:
                    log.exception(
                        "%s: notification poll failed (%d so far)", self._thread.name, self._errors
                    )
                found = 0
            if found:
                interval = self._min
            else:  # (a blocking pump's paces are all 0: no probe to ask)
                ceiling = self._max if self._idle == self._max or self._is_busy() else self._idle
                interval = min(max(interval * 2, self._min), ceiling)
            if interval and self._wake.wait(interval):
                self._wake.clear()
                interval = self._min

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s did not stop within %.1fs", self._thread.name, timeout)


_live: weakref.WeakSet[TransportBase] = weakref.WeakSet()


@atexit.register
def _close_live_transports() -> None:
    """Close transports the application did not close, before the interpreter tears
    down: a pump thread still inside the backend while its agent is destroyed aborts
    the process (NIXL: "terminate called without an active exception")."""
    for transport in list(_live):
        transport.close()


class TransportBase(abc.ABC):
    """Backend-independent half of a transport. See :mod:`kvbridge.transports.base`."""

    name: ClassVar[str]

    def __init__(self, agent_name: str) -> None:
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        self.agent_name = agent_name
        self._lock = threading.RLock()
        self._local = RegionIndex()
        self._registrations: list[Registration] = []
        self._peers: dict[str, RegionIndex] = {}
        self._peer_metadata: dict[str, bytes] = {}
        """What each peer was added with: the same bytes again keep its connection."""
        self._tables: set[DescTable] = set()
        self._xfers: set[Xfer] = set()
        self._inbox = Inbox()
        self._pump: Pump | None = None
        self._demand: tuple[Callable[[], bool], ...] = ()
        """:meth:`add_demand`'s probes (replaced whole, read by the pump's thread)."""
        self._closed = False
        self._reached: set[str] = set()
        """Peers a transfer has completed with; a failure before that is 'unreachable'."""
        _live.add(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.agent_name!r} peers={len(self._peers)}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_pump(self, blocking: bool = False) -> None:
        """Start collecting notifications; ``blocking`` when ``_drain_notifications``
        waits (briefly) for them itself."""

        def step() -> int:
            got = self._drain_notifications()
            self._inbox.put(got)
            return len(got)

        self._pump = Pump(f"kvbridge-{self.name}-pump", step, blocking=blocking, busy=self._busy)
        self._pump.start()

    # --- demand: how often a polled pump runs ---------------------------------------------

    def add_demand(self, probe: Callable[[], bool]) -> None:
        """From now on the pump polls the backend at its busy pace (every 2 ms at most)
        only while a transfer of ours is in flight or some ``probe()`` is true, and
        every :data:`IDLE_INTERVAL` otherwise (a transport with no probe is always
        busy). A probe says whether its owner expects notifications or a peer's
        transfers into or out of our memory (which need our progress): a receiver with
        receives pending, a sender whose computed blocks a peer may read. Called from the
        pump's thread: cheap, thread-safe, never blocking. Its owner calls :meth:`wake`
        when it starts expecting, and :meth:`remove_demand` when it closes."""
        with self._lock:
            self._demand = (*self._demand, probe)

    def remove_demand(self, probe: Callable[[], bool]) -> None:
        with self._lock:
            self._demand = tuple(p for p in self._demand if p is not probe)

    def wake(self) -> None:
        """Poll the backend now and at the busy pace from there (the caller now expects
        something: :meth:`add_demand`). Cheap; any thread."""
        if self._pump is not None:
            self._pump.wake()

    def _busy(self) -> bool:
        demand = self._demand
        return not demand or bool(self._xfers) or any(probe() for probe in demand)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name} transport {self.agent_name!r} is closed")

    # --- memory ----------------------------------------------------------------------------

    def register(
        self, regions: Sequence[tuple[int, int]], memory: MemoryKind = "host", device: int = 0
    ) -> Registration:
        """Register memory so it can be a transfer source or target. Call before
        :meth:`metadata`: peers learn our regions from it."""
        self._check_open()
        if memory not in ("host", "device"):
            raise InvalidDescriptorError(f"memory must be 'host' or 'device', got {memory!r}")
        spans = tuple((int(a), int(n)) for a, n in regions)
        if not spans or any(a <= 0 or n <= 0 for a, n in spans):
            raise InvalidDescriptorError(
                f"regions must be non-empty (address > 0, length > 0): {spans[:4]}"
            )
        handle = self._register(spans, memory, device)
        reg = Registration(spans, memory, device, handle)
        with self._lock:
            self._registrations.append(reg)
            self._local.add(spans, memory, device)
        return reg

    def deregister(self, registration: Registration) -> None:
        with self._lock:
            if registration not in self._registrations:
                return
            self._registrations.remove(registration)
            self._local.remove(registration.regions, registration.memory, registration.device)
        self._deregister(registration)

    # --- peers -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """Our agent metadata for peers, as of now (re-send after registering more)."""
        self._check_open()
        return encode_metadata(
            PeerMetadata(
                transport=self.name,
                agent=self.agent_name,
                payload=self._backend_metadata(),
                regions=self._local.as_list(),
            )
        )

    def peer_name(self, metadata: bytes) -> str:
        """The peer id (agent name) ``metadata`` names, checked as :meth:`add_peer`
        checks it but added to nothing: callers compare it with who sent the metadata
        before :meth:`add_peer`, which replaces a known peer whose metadata changed.

        Raises:
            WireError: malformed metadata.
            IncompatiblePeerError: metadata of another transport.
        """
        return decode_metadata(metadata, self.name).agent

    def add_peer(self, metadata: bytes, *, probe: bool = True) -> str:
        """Load a peer's metadata; returns its peer id (its agent name).

        ``probe``: make sure the peer answers before returning (the backends that
        connect lazily, Mooncake, do it with a zero-length write, which also opens the
        peer's segment; it may take up to the transfer timeout). False where the caller
        must not wait on the peer: when we answer a peer's handshake (the prefill side's
        ``Welcome``: the peer waits for our reply) or on a thread that serves other
        peers too (the SGLang prefill's control thread): the check then runs in the
        background and a dead peer shows at the first transfer.

        The same metadata again (a second handshake with a live peer, e.g. when two
        ``kv_both`` instances swap the prefill and decode roles) changes nothing: the
        connection, its prepared tables and transfers in flight on them stay valid.
        Other metadata under a known peer id (the peer re-registered memory) replaces
        the peer: its tables are released and the backend reconnects, so callers first
        check with :meth:`peer_name` that the metadata is the sender's own."""
        self._check_open()
        md = decode_metadata(metadata, self.name)
        if md.agent == self.agent_name:
            raise TransportError(
                f"peer metadata carries our own agent name {md.agent!r}",
                fix="give every instance a unique agent name (engine id + epoch + rank)",
            )
        with self._lock:
            known = md.agent in self._peers
            if known and self._peer_metadata.get(md.agent) == metadata:
                return md.agent
        index = RegionIndex()
        grouped: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for addr, length, dev, mem in md.regions:
            grouped.setdefault((mem, dev), []).append((addr, length))
        for (mem, dev), spans in grouped.items():
            index.add(spans, mem, dev)
        if known:
            self.remove_peer(md.agent)
        self._add_peer(md, probe)  # unlocked: it may wait on the peer (bounded)
        with self._lock:
            if self._closed:
                raise TransportError(
                    f"{self.name} transport {self.agent_name!r} was closed while adding peer "
                    f"{md.agent!r}"
                )
            self._peers[md.agent] = index
            self._peer_metadata[md.agent] = metadata
        return md.agent

    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its prepared tables are released. Unknown peers are ignored."""
        with self._lock:
            self._peer_metadata.pop(peer, None)
            if self._closed or self._peers.pop(peer, None) is None:
                return
            self._reached.discard(peer)
            for t in [t for t in self._tables if t.peer == peer]:
                self.release_table(t)
            self._remove_peer(peer)

    @property
    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def _peer_lost(self, peer: str | None, what: str, cause: object) -> KVBridgeError:
        """The error for a peer that stopped answering: unreachable if no transfer with it
        ever completed, disconnected otherwise."""
        if peer is not None and peer not in self._reached:
            return PeerUnreachableError(
                f"could not reach peer {peer!r} during {what} ({cause})",
                fix="check that the peer process is running and the metadata it sent is current",
            )
        return PeerDisconnectedError(f"peer {peer!r} disconnected during {what} ({cause})")

    def _peer_index(self, peer: str) -> RegionIndex:
        with self._lock:
            index = self._peers.get(peer)
        if index is None:
            raise UnknownPeerError(
                f"unknown peer {peer!r}",
                fix="add the peer with add_peer(<its metadata from the handshake>) first",
            )
        return index

    # --- descriptor tables -----------------------------------------------------------------

    def prepare(
        self, descs: np.ndarray, memory: MemoryKind = "host", peer: str | None = None
    ) -> DescTable:
        """Prepare ``(address, length[, device])`` descriptors of our memory (``peer`` is
        None) or of a peer's, for use by index in :meth:`post`."""
        arr = self._checked(descs, memory, peer)
        table = DescTable(arr, memory, peer)
        with self._lock:
            self._check_open()
            table.handle = self._prepare(table)
            self._tables.add(table)
        return table

    def adhoc(
        self, descs: np.ndarray, memory: MemoryKind = "host", peer: str | None = None
    ) -> DescTable:
        """Descriptors checked as :meth:`prepare` checks them, for one :meth:`post`, not
        prepared: for lists that change with every transfer, where a table of every
        possible descriptor would be too large (the state segments a peer of another
        tensor-parallel split moves). A backend with prepared lists builds the
        transfer from the addresses then (NIXL: ``initialize_xfer``); the others take
        addresses anyway. Holds nothing of the backend's: no release."""
        return DescTable(self._checked(descs, memory, peer), memory, peer, prepared=False)

    def _checked(self, descs: np.ndarray, memory: MemoryKind, peer: str | None) -> np.ndarray:
        self._check_open()
        arr = as_descs(descs)
        if arr.shape[0] == 0:
            raise InvalidDescriptorError("cannot prepare an empty descriptor list")
        if (arr[:, 1] == 0).any():
            raise InvalidDescriptorError("descriptor lengths must be positive")
        index = self._local if peer is None else self._peer_index(peer)
        outside = index.first_outside(arr, memory)
        if outside is not None:
            whose = "our" if peer is None else f"peer {peer!r}'s"
            raise InvalidDescriptorError(
                f"descriptor at 0x{outside[0]:x} (+{outside[1]} bytes) is outside {whose} "
                f"registered {memory} memory",
                fix="register the memory before preparing descriptors for it"
                + ("" if peer is None else ", then re-send metadata to the peer"),
            )
        return arr

    def release_table(self, table: DescTable) -> None:
        with self._lock:
            if table.released or table not in self._tables:
                return
            table.released = True
            self._tables.discard(table)
            if self._closed:
                return  # close() released everything it tracked
            self._release_table(table)

    # --- transfers -------------------------------------------------------------------------

    def post(
        self,
        op: Op,
        local: DescTable,
        local_idx: np.ndarray | Sequence[int],
        remote: DescTable,
        remote_idx: np.ndarray | Sequence[int],
        notify: bytes | None = None,
    ) -> Xfer:
        """Start moving ``local[local_idx[i]]`` to (``write``) or from (``read``)
        ``remote[remote_idx[i]]`` for every i; ``notify`` is delivered to the peer once
        all of it has landed. Returns at once; complete with :meth:`wait`/:meth:`poll`
        then :meth:`release`."""
        self._check_open()
        if op not in ("write", "read"):
            raise InvalidDescriptorError(f"op must be 'write' or 'read', got {op!r}")
        if local.peer is not None or remote.peer is None:
            raise InvalidDescriptorError(
                "post(local, ..., remote, ...) needs a local table and a peer's table"
            )
        if local.released or remote.released:
            raise InvalidDescriptorError("descriptor table was released")
        self._peer_index(remote.peer)
        lidx = _indices(local_idx, len(local), "local")
        ridx = _indices(remote_idx, len(remote), "remote")
        if lidx.size != ridx.size:
            raise InvalidDescriptorError(
                f"index lists differ in length: {lidx.size} local vs {ridx.size} remote"
            )
        if lidx.size == 0:
            raise InvalidDescriptorError(
                "empty transfer", fix="send a bare notification with notify()"
            )
        if local.uniform_length is not None and local.uniform_length == remote.uniform_length:
            nbytes = lidx.size * local.uniform_length  # equal-length tables: pairs match
        else:
            llen, rlen = local.descs[lidx, 1], remote.descs[ridx, 1]
            if not np.array_equal(llen, rlen):
                i = int(np.flatnonzero(llen != rlen)[0])
                raise InvalidDescriptorError(
                    f"descriptor {i}: local length {int(llen[i])} != remote length {int(rlen[i])}"
                )
            nbytes = int(llen.sum())
        with self._lock:  # close() cannot run between posting and recording the transfer
            self._check_open()
            xfer = self._post(op, local, lidx, remote, ridx, notify, nbytes)
            self._xfers.add(xfer)
            if xfer.done:
                self._reached.add(xfer.peer)
        return xfer

    def poll(self, xfer: Xfer) -> bool:
        """True once ``xfer`` completed; raises its mapped error if it failed."""
        if xfer.error is not None:
            raise xfer.error
        if xfer.done:
            return True
        with self._lock:
            if xfer.released:
                raise TransportError("transfer was released before it completed")
            self._check_open()
            try:
                xfer.done = self._poll(xfer)
            except KVBridgeError as exc:
                xfer.error = exc
                raise
            if xfer.done:
                self._reached.add(xfer.peer)
        return xfer.done

    def wait(self, xfer: Xfer, timeout: float) -> None:
        """Block until ``xfer`` completes; raises its error, or
        :class:`~kvbridge.errors.DeadlineExceeded` after ``timeout`` seconds."""
        start = time.monotonic()
        deadline = start + timeout
        while not self.poll(xfer):
            now = time.monotonic()
            if now >= deadline:
                raise DeadlineExceeded(
                    f"transfer of {xfer.nbytes} bytes to {xfer.peer!r} did not complete within "
                    f"{timeout:g}s",
                    fix=(
                        "check that the peer is alive; raise timeouts.transfer_s for very large "
                        "transfers"
                    ),
                )
            # the backends have no blocking completion call: sleep in proportion to the
            # time waited so far, so the wake-up overshoot stays a small share of it
            time.sleep(min((now - start) * _WAIT_SLEEP_FRACTION, _WAIT_MAX_SLEEP, deadline - now))

    def release(self, xfer: Xfer) -> None:
        """Free the transfer's backend resources. Idempotent. Releasing an unfinished
        transfer asks the backend to cancel it."""
        with self._lock:
            if xfer.released:
                return
            xfer.released = True
            self._xfers.discard(xfer)
            if self._closed:
                return  # close() released everything it tracked
            self._release(xfer)

    # --- notifications ---------------------------------------------------------------------

    def notify(self, peer: str, payload: bytes) -> None:
        """Send a notification not tied to a transfer."""
        self._peer_index(peer)
        with self._lock:
            self._check_open()
            waiter = self._notify(peer, bytes(payload))
        if waiter is not None:
            waiter()  # outside the lock: a slow peer must not stall other peers' transfers

    def take_notifications(self, timeout: float = 0.0) -> list[Notification]:
        """Every notification received so far, each exactly once; waits up to
        ``timeout`` seconds for the first one."""
        return self._inbox.take(timeout)

    # --- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything this transport holds and stop its threads. Idempotent;
        never raises (failures are logged). Waits for a post or poll in progress on
        another thread; afterwards every method but ``release``/``close`` raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            xfers, tables = list(self._xfers), list(self._tables)
            peers, registrations = list(self._peers), list(self._registrations)
            self._xfers.clear()
            self._tables.clear()
            self._peers.clear()
            self._peer_metadata.clear()
            self._registrations.clear()
        if self._pump is not None:
            self._pump.stop()
        for x in xfers:
            x.released = True
        for t in tables:
            t.released = True
        steps: list[tuple[str, Callable[[], None]]] = []
        steps += [("release transfer", lambda x=x: self._release(x)) for x in xfers]
        steps += [("release table", lambda t=t: self._release_table(t)) for t in tables]
        steps += [("remove peer", lambda p=p: self._remove_peer(p)) for p in peers]
        steps += [("deregister", lambda r=r: self._deregister(r)) for r in registrations]
        steps.append(("close backend", self._close_backend))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.warning("%s: %s failed during close", self.agent_name, what, exc_info=True)
        self._inbox.close()

    # --- backend hooks ---------------------------------------------------------------------

    @abc.abstractmethod
    def _register(
        self, regions: tuple[tuple[int, int], ...], memory: MemoryKind, device: int
    ) -> object: ...

    @abc.abstractmethod
    def _deregister(self, registration: Registration) -> None: ...

    @abc.abstractmethod
    def _backend_metadata(self) -> bytes: ...

    @abc.abstractmethod
    def _add_peer(self, md: PeerMetadata, probe: bool) -> None: ...

    @abc.abstractmethod
    def _remove_peer(self, peer: str) -> None: ...

    def _prepare(self, table: DescTable) -> object:
        """Backend handle for a new table; backends that take raw addresses keep none."""
        return None

    def _release_table(self, table: DescTable) -> None:  # noqa: B027 (optional hook)
        """Free what :meth:`_prepare` made (backends whose tables hold nothing: no-op)."""

    @staticmethod
    def _regions(
        local: DescTable, lidx: np.ndarray, remote: DescTable, ridx: np.ndarray
    ) -> Regions:
        """The selected descriptor pairs as coalesced (local, remote, length) regions,
        for backends that pay per descriptor."""
        return coalesce(local.descs[lidx, 0], remote.descs[ridx, 0], local.descs[lidx, 1])

    @abc.abstractmethod
    def _post(
        self,
        op: Op,
        local: DescTable,
        lidx: np.ndarray,
        remote: DescTable,
        ridx: np.ndarray,
        notify: bytes | None,
        nbytes: int,
    ) -> Xfer: ...

    @abc.abstractmethod
    def _poll(self, xfer: Xfer) -> bool: ...

    @abc.abstractmethod
    def _release(self, xfer: Xfer) -> None: ...

    @abc.abstractmethod
    def _notify(self, peer: str, payload: bytes) -> Callable[[], None] | None:
        """Send; return None when sent, or a callable that blocks (bounded) until the
        backend confirms and raises a mapped error; it is called without the lock."""

    @abc.abstractmethod
    def _drain_notifications(self) -> list[Notification]: ...

    @abc.abstractmethod
    def _close_backend(self) -> None: ...


def _indices(idx: np.ndarray | Sequence[int], size: int, side: str) -> np.ndarray:
    arr = np.asarray(idx)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidDescriptorError(f"{side} indices must be a 1-D integer array")
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        raise InvalidDescriptorError(
            f"{side} index out of range [0, {size}): min {arr.min()}, max {arr.max()}"
        )
    return np.ascontiguousarray(arr, dtype=np.int32)


__all__ = ["Inbox", "Pump", "RegionIndex", "TransportBase", "rdma_devices"]
