"""Mooncake transfer-engine transport: TCP everywhere, RDMA where a device exists.

Only this module imports ``mooncake``; the registry imports this module on first use.

How it uses the engine (``mooncake.engine.TransferEngine``, P2P handshake, no
metadata server):

- the protocol is validated here: the engine silently falls back to TCP for an unknown
  protocol string or when RDMA is asked for without a device;
- a transfer is one ``batch_transfer_sync`` call (the only batch call that can carry a
  notification) run on a small thread pool; the engine releases the GIL, so workers
  overlap. Descriptors are coalesced first (runs adjacent on both sides merge): the
  engine pays per descriptor, and ~16 KiB descriptors run at a fraction of the
  bandwidth of large ones;
- ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` / ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``
  are raised (unless set) so batches of thousands of descriptors are not refused with
  "queue-full"; ``MC_TRANSFER_TIMEOUT`` follows ``timeouts.transfer_s`` and
  ``MC_LOG_LEVEL`` defaults to ERROR (each unless already set);
- a bare notification is a zero-length transfer carrying it;
- the engine returns -1 for any failure; ``send_probe`` then tells a dead peer from a
  rejected transfer.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.layout import MemoryKind
from kvbridge.core.plan import coalesce
from kvbridge.errors import (
    DeadlineExceeded,
    InvalidDescriptorError,
    TransferFailedError,
    TransportError,
    TransportUnavailableError,
    WireError,
)
from kvbridge.transports.base import DescTable, Notification, Op, PeerMetadata, Registration, Xfer
from kvbridge.transports.common import TransportBase, rdma_devices

try:
    from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
except ImportError as _exc:  # pragma: no cover - exercised through the registry
    raise ImportError(f"Mooncake transfer engine is not importable: {_exc}") from _exc

if TYPE_CHECKING:
    from kvbridge.config import KVBridgeConfig, MooncakeOptions

log = logging.getLogger(__name__)

_ENDPOINT_RE = re.compile(r"^[A-Za-z0-9.\-:\[\]]+:\d{1,5}$")
_OPCODES = {"write": TransferOpcode.Write, "read": TransferOpcode.Read}


class MooncakeTransport(TransportBase):
    """A Mooncake ``TransferEngine`` behind the kvbridge transport contract.

    Args:
        agent_name: unique name of this agent (peers see it on notifications).
        options: ``mooncake`` section of the kvbridge config.
        host: address the engine listens on and advertises.
        transfer_timeout_s: the engine's own per-transfer timeout (at least 5 s).
    """

    name = "mooncake"

    def __init__(self, agent_name: str, options: MooncakeOptions, host: str = "127.0.0.1", transfer_timeout_s: float = 30.0) -> None:
        super().__init__(agent_name)
        if options.protocol not in ("tcp", "rdma"):
            raise TransportUnavailableError(
                f"Mooncake protocol {options.protocol!r} is not supported by kvbridge",
                fix="set mooncake.protocol to 'tcp' or 'rdma'",
            )
        if options.protocol == "rdma":
            devices = rdma_devices()
            if not devices:
                raise TransportUnavailableError(
                    "mooncake.protocol is 'rdma' but this machine has no RDMA device (/sys/class/infiniband is empty)",
                    fix="set mooncake.protocol to 'tcp', or install the NIC's RDMA driver",
                )
            if options.device_name and not set(options.device_name.split(",")) <= set(devices):
                raise TransportUnavailableError(
                    f"mooncake.device_name {options.device_name!r} names devices this machine lacks",
                    fix=f"use some of: {', '.join(devices)}",
                )
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(options.max_queued_transfers_per_peer))
        os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", str(options.max_pending_admissions_per_peer))
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # kvbridge reports failures itself
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(round(transfer_timeout_s)))))
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", options.protocol, options.device_name)
        if rc != 0:
            raise TransportUnavailableError(
                f"Mooncake TransferEngine.initialize({host!r}, protocol={options.protocol!r}) returned {rc}",
                fix="check that 'host' is an address of this machine; run 'kvbridge doctor'",
            )
        self.protocol = options.protocol
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._pool = cf.ThreadPoolExecutor(options.workers, thread_name_prefix="kvbridge-mooncake")
        self._endpoints: dict[str, str] = {}
        self._notify_target: dict[str, int] = {}
        self._start_pump()

    @classmethod
    def from_config(cls, agent_name: str, config: KVBridgeConfig, memory: MemoryKind = "host") -> MooncakeTransport:
        return cls(agent_name, config.mooncake, host=config.host, transfer_timeout_s=config.timeouts.transfer_s)

    @property
    def engine(self) -> TransferEngine:
        """The underlying ``TransferEngine``, for diagnostics and baseline benchmarks."""
        return self._engine

    def peer_endpoint(self, peer: str) -> str:
        """``host:port`` of a known peer's engine."""
        self._peer_index(peer)
        return self._endpoints[peer]

    # --- hooks -----------------------------------------------------------------------------

    def _register(self, regions: tuple[tuple[int, int], ...], memory: MemoryKind, device: int) -> object:
        location = "cpu:0" if memory == "host" else f"cuda:{device}"
        done: list[int] = []
        for addr, length in regions:
            rc = self._engine.register_memory(addr, length, location)
            if rc != 0:
                for a in done:
                    self._engine.unregister_memory(a)
                raise TransportError(f"Mooncake could not register {length} bytes at 0x{addr:x} ({location}): rc={rc}")
            done.append(addr)
        return done

    def _deregister(self, registration: Registration) -> None:
        for addr in registration.handle:  # type: ignore[attr-defined]
            self._engine.unregister_memory(addr)

    def _backend_metadata(self) -> bytes:
        return self.endpoint.encode()

    def _add_peer(self, md: PeerMetadata) -> None:
        try:
            endpoint = md.payload.decode("ascii")
        except UnicodeDecodeError as exc:
            raise WireError("Mooncake peer metadata has a non-ASCII endpoint") from exc
        if not _ENDPOINT_RE.match(endpoint):
            raise WireError(f"Mooncake peer metadata has a malformed endpoint {endpoint!r}")
        if not md.regions:
            raise TransportError(
                f"Mooncake peer {md.agent!r} has no registered memory",
                fix="register memory on the peer before taking its metadata",
            )
        self._endpoints[md.agent] = endpoint
        # bare notifications ride on a zero-length write to the peer's first region
        self._notify_target[md.agent] = md.regions[0][0]

    def _remove_peer(self, peer: str) -> None:
        self._endpoints.pop(peer, None)
        self._notify_target.pop(peer, None)

    def _prepare(self, table: DescTable) -> object:
        return None  # the engine takes raw addresses; nothing to prepare

    def _release_table(self, table: DescTable) -> None:
        pass

    def _post(
        self, op: Op, local: DescTable, lidx: np.ndarray, remote: DescTable, ridx: np.ndarray, notify: bytes | None, nbytes: int
    ) -> Xfer:
        peer = remote.peer
        assert peer is not None
        regions = coalesce(local.descs[lidx, 0], remote.descs[ridx, 0], local.descs[lidx, 1])
        note = TransferNotify(self.agent_name, notify.decode("latin-1")) if notify else None
        future = self._pool.submit(
            self._engine.batch_transfer_sync,
            self._endpoints[peer],
            regions.src.tolist(),
            regions.dst.tolist(),
            regions.length.tolist(),
            _OPCODES[op],
            note,
        )
        return Xfer(peer, nbytes, len(regions), future)

    def _poll(self, xfer: Xfer) -> bool:
        future: cf.Future = xfer.handle  # type: ignore[assignment]
        if not future.done():
            return False
        self._check_rc(future.result(), xfer.peer, "transfer")
        return True

    def wait(self, xfer: Xfer, timeout: float) -> None:
        """Block on the worker's future (no polling needed for this backend)."""
        if not xfer.done and xfer.error is None and not xfer.released:
            cf.wait([xfer.handle], timeout=timeout)  # type: ignore[list-item]
        if not self.poll(xfer):
            raise DeadlineExceeded(
                f"transfer of {xfer.nbytes} bytes to {xfer.peer!r} did not complete within {timeout:g}s",
                fix="check that the peer is alive; raise timeouts.transfer_s for very large transfers",
            )

    def _check_rc(self, rc: int, peer: str, what: str) -> None:
        if rc == 0:
            return
        endpoint = self._endpoints.get(peer)
        if endpoint is None or self._engine.send_probe(endpoint) != 0:
            raise self._peer_lost(peer, what, f"Mooncake rc={rc}, probe of {endpoint} failed")
        raise TransferFailedError(
            f"Mooncake {what} to {peer!r} failed (rc={rc}) although the peer answers a probe",
            fix="check that the target addresses are registered on the peer",
        )

    def _release(self, xfer: Xfer) -> None:
        xfer.handle.cancel()  # type: ignore[attr-defined]  # a started batch runs to completion

    def _notify(self, peer: str, payload: bytes) -> None:
        sources = [r[0] for r in self._local.as_list()]
        if not sources:
            raise InvalidDescriptorError("Mooncake needs registered local memory to send a notification")
        note = TransferNotify(self.agent_name, payload.decode("latin-1"))
        rc = self._engine.batch_transfer_sync(
            self._endpoints[peer], [sources[0]], [self._notify_target[peer]], [0], TransferOpcode.Write, note
        )
        self._check_rc(rc, peer, "notify")

    def _drain_notifications(self) -> list[Notification]:
        return [Notification(n.name, n.msg.encode("latin-1")) for n in self._engine.get_notifies()]

    def _close_backend(self) -> None:
        # Workers may still be inside the engine (bounded by MC_TRANSFER_TIMEOUT); the
        # engine must outlive them, so wait for them before dropping it.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._engine = None  # type: ignore[assignment]


__all__ = ["MooncakeTransport"]
