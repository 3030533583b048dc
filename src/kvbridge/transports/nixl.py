"""NIXL transport: UCX (or another NIXL backend), host (DRAM) or device (VRAM) memory.

Only this module imports ``nixl``; the registry imports this module on first use.

How it uses NIXL:

- one agent per transport, created with ``NIXL_THREAD_SYNC_STRICT`` because our pump
  thread and the caller's threads share it (without it, a shared agent hangs or crashes);
- descriptor tables are ``prep_xfer_dlist`` handles prepared once; each transfer is
  ``make_prepped_xfer`` with index arrays (several times cheaper than
  ``initialize_xfer`` for thousands of descriptors; NIXL merges adjacent descriptors);
  one-post lists (``adhoc``) go through ``initialize_xfer``;
- NIXL's progress thread is off by default for host memory (it spins a core; on small
  machines that halves throughput) and on for device memory. Either way our pump
  thread calls ``get_new_notifs`` regularly, which also drives UCX progress on the
  target side: without some progress there, transfers into it stall;
- NIXL raises ``nixlRemoteDisconnectError`` from ``transfer``/``check_xfer_state`` when the
  peer dies (its docstrings say "ERR" is returned; both are handled);
- ``NIXL_LOG_LEVEL`` defaults to WARN (unless set): NIXL logs each agent at INFO;
- ``UCX_MODULES`` defaults to ``^ib`` on machines without RDMA devices (see below).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.layout import MemoryKind
from kvbridge.errors import (
    InvalidDescriptorError,
    KVBridgeError,
    TransferFailedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
)
from kvbridge.transports.base import DescTable, Notification, Op, PeerMetadata, Registration, Xfer
from kvbridge.transports.common import TransportBase, rdma_devices

# NIXL logs every agent creation at INFO on stdout; keep warnings and errors only
# unless the user asked for more.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# Without an RDMA device UCX's InfiniBand modules are useless, and loading them is
# harmful: NIXL's wheel bundles libibverbs/libnl, the bundled libibverbs loads the
# system's verbs providers, which bring the system's libibverbs/libnl (installed for
# Mooncake) into the same process, and the two libnl-route copies crash the process
# at exit (SIGSEGV in rtnl_tc_unregister). Skip the modules unless the user chose.
if "UCX_MODULES" not in os.environ and not rdma_devices():
    os.environ["UCX_MODULES"] = "^ib"

try:
    import nixl._bindings as _nixl_bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError as _exc:  # pragma: no cover - exercised through the registry
    raise ImportError(f"NIXL is not importable: {_exc}") from _exc

if TYPE_CHECKING:
    from kvbridge.config import KVBridgeConfig, NixlOptions

log = logging.getLogger(__name__)

_MEM = {"host": "DRAM", "device": "VRAM"}
_OPS = {"write": "WRITE", "read": "READ"}


def _nixl_error(name: str) -> type[BaseException]:
    return getattr(_nixl_bindings, name, type(f"_absent_{name}", (Exception,), {}))


_DISCONNECT = _nixl_error("nixlRemoteDisconnectError")
_NOT_FOUND = _nixl_error("nixlNotFoundError")
_INVALID = _nixl_error("nixlInvalidParamError")


class NixlTransport(TransportBase):
    """A NIXL agent behind the kvbridge transport contract.

    Args:
        agent_name: unique name of this agent (peers see it).
        options: ``nixl`` section of the kvbridge config.
        memory: where the KV cache lives; picks the progress-thread default.
    """

    name = "nixl"

    def __init__(self, agent_name: str, options: NixlOptions, memory: MemoryKind = "host") -> None:
        super().__init__(agent_name)
        progress = (
            options.progress_thread if options.progress_thread is not None else memory == "device"
        )
        conf = nixl_agent_config(
            enable_prog_thread=progress,
            enable_listen_thread=False,
            backends=list(options.backends),
            num_threads=options.num_threads,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent = nixl_agent(agent_name, conf)
        except Exception as exc:
            raise TransportUnavailableError(
                f"could not create a NIXL agent: {exc}",
                fix="run 'kvbridge doctor' to see which NIXL backends work here",
            ) from exc
        if not self._agent.backends:
            plugins = self._agent.get_plugin_list()
            raise TransportUnavailableError(
                f"none of the NIXL backends {list(options.backends)} could be created; available "
                f"plugins: {plugins}",
                fix=f"set nixl.backends to some of {plugins}",
            )
        self.progress_thread = progress
        self._start_pump()

    @classmethod
    def from_config(
        cls, agent_name: str, config: KVBridgeConfig, memory: MemoryKind = "host"
    ) -> NixlTransport:
        return cls(agent_name, config.nixl, memory)

    @property
    def agent(self) -> nixl_agent:
        """The underlying ``nixl_agent``, for diagnostics and baseline benchmarks. Never
        release kvbridge-owned handles through it."""
        return self._agent

    # --- error mapping ---------------------------------------------------------------------

    def _map(self, exc: BaseException, what: str, peer: str | None = None) -> KVBridgeError:
        if isinstance(exc, KVBridgeError):
            return exc
        if isinstance(exc, _DISCONNECT):
            return self._peer_lost(peer, what, exc)
        if isinstance(exc, _NOT_FOUND):
            if peer is not None and what == "prepare":
                return InvalidDescriptorError(f"NIXL rejected descriptors of peer {peer!r}: {exc}")
            return UnknownPeerError(f"NIXL does not know peer {peer!r} ({what}): {exc}")
        if isinstance(exc, _INVALID):
            return InvalidDescriptorError(f"NIXL rejected {what}: {exc}")
        return TransferFailedError(f"NIXL {what} failed: {type(exc).__name__}: {exc}")

    # --- hooks -----------------------------------------------------------------------------

    def _register(
        self, regions: tuple[tuple[int, int], ...], memory: MemoryKind, device: int
    ) -> object:
        descs = np.array([(a, n, device) for a, n in regions], dtype=np.uint64)
        try:
            return self._agent.register_memory(descs, _MEM[memory])
        except Exception as exc:
            raise TransportError(
                f"NIXL could not register {len(regions)} {memory} regions: {exc}"
            ) from exc

    def _deregister(self, registration: Registration) -> None:
        self._agent.deregister_memory(registration.handle)

    def _backend_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _add_peer(self, md: PeerMetadata, probe: bool) -> None:
        # NIXL connects while loading the metadata, with or without `probe`
        try:
            name = self._agent.add_remote_agent(md.payload)
        except Exception as exc:
            # UCX connects while loading metadata: a backend error here means the
            # peer's endpoint refused or is gone
            raise self._peer_lost(md.agent, "add_peer", f"{type(exc).__name__}: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != md.agent:
            self._agent.remove_remote_agent(name)
            raise TransportError(f"peer metadata names agent {md.agent!r} but NIXL loaded {name!r}")

    def _remove_peer(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # noqa: BLE001 (a dead peer may fail to disconnect cleanly)
            log.debug("remove_remote_agent(%s): %s", peer, exc)

    def _prepare(self, table: DescTable) -> object:
        target = table.peer if table.peer is not None else "NIXL_INIT_AGENT"
        try:
            return self._agent.prep_xfer_dlist(target, table.descs, _MEM[table.memory])
        except Exception as exc:
            raise self._map(exc, "prepare", table.peer) from exc

    def _release_table(self, table: DescTable) -> None:
        table.handle.release()  # type: ignore[attr-defined]

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
        try:
            if local.prepared and remote.prepared:
                handle = self._agent.make_prepped_xfer(
                    _OPS[op], local.handle, lidx, remote.handle, ridx, notify or b""
                )
            else:  # one-post lists (adhoc): NIXL checks and resolves the addresses now
                ours = self._agent.get_xfer_descs(local.descs[lidx], _MEM[local.memory])
                theirs = self._agent.get_xfer_descs(remote.descs[ridx], _MEM[remote.memory])
                handle = self._agent.initialize_xfer(_OPS[op], ours, theirs, peer, notify or b"")
        except Exception as exc:
            raise self._map(exc, "post", peer) from exc
        xfer = Xfer(peer, nbytes, int(lidx.size), handle)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            handle.release()
            raise self._map(exc, "post", peer) from exc
        if state == "ERR":
            handle.release()
            raise self._peer_lost(peer, "post", "NIXL returned ERR")
        xfer.done = state == "DONE"
        return xfer

    def _poll(self, xfer: Xfer) -> bool:
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except Exception as exc:
            raise self._map(exc, "transfer", xfer.peer) from exc
        if state == "ERR":
            raise self._peer_lost(xfer.peer, "transfer", "NIXL reported ERR")
        return state == "DONE"

    def _release(self, xfer: Xfer) -> None:
        try:
            xfer.handle.release()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 (NIXL could not cancel an active transfer)
            log.warning("NIXL could not release transfer to %s: %s", xfer.peer, exc)

    def _notify(self, peer: str, payload: bytes) -> None:
        try:
            self._agent.send_notif(peer, payload)
        except Exception as exc:
            raise self._map(exc, "notify", peer) from exc

    def _drain_notifications(self) -> list[Notification]:
        got = self._agent.get_new_notifs()
        return [Notification(str(peer), bytes(msg)) for peer, msgs in got.items() for msg in msgs]

    def _close_backend(self) -> None:
        self._agent = None  # type: ignore[assignment]  # the agent is destroyed once unreferenced


__all__ = ["NixlTransport"]
