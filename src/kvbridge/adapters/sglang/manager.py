"""The ``kvbridge`` SGLang backend: SGLang's Common* machinery, kvbridge's data path.

Reading order: this module (the manager, one per scheduler rank: what both sides
share), then :mod:`.prefill` (the prefill rank's threads and SGLang's sender) and
:mod:`.decode` (the decode rank's threads and SGLang's receiver), :mod:`.bootstrap`
(the prefill's bootstrap server), then the pure pieces: :mod:`.pools` (pools as slot
tables), :mod:`.streaming` (per-layer plans),
:mod:`.packed` (staging runs and TP parts), :mod:`.lifecycle` (epochs, tombstones),
:mod:`.lanes` (room ids for several requests on one room; :mod:`.rooms` says why).

What comes from SGLang (``common/conn.py``, subclassed): the bootstrap server and the
rank registry, the ZMQ control sockets, the per-room status table and its poll
semantics, status messages to decode, the decode heartbeat, abort notifications and
acks. What kvbridge adds:

- a transport (NIXL or Mooncake, from ``KVBRIDGE_CONFIG``) with SGLang's KV pool and
  metadata buffers registered once, as prepared slot tables (:mod:`.pools`);
- the messages of :mod:`kvbridge.wire.room_messages`: decode -> prefill
  ``Registration`` (once per peer) and ``Destination`` (per room) on SGLang's control socket;
- on the prefill, a control thread (registrations, destinations, aborts) and one
  transfer thread that posts each chunk's (or, streaming per layer, each layer's) K and
  V pages and, after the last chunk, the metadata row with a ``Done`` notification
  (:mod:`.prefill`);
- a sliding-window pool (:func:`.pools.pool_states`): its window layers'
  sub-pool registered as a second table; the prefill writes their pages of the
  prompt's last window (SGLang's state indices on both sides) after the last chunk,
  before ``Done`` (on the packed path through the room's staging run, after its
  full-attention layers);
- a pool with state-space layers (Mamba2, Gated DeltaNet, short convolutions;
  :func:`.pools.pool_states`): their state tensors registered as a third table; the
  prefill writes the request's state slot (SGLang's state index) into the decode's
  after the last chunk, before ``Done``, directly on either data path (equal attention
  TP sizes);
- on the decode, a notification thread turning ``Done`` into SGLang's Success, a
  control thread applying failure statuses and abort acks, and an epoch thread that
  notices a restarted prefill (:mod:`.decode`);
- the packed path (``wire_dtype: fp8`` or ``data_path: packed``; CPU pools,
  :mod:`.packed`): the decode reserves a run of staging chunks per room (a part per
  prefill rank feeding it) and names it in its ``Destination``; the prefill packs the
  decode rank's heads of its pages (FP8 + scales, or exact values) into its own
  staging and writes them into its part of the room's run; on each ``Done`` the
  decode unpacks that part into the room's pages, then passes the status on. Prefill
  and decode may so have different attention TP sizes (:func:`.packed.room_part`);
  the direct path needs equal ones. Incompatible peers (transport, wire dtype, data
  path, page or packed format, TP sizes) are refused at registration and their rooms
  fail with the reason;
- metrics (:mod:`.metrics`): counters and per-request histograms on SGLang's
  ``/metrics`` when it runs with ``--enable-metrics``.

Every wait is bounded: transfers (and, on a GPU, the device event a layer's writes wait
for) by ``timeouts.transfer_s``, thread loops poll with short timeouts, SGLang's own
bootstrap/waiting timeouts and heartbeat cover the rest. Peers are transport agents
named with an instance epoch, so a restarted instance is a new peer; a decode rank also
registers its seat (:func:`.compat.server_seat`), and a prefill replaces a peer only
when the same seat registers again, so the ranks of several decode servers, and of DP
replicas, stay peers of their own. With SGLang's data parallelism each DP rank (replica
or attention-DP group) is a manager of its own; the bootstrap server and the decode
find a room's prefill DP rank as SGLang does (:func:`.compat.serve_replica_dp_rank`).
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref

import zmq

from kvbridge.adapters.sglang import compat, metrics
from kvbridge.adapters.sglang.bootstrap import KVBridgeKVBootstrapServer
from kvbridge.adapters.sglang.decode import DecodeSide, KVBridgeKVReceiver
from kvbridge.adapters.sglang.lanes import RoomLanes
from kvbridge.adapters.sglang.packed import pool_planes, typed_geometry
from kvbridge.adapters.sglang.pools import kv_geometry, pool_states
from kvbridge.adapters.sglang.prefill import (
    KVBridgeKVSender,
    PrefillSide,
    plan_forward,
    stop_streaming,
)
from kvbridge.adapters.sglang.settings import config_from_env, transfer_page_size
from kvbridge.adapters.sglang.states import state_split
from kvbridge.core.rows import RowLayout
from kvbridge.errors import KVBridgeError
from kvbridge.runtime.packed import PackedPath
from kvbridge.runtime.stats import StatsSnapshot
from kvbridge.transports.registry import create_transport
from kvbridge.wire import room_messages as wire
from kvbridge.wire.auth import ReplayGuard
from kvbridge.wire.peer_compat import CompatInfo

log = logging.getLogger(__name__)
_c = compat.common()
Mode = _c.DisaggregationMode


class KVBridgeKVManager(PrefillSide, DecodeSide, compat.TopologyRowHook, _c.Manager):
    """One per scheduler rank (SGLang makes it with the rank's KV pool): registers the
    pools with the transport, then runs the prefill's or the decode's threads
    (:meth:`PrefillSide._init_prefill`, :meth:`DecodeSide._init_decode`)."""

    kv_status_msg_tag = b"KVBRIDGE_STATUS"
    kv_status_msg_carries_reason = True
    # An aborting decode holds its pages until this prefill acknowledges that none of
    # the room's writes is still in flight (SGLang's deferred decode KV release).
    supports_deferred_decode_kv_release = True
    _poll_s = 0.2
    """Thread loops wake at least this often (seconds) to notice shutdown."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        compat.warn_if_untested()
        self.room_status = compat.RoomStatus(self)
        """SGLang's status of each room, read and set only through this."""
        self.destinations = compat.RoomDestinations(self)
        """SGLang's table of each room's decode destinations, read and set only through
        this (the prefill side)."""
        self.config = config_from_env()
        unit = transfer_page_size(self.config, args.page_size)
        self.page_ratio = args.page_size // unit
        """Transfer pages per SGLang page: 1, or on the side with the larger pages
        (``transfer_block_size``) each of its pages is this many transfer pages
        (:func:`.pools.transfer_pages`)."""
        self.decode_prefix_cache = compat.decode_prefix_cache(server_args)
        """A decode that keeps finished requests' pages (its radix cache) and asks the
        prefill only for the pages past a hit, which ends on one of its own pages."""
        self.secret = self.config.secret.encode() if self.config.secret else None
        """Authenticates kvbridge's messages between the two sides
        (:mod:`kvbridge.wire.room_messages`)."""
        self.epoch = uuid.uuid4().hex[:12]
        on_cpu = getattr(server_args, "device", "cuda") == "cpu"
        self.memory = "host" if on_cpu else "device"
        self.device_index = 0 if on_cpu else int(args.gpu_id)
        states = pool_states(getattr(args, "state_types", None))
        window = states == "swa"
        self.geometry = kv_geometry(
            page_size=args.page_size,
            ptrs=args.kv_data_ptrs,
            lens=args.kv_data_lens,
            item_lens=args.kv_item_lens,
            memory=self.memory,
            device=self.device_index,
            mla=is_mla_backend,
        ).in_blocks_of(unit)
        self.window_geometry = None
        """A hybrid sliding-window pool's window layers (their K and V pages, SGLang's
        ``state_data_ptrs[0]``, in transfer pages as ``geometry``); ``geometry`` then
        holds the full-attention layers. None for other pools."""
        if window:
            self.window_geometry = kv_geometry(
                page_size=args.page_size,
                ptrs=args.state_data_ptrs[0],
                lens=args.state_data_lens[0],
                item_lens=args.state_item_lens[0],
                memory=self.memory,
                device=self.device_index,
            ).in_blocks_of(unit)
        self.state_layout = None
        """A pool with state-space layers: their states (SGLang's ``state_data_ptrs[0]``,
        one row per state slot). None for other pools."""
        if states == "mamba":
            self.state_layout = RowLayout.build(
                ptrs=args.state_data_ptrs[0],
                lens=args.state_data_lens[0],
                item_lens=args.state_item_lens[0],
                what="state-space state tensors",
            )
        self.layer_subset = states is not None
        """The KV pool holds some of the model's layers only (a hybrid pool: its
        attention layers, or its full-attention ones): per-layer streaming maps a
        model layer id to its index among them (:func:`.compat.full_attention_layers`)."""
        self.aux_layout = RowLayout.build(
            ptrs=args.aux_data_ptrs, lens=args.aux_data_lens, item_lens=args.aux_item_lens
        )
        role = "prefill" if disaggregation_mode == Mode.PREFILL else "decode"
        self._metrics = metrics.exporter(
            role=role, tp_rank=args.engine_rank, transport=self.config.transport
        )
        self.transport = create_transport(
            self.config.transport,
            self.config,
            agent_name=f"sglang-{role}-r{args.engine_rank}-{self.epoch}",
            memory=self.memory,
        )
        # the transport polls at its busy pace while SGLang keeps a room (its writes and
        # notifications need it), slowly otherwise; each new room wakes it (.rooms)
        self.transport.add_demand(self.room_status.any)
        self._stop = threading.Event()
        self.room_holders: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        """Room -> the sender or receiver holding it (:mod:`.rooms`); scheduler thread."""
        self.room_lanes = RoomLanes()
        """Each new sender's or receiver's room id: its lane of its bootstrap room
        (:mod:`.lanes`, :mod:`.rooms`)."""
        # Only a prefill posts transfers: it prepares descriptor lists of its own pages,
        # state rows and metadata rows; a decode registers them as a target alone (a
        # list of every page of every layer is millions of descriptors at scale).
        prefill = disaggregation_mode == Mode.PREFILL
        try:
            self.transport.register(
                self.geometry.regions(), memory=self.memory, device=self.device_index
            )
            self.transport.register(self.aux_layout.regions(), memory="host")
            if self.window_geometry is not None:
                self.transport.register(
                    self.window_geometry.regions(), memory=self.memory, device=self.device_index
                )
            if self.state_layout is not None:
                self.transport.register(
                    self.state_layout.regions(), memory=self.memory, device=self.device_index
                )
            self.kv_table = self.window_table = self.state_table = self.aux_table = None
            """A prefill's prepared descriptor lists of its KV pages, window pages, state
            rows and metadata rows (None on a decode, and where the pool has none)."""
            if prefill:
                self.kv_table = self.transport.prepare(
                    self.geometry.slot_table(), memory=self.memory
                )
                if self.window_geometry is not None:
                    self.window_table = self.transport.prepare(
                        self.window_geometry.slot_table(), memory=self.memory
                    )
                if self.state_layout is not None:
                    self.state_table = self.transport.prepare(
                        self.state_layout.table(self.device_index), memory=self.memory
                    )
                self.aux_table = self.transport.prepare(self.aux_layout.table(), memory="host")
            self.packed: PackedPath | None = None
            self.window_kv = None
            """Packed path with a sliding-window pool: its window layers' planes, packed
            into the same staging chunks as the full-attention layers
            (:meth:`~kvbridge.runtime.packed.PackedPath.sibling`)."""
            cache = compat.kv_cache_identity(server_args, args)
            if self.config.packed:
                dtype, head_dim = compat.kv_dtype_and_head_dim(args, cache)
                typed = typed_geometry(self.geometry, dtype=dtype, head_dim=head_dim)
                self.packed = PackedPath(
                    typed,
                    pool_planes(typed),
                    self.config.staging_mb,
                    self.transport,
                    fp8=self.config.wire_dtype == "fp8",
                    timeout_s=self.config.timeouts.transfer_s,
                )
                if self.window_geometry is not None:
                    typed_window = typed_geometry(
                        self.window_geometry, dtype=dtype, head_dim=head_dim
                    )
                    self.window_kv = self.packed.sibling(pool_planes(typed_window))
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
        except Exception:
            self.transport.close()
            raise
        self.control_endpoint = compat.control_endpoint(self.local_ip, self.rank_port)
        """This rank's control socket, as peers address it (what their MACs cover)."""
        self.replays = ReplayGuard()
        """With a secret: control messages taken (the control thread's)."""
        self.note_replays = ReplayGuard()
        """With a secret: notifications taken (a decode's notification thread's)."""
        compat.serve_replica_dp_rank(self)
        compat.warn_unless_balanced_by_room(self, compat.load_balance_method())
        self.compat_info = self._compat_info(server_args, cache)
        """What a prefill and a decode must share (the model, the KV cache's dtype, page
        and shape, the settings that change what moves): a decode registers it, and a
        prefill compares its hash with its own before anything else of the decode's
        registration (:meth:`.registrations.Registrations.check_compat`), as a vLLM
        prefill does at a handshake."""
        self.seat = compat.server_seat(server_args, self)
        """Which rank of which server this is (a decode registers it: a restart of the
        same rank replaces its old agent on the prefill, another server's rank does not)."""
        self.state_split = None
        """A pool with state-space layers whose states SGLang says how to split over
        attention TP ranks (:func:`.states.state_split`; after SGLang's manager has set
        ``attn_tp_size``): they then move between TP sizes too. None otherwise."""
        if self.state_layout is not None:
            info = compat.state_split_info(args)
            if info is not None:
                self.state_split = state_split(
                    item_lens=self.state_layout.item_lens, tp=self.attn_tp_size, **info._asdict()
                )
        log.info(
            "kvbridge %s rank %s: transport %s, agent %s, %d KV slots of %d B%s%s, %d metadata "
            "buffers",
            role,
            args.engine_rank,
            self.config.transport,
            self.transport.agent_name,
            self.geometry.num_slots,
            self.geometry.spec.block_bytes,
            ""
            if self.window_geometry is None
            else f", {self.window_geometry.num_slots} sliding-window slots",
            ""
            if self.state_layout is None
            else f", {len(self.state_layout.ptrs)} state tensors of {self.state_layout.rows} slots",
            len(self.aux_layout.ptrs),
        )
        if disaggregation_mode == Mode.PREFILL:
            self._init_prefill(args)
        else:
            self._init_decode()

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
            self._metrics.set_levels(
                staging_slots=a.num_slots, staging_slots_used=a.num_slots - a.free_slots
            )

    def _report_limits(self) -> None:
        """Set the gauges of the bounded per-peer state
        (:data:`~kvbridge.runtime.stats.LIMIT_GAUGES`; with ``--enable-metrics``): peers
        registered with this prefill rank, messages remembered against replays, rooms
        whose destination came before their request. Called
        every loop by the prefill's transfer thread and the decode's notification thread."""
        if self._metrics is not None:
            admission = getattr(self, "admission", None)  # a prefill rank's
            self._metrics.set_levels(
                peers=len(getattr(self, "peers", ())),
                replay_entries=len(self.replays) + len(self.note_replays),
                early_rooms=0 if admission is None else len(admission.early),
            )

    def _send_multipart_locked(self, endpoint: str, parts, is_ipv6: bool = False):
        """Every message this rank sends to another's control socket (SGLang's status,
        abort acknowledgements): signed for that socket with a secret (:func:`.messages.sign`)."""
        super()._send_multipart_locked(
            endpoint, wire.sign(parts, self.secret, endpoint), is_ipv6=is_ipv6
        )

    def _authentic(self, frames: list[bytes]) -> list[bytes]:
        """A control message as its sender signed it, after checking its MAC, freshness
        and novelty (:func:`.messages.unsign`) with a secret; unchanged without one.
        Control thread."""
        if self.secret is None:
            return frames
        return wire.unsign(frames, self.secret, self.control_endpoint, self.replays)

    def _thread(self, name: str, target) -> None:
        def guarded():
            try:
                target()
            except Exception:
                log.exception("%s died; transfers of this rank will fail at their deadlines", name)

        threading.Thread(target=guarded, name=name, daemon=True).start()

    def _recv_loop(self, handle) -> None:
        """A control thread's loop: ``handle`` each message of SGLang's control socket."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(int(self._poll_s * 1000)):
                    continue
                frames = self.server_socket.recv_multipart()
            except zmq.ZMQError as exc:
                log.warning("kvbridge: control socket receive failed: %s", exc)
                continue
            try:
                handle(frames)
            except KVBridgeError as exc:
                self._count(messages_refused=1)
                log.warning("kvbridge: dropped a control message: %s", exc)
            except Exception:  # no message may end the control thread
                self._count(messages_refused=1)
                log.exception("kvbridge: dropped a control message that failed unhandled")

    def _compat_info(self, server_args, cache: compat.KVCacheIdentity) -> CompatInfo:
        """This rank's :attr:`compat_info` (after SGLang's manager set ``attn_tp_size``).
        From the model's config (``cache``), not the pool's bytes: a rank's page holds its
        share of the heads, which differs between TP sizes that pair."""
        spec = self.geometry.spec
        latent = spec.layout == "latent"  # one latent vector per token, on every rank
        total, tp = (1, 1) if latent else (cache.kv_heads, self.attn_tp_size)
        return CompatInfo(
            model=compat.model_identity(server_args),
            dtype=cache.dtype,
            layout=spec.layout,
            block_size=spec.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=max(total // tp, 1),
            head_dim=cache.head_dim,
            tp_size=tp,
            wire_dtype=self.config.wire_dtype,
            total_kv_heads=total,
            data_path=self.config.resolved_data_path,
        )

    def _total_kv_heads(self) -> int:
        """The model's KV heads over all ranks: 1 for an MLA pool (one latent vector per
        token, on every rank), SGLang's ``KVArgs``, else, on the packed path, this rank's
        heads times the attention TP size; 0 when unknown."""
        if self.geometry.spec.layout == "latent":
            return 1
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        if not total and self.packed is not None:
            total = self.packed.geometry.spec.num_kv_heads * self.attn_tp_size
        return total

    def close(self) -> None:
        stop_streaming(self)
        self._stop.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        self.transport.close()


def classes():
    return KVBridgeKVManager, KVBridgeKVSender, KVBridgeKVReceiver, KVBridgeKVBootstrapServer


__all__ = [
    "KVBridgeKVBootstrapServer",
    "KVBridgeKVManager",
    "KVBridgeKVReceiver",
    "KVBridgeKVSender",
    "classes",
    "plan_forward",
]
