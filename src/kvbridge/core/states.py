"""State-space layers' states between tensor-parallel splits: which bytes of a prefill
rank's state block a decode rank of another TP size needs, and where they go. Pure; no I/O.

A state-space layer (Mamba2, Gated DeltaNet, a short convolution) keeps one state per
request in a block of its own: a few tensors one after the other (vLLM: convolution
state, then temporal state). Each tensor is ``rows`` rows, and each row is *sections*
one after the other: a section is ``units`` units of the model (heads, groups, or
single channels) of ``width`` elements each, split over TP ranks like KV heads
(:func:`kvbridge.core.tp.rank_heads`: contiguous ranges, or one replicated unit per
rank when the model has fewer units than ranks, as Mamba2's single group of B and C).

A Mamba2 convolution state stored state-length first (``SD``, ``(L, channels)``) is
``L`` rows of three sections (x by heads, B and C by groups); stored channels first
(``DS``, ``(channels, L)``) it is one row whose sections are ``L`` times wider. The
temporal state is one row of one section (heads of ``head_dim * d_state``).

>>> m2 = StateLayout(kind="mamba2", tensors=(
...     StateTensor(
...         dtype="float32", rows=3, sections=(Section(8, 32), Section(1, 8), Section(1, 8))
...     ),
...     StateTensor(dtype="float32", rows=1, sections=(Section(8, 256),)),
... ))
>>> m2.nbytes(1), m2.nbytes(2)      # B and C repeated on both ranks
(11456, 5824)
>>> state_segments(m2, 1, 2, 0, 0)[:2]   # rank 0: x of row 0; B, C of row 0 with x of row 1
[(0, 0, 512), (1024, 512, 576)]
"""

from __future__ import annotations

import msgspec

from kvbridge.core.layout import DTYPE_SIZES
from kvbridge.core.tp import head_slices, heads_per_rank
from kvbridge.errors import IncompatiblePeerError


class Section(msgspec.Struct, frozen=True, array_like=True):
    """``units`` units of ``width`` elements each, in every row of a state tensor."""

    units: int
    width: int


class StateTensor(msgspec.Struct, frozen=True, array_like=True):
    """One state tensor of a layer, as the whole model (TP 1) holds it."""

    dtype: str
    rows: int
    sections: tuple[Section, ...]

    def row_elements(self, tp: int) -> int:
        """Elements of one row on a rank of ``tp``."""
        return sum(heads_per_rank(s.units, tp) * s.width for s in self.sections)

    def nbytes(self, tp: int) -> int:
        return self.rows * self.row_elements(tp) * DTYPE_SIZES[self.dtype]


class StateLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What one state block of a state-space layer holds, independent of the TP size:
    the engine adapter derives it from the model, both peers must agree on it (it is
    part of the compatibility hash, :attr:`~kvbridge.wire.peer_compat.CompatInfo.group_states`).
    """

    kind: str
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        for t in self.tensors:
            if (
                t.dtype not in DTYPE_SIZES
                or t.rows <= 0
                or not t.sections
                or any(s.units <= 0 or s.width <= 0 for s in t.sections)
            ):
                raise ValueError(
                    "a state tensor needs a known dtype, rows and sections of positive size, got "
                    f"{t}"
                )

    def nbytes(self, tp: int) -> int:
        """Bytes of one state block on a rank of ``tp``."""
        return sum(t.nbytes(tp) for t in self.tensors)

    def splits_over(self, tp: int) -> bool:
        """Every section's units split evenly over ``tp`` ranks, or ``tp`` over them."""
        return all(s.units % tp == 0 or tp % s.units == 0 for t in self.tensors for s in t.sections)

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str) -> StateLayout | None:
        """The layout a peer described, or None for a description without one (a state
        kvbridge moves between equal TP sizes only)."""
        try:
            return msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return None


Segment = tuple[int, int, int]
"""``(prefill offset, decode offset, length)`` in bytes, within one state block."""


def state_segments(
    layout: StateLayout, p_tp: int, d_tp: int, p_rank: int, d_rank: int
) -> list[Segment]:
    """The bytes prefill rank ``p_rank`` (of ``p_tp``) sends decode rank ``d_rank`` (of
    ``d_tp``) of every state block, in decode order, adjacent ones merged; empty when
    the pair shares nothing. Every unit of the decode rank comes from exactly one
    prefill rank (a replicated unit from replica ``d_rank % replicas``, as attention
    heads: :func:`~kvbridge.core.tp.head_slices`).

    Raises:
        IncompatiblePeerError: a section's units do not split over one of the TP sizes.
    """
    for tp in (p_tp, d_tp):
        if not layout.splits_over(tp):
            raise IncompatiblePeerError(
                f"the {layout.kind} state's heads or groups do not split over {tp} ranks",
                fix=(
                    "give prefill and decode a --tensor-parallel-size that divides the model's "
                    "state-space heads and groups"
                ),
            )
    out: list[Segment] = []
    p_base = d_base = 0
    for t in layout.tensors:
        es = DTYPE_SIZES[t.dtype]
        p_row, d_row = t.row_elements(p_tp) * es, t.row_elements(d_tp) * es
        pieces: list[Segment] = []  # within one row
        p_sec = d_sec = 0
        for s in t.sections:
            unit = s.width * es
            for h in head_slices(s.units, p_tp, d_tp):
                if (h.p_rank, h.d_rank) == (p_rank, d_rank):
                    pieces.append(
                        (p_sec + h.p_first * unit, d_sec + h.d_first * unit, h.count * unit)
                    )
            p_sec += heads_per_rank(s.units, p_tp) * unit
            d_sec += heads_per_rank(s.units, d_tp) * unit
        for r in range(t.rows):
            for p_off, d_off, n in pieces:
                _append(out, (p_base + r * p_row + p_off, d_base + r * d_row + d_off, n))
        p_base += t.rows * p_row
        d_base += t.rows * d_row
    return out


def _append(out: list[Segment], seg: Segment) -> None:
    if out and out[-1][0] + out[-1][2] == seg[0] and out[-1][1] + out[-1][2] == seg[1]:
        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + seg[2])
    else:
        out.append(seg)


def state_prefill_ranks(layout: StateLayout, p_tp: int, d_tp: int, d_rank: int) -> set[int]:
    """The prefill ranks that hold some of decode rank ``d_rank``'s state."""
    return {p for p in range(p_tp) if state_segments(layout, p_tp, d_tp, p, d_rank)}


__all__ = [
    "Section",
    "Segment",
    "StateLayout",
    "StateTensor",
    "state_prefill_ranks",
    "state_segments",
]
