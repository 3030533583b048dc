"""A request's cache blocks, position by position, in every KV cache group. Pure (numpy).

vLLM's hybrid KV cache manager keeps layers of different kinds (full attention, sliding
window) in *KV cache groups*, each with its own block ids for the same request: the
prompt's ``p``-th block is block ``rows[g][p]`` in group ``g``, and every layer belongs
to one group (:attr:`~kvbridge.wire.peer_compat.CompatInfo.layer_groups`). A sliding-window
group holds nothing at positions that have left its window (vLLM's null block):
:data:`NONE` there. An engine without groups (SGLang, vLLM with the manager off) has one
row, and a table of one row is what a plain list of block ids means everywhere.

The runtime counts positions (``len``, slices) and never looks inside a table; the
planner (:func:`kvbridge.core.plan.plan_grouped`) reads the rows, and the wire carries
them (``Destination.block_ids`` + ``group_block_ids``).

>>> t = BlockTable.grouped([[7, 8, 9], [NONE, 4, 5]])
>>> len(t), t.num_groups, t[1:].rows.tolist()
(3, 2, [[8, 9], [4, 5]])
>>> (BlockTable.flat([1, 2]) + BlockTable.flat([3])).flat_ids()
[1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvbridge.errors import PlanError

NONE = -1
"""The id of a position a group holds no block for (it left a sliding window)."""


class BlockTable:
    """Block ids of consecutive positions of one request, one row per KV cache group
    (``rows``: int64 ``(groups, positions)``, :data:`NONE` where a group holds none).
    Immutable: slicing and ``+`` make new tables."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[0] < 1:
            raise PlanError(f"a block table has one row per KV cache group, got shape {rows.shape}")
        self.rows = rows

    @classmethod
    def flat(cls, block_ids: Sequence[int] | np.ndarray) -> BlockTable:
        """One group: ``block_ids`` in order."""
        return cls(np.asarray(block_ids, dtype=np.int64).reshape(1, -1))

    @classmethod
    def grouped(cls, rows: Sequence[Sequence[int]]) -> BlockTable:
        """One list of ids per group, all as long."""
        lengths = {len(r) for r in rows}
        if len(lengths) > 1:
            raise PlanError(f"the KV cache groups' block lists differ in length: {sorted(lengths)}")
        return cls(np.asarray([list(r) for r in rows], dtype=np.int64).reshape(len(rows), -1))

    @classmethod
    def of(cls, blocks: BlockTable | Sequence[int] | np.ndarray) -> BlockTable:
        """``blocks`` as a table (a plain sequence is one group)."""
        return blocks if isinstance(blocks, BlockTable) else cls.flat(blocks)

    @classmethod
    def from_wire(
        cls, block_ids: Sequence[int], group_block_ids: Sequence[Sequence[int]] = ()
    ) -> BlockTable:
        """Inverse of :meth:`to_wire`."""
        return (
            cls.grouped([block_ids, *group_block_ids]) if group_block_ids else cls.flat(block_ids)
        )

    def to_wire(self) -> tuple[list[int], list[list[int]]]:
        """Group 0's ids, and the other groups' (empty with one group)."""
        rows = self.rows.tolist()
        return rows[0], rows[1:]

    @property
    def num_groups(self) -> int:
        return int(self.rows.shape[0])

    def row(self, group: int) -> np.ndarray:
        return self.rows[group]

    def flat_ids(self) -> list[int]:
        """The ids of a one-group table.

        Raises:
            PlanError: the table has several groups.
        """
        if self.num_groups != 1:
            raise PlanError(
                f"this path moves one block list per request; the request has {self.num_groups} KV "
                "cache groups"
            )
        return self.rows[0].tolist()

    def __len__(self) -> int:
        return int(self.rows.shape[1])

    def __getitem__(self, positions: slice) -> BlockTable:
        if not isinstance(positions, slice):
            raise TypeError("a block table is sliced by positions: table[a:b]")
        return BlockTable(self.rows[:, positions])

    def __add__(self, other: BlockTable) -> BlockTable:
        if other.num_groups != self.num_groups:
            raise PlanError(
                f"cannot join block tables of {self.num_groups} and {other.num_groups} KV cache "
                "groups"
            )
        return BlockTable(np.concatenate([self.rows, other.rows], axis=1))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        """Positions, each as its ids in every group."""
        return iter(map(tuple, self.rows.T.tolist()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.rows.shape == other.rows.shape and bool((self.rows == other.rows).all())
        if isinstance(other, (list, tuple)) and self.num_groups == 1:
            return self.rows[0].tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking equality, like a list

    def __repr__(self) -> str:
        return f"BlockTable({self.rows.tolist()})"


__all__ = ["NONE", "BlockTable"]
