"""The ``kvbridge`` SGLang backend: SGLang's Common* machinery, kvbridge's data path.

Reading order: this module (the manager, one per scheduler rank), then :mod:`.sender`
and :mod:`.receiver` (thin), :mod:`.messages` and :mod:`.layout` (pure).

What comes from SGLang (``common/conn.py``, subclassed): the bootstrap server and the
rank registry, the ZMQ control sockets, the per-room status table and its poll
semantics, status messages to decode, the decode heartbeat, abort notifications and
acks. What kvbridge adds:

- a transport (NIXL or Mooncake, from ``KVBRIDGE_CONFIG``) with SGLang's KV pool and
  metadata buffers registered once, as prepared slot tables (:mod:`.layout`);
- decode -> prefill :class:`~.messages.Registration` (once per peer) and
  :class:`~.messages.Destination` (per room) on SGLang's control socket;
- a prefill control thread (registrations, destinations, aborts) and one transfer
  thread, which owns every posted transfer of this rank and all per-room bookkeeping:
  per chunk (:meth:`KVBridgeKVManager.add_transfer_request`, called by SGLang's
  scheduler after each chunk's forward) it posts one write of every layer's K and V
  pages (the transport merges adjacent pages); after the last chunk's pages have
  completed, it writes the metadata row with a :class:`~.messages.Done` notification,
  which the transport delivers once that row has landed;
- per-layer streaming (config ``layerwise``, prompts of at least
  ``layerwise_min_tokens`` tokens): before each prefill forward the scheduler thread
  builds a :class:`~.streaming.ForwardPlan` (:func:`plan_forward`, from the
  ``ForwardBatch.init_new`` hook of :func:`.compat.hook_layerwise`; active while
  ``ModelRunner.forward`` runs that batch): per streamed room, the decode page
  positions that forward completes and their prefill page ids. After each attention
  layer the hook queues ``(plan, layer)`` (:meth:`~KVBridgeKVManager.layer_done`,
  O(1), never blocks) and the transfer thread posts that layer's K and V pages to each
  destination. A room's :class:`~.streaming.RoomProgress` records every posted
  ``(layer, page)`` pair, so the chunk sends then post only what is missing (pages of
  radix-cache hits, layers the hook did not see); other rooms keep the per-chunk path
  unchanged. A failed or aborted room posts nothing more, and its transfers are
  released when the transfer thread next sees the room (a chunk, a layer, or the
  sender's ``clear``/``abort``);
- on decode, a notification thread turning ``Done`` into SGLang's Success, and a control
  thread applying failure statuses and abort acks;
- the packed path (``wire_dtype: fp8`` or ``data_path: packed``; CPU pools,
  :mod:`.packed`): the decode reserves a run of staging chunks per room (a part per
  prefill rank feeding it) and names it in its ``Destination``; every post above packs
  its pages, the decode rank's heads of them, into the prefill's staging (FP8 + scales,
  or exact values) and writes those into its part of the room's run; on each ``Done``
  the notification thread unpacks that part into the room's pages, then passes the
  status on (SGLang counts the prefill ranks). Prefill and decode may so have
  different attention TP sizes (:func:`.packed.room_part`); the direct path needs
  equal ones. Incompatible peers (transport, wire dtype, data path, page or packed
  format, TP sizes) are refused at registration and their rooms fail with the reason;
- metrics (:mod:`.metrics`): counters and per-request histograms on SGLang's
  ``/metrics`` when it runs with ``--enable-metrics``.

Every wait is bounded: transfers (and, on a GPU, the device event a layer's writes wait
for) by ``timeouts.transfer_s``, thread loops poll with
short timeouts, SGLang's own bootstrap/waiting timeouts and heartbeat cover the rest.
Peers are transport agents named with an instance epoch, so a restarted instance is a
new peer. Restarts and aborts (:mod:`.lifecycle`): the prefill registers its epoch with
its bootstrap server, which serves the instance's epochs; the decode polls them every
``timeouts.heartbeat_s`` and drops a restarted or refusing prefill at once (failing its
in-flight rooms, so the next request bootstraps anew instead of hanging). A room
aborted on the prefill tells the decode (now, or when its destination arrives late).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import NamedTuple

import msgspec
import numpy as np
import requests
import zmq

from kvbridge.adapters.sglang import compat, metrics
from kvbridge.adapters.sglang import messages as wire
from kvbridge.adapters.sglang.layout import AuxLayout, kv_geometry, paired_count
from kvbridge.adapters.sglang.lifecycle import (
    EPOCH_PATH,
    EpochWatcher,
    InstanceEpoch,
    Tombstones,
    Verdict,
    decode_epoch,
    encode_epoch,
    rank_key,
)
from kvbridge.adapters.sglang.packed import (
    Part,
    RoomReservations,
    decode_parts,
    part_start,
    pool_planes,
    room_part,
    room_slots,
    typed_geometry,
)
from kvbridge.adapters.sglang.settings import config_from_env
from kvbridge.adapters.sglang.streaming import (
    ForwardPlan,
    LayerReady,
    ReqSpan,
    RoomProgress,
    coalesce,
    completed_span,
    streams,
)
from kvbridge.core.tp import heads_per_rank
from kvbridge.errors import (
    ConfigError,
    DeadlineExceeded,
    IncompatiblePeerError,
    KVBridgeError,
    PlanError,
)
from kvbridge.runtime.packed import PackedPath, Run, staging_descs
from kvbridge.runtime.stats import StatsSnapshot
from kvbridge.transports.registry import create_transport

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll
Mode = _c.DisaggregationMode

_LOOP_POLL_MS = 200
"""Control loops wake at least this often to notice shutdown."""


def fetch_epoch(addr: str, timeout: float) -> tuple[InstanceEpoch | None, bool]:
    """``(epoch, refused)`` of the prefill whose bootstrap server is at ``addr``
    (``host:port``): its epoch document, or None and whether the connection was refused
    (None, False: no answer within ``timeout``, or not a kvbridge prefill; logged)."""
    try:
        resp = requests.get(f"http://{addr}{EPOCH_PATH}", timeout=(timeout, timeout))
    except requests.Timeout:
        return None, False
    except requests.ConnectionError:
        return None, True
    if resp.status_code != 200:
        log.warning("kvbridge: %s%s answered %s; is the prefill running the kvbridge backend?", addr, EPOCH_PATH, resp.status_code)
        return None, False
    try:
        return decode_epoch(resp.content), False
    except KVBridgeError as exc:
        log.warning("kvbridge: %s%s: %s", addr, EPOCH_PATH, exc)
        return None, False


def _has_state(state_indices) -> bool:
    """Whether SGLang asks to move per-request state (mamba/SWA pools): for an MHA
    pool it passes None or a list of empty components."""
    if state_indices is None:
        return False
    return any(s is not None and len(s) > 0 for s in state_indices)


class _Chunk(NamedTuple):
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    queued_at: float
    """``time.monotonic()`` when SGLang handed the chunk over (after its forward)."""


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
    mine = [r for r in compat.extend_requests(batch, model_runner) if isinstance(r.sender, KVBridgeKVSender)]
    if not mine:
        return None
    return mine[0].sender.kv_mgr.plan(batch, [r for r in mine if r.sender.kv_mgr is mine[0].sender.kv_mgr])


class _Peer(NamedTuple):
    agent: str
    kv: object  # DescTable of the decode's KV slots
    aux: object  # DescTable of the decode's metadata rows
    geometry: object
    aux_layout: AuxLayout
    aux_count: int
    staging: object = None  # packed path: DescTable of the decode's staging, in chunks of part.heads
    part: Part | None = None  # packed path: the heads this rank moves to the decode rank


class _Dest(NamedTuple):
    """One decode rank's destination for a room; SGLang's helpers read ``endpoint``,
    ``dst_port``, ``is_dummy`` and ``required_dst_info_num``."""

    agent: str
    endpoint: str
    dst_port: int
    pages: np.ndarray
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int | None
    is_dummy: bool
    staging_first: int | None = None


class KVBridgeKVManager(_c.Manager):
    kv_status_msg_tag = b"KVBRIDGE_STATUS"
    kv_status_msg_carries_reason = True
    # An aborting decode holds its pages until this prefill acknowledges that none of
    # the room's writes is still in flight (SGLang's deferred decode KV release).
    supports_deferred_decode_kv_release = True

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        compat.warn_if_untested()
        self.config = config_from_env()
        self.epoch = uuid.uuid4().hex[:12]
        if is_mla_backend:
            raise ConfigError("the kvbridge SGLang backend does not support MLA models yet", fix="use --disaggregation-transfer-backend mooncake or nixl")
        on_cpu = getattr(server_args, "device", "cuda") == "cpu"
        self.memory = "host" if on_cpu else "device"
        self.device_index = 0 if on_cpu else int(args.gpu_id)
        self.geometry = kv_geometry(
            page_size=args.page_size,
            ptrs=args.kv_data_ptrs,
            lens=args.kv_data_lens,
            item_lens=args.kv_item_lens,
            memory=self.memory,
            device=self.device_index,
        )
        self.aux_layout = AuxLayout.build(ptrs=args.aux_data_ptrs, lens=args.aux_data_lens, item_lens=args.aux_item_lens)
        role = "prefill" if disaggregation_mode == Mode.PREFILL else "decode"
        self._metrics = metrics.exporter(role=role, tp_rank=args.engine_rank, transport=self.config.transport)
        self.transport = create_transport(
            self.config.transport,
            self.config,
            agent_name=f"sglang-{role}-r{args.engine_rank}-{self.epoch}",
            memory=self.memory,
        )
        self._stop = threading.Event()
        try:
            self.transport.register(self.geometry.regions(), memory=self.memory, device=self.device_index)
            self.transport.register(self.aux_layout.regions(), memory="host")
            self.kv_table = self.transport.prepare(self.geometry.slot_table(), memory=self.memory)
            self.aux_table = self.transport.prepare(self.aux_layout.table(), memory="host")
            self.packed: PackedPath | None = None
            if self.config.packed:
                dtype, head_dim = compat.kv_dtype_and_head_dim(server_args, args)
                typed = typed_geometry(self.geometry, dtype=dtype, head_dim=head_dim)
                self.packed = PackedPath(typed, pool_planes(typed), self.config.staging_mb, self.transport, fp8=self.config.wire_dtype == "fp8")
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
        except Exception:
            self.transport.close()
            raise
        log.info(
            "kvbridge %s rank %s: transport %s, agent %s, %d KV slots of %d B, %d metadata buffers",
            role, args.engine_rank, self.config.transport, self.transport.agent_name,
            self.geometry.num_slots, self.geometry.spec.block_bytes, len(self.aux_layout.ptrs),
        )
        if disaggregation_mode == Mode.PREFILL:
            self.peers: dict[str, _Peer] = {}
            self._peers_lock = threading.Lock()
            self._inflight: dict[int, list] = {}
            self._progress: dict[int, RoomProgress] = {}
            self._chunk_writes: dict[int, int] = {}
            self._room_bytes: dict[int, dict[str, int]] = {}  # room -> decode agent -> bytes posted
            self._first_post: dict[int, float] = {}
            self._packed_runs: dict[int, list[Run]] = {}  # room -> our staging runs
            self._refused: dict[str, str] = {}  # decode agent -> why its registration was refused
            self._num_layers = self.geometry.spec.num_layers
            self._start_layer = compat.start_layer(args)
            self._work: queue.Queue[_Chunk | LayerReady | _Forget] = queue.Queue()
            self.tombstones = Tombstones()
            self._thread("kvbridge-prefill-control", self._prefill_control_loop)
            self._thread("kvbridge-transfer", self._transfer_loop)
            if self.config.layerwise:
                _streaming_managers.append(self)
        else:
            self.epochs = EpochWatcher()
            self._epochs_lock = threading.Lock()
            if self.packed is not None:
                self.reservations = RoomReservations(self.packed, num_layers=self.geometry.spec.num_layers, hold_s=self.config.timeouts.transfer_s)
            # held while a room is unpacked, and by the receiver's clear/abort: SGLang never
            # frees a room's pages while kvbridge writes into them
            self._unpack_lock = threading.Lock()
            self._thread("kvbridge-decode-control", self._decode_control_loop)
            self._thread("kvbridge-decode-notify", self._decode_notify_loop)
            self._thread("kvbridge-decode-epochs", self._epoch_loop)
            self._start_heartbeat_checker_thread()

    def _count(self, **fields) -> None:
        """Add to kvbridge's Prometheus metrics (:mod:`.metrics`; a no-op unless SGLang
        runs with ``--enable-metrics``): counters and histogram samples, named as the
        fields of :class:`~kvbridge.runtime.stats.StatsSnapshot`. Any thread."""
        if self._metrics is not None:
            self._metrics.export(StatsSnapshot(**fields))

    def _report_staging(self) -> None:
        """Set the staging gauges (``wire_dtype: fp8`` with ``--enable-metrics``): slots
        of this rank's buffer, and those held by rooms (a decode's retired runs too,
        until their hold ends). Called every loop (at least every 200 ms) by the one
        thread that owns the gauges: the prefill's transfer thread, the decode's
        notification thread."""
        if self._metrics is not None and self.packed is not None:
            a = self.packed.allocator
            self._metrics.set_levels(staging_slots=a.num_slots, staging_slots_used=a.num_slots - a.free_slots)

    def _thread(self, name: str, target) -> None:
        def guarded():
            try:
                target()
            except Exception:
                log.exception("%s died; transfers of this rank will fail at their deadlines", name)

        threading.Thread(target=guarded, name=name, daemon=True).start()

    # --- bootstrap registration (prefill) --------------------------------------------------

    def _register_topology_row(self, url, payload):
        # This rank's epoch is part of what it registers (a restart is a new instance);
        # rows gathered from other ranks (SGLang's multi-DP registry path) carry their own.
        if payload.get("rank_port") == self.rank_port and payload.get("rank_ip") == self.local_ip:
            payload = dict(payload, kvbridge_epoch=self.epoch, kvbridge_agent=self.transport.agent_name)
        return super()._register_topology_row(url, payload)

    # --- decode: is the prefill we cached still the same instance? --------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        # Called by the decode scheduler per new request; fetches once per prefill.
        if bootstrap_addr in self.prefill_info_table:
            return True
        epoch, _ = self._fetch_epoch(bootstrap_addr)  # before the info: a race errs towards "restarted"
        ok = super().try_ensure_parallel_info(bootstrap_addr)
        if ok and epoch is not None and epoch.ready:
            with self._epochs_lock:
                self.epochs.remember(bootstrap_addr, epoch)
        return ok

    def _fetch_epoch(self, addr: str) -> tuple[InstanceEpoch | None, bool]:
        return fetch_epoch(addr, timeout=min(2.0, self.config.timeouts.heartbeat_s))

    def _epoch_loop(self) -> None:
        period = self.config.timeouts.heartbeat_s
        while not self._stop.wait(period):
            with self.connection_lock:
                addrs = list(self.prefill_info_table)
            with self._epochs_lock:
                for gone in self.epochs.addresses() - set(addrs):
                    self.epochs.forget(gone)  # SGLang's heartbeat dropped it
            for addr in addrs:
                epoch, refused = self._fetch_epoch(addr)
                with self._epochs_lock:
                    before = self.epochs.known(addr)
                    verdict = self.epochs.observe(addr, epoch, refused=refused)
                if verdict is Verdict.RESTARTED:
                    log.warning(
                        "kvbridge: the prefill at %s restarted (instance %s -> %s): dropping its cached "
                        "bootstrap info and failing its in-flight requests; new requests bootstrap again",
                        addr, before.instance if before else "?", epoch.instance if epoch else "?",
                    )
                    self._handle_node_failure(addr)
                elif verdict is Verdict.DOWN:
                    log.warning("kvbridge: the prefill at %s refuses connections: failing its in-flight requests", addr)
                    self._handle_node_failure(addr)

    # --- decode -> prefill messages (built on decode, sent by CommonKVReceiver) ------------

    def build_receiver_registration_message(self) -> list[bytes]:
        return wire.encode(
            wire.Registration(
                agent=self.transport.agent_name,
                epoch=self.epoch,
                transport=self.config.transport,
                transport_md=self.transport.metadata(),
                geometry=self.geometry,
                aux=self.aux_layout,
                ip=self.local_ip,
                port=self.rank_port,
                wire_dtype=self.config.wire_dtype,
                staging=self.packed.info if self.packed is not None else None,
                packed_spec=self.packed.geometry.spec if self.packed is not None else None,
                data_path=self.config.resolved_data_path,
                tp_size=self.attn_tp_size,
                tp_rank=self.attn_tp_rank,
                kv_heads=self._total_kv_heads(),
            )
        )

    def _total_kv_heads(self) -> int:
        """The model's KV heads over all ranks: SGLang's ``KVArgs``, else, on the packed
        path, this rank's heads times the attention TP size; 0 when unknown."""
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        if not total and self.packed is not None:
            total = self.packed.geometry.spec.num_kv_heads * self.attn_tp_size
        return total

    def decode_parts(self, prefill_tp: int) -> tuple[Part, ...]:
        """Decode, packed path: every source's part of this rank's rooms from a prefill
        of attention TP ``prefill_tp``. Raises
        :class:`~kvbridge.errors.IncompatiblePeerError` for sizes that do not pair."""
        return decode_parts(self._total_kv_heads(), prefill_tp, self.attn_tp_size, self.attn_tp_rank)

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room,
        required_dst_info_num,
        kv_indices,
        aux_index,
        state_indices,
        decode_prefix_len,
        is_dummy,
        device_kv_indices=None,
    ) -> list[bytes]:
        staging_first = None
        if self.packed is not None and not is_dummy:
            res = self.reservations.get(int(bootstrap_room))  # reserved by the receiver's send_metadata
            if res is None:
                log.warning("kvbridge: room %s: no staging run for %d pages (staging_mb %d); the prefill fails it", bootstrap_room, len(kv_indices), self.config.staging_mb)
            else:
                staging_first = res.first
        return wire.encode(
            wire.Destination(
                room=int(bootstrap_room),
                agent=self.transport.agent_name,
                ip=self.local_ip,
                port=self.rank_port,
                pages=wire.encode_pages(kv_indices),
                aux_index=None if aux_index is None else int(aux_index),
                required_dst_info_num=int(required_dst_info_num),
                decode_prefix_len=None if decode_prefix_len is None else int(decode_prefix_len),
                is_dummy=bool(is_dummy),
                staging_first=staging_first,
            )
        )

    # --- prefill: control thread -----------------------------------------------------------

    def _recv_loop(self, handle) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_LOOP_POLL_MS):
                continue
            frames = self.server_socket.recv_multipart()
            try:
                handle(frames)
            except KVBridgeError as exc:
                log.warning("kvbridge: dropped a control message: %s", exc)

    def _prefill_control_loop(self) -> None:
        self._recv_loop(self._prefill_handle)

    def _prefill_handle(self, frames: list[bytes]) -> None:
        if self.deferred_bootstrap is not None and self._handle_bootstrap_message(frames):
            return
        if frames and frames[0] == _c.ABORT_TAG:
            self._handle_abort(frames)
            return
        msg = wire.decode(frames)
        if isinstance(msg, wire.Registration):
            self._add_peer(msg)
        elif isinstance(msg, wire.Destination):
            self._add_destination(msg)
        else:
            log.warning("kvbridge: unexpected %s on the prefill control socket", type(msg).__name__)

    def _add_peer(self, reg: wire.Registration) -> None:
        try:
            part = self._pairing(reg)
        except IncompatiblePeerError as exc:
            log.error("kvbridge: refused decode %s: %s", reg.agent, exc)
            self._refused[reg.agent] = str(exc)
            return
        with self._peers_lock:
            if reg.agent in self.peers:
                return
            peer = self.transport.add_peer(reg.transport_md)
            kv = self.transport.prepare(reg.geometry.slot_table(), memory=reg.geometry.memory, peer=peer)
            aux = self.transport.prepare(reg.aux.table(), memory="host", peer=peer)
            staging = None
            if part is not None:
                chunks = staging_descs(reg.staging, self.packed.chunk(part.heads).nbytes)
                staging = self.transport.prepare(chunks, memory=reg.staging.memory, peer=peer)
            count = paired_count(self.aux_layout, reg.aux)
            if count != len(self.aux_layout.ptrs) or count != len(reg.aux.ptrs):
                self.check_peer_aux_buffer_count(reg.agent, len(reg.aux.ptrs))
            self.peers[reg.agent] = _Peer(reg.agent, kv, aux, reg.geometry, reg.aux, count, staging, part)
            # A restarted decode (same address, new epoch) replaces its old agent.
            stale = [a for a in self.peers if a != reg.agent and a.rsplit("-", 1)[0] == reg.agent.rsplit("-", 1)[0]]
        for agent in stale:
            self._drop_peer(agent)
        log.info("kvbridge: registered decode peer %s (epoch %s)", reg.agent, reg.epoch)

    def _pairing(self, reg: wire.Registration) -> Part | None:
        """Check a decode's registration: on the packed path, the heads this rank moves
        to it (:func:`.packed.room_part`; any TP sizes that pair); on the direct path
        None (whole pages, equal TP sizes only).

        Raises:
            IncompatiblePeerError: why it cannot be served (its rooms then fail with
                this reason), naming the fix.
        """
        fix = "set the same KVBRIDGE_CONFIG on prefill and decode"
        if reg.transport != self.config.transport:
            raise IncompatiblePeerError(f"it uses transport {reg.transport!r}, this prefill {self.config.transport!r}; {fix}")
        if reg.wire_dtype != self.config.wire_dtype:
            raise IncompatiblePeerError(f"it uses wire_dtype {reg.wire_dtype!r}, this prefill {self.config.wire_dtype!r}; {fix}")
        if reg.data_path != self.config.resolved_data_path:
            raise IncompatiblePeerError(f"it uses data_path {reg.data_path!r}, this prefill {self.config.resolved_data_path!r}; {fix}")
        p_tp, d_tp = self.attn_tp_size, reg.tp_size
        if self.packed is None:
            if p_tp != d_tp:
                raise IncompatiblePeerError(
                    f"prefill attention TP {p_tp}, decode TP {d_tp}: the direct data path moves whole pages, and an "
                    "SGLang page holds every KV head of its rank token by token",
                    fix="set data_path 'packed' (exact values) or wire_dtype 'fp8' in KVBRIDGE_CONFIG on both instances",
                )
            if reg.geometry.spec != self.geometry.spec:
                raise IncompatiblePeerError(f"its KV pages {reg.geometry.spec} differ from this prefill's {self.geometry.spec}")
            return None
        mine = self.packed.geometry.spec
        theirs = reg.packed_spec
        if reg.staging is None or theirs is None or msgspec.structs.replace(theirs, num_kv_heads=mine.num_kv_heads) != mine:
            raise IncompatiblePeerError(f"its packed KV ({theirs}) differs from this prefill's ({mine})")
        total = self._total_kv_heads()
        if reg.kv_heads and reg.kv_heads != total:
            raise IncompatiblePeerError(f"its model has {reg.kv_heads} KV heads, this prefill's {total}; serve the same model on both")
        part = room_part(total, p_tp, d_tp, self.attn_tp_rank, reg.tp_rank)
        if part is None or (mine.num_kv_heads, theirs.num_kv_heads) != (heads_per_rank(total, p_tp), heads_per_rank(total, d_tp)):
            raise IncompatiblePeerError(
                f"decode rank {reg.tp_rank} of attention TP {d_tp} ({theirs.num_kv_heads} KV heads) does not pair with "
                f"prefill rank {self.attn_tp_rank} of TP {p_tp} ({mine.num_kv_heads} KV heads) for a model of {total}"
            )
        return part

    def _drop_peer(self, agent: str) -> None:
        with self._peers_lock:
            peer = self.peers.pop(agent, None)
        if peer is None:
            return
        for table in (peer.kv, peer.aux, peer.staging):
            if table is not None:
                self.transport.release_table(table)
        self.transport.remove_peer(peer.agent)

    def _add_destination(self, msg: wire.Destination) -> None:
        room = msg.room
        dest = _Dest(
            msg.agent, msg.ip, msg.port, wire.decode_pages(msg.pages), msg.aux_index,
            msg.required_dst_info_num, msg.decode_prefix_len, msg.is_dummy, msg.staging_first,
        )
        aborted = self.tombstones.reason(room)
        if aborted is not None:
            self.send_kv_status_message(targets=[(msg.ip, msg.port)], bootstrap_room=room, status=KVPoll.Failed, failure_reason=aborted)
            return
        reason = None
        if not msg.is_dummy and msg.agent in self._refused:
            reason = f"kvbridge: this prefill refused decode {msg.agent}: {self._refused[msg.agent]}"
        elif not msg.is_dummy and msg.agent not in self.peers:
            # A decode that registered with an earlier instance of this prefill.
            reason = f"kvbridge: unknown decode peer {msg.agent} (this prefill restarted; epoch {self.epoch})"
        elif not msg.is_dummy and self.packed is not None and msg.staging_first is None:
            reason = "kvbridge: the decode's staging buffer had no room for this request (packed data path); raise staging_mb on the decode"
        if reason is not None:
            self.send_kv_status_message(targets=[(msg.ip, msg.port)], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)
            # and this side's request too (SGLang's router waits for both answers): now,
            # or, when its sender is not made yet, as it is (the tombstone)
            self.tombstones.add(room, reason)
            self.fail_room(room, reason)
            return
        infos = self.transfer_infos.setdefault(room, {})
        infos[msg.agent] = dest
        if len(infos) == msg.required_dst_info_num:
            self.resolve_kv_replica_factor(infos)
            self.req_to_decode_prefix_len[room] = next(
                (d.decode_prefix_len for d in infos.values() if d.decode_prefix_len is not None), 0
            )
            self.update_status(room, KVPoll.WaitingForInput)

    def fail_room(self, room: int, reason: str) -> bool:
        """Prefill: fail ``room`` here unless it succeeded or failed already (SGLang's
        scheduler then aborts the request with ``reason``). Whether it did; False too
        when the room has no sender yet. Any thread."""
        if room in self.request_status and self.check_status(room) not in (KVPoll.Success, KVPoll.Failed):
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            return True
        return False

    def _handle_abort(self, frames: list[bytes]) -> None:
        note = _c.AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)
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
        """Queue one chunk (never blocks the scheduler)."""
        if bootstrap_room not in self.transfer_infos:
            return  # dummy rank, or already cleared
        if _has_state(state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason="kvbridge: state (mamba/SWA) transfer is not supported yet")
            return
        self._work.put(
            _Chunk(bootstrap_room, np.asarray(kv_indices, dtype=np.int64), index_slice, is_last_chunk, aux_index, time.monotonic())
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
            if not streams(layerwise=self.config.layerwise, min_tokens=self.config.layerwise_min_tokens, prompt_len=r.prompt_len):
                continue
            if r.room not in self.transfer_infos:
                continue  # no destination yet (or a dummy rank): the chunk sends cover it
            lo, hi = completed_span(
                prefix_len=r.prefix_len, extend_len=r.extend_len, prompt_len=r.prompt_len,
                decode_prefix_len=r.decode_prefix_len, page_size=page,
            )
            if hi <= lo:
                continue
            first = (lo * page) + r.decode_prefix_len
            src = compat.page_ids(batch, r.req_pool_idx, first, first + (hi - lo) * page, page)
            if src.size != hi - lo:
                log.warning("kvbridge: room %s: %d page ids for positions %d:%d; left to the chunk send", r.room, src.size, lo, hi)
                continue
            spans.append(ReqSpan(r.room, lo, hi, src))
        return ForwardPlan(tuple(spans), self.layer_done) if spans else None

    def layer_done(self, plan: ForwardPlan, layer_id: int) -> None:
        """Attention layer ``layer_id`` of ``plan``'s forward has written its K and V
        (forward thread, once per layer; O(1), never blocks)."""
        layer = layer_id - self._start_layer
        if not 0 <= layer < self._num_layers:
            return
        event = compat.record_layer_event() if self.memory == "device" else None
        self._work.put(LayerReady(plan, (layer,), event))

    # --- prefill: transfer thread -----------------------------------------------------------

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            self._report_staging()
            try:
                items = [self._work.get(timeout=_LOOP_POLL_MS / 1000)]
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
        return room in self.request_status and self.check_status(room) != KVPoll.Failed and room in self.transfer_infos

    def _release_if_inactive(self, room: int) -> bool:
        """A failed, aborted or cleared room posts nothing more: release what it holds,
        after its posted writes drained (:meth:`_release_room`). Whether it was inactive."""
        if self._room_active(room):
            return False
        self._release_room(room, drain_s=self.config.timeouts.transfer_s)
        return True

    def _dests(self, room: int) -> list[_Dest]:
        return [d for d in self.transfer_infos[room].values() if not d.is_dummy]

    def _post(self, room: int, dests: list[_Dest], src_pages: np.ndarray, positions, layers=None) -> int:
        """Write ``src_pages`` (of ``layers``, default all) to the pages at ``positions``
        (a slice or an index array) of every destination's page list; returns the
        number of writes posted. The room's list of in-flight transfers owns them."""
        xfers = self._inflight.setdefault(room, [])
        packed: dict[tuple[int, int], tuple[list[int], np.ndarray, object]] = {}  # head range -> packed chunks
        posted = 0
        for dest in dests:
            peer = self.peers.get(dest.agent)
            if peer is None:
                raise PlanError(f"decode peer {dest.agent} is gone")
            dst_pages = dest.pages[positions]
            if dst_pages.size != src_pages.size:
                where = f"{positions.start}:{positions.stop}" if isinstance(positions, slice) else f"{positions.tolist()}"
                raise PlanError(
                    f"{src_pages.size} pages map to {dst_pages.size} destination pages "
                    f"(positions {where} of {dest.pages.size})"
                )
            if src_pages.size:
                if peer.part is None:  # the pages themselves
                    src_table, src, dst_table = self.kv_table, self.geometry.slots(src_pages, layers), peer.kv
                    dst, slot_bytes = peer.geometry.slots(dst_pages, layers), self.geometry.spec.block_bytes
                else:  # the decode rank's heads of them, packed, into its part of the room's run
                    part = peer.part
                    if part.p_heads not in packed:
                        packed[part.p_heads] = self._pack(room, src_pages, layers, part)
                    (layer_ids, src, src_table), dst_table = packed[part.p_heads], peer.staging
                    at = np.arange(dest.pages.size, dtype=np.int64)[positions]
                    first = part_start(dest.staging_first, part.index, self._num_layers, int(dest.pages.size))
                    dst, slot_bytes = room_slots(first, dest.pages.size, layer_ids, at), self.packed.chunk(part.heads).nbytes
                xfers.append(self.transport.post("write", src_table, src, dst_table, dst))
                self._staging_outstanding[room] += 1
                posted += 1
                nbytes = int(src.size) * slot_bytes
                sent = self._room_bytes.setdefault(room, {})
                sent[dest.agent] = sent.get(dest.agent, 0) + nbytes
                self._first_post.setdefault(room, time.monotonic())
                self._count(transfers=1, bytes_sent=nbytes)
        return posted

    def _pack(self, room: int, src_pages: np.ndarray, layers, part: Part) -> tuple[list[int], np.ndarray, object]:
        """Pack ``part``'s heads of ``layers`` (default all) of ``src_pages`` into a run of
        chunks of our staging buffer, layer-major; the room holds the run until it is
        released. Returns the layer ids, the run's chunks and the table they index."""
        layer_ids = list(range(self._num_layers)) if layers is None else [int(l) for l in layers]
        count = len(layer_ids) * int(src_pages.size)
        run = self.packed.reserve(count, part.heads)
        if run is None:
            raise PlanError(
                f"the staging buffer has no run for {count} packed pages (packed path, staging_mb "
                f"{self.config.staging_mb}); raise staging_mb on the prefill"
            )
        self._packed_runs.setdefault(room, []).append(run)
        whole = part.heads == self.packed.slot.num_heads
        self.packed.pack(layer_ids, src_pages, run.first, heads=None if whole else part.p_heads)
        return layer_ids, np.arange(run.first, run.first + count, dtype=np.int64), self.packed.table_for(part.heads)

    def _send_layers(self, item: LayerReady) -> None:
        if item.event is not None:
            deadline = time.monotonic() + self.config.timeouts.transfer_s
            while not item.event.query():  # the layer's kernels, then our reads
                if time.monotonic() >= deadline:
                    exc = DeadlineExceeded(f"layers {list(item.layers)} not computed within {self.config.timeouts.transfer_s:g}s")
                    for span in item.plan.spans:
                        self._guarded(span.room, _raise, exc)
                    return
                time.sleep(50e-6)
        for span in item.plan.spans:
            self._guarded(span.room, self._send_span, span, item.layers)

    def _send_span(self, span: ReqSpan, layers: tuple[int, ...]) -> None:
        room = span.room
        if self._release_if_inactive(room):
            return
        dests = self._dests(room)
        progress = self._progress.get(room)
        if progress is None:
            progress = self._progress[room] = RoomProgress(self._num_layers, min(d.pages.size for d in dests) if dests else 0)
        for group, positions in progress.take(layers, span.lo, span.hi):
            progress.layer_writes += self._post(room, dests, span.src_pages[positions - span.lo], positions, group)

    def _send_chunk(self, chunk: _Chunk) -> None:
        room = chunk.room
        if self._release_if_inactive(room):
            return
        dests = self._dests(room)
        progress = self._progress.get(room)
        if progress is None:  # the per-chunk path: every layer of the chunk's pages
            self._chunk_writes[room] = self._chunk_writes.get(room, 0) + self._post(room, dests, chunk.pages, chunk.index_slice)
        else:  # streamed: only the (layer, page) pairs no layer post covered
            start = chunk.index_slice.start
            if chunk.index_slice.stop - start != chunk.pages.size:
                raise PlanError(f"chunk of {chunk.pages.size} pages for positions {start}:{chunk.index_slice.stop}")
            for group, positions in progress.take(range(self._num_layers), start, chunk.index_slice.stop):
                progress.chunk_writes += self._post(room, dests, chunk.pages[positions - start], positions, group)
        if not chunk.is_last:
            return
        deadline = time.monotonic() + self.config.timeouts.transfer_s
        self._wait_room(room, deadline)
        if self._release_if_inactive(room):
            return
        sent = self._room_bytes.get(room, {})
        for dest in dests:
            peer = self.peers[dest.agent]
            done = wire.Done(
                room=room, prefill_rank=self._prefill_unique_rank(), epoch=self.epoch, bytes=sent.get(dest.agent, 0),
                part=0 if peer.part is None else peer.part.index,
            )
            if chunk.aux_index is None or dest.aux_index is None:
                raise PlanError("the last chunk carries no metadata row")
            x = self.transport.post(
                "write",
                self.aux_table,
                self.aux_layout.slots(chunk.aux_index, peer.aux_count),
                peer.aux,
                peer.aux_layout.slots(dest.aux_index, peer.aux_count),
                notify=wire.encode_payload(done),
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
        with self.failure_lock:
            failed = room in self.failure_records
        if not failed and room in self.request_status:
            # Tests read this line: it shows which path a room took. The time is what the
            # transfer added after the last chunk's forward (what streaming hides).
            now = time.monotonic()
            log.info(
                "kvbridge: room %d sent: %d layer writes, %d chunk writes, done %.1f ms after the last chunk",
                room, layer_writes, chunk_writes, (now - chunk.queued_at) * 1000,
            )
            self.update_status(room, KVPoll.Success)
            self._count(
                requests_sent=1, exposed_s=[now - chunk.queued_at],
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
            log.warning("kvbridge: room %s failed with writes still running after %.0f s; its abort is not acknowledged", room, drain_s)
            self.poison_deferred_ack_room(room)
        if self._staging_outstanding.pop(room, 0):
            self._maybe_ack_drained_abort(room)

    # --- decode: control and notification threads -------------------------------------------

    def _decode_control_loop(self) -> None:
        self._recv_loop(self._decode_handle)

    def _decode_handle(self, frames: list[bytes]) -> None:
        if self.handle_abort_ack_message(frames):
            return
        status = self.parse_kv_status_message(frames)
        if status is None:
            log.warning("kvbridge: unexpected %d-frame message on the decode control socket", len(frames))
            return
        room, value, prefill_rank, reason = status
        if value == KVPoll.Failed:
            self._count(failures=1)
        self.apply_prefill_status(bootstrap_room=room, status=value, prefill_rank=prefill_rank, failure_reason=reason)

    def _unpack(self, room: int, index: int) -> bool:
        """Unpack source ``index``'s part of a room whose ``Done`` from that source
        arrived into its pages' heads (notification thread, before SGLang counts the
        source). False: the room is gone or failed, or the part unknown."""
        with self._unpack_lock:
            res, last = self.reservations.arrive(room, index)
            if res is None:
                log.warning("kvbridge: Done for part %d of room %s, which holds no such staging run (cleared, aborted or repeated); ignored", index, room)
                return False
            try:
                if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
                    return False
                part, layers = res.parts[index], self.geometry.spec.num_layers
                first = res.part_first(index, layers)
                heads = None if part.heads == self.packed.slot.num_heads else part.d_heads
                for layer in range(layers):
                    self.packed.unpack(layer, res.pages, first + layer * res.pages.size, heads=heads)
                return True
            except Exception as exc:  # noqa: BLE001 - fail the room, keep the thread
                log.warning("kvbridge: room %s: unpacking failed: %s", room, exc)
                self._count(failures=1)
                self.record_failure(room, f"kvbridge: unpacking the FP8 KV failed: {exc}")
                self.update_status(room, KVPoll.Failed)
                return False
            finally:
                if last:
                    self.reservations.free(res)  # every source is done: none writes into it any more

    def _decode_notify_loop(self) -> None:
        while not self._stop.is_set():
            if self.packed is not None:
                self.reservations.reap()
                self._report_staging()
            for note in self.transport.take_notifications(timeout=_LOOP_POLL_MS / 1000):
                try:
                    msg = wire.decode_payload(note.payload)
                except KVBridgeError as exc:
                    log.warning("kvbridge: dropped a notification from %s: %s", note.peer, exc)
                    continue
                if isinstance(msg, wire.Done):
                    if self.packed is not None and not self._unpack(msg.room, msg.part):
                        continue
                    self.apply_prefill_status(bootstrap_room=msg.room, status=KVPoll.Success, prefill_rank=msg.prefill_rank)
                    self._count(requests_received=1, bytes_received=msg.bytes)

    # --- lifecycle -----------------------------------------------------------------------------

    def forget(self, room: int) -> None:
        """The sender of ``room`` is done with it (any thread; never blocks)."""
        if self.disaggregation_mode == Mode.PREFILL:
            self._work.put(_Forget(room))

    def close(self) -> None:
        if self in _streaming_managers:
            _streaming_managers.remove(self)
        self._stop.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        self.transport.close()


def _raise(exc: BaseException) -> None:
    raise exc


class KVBridgeKVSender(_c.Sender):
    # The scheduler must hand page ids as numpy arrays (its host-tensor path needs CUDA).
    supports_host_tensor_indices = False

    def __init__(self, mgr, *args, **kwargs):
        super().__init__(mgr, *args, **kwargs)
        # a destination refused (or a room aborted) before this sender existed
        reason = mgr.tombstones.reason(self.bootstrap_room)
        if reason is not None and self.conclude_state is None and mgr.fail_room(self.bootstrap_room, reason):
            log.warning("kvbridge: room %s failed before its request reached this prefill: %s", self.bootstrap_room, reason)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def abort(self) -> None:
        """The prefill aborted this request (scheduler thread): fail the room here, tell
        the decode now if its destination is known, else when it arrives (tombstone);
        the transfer thread then releases what the room holds."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        targets = mgr._room_notify_targets(room) if room in mgr.transfer_infos else []
        super().abort()
        mgr.forget(room)
        if self.conclude_state != KVPoll.Failed:
            return  # not ours to abort (deferred bootstrap owned elsewhere)
        reason = "kvbridge: the prefill aborted this request"
        mgr._count(aborted=1)
        mgr.tombstones.add(room, reason)
        if targets:
            mgr.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)


class _StagingWait(NamedTuple):
    """A room's ``send_metadata`` call, held until a staging run is free."""

    args: tuple
    kwargs: dict
    pages: np.ndarray
    parts: tuple[Part, ...]
    deadline: float


class KVBridgeKVReceiver(_c.Receiver):
    """SGLang's receiver. On the packed path (``wire_dtype: fp8``, ``data_path:
    packed``):

    - ``send_metadata`` first reserves the room's staging run (a part per prefill rank
      that feeds this rank, :func:`.packed.decode_parts`); when the buffer is full
      the call is held (SGLang sees the room waiting for input, its own waiting timeout
      not yet started) and retried at each ``poll`` from SGLang's scheduler, in the
      order rooms poll. It goes out once a run is free, or after
      ``timeouts.receive_s`` without one (then, as for a room that can never fit,
      without a run: the prefill fails the room naming ``staging_mb``);
    - a room's clear or abort waits for an unpack in progress (the pages stay SGLang's
      until it ends), drops a held ``send_metadata``, and retires the room's staging
      run if it never completed.

    Who calls: SGLang's decode scheduler thread, all methods.
    """

    _staging_wait: _StagingWait | None = None

    def send_metadata(self, kv_indices, aux_index=None, *args, **kwargs) -> None:
        mgr = self.kv_mgr
        if mgr.packed is None or getattr(self, "bootstrap_infos", None) is None:
            super().send_metadata(kv_indices, aux_index, *args, **kwargs)
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        try:
            parts = mgr.decode_parts(int(self.prefill_info.attn_tp_size))
        except IncompatiblePeerError as exc:  # the prefill refuses this rank too, naming it
            log.warning("kvbridge: room %s: %s", self.bootstrap_room, exc)
            super().send_metadata(kv_indices, aux_index, *args, **kwargs)
            return
        wait = _StagingWait((kv_indices, aux_index, *args), kwargs, pages, parts, time.monotonic() + mgr.config.timeouts.receive_s)
        if not mgr.reservations.fits(int(pages.size), parts):
            log.warning("kvbridge: room %s: %d pages exceed the staging buffer (staging_mb %d) however empty", self.bootstrap_room, pages.size, mgr.config.staging_mb)
        elif mgr.reservations.reserve(int(self.bootstrap_room), pages, parts) is None:
            log.info("kvbridge: room %s waits for room in the staging buffer (%d pages)", self.bootstrap_room, pages.size)
            self._staging_wait = wait
            return
        super().send_metadata(*wait.args, **wait.kwargs)

    def poll(self):
        wait = self._staging_wait
        if wait is not None:
            if self.conclude_state is not None:
                self._staging_wait = None
            elif (run := self.kv_mgr.reservations.reserve(int(self.bootstrap_room), wait.pages, wait.parts)) is not None or time.monotonic() >= wait.deadline:
                if run is None:
                    log.warning("kvbridge: room %s found no room in the staging buffer for timeouts.receive_s; the prefill fails it", self.bootstrap_room)
                self._staging_wait = None
                super().send_metadata(*wait.args, **wait.kwargs)
        return super().poll()

    def clear(self) -> None:
        mgr = self.kv_mgr
        if mgr.packed is None:
            super().clear()
            return
        owned = getattr(self, "_owns_bootstrap_room", True)  # SGLang's: this receiver's room
        self._staging_wait = None
        with mgr._unpack_lock:
            super().clear()
            if owned:
                mgr.reservations.retire(self.bootstrap_room)

    def abort(self) -> None:
        mgr = self.kv_mgr
        if mgr.packed is None:
            super().abort()
            return
        self._staging_wait = None
        with mgr._unpack_lock:
            super().abort()


class KVBridgeKVBootstrapServer(_c.BootstrapServer):
    """SGLang's bootstrap server (prefill main process) plus the instance's epochs at
    :data:`~.lifecycle.EPOCH_PATH`: a fresh id per start, and each rank's epoch from its
    registration."""

    def __init__(self, host, port):
        # Set before SGLang's constructor: it adds the routes and starts serving.
        self.kvbridge_instance = uuid.uuid4().hex[:12]
        self.kvbridge_ranks: dict[str, str] = {}
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_get(EPOCH_PATH, self._handle_kvbridge_epoch)

    async def _handle_route_put(self, request):
        data = await request.json()  # aiohttp caches the body: SGLang's handler reads it again
        response = await super()._handle_route_put(request)
        if response.status == 200 and isinstance(data.get("kvbridge_epoch"), str):
            dp = data["attn_dp_rank"] if data.get("system_dp_size", 1) == 1 else data["system_dp_rank"]
            key = rank_key(dp=dp, cp=data["attn_cp_rank"], tp=data["attn_tp_rank"], pp=data["pp_rank"])
            self.kvbridge_ranks[key] = data["kvbridge_epoch"]
        return response

    async def _handle_kvbridge_epoch(self, request):
        from aiohttp import web

        doc = InstanceEpoch(instance=self.kvbridge_instance, ranks=dict(self.kvbridge_ranks), ready=self._is_ready())
        return web.Response(body=encode_epoch(doc), content_type="application/json")


def classes():
    return KVBridgeKVManager, KVBridgeKVSender, KVBridgeKVReceiver, KVBridgeKVBootstrapServer


__all__ = ["KVBridgeKVBootstrapServer", "KVBridgeKVManager", "KVBridgeKVReceiver", "KVBridgeKVSender", "classes"]
