"""Decode side of the ``kvbridge`` SGLang backend: what a decode rank's manager does
(:class:`DecodeSide`, mixed into :class:`~.manager.KVBridgeKVManager`) and SGLang's
receiver (:class:`KVBridgeKVReceiver`).

Threads and who calls what:

- SGLang's ``CommonKVReceiver`` (decode scheduler thread) sends the prefill this
  rank's :class:`~kvbridge.wire.room_messages.Registration` once per prefill rank and a
  :class:`~kvbridge.wire.room_messages.Destination` per room, built here;
- the *notification thread* (:meth:`DecodeSide._decode_notify_loop`) turns each
  ``Done`` into SGLang's Success for that prefill rank (packed path: after unpacking
  that source's part of the room's staging run into its pages' heads);
- the *control thread* applies failure statuses and abort acknowledgements from the
  prefill;
- the *epoch thread* polls each known prefill's epochs (:mod:`.lifecycle`) every
  ``timeouts.heartbeat_s`` and fails the in-flight rooms of a restarted or refusing
  prefill at once, so the next request bootstraps anew instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import numpy as np
import requests

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang.lifecycle import (
    EPOCH_PATH,
    EpochWatcher,
    InstanceEpoch,
    Verdict,
    decode_epoch,
)
from kvbridge.adapters.sglang.packed import Part, RoomReservations, decode_parts, window_start
from kvbridge.adapters.sglang.pools import transfer_pages
from kvbridge.adapters.sglang.rooms import SoleHolder
from kvbridge.adapters.sglang.states import state_slot
from kvbridge.errors import IncompatiblePeerError, KVBridgeError, WireError
from kvbridge.wire import room_messages as wire

log = logging.getLogger(__name__)
_c = compat.common()
KVPoll = _c.KVPoll


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
        log.warning(
            "kvbridge: %s%s answered %s; is the prefill running the kvbridge backend?",
            addr,
            EPOCH_PATH,
            resp.status_code,
        )
        return None, False
    try:
        return decode_epoch(resp.content), False
    except KVBridgeError as exc:
        log.warning("kvbridge: %s%s: %s", addr, EPOCH_PATH, exc)
        return None, False


class DecodeSide:
    """The decode rank's part of :class:`~.manager.KVBridgeKVManager` (a mixin: it uses
    the manager's transport, packed path, config and SGLang's status table). See the
    module docstring for its threads."""

    def _init_decode(self) -> None:
        """State and threads of a decode rank (the manager's constructor, once)."""
        self.epochs = EpochWatcher()
        self._epochs_lock = threading.Lock()
        if self.packed is not None:
            self.reservations = RoomReservations(
                self.packed,
                num_layers=self.geometry.spec.num_layers,
                hold_s=self.config.timeouts.transfer_s,
                window_layers=(
                    0 if self.window_geometry is None else self.window_geometry.spec.num_layers
                ),
            )
        # held while a room is unpacked, and by the receiver's clear/abort: SGLang never
        # frees a room's pages while kvbridge writes into them
        self._unpack_lock = threading.Lock()
        self._thread("kvbridge-decode-control", self._decode_control_loop)
        self._thread("kvbridge-decode-notify", self._decode_notify_loop)
        self._thread("kvbridge-decode-epochs", self._epoch_loop)
        self._start_heartbeat_checker_thread()

    # --- decode: is the prefill we cached still the same instance? --------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        # Called by the decode scheduler per new request; fetches once per prefill.
        if bootstrap_addr in self.prefill_info_table:
            return True
        # before the info: a race errs towards "restarted"
        epoch, _ = self._fetch_epoch(bootstrap_addr)
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
                        "kvbridge: the prefill at %s restarted (instance %s -> %s): dropping its "
                        "cached bootstrap info and failing its in-flight requests; new requests "
                        "bootstrap again",
                        addr,
                        before.instance if before else "?",
                        epoch.instance if epoch else "?",
                    )
                    self._handle_node_failure(addr)
                elif verdict is Verdict.DOWN:
                    log.warning(
                        "kvbridge: the prefill at %s refuses connections: failing its in-flight "
                        "requests",
                        addr,
                    )
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
                prefix_cache=self.decode_prefix_cache,
                page_size=self.kv_args.page_size,
                window=self.window_geometry,
                states=self.state_layout,
                state_split=self.state_split,
                compat=self.compat_info,
                seat=self.seat,
            ),
        )

    def transfer_pages(self, kv_indices) -> np.ndarray:
        """SGLang's page ids of a room as transfer pages (the prefill's page size,
        ``transfer_block_size``): page ``p`` is ``p * r`` to ``p * r + r - 1``, ``r =``
        :attr:`page_ratio`. All of them: the last may hold no prompt token (the prefill
        writes the positions it has, and names how many in its ``Done``)."""
        return transfer_pages(kv_indices, self.page_ratio)

    def window_pages(self, state_indices) -> np.ndarray | None:
        """A sliding-window pool: a room's window pages of the prompt's last window
        (SGLang's SWA state indices; ``state_indices`` holds one entry per state type:
        the one, SWA) as transfer pages (:meth:`transfer_pages`), empty when SGLang gave
        none; None for other pools."""
        if self.window_geometry is None:
            return None
        if not state_indices or state_indices[0] is None:
            return np.empty(0, dtype=np.int64)
        return transfer_pages(state_indices[0], self.page_ratio)

    def state_row(self, state_indices) -> int | None:
        """A pool with state-space layers: a room's state slot
        (:func:`.states.state_slot`). None for other pools, and (logged) when SGLang
        named no slot or several: the prefill then fails the room, naming why
        (scheduler thread: never raises)."""
        if self.state_layout is None:
            return None
        row = state_slot(state_indices)
        if row is None:
            log.warning(
                "kvbridge: SGLang named no state slot or several for a request (%r); kvbridge "
                "moves one state per request",
                state_indices,
            )
        return row

    def decode_parts(self, prefill_tp: int) -> tuple[Part, ...]:
        """Decode, packed path: every source's part of this rank's rooms from a prefill
        of attention TP ``prefill_tp``. Raises
        :class:`~kvbridge.errors.IncompatiblePeerError` for sizes that do not pair."""
        latent = self.geometry.spec.layout == "latent"
        return decode_parts(
            self._total_kv_heads(), prefill_tp, self.attn_tp_size, self.attn_tp_rank, latent=latent
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
        staging_first = None
        if self.packed is not None and not is_dummy:
            # reserved by the receiver's send_metadata
            res = self.reservations.get(int(bootstrap_room))
            if res is None:
                log.warning(
                    "kvbridge: room %s: no staging run for %d pages (staging_mb %d); the prefill "
                    "fails it",
                    bootstrap_room,
                    len(kv_indices) * self.page_ratio,
                    self.config.staging_mb,
                )
            else:
                staging_first = res.first
        window_pages = None
        if not is_dummy and (pages := self.window_pages(state_indices)) is not None:
            window_pages = wire.encode_pages(pages)
        state_row = None if is_dummy else self.state_row(state_indices)
        return wire.encode(
            wire.Destination(
                room=int(bootstrap_room),
                agent=self.transport.agent_name,
                ip=self.local_ip,
                port=self.rank_port,
                pages=wire.encode_pages(self.transfer_pages(kv_indices)),
                aux_index=None if aux_index is None else int(aux_index),
                required_dst_info_num=int(required_dst_info_num),
                decode_prefix_len=None if decode_prefix_len is None else int(decode_prefix_len),
                is_dummy=bool(is_dummy),
                staging_first=staging_first,
                window_pages=window_pages,
                state_row=state_row,
                nonce=self._holder_nonce(bootstrap_room),
            ),
        )

    def _holder_nonce(self, room) -> int | None:
        holder = SoleHolder._holder(self, int(room))
        return None if holder is None else holder.nonce

    def _meant_for_holder(self, done: wire.Done) -> bool:
        """Whether ``done`` answers the request holding its room now (notification
        thread). One that names another request (an earlier one on the room, failed and
        cleared: SGLang's parallel sampling sends every sample on one room) is dropped:
        SGLang would count it toward the new request (a Success before its pages were
        even sent, which its scheduler does not expect) and the packed path would
        unpack it into the new request's pages. A ``Done`` without a nonce (older
        prefill) is not checked."""
        if done.nonce is None or self._holder_nonce(done.room) == done.nonce:
            return True
        log.warning(
            "kvbridge: dropped a Done for room %s meant for an earlier request of the room",
            done.room,
        )
        return False

    def _from_source(self, done: wire.Done, sender: str) -> None:
        """Raise unless ``done`` comes from one of its room's prefill ranks: the transport
        agents the room's bootstrap named (SGLang's registry rows a kvbridge prefill
        registers carry its agent; rows without one, from SGLang's multi-DP registry,
        are not checked). Notification thread."""
        holder = SoleHolder._holder(self, int(done.room))
        infos = getattr(holder, "bootstrap_infos", None) or ()
        agents = {info.get("kvbridge_agent") for info in infos} - {None}
        if agents and sender not in agents:
            raise WireError(
                f"a Done for room {done.room} from {sender}, which is not one of the room's "
                f"prefill ranks ({', '.join(sorted(agents))})"
            )

    # --- decode: control and notification threads -------------------------------------------

    def _decode_control_loop(self) -> None:
        self._recv_loop(self._decode_handle)

    def _decode_handle(self, frames: list[bytes]) -> None:
        frames = self._authentic(frames)  # with a secret: signed by the prefill, for us, fresh
        if self.handle_abort_ack_message(frames):
            return
        status = self.parse_kv_status_message(frames)
        if status is None:
            log.warning(
                "kvbridge: unexpected %d-frame message on the decode control socket", len(frames)
            )
            return
        room, value, prefill_rank, reason = status
        if value == KVPoll.Failed:
            self._count(failures=1)
        self.apply_prefill_status(
            bootstrap_room=room, status=value, prefill_rank=prefill_rank, failure_reason=reason
        )

    def _unpack(
        self, room: int, index: int, written: int = -1, window: tuple[int, int] = (0, -1)
    ) -> bool:
        """Unpack source ``index``'s part of a room whose ``Done`` from that source
        arrived into its pages' heads: the first ``written`` of the room's pages (-1:
        all), and of a sliding-window pool's window pages the ``window`` ``(first,
        count)`` the source wrote (-1: all from ``first``) (notification thread, before
        SGLang counts the source). False: the room is gone or failed, or the part
        unknown."""
        with self._unpack_lock:
            res, last = self.reservations.arrive(room, index)
            if res is None:
                log.warning(
                    "kvbridge: Done for part %d of room %s, which holds no such staging run "
                    "(cleared, aborted or repeated); ignored",
                    index,
                    room,
                )
                return False
            try:
                if not self.room_status.live(room):
                    return False
                part, layers = res.parts[index], self.geometry.spec.num_layers
                first = res.part_first(index, layers)
                heads = None if part.heads == self.packed.slot.num_heads else part.d_heads
                pages = res.pages if not 0 <= written < res.pages.size else res.pages[:written]
                for layer in range(layers):
                    self.packed.unpack(layer, pages, first + layer * res.pages.size, heads=heads)
                if res.window_chunks:  # a sliding-window pool's window layers, after them
                    first = window_start(first, layers, int(res.pages.size))
                    size = int(res.window_pages.size)
                    lo, count = window
                    wrote = res.window_pages[lo : size if count < 0 else lo + count]
                    for layer in range(res.window_layers):
                        self.packed.unpack(
                            layer, wrote, first + layer * size + lo, heads, self.window_kv
                        )
                return True
            except Exception as exc:  # noqa: BLE001 - fail the room, keep the thread
                log.warning("kvbridge: room %s: unpacking failed: %s", room, exc)
                self._count(failures=1)
                reason = f"kvbridge: unpacking the FP8 KV failed: {exc}"
                self.room_status.mark_failed(room, reason)
                return False
            finally:
                if last:
                    # every source is done: none writes into it any more
                    self.reservations.free(res)

    def _decode_notify_loop(self) -> None:
        while not self._stop.is_set():
            if self.packed is not None:
                self.reservations.reap()
                self._report_staging()
            self._report_limits()
            for note in self.transport.take_notifications(timeout=self._poll_s):
                try:
                    self._on_note(note)
                except KVBridgeError as exc:
                    self._count(messages_refused=1)
                    log.warning("kvbridge: dropped a notification from %s: %s", note.peer, exc)
                except Exception:  # no notification may end the thread
                    self._count(messages_refused=1)
                    log.exception("kvbridge: dropped a notification from %s", note.peer)

    def _on_note(self, note) -> None:
        """One transport notification (the notification thread)."""
        msg = wire.decode_payload(
            note.payload,
            self.secret,
            sender=note.peer,
            receiver=self.transport.agent_name,
            guard=self.note_replays,
        )
        if not isinstance(msg, wire.Done):
            raise WireError(f"unexpected {type(msg).__name__} as a notification")
        self._from_source(msg, note.peer)
        if not self._meant_for_holder(msg):
            return
        if self.packed is not None and not self._unpack(
            msg.room, msg.part, msg.pages, (msg.window_first, msg.window_pages)
        ):
            return
        self.apply_prefill_status(
            bootstrap_room=msg.room,
            status=KVPoll.Success,
            prefill_rank=msg.prefill_rank,
        )
        self._count(requests_received=1, bytes_received=msg.bytes)


class _Signing:
    """A socket to one prefill rank's control socket that signs every message it sends
    (:func:`.messages.sign`); everything else is the socket's."""

    def __init__(self, sock, secret: bytes, receiver: str) -> None:
        self._sock, self._secret, self._receiver = sock, secret, receiver

    def send_multipart(self, frames, *args, **kwargs):
        return self._sock.send_multipart(
            wire.sign(frames, self._secret, self._receiver), *args, **kwargs
        )

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _StagingWait(NamedTuple):
    """A room's ``send_metadata`` call, held until a staging run is free."""

    args: tuple
    kwargs: dict
    pages: np.ndarray
    parts: tuple[Part, ...]
    deadline: float
    window_pages: np.ndarray | None = None


class KVBridgeKVReceiver(SoleHolder, _c.Receiver):
    """SGLang's receiver. Works under its lane's room id (:mod:`.rooms`: the samples of a
    request with ``n > 1`` share its bootstrap room); a second request on a lane another
    receiver holds fails at once, and so does the holder. On the packed path (``wire_dtype:
    fp8``, ``data_path: packed``):

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

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, *args, **kwargs):
        bootstrap_room = mgr.room_lanes.take(bootstrap_room)  # this request's lane
        holder = self._holder(mgr, bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        self._hold_or_refuse(holder, "decode")

    def _connect_to_bootstrap_server(self, bootstrap_info: dict):
        """SGLang's socket to a prefill rank's control socket (every message this receiver
        sends goes through it: registration, destination, bootstrap, abort), which with
        a secret signs each message for that rank (:func:`.messages.sign`)."""
        sock, lock = super()._connect_to_bootstrap_server(bootstrap_info)
        secret = self.kv_mgr.secret
        if secret is None:
            return sock, lock
        to = compat.control_endpoint(bootstrap_info["rank_ip"], bootstrap_info["rank_port"])
        return _Signing(sock, secret, to), lock

    def send_metadata(self, kv_indices, aux_index=None, *args, **kwargs) -> None:
        mgr = self.kv_mgr
        if mgr.packed is None or getattr(self, "bootstrap_infos", None) is None:
            super().send_metadata(kv_indices, aux_index, *args, **kwargs)
            return
        pages = mgr.transfer_pages(kv_indices)
        try:
            parts = mgr.decode_parts(int(self.prefill_info.attn_tp_size))
        except IncompatiblePeerError as exc:  # the prefill refuses this rank too, naming it
            log.warning("kvbridge: room %s: %s", self.bootstrap_room, exc)
            super().send_metadata(kv_indices, aux_index, *args, **kwargs)
            return
        window_pages = mgr.window_pages(args[0] if args else kwargs.get("state_indices"))
        wait = _StagingWait(
            (kv_indices, aux_index, *args),
            kwargs,
            pages,
            parts,
            time.monotonic() + mgr.config.timeouts.receive_s,
            window_pages,
        )
        windows = 0 if window_pages is None else int(window_pages.size)
        if not mgr.reservations.fits(int(pages.size), parts, windows):
            log.warning(
                "kvbridge: room %s: %d pages exceed the staging buffer (staging_mb %d) however "
                "empty",
                self.bootstrap_room,
                pages.size,
                mgr.config.staging_mb,
            )
        elif mgr.reservations.reserve(int(self.bootstrap_room), pages, parts, window_pages) is None:
            log.info(
                "kvbridge: room %s waits for room in the staging buffer (%d pages)",
                self.bootstrap_room,
                pages.size,
            )
            self._staging_wait = wait
            return
        super().send_metadata(*wait.args, **wait.kwargs)

    def poll(self):
        wait = self._staging_wait
        if wait is not None:
            if self.conclude_state is not None:
                self._staging_wait = None
            elif (
                run := self.kv_mgr.reservations.reserve(
                    int(self.bootstrap_room), wait.pages, wait.parts, wait.window_pages
                )
            ) is not None or time.monotonic() >= wait.deadline:
                if run is None:
                    log.warning(
                        "kvbridge: room %s found no room in the staging buffer for "
                        "timeouts.receive_s; the prefill fails it",
                        self.bootstrap_room,
                    )
                self._staging_wait = None
                super().send_metadata(*wait.args, **wait.kwargs)
        return super().poll()

    def clear(self) -> None:
        if not self._clear_once():
            return  # cleared already: the room's state may be another request's now
        mgr = self.kv_mgr
        self._let_go()
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
        # holds its room until cleared: SGLang may keep the pages until the prefill
        # acknowledged the abort (deferred release), then clears
        mgr = self.kv_mgr
        if mgr.packed is None:
            super().abort()
            return
        self._staging_wait = None
        with mgr._unpack_lock:
            super().abort()


__all__ = ["DecodeSide", "KVBridgeKVReceiver", "fetch_epoch"]
