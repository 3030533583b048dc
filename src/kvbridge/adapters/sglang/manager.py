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
  worker: per chunk it posts one write of every layer's K and V pages (the transport
  merges adjacent pages); after the last chunk's pages have completed, it writes the
  metadata row with a :class:`~.messages.Done` notification, which the transport
  delivers once that row has landed;
- on decode, a notification thread turning ``Done`` into SGLang's Success, and a control
  thread applying failure statuses and abort acks.

Every wait is bounded: transfers by ``timeouts.transfer_s``, thread loops poll with
short timeouts, SGLang's own bootstrap/waiting timeouts and heartbeat cover the rest.
Peers are transport agents named with an instance epoch, so a restarted instance is a
new peer; the prefill's epoch is also part of its bootstrap registration.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import NamedTuple

import numpy as np
import zmq

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang import messages as wire
from kvbridge.adapters.sglang.layout import AuxLayout, kv_geometry, paired_count
from kvbridge.adapters.sglang.settings import config_from_env
from kvbridge.errors import ConfigError, KVBridgeError, PlanError
from kvbridge.transports.registry import create_transport

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll
Mode = _c.DisaggregationMode

_LOOP_POLL_MS = 200
"""Control loops wake at least this often to notice shutdown."""


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


class _Peer(NamedTuple):
    agent: str
    kv: object  # DescTable of the decode's KV slots
    aux: object  # DescTable of the decode's metadata rows
    geometry: object
    aux_layout: AuxLayout
    aux_count: int


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


class KVBridgeKVManager(_c.Manager):
    kv_status_msg_tag = b"KVBRIDGE_STATUS"
    kv_status_msg_carries_reason = True

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
            self._chunks: queue.Queue[_Chunk] = queue.Queue()
            self._thread("kvbridge-prefill-control", self._prefill_control_loop)
            self._thread("kvbridge-transfer", self._transfer_loop)
        else:
            self._thread("kvbridge-decode-control", self._decode_control_loop)
            self._thread("kvbridge-decode-notify", self._decode_notify_loop)
            self._start_heartbeat_checker_thread()

    def _thread(self, name: str, target) -> None:
        def guarded():
            try:
                target()
            except Exception:
                log.exception("%s died; transfers of this rank will fail at their deadlines", name)

        threading.Thread(target=guarded, name=name, daemon=True).start()

    # --- bootstrap registration (prefill) --------------------------------------------------

    def _register_topology_row(self, url, payload):
        # The instance epoch is part of what the prefill registers (a restart is a new peer).
        payload = dict(payload, kvbridge_epoch=self.epoch, kvbridge_agent=self.transport.agent_name)
        return super()._register_topology_row(url, payload)

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
            )
        )

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
        if reg.transport != self.config.transport:
            log.error(
                "kvbridge: decode %s uses transport %r, this prefill %r; set the same KVBRIDGE_CONFIG on both",
                reg.agent, reg.transport, self.config.transport,
            )
            return
        if reg.geometry.spec != self.geometry.spec:
            log.error("kvbridge: decode %s cache %s differs from ours %s", reg.agent, reg.geometry.spec, self.geometry.spec)
            return
        with self._peers_lock:
            if reg.agent in self.peers:
                return
            peer = self.transport.add_peer(reg.transport_md)
            kv = self.transport.prepare(reg.geometry.slot_table(), memory=reg.geometry.memory, peer=peer)
            aux = self.transport.prepare(reg.aux.table(), memory="host", peer=peer)
            count = paired_count(self.aux_layout, reg.aux)
            if count != len(self.aux_layout.ptrs) or count != len(reg.aux.ptrs):
                self.check_peer_aux_buffer_count(reg.agent, len(reg.aux.ptrs))
            self.peers[reg.agent] = _Peer(reg.agent, kv, aux, reg.geometry, reg.aux, count)
            # A restarted decode (same address, new epoch) replaces its old agent.
            stale = [a for a in self.peers if a != reg.agent and a.rsplit("-", 1)[0] == reg.agent.rsplit("-", 1)[0]]
        for agent in stale:
            self._drop_peer(agent)
        log.info("kvbridge: registered decode peer %s (epoch %s)", reg.agent, reg.epoch)

    def _drop_peer(self, agent: str) -> None:
        with self._peers_lock:
            peer = self.peers.pop(agent, None)
        if peer is None:
            return
        for table in (peer.kv, peer.aux):
            self.transport.release_table(table)
        self.transport.remove_peer(peer.agent)

    def _add_destination(self, msg: wire.Destination) -> None:
        room = msg.room
        dest = _Dest(
            msg.agent, msg.ip, msg.port, wire.decode_pages(msg.pages), msg.aux_index,
            msg.required_dst_info_num, msg.decode_prefix_len, msg.is_dummy,
        )
        if not msg.is_dummy and msg.agent not in self.peers:
            # A decode that registered with an earlier instance of this prefill.
            reason = f"kvbridge: unknown decode peer {msg.agent} (this prefill restarted; epoch {self.epoch})"
            self.send_kv_status_message(targets=[(msg.ip, msg.port)], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)
            return
        infos = self.transfer_infos.setdefault(room, {})
        infos[msg.agent] = dest
        if len(infos) == msg.required_dst_info_num:
            self.resolve_kv_replica_factor(infos)
            self.req_to_decode_prefix_len[room] = next(
                (d.decode_prefix_len for d in infos.values() if d.decode_prefix_len is not None), 0
            )
            self.update_status(room, KVPoll.WaitingForInput)

    def _handle_abort(self, frames: list[bytes]) -> None:
        note = _c.AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)
        if self.enable_deferred_decode_kv_release:
            target = note.deferred_ack_target()
            if target is not None:
                self.register_deferred_ack_target(room, target)
                self._maybe_ack_drained_abort(room)

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
            return None  # dummy rank, or already cleared
        if _has_state(state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason="kvbridge: state (mamba/SWA) transfer is not supported yet")
            return None
        self._chunks.put(_Chunk(bootstrap_room, np.asarray(kv_indices, dtype=np.int64), index_slice, is_last_chunk, aux_index))
        return None

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                chunk = self._chunks.get(timeout=_LOOP_POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                self._send_chunk(chunk)
            except Exception as exc:  # noqa: BLE001 - any failure fails the room, not the thread
                log.warning("kvbridge: room %s failed: %s", chunk.room, exc)
                self._release_room(chunk.room)
                self.conclude_failure(bootstrap_room=chunk.room, failure_reason=f"kvbridge: {exc}")

    def _room_active(self, room: int) -> bool:
        return room in self.request_status and self.check_status(room) != KVPoll.Failed and room in self.transfer_infos

    def _send_chunk(self, chunk: _Chunk) -> None:
        room = chunk.room
        if not self._room_active(room):
            self._release_room(room)
            return
        dests = [d for d in self.transfer_infos[room].values() if not d.is_dummy]
        xfers = self._inflight.setdefault(room, [])
        for dest in dests:
            peer = self.peers.get(dest.agent)
            if peer is None:
                raise PlanError(f"decode peer {dest.agent} is gone")
            dst_pages = dest.pages[chunk.index_slice]
            if dst_pages.size != chunk.pages.size:
                raise PlanError(
                    f"chunk of {chunk.pages.size} pages maps to {dst_pages.size} destination pages "
                    f"(positions {chunk.index_slice.start}:{chunk.index_slice.stop} of {dest.pages.size})"
                )
            if chunk.pages.size:
                xfers.append(
                    self.transport.post(
                        "write", self.kv_table, self.geometry.slots(chunk.pages), peer.kv, peer.geometry.slots(dst_pages)
                    )
                )
                self._staging_outstanding[room] += 1
        if not chunk.is_last:
            return
        deadline = time.monotonic() + self.config.timeouts.transfer_s
        self._wait_room(room, deadline)
        if not self._room_active(room):
            return
        done = wire.encode_payload(wire.Done(room=room, prefill_rank=self._prefill_unique_rank(), epoch=self.epoch))
        for dest in dests:
            peer = self.peers[dest.agent]
            if chunk.aux_index is None or dest.aux_index is None:
                raise PlanError("the last chunk carries no metadata row")
            x = self.transport.post(
                "write",
                self.aux_table,
                self.aux_layout.slots(chunk.aux_index, peer.aux_count),
                peer.aux,
                peer.aux_layout.slots(dest.aux_index, peer.aux_count),
                notify=done,
            )
            xfers.append(x)
            self._staging_outstanding[room] += 1
        self._wait_room(room, deadline)
        self._release_room(room)
        with self.failure_lock:
            failed = room in self.failure_records
        if not failed and room in self.request_status:
            self.update_status(room, KVPoll.Success)

    def _wait_room(self, room: int, deadline: float) -> None:
        for x in self._inflight.get(room, []):
            if not x.done:
                self.transport.wait(x, max(0.0, deadline - time.monotonic()))

    def _release_room(self, room: int) -> None:
        for x in self._inflight.pop(room, []):
            self.transport.release(x)
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
        self.apply_prefill_status(bootstrap_room=room, status=value, prefill_rank=prefill_rank, failure_reason=reason)

    def _decode_notify_loop(self) -> None:
        while not self._stop.is_set():
            for note in self.transport.take_notifications(timeout=_LOOP_POLL_MS / 1000):
                try:
                    msg = wire.decode_payload(note.payload)
                except KVBridgeError as exc:
                    log.warning("kvbridge: dropped a notification from %s: %s", note.peer, exc)
                    continue
                if isinstance(msg, wire.Done):
                    self.apply_prefill_status(bootstrap_room=msg.room, status=KVPoll.Success, prefill_rank=msg.prefill_rank)

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        self.transport.close()


class KVBridgeKVSender(_c.Sender):
    # The scheduler must hand page ids as numpy arrays (its host-tensor path needs CUDA).
    supports_host_tensor_indices = False


class KVBridgeKVReceiver(_c.Receiver):
    pass


class KVBridgeKVBootstrapServer(_c.BootstrapServer):
    pass


def classes():
    return KVBridgeKVManager, KVBridgeKVSender, KVBridgeKVReceiver, KVBridgeKVBootstrapServer


__all__ = ["KVBridgeKVManager", "KVBridgeKVSender", "KVBridgeKVReceiver", "KVBridgeKVBootstrapServer", "classes"]
