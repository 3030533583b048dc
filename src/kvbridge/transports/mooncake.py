"""Mooncake transfer-engine transport: TCP everywhere, RDMA where a device exists.

Only this module imports ``mooncake``; the registry imports this module on first use.

How it uses the engine (``mooncake.engine.TransferEngine``, P2P handshake, no
metadata server), and what it avoids:

- the protocol is validated here: the engine silently falls back to TCP for an unknown
  protocol string or when RDMA is asked for without a device;
- a transfer runs on a thread pool *per peer* (engine calls release the GIL): its
  descriptors are submitted, each as a batch of one (``batch_transfer_async``), then
  polled (``transfer_check_status``) with pauses growing to :data:`POLL_PAUSE_MAX_S`,
  never waited on with the engine's own calls (below). A transfer to a frozen peer
  holds its thread until the engine fails it; per-peer pools keep that from starving
  transfers to other peers. Descriptors are coalesced first (runs adjacent on both
  sides merge): the engine pays per descriptor;
- notifications do not use the engine's ``TransferNotify``: it is delivered by an RPC
  under the engine's global lock, so one frozen peer stalls every transfer. They go
  over ZeroMQ (:mod:`.notifier`), sent by the worker after the engine reports the
  batch complete (the TCP transport acknowledges data applied on the target);
- the engine opens a peer's segment (a handshake RPC, also under that lock) on the
  first transfer; ``add_peer`` does it at once with a zero-length write, while the
  handshake shows the peer is alive, and reports an unreachable peer there. With
  ``probe=False`` (the prefill side, adding a decode peer that waits for its answer)
  that write runs in the background: a stalled TCP lane holds it for
  ``transfer_s``, and the peer's handshake would time out first;
- ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` / ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``
  are raised (unless set) so batches of thousands of descriptors are not refused;
  ``MC_TRANSFER_TIMEOUT`` follows ``timeouts.transfer_s``, ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  a third of it (Mooncake's 30 s would let one stalled lane use a whole default
  ``transfer_s``: measured, a write to a peer that stops reading fails after exactly
  that time) and ``MC_LOG_LEVEL`` defaults to WARNING, as INFO logs every batch (each
  unless the user set it);
- the engine's ``batch_transfer_sync`` and ``get_batch_transfer_status`` wait in a busy
  loop (GIL released): one core per batch in flight for as long as it takes (measured:
  3.0 s of CPU in 3.0 s for a batch to a stopped peer), which on a small machine
  starves the engine's TCP threads, the peer and the serving engine's forward (SGLang,
  128 tokens, 2 CPUs: per layer cost the prefill's forward 20-25 ms more than per
  chunk). ``transfer_check_status`` does not wait, but reads a batch's first task only:
  hence batches of one. Measured side by side (``benchmarks/run.py transport-costs``,
  2 CPUs): a request's 32 layer transfers took 0.82x the time with half the sending
  process's CPU (64 x 64 KiB a layer), 0.56x with 44% (2 x 16 KiB), and waiting on a
  stopped peer took 4% of a core against 10% (the busy wait at nice 10). The pool
  threads still run at nice ``waiter_nice`` (Linux, that thread alone);
- the engine returns -1 for any failure; the worker then runs ``send_probe`` to tell a
  dead peer from a rejected transfer and, while the peer answers, retries the batch
  after growing pauses (:data:`RETRY_PAUSES_S`): a TCP lane can fail transiently (an
  idle lane, a lane reconnecting after a cool-down under load), and moving the same
  bytes again is harmless. A dead peer fails at once;
- ``close`` waits a bounded time for batches in flight; batches stuck on a frozen peer
  keep the engine alive (parked, with a warning) rather than being pulled from under.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvbridge.core.layout import MemoryKind
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
from kvbridge.transports.notifier import ZmqNotifier

try:
    from mooncake.engine import TransferEngine, TransferOpcode
except ImportError as _exc:  # pragma: no cover - exercised through the registry
    raise ImportError(f"Mooncake transfer engine is not importable: {_exc}") from _exc

if TYPE_CHECKING:
    from kvbridge.config import KVBridgeConfig, MooncakeOptions

log = logging.getLogger(__name__)

_OWN_ENV = "KVBRIDGE_MOONCAKE_ENV"
"""The engine's ``MC_*`` variables kvbridge set itself in this process, with their
values (``NAME=value;...``). A child process inherits both; without this record it
would take kvbridge's values (e.g. a 2 s lane timeout made for a 6 s ``transfer_s``)
for the user's and keep them whatever its own config says."""


def _own_env() -> dict[str, str]:
    return dict(
        item.split("=", 1) for item in os.environ.get(_OWN_ENV, "").split(";") if "=" in item
    )


def _user_set(name: str) -> bool:
    """Whether the user set ``name``: present, and not as kvbridge left it."""
    return name in os.environ and _own_env().get(name) != os.environ[name]


def _set_env(name: str, value: str) -> None:
    """Set one of the engine's variables unless the user did (read at engine creation)."""
    if _user_set(name):
        return
    own = _own_env()
    own[name] = os.environ[name] = value
    os.environ[_OWN_ENV] = ";".join(f"{k}={v}" for k, v in sorted(own.items()))


_ENGINE_RE = re.compile(r"^[A-Za-z0-9.\-:\[\]]+:\d{1,5}$")
_OPCODES = {"write": TransferOpcode.Write, "read": TransferOpcode.Read}

RETRY_PAUSES_S = (0.05, 0.5, 1.5)
"""Pauses before each retry of a batch that failed while its peer answers a probe. The
later ones outlast the cool-down after which Mooncake's TCP transport reconnects a
failed lane (about 1 s); all of them together stay well inside any transfer
deadline (``MC_TRANSFER_TIMEOUT`` is at least 5 s)."""


POLL_PAUSE_FIRST_S = 20e-6
"""The first pause between two looks at a pending descriptor; each later one doubles."""
POLL_PAUSE_MAX_S = 0.5e-3
"""The longest pause: what waiting costs a transfer beyond its completion, at most (a
look costs about a microsecond; at this pace a long transfer's waiting thread wakes
2,000 times a second)."""
_BATCH_IDS = range(1, 1 << 63)
"""What ``batch_transfer_async`` returns for a submitted batch (an address); 0 (refused)
and 2**64 - 1 (the peer's segment would not open) are failures."""


def progress_timeout_s(options: MooncakeOptions, transfer_timeout_s: float) -> int:
    """Seconds a TCP lane may move nothing before Mooncake drops it: the option, else a
    third of the transfer timeout (at least 2), so a retry fits in the deadline."""
    return options.progress_timeout_s or max(2, int(transfer_timeout_s // 3))


_parked: list[object] = []
"""Engines (with their pools) closed while a frozen peer still held batches; kept alive
so no worker thread ever runs inside a destroyed engine."""


class _Endpoints(msgspec.Struct, frozen=True):
    """The Mooncake payload of :class:`~kvbridge.transports.base.PeerMetadata`."""

    engine: str
    """``host:port`` of the transfer engine's RPC server."""
    notify: str
    """``tcp://host:port`` of the notification socket."""


def _lower_priority(nice: int) -> None:
    """Pool-thread initializer: run this thread (alone) at ``nice``; see the module
    docstring. Where the OS refuses (not Linux, a sandbox), the thread keeps its
    priority."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as exc:
        log.debug("kvbridge: could not lower the Mooncake waiter's priority: %s", exc)


class MooncakeTransport(TransportBase):
    """A Mooncake ``TransferEngine`` behind the kvbridge transport contract.

    Args:
        agent_name: unique name of this agent (peers see it on notifications).
        options: ``mooncake`` section of the kvbridge config.
        host: address the engine and the notification socket listen on and advertise.
        transfer_timeout_s: the engine's own per-transfer timeout (at least 5 s).
    """

    name = "mooncake"

    def __init__(
        self,
        agent_name: str,
        options: MooncakeOptions,
        host: str = "127.0.0.1",
        transfer_timeout_s: float = 30.0,
    ) -> None:
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
                    "mooncake.protocol is 'rdma' but this machine has no RDMA device "
                    "(/sys/class/infiniband is empty)",
                    fix="set mooncake.protocol to 'tcp', or install the NIC's RDMA driver",
                )
            if options.device_name and not set(options.device_name.split(",")) <= set(devices):
                raise TransportUnavailableError(
                    f"mooncake.device_name {options.device_name!r} names devices this machine "
                    "lacks",
                    fix=f"use some of: {', '.join(devices)}",
                )
        _set_env("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(options.max_queued_transfers_per_peer))
        _set_env(
            "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", str(options.max_pending_admissions_per_peer)
        )
        _set_env("MC_LOG_LEVEL", "WARNING")  # INFO logs every batch
        # follow this config
        _set_env("MC_TRANSFER_TIMEOUT", str(max(5, round(transfer_timeout_s))))
        self._engine_timeout_s = max(5.0, float(os.environ["MC_TRANSFER_TIMEOUT"]))
        _set_env(
            "MC_TCP_PROGRESS_TIMEOUT_SEC", str(progress_timeout_s(options, transfer_timeout_s))
        )
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", options.protocol, options.device_name)
        if rc != 0:
            raise TransportUnavailableError(
                f"Mooncake TransferEngine.initialize({host!r}, protocol={options.protocol!r}) "
                f"returned {rc}",
                fix="check that 'host' is an address of this machine; run 'kvbridge doctor'",
            )
        self.protocol = options.protocol
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._notifier = ZmqNotifier(host)
        self._workers = options.workers
        self._nice = options.waiter_nice
        self._pools: dict[str, cf.ThreadPoolExecutor] = {}
        self._draining: list[cf.ThreadPoolExecutor] = []
        self._endpoints: dict[str, str] = {}
        self._inflight: set[cf.Future] = set()
        self._inflight_lock = threading.Lock()
        self._closing = threading.Event()  # cuts retry pauses short
        self._start_pump(blocking=True)

    @classmethod
    def from_config(
        cls, agent_name: str, config: KVBridgeConfig, memory: MemoryKind = "host"
    ) -> MooncakeTransport:
        return cls(
            agent_name,
            config.mooncake,
            host=config.host,
            transfer_timeout_s=config.timeouts.transfer_s,
        )

    @property
    def engine(self) -> TransferEngine:
        """The underlying ``TransferEngine``, for diagnostics and baseline benchmarks."""
        return self._engine

    def peer_endpoint(self, peer: str) -> str:
        """``host:port`` of a known peer's engine."""
        self._peer_index(peer)
        return self._endpoints[peer]

    # --- workers ---------------------------------------------------------------------------

    def _submit(self, peer: str, fn: Callable[..., object], *args: object) -> cf.Future:
        future = self._pools[peer].submit(fn, *args)
        with self._inflight_lock:
            self._inflight.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: cf.Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(future)

    def _batch(
        self,
        peer: str,
        endpoint: str,
        src: list[int],
        dst: list[int],
        length: list[int],
        opcode: object,
        notify: bytes | None,
    ) -> tuple[int, int]:
        """Worker side: run one batch; on success send its notification, on failure
        probe the peer (every engine call here may block)."""
        engine = self._engine  # close() may drop the attribute while we run; not the engine
        rc = self._move(engine, endpoint, src, dst, length, opcode)
        probe = 0
        for attempt, pause in enumerate(RETRY_PAUSES_S, 1):
            if rc == 0:
                break
            probe = engine.send_probe(endpoint)
            if probe != 0 or self._closing.wait(pause):
                break  # the peer is gone (or we are closing): no retry can help
            # the peer is alive: a transient TCP lane failure (seen after a lane sat
            # idle, and under load). The notification only follows success.
            log.info(
                "Mooncake batch to %s failed (rc=%s) with the peer alive; retry %d of %d",
                peer,
                rc,
                attempt,
                len(RETRY_PAUSES_S),
            )
            rc = self._move(engine, endpoint, src, dst, length, opcode)
            probe = 0
        if rc == 0:
            if notify is not None:
                self._notifier.send(peer, self.agent_name, notify)
            return 0, 0
        return rc, (probe if probe != 0 else engine.send_probe(endpoint))

    def _move(
        self,
        engine: TransferEngine,
        endpoint: str,
        src: list[int],
        dst: list[int],
        length: list[int],
        opcode: object,
    ) -> int:
        """Worker side: move one transfer's descriptors, each a batch of one, and look at
        them in order until each has ended; 0 if all landed, else the engine's failure
        (-1 failed, -2 timed out) or -1 (refused, or no end within the engine's own
        deadline for a batch of these bytes, as ``batch_transfer_sync`` gives: the
        transfer timeout plus a second per GB). Returns only once no descriptor is left
        that the engine reports as moving, or at that deadline."""
        rc, ids = 0, []
        for s, d, n in zip(src, dst, length, strict=True):
            batch = engine.batch_transfer_async(endpoint, [s], [d], [n], opcode)
            if batch not in _BATCH_IDS:
                rc = -1
                break  # those submitted are still waited for: their memory is in use
            ids.append(batch)
        deadline = time.monotonic() + self._engine_timeout_s + sum(length) / 1e9
        for i, batch in enumerate(ids):
            pause = POLL_PAUSE_FIRST_S
            while (status := engine.transfer_check_status(batch)) == 0:
                if time.monotonic() > deadline:
                    log.error(
                        "kvbridge: Mooncake transfer to %s still moving %d descriptors "
                        "after the engine's deadline; giving up on it",
                        endpoint,
                        len(ids) - i,
                    )
                    return -1
                time.sleep(pause)  # the binding offers no completion event
                pause = min(2 * pause, POLL_PAUSE_MAX_S)
            if status != 1 and rc == 0:
                rc = status
        return rc

    def _log_probe(self, peer: str, future: cf.Future[tuple[int, int]]) -> None:
        """A background ``add_peer`` probe ended (its pool thread): a failure only
        logged; the first transfer to the peer reports it."""
        try:
            rc, probe_rc = future.result()
            self._check(rc, probe_rc, peer, "add_peer")
        except Exception as exc:  # noqa: BLE001 - a log line, the transfer raises its own
            log.warning("kvbridge: Mooncake peer %s did not answer its first probe: %s", peer, exc)

    def _check(self, rc: int, probe: int, peer: str, what: str) -> None:
        if rc == 0:
            return
        if probe != 0:
            raise self._peer_lost(peer, what, f"Mooncake rc={rc}, the peer does not answer a probe")
        raise TransferFailedError(
            f"Mooncake {what} to {peer!r} failed (rc={rc}) {len(RETRY_PAUSES_S) + 1} times "
            "although the peer answers a probe",
            fix="check that the target addresses are registered on the peer",
        )

    # --- hooks -----------------------------------------------------------------------------

    def _register(
        self, regions: tuple[tuple[int, int], ...], memory: MemoryKind, device: int
    ) -> object:
        location = "cpu:0" if memory == "host" else f"cuda:{device}"
        done: list[int] = []
        for addr, length in regions:
            rc = self._engine.register_memory(addr, length, location)
            if rc != 0:
                for a in done:
                    self._engine.unregister_memory(a)
                raise TransportError(
                    f"Mooncake could not register {length} bytes at 0x{addr:x} ({location}): "
                    f"rc={rc}"
                )
            done.append(addr)
        return done

    def _deregister(self, registration: Registration) -> None:
        for addr in registration.handle:  # type: ignore[attr-defined]
            self._engine.unregister_memory(addr)

    def _backend_metadata(self) -> bytes:
        return msgspec.msgpack.encode(
            _Endpoints(engine=self.endpoint, notify=self._notifier.endpoint)
        )

    def _add_peer(self, md: PeerMetadata, probe: bool) -> None:
        try:
            ends = msgspec.msgpack.decode(md.payload, type=_Endpoints)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"Mooncake peer metadata is malformed: {exc}") from exc
        if not _ENGINE_RE.match(ends.engine):
            raise WireError(
                f"Mooncake peer metadata has a malformed engine endpoint {ends.engine!r}"
            )
        if not md.regions:
            raise TransportError(
                f"Mooncake peer {md.agent!r} has no registered memory",
                fix="register memory on the peer before taking its metadata",
            )
        sources = [r[0] for r in self._local.as_list()]
        if not sources:
            raise InvalidDescriptorError("register local memory before adding Mooncake peers")
        self._pools[md.agent] = cf.ThreadPoolExecutor(
            self._workers,
            thread_name_prefix=f"kvbridge-mooncake-{md.agent}",
            initializer=_lower_priority,
            initargs=(self._nice,),
        )
        self._notifier.connect(md.agent, ends.notify)
        # open the engine's segment now (see the module docstring); moves nothing
        future = self._submit(
            md.agent,
            self._batch,
            md.agent,
            ends.engine,
            [sources[0]],
            [md.regions[0][0]],
            [0],
            TransferOpcode.Write,
            None,
        )
        if not probe:  # the peer waits for our answer: open the segment in the background
            self._endpoints[md.agent] = ends.engine
            future.add_done_callback(lambda f, peer=md.agent: self._log_probe(peer, f))
            return
        try:
            try:
                rc, probe_rc = future.result(timeout=self._engine_timeout_s + 5)
            except cf.TimeoutError:
                raise self._peer_lost(
                    md.agent, "add_peer", f"no answer from {ends.engine}"
                ) from None
            self._check(rc, probe_rc, md.agent, "add_peer")
        except Exception:
            self._drop_peer(md.agent)
            raise
        self._endpoints[md.agent] = ends.engine

    def _remove_peer(self, peer: str) -> None:
        self._endpoints.pop(peer, None)
        self._drop_peer(peer)

    def _drop_peer(self, peer: str) -> None:
        self._notifier.disconnect(peer)
        pool = self._pools.pop(peer, None)
        if pool is not None:
            pool.shutdown(wait=False)  # its batches finish on their own; close() waits for them
            self._draining.append(pool)

    def _post(
        self,
        op: Op,
        local: DescTable,
        lidx: np.ndarray,
        remote: DescTable,
        ridx: np.ndarray,
        notify: bytes | None,
        nbytes: int,
    ) -> Xfer:
        peer = remote.peer
        assert peer is not None
        regions = self._regions(local, lidx, remote, ridx)
        future = self._submit(
            peer,
            self._batch,
            peer,
            self._endpoints[peer],
            regions.src.tolist(),
            regions.dst.tolist(),
            regions.length.tolist(),
            _OPCODES[op],
            notify,
        )
        return Xfer(peer, nbytes, len(regions), future)

    def _poll(self, xfer: Xfer) -> bool:
        future: cf.Future = xfer.handle  # type: ignore[assignment]
        if not future.done():
            return False
        try:
            rc, probe = future.result()
        except TransportError:
            raise
        except Exception as exc:  # pragma: no cover - defensive: a worker bug
            raise TransferFailedError(
                f"Mooncake worker failed: {type(exc).__name__}: {exc}"
            ) from exc
        self._check(rc, probe, xfer.peer, "transfer")
        return True

    def wait(self, xfer: Xfer, timeout: float) -> None:
        """Block on the worker's future (no polling needed for this backend)."""
        if not xfer.done and xfer.error is None and not xfer.released:
            cf.wait([xfer.handle], timeout=timeout)  # type: ignore[list-item]
        if not self.poll(xfer):
            raise DeadlineExceeded(
                f"transfer of {xfer.nbytes} bytes to {xfer.peer!r} did not complete within "
                f"{timeout:g}s",
                fix=(
                    "check that the peer is alive; raise timeouts.transfer_s for very large "
                    "transfers"
                ),
            )

    def _release(self, xfer: Xfer) -> None:
        xfer.handle.cancel()  # type: ignore[attr-defined]  # a started batch runs to completion

    def _notify(self, peer: str, payload: bytes) -> None:
        self._notifier.send(peer, self.agent_name, payload)

    def _drain_notifications(self) -> list[Notification]:
        return self._notifier.receive(timeout_ms=20)

    def _close_backend(self) -> None:
        self._closing.set()
        pools = list(self._pools.values()) + self._draining
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._inflight_lock:
            running = list(self._inflight)
        bound = self._engine_timeout_s + 5
        _, stuck = cf.wait(running, timeout=bound)
        self._notifier.close()
        if stuck:
            log.warning(
                "%s: %d Mooncake batches still running %.0fs after close (a peer is frozen); "
                "the engine stays alive until they end",
                self.agent_name,
                len(stuck),
                bound,
            )
            _parked.append((self._engine, pools))
        self._pools.clear()
        self._draining.clear()
        self._engine = None  # type: ignore[assignment]


__all__ = ["RETRY_PAUSES_S", "MooncakeTransport", "progress_timeout_s"]
