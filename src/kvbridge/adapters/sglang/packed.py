"""The packed path (``wire_dtype: fp8`` or ``data_path: packed``) for the SGLang backend: SGLang's KV pool as typed planes, the
packed slots of a room on both sides, and the decode's reservations. No SGLang imports.

The direct path moves SGLang's pages as opaque bytes (:func:`.layout.kv_geometry`). The
packed path needs to read them as numbers, so it describes the same pool with its real
dtype, KV heads and head dim (:func:`typed_geometry`; the dtype and head dim come from
SGLang's model config, see :func:`.compat.kv_dtype_and_head_dim`) and views each layer's
K and V buffer as a torch tensor (:func:`pool_planes`; CPU pools only, like
:class:`~kvbridge.runtime.packed.PackedPath`, which does the staging buffer, the slot
allocator and the packing).

Slots of a room: the decode reserves ``layers * pages`` contiguous staging slots per
room (:class:`RoomReservations`) and sends the first one in its ``Destination``; layer
``l``'s page at position ``p`` of the room's page list goes to slot ``first + l * pages +
p`` (:func:`room_slots`). The prefill packs what a post covers into slots of its own
buffer, in the same layer-major order, and writes them there. The decode unpacks a room
when its ``Done`` arrives, before SGLang sees the room as received.

A reservation ends exactly once: unpacked (``Done``), or retired when SGLang clears a
room that never completed (failure, abort, timeout). A retired run is held for
``hold_s`` (the prefill's transfer deadline: its writes into the run have finished or
been given up by then) before its slots are reused.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvbridge.core.layout import DTYPE_SIZES, CacheGeometry, CacheSpec
from kvbridge.errors import ConfigError, PlanError

if TYPE_CHECKING:
    import torch

    from kvbridge.runtime.packed import SlotAllocator


def typed_geometry(opaque: CacheGeometry, *, dtype: str, head_dim: int) -> CacheGeometry:
    """``opaque`` (pages as bytes) with the pool's element type: same addresses and
    pages, ``num_kv_heads`` from the row size. Raises :class:`ConfigError` when the page
    bytes do not split into whole heads of ``head_dim`` values of ``dtype``."""
    size = DTYPE_SIZES.get(dtype)
    row = opaque.spec.head_dim  # opaque spec: one "head" of page_bytes / page_size bytes
    if size is None or head_dim <= 0 or row % (head_dim * size):
        raise ConfigError(
            f"the packed data path: SGLang's KV pages hold {row} bytes per token, not whole heads of "
            f"{head_dim} {dtype} values",
            key="wire_dtype",
            fix="use wire_dtype 'exact' and data_path 'direct' for this model (a quantized or MLA KV cache is not packed)",
        )
    spec = CacheSpec(
        num_layers=opaque.spec.num_layers,
        block_size=opaque.spec.block_size,
        num_kv_heads=row // (head_dim * size),
        head_dim=head_dim,
        dtype=dtype,
        layout="nhd",
    )
    return CacheGeometry(spec=spec, num_blocks=opaque.num_blocks, plane_bases=opaque.plane_bases, memory=opaque.memory, device=opaque.device)


def pool_planes(geometry: CacheGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, SGLang's K and V buffers as ``(pages, page_size, heads, head_dim)``
    tensors over the pool's own memory (no copy; host memory only). The pool outlives
    them: SGLang keeps it for the life of the scheduler, as it does the manager."""
    import torch

    from kvbridge import ops

    if geometry.memory != "host":
        raise ConfigError(
            "the packed data path (wire_dtype 'fp8', data_path 'packed') with SGLang packs CPU KV pools only for now",
            key="wire_dtype",
            fix="use wire_dtype 'exact' and data_path 'direct' on GPU servers",
        )
    s = geometry.spec
    nbytes = geometry.num_blocks * s.block_bytes
    dtype = getattr(torch, s.dtype)

    def view(base: int) -> torch.Tensor:
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(base), dtype=torch.uint8)
        return raw.view(dtype).view(-1, s.num_kv_heads, s.head_dim)

    bases = geometry.plane_bases
    return [ops.kv_planes((view(bases[2 * l]), view(bases[2 * l + 1])), "nhd", block_size=s.block_size) for l in range(s.num_layers)]


def room_slots(first: int, pages: int, layers: Sequence[int], positions: np.ndarray) -> np.ndarray:
    """The decode staging slots of ``layers`` x ``positions`` of a room whose run starts
    at ``first`` and spans ``pages`` pages per layer, layer-major (the order
    :meth:`~kvbridge.runtime.packed.PackedPath.pack` fills).

    >>> room_slots(100, 4, [0, 2], np.array([1, 2])).tolist()
    [101, 102, 109, 110]
    """
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= pages):
        raise PlanError(f"positions {positions.tolist()} outside the room's {pages} pages")
    return (first + np.asarray(layers, dtype=np.int64)[:, None] * pages + positions[None, :]).reshape(-1)


class Reservation(NamedTuple):
    first: int
    pages: np.ndarray
    """The room's decode page ids (its ``Destination``), position order."""
    count: int
    """Slots in the run: ``layers * pages``."""


class RoomReservations:
    """The decode's staging runs, one per room in flight. Thread-safe.

    Who calls: the scheduler thread reserves before it sends a room's destination
    (:meth:`reserve`; a room that finds no free run waits, retried from SGLang's polls)
    and retires a room SGLang clears (:meth:`retire`); the notification
    thread takes a room whose ``Done`` arrived (:meth:`take`), unpacks it and frees it
    (:meth:`free`), and reaps retired runs (:meth:`reap`).

    >>> from kvbridge.runtime.packed import SlotAllocator
    >>> r = RoomReservations(SlotAllocator(8), num_layers=2, hold_s=5.0)
    >>> r.reserve(1, np.array([7, 9])).first, r.reserve(2, np.array([3, 4, 5]))
    (0, None)
    >>> r.retire(1, now=0.0); r.reap(now=4.0), r.reap(now=6.0)
    (0, 1)
    >>> r.reserve(2, np.array([3, 4, 5])).first
    0
    """

    def __init__(self, allocator: SlotAllocator, *, num_layers: int, hold_s: float) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self.hold_s = hold_s
        self._rooms: dict[int, Reservation] = {}
        self._retired: list[tuple[float, int, int]] = []  # (free at, first, count)
        self._lock = threading.Lock()

    def fits(self, pages: int) -> bool:
        """Whether a room of ``pages`` pages fits the buffer at all (an empty one)."""
        return self.num_layers * pages <= self.allocator.num_slots

    def reserve(self, room: int, pages: np.ndarray) -> Reservation | None:
        """A run for ``room``'s pages (all layers), or None when no run is free."""
        if pages.size == 0:
            raise PlanError(f"room {room}: no pages to reserve staging for")
        count = self.num_layers * int(pages.size)
        first = self.allocator.alloc(count)
        if first is None:
            return None
        res = Reservation(first, np.asarray(pages, dtype=np.int64), count)
        with self._lock:
            old = self._rooms.pop(room, None)
            self._rooms[room] = res
        if old is not None:  # a room id reused before its first run ended: hold that one
            self._hold(old, time.monotonic())
        return res

    def get(self, room: int) -> Reservation | None:
        """The room's run, still owned by the reservations; None if it has none."""
        with self._lock:
            return self._rooms.get(room)

    def take(self, room: int) -> Reservation | None:
        """The room's run, now owned by the caller (:meth:`free` it); None if it has none."""
        with self._lock:
            return self._rooms.pop(room, None)

    def free(self, res: Reservation) -> None:
        self.allocator.free(res.first, res.count)

    def retire(self, room: int, now: float | None = None) -> None:
        """SGLang cleared ``room``: a run it still has is held for ``hold_s``, then reused."""
        with self._lock:
            res = self._rooms.pop(room, None)
        if res is not None:
            self._hold(res, time.monotonic() if now is None else now)

    def _hold(self, res: Reservation, now: float) -> None:
        with self._lock:
            self._retired.append((now + self.hold_s, res.first, res.count))

    def reap(self, now: float | None = None) -> int:
        """Free the retired runs whose hold is over; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [r for r in self._retired if r[0] <= now]
            self._retired = [r for r in self._retired if r[0] > now]
        for _, first, count in due:
            self.allocator.free(first, count)
        return len(due)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)


__all__ = ["Reservation", "RoomReservations", "pool_planes", "room_slots", "typed_geometry"]
