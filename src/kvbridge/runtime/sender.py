"""Prefill side: hold a request's blocks, write them to the decode side, release them.

Who calls what (the engine adapter, on the prefill worker):

- :meth:`Sender.track` when a request that will be handed off starts prefill (its
  blocks are held from then on, under a lease), and :meth:`Sender.add_blocks` with
  each later chunk's new blocks; both before the forward pass that first writes them
  (``wire_dtype: fp8`` may clear the prompt's partial last block then);
- :meth:`Sender.layer_done` from the forward pass, after each attention layer, with
  how many prompt tokens that layer has computed so far (every chunk of a chunked
  prefill). O(1), never blocks: the sender thread does the I/O;
- :meth:`Sender.prefill_done` when the last chunk is computed;
- on GPU caches both pass ``ready``, a device event recorded on the stream that
  computes the layer (anything with ``query()``): the host calls them when it has
  *queued* the layer's kernels, so nothing of that layer is posted before the event
  has completed (the sender thread polls it; past ``timeouts.transfer_s`` the
  request fails);
- :meth:`Sender.take_released` once per engine step: requests whose blocks the engine
  may free now (sent, expired, aborted or failed; in every case no transfer still
  reads them). Each transfer id is returned exactly once.

The decode side drives the rest through the side channel: ``Destination`` (layer-wise
push: where to write; it may arrive before or after :meth:`track`, before, during or
after the prefill), ``Release`` (P-first: D has read the blocks itself; on the packed
path a P-first decode sends a ``Destination`` instead and the request, computed,
is written at once like a pushed one; either flow: from the decode rank this rank is
*idle* for, :func:`~kvbridge.core.tp.idle_prefill_ranks`, which needs nothing from it:
it may come before :meth:`track` too), ``Abort`` (D gave up, or will not load the
request at all; it too may come before :meth:`track`).
When the decode instance has more TP ranks than ours, each of the ``Peer.fanout``
decode ranks this rank feeds sends its own ``Destination`` (or ``Release``), gets its
head range of every block (packed separately for each on the packed path), and the
blocks are released once all of them are served.

Writes: for every layer, the blocks that are both computed and not yet sent (and that
the decode side lacks) are planned against the peer's slot table and posted, each
write carrying a ``LayerDone`` naming its layers and destination blocks; layers ready
at the same time go out as one transfer. Short prompts (``layerwise_min_tokens``) and
``layerwise: false`` send everything in one transfer after the prefill.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kvbridge.core.blocks import NONE, BlockTable
from kvbridge.core.lifecycle import EndedTransfers, SendPhase, SendRequest
from kvbridge.core.plan import held_positions, layers_by_group
from kvbridge.errors import KVBridgeError
from kvbridge.runtime.node import Node, Peer
from kvbridge.runtime.packed import Run
from kvbridge.runtime.stats import TransferStats
from kvbridge.transports.base import Xfer
from kvbridge.wire.messages import Abort, Destination, Done, LayerDone, Release, Reply

log = logging.getLogger(__name__)

MAX_EARLY_TRANSFERS = 4096
"""Transfers not tracked yet that may have messages waiting (a decode may reach a prefill
worker before its engine schedules the request; more than this many at once is a flood)."""
MAX_EARLY_PER_TRANSFER = 16
"""Messages kept per such transfer (one destination, release or abort per decode rank)."""
MAX_EARLY_BLOCK_IDS = 1 << 22
"""Block ids all those messages may carry together (about 40 bytes each as Python ints:
some 170 MB at most; a destination may carry up to
:data:`~kvbridge.wire.messages.MAX_BLOCK_IDS`, so the count bound alone allows far more)."""


def _block_ids(msg: Destination | Release | Abort) -> int:
    """Block ids a message kept early holds (what its memory grows with)."""
    if not isinstance(msg, Destination):
        return 0
    return len(msg.block_ids) + sum(len(ids) for ids in msg.group_block_ids)


def _same_party(a: Destination | Release | Abort, b: Destination | Release | Abort) -> bool:
    """Whether two messages come from one decode instance with one ticket."""
    return a.ticket == b.ticket and a.peer.engine_id == b.peer.engine_id


class Ready(Protocol):
    """A device event: ``query()`` is True once the work queued before it has completed
    (``torch.cuda.Event``)."""

    def query(self) -> bool: ...


class _Gate(NamedTuple):
    """Readiness waiting for ``ready``: ``layer`` holds ``tokens`` prompt tokens (layer
    :data:`_EVERY`: every layer does; None: the prefill is done)."""

    ready: Ready
    transfer_id: str
    layer: int | None
    tokens: int
    since: float


_EVERY = -1
"""A gate's layer: the request's cached prefix, in every layer."""


@dataclass
class _Dest:
    """One decode rank's destination for a transfer."""

    msg: Destination
    peer: Peer
    posted: list[int]
    """Per layer: prompt blocks posted to it so far (absolute index)."""
    blocks: BlockTable
    """The destination's blocks (``msg``'s, in every KV cache group)."""


@dataclass
class _Out:
    req: SendRequest
    blocks: BlockTable
    num_tokens: int
    stream: bool
    pull: bool
    ready: list[int]
    """Per layer: prompt tokens computed so far."""
    prefill_done: bool = False
    dests: list[_Dest] = field(default_factory=list)
    """Destinations so far: one per decode rank this rank feeds (``Peer.fanout``; 1
    unless the decode instance has more TP ranks than this one)."""
    released_by: set[str] = field(default_factory=set)
    """P-first: decode ranks (engine/rank/epoch) that read their part and said Release."""
    ticket: str = ""
    """The handoff's ticket; every message acting on the transfer must carry it ("": none
    was given, e.g. a caller that predates tickets: then only the owner check applies)."""
    owner: str | None = None
    """The decode instance (engine id) whose destination or release was accepted first;
    messages from any other instance are refused."""
    t_prefill_done: float | None = None
    t_first_post: float | None = None
    inflight: dict[int, tuple[Xfer, float, Run | None]] = field(default_factory=dict)
    """Posted writes: key -> (transfer, post time, staging it reads or None)."""


class Sender:
    """Prefill-side transfers of one worker. Thread-safe.

    Args:
        node: this worker's node (transport, geometry, peers).
        stats: where transfer statistics are recorded.
        clock: monotonic seconds (tests may inject one).
        on_outcome: called (from the sender thread, lock held: it must not block or call
            back) whenever :meth:`take_released` has something new.
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
        self._bs = node.geometry.spec.block_size
        self._layers = node.geometry.spec.num_layers
        self._lock = threading.Condition()
        self._out: dict[str, _Out] = {}
        self._readable: set[str] = set()
        """P-first transfers whose prompt is computed: their decode may read the blocks
        now, which over some backends (UCX over TCP) needs this side's progress."""
        # the transport polls at its busy pace while a decode may read from us, slowly
        # otherwise: our own writes keep it busy while in flight (the transport's rule),
        # and nothing else here needs it. Tracked transfers alone do not: a busy pace
        # through the prefill's forward takes its core from the forward (measured: 6 ms
        # of a 120 ms forward on one core)
        self._holding = lambda: bool(self._readable)
        node.transport.add_demand(self._holding)
        self._early: dict[str, list[tuple[Destination | Release | Abort, float]]] = {}
        """Destinations (and idle ranks' releases, and aborts) that came before
        :meth:`track`, with the time they are dropped; unauthorised until then (the
        ticket is checked at :meth:`track`), so bounded: :data:`MAX_EARLY_TRANSFERS`
        transfers, :data:`MAX_EARLY_PER_TRANSFER` messages each,
        :data:`MAX_EARLY_BLOCK_IDS` block ids in all."""
        self._early_ids = 0
        """Block ids the messages in :attr:`_early` carry."""
        self._early_order: deque[tuple[float, str]] = deque()
        """(drop time, transfer id) per message kept early, oldest first (the lease is
        the same for all): the sender thread drops expired ones without visiting the
        others."""
        self._released: list[str] = []
        self._never_sent = EndedTransfers()
        """Transfers whose request the engine ended before this worker tracked it
        (:meth:`never_sent`), with why: a destination that comes later is answered
        ``aborted`` at once."""
        self._ended = EndedTransfers()
        """Released transfers and how they ended: a destination that comes later is
        refused at once (its decode side fails the load instead of waiting)."""
        self._gates: deque[_Gate] = deque()
        """Readiness behind device events, in the order the engine queued it."""
        self._keys = itertools.count()
        self._stop = False
        self._starved = False  # a packed post waits for staging slots
        self._thread = threading.Thread(target=self._run, name="kvbridge-sender", daemon=True)
        self._thread.start()

    # --- engine-facing -------------------------------------------------------------------

    def track(
        self,
        transfer_id: str,
        blocks: BlockTable | list[int],
        num_tokens: int,
        computed_tokens: int = 0,
        pull: bool = False,
        ready: Ready | None = None,
        ticket: str = "",
    ) -> None:
        """Start holding ``blocks`` (the prompt's, in order; a table of several KV cache
        groups, :mod:`kvbridge.core.blocks`, where the engine keeps some) for
        ``transfer_id``.

        ``computed_tokens``: tokens already in the cache before this prefill (prefix
        cache hits), ready in every layer (once ``ready`` has completed, when given: an
        earlier forward still running on the device may be writing them). ``pull``:
        P-first flow, the decode side reads the blocks itself and sends ``Release``.
        ``ticket``: the handoff's (:class:`~kvbridge.wire.messages.Abort`); messages for
        the transfer that do not carry it are refused, those that came early dropped.
        """
        now = self.clock()
        blocks = BlockTable.of(blocks)
        with self._lock:
            if transfer_id in self._out:
                raise KVBridgeError(
                    f"transfer {transfer_id!r} is already tracked by this prefill worker"
                )
            stream = self.cfg.layerwise and num_tokens >= self.cfg.layerwise_min_tokens
            out = _Out(
                req=SendRequest(transfer_id, blocks, self.cfg.timeouts, now),
                blocks=blocks,
                num_tokens=num_tokens,
                stream=stream,
                pull=pull,
                ready=[0 if ready is not None else computed_tokens] * self._layers,
                ticket=ticket,
            )
            self._out[transfer_id] = out
            if ready is not None and computed_tokens:
                self._gates.append(_Gate(ready, transfer_id, _EVERY, computed_tokens, now))
            self._clear_tail(out, 0, blocks)
            refused: list[tuple[Peer, Done]] = []
            for msg, _ in self._drop_early(transfer_id, lambda msg, deadline: False):
                why = None  # why the message is refused, if it is
                if (reply := self._forbidden(out, msg)) is not None:
                    why = reply.detail
                elif isinstance(msg, Release):
                    self._release(out, msg, now)
                elif isinstance(msg, Abort):
                    if out.req.abort(f"decode side aborted: {msg.reason}", now):
                        self.stats.add(aborted=1)
                else:
                    why = self._accept(out, msg, now)
                if why is not None:
                    refused += self._nothing_for(msg, why)
            self._lock.notify()
        self._tell(refused)

    def add_blocks(self, transfer_id: str, blocks: BlockTable | list[int]) -> None:
        """More blocks of the same prompt (a later chunk of a chunked prefill)."""
        blocks = BlockTable.of(blocks)
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None or out.req.terminal:
                return
            self._clear_tail(out, len(out.blocks), blocks)
            out.blocks = out.blocks + blocks
            out.req.hold(blocks)

    def _clear_tail(self, out: _Out, first: int, blocks: BlockTable) -> None:
        """Packed path: zero the prompt's partial last block if it is among ``blocks``
        (new, prompt blocks ``first`` onwards), before the engine writes it (see
        :meth:`~kvbridge.runtime.packed.PackedPath.clear`)."""
        packed = self.node.packed
        if packed is None or not packed.mixes_tokens or out.num_tokens % self._bs == 0:
            return
        last = out.num_tokens // self._bs - first  # its index in ``blocks``
        if 0 <= last < len(blocks):
            for block in blocks.rows[:, last].tolist():  # in every KV cache group that holds one
                if block != NONE:
                    packed.clear(block)

    def layer_done(
        self, transfer_id: str, layer: int, computed_tokens: int, ready: Ready | None = None
    ) -> None:
        """``layer`` holds KV for the first ``computed_tokens`` prompt tokens (once
        ``ready`` has completed, when given). Hot path."""
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                return
            if ready is None:
                self._set_ready(out, layer, computed_tokens)
            elif out.stream:  # else only prefill_done (and its own event) makes it sendable
                self._gates.append(_Gate(ready, transfer_id, layer, computed_tokens, self.clock()))
                self._lock.notify()

    def _set_ready(self, out: _Out, layer: int, computed_tokens: int) -> None:
        if computed_tokens > out.ready[layer]:
            out.ready[layer] = computed_tokens
            if out.stream and out.dests:
                self._lock.notify()

    def prefill_done(self, transfer_id: str, ready: Ready | None = None) -> None:
        """Every layer holds the whole prompt (once ``ready`` has completed, when given)."""
        now = self.clock()
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                return
            if ready is not None:
                self._gates.append(_Gate(ready, transfer_id, None, out.num_tokens, now))
                self._lock.notify()
            else:
                self._set_done(out, now)

    def _set_done(self, out: _Out, now: float) -> None:
        out.ready = [out.num_tokens] * self._layers
        out.prefill_done = True
        out.t_prefill_done = now
        if out.pull and not out.req.terminal:  # the engine hands the decode our blocks now
            self._readable.add(out.req.transfer_id)
            self.node.transport.wake()
        self._lock.notify()

    def _open_gates(self) -> bool:
        """Apply the readiness whose events have completed, oldest first; a gate past
        ``timeouts.transfer_s`` fails its request (lock held). True while some wait."""
        now = self.clock()
        while self._gates:
            gate = self._gates[0]
            out = self._out.get(gate.transfer_id)
            if out is not None and not out.req.terminal and not gate.ready.query():
                if now - gate.since <= self.cfg.timeouts.transfer_s:
                    return True  # the stream reaches the later ones after this one
                what = {None: "the prefill", _EVERY: "its cached prefix"}.get(
                    gate.layer, f"layer {gate.layer}"
                )
                self._fail(
                    out,
                    f"the engine's device did not finish computing {what} within "
                    "timeouts.transfer_s "
                    f"({self.cfg.timeouts.transfer_s:g} s): is the GPU stalled?",
                    now,
                )
            elif out is not None and not out.req.terminal:
                if gate.layer is None:
                    self._set_done(out, now)
                elif gate.layer == _EVERY:
                    for layer in range(self._layers):
                        self._set_ready(out, layer, gate.tokens)
                else:
                    self._set_ready(out, gate.layer, gate.tokens)
            self._gates.popleft()
        return False

    def abort(self, transfer_id: str, reason: str) -> None:
        """The engine gave up on the request (client gone, ...)."""
        with self._lock:
            out = self._out.get(transfer_id)
            if out is not None and out.req.abort(reason, self.clock()):
                self.stats.add(aborted=1)
                self._lock.notify()

    def never_sent(self, transfer_id: str, reason: str) -> None:
        """The engine ended the request of ``transfer_id`` before this worker tracked it
        (aborted while queued: its client went away), so nothing will be sent. Any
        thread, once per such request. A decode whose destination waits here is told now
        (a ``Done`` marked ``aborted``: it counts no failure), one whose destination
        comes later is answered ``aborted`` at once; either would otherwise wait
        out ``timeouts.receive_s``, holding its blocks. A transfer tracked meanwhile
        ends the usual way."""
        told: list[tuple[Peer, Done]] = []
        with self._lock:
            if (
                transfer_id in self._out
                or transfer_id in self._ended
                or transfer_id in self._never_sent
            ):
                return
            self._never_sent.add(transfer_id, reason)
            for msg, _ in self._drop_early(transfer_id, lambda msg, deadline: False):
                told += self._nothing_for(msg, reason, aborted=True)
        self._tell(told)

    def _nothing_for(
        self, msg: Destination | Release | Abort, why: str, aborted: bool = False
    ) -> list[tuple[Peer, Done]]:
        """The failed ``Done`` (for :meth:`_tell`) that tells the decode behind an early
        ``msg`` now, rather than at its deadline, that nothing will be written for it:
        only a destination waits for writes, and only a peer we shook hands with can be
        told (lock held)."""
        peer = self.node.peer(msg.peer)
        if not isinstance(msg, Destination) or peer is None:
            return []
        note = Done(
            transfer_id=msg.transfer_id, ok=False, reason=why, source=msg.source, aborted=aborted
        )
        return [(peer, note)]

    def take_released(self) -> list[str]:
        """Transfer ids whose blocks the engine may free now, each exactly once."""
        with self._lock:
            out, self._released = self._released, []
        return out

    def wait_released(self, timeout: float) -> list[str]:
        """Like :meth:`take_released`, waiting up to ``timeout`` seconds for one."""
        with self._lock:
            self._lock.wait_for(lambda: self._released or self._stop, timeout)
        return self.take_released()

    def phase(self, transfer_id: str) -> SendPhase | None:
        with self._lock:
            out = self._out.get(transfer_id)
            return None if out is None else out.req.phase

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._out)

    def phases(self) -> Counter[SendPhase]:
        """How many tracked requests are in each live phase (``HELD``, ``SENDING``);
        ended ones still draining are not counted. O(requests); any thread."""
        with self._lock:
            return Counter(out.req.phase for out in self._out.values() if not out.req.terminal)

    # --- side-channel handlers (the side channel's thread) -------------------------------

    def on_destination(self, msg: Destination) -> Reply:
        now = self.clock()
        with self._lock:
            out = self._out.get(msg.transfer_id)
            if out is None and (why := self._never_sent.get(msg.transfer_id)) is not None:
                return Reply(
                    ok=False,
                    code="aborted",
                    detail=f"transfer {msg.transfer_id} was never sent: {why}",
                    epoch=self.node.id.epoch,
                )
            if out is None:
                how = self._ended.get(msg.transfer_id)
                if how is not None:  # e.g. the engine aborted or preempted the request first
                    return Reply(
                        ok=False,
                        code="error",
                        detail=(
                            f"transfer {msg.transfer_id} already ended on this prefill worker "
                            f"({how})"
                        ),
                        epoch=self.node.id.epoch,
                    )
                # D may see the request before this prefill worker does: keep it
                return self._keep_early(msg, now)
            if (refused := self._forbidden(out, msg)) is not None:
                return refused
            if out.req.terminal:
                return Reply(
                    ok=False,
                    code="error",
                    detail=(
                        f"transfer {msg.transfer_id} already ended ({out.req.phase.value}: "
                        f"{out.req.reason})"
                    ),
                )
            if any(d.msg.peer == msg.peer for d in out.dests):
                return Reply(
                    ok=False,
                    code="error",
                    detail=f"transfer {msg.transfer_id} already has a destination from {msg.peer}",
                )
            err = self._accept(out, msg, now)
            self._lock.notify()
        if err:
            return Reply(ok=False, code="error", detail=err, epoch=self.node.id.epoch)
        return Reply(ok=True, epoch=self.node.id.epoch)

    def _accept(self, out: _Out, msg: Destination, now: float) -> str | None:
        """Attach a destination (lock held). Returns an error text, or None."""
        expected = math.ceil(out.num_tokens / self._bs) - msg.skip_tokens // self._bs
        if (
            msg.num_tokens != out.num_tokens
            or len(msg.block_ids) != expected
            or msg.skip_tokens % self._bs
        ):
            reason = (
                f"destination of {msg.transfer_id} does not fit: {len(msg.block_ids)} blocks for "
                f"tokens [{msg.skip_tokens}, {msg.num_tokens}), this prefill has {out.num_tokens} "
                f"tokens in blocks of {self._bs}"
            )
            out.req.fail(reason, now)
            return reason
        peer = self.node.peer(msg.peer)
        if peer is None:
            out.req.fail(f"destination from {msg.peer}, which never shook hands", now)
            return "unknown peer"
        try:
            blocks = BlockTable.from_wire(msg.block_ids, msg.group_block_ids)
        except KVBridgeError as exc:
            reason = f"destination of {msg.transfer_id} from {msg.peer} is malformed: {exc}"
            out.req.fail(reason, now)
            return reason
        if blocks.num_groups != out.blocks.num_groups:
            reason = (
                f"destination of {msg.transfer_id} from {msg.peer} has blocks of "
                f"{blocks.num_groups} KV cache groups, "
                f"this prefill's request {out.blocks.num_groups}"
            )
            out.req.fail(reason, now)
            return reason
        if peer.split is not None and peer.split.idle:
            reason = (
                f"destination of {msg.transfer_id} from {msg.peer}, for which this prefill rank "
                "holds no KV heads (it is idle for it)"
            )
            out.req.fail(reason, now)
            return reason
        if len(out.dests) >= peer.fanout:
            reason = (
                f"destination of {msg.transfer_id} from {msg.peer}: this prefill rank already has "
                f"the {peer.fanout} it sends to"
            )
            out.req.fail(reason, now)
            return reason
        if out.pull:
            if self.node.packed is None:  # the decode side reads P-first requests itself
                reason = (
                    f"destination of {msg.transfer_id} from {msg.peer}: the request is P-first, "
                    "its decode side reads the blocks"
                )
                out.req.fail(reason, now)
                return reason
            out.pull = False  # packed: P-first requests are written like pushed ones
        out.dests.append(_Dest(msg=msg, peer=peer, posted=[0] * self._layers, blocks=blocks))
        if out.req.phase is SendPhase.HELD:
            out.req.start_sending(now)
        return None

    def on_release(self, msg: Release) -> Reply:
        now = self.clock()
        with self._lock:
            out = self._out.get(msg.transfer_id)
            if out is None:
                peer = self.node.peer(msg.peer)
                if peer is not None and peer.split is not None and peer.split.idle:
                    # an idle rank may hear before it tracks the request (push flow)
                    return self._keep_early(msg, now)
                return Reply(
                    ok=False,
                    code="unknown_transfer",
                    detail=f"no blocks held for {msg.transfer_id}",
                    epoch=self.node.id.epoch,
                )
            if (refused := self._forbidden(out, msg)) is not None:
                return refused
            self._release(out, msg, now)
            self._lock.notify()
        return Reply(ok=True, epoch=self.node.id.epoch)

    def _release(self, out: _Out, msg: Release, now: float) -> None:
        """A decode rank lets go of ``out`` (lock held): it read its part (P-first), or
        this rank is idle for it. The request ends once every decode rank it feeds did."""
        peer = self.node.peer(msg.peer)
        out.released_by.add(str(msg.peer))
        if out.req.phase is SendPhase.HELD and len(out.released_by) >= (
            1 if peer is None else peer.fanout
        ):
            out.req.start_sending(now)
            out.req.finish(now)

    def on_abort(self, msg: Abort) -> Reply:
        """Reply ``stopped`` when nothing will be written for the transfer any more (the
        decode side may reuse its blocks at once); otherwise ``Done`` follows the drain."""
        with self._lock:
            out = self._out.get(msg.transfer_id)
            if out is None:
                if msg.transfer_id not in self._ended and msg.transfer_id not in self._never_sent:
                    # D may give up before this worker tracks it
                    # what the same party sent before is void (a stranger's abort voids nothing)
                    self._drop_early(msg.transfer_id, lambda m, _: not _same_party(m, msg))
                    reply = self._keep_early(msg, self.clock())
                    if not reply.ok:
                        return reply
                return Reply(ok=True, code="stopped", epoch=self.node.id.epoch)
            if (refused := self._forbidden(out, msg)) is not None:
                return refused
            if out.req.abort(f"decode side aborted: {msg.reason}", self.clock()):
                self.stats.add(aborted=1)
                self._lock.notify()
        return Reply(ok=True, epoch=self.node.id.epoch)

    def _forbidden(self, out: _Out, msg: Destination | Release | Abort) -> Reply | None:
        """None when ``msg`` may act on ``out``: it carries the transfer's ticket and comes
        from the decode instance that owns the transfer (the first whose destination or
        release was accepted; a destination or release makes its sender the owner).
        Otherwise the refusal, counted and logged (lock held)."""
        if out.ticket and not hmac.compare_digest(msg.ticket, out.ticket):
            why = "does not carry the transfer's ticket"
        elif out.owner is not None and msg.peer.engine_id != out.owner:
            why = f"comes from another decode instance than its destination's ({out.owner})"
        else:
            if out.owner is None and not isinstance(msg, Abort):
                out.owner = msg.peer.engine_id
            return None
        self.stats.add(messages_refused=1)
        log.warning(
            "kvbridge: refused a %s for %s from %s: it %s",
            type(msg).__name__,
            msg.transfer_id,
            msg.peer,
            why,
        )
        return Reply(
            ok=False,
            code="forbidden",
            detail=f"{type(msg).__name__} for {msg.transfer_id} refused: it {why}",
            epoch=self.node.id.epoch,
        )

    def _keep_early(self, msg: Destination | Release | Abort, now: float) -> Reply:
        """Keep a message for a transfer not tracked yet, within the bounds (lock held)."""
        early = self._early.get(msg.transfer_id)
        ids = _block_ids(msg)
        if (
            (early is None and len(self._early) >= MAX_EARLY_TRANSFERS)
            or (early is not None and len(early) >= MAX_EARLY_PER_TRANSFER)
            or self._early_ids + ids > MAX_EARLY_BLOCK_IDS
        ):
            self.stats.add(messages_refused=1)
            log.warning(
                "kvbridge: refused a %s for %s from %s: %d transfers not tracked yet have "
                "messages with %d block ids waiting (at most %d transfers, %d messages each, "
                "%d block ids)",
                type(msg).__name__,
                msg.transfer_id,
                msg.peer,
                len(self._early),
                self._early_ids,
                MAX_EARLY_TRANSFERS,
                MAX_EARLY_PER_TRANSFER,
                MAX_EARLY_BLOCK_IDS,
            )
            return Reply(
                ok=False,
                code="error",
                detail="too many messages for transfers this prefill worker does not track yet",
                epoch=self.node.id.epoch,
            )
        if len(self._early_order) >= 2 * MAX_EARLY_TRANSFERS * MAX_EARLY_PER_TRANSFER:
            # entries of messages dropped before their time (tracked, voided): compact
            self._early_order = deque(
                sorted((t, tid) for tid, kept in self._early.items() for _, t in kept)
            )
        deadline = now + self.cfg.timeouts.lease_s
        self._early.setdefault(msg.transfer_id, []).append((msg, deadline))
        self._early_ids += ids
        self._early_order.append((deadline, msg.transfer_id))
        return Reply(ok=True, epoch=self.node.id.epoch)

    def _drop_early(
        self, transfer_id: str, keep: Callable[[Destination | Release | Abort, float], bool]
    ) -> list[tuple[Destination | Release | Abort, float]]:
        """Drop the messages kept early for ``transfer_id`` that ``keep`` (message, drop
        time) refuses; return them (lock held). Their entries in :attr:`_early_order`
        go when their time comes."""
        early = self._early.get(transfer_id)
        if early is None:
            return []
        dropped = [(m, t) for m, t in early if not keep(m, t)]
        if dropped:
            early[:] = [(m, t) for m, t in early if keep(m, t)]
            self._early_ids -= sum(_block_ids(m) for m, _ in dropped)
            if not early:
                del self._early[transfer_id]
        return dropped

    @property
    def early(self) -> int:
        """Messages kept for transfers not tracked yet (a level; any thread)."""
        with self._lock:
            return sum(len(v) for v in self._early.values())

    @property
    def early_block_ids(self) -> int:
        """Block ids those messages carry (a level, bounded by
        :data:`MAX_EARLY_BLOCK_IDS`; any thread)."""
        with self._lock:
            return self._early_ids

    # --- the sender thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                gated = self._open_gates()
                work = self._plan_posts()
            for out, posts in work:
                self._post(out, posts)
            busy = self._poll_inflight() or gated
            self._apply_deadlines()
            with self._lock:
                if self._stop:
                    return
                if not busy and (self._starved or not self._has_postable()):
                    self._lock.wait(0.05)  # woken by any event; 50 ms bounds deadline checks
                elif busy:  # writes in flight or device events pending: poll them
                    self._lock.wait(0.0002)

    def _has_postable(self) -> bool:
        return any(self._postable(out) for out in self._out.values())

    def _postable(self, out: _Out) -> list[tuple[_Dest, list[int], int, int]]:
        """(destination, layers, first block, end block) groups ready to post (lock held)."""
        if not out.dests or out.req.phase is not SendPhase.SENDING or out.pull:
            return []
        if not out.stream and not out.prefill_done:
            return []
        total = math.ceil(out.num_tokens / self._bs)
        found = []
        for dest in out.dests:
            skip = dest.msg.skip_tokens // self._bs
            groups: dict[tuple[int, int], list[int]] = {}
            for layer in range(self._layers):
                ready = (
                    total
                    if out.ready[layer] >= out.num_tokens
                    else min(out.ready[layer] // self._bs, total)
                )
                start = max(dest.posted[layer], skip)
                if ready > start:
                    groups.setdefault((start, ready), []).append(layer)
            found += [(dest, layers, a, b) for (a, b), layers in groups.items()]
        return found

    def _plan_posts(self) -> list[tuple[_Out, list[tuple[_Dest, list[int], int, int, Run | None]]]]:
        """Posts ready now (lock held): (destination, layers, first block, end block,
        staging to pack into or None). A packed post waits while the staging buffer is
        full."""
        work = []
        packed = self.node.packed
        self._starved = False
        for out in self._out.values():
            posts = []
            for dest, layers, start, end in self._split(self._postable(out)):
                run = None
                if packed is not None:
                    need, heads = (
                        len(layers) * (end - start),
                        dest.peer.heads[1] - dest.peer.heads[0],
                    )
                    if packed.slots_for(need, heads) > packed.allocator.num_slots:
                        self._fail(
                            out,
                            f"a post of {need} packed blocks exceeds the staging buffer "
                            f"({packed.allocator.num_slots} blocks): raise staging_mb",
                            self.clock(),
                        )
                        break
                    run = packed.reserve(need, heads)
                    if run is None:
                        self._starved = True  # retried when a write settles
                        continue
                for layer in layers:
                    dest.posted[layer] = end
                posts.append((dest, layers, start, end, run))
            if posts:
                work.append((out, posts))
        return work

    def _split(
        self, groups: list[tuple[_Dest, list[int], int, int]]
    ) -> list[tuple[_Dest, list[int], int, int]]:
        """Packed path: cut a group's layers into posts of at most a quarter of the
        staging buffer each (at least one layer), so that a large group (a P-first
        request, every layer at once) neither exceeds the buffer nor holds all of it."""
        packed = self.node.packed
        if packed is None:
            return groups
        cap = max(1, packed.allocator.num_slots // 4)
        out = []
        for dest, layers, start, end in groups:
            heads = dest.peer.heads[1] - dest.peer.heads[0]
            per = max(1, cap // packed.slots_for(end - start, heads))
            out += [(dest, layers[i : i + per], start, end) for i in range(0, len(layers), per)]
        return out

    def _post(self, out: _Out, posts: list[tuple[_Dest, list[int], int, int, Run | None]]) -> None:
        packed = self.node.packed
        for i, (dest, layers, start, end, run) in enumerate(posts):
            skip = dest.msg.skip_tokens // self._bs
            now = self.clock()
            key = next(self._keys)
            registered = False
            try:
                note = LayerDone(
                    transfer_id=dest.msg.transfer_id,
                    layers=layers,
                    first_block=start - skip,
                    num_blocks=end - start,
                    source=dest.msg.source,
                )
                if packed is None:
                    local, lidx, remote, ridx = self.node.plan(
                        dest.peer,
                        out.blocks[start:end],
                        dest.blocks[start - skip : end - skip],
                        layers,
                    )
                else:
                    local, lidx, remote, ridx = self._pack(out, dest, layers, start, end, run)
                if not len(lidx):  # sliding-window layers before their window: nothing to write
                    self.node.transport.notify(
                        dest.peer.agent, self.node.encode_note(note, dest.peer.agent)
                    )
                    self._free_posts([posts[i]])
                    continue
                with self._lock:
                    if out.req.terminal:
                        self._free_posts(posts[i:])
                        return
                    out.req.posted(key)
                    registered = True
                xfer = self.node.transport.post(
                    "write",
                    local,
                    lidx,
                    remote,
                    ridx,
                    notify=self.node.encode_note(note, dest.peer.agent),
                )
            except KVBridgeError as exc:
                with self._lock:
                    if registered:
                        out.req.settled(key, now)
                    self._free_posts(posts[i:])
                    self._fail(out, f"write failed: {exc}", now)
                return
            with self._lock:
                out.inflight[key] = (xfer, now, run)
                out.t_first_post = out.t_first_post or now
            self.stats.add(transfers=1, descriptors=xfer.num_descs, bytes_sent=xfer.nbytes)

    def _pack(self, out: _Out, to: _Dest, layers: list[int], start: int, end: int, run: Run):
        """Pack a post (the peer's head range of each block) into our staging; the chunk
        pairs to write (packed path). Per KV cache group, only the positions the
        destination holds a block for (all, with one group) are packed and written,
        each into its chunk of the destination's staging."""
        packed, dest, peer = self.node.packed, to.msg, to.peer
        assert packed is not None and peer.heads is not None
        if peer.staging is None or dest.staging_slot < 0:
            raise KVBridgeError(
                f"destination of {dest.transfer_id} has no staging slots for packed KV"
            )
        skip = dest.skip_tokens // self._bs
        nb = len(dest.block_ids)
        src, dst = out.blocks[start:end], to.blocks[start - skip : end - skip]
        chunk, lparts, rparts = run.first, [], []
        for g, on in layers_by_group(self.node.codec.compat.layer_groups, layers):
            keep = held_positions(src.row(g), dst.row(g), g)
            if not keep.size:
                continue
            packed.pack(on, src.row(g)[keep].tolist(), chunk, heads=peer.heads)
            lparts.append(np.arange(chunk, chunk + len(on) * keep.size, dtype=np.int64))
            rparts += [dest.staging_slot + layer * nb + (start - skip) + keep for layer in on]
            chunk += len(on) * keep.size
        lidx = np.concatenate(lparts) if lparts else np.empty(0, dtype=np.int64)
        ridx = np.concatenate(rparts) if rparts else np.empty(0, dtype=np.int64)
        return packed.table_for(peer.heads[1] - peer.heads[0]), lidx, peer.staging, ridx

    def _free_posts(self, posts: list[tuple[_Dest, list[int], int, int, Run | None]]) -> None:
        """Give back the staging of posts that will not be written."""
        for *_, run in posts:
            if run is not None:
                self.node.packed.release(run)

    def _poll_inflight(self) -> bool:
        """Poll posted writes; settle the finished ones. True while any is in flight."""
        with self._lock:
            items = [
                (out, key, xfer, t0, run)
                for out in self._out.values()
                for key, (xfer, t0, run) in list(out.inflight.items())
            ]
        for out, key, xfer, t0, run in items:
            try:
                done = self.node.transport.poll(xfer)
                error = None
            except KVBridgeError as exc:
                done, error = True, exc
            if not done:
                continue
            now = self.clock()
            self.node.transport.release(xfer)
            if run is not None:
                self.node.packed.release(run)
            with self._lock:
                out.inflight.pop(key, None)
                out.req.settled(key, now)
                if error is not None:
                    self._fail(out, f"write failed: {error}", now)
                else:
                    self.stats.observe("transfer_s", now - t0)
                    self._maybe_finish(out, now)
        with self._lock:
            return any(out.inflight for out in self._out.values())

    def _maybe_finish(self, out: _Out, now: float) -> None:
        """All of the prompt posted and landed: done (lock held)."""
        if (
            out.req.phase is not SendPhase.SENDING
            or not out.prefill_done
            or not out.dests
            or out.pull
        ):
            return
        if len(out.dests) < out.dests[0].peer.fanout:
            return  # more decode ranks will ask for their part
        total = math.ceil(out.num_tokens / self._bs)
        if all(p >= total for d in out.dests for p in d.posted) and not out.inflight:
            out.req.finish(now)
            self.stats.add(requests_sent=1)
            if out.t_prefill_done is not None:
                self.stats.observe("exposed_s", max(0.0, now - out.t_prefill_done))
            if out.t_first_post is not None:
                self.stats.observe("request_transfer_s", now - out.t_first_post)

    def _fail(self, out: _Out, reason: str, now: float) -> None:
        if out.req.fail(reason, now):
            self.stats.add(failures=1)
            log.warning("kvbridge: transfer %s failed: %s", out.req.transfer_id, reason)

    def _apply_deadlines(self) -> None:
        now = self.clock()
        tell: list[tuple[Peer, Done]] = []
        with self._lock:
            while self._early_order and self._early_order[0][0] <= now:
                _, tid = self._early_order.popleft()
                self._drop_early(tid, lambda _, deadline: now < deadline)
            for tid, out in list(self._out.items()):
                if out.prefill_done and out.dests:
                    self._maybe_finish(out, now)
                if out.req.poll(now):
                    if out.req.phase is SendPhase.EXPIRED:
                        self.stats.add(leases_expired=1)
                        log.warning("kvbridge: %s: %s", tid, out.req.reason)
                    elif out.req.phase is SendPhase.FAILED:
                        self.stats.add(failures=1)
                if out.req.releasable:
                    for xfer, _, run in out.inflight.values():  # abandoned after the drain deadline
                        self.node.transport.release(xfer)
                        if run is not None:
                            self.node.packed.release(run)
                    out.inflight.clear()
                    out.req.release()
                    del self._out[tid]
                    self._readable.discard(tid)
                    self._released.append(tid)
                    self._ended.add(
                        tid, out.req.phase.value + (f": {out.req.reason}" if out.req.reason else "")
                    )
                    self._lock.notify_all()
                    self._on_outcome()
                    if out.req.phase is not SendPhase.DONE:
                        # after the drain: the decode side may reuse its blocks once it reads this
                        reason = out.req.reason or out.req.phase.value
                        tell += [
                            (
                                d.peer,
                                Done(transfer_id=tid, ok=False, reason=reason, source=d.msg.source),
                            )
                            for d in out.dests
                        ]
        self._tell(tell)

    def _tell(self, notes: list[tuple[Peer, Done]]) -> None:
        """Send each peer its ``Done`` notification (lock not held)."""
        for peer, msg in notes:  # best effort: D also has its own deadlines
            try:
                self.node.transport.notify(peer.agent, self.node.encode_note(msg, peer.agent))
            except KVBridgeError as exc:
                log.debug("could not tell %s that %s ended: %s", peer.id, msg.transfer_id, exc)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(5)
        self.node.transport.remove_demand(self._holding)


__all__ = ["Ready", "Sender"]
