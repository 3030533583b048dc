"""Row buffers: several buffers of equally many fixed-size rows, one row per request
(metadata: first token, logprobs, ...) or per state slot (a state-space model's
states), described as one transport descriptor table. Pure; no I/O.

Who uses it: an engine adapter builds its own from the engine's buffer lists once per
rank and sends it in its registration; the peer posts a request's row of each paired
buffer (:func:`paired_count`).

>>> rows = RowLayout.build(ptrs=[0x100, 0x900], lens=[64, 128], item_lens=[16, 32])
>>> rows.rows, rows.slots(2, count=2).tolist()
(4, [2, 6])
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from kvbridge.errors import PlanError


class RowLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Buffers of equally many rows as one descriptor table: buffer ``j``'s row ``r`` is
    slot ``j * rows + r``. Built once per rank from the engine's buffer lists (and
    received in a peer's registration); read when a request's rows are posted."""

    ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    rows: int

    @classmethod
    def build(
        cls,
        *,
        ptrs: Sequence[int],
        lens: Sequence[int],
        item_lens: Sequence[int],
        what: str = "metadata buffers",
    ) -> RowLayout:
        """From parallel lists of buffer addresses, byte lengths and row sizes (SGLang's
        ``KVArgs`` lists); ``what`` names them in errors."""
        if not (len(ptrs) == len(lens) == len(item_lens)) or not ptrs:
            raise PlanError(
                f"{what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} row sizes"
            )
        rows = {int(length) // int(item) for length, item in zip(lens, item_lens, strict=True)}
        if len(rows) != 1:
            raise PlanError(f"{what} have different row counts: {sorted(rows)}")
        return cls(
            ptrs=tuple(int(p) for p in ptrs),
            item_lens=tuple(int(i) for i in item_lens),
            rows=rows.pop(),
        )

    def regions(self) -> list[tuple[int, int]]:
        return [(p, item * self.rows) for p, item in zip(self.ptrs, self.item_lens, strict=True)]

    def table(self, device: int = 0) -> np.ndarray:
        """``(buffers * rows, 3)`` uint64 descriptors ``(address, length, device)``."""
        rows = np.arange(self.rows, dtype=np.uint64)
        out = np.empty((len(self.ptrs) * self.rows, 3), dtype=np.uint64)
        for j, (ptr, item) in enumerate(zip(self.ptrs, self.item_lens, strict=True)):
            part = out[j * self.rows : (j + 1) * self.rows]
            part[:, 0] = np.uint64(ptr) + rows * np.uint64(item)
            part[:, 1] = item
            part[:, 2] = device
        return out

    def slots(self, row: int, count: int | None = None) -> np.ndarray:
        """Slot indices of ``row`` in the first ``count`` buffers (default all)."""
        count = len(self.ptrs) if count is None else count
        if not 0 <= row < self.rows:
            raise PlanError(f"metadata row {row} out of range [0, {self.rows})")
        return np.arange(count, dtype=np.int64) * self.rows + row


def paired_count(local: RowLayout, remote: RowLayout) -> int:
    """How many leading buffers both sides have with equal row sizes (buffers pair by
    position, and the shorter list is what moves)."""
    count = 0
    for a, b in zip(local.item_lens, remote.item_lens, strict=False):
        if a != b:
            break
        count += 1
    return count


__all__ = ["RowLayout", "paired_count"]
