"""The transport contract: what kvbridge needs from NIXL, Mooncake or a test double.

A transport moves bytes between registered memory of two processes and delivers small
notifications. It knows nothing of KV caches, requests or engines.

Lifecycle (one transport per worker process, owned by the engine adapter)::

    t = create_transport("nixl", config, name="prefill-0#<epoch>")
    reg = t.register([(addr, length)], memory="host")       # once, at start
    md = t.metadata()                                      # after registering; to peers
    t.peer_name(peer_md)   # per peer, from the handshake: the agent it names, checked
    peer = t.add_peer(peer_md)     # against the sender first (a known one is replaced)
    local = t.prepare(local_descs)                         # once per cache
    remote = t.prepare(peer_descs, peer=peer)              # once per peer cache
    once = t.adhoc(descs, peer=peer)     # or: checked, not prepared, for one post
    x = t.post("write", local, idx, remote, idx, notify=b"...")   # per transfer
    t.wait(x, timeout)  # or: poll(x) until True
    t.release(x)
    t.take_notifications(timeout)                          # the target side
    t.add_demand(probe); t.wake()   # when something is expected (see below)
    t.close()

Threads: every method may be called from any thread. Notifications are collected by a
pump thread per transport (which also drives backend progress) and each is handed to
exactly one :meth:`~Transport.take_notifications` caller. A backend without a blocking
wait (NIXL) is polled: at a busy pace while its owners expect something (their
:meth:`~Transport.add_demand` probes), slowly otherwise.

Errors: methods raise only :class:`~kvbridge.errors.TransportError` subclasses and
:class:`~kvbridge.errors.DeadlineExceeded`; backend exceptions are mapped at the edge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import msgspec
import numpy as np

from kvbridge.core.layout import MemoryKind
from kvbridge.errors import IncompatiblePeerError, InvalidDescriptorError, WireError

Op = Literal["write", "read"]


class Notification(NamedTuple):
    """A notification received from ``peer`` (the sender's agent name)."""

    peer: str
    payload: bytes


class Registration(NamedTuple):
    """Memory registered with a transport; pass back to ``deregister``."""

    regions: tuple[tuple[int, int], ...]
    memory: MemoryKind
    device: int
    handle: object


class DescTable:
    """A descriptor list prepared once, then referenced by index by many transfers.

    ``descs`` is an ``(N, 3)`` uint64 array of ``(address, length, device)``; ``peer`` is
    ``None`` for our own memory. ``handle`` belongs to the backend. Created by
    :meth:`Transport.prepare`; freed by :meth:`Transport.release_table` or ``close``.
    ``prepared`` is False for the one-post lists of :meth:`Transport.adhoc`, which hold
    nothing of the backend's and need no release.
    """

    __slots__ = ("descs", "handle", "memory", "peer", "prepared", "released", "uniform_length")

    def __init__(
        self,
        descs: np.ndarray,
        memory: MemoryKind,
        peer: str | None,
        handle: object = None,
        *,
        prepared: bool = True,
    ) -> None:
        self.descs = descs
        self.memory = memory
        self.peer = peer
        self.handle = handle
        self.prepared = prepared
        self.released = False
        lengths = descs[:, 1]
        self.uniform_length: int | None = (
            int(lengths[0]) if lengths.size and (lengths == lengths[0]).all() else None
        )
        """The length of every descriptor when all are equal (KV slot tables), else None."""

    def __len__(self) -> int:
        return int(self.descs.shape[0])

    def __repr__(self) -> str:
        where = f"peer={self.peer!r}" if self.peer else "local"
        return f"DescTable({len(self)} descs, {self.memory}, {where})"


class Xfer:
    """One posted transfer. Backends subclass it to carry their handle.

    ``done`` becomes True once the transfer completed successfully; ``error`` holds the
    mapped exception once it failed (and is raised by ``poll``/``wait``).
    """

    __slots__ = ("done", "error", "handle", "nbytes", "num_descs", "peer", "released")

    def __init__(self, peer: str, nbytes: int, num_descs: int, handle: object = None) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.num_descs = num_descs
        self.handle = handle
        self.done = False
        self.error: BaseException | None = None
        self.released = False

    def __repr__(self) -> str:
        state = "done" if self.done else ("failed" if self.error else "pending")
        return f"Xfer(peer={self.peer!r}, {self.nbytes} B in {self.num_descs} descs, {state})"


@runtime_checkable
class Transport(Protocol):
    """Structural type of a transport; see the module docstring for the lifecycle."""

    name: str
    """Registry name: ``"nixl"``, ``"mooncake"``, ``"loopback"``."""
    agent_name: str
    """Our identity as peers see it (notifications arrive tagged with the sender's)."""

    def register(
        self, regions: Sequence[tuple[int, int]], memory: MemoryKind = "host", device: int = 0
    ) -> Registration: ...
    def deregister(self, registration: Registration) -> None: ...
    def metadata(self) -> bytes: ...
    def peer_name(self, metadata: bytes) -> str: ...
    def add_peer(self, metadata: bytes, *, probe: bool = True) -> str: ...
    def remove_peer(self, peer: str) -> None: ...
    def prepare(
        self, descs: np.ndarray, memory: MemoryKind = "host", peer: str | None = None
    ) -> DescTable: ...
    def adhoc(
        self, descs: np.ndarray, memory: MemoryKind = "host", peer: str | None = None
    ) -> DescTable: ...
    def release_table(self, table: DescTable) -> None: ...
    def post(
        self,
        op: Op,
        local: DescTable,
        local_idx: np.ndarray | Sequence[int],
        remote: DescTable,
        remote_idx: np.ndarray | Sequence[int],
        notify: bytes | None = None,
    ) -> Xfer: ...
    def poll(self, xfer: Xfer) -> bool: ...
    def wait(self, xfer: Xfer, timeout: float) -> None: ...
    def release(self, xfer: Xfer) -> None: ...
    def notify(self, peer: str, payload: bytes) -> None: ...
    def take_notifications(self, timeout: float = 0.0) -> list[Notification]: ...
    def add_demand(self, probe: Callable[[], bool]) -> None: ...
    def remove_demand(self, probe: Callable[[], bool]) -> None: ...
    def wake(self) -> None: ...
    def close(self) -> None: ...


# --- metadata envelope -------------------------------------------------------------------


class PeerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`Transport.metadata` returns, msgpack-encoded.

    ``payload`` is the backend's own blob (NIXL agent metadata, Mooncake endpoint);
    ``regions`` lists the memory registered when the metadata was taken, as
    ``(address, length, device, memory)``, so we can reject a descriptor that points
    outside the peer's memory before the backend sees it.
    """

    transport: str
    agent: str
    payload: bytes
    regions: list[tuple[int, int, int, Literal["host", "device"]]] = []


_md_encoder = msgspec.msgpack.Encoder()
_md_decoder = msgspec.msgpack.Decoder(PeerMetadata)


def encode_metadata(md: PeerMetadata) -> bytes:
    return _md_encoder.encode(md)


def decode_metadata(data: bytes, expect_transport: str) -> PeerMetadata:
    """Decode a peer's metadata (network input) and check it is for our transport."""
    try:
        md = _md_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"peer transport metadata is malformed: {exc}") from exc
    if md.transport != expect_transport:
        raise IncompatiblePeerError(
            f"peer uses transport {md.transport!r}, this instance uses {expect_transport!r}",
            differences={"transport": (expect_transport, md.transport)},
            fix="set the same 'transport' in the kvbridge config of prefill and decode",
        )
    return md


# --- descriptors -------------------------------------------------------------------------


def as_descs(descs: np.ndarray | Sequence[Sequence[int]], default_device: int = 0) -> np.ndarray:
    """Normalise ``(N, 2)`` or ``(N, 3)`` descriptors to a C-contiguous ``(N, 3)`` uint64
    array of ``(address, length, device)``."""
    arr = np.asarray(descs, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise InvalidDescriptorError(
            "descriptors must be an (N, 2) or (N, 3) array of (address, length[, device]), got "
            f"shape {arr.shape}"
        )
    if arr.shape[1] == 2:
        arr = np.concatenate(
            [arr, np.full((arr.shape[0], 1), default_device, dtype=np.uint64)], axis=1
        )
    return np.ascontiguousarray(arr)


__all__ = [
    "DescTable",
    "Notification",
    "Op",
    "PeerMetadata",
    "Registration",
    "Transport",
    "Xfer",
    "as_descs",
    "decode_metadata",
    "encode_metadata",
]
