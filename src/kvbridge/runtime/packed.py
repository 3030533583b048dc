"""The packed data path of one worker (``data_path: packed``, implied by ``wire_dtype:
fp8``): a registered staging buffer, its slot allocator, and packing / unpacking a
request's blocks.

A *slot* holds one block of one layer, packed: one chunk of the format of
``csrc/PACKED_FORMAT.md`` with ``chunk_tokens = block_size``, FP8 with scales
(``wire_dtype: fp8``) or the cache's own values (``exact``); a latent (MLA) cache's
block packs as its vectors' two halves (:func:`slot_format`). Peers with the same TP
split share the cache spec (the handshake checks it), so their slots have the same
size and a write is a list of slot pairs, like a direct write is a list of cache-slot
pairs. Peers split differently exchange, for every block, the head range they pair on
(:class:`~kvbridge.core.tp.Split`): both sides then address their buffers as *chunks*
of that many heads (:meth:`PackedPath.table_for`), reserved in whole slots
(:meth:`PackedPath.reserve`).

Who calls: :class:`~kvbridge.runtime.node.Node` creates it (after registering the
cache, before its transport metadata is taken); the sender packs a post's layers and
blocks into slots it allocates (:meth:`PackedPath.pack`) and frees them when the
write settles; the receiver reserves a request's slots before sending its
``Destination``, unpacks each arrival (:meth:`PackedPath.unpack`) and frees the
reservation when the request ends. Thread-safe allocator; pack / unpack return once
their bytes are in place: on CPU caches they run in the caller's thread, on a GPU on
a stream of their own (:class:`~kvbridge.runtime.device.OpsQueue`), waited for with
``timeouts.transfer_s``. The caller packs a layer only once the engine's kernels that
write it have completed (the vLLM worker's compute events gate the sender; the SGLang
backend waits for its layer events before packing).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvbridge.core.layout import CacheGeometry
from kvbridge.errors import ConfigError
from kvbridge.ops.format import FP8_DTYPE, PackedFormat
from kvbridge.runtime.device import OpsQueue
from kvbridge.transports.base import DescTable
from kvbridge.wire.messages import StagingInfo

if TYPE_CHECKING:
    import torch

    from kvbridge import ops
    from kvbridge.transports.common import TransportBase

_FLOAT_CACHES = ("float16", "bfloat16", "float32")


def slot_format(geometry: CacheGeometry, fp8: bool = True) -> PackedFormat:
    """The format of one slot: one block of one layer, FP8 with scales (``fp8``) or
    the cache's values."""
    s = geometry.spec
    dtype = FP8_DTYPE if fp8 else s.dtype
    # a latent (MLA) cache packs as two planes, each one head of half the vector (kv_planes)
    heads, dim = (1, s.head_dim // 2) if s.layout == "latent" else (s.num_kv_heads, s.head_dim)
    return PackedFormat(
        num_tokens=s.block_size,
        num_heads=heads,
        head_dim=dim,
        dtype=dtype,
        scaled=fp8,
        chunk_tokens=s.block_size,
    )


def staging_descs(info: StagingInfo, chunk_bytes: int | None = None) -> np.ndarray:
    """``(N, 3)`` descriptor table of a staging buffer (ours or a peer's): its slots, or
    the buffer cut into pieces of ``chunk_bytes`` (a multiple of 16)."""
    size = info.slot_bytes if chunk_bytes is None else chunk_bytes
    n = info.num_slots * info.slot_bytes // size
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, 0] = np.uint64(info.base) + np.arange(n, dtype=np.uint64) * np.uint64(size)
    table[:, 1] = size
    table[:, 2] = info.device
    return table


class Run(NamedTuple):
    """Staging reserved for ``n`` chunks of one size: chunk ``first`` onwards in the
    buffer cut into such chunks (:meth:`PackedPath.table_for`), inside slots ``[slot,
    slot + slots)``, which :meth:`PackedPath.release` gives back."""

    first: int
    slot: int
    slots: int


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
        fp8: quantize to float8 e4m3 with scales (``wire_dtype: fp8``); False: move
            the cache's values unchanged.
        timeout_s: the longest a pack or unpack waits for the GPU
            (``timeouts.transfer_s``).
    """

    def __init__(
        self,
        geometry: CacheGeometry,
        planes: Sequence[tuple[torch.Tensor, torch.Tensor]],
        staging_mb: int,
        transport: TransportBase,
        fp8: bool = True,
        timeout_s: float = 30.0,
    ) -> None:
        import torch

        from kvbridge import ops

        spec = geometry.spec
        if fp8 and spec.dtype not in _FLOAT_CACHES:
            raise ConfigError(
                "wire_dtype 'fp8' packs float16, bfloat16 or float32 caches; this cache is "
                f"{spec.dtype}",
                key="wire_dtype",
                fix="use wire_dtype 'exact' (a float8 cache is already as small)",
            )
        if spec.layout == "latent" and spec.head_dim % 2:
            raise ConfigError(
                "the packed data path packs a latent (MLA) cache as the two halves of each "
                f"vector; this one has {spec.head_dim} values",
                key="wire_dtype" if fp8 else "data_path",
                fix="use wire_dtype 'exact' and data_path 'direct' for this model",
            )
        if len(planes) != spec.num_layers:
            raise ValueError(
                f"{len(planes)} layers of cache planes for a {spec.num_layers}-layer cache"
            )
        self.geometry = geometry
        self.planes = list(planes)
        self.kv = ops.PagedKV(self.planes)  # checked once here, not on every call
        self.block_size = spec.block_size
        self.fp8 = fp8
        self.slot = slot_format(geometry, fp8)
        num_slots = (staging_mb << 20) // self.slot.nbytes
        if num_slots < spec.num_layers:
            raise ConfigError(
                f"staging_mb {staging_mb} holds {num_slots} packed blocks, fewer than one block "
                "per layer",
                key="staging_mb",
                fix="raise staging_mb",
            )
        device = self.planes[0][0].device
        self.queue = OpsQueue(device, timeout_s)
        raw = torch.empty(num_slots * self.slot.nbytes + 64, dtype=torch.uint8, device=device)
        skip = (-raw.data_ptr()) % 64
        self._raw = raw
        self.buffer = raw[skip : skip + num_slots * self.slot.nbytes]
        self.allocator = SlotAllocator(num_slots)
        memory = "host" if device.type == "cpu" else "device"
        dev = 0 if memory == "host" else (device.index or 0)
        self.info = StagingInfo(
            base=self.buffer.data_ptr(),
            num_slots=num_slots,
            slot_bytes=self.slot.nbytes,
            memory=memory,
            device=dev,
        )
        self._registration = transport.register(
            [(self.info.base, num_slots * self.slot.nbytes)], memory=memory, device=dev
        )
        self.table: DescTable = transport.prepare(staging_descs(self.info), memory=memory)
        self._transport = transport
        self._tables: dict[int, DescTable] = {}
        self._tables_lock = threading.Lock()

    def view(self, first: int, n: int) -> torch.Tensor:
        """Bytes of slots ``[first, first + n)``."""
        return self._chunks(self.slot, first, n)

    # --- chunks: blocks of some of the heads (a peer with another TP split) -------------

    def chunk(self, heads: int) -> PackedFormat:
        """One block of one layer of ``heads`` of our KV heads, packed (all of them: a
        slot)."""
        return self.slot if heads == self.slot.num_heads else self.slot._replace(num_heads=heads)

    def table_for(self, heads: int) -> DescTable:
        """The buffer cut into chunks of ``heads`` heads (all: :attr:`table`), prepared on
        first use and kept."""
        if heads == self.slot.num_heads:
            return self.table
        with self._tables_lock:  # held while preparing: each table is prepared once
            table = self._tables.get(heads)
            if table is None:
                descs = staging_descs(self.info, self.chunk(heads).nbytes)
                table = self._tables[heads] = self._transport.prepare(
                    descs, memory=self.info.memory
                )
        return table

    def slots_for(self, n: int, heads: int) -> int:
        """Slots a run of ``n`` chunks of ``heads`` heads takes."""
        size = self.chunk(heads).nbytes
        if size == self.slot.nbytes:
            return n
        # the run's first chunk starts at the first chunk boundary inside its first slot
        return -(-((n + 1) * size) // self.slot.nbytes)

    def reserve(self, n: int, heads: int) -> Run | None:
        """Staging for ``n`` chunks of ``heads`` heads, or None while the buffer is too
        full. Give it back with :meth:`release`, exactly once."""
        slots = self.slots_for(n, heads)
        slot = self.allocator.alloc(slots)
        if slot is None:
            return None
        size = self.chunk(heads).nbytes
        return Run(first=-(-(slot * self.slot.nbytes) // size), slot=slot, slots=slots)

    def release(self, run: Run) -> None:
        self.allocator.free(run.slot, run.slots)

    def _chunks(self, fmt: PackedFormat, first: int, n: int) -> torch.Tensor:
        """Bytes of chunks ``[first, first + n)`` of format ``fmt`` (slots: :attr:`slot`)."""
        return self.buffer[first * fmt.nbytes : (first + n) * fmt.nbytes]

    # --- pack / unpack -------------------------------------------------------------------

    @property
    def mixes_tokens(self) -> bool:
        """True when a packed row of a block may hold values of several tokens (the
        ``fused`` layout: vLLM's CPU kernel keeps a block's keys dim-major), so a
        row's FP8 scale covers the block's unused token positions too (exact packing
        has no scales: False)."""
        return self.fp8 and self.geometry.spec.layout == "fused"

    def clear(self, block_id: int) -> None:
        """Zero block ``block_id`` in every layer. The sender clears a prompt's partial
        last block before the engine first writes it, where :attr:`mixes_tokens`: its
        unused positions would otherwise hold stale KV of an earlier request, which
        would enter the FP8 scales of the prompt's own values (more error, and an
        output that depends on the block's history). Engine thread, before the forward
        pass that writes the block; one block per request."""
        for k, v in self.planes:
            k[block_id].zero_()
            v[block_id].zero_()

    def sibling(self, planes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ops.PagedKV:
        """Another pool of this worker whose blocks pack into the same slots: its rows
        have this cache's block size, KV heads, head dim, dtype and device (SGLang's
        sliding-window sub-pool beside its full-attention one). Pass the result as
        ``kv`` to :meth:`pack` and :meth:`unpack`. Called once, when the pool is
        registered; the engine owns the planes, as it does :attr:`planes`.

        Raises:
            ConfigError: the pool's blocks differ (naming the direct path as the fix).
        """
        from kvbridge import ops

        mine, theirs = self.planes[0][0], planes[0][0] if planes else None
        if theirs is None or (theirs.shape[1:], theirs.dtype, theirs.device) != (
            mine.shape[1:],
            mine.dtype,
            mine.device,
        ):
            raise ConfigError(
                "the packed data path packs a second pool of this cache only when its blocks "
                f"hold the same rows as the first ({tuple(mine.shape[1:])}, {mine.dtype}); this "
                f"one has {None if theirs is None else (tuple(theirs.shape[1:]), theirs.dtype)}",
                key="wire_dtype" if self.fp8 else "data_path",
                fix="leave wire_dtype and data_path at their defaults (the direct path) for this "
                "model",
            )
        return ops.PagedKV(list(planes))

    def pack(
        self,
        layers: Sequence[int],
        block_ids: Sequence[int],
        first: int,
        heads: tuple[int, int] | None = None,
        kv: ops.PagedKV | None = None,
    ) -> None:
        """Pack the whole ``block_ids`` of each of ``layers`` into chunks from ``first``:
        layer ``layers[i]``'s block ``j`` in chunk ``first + i * len(block_ids) + j``.
        ``heads``: our KV heads ``(start, end)`` to pack (default all; chunks are then
        slots). Returns once the bytes are in place.

        Whole blocks, like the exact path: the order of tokens inside a block is the
        attention kernel's business (vLLM's CPU kernel keeps a block's keys dim-major),
        so a block is moved as ``block_size`` opaque rows per head and plane, whatever
        they hold; only a row's ``head_dim`` values must be contiguous. ``kv``: the
        pool to read (default this cache; another from :meth:`sibling`)."""
        n = len(block_ids)
        fmt = self.chunk(self.slot.num_heads if heads is None else heads[1] - heads[0])
        out = self._chunks(fmt, first, len(layers) * n)
        kv = self.kv if kv is None else kv
        self.queue.run(
            lambda: kv.pack(
                block_ids,
                n * self.block_size,
                layers=layers,
                heads=heads,
                fp8=self.fp8,
                chunk_tokens=self.block_size,
                out=out,
            ),
            f"packing {n} blocks of layers {list(layers)}",
        )

    def unpack(
        self,
        layer: int,
        block_ids: Sequence[int],
        first: int,
        heads: tuple[int, int] | None = None,
        kv: ops.PagedKV | None = None,
    ) -> None:
        """Unpack chunks ``[first, first + len(block_ids))`` of one layer into the whole
        ``block_ids`` of this cache (or of ``kv``, from :meth:`sibling`), into our KV
        heads ``heads`` (default all). Returns once the cache holds them."""
        h0, h1 = (0, self.slot.num_heads) if heads is None else heads
        chunk = self.chunk(h1 - h0)
        fmt = chunk._replace(num_tokens=len(block_ids) * self.block_size)
        region = self._chunks(chunk, first, len(block_ids))
        kv = self.kv if kv is None else kv
        self.queue.run(
            lambda: kv.unpack(region, fmt, block_ids, layers=(layer,), head_start=h0),
            f"unpacking {len(block_ids)} blocks of layer {layer}",
        )


__all__ = ["PackedPath", "Run", "SlotAllocator", "slot_format", "staging_descs"]
