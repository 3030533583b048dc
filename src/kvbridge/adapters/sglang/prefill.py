"""Prefill side of the ``kvbridge`` SGLang backend: what a prefill rank's manager does
(:class:`PrefillSide`, mixed into :class:`~.manager.KVBridgeKVManager`) and SGLang's
sender (:class:`KVBridgeKVSender`).

Threads and who calls what:

- the *control thread* (:meth:`PrefillSide._prefill_control_loop`) reads SGLang's
  control socket: a decode's ``Registration`` (:mod:`kvbridge.wire.room_messages`;
  once per decode rank: checked, then its KV, metadata and staging tables prepared, by
  :class:`~.registrations.Registrations`), its
  ``Destination`` per room, and abort notifications (both kept, answered or refused by
  :class:`~.admission.Admission`);
- SGLang's scheduler calls :meth:`PrefillSide.add_transfer_request` after each chunk's
  forward (queued, never blocks) and, per forward, :func:`plan_forward` through the
  hook of :func:`.compat.hook_layerwise` (per-layer streaming: the decode page
  positions the forward completes; :meth:`PrefillSide.layer_done` queues each layer,
  O(1));
- the *transfer thread* (:meth:`PrefillSide._transfer_loop`) owns every posted
  transfer of this rank and all per-room bookkeeping: it posts each layer's or chunk's
  K and V pages (packed path: the decode rank's heads of them, packed into our staging
  and written into its part of the room's run), after the last chunk a sliding-window
  pool's window pages or a state-space pool's state slot and the metadata row with a
  ``Done``, then marks
  the room sent and releases what it holds (each transfer and staging run exactly once,
  :meth:`PrefillSide._release_room`). A failed or aborted room posts nothing more; its
  transfers are released once drained.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import NamedTuple

import numpy as np

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang.admission import Admission, DecodeDestination
from kvbridge.adapters.sglang.lifecycle import Tombstones
from kvbridge.adapters.sglang.packed import (
    Part,
    part_start,
    room_slots,
    window_chunks,
    window_start,
)
from kvbridge.adapters.sglang.pools import (
    transfer_pages,
    window_overlap,
)
from kvbridge.adapters.sglang.registrations import DecodePeer, PrefillRank, Registrations
from kvbridge.adapters.sglang.rooms import SoleHolder
from kvbridge.adapters.sglang.states import state_slot
from kvbridge.adapters.sglang.streaming import (
    ForwardPlan,
    LayerReady,
    ReqSpan,
    RoomProgress,
    coalesce,
    completed_span,
    streams,
)
from kvbridge.errors import DeadlineExceeded, KVBridgeError, PlanError
from kvbridge.runtime.device import record_device_event, wait_device_event
from kvbridge.runtime.packed import Run
from kvbridge.wire import room_messages as wire

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll


class _Chunk(NamedTuple):
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    queued_at: float
    """``time.monotonic()`` when SGLang handed the chunk over (after its forward)."""
    wait_event: object = None
    """SGLang's early send of a cached prefix under overlap scheduling (GPU): a device
    event after which the previous forward no longer writes these pages; None when
    the pages are final (always on CPU)."""
    window_pages: np.ndarray | None = None
    """A sliding-window pool's last chunk: the window layers' pages of the prompt's last
    window (SGLang's state indices), as transfer pages."""
    state_row: int | None = None
    """A pool with state-space layers, last chunk: the request's state slot (SGLang's
    state index)."""


class _Forget(NamedTuple):
    """The sender of ``room`` was cleared or aborted, or the decode aborted it: unless
    it is still being transferred, let its posted writes finish, release them and
    acknowledge a decode's abort (which then reuses its pages)."""

    room: int


_streaming_managers: list = []
"""Prefill managers of this process with ``layerwise`` on (normally at most one); the
forward hooks do nothing while it is empty."""


def plan_forward(batch, model_runner) -> ForwardPlan | None:
    """The per-layer plan of one prefill forward, or None (scheduler thread, once per
    ``ForwardBatch``; called by the hook of :func:`.compat.hook_layerwise`)."""
    if not _streaming_managers:
        return None
    mine = [
        r
        for r in compat.extend_requests(batch, model_runner)
        if isinstance(r.sender, KVBridgeKVSender)
    ]
    if not mine:
        return None
    mgr = mine[0].sender.kv_mgr
    if mgr.layer_subset and mgr._full_layers is None:
        mgr._full_layers = compat.full_attention_layers(model_runner)
    return mgr.plan(batch, [r for r in mine if r.sender.kv_mgr is mgr])


def stop_streaming(mgr) -> None:
    """``mgr`` is closing: the forward hooks stop planning for it (any thread)."""
    if mgr in _streaming_managers:
        _streaming_managers.remove(mgr)


class PrefillSide:
    """The prefill rank's part of :class:`~.manager.KVBridgeKVManager` (a mixin: it
    uses the manager's transport, tables, geometry, config and SGLang's status table).
    See the module docstring for its threads."""

    tombstones: Tombstones | None = None
    """Rooms this prefill failed (:meth:`record_failure`); None on a decode."""

    def _init_prefill(self, args) -> None:
        """State and threads of a prefill rank (the manager's constructor, once)."""
        self.registrations = Registrations(
            PrefillRank(
                transport=self.config.transport,
                wire_dtype=self.config.wire_dtype,
                data_path=self.config.resolved_data_path,
                compat=self.compat_info,
                disclose=self.secret is not None,
                page_size=self.kv_args.page_size,
                geometry=self.geometry,
                packed=self.packed,
                window_geometry=self.window_geometry,
                state_layout=self.state_layout,
                state_split=self.state_split,
                aux_layout=self.aux_layout,
                tp_size=self.attn_tp_size,
                tp_rank=self.attn_tp_rank,
                total_kv_heads=self._total_kv_heads(),
            ),
            self.transport,
            self._count,
            self.check_peer_aux_buffer_count,
        )
        self.peers = self.registrations.peers
        """Registered decode ranks by agent (what the transfer thread writes to)."""
        self._inflight: dict[int, list] = {}
        self._seen_done: dict[int, int] = {}
        """Room -> how many of its first in-flight transfers completed (:meth:`_raise_failed`)."""
        self._progress: dict[int, RoomProgress] = {}
        self._chunk_writes: dict[int, int] = {}
        self._room_bytes: dict[int, dict[str, int]] = {}  # room -> decode agent -> bytes posted
        self._first_post: dict[int, float] = {}
        self._packed_runs: dict[int, list[Run]] = {}  # room -> our staging runs
        self._num_layers = self.geometry.spec.num_layers
        self._start_layer = compat.start_layer(args)
        self._full_layers: dict[int, int] | None = None
        """Hybrid pool (:attr:`layer_subset`): model layer id -> index among the layers
        the pool's KV pages hold, read from the pool at the first planned forward (None
        until then: no layer is streamed)."""
        self._work: queue.Queue[_Chunk | LayerReady | _Forget] = queue.Queue()
        self.tombstones = Tombstones()
        self.admission = self._new_admission()
        """Which decode destinations and aborts this rank acts on (control thread)."""
        self._thread("kvbridge-prefill-control", self._prefill_control_loop)
        self._thread("kvbridge-transfer", self._transfer_loop)
        if self.config.layerwise:
            _streaming_managers.append(self)

    def _new_admission(self) -> Admission:
        """This rank's :class:`~.admission.Admission`, over the manager's registrations,
        SGLang's destinations and status table, and the tombstones (all made before)."""
        return Admission(
            registrations=self.registrations,
            destinations=self.destinations,
            room_status=self.room_status,
            tombstones=self.tombstones,
            holder=lambda room: SoleHolder._holder(self, room),
            send_status=self.send_kv_status_message,
            count=self._count,
            epoch=self.epoch,
            packed=self.packed is not None,
            states=self.state_layout is not None,
            lease_s=self.config.timeouts.lease_s,
        )

    # --- bootstrap registration (prefill) --------------------------------------------------

    def topology_row(self, payload: dict) -> dict:
        """What this rank adds to the row it registers with SGLang's bootstrap server
        (:class:`.compat.TopologyRowHook`; during SGLang's constructor): its epoch (a
        restart is a new instance) and agent, and with ``transfer_block_size`` its
        transfer page (the bootstrap server then hides its page size). Rows gathered
        from other ranks (SGLang's multi-DP registry path) carry their own."""
        if payload.get("rank_port") == self.rank_port and payload.get("rank_ip") == self.local_ip:
            payload = dict(
                payload, kvbridge_epoch=self.epoch, kvbridge_agent=self.transport.agent_name
            )
            if self.config.transfer_block_size:
                payload["kvbridge_transfer_pages"] = self.geometry.spec.block_size
        return payload

    # --- prefill: control thread -----------------------------------------------------------

    def _prefill_control_loop(self) -> None:
        self._recv_loop(self._prefill_handle)

    def _prefill_handle(self, frames: list[bytes]) -> None:
        try:
            frames = self._authentic(frames)
        except wire.AuthenticationError as exc:
            self.admission.refuse_unauthenticated(exc)
            return
        if frames and frames[0] == _c.ABORT_TAG and not self.admission.abort_allowed(frames):
            return
        if self.deferred_bootstrap is not None and self._handle_bootstrap_message(frames):
            return
        if frames and frames[0] == _c.ABORT_TAG:
            self._handle_abort(frames)
            return
        try:
            msg = wire.decode(frames)
        except wire.AuthenticationError as exc:
            self.admission.refuse_unauthenticated(exc)
            return
        if isinstance(msg, wire.Registration):
            self.registrations.register(msg)
        elif isinstance(msg, wire.Destination):
            self.admission.destination(msg)
        else:
            log.warning("kvbridge: unexpected %s on the prefill control socket", type(msg).__name__)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        """SGLang's record of why a room failed; on a prefill also a tombstone, so a
        decode destination that comes for the room later is answered with the failure
        at once (:meth:`.Admission.destination`). SGLang fails some rooms before their
        destination arrives and never tells the decode: in its sender's constructor (a
        DP rank that does not match the room), at its bootstrap timeout. Any thread."""
        super().record_failure(bootstrap_room, failure_reason)
        if self.tombstones is not None:
            self.tombstones.add(bootstrap_room, failure_reason)

    def _handle_abort(self, frames: list[bytes]) -> None:
        note = _c.AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        reason = "Aborted by decode-side abort notification."
        if self.room_status.fail(room, reason, unless=(KVPoll.Success,)):
            self._count(aborted=1)
        if self.enable_deferred_decode_kv_release:
            target = note.deferred_ack_target()
            if target is not None:
                self.register_deferred_ack_target(room, target)
                self._maybe_ack_drained_abort(room)  # acks now when nothing is in flight
        if self._staging_outstanding.get(room, 0) > 0:
            self._work.put(_Forget(room))  # the transfer thread acks once they drained

    # --- prefill: transfers ----------------------------------------------------------------

    def add_transfer_request(
        self,
        bootstrap_room,
        kv_indices,
        index_slice,
        is_last_chunk,
        aux_index=None,
        state_indices=None,
        num_kv_tokens=None,
        *,
        wait_event=None,
        indices_event=None,
        trace_ctx=None,
    ):
        """Queue one chunk (never blocks the scheduler). ``state_indices`` (last chunk):
        one entry, for the one state kind a pool may carry
        (:func:`~kvbridge.adapters.sglang.pools.pool_states`): a sliding-window pool's
        window pages, or a state-space pool's state slot."""
        if not self.destinations.has(bootstrap_room):
            return  # dummy rank, or already cleared
        window_pages = None
        if self.window_geometry is not None and is_last_chunk and state_indices:
            window_pages = transfer_pages(state_indices[0], self.page_ratio)
        state_row = None
        if self.state_layout is not None and is_last_chunk:
            state_row = state_slot(state_indices)
        # indices_event is only given to senders that take host tensors (we do not:
        # KVBridgeKVSender.supports_host_tensor_indices), so kv_indices are final here
        self._work.put(
            _Chunk(
                bootstrap_room,
                np.asarray(kv_indices, dtype=np.int64),
                index_slice,
                is_last_chunk,
                aux_index,
                time.monotonic(),
                wait_event,
                window_pages,
                state_row,
            )
        )
        return

    # --- prefill: per-layer streaming (scheduler thread / forward) ------------------------------

    def plan(self, batch, reqs: list[compat.ExtendReq]) -> ForwardPlan | None:
        """Which decode pages of which rooms this forward completes (scheduler thread,
        before the forward). Rooms below ``layerwise_min_tokens`` or without a known
        destination are left to the chunk sends."""
        page = self.geometry.spec.block_size
        spans = []
        for r in reqs:
            if not streams(
                layerwise=self.config.layerwise,
                min_tokens=self.config.layerwise_min_tokens,
                prompt_len=r.prompt_len,
            ):
                continue
            infos = self.destinations.of(r.room)
            if not infos or all(d.is_dummy for d in infos.values()):
                # no destination yet, or a dummy one only (MLA: another prefill rank
                # writes this decode's latent pages): left to the chunk sends
                continue
            lo, hi = completed_span(
                prefix_len=r.prefix_len,
                extend_len=r.extend_len,
                prompt_len=r.prompt_len,
                decode_prefix_len=r.decode_prefix_len,
                page_size=page,
            )
            if hi <= lo:
                continue
            first = (lo * page) + r.decode_prefix_len
            src = compat.page_ids(batch, r.req_pool_idx, first, first + (hi - lo) * page, page)
            if src.size != hi - lo:
                log.warning(
                    "kvbridge: room %s: %d page ids for positions %d:%d; left to the chunk send",
                    r.room,
                    src.size,
                    lo,
                    hi,
                )
                continue
            spans.append(ReqSpan(r.room, lo, hi, src))
        return ForwardPlan(tuple(spans), self.layer_done) if spans else None

    def layer_done(self, plan: ForwardPlan, layer_id: int) -> None:
        """Attention layer ``layer_id`` of ``plan``'s forward has written its K and V
        (forward thread, once per layer; O(1), never blocks)."""
        if not self.layer_subset:
            layer = layer_id - self._start_layer
        else:  # the pool's (full-)attention layers; window pages, states go after the last chunk
            layer = self._full_layers.get(layer_id, -1) if self._full_layers is not None else -1
        if not 0 <= layer < self._num_layers:
            return
        event = record_device_event() if self.memory == "device" else None
        self._work.put(LayerReady(plan, (layer,), event))

    # --- prefill: transfer thread -----------------------------------------------------------

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            self._report_staging()
            self._report_limits()
            try:
                items = [self._work.get(timeout=self._poll_s)]
            except queue.Empty:
                continue
            while True:  # whatever else is ready: layers of one forward go out together
                try:
                    items.append(self._work.get_nowait())
                except queue.Empty:
                    break
            for item in coalesce(items):
                if isinstance(item, LayerReady):
                    self._send_layers(item)
                elif isinstance(item, _Forget):
                    self._release_if_inactive(item.room)
                else:
                    self._guarded(item.room, self._send_chunk, item)

    def _guarded(self, room: int, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure fails the room, not the thread
            log.warning("kvbridge: room %s failed: %s", room, exc)
            self._count(failures=1)
            self.conclude_failure(bootstrap_room=room, failure_reason=f"kvbridge: {exc}")
            self._release_room(room, drain_s=0.0)  # no waiting here: other rooms queue behind

    def _room_active(self, room: int) -> bool:
        return self.room_status.live(room) and self.destinations.has(room)

    def _release_if_inactive(self, room: int) -> bool:
        """A failed, aborted or cleared room posts nothing more: release what it holds,
        after its posted writes drained (:meth:`_release_room`). Whether it was inactive."""
        if self._room_active(room):
            return False
        self._release_room(room, drain_s=self.config.timeouts.transfer_s)
        return True

    def _dests(self, room: int) -> list[DecodeDestination]:
        infos = self.destinations.of(room)
        if infos is None:
            raise KeyError(f"room {room} has no destination")
        return [d for d in infos.values() if not d.is_dummy]

    def _post(
        self,
        room: int,
        dests: list[DecodeDestination],
        src_pages: np.ndarray,
        positions,
        layers=None,
    ) -> int:
        """Write ``src_pages`` (of ``layers``, default all) to the pages at ``positions``
        (a slice or an index array) of every destination's page list; returns the
        number of writes posted. The room's list of in-flight transfers owns them.
        Raises (posting nothing) if one of the room's earlier writes failed."""
        self._raise_failed(room)
        xfers = self._inflight.setdefault(room, [])
        # head range -> packed chunks
        packed: dict[tuple[int, int], tuple[list[int], np.ndarray, object]] = {}
        posted = 0
        for dest in dests:
            peer = self.peers.get(dest.agent)
            if peer is None:
                raise PlanError(f"decode peer {dest.agent} is gone")
            dst_pages = dest.pages[positions]
            if dst_pages.size != src_pages.size:
                where = (
                    f"{positions.start}:{positions.stop}"
                    if isinstance(positions, slice)
                    else f"{positions.tolist()}"
                )
                raise PlanError(
                    f"{src_pages.size} pages map to {dst_pages.size} destination pages "
                    f"(positions {where} of {dest.pages.size})"
                )
            if src_pages.size:
                if peer.part is None:  # the pages themselves
                    src_table, src, dst_table = (
                        self.kv_table,
                        self.geometry.slots(src_pages, layers),
                        peer.kv,
                    )
                    dst, slot_bytes = (
                        peer.geometry.slots(dst_pages, layers),
                        self.geometry.spec.block_bytes,
                    )
                else:  # the decode rank's heads of them, packed, into its part of the room's run
                    part = peer.part
                    if part.p_heads not in packed:
                        packed[part.p_heads] = self._pack(room, src_pages, layers, part)
                    (layer_ids, src, src_table), dst_table = packed[part.p_heads], peer.staging
                    at = np.arange(dest.pages.size, dtype=np.int64)[positions]
                    first = part_start(
                        dest.staging_first,
                        part.index,
                        self._num_layers,
                        int(dest.pages.size),
                        self._window_chunks(dest),
                    )
                    dst, slot_bytes = (
                        room_slots(first, dest.pages.size, layer_ids, at),
                        self.packed.chunk(part.heads).nbytes,
                    )
                xfers.append(self.transport.post("write", src_table, src, dst_table, dst))
                self._posted(room, dest, int(src.size) * slot_bytes)
                posted += 1
        return posted

    def _raise_failed(self, room: int) -> None:
        """Raise the error of the room's first failed write, if one failed (never blocks).

        A room whose decode died would otherwise go on posting a write per chunk or layer
        until its last chunk waits on them; each write to a dead Mooncake peer spends a
        second or more in the engine (reconnecting, probing), so a long prompt's chunks
        took minutes to fail under load. Polls the writes after the completed prefix, up to
        the first one still running."""
        xfers = self._inflight.get(room)
        if not xfers:
            return
        seen = self._seen_done.get(room, 0)
        while seen < len(xfers) and self.transport.poll(xfers[seen]):  # raises its error
            seen += 1
        self._seen_done[room] = seen

    def _posted(self, room: int, dest: DecodeDestination, nbytes: int) -> None:
        """Account one write of ``nbytes`` to ``dest`` just posted for ``room`` (its
        abort waits for it; the decode's metrics count its bytes)."""
        self._staging_outstanding[room] += 1
        sent = self._room_bytes.setdefault(room, {})
        sent[dest.agent] = sent.get(dest.agent, 0) + nbytes
        self._first_post.setdefault(room, time.monotonic())
        self._count(transfers=1, bytes_sent=nbytes)

    def _post_window(
        self, room: int, dests: list[DecodeDestination], src_pages: np.ndarray | None, src_end: int
    ) -> dict[str, tuple[int, int]]:
        """A sliding-window pool, after the room's last chunk: write the window layers'
        pages of the prompt's last window (SGLang's state indices on both sides, in
        transfer pages, matched by position: :func:`.pools.window_overlap`, the room's
        page list ending at transfer page ``src_end`` here) into every destination's:
        the pages themselves, or on the packed path the decode rank's heads of them into
        its part of the room's run, after the part's full-attention layers
        (:func:`.packed.window_start`). Returns each destination's ``(first, count)`` of
        its window pages written, for its ``Done``. Transfer thread."""
        if src_pages is None:
            raise PlanError("the last chunk carries no sliding-window pages (state indices)")
        xfers = self._inflight.setdefault(room, [])
        window_layers = self.window_geometry.spec.num_layers
        written: dict[str, tuple[int, int]] = {}
        # sources per window slice (every decode rank of one page size shares one), and
        # on the packed path per head range too
        direct: dict[tuple[int, int], np.ndarray] = {}
        packed: dict[tuple, tuple[list[int], np.ndarray, object]] = {}
        for dest in dests:
            peer = self.peers.get(dest.agent)
            if peer is None:
                raise PlanError(f"decode peer {dest.agent} is gone")
            dst_pages = dest.window_pages
            if dst_pages is None:
                raise PlanError(f"{src_pages.size} sliding-window pages map to no destination")
            src_sl, dst_sl = window_overlap(
                src_pages.size, src_end, dst_pages.size, int(dest.pages.size)
            )
            count = src_sl.stop - src_sl.start
            # the side with the smaller pages holds the window's positions in fewer pages,
            # all of them among the other side's
            if count != min(src_pages.size, dst_pages.size):
                raise PlanError(
                    f"{src_pages.size} sliding-window pages ending at page {src_end} share "
                    f"{count} with the destination's {dst_pages.size} ending at page "
                    f"{dest.pages.size}"
                )
            written[dest.agent] = (dst_sl.start, count)
            if not count:
                continue
            src = src_pages[src_sl]
            if peer.part is None:  # the pages themselves
                key = (src_sl.start, src_sl.stop)
                if key not in direct:
                    direct[key] = self.window_geometry.slots(src)
                src_slots = direct[key]
                x = self.transport.post(
                    "write",
                    self.window_table,
                    src_slots,
                    peer.window,
                    peer.window_geometry.slots(dst_pages[dst_sl]),
                )
                nbytes = int(src_slots.size) * self.window_geometry.spec.block_bytes
            else:  # the decode rank's heads of them, packed, into its part of the room's run
                part = peer.part
                key = (part.p_heads, src_sl.start, src_sl.stop)
                if key not in packed:
                    packed[key] = self._pack(
                        room, src, range(window_layers), part, kv=self.window_kv
                    )
                layer_ids, src_slots, src_table = packed[key]
                pages = int(dest.pages.size)
                first = part_start(
                    dest.staging_first,
                    part.index,
                    self._num_layers,
                    pages,
                    self._window_chunks(dest),
                )
                dst = room_slots(
                    window_start(first, self._num_layers, pages),
                    dst_pages.size,
                    layer_ids,
                    np.arange(dst_sl.start, dst_sl.stop),
                )
                x = self.transport.post("write", src_table, src_slots, peer.staging, dst)
                nbytes = int(src_slots.size) * self.packed.chunk(part.heads).nbytes
            xfers.append(x)
            self._posted(room, dest, nbytes)
        return written

    def _post_states(self, room: int, dests: list[DecodeDestination], row: int | None) -> None:
        """A pool with state-space layers, after the room's last chunk (its forward has
        left the prompt's final states in the request's slot): write the slot's row of
        every state tensor into the destination's slot, on either data path (states
        are not packed); to a decode rank of another attention TP size, the parts of
        the row it holds (``DecodePeer.state_cut``). Transfer thread."""
        if row is None:
            raise PlanError("the last chunk names no state slot (SGLang's state indices)")
        src = self.state_layout.slots(row)
        nbytes = sum(self.state_layout.item_lens)
        xfers = self._inflight.setdefault(room, [])
        for dest in dests:
            peer = self.peers.get(dest.agent)
            if peer is None:
                raise PlanError(f"decode peer {dest.agent} is gone")
            if peer.state_cut is not None:
                sent = self._post_state_parts(xfers, peer, row, dest.state_row)
                self._posted(room, dest, sent)
                continue
            dst = peer.state_layout.slots(dest.state_row)
            xfers.append(self.transport.post("write", self.state_table, src, peer.states, dst))
            self._posted(room, dest, nbytes)

    def _post_state_parts(self, xfers: list, peer: DecodePeer, row: int, dst_row: int) -> int:
        """Write the segments of state slot ``row`` that ``peer`` (another attention TP
        size) holds into its slot ``dst_row``, as one transfer of one-post lists;
        returns the bytes (0: this rank holds none of the decode rank's states)."""
        mine, theirs = self.state_layout, peer.state_layout
        if not 0 <= dst_row < theirs.rows:
            raise PlanError(f"state slot {dst_row} out of the decode's range [0, {theirs.rows})")
        local, remote = [], []
        for j, segments in enumerate(peer.state_cut):
            src = mine.ptrs[j] + row * mine.item_lens[j]
            dst = theirs.ptrs[j] + dst_row * theirs.item_lens[j]
            for p_off, d_off, n in segments:
                local.append((src + p_off, n, self.device_index))
                remote.append((dst + d_off, n, peer.geometry.device))
        if not local:
            return 0
        rows = np.arange(len(local), dtype=np.int64)
        xfers.append(
            self.transport.post(
                "write",
                self.transport.adhoc(np.array(local, dtype=np.uint64), memory=self.memory),
                rows,
                self.transport.adhoc(
                    np.array(remote, dtype=np.uint64),
                    memory=peer.geometry.memory,
                    peer=peer.kv.peer,
                ),
                rows,
            )
        )
        return sum(n for _, n, _ in local)

    def _window_chunks(self, dest: DecodeDestination) -> int:
        """Packed path: the staging chunks of each part of ``dest``'s room run that hold
        a sliding-window pool's window layers (0 without one)."""
        if self.window_geometry is None:
            return 0
        return window_chunks(self.window_geometry.spec.num_layers, dest.window_pages)

    def _pack(
        self, room: int, src_pages: np.ndarray, layers, part: Part, kv=None
    ) -> tuple[list[int], np.ndarray, object]:
        """Pack ``part``'s heads of ``layers`` (default all) of ``src_pages`` into a run of
        chunks of our staging buffer, layer-major; the room holds the run until it is
        released. ``kv``: the pool (default the full-attention one; a sliding-window
        pool's :attr:`window_kv`). Returns the layer ids, the run's chunks and the table
        they index."""
        layer_ids = (
            list(range(self._num_layers)) if layers is None else [int(layer) for layer in layers]
        )
        count = len(layer_ids) * int(src_pages.size)
        run = self.packed.reserve(count, part.heads)
        if run is None:
            raise PlanError(
                f"the staging buffer has no run for {count} packed pages (packed path, staging_mb "
                f"{self.config.staging_mb}); raise staging_mb on the prefill"
            )
        self._packed_runs.setdefault(room, []).append(run)
        whole = part.heads == self.packed.slot.num_heads
        self.packed.pack(
            layer_ids, src_pages, run.first, heads=None if whole else part.p_heads, kv=kv
        )
        return (
            layer_ids,
            np.arange(run.first, run.first + count, dtype=np.int64),
            self.packed.table_for(part.heads),
        )

    def _send_layers(self, item: LayerReady) -> None:
        # the layer's kernels, then our reads
        if item.event is not None and not wait_device_event(
            item.event, time.monotonic() + self.config.timeouts.transfer_s
        ):
            exc = DeadlineExceeded(
                f"layers {list(item.layers)} not computed within "
                f"{self.config.timeouts.transfer_s:g}s"
            )
            for span in item.plan.spans:
                self._guarded(span.room, _raise, exc)
            return
        for span in item.plan.spans:
            self._guarded(span.room, self._send_span, span, item.layers)

    def _send_span(self, span: ReqSpan, layers: tuple[int, ...]) -> None:
        room = span.room
        if self._release_if_inactive(room):
            return
        dests = self._dests(room)
        progress = self._progress.get(room)
        if progress is None:
            progress = self._progress[room] = RoomProgress(
                self._num_layers, min(d.pages.size for d in dests) if dests else 0
            )
        for group, positions in progress.take(layers, span.lo, span.hi):
            progress.layer_writes += self._post(
                room, dests, span.src_pages[positions - span.lo], positions, group
            )

    def _in_transfer_pages(self, chunk: _Chunk, dests: list[DecodeDestination]) -> _Chunk:
        """``chunk`` (SGLang's pages and positions, in this prefill's pages) in transfer
        pages, when this prefill's pages are larger than the decode's
        (``transfer_block_size``): page ``p`` is transfer pages ``p * r .. p * r + r - 1``,
        cut where the decode's page list ends (the prompt's last page may reach past
        it; the per-layer plans already count in transfer pages)."""
        r = self.page_ratio
        start, stop = chunk.index_slice.start * r, chunk.index_slice.stop * r
        if dests:
            stop = min(stop, *(d.pages.size for d in dests))
        pages = transfer_pages(chunk.pages, r)[: max(0, stop - start)]
        return chunk._replace(pages=pages, index_slice=slice(start, start + pages.size))

    def _send_chunk(self, chunk: _Chunk) -> None:
        room = chunk.room
        if self._release_if_inactive(room):
            return
        # an early send's pages may still be written by the previous forward: wait, as
        # SGLang's own backends do, before any transfer reads them
        if chunk.wait_event is not None and not wait_device_event(
            chunk.wait_event, time.monotonic() + self.config.timeouts.transfer_s
        ):
            raise DeadlineExceeded(
                "the cached prefix pages of an early send were not written within "
                f"{self.config.timeouts.transfer_s:g}s"
            )
        dests = self._dests(room)
        end = chunk.index_slice.stop * self.page_ratio  # in transfer pages, uncut
        if self.page_ratio > 1:
            chunk = self._in_transfer_pages(chunk, dests)
        progress = self._progress.get(room)
        if progress is None:  # the per-chunk path: every layer of the chunk's pages
            self._chunk_writes[room] = self._chunk_writes.get(room, 0) + self._post(
                room, dests, chunk.pages, chunk.index_slice
            )
        else:  # streamed: only the (layer, page) pairs no layer post covered
            start = chunk.index_slice.start
            if chunk.index_slice.stop - start != chunk.pages.size:
                raise PlanError(
                    f"chunk of {chunk.pages.size} pages for positions "
                    f"{start}:{chunk.index_slice.stop}"
                )
            for group, positions in progress.take(
                range(self._num_layers), start, chunk.index_slice.stop
            ):
                progress.chunk_writes += self._post(
                    room, dests, chunk.pages[positions - start], positions, group
                )
        if not chunk.is_last:
            return
        windows = {}
        if self.window_geometry is not None:
            windows = self._post_window(room, dests, chunk.window_pages, end)
        if self.state_layout is not None:
            self._post_states(room, dests, chunk.state_row)
        deadline = time.monotonic() + self.config.timeouts.transfer_s
        self._wait_room(room, deadline)
        if self._release_if_inactive(room):
            return
        sent = self._room_bytes.get(room, {})
        for dest in dests:
            peer = self.peers[dest.agent]
            window_first, window_pages = windows.get(dest.agent, (0, -1))
            done = wire.Done(
                room=room,
                prefill_rank=self._prefill_unique_rank(),
                epoch=self.epoch,
                bytes=sent.get(dest.agent, 0),
                part=0 if peer.part is None else peer.part.index,
                pages=chunk.index_slice.stop,
                window_first=window_first,
                window_pages=window_pages,
                nonce=dest.nonce,
            )
            if chunk.aux_index is None or dest.aux_index is None:
                raise PlanError("the last chunk carries no metadata row")
            x = self.transport.post(
                "write",
                self.aux_table,
                self.aux_layout.slots(chunk.aux_index, peer.aux_count),
                peer.aux,
                peer.aux_layout.slots(dest.aux_index, peer.aux_count),
                notify=wire.encode_payload(
                    done, self.secret, sender=self.transport.agent_name, receiver=dest.agent
                ),
            )
            self._inflight.setdefault(room, []).append(x)
            self._staging_outstanding[room] += 1
        self._wait_room(room, deadline)
        first_post = self._first_post.get(room)
        progress = self._progress.get(room)
        if progress is None:
            layer_writes, chunk_writes = 0, self._chunk_writes.get(room, 0)
        else:
            layer_writes, chunk_writes = progress.layer_writes, progress.chunk_writes
        self._release_room(room)
        if not self.room_status.failed(room) and self.room_status.known(room):
            # Which path the room took (also counted: layer_writes, chunk_writes). The time
            # is what the transfer added after the last chunk's forward (what streaming hides).
            now = time.monotonic()
            log.info(
                "kvbridge: room %d sent: %d layer writes, %d chunk writes, done %.1f ms after the "
                "last chunk",
                room,
                layer_writes,
                chunk_writes,
                (now - chunk.queued_at) * 1000,
            )
            self.room_status.succeeded(room)
            self._count(
                layer_writes=layer_writes,
                chunk_writes=chunk_writes,
                requests_sent=1,
                exposed_s=[now - chunk.queued_at],
                request_transfer_s=[now - first_post] if first_post is not None else [],
            )

    def _wait_room(self, room: int, deadline: float) -> None:
        for x in self._inflight.get(room, []):
            if not x.done:
                self.transport.wait(x, max(0.0, deadline - time.monotonic()))

    def _release_room(self, room: int, *, drain_s: float | None = None) -> None:
        """Release the room's posted transfers (each exactly once: they leave
        ``_inflight`` here). ``drain_s`` (a failed or aborted room): first give the
        posted writes that long to finish, since the decode reuses its pages once the
        abort is acknowledged; writes still running then mean no acknowledgement (the
        decode frees its pages at SGLang's deferred-release timeout instead). Drops the
        room's bookkeeping. Transfer thread only."""
        self._progress.pop(room, None)
        self._seen_done.pop(room, None)
        self._chunk_writes.pop(room, None)
        self._room_bytes.pop(room, None)
        self._first_post.pop(room, None)
        xfers = self._inflight.pop(room, [])
        drained = True
        if drain_s is not None:
            deadline = time.monotonic() + drain_s
            for x in xfers:
                if x.done or x.error is not None:
                    continue
                try:
                    self.transport.wait(x, max(0.0, deadline - time.monotonic()))
                except DeadlineExceeded:
                    drained = False
                except KVBridgeError:
                    pass  # failed: it writes no more
        for x in xfers:
            self.transport.release(x)
        for run in self._packed_runs.pop(room, []):
            self.packed.release(run)
        if not drained:
            log.warning(
                "kvbridge: room %s failed with writes still running after %.0f s; its abort is not "
                "acknowledged",
                room,
                drain_s,
            )
            self.poison_deferred_ack_room(room)
        if self._staging_outstanding.pop(room, 0):
            self._maybe_ack_drained_abort(room)

    def forget(self, room: int) -> None:
        """The sender of ``room`` is done with it (any thread; never blocks)."""
        self._work.put(_Forget(room))


def _raise(exc: BaseException) -> None:
    raise exc


class KVBridgeKVSender(SoleHolder, _c.Sender):
    """SGLang's sender (scheduler thread). Works under its lane's room id (:mod:`.rooms`:
    the samples of a request with ``n > 1`` share its bootstrap room); a second request
    on a lane another sender holds fails at once, and so does the holder."""

    # The scheduler must hand page ids as numpy arrays (its host-tensor path needs CUDA).
    supports_host_tensor_indices = False

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, *args, **kwargs):
        bootstrap_room = mgr.room_lanes.take(bootstrap_room)  # this request's lane
        holder = self._holder(mgr, bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        refused = self._hold_or_refuse(holder, "prefill")
        if refused is not None:
            # a decode destination for the room that comes later is failed at once
            mgr.tombstones.add(bootstrap_room, refused)
            return
        # a destination refused (or a room aborted) before this sender existed
        reason = mgr.tombstones.reason(self.bootstrap_room)
        if (
            reason is not None
            and self.conclude_state is None
            and mgr.room_status.fail(self.bootstrap_room, reason)
        ):
            log.warning(
                "kvbridge: room %s failed before its request reached this prefill: %s",
                self.bootstrap_room,
                reason,
            )

    def _fail_holder(self, reason: str) -> None:
        # also tells the decode ranks whose destinations arrived: they stop waiting
        self.kv_mgr.conclude_failure(bootstrap_room=self.bootstrap_room, failure_reason=reason)

    def clear(self) -> None:
        if self.duplicate is not None:
            return  # the room is another sender's
        if not self._clear_once():
            return  # cleared already: the room's state may be another request's now
        self._let_go()
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def abort(self) -> None:
        """The prefill aborted this request (scheduler thread): fail the room here, tell
        the decode now if its destination is known, else when it arrives (tombstone);
        the transfer thread then releases what the room holds."""
        if self.duplicate is not None:
            return  # failed already; the room is another sender's
        self._let_go()
        mgr, room = self.kv_mgr, self.bootstrap_room
        targets = mgr.destinations.status_targets(room)
        super().abort()
        mgr.forget(room)
        if self.conclude_state != KVPoll.Failed:
            return  # not ours to abort (deferred bootstrap owned elsewhere)
        reason = "kvbridge: the prefill aborted this request"
        mgr._count(aborted=1)
        mgr.tombstones.add(room, reason)
        if targets:
            mgr.send_kv_status_message(
                targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
            )


__all__ = ["KVBridgeKVSender", "PrefillSide", "plan_forward"]
