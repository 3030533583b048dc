"""Decode side: ask for a request's KV, track what arrived, report the outcome.

Who calls what (the engine adapter, on the decode worker):

- :meth:`Receiver.expect_push` (layer-wise push): the blocks D allocated for the prompt
  are sent to the prefill instance as a ``Destination``; its writes arrive with
  ``LayerDone`` notifications, and the request is complete when every layer of every
  destination block is covered;
- :meth:`Receiver.expect_pull` (P-first): the prefill instance already holds the
  blocks; D reads them, then sends ``Release`` (packed path: D sends a
  ``Destination`` as in the push flow and the prefill writes them);
- :meth:`Receiver.take_finished` once per engine step: transfer ids that completed and
  ones that failed, each reported exactly once (then the engine's load-failure
  policy recomputes or fails the failed ones);
- :meth:`Receiver.abort` when the engine drops the request.

A request may have several *sources*: when the prefill instance has more TP ranks than
ours, each of several prefill workers holds some of our KV heads; each gets its own
``Destination`` (numbered by ``source``, echoed in its notifications) and writes its
head range of every block (packed path: into staging reserved for all sources at once,
then unpacked into those heads), and the request completes when every source covered
every layer and block.

Nothing here blocks the caller: side-channel calls (handshake, destination, release,
heartbeats) run on a small pool, reads are polled by the control thread, and
notifications are handled by their own thread. Every wait is bounded by the request's
deadline (``receive_s`` before the first data, ``transfer_s`` between arrivals) and by
heartbeats: a prefill instance that stops answering (``3 x heartbeat_s``) or restarts
(new epoch) fails its requests at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.core.blocks import NONE, BlockTable
from kvbridge.core.lifecycle import RecvPhase, RecvRequest
from kvbridge.errors import KVBridgeError, PeerUnreachableError, WireError
from kvbridge.runtime.node import Node, Peer
from kvbridge.runtime.packed import Run
from kvbridge.runtime.sidechannel import listening
from kvbridge.runtime.stats import TransferStats
from kvbridge.transports.base import Xfer
from kvbridge.wire.messages import Abort, Destination, Done, Heartbeat, LayerDone, Release, Reply

log = logging.getLogger(__name__)

_REMOTE = "prefill-writes"
"""Prefix of the in-flight keys standing for the prefill side's writes into a push
destination, one per source (:func:`_remote`)."""
_UNPACK = "unpack"
"""In-flight key of an unpack from staging into the request's blocks (packed path)."""


@dataclass
class _Source:
    """One prefill rank a request's KV comes from (several when the prefill instance
    has more TP ranks than ours: each holds some of our KV heads)."""

    address: str
    epoch: str | None = None
    peer: Peer | None = None
    xfer: Xfer | None = None
    """P-first: the posted read from this source."""
    read: bool = False
    """P-first: its read landed."""
    delivered: bool = False
    """Push: it has (or may have) our destination; only then may an ``Abort`` go to it
    from any thread (before, the destination's own thread sends it)."""

    @property
    def share(self) -> tuple[int, int]:
        """The fraction of each of our blocks this source writes, (numerator, denominator)."""
        split = None if self.peer is None else self.peer.split
        return (1, 1) if split is None else (sum(n for _, _, n in split.runs), split.local_parts)


def _of_another(src: _Source, epoch: str, pull: bool) -> bool:
    """Whether ``src`` is an instance other than ``epoch`` (the one now serving its
    address) that holds our request: a read posted to it, or our destination delivered
    to it. A destination still on its way finds the new instance by itself (it answers
    ``unknown_peer``, and we shake hands again)."""
    return src.peer is not None and src.peer.id.epoch != epoch and (pull or src.delivered)


def _remote(i: int) -> str:
    """In-flight key standing for source ``i``'s writes into a push destination."""
    return f"{_REMOTE}:{i}"


@dataclass
class _In:
    req: RecvRequest
    sources: list[_Source]
    block_ids: BlockTable
    num_tokens: int
    skip_tokens: int
    pull: bool
    remote_blocks: BlockTable
    coverage: np.ndarray | None = None
    """Push: (source, layer, block) landed."""
    started: float = 0.0
    nbytes: int = 0
    staging: Run | None = None
    """Packed path: our staging for every source's chunks (source ``i``'s head range of
    every layer and block from chunk ``first + i * layers * blocks``), reserved for all
    sources at once before any destination is sent, until the request ends."""
    wants_staging: bool = False
    """Packed path: waiting for free staging before the destinations are sent."""
    ticket: str = ""
    """The handoff's ticket, sent with every message about the transfer
    (:class:`~kvbridge.wire.messages.Abort`)."""


class Receiver:
    """Decode-side transfers of one worker. Thread-safe.

    ``on_outcome`` is called (from a kvbridge thread, lock held: it must not block or call
    back) whenever :meth:`take_finished` has something new.
    """

    def __init__(
        self,
        node: Node,
        stats: TransferStats,
        clock: Callable[[], float] = time.monotonic,
        on_outcome: Callable[[], None] = lambda: None,
    ) -> None:
        self.node = node
        self.stats = stats
        self.clock = clock
        self._on_outcome = on_outcome
        self.cfg = node.config
        self._layers = node.geometry.spec.num_layers
        self._lock = threading.Condition()
        self._in: dict[str, _In] = {}
        self._finished: list[str] = []
        self._failed: list[str] = []
        self._beats: dict[str, float] = {}
        self._beating: set[str] = set()
        """Prefill addresses with a heartbeat in flight: at most one each, so that a
        slow prefill's beats cannot pile up in the I/O pool ahead of destinations."""
        self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="kvbridge-recv-io")
        # the transport polls at its busy pace while receives are pending (their
        # notifications, and the writes into our blocks, need it), slowly otherwise
        self._expecting = lambda: bool(self._in)
        node.transport.add_demand(self._expecting)
        self._stop = False
        self._threads = [
            threading.Thread(target=self._control, name="kvbridge-recv-control", daemon=True),
            threading.Thread(target=self._notifications, name="kvbridge-recv-notify", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- engine-facing -------------------------------------------------------------------

    def expect_push(
        self,
        transfer_id: str,
        address: str | Sequence[str],
        block_ids: BlockTable | list[int],
        num_tokens: int,
        skip_tokens: int = 0,
        ticket: str = "",
    ) -> None:
        """Layer-wise push: ask the prefill worker at ``address`` to write the prompt's
        KV for tokens ``[skip_tokens, num_tokens)`` into ``block_ids`` (a table of
        several KV cache groups, :mod:`kvbridge.core.blocks`, where the engine keeps
        some: each layer gets its group's blocks, none where that is -1). A list of
        addresses: each of those prefill workers holds some of our KV heads and writes
        them (a prefill instance with more TP ranks than ours)."""
        addresses = [address] if isinstance(address, str) else list(address)
        self._push(
            self._new(
                transfer_id,
                [_Source(a) for a in addresses],
                block_ids,
                num_tokens,
                skip_tokens,
                pull=False,
                remote_blocks=[],
                ticket=ticket,
            )
        )

    def expect_pull(
        self,
        transfer_id: str,
        address: str | Sequence[str],
        epoch: str | Sequence[str | None] | None,
        remote_blocks: BlockTable | list[int],
        block_ids: BlockTable | list[int],
        num_tokens: int,
        skip_tokens: int = 0,
        ticket: str = "",
    ) -> None:
        """P-first: read ``remote_blocks`` (the prefill's, whole prompt) into ``block_ids``
        (D's, for tokens from ``skip_tokens``), then release them on the prefill side.
        Lists of addresses and epochs: read our KV heads from each of those prefill
        workers (their block ids are the same).

        Packed path: the prefill packs, so instead of reading we send each source our
        destination as in the push flow (the prefill, done computing, writes every layer
        at once into our staging and lets go by itself); the epochs are still checked."""
        addresses = [address] if isinstance(address, str) else list(address)
        epochs = (
            [epoch] * len(addresses) if epoch is None or isinstance(epoch, str) else list(epoch)
        )
        sources = [_Source(a, e) for a, e in zip(addresses, epochs, strict=True)]
        packed = self.node.packed is not None
        entry = self._new(
            transfer_id,
            sources,
            block_ids,
            num_tokens,
            skip_tokens,
            pull=not packed,
            remote_blocks=remote_blocks,
            ticket=ticket,
        )
        if packed:
            self._push(entry)
        else:
            self._pool.submit(self._start_read, entry)

    def release_idle(
        self,
        transfer_id: str,
        addresses: Sequence[str],
        epochs: Sequence[str | None],
        ticket: str = "",
    ) -> list[cf.Future[None]]:
        """Tell prefill workers this worker needs nothing from (idle replicas,
        :func:`~kvbridge.core.tp.idle_prefill_ranks`) to let go of ``transfer_id`` now,
        whether or not they track it yet. Fire and forget (pool threads, each bounded by
        ``timeouts.handshake_s``; the returned futures end when the messages did): if a
        message is lost, that worker's lease frees the blocks."""
        msg = Release(transfer_id=transfer_id, peer=self.node.id, ticket=ticket)
        return [
            self._pool.submit(self._let_go, msg, a, e, "idle prefill worker")
            for a, e in zip(addresses, epochs, strict=True)
        ]

    def forgo(
        self,
        transfer_id: str,
        addresses: Sequence[str],
        epochs: Sequence[str | None],
        reason: str,
        ticket: str = "",
    ) -> list[cf.Future[None]]:
        """Tell the prefill workers of ``transfer_id`` that this worker will not load
        it (its engine computes the prompt itself, e.g. vLLM for a request that asks
        for prompt logprobs), so they let go of its blocks now, whether or not they
        track it yet, instead of when their lease runs out. Fire and forget, as
        :meth:`release_idle`."""
        msg = Abort(transfer_id=transfer_id, peer=self.node.id, reason=reason, ticket=ticket)
        return [
            self._pool.submit(self._let_go, msg, a, e, "prefill worker")
            for a, e in zip(addresses, epochs, strict=True)
        ]

    def _let_go(self, msg: Release | Abort, address: str, epoch: str | None, who: str) -> None:
        try:
            self.node.connect(address, epoch=epoch)
            reply = self.node.client.request(address, msg, self.cfg.timeouts.handshake_s)
        except KVBridgeError as exc:
            log.warning(
                "kvbridge: could not tell %s %s to let go of %s (its lease will): %s",
                who,
                address,
                msg.transfer_id,
                exc,
            )
            return
        if isinstance(reply, Reply) and not reply.ok:
            log.warning(
                "kvbridge: %s %s refused to let go of %s: %s",
                who,
                address,
                msg.transfer_id,
                reply.detail or reply.code,
            )

    def refuse(
        self, transfer_id: str, block_ids: BlockTable | list[int], num_tokens: int, reason: str
    ) -> None:
        """Fail a load before it starts (the adapter found it cannot be served, e.g. the
        prefill instance is incompatible); reported by :meth:`take_finished` like any
        failed load."""
        entry = self._new(transfer_id, [], block_ids, num_tokens, 0, pull=False, remote_blocks=[])
        self._fail(entry, reason)

    def _new(
        self,
        transfer_id: str,
        sources: list[_Source],
        block_ids: BlockTable | list[int],
        num_tokens: int,
        skip_tokens: int,
        pull: bool,
        remote_blocks: BlockTable | list[int],
        ticket: str = "",
    ) -> _In:
        now = self.clock()
        block_ids = BlockTable.of(block_ids)
        entry = _In(
            req=RecvRequest(transfer_id, block_ids, self.cfg.timeouts, now),
            sources=sources,
            block_ids=block_ids,
            num_tokens=num_tokens,
            skip_tokens=skip_tokens,
            pull=pull,
            remote_blocks=BlockTable.of(remote_blocks),
            started=now,
            ticket=ticket,
        )
        with self._lock:
            if transfer_id in self._in:
                raise KVBridgeError(
                    f"transfer {transfer_id!r} is already expected by this decode worker"
                )
            self._in[transfer_id] = entry
            if not len(block_ids):  # D's prefix cache already holds everything
                entry.req.complete(now)
            self._lock.notify()
        self.node.transport.wake()
        return entry

    def abort(self, transfer_id: str, reason: str) -> bool:
        """The engine dropped the request; tell the prefill side to let go.

        Returns True if :meth:`take_finished` will still report ``transfer_id`` (its
        blocks are free once it does), False if it already did (they are free now).
        """
        with self._lock:
            entry = self._in.get(transfer_id)
            if entry is None:  # ended: reported already, or waiting to be taken
                return transfer_id in self._finished or transfer_id in self._failed
            if not entry.req.abort(reason, self.clock()):
                return True
            self._lock.notify()
            told = self._writing(entry)
        for i in told:
            self._pool.submit(
                self._tell,
                entry,
                i,
                self._abort(entry, reason),
            )
        return True

    def _abort(self, entry: _In, reason: str) -> Abort:
        """The ``Abort`` telling a source of ``entry`` to stop and let go."""
        return Abort(
            transfer_id=entry.req.transfer_id, peer=self.node.id, reason=reason, ticket=entry.ticket
        )

    def _release(self, entry: _In, ok: bool = True, reason: str = "") -> Release:
        """The ``Release`` telling a source of ``entry`` (P-first) that we read its part."""
        return Release(
            transfer_id=entry.req.transfer_id,
            peer=self.node.id,
            ok=ok,
            reason=reason,
            ticket=entry.ticket,
        )

    def take_finished(self) -> tuple[list[str], list[str]]:
        """(completed, failed) transfer ids since the last call; each exactly once."""
        with self._lock:
            done, failed = self._finished, self._failed
            self._finished, self._failed = [], []
        return done, failed

    def wait_finished(self, timeout: float) -> tuple[list[str], list[str]]:
        """Like :meth:`take_finished`, waiting up to ``timeout`` seconds for an outcome."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or self._failed or self._stop, timeout)
        return self.take_finished()

    def phase(self, transfer_id: str) -> RecvPhase | None:
        with self._lock:
            entry = self._in.get(transfer_id)
            return None if entry is None else entry.req.phase

    def phases(self) -> Counter[RecvPhase]:
        """How many expected requests are in each live phase (``ALLOCATED``,
        ``WAITING``, ``RECEIVING``); ended ones still settling are not counted.
        O(requests); any thread."""
        with self._lock:
            return Counter(entry.req.phase for entry in self._in.values() if not entry.req.terminal)

    # --- side-channel work (pool threads) --------------------------------------------------

    def _connect(self, entry: _In, i: int, fresh: bool = False) -> Peer:
        src = entry.sources[i]
        peer = self.node.connect(src.address, epoch=src.epoch, fresh=fresh)
        with self._lock:
            src.peer = peer
        return peer

    def _push(self, entry: _In) -> None:
        """Track what lands per source, layer and block; start sending destinations."""
        entry.coverage = np.zeros(
            (len(entry.sources), self._layers, len(entry.block_ids)), dtype=bool
        )
        self._pool.submit(self._start_push, entry)

    def _start_push(self, entry: _In) -> None:
        """Reserve the request's staging (packed path), then send every source our
        destination (a pool thread). Waiting for staging: the control thread goes on."""
        if self._reserve(entry):
            for i in range(len(entry.sources)):
                self._pool.submit(self._send_destination, entry, i)

    def _source_heads(self, entry: _In) -> int:
        """KV heads of ours each source writes: each of our heads comes from one source,
        and with several sources each holds an equal share (:mod:`kvbridge.core.tp`)."""
        return self.node.geometry.spec.num_kv_heads // max(1, len(entry.sources))

    def _reserve(self, entry: _In) -> bool:
        """Packed path: reserve staging for every source's chunks in one run (lock not
        held): a request never holds part of what it needs while waiting for the rest.
        False: the buffer is full now (the control thread tries again as slots free up)
        or the request ended."""
        packed = self.node.packed
        if packed is None or entry.staging is not None:
            return True
        need = len(entry.sources) * self._layers * len(entry.block_ids)
        heads = self._source_heads(entry)
        if packed.slots_for(need, heads) > packed.allocator.num_slots:
            self._fail(
                entry,
                f"the request's packed KV ({need} blocks) exceeds the staging buffer "
                f"({packed.allocator.num_slots} blocks): raise staging_mb",
            )
            return False
        run = packed.reserve(need, heads)
        with self._lock:
            entry.wants_staging = run is None
            if run is None:
                return False
            if entry.req.terminal:  # aborted meanwhile
                packed.release(run)
                return False
            entry.staging = run
        return True

    def _send_destination(self, entry: _In, i: int = 0) -> None:
        """Send source ``i`` our destination (a pool thread).

        Our blocks are held for the source (in-flight key :func:`_remote`) from before
        the destination may reach it until its writes are known to have stopped
        (coverage, its ``Done``, a ``stopped`` reply to our ``Abort``, or its death).
        If the request ended meanwhile, this thread tells the source to stop, after
        the destination: sent from another thread, an ``Abort`` could overtake it.
        """
        src, key = entry.sources[i], _remote(i)
        with self._lock:
            if entry.req.terminal:
                return
            entry.req.posted(key)
        maybe_held = False  # the source may hold our destination without our knowing
        reply: object = None
        try:
            for attempt in range(2):
                peer = self._connect(entry, i, fresh=attempt > 0)
                first = -1
                if entry.staging is not None:
                    if peer.heads is None or peer.heads[1] - peer.heads[0] != self._source_heads(
                        entry
                    ):
                        raise KVBridgeError(
                            f"prefill at {src.address} writes KV heads {peer.heads}, not "
                            f"{self._source_heads(entry)} of ours as one of {len(entry.sources)} "
                            "sources"
                        )
                    first = entry.staging.first + i * self._layers * len(entry.block_ids)
                block_ids, group_block_ids = entry.block_ids.to_wire()
                msg = Destination(
                    transfer_id=entry.req.transfer_id,
                    peer=self.node.id,
                    ticket=entry.ticket,
                    block_ids=block_ids,
                    num_tokens=entry.num_tokens,
                    skip_tokens=entry.skip_tokens,
                    staging_slot=first,
                    source=i,
                    group_block_ids=group_block_ids,
                )
                maybe_held = True
                reply = self.node.client.request(src.address, msg, self.cfg.timeouts.handshake_s)
                maybe_held = False
                if isinstance(reply, Reply) and reply.code == "unknown_peer":
                    continue  # the prefill instance restarted since our handshake
                break
            if not isinstance(reply, Reply) or not reply.ok:
                raise KVBridgeError(
                    f"prefill at {src.address} refused the destination: "
                    f"{getattr(reply, 'detail', reply)}"
                )
        except (KVBridgeError, WireError) as exc:
            with self._lock:
                if maybe_held:
                    src.delivered = True  # the failure below asks it to stop
                else:
                    entry.req.settled(key, self.clock())
            aborted = isinstance(reply, Reply) and reply.code == "aborted"
            self._fail(entry, f"destination not delivered: {exc}", aborted=aborted)
            return
        with self._lock:
            src.delivered = True
            # (RECEIVED is fine: the source may write everything before its reply reaches us)
            ended = entry.req.terminal and entry.req.phase is not RecvPhase.RECEIVED
            if not entry.req.terminal and entry.req.phase is RecvPhase.ALLOCATED:
                entry.req.destination_sent(self.clock())
        if ended:  # failed or aborted while the destination was on its way
            self._tell(
                entry,
                i,
                self._abort(entry, entry.req.reason or "aborted"),
            )

    def _start_read(self, entry: _In) -> None:
        """P-first: post a read from every source (a pool thread)."""
        skip = entry.skip_tokens // self.node.geometry.spec.block_size
        remote_blocks = entry.remote_blocks[skip : skip + len(entry.block_ids)]
        for i, src in enumerate(entry.sources):
            key = ("read", i)
            try:
                peer = self._connect(entry, i)
                local, lidx, remote, ridx = self.node.plan(
                    peer, entry.block_ids, remote_blocks, into_local=True
                )
                with self._lock:
                    if entry.req.terminal:  # it holds blocks for us that we will not read
                        stop = self._abort(entry, entry.req.reason or "aborted")
                        self._pool.submit(self._tell, entry, i, stop)
                        continue
                    if entry.req.phase is RecvPhase.ALLOCATED:
                        entry.req.destination_sent(self.clock())
                    entry.req.posted(key)
                xfer = self.node.transport.post("read", local, lidx, remote, ridx)
            except KVBridgeError as exc:
                with self._lock:
                    if key in entry.req._inflight_keys():
                        entry.req.settled(key, self.clock())
                self._fail(entry, f"read failed: {exc}")
                continue  # the other sources are told to let go
            with self._lock:
                src.xfer = xfer
                entry.nbytes += xfer.nbytes
                self._lock.notify()

    def _tell(self, entry: _In, i: int, msg: Release | Abort) -> None:
        """Send source ``i`` a Release or an Abort (a pool thread)."""
        try:
            reply = self.node.client.request(
                entry.sources[i].address, msg, self.cfg.timeouts.handshake_s
            )
        except KVBridgeError as exc:  # the prefill side's lease frees the blocks anyway
            log.info(
                "kvbridge: could not send %s for %s: %s",
                type(msg).__name__,
                entry.req.transfer_id,
                exc,
            )
            return
        if isinstance(reply, Reply) and reply.code == "stopped":
            with self._lock:  # the prefill side holds nothing for it: no write can follow
                self._writes_stopped(entry, self.clock(), i)
                self._lock.notify()

    def _heartbeat(self, address: str, epoch: str) -> None:
        """One beat (a pool thread; the next one for ``address`` is due once it ended)."""
        try:
            self._beat_once(address, epoch)
        finally:
            with self._lock:
                self._beating.discard(address)

    def _beat_once(self, address: str, epoch: str) -> None:
        """One beat: a new epoch or a closed port fails the peer's transfers at once. No
        reply while the port still accepts connections is a busy peer (its side-channel
        thread waits for the GIL, e.g. through a compilation), not a dead one: its
        transfers keep their own deadlines (``receive_s``, ``transfer_s``).

        ``epoch``: the one a transfer that asked for this beat shook hands with. The
        instance that answers may be a newer one on the same port, which later transfers
        already shook hands with: only transfers from another epoch than the one that
        answers are gone (and the cached handshake only if it is of another epoch)."""
        current: str | None = None
        """The epoch serving ``address`` now; None: nothing usable serves it."""
        try:
            try:
                reply = self.node.client.request(
                    address, Heartbeat(peer=self.node.id), 3 * self.cfg.timeouts.heartbeat_s
                )
            except PeerUnreachableError:
                if listening(address, timeout=self.cfg.timeouts.heartbeat_s):
                    log.info(
                        "kvbridge: prefill at %s is slow to answer heartbeats but still listening",
                        address,
                    )
                    return
                raise
            if not isinstance(reply, Reply):
                raise WireError(f"unexpected {type(reply).__name__} to a heartbeat")
            current = reply.epoch
            reason = f"prefill at {address} restarted (epoch {current}); its KV is gone"
        except (KVBridgeError, WireError) as exc:
            reason = str(exc)
        if current != epoch:
            self.node.forget(address, unless_epoch=current)
        with self._lock:
            victims = []
            for e in self._in.values():
                gone = [
                    i
                    for i, src in enumerate(e.sources)
                    if src.address == address
                    and _remote(i) in e.req._inflight_keys()
                    and (current is None or _of_another(src, current, e.pull))
                ]
                for i in gone:
                    # it is gone: no more writes from it
                    self._writes_stopped(e, self.clock(), i)
                if gone and not e.pull:
                    victims.append(e)
        for e in victims:
            self._fail(e, f"prefill instance lost: {reason}")

    # --- notifications thread ------------------------------------------------------------

    def _notifications(self) -> None:
        """The notifications thread: no notification, however malformed or hostile, ends
        it; one that fails is dropped with one log line (and counted)."""
        while not self._stop:
            try:
                notes = self.node.transport.take_notifications(timeout=0.1)
            except Exception:  # the transport's inbox; retried next turn
                log.exception("kvbridge: taking notifications failed")
                continue
            for note in notes:
                try:
                    self._on_note(note.peer, note.payload)
                except Exception as exc:  # noqa: BLE001 - one message never ends the loop
                    self.stats.add(messages_refused=1)
                    log.warning(
                        "kvbridge: dropped a notification from %s: %s",
                        note.peer,
                        exc if isinstance(exc, WireError) else f"{type(exc).__name__}: {exc}",
                    )

    def _on_note(self, sender: str, payload: bytes) -> None:
        msg = self.node.decode_note(payload, sender)
        if not isinstance(msg, (LayerDone, Done)):
            raise WireError(f"unexpected {type(msg).__name__} as a notification")
        with self._lock:
            entry = self._in.get(msg.transfer_id)
            if entry is None:
                return  # late news of a finished request: ignored
            if not 0 <= msg.source < len(entry.sources):
                raise WireError(f"{msg.transfer_id}: notification from source {msg.source}")
            peer = entry.sources[msg.source].peer
            if peer is None or peer.agent != sender:
                raise WireError(
                    f"{type(msg).__name__} for {msg.transfer_id} does not come from its source "
                    f"({'unknown yet' if peer is None else peer.agent})"
                )
        if isinstance(msg, LayerDone):
            self._on_layers(msg)
            return
        with self._lock:
            self._writes_stopped(entry, self.clock(), msg.source)  # Done comes after its last write
        if not msg.ok:
            self._fail(entry, f"prefill gave up: {msg.reason}", aborted=msg.aborted)

    def _writes_stopped(self, entry: _In, now: float, i: int | None = None) -> None:
        """Source ``i`` (default: every source) will not write into this destination
        any more (lock held)."""
        if entry.coverage is None:
            return
        for j in range(len(entry.sources)) if i is None else (i,):
            if _remote(j) in entry.req._inflight_keys():
                entry.req.settled(_remote(j), now)

    def _on_layers(self, msg: LayerDone) -> None:
        with self._lock:
            entry = self._in.get(msg.transfer_id)
            if entry is None or entry.coverage is None or entry.req.phase is RecvPhase.RECEIVED:
                return  # late data for a finished request: ignored
            end = msg.first_block + msg.num_blocks
            if (
                not 0 <= msg.source < len(entry.sources)
                or msg.first_block < 0
                or end > entry.coverage.shape[2]
                or not all(0 <= layer < self._layers for layer in msg.layers)
            ):
                log.warning(
                    "kvbridge: %s: notification for blocks outside the destination", msg.transfer_id
                )
                return
            src = entry.sources[msg.source]
            unpack = (
                self.node.packed is not None
                and entry.staging is not None
                and not entry.req.terminal
            )
            if unpack:  # the blocks stay ours until the unpack is done
                entry.req.posted(_UNPACK)
        if unpack:  # the bytes are in our staging slots: into the cache
            try:
                self._unpack(entry, msg)
            except Exception as exc:  # noqa: BLE001 - a failed unpack fails the load, never the thread
                with self._lock:
                    entry.req.settled(_UNPACK, self.clock())
                self._fail(entry, f"unpacking layers {msg.layers} failed: {exc}")
                return
        now = self.clock()
        with self._lock:
            if unpack:
                entry.req.settled(_UNPACK, now)
            entry.coverage[msg.source, msg.layers, msg.first_block : end] = True
            entry.nbytes += self._written(entry, src, msg.layers, msg.first_block, end)
            entry.req.layer_arrived(now)
            if entry.coverage[msg.source].all():
                self._writes_stopped(entry, now, msg.source)
            if entry.coverage.all():
                entry.req.complete(now)
            self._lock.notify()

    def _written(self, entry: _In, src: _Source, layers: list[int], first: int, end: int) -> int:
        """Bytes ``src`` wrote for ``layers`` at positions ``[first, end)``: what it sends
        of one block of a layer, for every (layer, block) pair our blocks hold (all,
        except where a layer's KV cache group holds no block: a sliding window's
        positions before it, a state-space group's all but the last)."""
        groups = self.node.codec.compat.layer_groups
        held = (entry.block_ids.rows[:, first:end] != NONE).sum(axis=1) if groups else None
        return sum(
            int(held[groups[layer]] if held is not None else end - first)
            * self._block_bytes(src, layer)
            for layer in layers
        )

    def _block_bytes(self, src: _Source, layer: int) -> int:
        """Bytes source ``src`` sends per block of ours in ``layer``: a packed chunk of
        its heads, or its share of the block in every plane."""
        if self.node.packed is not None and src.peer is not None and src.peer.heads is not None:
            h0, h1 = src.peer.heads
            return self.node.packed.chunk(h1 - h0).nbytes
        geo = self.node.geometry
        if src.peer is not None and src.peer.cut is not None:
            return src.peer.cut.layer_bytes(layer) * geo.spec.planes_per_layer
        num, den = src.share
        return geo.layer_block_bytes(layer) * geo.spec.planes_per_layer * num // den

    def _unpack(self, entry: _In, msg: LayerDone) -> None:
        """Unpack the layers a ``LayerDone`` announced from the source's staging chunks
        into its heads of our blocks (the notifications thread; the request keeps its
        staging until it ends)."""
        packed, nb = self.node.packed, len(entry.block_ids)
        blocks = entry.block_ids[msg.first_block : msg.first_block + msg.num_blocks]
        first = entry.staging.first + msg.source * self._layers * nb + msg.first_block
        heads = entry.sources[msg.source].peer.heads
        groups = self.node.codec.compat.layer_groups
        for layer in msg.layers:
            row = blocks.row(groups[layer] if groups else 0)
            # a sliding group's positions before its window got nothing
            held = np.flatnonzero(row != NONE)
            for run in np.split(held, np.flatnonzero(np.diff(held) != 1) + 1) if held.size else ():
                a, b = int(run[0]), int(run[-1]) + 1
                packed.unpack(layer, row[a:b].tolist(), first + layer * nb + a, heads=heads)

    # --- control thread ------------------------------------------------------------------

    def _control(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                # reads of ended requests too: their blocks are ours until the read lands
                reads = [
                    (e, i)
                    for e in self._in.values()
                    for i, src in enumerate(e.sources)
                    if src.xfer is not None
                ]
            for entry, i in reads:
                self._poll_read(entry, i)
            self._retry_staging()
            self._beat()
            self._settle()
            with self._lock:
                if self._stop:
                    return
                self._lock.wait(0.0005 if reads else 0.05)

    def _poll_read(self, entry: _In, i: int) -> None:
        src = entry.sources[i]
        assert src.xfer is not None
        try:
            done = self.node.transport.poll(src.xfer)
            error = None
        except KVBridgeError as exc:
            done, error = True, exc
        if not done:
            return
        self.node.transport.release(src.xfer)
        now = self.clock()
        with self._lock:
            src.xfer = None
            src.read = error is None
            entry.req.settled(("read", i), now)
            if all(s.read for s in entry.sources):
                entry.req.complete(now)
        if error is not None:
            self._fail(entry, f"read failed: {error}")
            self._pool.submit(
                self._tell,
                entry,
                i,
                self._release(entry, ok=False, reason=str(error)),
            )
        else:
            self._pool.submit(
                self._tell,
                entry,
                i,
                self._release(entry),
            )

    def _retry_staging(self) -> None:
        """Send the destinations that waited for staging slots, if some were freed."""
        with self._lock:
            waiting = [e for e in self._in.values() if e.wants_staging and not e.req.terminal]
        for entry in waiting:
            if self._reserve(entry):
                for i in range(len(entry.sources)):
                    self._pool.submit(self._send_destination, entry, i)

    def _beat(self) -> None:
        now = self.clock()
        with self._lock:  # also ended requests whose sources may still write: a death settles them
            waiting = {
                (e.sources[i].address, e.sources[i].peer.id.epoch)
                for e in self._in.values()
                if not e.pull
                for i in (range(len(e.sources)) if not e.req.terminal else self._writing(e))
                if e.sources[i].peer is not None
            }
        for address, epoch in waiting:
            with self._lock:
                if address in self._beating or now < self._beats.get(address, 0.0):
                    continue
                self._beats[address] = now + self.cfg.timeouts.heartbeat_s
                self._beating.add(address)
            self._pool.submit(self._heartbeat, address, epoch)

    def _settle(self) -> None:
        now = self.clock()
        with self._lock:
            deadline_failed = []
            for tid, entry in list(self._in.items()):
                if (
                    entry.req.poll(now)
                    and entry.req.phase is RecvPhase.FAILED
                    and entry.req.inflight
                ):
                    self.stats.add(failures=1)
                    log.warning("kvbridge: receiving %s failed: %s", tid, entry.req.reason)
                    deadline_failed += [(entry, i) for i in self._writing(entry)]
                if entry.req.releasable:
                    entry.req.release()
                    del self._in[tid]
                    if entry.staging is not None:  # no write can land any more
                        self.node.packed.release(entry.staging)
                        entry.staging = None
                    if entry.req.phase is RecvPhase.RECEIVED:
                        self._finished.append(tid)
                        self.stats.add(requests_received=1, bytes_received=entry.nbytes)
                    else:
                        self._failed.append(tid)
                    self._lock.notify_all()
                    self._on_outcome()
        for entry, i in deadline_failed:  # timed out: ask the prefill side to stop writing
            self._pool.submit(
                self._tell,
                entry,
                i,
                self._abort(entry, entry.req.reason or "timeout"),
            )

    @staticmethod
    def _writing(entry: _In) -> list[int]:
        """Push: sources that have our destination and may still write, to tell to stop
        when the request ends (lock held). P-first has none: a posted read sends its
        ``Release`` when it lands, and :meth:`_start_read` tells the sources it did not
        read from yet."""
        if entry.pull:
            return []
        keys = entry.req._inflight_keys()
        return [i for i, src in enumerate(entry.sources) if src.delivered and _remote(i) in keys]

    def _fail(self, entry: _In, reason: str, aborted: bool = False) -> None:
        """End ``entry`` as failed (the engine is told its blocks hold no KV) and ask its
        sources to stop. ``aborted``: the prefill's engine ended the request first (its
        client went away); counted as aborted, not as a failure."""
        with self._lock:
            ended = entry.req.fail(reason, self.clock())
            if ended and aborted:
                self.stats.add(aborted=1)
                log.info("kvbridge: receiving %s ended: %s", entry.req.transfer_id, reason)
            elif ended:
                self.stats.add(failures=1)
                log.warning("kvbridge: receiving %s failed: %s", entry.req.transfer_id, reason)
            writing = self._writing(entry) if ended else []
            self._lock.notify()
        for i in writing:  # those sources may still be writing: ask them to stop
            self._pool.submit(
                self._tell,
                entry,
                i,
                self._abort(entry, reason),
            )

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        for t in self._threads:
            t.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.node.transport.remove_demand(self._expecting)


__all__ = ["Receiver"]
