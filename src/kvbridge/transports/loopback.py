"""In-process test double: transports of one process moving bytes with ``memmove``
(GPU memory: with torch copies, where CUDA is available; for the GPU tests).

For unit tests of the core and the adapters, never as evidence that NIXL or Mooncake
work. It honours the whole contract (validation, notifications exactly once, close)
because it shares :class:`~kvbridge.transports.common.TransportBase` with them, and it
can simulate a dead peer with :meth:`LoopbackTransport.kill`.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.layout import MemoryKind
from kvbridge.errors import InvalidDescriptorError, TransportUnavailableError
from kvbridge.transports.base import DescTable, Notification, Op, PeerMetadata, Registration, Xfer
from kvbridge.transports.common import TransportBase

if TYPE_CHECKING:
    from kvbridge.config import KVBridgeConfig

_fabric: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_fabric_lock = threading.Lock()


class LoopbackTransport(TransportBase):
    """Transfers complete inside :meth:`post`; notifications land in the peer's inbox."""

    name = "loopback"

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        self.alive = True
        with _fabric_lock:
            if agent_name in _fabric:
                raise ValueError(f"a loopback transport named {agent_name!r} already exists")
            _fabric[agent_name] = self

    @classmethod
    def from_config(
        cls, agent_name: str, config: KVBridgeConfig, memory: MemoryKind = "host"
    ) -> LoopbackTransport:
        if memory != "host":
            raise TransportUnavailableError("the loopback transport moves host memory only")
        return cls(agent_name)

    def kill(self) -> None:
        """Simulate a dead process: every transfer or notification to it now fails."""
        self.alive = False

    def _target(self, peer: str) -> LoopbackTransport:
        other = _fabric.get(peer)
        if other is None or not other.alive or other._closed:
            raise self._peer_lost(peer, "transfer", "loopback peer is gone")
        return other

    def _register(
        self, regions: tuple[tuple[int, int], ...], memory: MemoryKind, device: int
    ) -> object:
        if memory != "host" and not _cuda_available():
            raise InvalidDescriptorError(
                "the loopback transport moves device memory only where CUDA is available"
            )
        return None

    def _deregister(self, registration: Registration) -> None:
        pass

    def _backend_metadata(self) -> bytes:
        return b""

    def _add_peer(self, md: PeerMetadata, probe: bool) -> None:
        pass

    def _remove_peer(self, peer: str) -> None:
        pass

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
        target = self._target(peer)
        regions = self._regions(local, lidx, remote, ridx)
        if local.memory != remote.memory:
            raise InvalidDescriptorError(
                f"the loopback transport moves {local.memory} to {local.memory} memory only, not "
                f"to {remote.memory}"
            )
        pairs = zip(
            regions.src.tolist(), regions.dst.tolist(), regions.length.tolist(), strict=True
        )
        if op == "read":
            pairs = ((dst, src, n) for src, dst, n in pairs)
        if local.memory == "host":
            for src, dst, n in pairs:
                ctypes.memmove(dst, src, n)
        else:
            _device_copy(pairs)
        if notify:
            target._inbox.put([Notification(self.agent_name, bytes(notify))])
        xfer = Xfer(peer, nbytes, len(regions))
        xfer.done = True
        return xfer

    def _poll(self, xfer: Xfer) -> bool:
        return True

    def _release(self, xfer: Xfer) -> None:
        pass

    def _notify(self, peer: str, payload: bytes) -> None:
        self._target(peer)._inbox.put([Notification(self.agent_name, payload)])

    def _drain_notifications(self) -> list[Notification]:
        return []

    def _close_backend(self) -> None:
        with _fabric_lock:
            if _fabric.get(self.agent_name) is self:
                del _fabric[self.agent_name]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _device_copy(pairs) -> None:
    """Copy ``(src, dst, n)`` regions of GPU memory; returns once they have landed."""
    import torch

    from kvbridge.ops import device_bytes

    device = torch.cuda.current_device()
    for src, dst, n in pairs:
        device_bytes(dst, n, device).copy_(device_bytes(src, n, device))
    torch.cuda.synchronize()


__all__ = ["LoopbackTransport"]
