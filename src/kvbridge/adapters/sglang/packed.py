"""The packed path (``wire_dtype: fp8`` or ``data_path: packed``) for the SGLang backend:
SGLang's KV pool as typed planes, the packed slots of a room on both sides, and the decode's
reservations. No SGLang imports.

The direct path moves SGLang's pages as opaque bytes (:func:`.pools.kv_geometry`). The
packed path needs to read them as numbers, so it describes the same pool with its real
dtype, KV heads and head dim (:func:`typed_geometry`; the dtype and head dim come from
SGLang's model config, see :func:`.compat.kv_dtype_and_head_dim`) and views each layer's
K and V buffer as a torch tensor (:func:`pool_planes`; CPU pools only, like
:class:`~kvbridge.runtime.packed.PackedPath`, which does the staging buffer, the slot
allocator and the packing).

Chunks of a room: a decode rank receives a room's KV from one prefill rank, or, when
the prefill has more attention TP ranks, from several (SGLang's rank mapping), each
holding some of its KV heads; when the decode has more ranks, a prefill rank feeds
several decode ranks, each a part of its heads. Every (prefill rank, decode rank)
pairing moves one contiguous head range (:class:`Part`, :func:`room_part`, from
:mod:`kvbridge.core.tp`); both sides address their staging buffers as *chunks* of that
many heads (:meth:`~kvbridge.runtime.packed.PackedPath.table_for`; between equal TP
sizes a chunk is a slot: one page of one layer, all heads). The decode reserves a run
of ``sources * layers * pages`` chunks per room (:class:`RoomReservations`) and sends
its first chunk in its ``Destination``; source ``k``'s layer ``l`` page at position
``p`` of the room's page list goes to chunk ``first + (k * layers + l) * pages + p``
(:func:`room_slots`). A hybrid sliding-window pool adds to each part, after its
full-attention layers, its window layers over the room's window pages (SGLang's state
indices, :func:`window_start`), in the same chunk format: a server whose window layers'
rows differ from its full-attention layers' is refused when it starts. The prefill
packs what a post covers, for each destination its head range, into chunks of its own
buffer in the same layer-major order, and writes them there. The decode unpacks each
source's part into its heads when that source's ``Done`` arrives, before SGLang sees
the room as received (SGLang counts the sources).

A reservation ends exactly once: freed once every source's part is unpacked, or retired
when SGLang clears a room that never completed (failure, abort, timeout). A retired run
is held for ``hold_s`` (the prefill's transfer deadline: its writes into the run have
finished or been given up by then) before its chunks are reused.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvbridge.core.layout import DTYPE_SIZES, CacheGeometry, CacheSpec
from kvbridge.core.tp import check_pairing, head_slices, prefill_ranks
from kvbridge.errors import ConfigError, IncompatiblePeerError, PlanError

if TYPE_CHECKING:
    import torch

    from kvbridge.runtime.packed import PackedPath, Run


def typed_geometry(opaque: CacheGeometry, *, dtype: str, head_dim: int) -> CacheGeometry:
    """``opaque`` (pages as bytes) with the pool's element type: same addresses and
    pages, ``num_kv_heads`` from the row size; for an MLA pool (layout ``latent``) one
    head of the whole row, ``head_dim`` ignored. Raises :class:`ConfigError` when the
    page bytes do not split into whole heads of ``head_dim`` values of ``dtype``."""
    size = DTYPE_SIZES.get(dtype)
    row = opaque.spec.head_dim  # opaque spec: one "head" of page_bytes / page_size bytes
    latent = opaque.spec.layout == "latent"
    if latent and size:  # an MLA pool: one latent vector per token, whatever the model's head_dim
        head_dim = row // size
    if size is None or head_dim <= 0 or row % (head_dim * size):
        raise ConfigError(
            f"the packed data path: SGLang's KV pages hold {row} bytes per token, not whole heads "
            f"of {head_dim} {dtype} values",
            key="wire_dtype",
            fix=(
                "use wire_dtype 'exact' and data_path 'direct' for this model (a quantized or MLA "
                "KV cache is not packed)"
            ),
        )
    spec = CacheSpec(
        num_layers=opaque.spec.num_layers,
        block_size=opaque.spec.block_size,
        num_kv_heads=row // (head_dim * size),
        head_dim=head_dim,
        dtype=dtype,
        layout="latent" if latent else "nhd",
    )
    return CacheGeometry(
        spec=spec,
        num_blocks=opaque.num_blocks,
        plane_bases=opaque.plane_bases,
        memory=opaque.memory,
        device=opaque.device,
    )


def pool_planes(geometry: CacheGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, SGLang's K and V buffers as ``(pages, page_size, heads, head_dim)``
    tensors over the pool's own memory (no copy; host or GPU memory), or an MLA pool's
    latent buffer as its vectors' two halves (:func:`kvbridge.ops.kv_planes`). The pool
    outlives them: SGLang keeps it for the life of the scheduler, as it does the
    manager."""
    import torch

    from kvbridge import ops

    s = geometry.spec
    nbytes = geometry.num_blocks * s.block_bytes
    dtype = getattr(torch, s.dtype)

    def view(base: int) -> torch.Tensor:
        if geometry.memory == "host":
            raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(base), dtype=torch.uint8)
        else:
            raw = ops.device_bytes(base, nbytes, geometry.device)
        return raw.view(dtype).view(-1, s.num_kv_heads, s.head_dim)

    bases = geometry.plane_bases
    if s.layout == "latent":  # one buffer per layer
        return [
            ops.kv_planes(view(bases[layer]), "latent", block_size=s.block_size)
            for layer in range(s.num_layers)
        ]
    return [
        ops.kv_planes(
            (view(bases[2 * layer]), view(bases[2 * layer + 1])), "nhd", block_size=s.block_size
        )
        for layer in range(s.num_layers)
    ]


class Part(NamedTuple):
    """What one prefill rank moves to one decode rank of a room on the packed path."""

    index: int
    """This prefill rank's place among the decode rank's sources (the order of
    :func:`kvbridge.core.tp.prefill_ranks`): its part of the room's run."""
    sources: int
    """Prefill ranks feeding the decode rank (1 unless the prefill has more TP ranks)."""
    heads: int
    """KV heads moved, the chunk size of the pairing."""
    p_heads: tuple[int, int]
    """The prefill rank's heads ``[first, end)``, its own numbering."""
    d_heads: tuple[int, int]
    """The decode rank's heads ``[first, end)`` they become."""


def latent_sources(p_tp: int, d_tp: int, d_rank: int) -> range:
    """The prefill ranks that may feed decode rank ``d_rank`` an MLA pool (``latent``:
    every rank holds the whole latent cache), following SGLang's receiver, which maps
    MLA ranks itself (``CommonKVReceiver``, 0.5.23): a decode rank of at least as many
    reads from prefill rank ``d_rank // (d_tp / p_tp)``; one of fewer ranks connects to
    the ``p_tp / d_tp`` ranks ``[d_rank * k, (d_rank + 1) * k)``, sends the first a real
    destination and the others dummy ones. Each of that range pairs (as the whole
    cache, part 0 of 1); the destination's dummy flag says which one writes.

    Raises:
        IncompatiblePeerError: neither TP size is a multiple of the other.

    >>> latent_sources(1, 2, 1), latent_sources(4, 2, 1)
    (range(0, 1), range(2, 4))
    """
    check_pairing(1, p_tp, d_tp, idle=True)
    if p_tp <= d_tp:
        source = d_rank // (d_tp // p_tp)
        return range(source, source + 1)
    k = p_tp // d_tp
    return range(d_rank * k, (d_rank + 1) * k)


_WHOLE_LATENT = Part(index=0, sources=1, heads=1, p_heads=(0, 1), d_heads=(0, 1))


def room_part(
    total: int, p_tp: int, d_tp: int, p_rank: int, d_rank: int, *, latent: bool = False
) -> Part | None:
    """The pairing of prefill rank ``p_rank`` (of ``p_tp``) and decode rank ``d_rank``
    (of ``d_tp``) for a model of ``total`` KV heads, or an MLA pool (``latent``, see
    :func:`latent_sources`); None when they exchange nothing. Both sides compute it
    alike.

    Raises:
        IncompatiblePeerError: the TP sizes do not pair (naming the fix).

    >>> room_part(4, 1, 2, 0, 1)
    Part(index=0, sources=1, heads=2, p_heads=(2, 4), d_heads=(0, 2))
    >>> room_part(4, 2, 1, 1, 0)
    Part(index=1, sources=2, heads=2, p_heads=(0, 2), d_heads=(2, 4))
    """
    if latent:
        return _WHOLE_LATENT if p_rank in latent_sources(p_tp, d_tp, d_rank) else None
    check_pairing(total, p_tp, d_tp)
    mine = [s for s in head_slices(total, p_tp, d_tp) if (s.p_rank, s.d_rank) == (p_rank, d_rank)]
    if not mine:
        return None
    if len(mine) != 1:  # cannot happen when one size is a multiple of the other
        raise IncompatiblePeerError(
            f"prefill rank {p_rank} of TP {p_tp} and decode rank {d_rank} of TP {d_tp} share "
            f"{len(mine)} head ranges"
        )
    s = mine[0]
    sources = prefill_ranks(total, p_tp, d_tp, d_rank)
    return Part(
        sources.index(p_rank),
        len(sources),
        s.count,
        (s.p_first, s.p_first + s.count),
        (s.d_first, s.d_first + s.count),
    )


def decode_parts(
    total: int, p_tp: int, d_tp: int, d_rank: int, *, latent: bool = False
) -> tuple[Part, ...]:
    """Every source's part of decode rank ``d_rank``'s rooms, in source order (an MLA
    pool: the whole cache from one source). Raises
    :class:`~kvbridge.errors.IncompatiblePeerError` like :func:`room_part`.

    >>> [(p.index, p.heads, p.d_heads) for p in decode_parts(4, 2, 1, 0)]
    [(0, 2, (0, 2)), (1, 2, (2, 4))]
    """
    if latent:
        latent_sources(p_tp, d_tp, d_rank)  # the sizes pair
        return (_WHOLE_LATENT,)
    check_pairing(total, p_tp, d_tp)
    parts = tuple(
        room_part(total, p_tp, d_tp, p, d_rank) for p in prefill_ranks(total, p_tp, d_tp, d_rank)
    )
    if len({p.heads for p in parts}) != 1:  # cannot happen when one size is a multiple of the other
        raise IncompatiblePeerError(
            f"decode rank {d_rank} of TP {d_tp} takes unequal head ranges from prefill TP {p_tp}"
        )
    return parts  # type: ignore[return-value]


def part_start(first: int, index: int, num_layers: int, pages: int, window: int = 0) -> int:
    """The first chunk of source ``index``'s part of a room run starting at chunk
    ``first`` (``num_layers * pages + window`` chunks per part; ``window``: a
    sliding-window pool's chunks of the part, :func:`window_start`): where the prefill
    writes and the decode unpacks, so both sides use this one rule.

    >>> part_start(100, 1, 2, 4)
    108
    >>> part_start(100, 1, 2, 4, window=6)
    114
    """
    return first + index * (num_layers * pages + window)


def window_chunks(window_layers: int, window_pages: np.ndarray | None) -> int:
    """The chunks of a part of a room run that hold a sliding-window pool's
    ``window_layers`` over the room's ``window_pages`` (None, or no window layers: 0):
    the ``window`` of :func:`part_start`, counted by both sides with this one rule.

    >>> window_chunks(2, np.array([7, 9, 4])), window_chunks(2, None)
    (6, 0)
    """
    return 0 if window_pages is None else window_layers * int(window_pages.size)


def window_start(part_first: int, num_layers: int, pages: int) -> int:
    """The first chunk of a part's sliding-window layers (a hybrid sliding-window pool,
    packed path): they follow the part's full-attention layers, layer-major over the
    room's window pages (:func:`room_slots` with the window's page count).

    >>> window_start(114, 2, 4)
    122
    """
    return part_first + num_layers * pages


def room_slots(first: int, pages: int, layers: Sequence[int], positions: np.ndarray) -> np.ndarray:
    """The decode staging chunks of ``layers`` x ``positions`` of a room part whose
    chunks start at ``first`` and span ``pages`` pages per layer, layer-major (the order
    :meth:`~kvbridge.runtime.packed.PackedPath.pack` fills).

    >>> room_slots(100, 4, [0, 2], np.array([1, 2])).tolist()
    [101, 102, 109, 110]
    """
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= pages):
        raise PlanError(f"positions {positions.tolist()} outside the room's {pages} pages")
    return (
        first + np.asarray(layers, dtype=np.int64)[:, None] * pages + positions[None, :]
    ).reshape(-1)


class Reservation(NamedTuple):
    run: Run
    """The room's chunks in the decode's staging buffer."""
    pages: np.ndarray
    """The room's decode page ids (its ``Destination``), position order."""
    parts: tuple[Part, ...]
    """One per source, in source order (:func:`decode_parts`)."""
    window_pages: np.ndarray | None = None
    """A sliding-window pool: the room's window page ids (its ``Destination``'s
    ``window_pages``), position order; None for other pools."""
    window_layers: int = 0
    """The pool's sliding-window layers (0: none)."""

    @property
    def first(self) -> int:
        """The run's first chunk (of ``parts[0].heads`` heads): what the
        ``Destination`` names."""
        return self.run.first

    @property
    def window_chunks(self) -> int:
        """Chunks of a part's sliding-window layers."""
        return window_chunks(self.window_layers, self.window_pages)

    def part_first(self, index: int, num_layers: int) -> int:
        """The first chunk of source ``index``'s part."""
        return part_start(
            self.run.first, index, num_layers, int(self.pages.size), self.window_chunks
        )


class RoomReservations:
    """The decode's staging runs, one per room in flight. Thread-safe.

    Who calls: the scheduler thread reserves before it sends a room's destination
    (:meth:`reserve`; a room that finds no free run waits, retried from SGLang's polls)
    and retires a room SGLang clears (:meth:`retire`); the notification thread marks a
    source's part arrived (:meth:`arrive`), unpacks it, frees the run after the last
    part (:meth:`free`), and reaps retired runs (:meth:`reap`).

    Args:
        packed: the decode's staging buffer (its chunk runs: ``reserve``, ``release``,
            ``slots_for``).
        num_layers: layers of the pool (a sliding-window pool: its full-attention
            layers).
        hold_s: how long a retired run is held before its chunks are reused.
        window_layers: a sliding-window pool's window layers (0: none); each part of a
            room then also holds their chunks of the room's window pages.
    """

    def __init__(
        self, packed: PackedPath, *, num_layers: int, hold_s: float, window_layers: int = 0
    ) -> None:
        self.packed = packed
        self.num_layers = num_layers
        self.window_layers = window_layers
        self.hold_s = hold_s
        self._rooms: dict[int, Reservation] = {}
        self._arrived: dict[int, set[int]] = {}
        self._retired: list[tuple[float, Run]] = []  # (free at, run)
        self._lock = threading.Lock()

    def _chunks(self, pages: int, parts: Sequence[Part], window_pages: int = 0) -> int:
        return len(parts) * (self.num_layers * pages + self.window_layers * window_pages)

    def fits(self, pages: int, parts: Sequence[Part], window_pages: int = 0) -> bool:
        """Whether a room of ``pages`` pages (and ``window_pages`` sliding-window pages)
        fits the buffer at all (an empty one)."""
        return (
            self.packed.slots_for(self._chunks(pages, parts, window_pages), parts[0].heads)
            <= self.packed.allocator.num_slots
        )

    def reserve(
        self,
        room: int,
        pages: np.ndarray,
        parts: Sequence[Part],
        window_pages: np.ndarray | None = None,
    ) -> Reservation | None:
        """A run for ``room``'s pages (all layers, every source's part; with a
        sliding-window pool its ``window_pages`` of the window layers too), or None when
        no run is free."""
        if pages.size == 0:
            raise PlanError(f"room {room}: no pages to reserve staging for")
        if (window_pages is None) != (self.window_layers == 0):
            raise PlanError(
                f"room {room}: {'no' if window_pages is None else 'some'} sliding-window pages "
                f"for a pool of {self.window_layers} window layers"
            )
        if window_pages is not None:
            window_pages = np.asarray(window_pages, dtype=np.int64)
        n = self._chunks(int(pages.size), parts, 0 if window_pages is None else window_pages.size)
        run = self.packed.reserve(n, parts[0].heads)
        if run is None:
            return None
        res = Reservation(
            run,
            np.asarray(pages, dtype=np.int64),
            tuple(parts),
            window_pages,
            self.window_layers,
        )
        with self._lock:
            old = self._rooms.pop(room, None)
            self._arrived.pop(room, None)
            self._rooms[room] = res
        if old is not None:  # a room id reused before its first run ended: hold that one
            self._hold(old, time.monotonic())
        return res

    def get(self, room: int) -> Reservation | None:
        """The room's run, still owned by the reservations; None if it has none."""
        with self._lock:
            return self._rooms.get(room)

    def arrive(self, room: int, index: int) -> tuple[Reservation | None, bool]:
        """Source ``index``'s part of ``room`` has landed: ``(reservation, last)``. After
        the last part the caller owns the run (:meth:`free` it); before, the
        reservations still do. ``(None, False)``: the room has no run, or no such part,
        or that part arrived already."""
        with self._lock:
            res = self._rooms.get(room)
            if res is None or not 0 <= index < len(res.parts):
                return None, False
            arrived = self._arrived.setdefault(room, set())
            if index in arrived:
                return None, False
            arrived.add(index)
            if len(arrived) < len(res.parts):
                return res, False
            del self._rooms[room], self._arrived[room]
            return res, True

    def free(self, res: Reservation) -> None:
        self.packed.release(res.run)

    def retire(self, room: int, now: float | None = None) -> None:
        """SGLang cleared ``room``: a run it still has is held for ``hold_s``, then reused."""
        with self._lock:
            res = self._rooms.pop(room, None)
            self._arrived.pop(room, None)
        if res is not None:
            self._hold(res, time.monotonic() if now is None else now)

    def _hold(self, res: Reservation, now: float) -> None:
        with self._lock:
            self._retired.append((now + self.hold_s, res.run))

    def reap(self, now: float | None = None) -> int:
        """Free the retired runs whose hold is over; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [r for r in self._retired if r[0] <= now]
            self._retired = [r for r in self._retired if r[0] > now]
        for _, run in due:
            self.packed.release(run)
        return len(due)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)


__all__ = [
    "Part",
    "Reservation",
    "RoomReservations",
    "decode_parts",
    "latent_sources",
    "part_start",
    "pool_planes",
    "room_part",
    "room_slots",
    "typed_geometry",
    "window_chunks",
    "window_start",
]
