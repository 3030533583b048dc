"""The packed data path of one worker (``wire_dtype: fp8``): a registered staging
buffer, its slot allocator, and packing / unpacking a request's blocks.

A *slot* holds one block of one layer, packed: one chunk of the format of
``csrc/PACKED_FORMAT.md`` with ``chunk_tokens = block_size``. Both sides share the
cache spec (the handshake checks it), so their slots have the same size and a write
is a list of slot pairs, like a direct write is a list of cache-slot pairs.

Who calls: :class:`~kvbridge.runtime.node.Node` creates it (after registering the
cache, before its transport metadata is taken); the sender packs a post's layers and
blocks into slots it allocates (:meth:`PackedPath.pack`) and frees them when the
write settles; the receiver reserves a request's slots before sending its
``Destination``, unpacks each arrival (:meth:`PackedPath.unpack`) and frees the
reservation when the request ends. Thread-safe allocator; pack / unpack run on the
caller's thread, synchronously. CPU caches only for now: on a GPU the sender would need
each layer's compute event before packing it, which no adapter passes yet.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.layout import CacheGeometry
from kvbridge.errors import ConfigError
from kvbridge.ops.format import FP8_DTYPE, PackedFormat
from kvbridge.transports.base import DescTable
from kvbridge.wire.messages import StagingInfo

if TYPE_CHECKING:
    import torch

    from kvbridge.transports.common import TransportBase

_FLOAT_CACHES = ("float16", "bfloat16", "float32")


def slot_format(geometry: CacheGeometry) -> PackedFormat:
    """The format of one slot: one block of one layer, FP8 with scales."""
    s = geometry.spec
    return PackedFormat(num_tokens=s.block_size, num_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=FP8_DTYPE, scaled=True, chunk_tokens=s.block_size)


def staging_descs(info: StagingInfo) -> np.ndarray:
    """``(num_slots, 3)`` descriptor table of a staging buffer (ours or a peer's)."""
    table = np.empty((info.num_slots, 3), dtype=np.uint64)
    table[:, 0] = np.uint64(info.base) + np.arange(info.num_slots, dtype=np.uint64) * np.uint64(info.slot_bytes)
    table[:, 1] = info.slot_bytes
    table[:, 2] = info.device
    return table


class SlotAllocator:
    """First-fit allocator of contiguous slot runs. Thread-safe.

    >>> a = SlotAllocator(10)
    >>> a.alloc(4), a.alloc(4), a.alloc(4)
    (0, 4, None)
    >>> a.free(0, 4); a.alloc(3), a.free_slots
    (0, 3)
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # sorted (start, length) runs
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def alloc(self, n: int) -> int | None:
        """First slot of ``n`` contiguous free slots, or None when no run is long enough."""
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (start + n, length - n)
                    return start
        return None

    def free(self, start: int, n: int) -> None:
        """Give back a run from :meth:`alloc` (exactly once)."""
        with self._lock:
            runs = self._free
            runs.append((start, n))
            runs.sort()
            merged: list[tuple[int, int]] = []
            for s, length in runs:
                if merged and merged[-1][0] + merged[-1][1] > s:
                    raise RuntimeError(f"staging slots [{s}, {s + length}) freed twice")
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((s, length))
            self._free = merged


class PackedPath:
    """Staging buffer + pack / unpack of one worker. See the module docstring.

    Args:
        geometry: this worker's cache.
        planes: per layer (model order) its K and V planes, from
            :func:`kvbridge.ops.kv_planes`.
        staging_mb: size of the staging buffer.
        transport: registers the buffer; ``prepare`` gives :attr:`table`.
    """

    def __init__(self, geometry: CacheGeometry, planes: Sequence[tuple[torch.Tensor, torch.Tensor]], staging_mb: int, transport: TransportBase) -> None:
        import torch

        spec = geometry.spec
        if spec.dtype not in _FLOAT_CACHES:
            raise ConfigError(
                f"wire_dtype 'fp8' packs float16, bfloat16 or float32 caches; this cache is {spec.dtype}",
                key="wire_dtype",
                fix="use wire_dtype 'exact' (a float8 cache is already as small)",
            )
        if planes and planes[0][0].device.type != "cpu":
            # the engine computes a layer on its own stream: packing it needs that layer's
            # compute event, which no engine adapter passes yet (the kernels are ready)
            raise ConfigError(
                "wire_dtype 'fp8' on GPU caches is not wired into the engine adapters yet",
                key="wire_dtype",
                fix="use wire_dtype 'exact' on GPU instances (kvbridge.ops packs GPU caches when called directly)",
            )
        if len(planes) != spec.num_layers:
            raise ValueError(f"{len(planes)} layers of cache planes for a {spec.num_layers}-layer cache")
        self.geometry = geometry
        self.planes = list(planes)
        self.block_size = spec.block_size
        self.slot = slot_format(geometry)
        num_slots = (staging_mb << 20) // self.slot.nbytes
        if num_slots < spec.num_layers:
            raise ConfigError(f"staging_mb {staging_mb} holds {num_slots} packed blocks, fewer than one block per layer", key="staging_mb", fix="raise staging_mb")
        device = self.planes[0][0].device
        raw = torch.empty(num_slots * self.slot.nbytes + 64, dtype=torch.uint8, device=device)
        skip = (-raw.data_ptr()) % 64
        self._raw = raw
        self.buffer = raw[skip : skip + num_slots * self.slot.nbytes]
        self.allocator = SlotAllocator(num_slots)
        memory = "host" if device.type == "cpu" else "device"
        dev = 0 if memory == "host" else (device.index or 0)
        self.info = StagingInfo(base=self.buffer.data_ptr(), num_slots=num_slots, slot_bytes=self.slot.nbytes, memory=memory, device=dev)
        self._registration = transport.register([(self.info.base, num_slots * self.slot.nbytes)], memory=memory, device=dev)
        self.table: DescTable = transport.prepare(staging_descs(self.info), memory=memory)

    def view(self, first: int, n: int) -> torch.Tensor:
        """Bytes of slots ``[first, first + n)``."""
        return self.buffer[first * self.slot.nbytes : (first + n) * self.slot.nbytes]

    def pack(self, layers: Sequence[int], block_ids: Sequence[int], first: int) -> None:
        """Pack the whole ``block_ids`` of each of ``layers`` into slots from ``first``:
        layer ``layers[i]``'s block ``j`` in slot ``first + i * len(block_ids) + j``.
        Returns once the bytes are in place (CPU: the ops run synchronously).

        Whole blocks, like the exact path: the order of tokens inside a block is the
        attention kernel's business (vLLM's CPU kernel keeps a block's keys dim-major),
        so a block is moved as ``block_size`` opaque rows per head and plane, whatever
        they hold; only a row's ``head_dim`` values must be contiguous."""
        from kvbridge import ops

        n = len(block_ids)
        ops.pack([self.planes[l] for l in layers], block_ids, n * self.block_size, fp8=True, chunk_tokens=self.block_size, out=self.view(first, len(layers) * n))

    def unpack(self, layer: int, block_ids: Sequence[int], first: int) -> None:
        """Unpack slots ``[first, first + len(block_ids))`` of one layer into the whole
        ``block_ids`` of this cache. Returns once the cache holds them."""
        from kvbridge import ops

        fmt = self.slot._replace(num_tokens=len(block_ids) * self.block_size)
        ops.unpack(self.view(first, len(block_ids)), fmt, self.planes[layer], block_ids)


__all__ = ["PackedPath", "SlotAllocator", "slot_format", "staging_descs"]
