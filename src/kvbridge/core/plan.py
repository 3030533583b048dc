"""Transfer plans: which bytes go where, as descriptor lists. Pure; no I/O.

A plan pairs slots (see :mod:`kvbridge.core.layout`) of a local cache with slots of a
remote cache, position by position. Transports consume it two ways:

- as slot indices into descriptor tables prepared once per cache (NIXL's
  ``prep_xfer_dlist`` + ``make_prepped_xfer``), where the backend merges adjacent
  descriptors itself;
- as coalesced ``(src, dst, length)`` regions (:func:`coalesce`), where runs of blocks
  that are adjacent on both sides become one region (Mooncake, and any backend that
  pays per descriptor).

Who calls: the engine adapters' worker side, once per (request, layer) for layer-wise
streaming or once per request otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from kvbridge.core.blocks import NONE, BlockTable
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.tp import Split
from kvbridge.errors import PlanError


class TransferPlan(NamedTuple):
    """Position-wise paired slot indices; ``local_slots[i]`` moves to/from
    ``remote_slots[i]``. Both are int32 (NIXL's index type), ordered layer-major, so
    the slots of ``layers[k]`` are the k-th of ``len(layers)`` equal slices."""

    local_slots: np.ndarray
    remote_slots: np.ndarray
    slot_bytes: int
    layers: tuple[int, ...]

    @property
    def num_descriptors(self) -> int:
        return int(self.local_slots.size)

    @property
    def nbytes(self) -> int:
        return self.num_descriptors * self.slot_bytes

    def for_layer(self, layer: int) -> TransferPlan:
        """The part of this plan that moves ``layer`` (views, no copy). Layer-wise
        streaming plans a request once and posts one slice per finished layer."""
        try:
            k = self.layers.index(layer)
        except ValueError:
            raise PlanError(
                f"layer {layer} is not part of this plan (layers {list(self.layers)})"
            ) from None
        per = self.num_descriptors // len(self.layers)
        part = slice(k * per, (k + 1) * per)
        return TransferPlan(
            self.local_slots[part], self.remote_slots[part], self.slot_bytes, (layer,)
        )


class Regions(NamedTuple):
    """Descriptor list as three equal-length uint64 arrays."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


def check_direct_compatible(local: CacheSpec, remote: CacheSpec) -> None:
    """Raise :class:`PlanError` unless blocks can be copied byte for byte."""
    if local != remote:
        diffs = [
            f"{f}: {getattr(local, f)!r} vs {getattr(remote, f)!r}"
            for f in local.__struct_fields__
            if getattr(local, f) != getattr(remote, f)
        ]
        raise PlanError("caches differ, a block-for-block copy is impossible: " + "; ".join(diffs))


def plan_blocks(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    layers: Iterable[int] | None = None,
) -> TransferPlan:
    """Pair ``local_blocks[i]`` with ``remote_blocks[i]`` in every plane of ``layers``.

    Raises:
        PlanError: the specs differ, the block lists differ in length, or a block id
            or layer is out of range for its cache.
    """
    check_direct_compatible(local.spec, remote.spec)
    lslots, rslots, layer_list = _paired_slots(local, remote, local_blocks, remote_blocks, layers)
    return TransferPlan(
        local_slots=lslots.astype(np.int32),
        remote_slots=rslots.astype(np.int32),
        slot_bytes=local.spec.block_bytes,
        layers=layer_list,
    )


def _paired_slots(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    layers: Iterable[int] | None,
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Slot indices of both block lists in ``layers`` (default all), position-matched."""
    if len(local_blocks) != len(remote_blocks):
        raise PlanError(
            f"block lists differ in length: {len(local_blocks)} local vs {len(remote_blocks)} "
            "remote"
        )
    layer_list = tuple(range(local.spec.num_layers)) if layers is None else tuple(layers)
    return (
        local.slots(local_blocks, layer_list),
        remote.slots(remote_blocks, layer_list),
        layer_list,
    )


def plan_parts(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    split: Split,
    layers: Iterable[int] | None = None,
) -> TransferPlan:
    """Like :func:`plan_blocks` between caches of different tensor-parallel splits:
    indices into :meth:`~kvbridge.core.layout.CacheGeometry.part_table` tables
    (``split.local_parts`` pieces per local slot, ``split.remote_parts`` per remote
    one), pairing the head ranges of ``split.runs`` in every block and plane.

    Raises:
        PlanError: the caches differ in more than their KV heads per rank, the block
            lists differ in length, or a block id or layer is out of range.
    """
    check_direct_compatible(
        local.spec, msgspec.structs.replace(remote.spec, num_kv_heads=local.spec.num_kv_heads)
    )
    lslots, rslots, layer_list = _paired_slots(local, remote, local_blocks, remote_blocks, layers)
    lpart = np.concatenate([np.arange(a, a + n) for a, _, n in split.runs])
    rpart = np.concatenate([np.arange(b, b + n) for _, b, n in split.runs])
    lidx = (lslots[:, None] * split.local_parts + lpart[None, :]).reshape(-1)
    ridx = (rslots[:, None] * split.remote_parts + rpart[None, :]).reshape(-1)
    return TransferPlan(
        local_slots=lidx.astype(np.int32),
        remote_slots=ridx.astype(np.int32),
        slot_bytes=local.spec.block_bytes // split.local_parts,
        layers=layer_list,
    )


class Cut:
    """The bytes of each block a rank and a peer rank of another tensor-parallel split
    exchange, per layer: ``(local offset, remote offset, length)`` segments. The node
    builds one per such peer of a model with state-space layers, whose states split by
    heads, groups and channels (:mod:`kvbridge.core.states`), not by equal head ranges
    (:meth:`~kvbridge.core.layout.CacheGeometry.part_table`). A request's blocks are
    then addressed segment by segment (:meth:`descs`), per transfer: a table of every
    segment of every block, prepared once, would hold ~10 descriptors per state block
    (a Mamba2 state with ``SD`` conv order) on each side of each pair.

    >>> cut = Cut((((0, 32, 16),), ((0, 0, 8), (64, 16, 8))))
    >>> cut.layer_bytes(1), cut.counts
    (16, [1, 2])
    """

    __slots__ = ("_counts", "_first", "_flat", "counts", "segments")

    def __init__(self, segments: Sequence[Sequence[tuple[int, int, int]]]) -> None:
        self.segments = tuple(
            tuple((int(a), int(b), int(n)) for a, b, n in layer) for layer in segments
        )
        self.counts = [len(layer) for layer in self.segments]
        """Segments per block, per layer: the same on both sides."""
        self._counts = np.asarray(self.counts, dtype=np.int64)
        self._flat = np.asarray(
            [seg for layer in self.segments for seg in layer], dtype=np.uint64
        ).reshape(-1, 3)
        self._first = np.concatenate([[0], np.cumsum(self._counts)[:-1]]).astype(np.int64)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cut) and other.segments == self.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        return f"Cut({self.segments!r})"

    def layer_bytes(self, layer: int) -> int:
        """Bytes of one block of ``layer`` that move (each plane)."""
        return sum(n for _, _, n in self.segments[layer])

    def check(self, geo: CacheGeometry, remote: bool) -> None:
        """Raise :class:`PlanError` unless every segment lies inside a block of ``geo``
        (our cache, or the peer's when ``remote``). Once per pair, at the handshake."""
        if len(self.segments) != geo.spec.num_layers:
            raise PlanError(
                f"a cut of {len(self.segments)} layers for a cache of {geo.spec.num_layers}"
            )
        side = 1 if remote else 0
        for layer in self.segments:
            if any(seg[side] + seg[2] > geo.stride or seg[2] <= 0 for seg in layer):
                raise PlanError(
                    f"a segment of {list(layer)} lies outside a block of {geo.stride} bytes"
                )

    def descs(self, geo: CacheGeometry, slots: np.ndarray, remote: bool = False) -> np.ndarray:
        """``(address, length, device)`` of every segment of each slot of ``geo`` (ours,
        or the peer's when ``remote``): slot by slot, segments in order, so the rows of
        both sides pair up position by position. Per transfer (once per layer and
        request when streaming); ``uint64`` ``(N, 3)``."""
        plane, block = np.divmod(np.asarray(slots, dtype=np.int64).reshape(-1), geo.num_blocks)
        layer = plane // geo.spec.planes_per_layer
        n = self._counts[layer]
        # every slot's segments first .. first + n - 1, concatenated
        rows = (
            np.repeat(self._first[layer], n)
            + np.arange(int(n.sum()))
            - np.repeat(np.cumsum(n) - n, n)
        )
        starts = np.asarray(geo.plane_bases, dtype=np.uint64)[plane] + block.astype(
            np.uint64
        ) * np.uint64(geo.stride)
        out = np.empty((rows.size, 3), dtype=np.uint64)
        out[:, 0] = np.repeat(starts, n) + self._flat[rows, 1 if remote else 0]
        out[:, 1] = self._flat[rows, 2]
        out[:, 2] = geo.device
        return out


def plan_cut(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    cut: Cut,
    layers: Iterable[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`plan_blocks` between caches cut by ``cut``: every segment of every
    block and plane paired, as descriptor rows (:meth:`Cut.descs`) of both sides.

    Raises:
        PlanError: the block lists differ in length, or a block id or layer is out of range.
    """
    lslots, rslots, _ = _paired_slots(local, remote, local_blocks, remote_blocks, layers)
    return cut.descs(local, lslots), cut.descs(remote, rslots, remote=True)


def layers_by_group(
    layer_groups: Sequence[int], layers: Sequence[int]
) -> list[tuple[int, list[int]]]:
    """``layers`` split by KV cache group: ``(group, its layers in the given order)`` per
    group, groups ascending (``layer_groups`` empty: all in group 0)."""
    of = list(layer_groups)
    by: dict[int, list[int]] = {}
    for layer in layers:
        by.setdefault(of[layer] if of else 0, []).append(layer)
    return sorted(by.items())


def held_positions(src: np.ndarray, dst: np.ndarray, group: int = 0) -> np.ndarray:
    """Positions of one KV cache group's block ids where the destination (``dst``) holds
    a block, as indices: what moves. The source must hold those too.

    Raises:
        PlanError: the destination holds a block where the source holds none (the
            source no longer has KV the destination expects).
    """
    lost = np.flatnonzero((src == NONE) & (dst != NONE))
    if lost.size:
        raise PlanError(
            f"KV cache group {group}: the destination expects position {int(lost[0])} of the "
            "request's blocks, "
            "which the source no longer holds (it left the source's sliding window)"
        )
    return np.flatnonzero(dst != NONE)


def plan_grouped(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: BlockTable,
    remote_blocks: BlockTable,
    layer_groups: Sequence[int],
    layers: Iterable[int] | None = None,
    *,
    split: Split | None = None,
    cut: Cut | None = None,
    into_local: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_blocks` (or, with ``split``, :func:`plan_parts`; with ``cut``,
    :func:`plan_cut`, which returns descriptor rows, not indices) for a request whose
    layers take their blocks from KV cache groups (:mod:`kvbridge.core.blocks`): layer
    ``l`` moves the blocks of group ``layer_groups[l]`` (empty: every layer group 0).
    A position the destination (``remote``, or ``local`` when ``into_local``) holds no
    block for in a group is left out for that group's layers: a sliding-window layer
    moves only its window. Returns the paired slot (or part) indices, int32, layer
    order within each group.

    >>> from kvbridge.core.layout import CacheSpec
    >>> spec = CacheSpec(
    ...     num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16", layout="fused"
    ... )
    >>> geo = CacheGeometry(spec=spec, num_blocks=10, plane_bases=(0x1000, 0x2000))
    >>> src = BlockTable.grouped([[1, 2, 3], [4, 5, 6]])
    >>> dst = BlockTable.grouped([[7, 8, 9], [NONE, NONE, 3]])    # layer 1 keeps its last block
    >>> lidx, ridx = plan_grouped(geo, geo, src, dst, layer_groups=(0, 1))
    >>> lidx.tolist(), ridx.tolist()
    ([1, 2, 3, 16], [7, 8, 9, 13])

    Raises:
        PlanError: a table's groups are not those of ``layer_groups``, the tables differ
            in length, or the destination holds a block where the source holds none
            (the source no longer has KV the destination expects).
    """
    groups = max(layer_groups, default=0) + 1
    if local_blocks.num_groups != groups or remote_blocks.num_groups != groups:
        raise PlanError(
            f"block tables of {local_blocks.num_groups} (local) and {remote_blocks.num_groups} "
            f"(remote) KV cache groups for a cache whose layers form {groups}"
        )
    if len(local_blocks) != len(remote_blocks):
        raise PlanError(
            f"block lists differ in length: {len(local_blocks)} local vs {len(remote_blocks)} "
            "remote"
        )
    layer_list = list(range(local.spec.num_layers)) if layers is None else list(layers)
    lparts, rparts = [], []
    for g, on in layers_by_group(layer_groups, layer_list):
        lrow, rrow = local_blocks.row(g), remote_blocks.row(g)
        keep = held_positions(rrow, lrow, g) if into_local else held_positions(lrow, rrow, g)
        if cut is not None:
            lidx, ridx = plan_cut(local, remote, lrow[keep], rrow[keep], cut, layers=on)
            lparts.append(lidx)
            rparts.append(ridx)
            continue
        if split is None:
            plan = plan_blocks(local, remote, lrow[keep], rrow[keep], layers=on)
        else:
            plan = plan_parts(local, remote, lrow[keep], rrow[keep], split, layers=on)
        lparts.append(plan.local_slots)
        rparts.append(plan.remote_slots)
    if not lparts:
        empty = (
            np.empty((0, 3), dtype=np.uint64) if cut is not None else np.empty(0, dtype=np.int32)
        )
        return empty, empty
    return np.concatenate(lparts), np.concatenate(rparts)


def plan_regions(plan: TransferPlan, local: CacheGeometry, remote: CacheGeometry) -> Regions:
    """The plan as coalesced (local -> remote) address regions."""
    lt = _addresses(local, plan.local_slots)
    rt = _addresses(remote, plan.remote_slots)
    lengths = np.full(lt.size, plan.slot_bytes, dtype=np.uint64)
    return coalesce(lt, rt, lengths)


def _addresses(geo: CacheGeometry, slots: np.ndarray) -> np.ndarray:
    plane, block = np.divmod(slots.astype(np.int64), geo.num_blocks)
    bases = np.asarray(geo.plane_bases, dtype=np.uint64)
    return bases[plane] + block.astype(np.uint64) * np.uint64(geo.stride)


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray, *, sort: bool = True) -> Regions:
    """Merge descriptors that are adjacent on both sides into one region.

    Order inside one transfer is irrelevant, so by default entries are first sorted by
    source address; pairs stay together. Zero-length entries are dropped.

    >>> src, dst = np.array([0, 16, 32, 96]), np.array([100, 116, 200, 216])
    >>> r = coalesce(src, dst, np.full(4, 16))
    >>> r.src.tolist(), r.dst.tolist(), r.length.tolist()
    ([0, 32, 96], [100, 200, 216], [32, 16, 16])
    """
    src = np.asarray(src, dtype=np.uint64).reshape(-1)
    dst = np.asarray(dst, dtype=np.uint64).reshape(-1)
    length = np.asarray(length, dtype=np.uint64).reshape(-1)
    if not (src.size == dst.size == length.size):
        raise PlanError(
            f"descriptor arrays differ in length: {src.size}, {dst.size}, {length.size}"
        )
    keep = length > 0
    if not keep.all():
        src, dst, length = src[keep], dst[keep], length[keep]
    if src.size == 0:
        return Regions(src, dst, length)
    if sort:
        order = np.argsort(src, kind="stable")
        src, dst, length = src[order], dst[order], length[order]
    starts = np.ones(src.size, dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    merged_len = np.zeros(first.size, dtype=np.uint64)
    np.add.at(merged_len, group, length)
    return Regions(src[first], dst[first], merged_len)


__all__ = [
    "Cut",
    "PlanError",
    "Regions",
    "TransferPlan",
    "check_direct_compatible",
    "coalesce",
    "held_positions",
    "layers_by_group",
    "plan_blocks",
    "plan_cut",
    "plan_grouped",
    "plan_parts",
    "plan_regions",
]
