"""Tensor parallelism between instances: which KV heads each rank holds, and which
prefill rank sends which heads to which decode rank. Pure; no I/O.

A model has ``total`` KV heads. With ``tp`` ranks, rank ``r`` holds heads
``[r * total / tp, (r + 1) * total / tp)`` when ``tp <= total``; when ``tp > total``
each head is replicated on ``tp / total`` consecutive ranks and rank ``r`` holds head
``r // (tp / total)`` (vLLM's and SGLang's split). ``tp`` and ``total`` must divide
one another.

Every decode head is fed by exactly one prefill rank. kvbridge pairs instances when
one TP size is a multiple of the other (:func:`check_pairing`): a decode rank then
reads from one prefill rank (decode TP >= prefill TP) or from several (prefill TP >
decode TP). Where several prefill ranks hold a head (replicas), decode rank ``d``
takes it from replica ``d % replicas``, so the work spreads over them; when the decode
has fewer ranks than the prefill has replicas (an MLA model, whose one latent "head"
every rank holds, on a prefill of more ranks than its decode), some prefill ranks feed
nobody: each such *idle* rank is told by one decode rank (:func:`idle_prefill_ranks`)
to let go of every request.

>>> [(s.p_rank, s.d_rank, s.p_first, s.d_first, s.count) for s in head_slices(8, 1, 2)]
[(0, 0, 0, 0, 4), (0, 1, 4, 0, 4)]
>>> [(s.p_rank, s.d_rank, s.p_first, s.d_first, s.count) for s in head_slices(8, 2, 1)]
[(0, 0, 0, 0, 4), (1, 0, 0, 4, 4)]
>>> rank_heads(2, 4, 3)
range(1, 2)
>>> prefill_ranks(1, 2, 1, 0), idle_prefill_ranks(1, 2, 1, 0)   # MLA, prefill TP 2, decode TP 1
([0], [1])
"""

from __future__ import annotations

from math import gcd
from typing import NamedTuple

from kvbridge.errors import IncompatiblePeerError


class HeadSlice(NamedTuple):
    """Heads ``[p_first, p_first + count)`` of prefill rank ``p_rank`` (its own
    numbering) are heads ``[d_first, d_first + count)`` of decode rank ``d_rank``."""

    p_rank: int
    d_rank: int
    p_first: int
    d_first: int
    count: int


def _check(total: int, tp: int, side: str) -> None:
    if total <= 0 or tp <= 0:
        raise IncompatiblePeerError(f"{side}: {total} KV heads over tensor parallel size {tp}")
    if tp % total and total % tp:
        raise IncompatiblePeerError(
            f"{side}: tensor parallel size {tp} does not split {total} KV heads evenly",
            fix=(
                f"use a --tensor-parallel-size that divides the model's {total} KV heads, or a "
                f"multiple of {total}"
            ),
        )


def check_pairing(total: int, p_tp: int, d_tp: int, *, idle: bool = False) -> None:
    """Raise unless the two splits pair up: both split the ``total`` heads evenly, one
    TP size is a multiple of the other, and every prefill rank feeds some decode rank
    (a prefill with more ranks than heads holds replicas: then the decode needs at
    least as many ranks, or some prefill ranks would hold requests nobody reads),
    unless ``idle``: the caller tells such ranks to let go (:func:`idle_prefill_ranks`).

    Raises:
        IncompatiblePeerError: naming the fix.
    """
    _check(total, p_tp, "prefill")
    _check(total, d_tp, "decode")
    if d_tp % p_tp and p_tp % d_tp:
        raise IncompatiblePeerError(
            f"prefill TP {p_tp}, decode TP {d_tp}: one TP size must be a multiple of the other",
            fix=(
                "give the decode instance a --tensor-parallel-size that is a multiple or a divisor "
                "of the prefill's"
            ),
        )
    if p_tp > d_tp and p_tp > total and not idle:
        raise IncompatiblePeerError(
            f"prefill TP {p_tp}, decode TP {d_tp}: the prefill's ranks hold replicas of the "
            f"model's {total} KV heads, and the decode would read each head from one of them only",
            fix=(
                f"give the decode instance a --tensor-parallel-size of at least {p_tp}, or the "
                f"prefill at most {total}"
            ),
        )


def heads_per_rank(total: int, tp: int) -> int:
    return max(1, total // tp)


def rank_heads(total: int, tp: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of ``tp`` holds."""
    _check(total, tp, "split")
    if tp <= total:
        n = total // tp
        return range(rank * n, (rank + 1) * n)
    head = rank // (tp // total)
    return range(head, head + 1)


def head_slices(total: int, p_tp: int, d_tp: int) -> list[HeadSlice]:
    """Every (prefill rank, decode rank) pairing, as maximal runs of heads, ordered by
    decode rank then decode head."""
    _check(total, p_tp, "prefill")
    _check(total, d_tp, "decode")
    p_replicas = max(1, p_tp // total)
    out: list[HeadSlice] = []
    for d in range(d_tp):
        d_heads = rank_heads(total, d_tp, d)
        for i, head in enumerate(d_heads):
            if p_tp <= total:
                p, p_local = head // (total // p_tp), head % (total // p_tp)
            else:
                p, p_local = head * p_replicas + d % p_replicas, 0
            last = out[-1] if out else None
            if (
                last
                and last.d_rank == d
                and last.p_rank == p
                and last.p_first + last.count == p_local
                and last.d_first + last.count == i
            ):
                out[-1] = last._replace(count=last.count + 1)
            else:
                out.append(HeadSlice(p, d, p_local, i, 1))
    return out


class Split(NamedTuple):
    """How one prefill rank and one decode rank of differently split instances exchange
    KV: every block is cut into *parts* of the same number of heads on both sides
    (``local_parts`` per block here, ``remote_parts`` on the peer), and ``runs`` pairs
    them: ``(first local part, first remote part, number of parts)``."""

    local_parts: int
    remote_parts: int
    runs: tuple[tuple[int, int, int], ...]
    fanout: int
    """Prefill side: how many decode ranks of the peer's instance this rank feeds (each
    sends its own destination for every request); 1 on the decode side."""

    @property
    def idle(self) -> bool:
        """An idle prefill rank and the decode rank that tells it to let go
        (:func:`idle_prefill_ranks`): no heads move between them."""
        return not self.runs

    def local_heads(self, num_heads: int) -> tuple[int, int]:
        """Our KV heads ``[first, end)`` (of our ``num_heads``) that this pairing moves.
        One run always: two ranks' heads overlap in one contiguous range.

        >>> pair_split(8, 1, 2, 0, 1, prefill=True).local_heads(8)
        (4, 8)
        """
        if len(self.runs) != 1:
            raise ValueError(f"a pairing of {len(self.runs)} head runs has no single head range")
        unit = num_heads // self.local_parts
        first, _, count = self.runs[0]
        return first * unit, (first + count) * unit


def pair_split(
    total: int, p_tp: int, d_tp: int, p_rank: int, d_rank: int, *, prefill: bool
) -> Split | None:
    """The :class:`Split` between prefill rank ``p_rank`` and decode rank ``d_rank``,
    seen from the prefill side (``prefill=True``) or the decode side; None when that
    pair exchanges nothing. Both sides derive the same part size from the whole
    pairing, so their descriptors have equal lengths. An idle prefill rank and the
    decode rank that tells it to let go pair without runs (``Split.idle``, fanout 1).

    >>> pair_split(8, 1, 2, 0, 1, prefill=True)
    Split(local_parts=2, remote_parts=1, runs=((1, 0, 1),), fanout=2)
    >>> pair_split(8, 1, 2, 0, 1, prefill=False)
    Split(local_parts=1, remote_parts=2, runs=((0, 1, 1),), fanout=1)
    """
    slices = head_slices(total, p_tp, d_tp)
    p_heads, d_heads = heads_per_rank(total, p_tp), heads_per_rank(total, d_tp)
    unit = gcd(p_heads, d_heads)
    for s in slices:
        unit = gcd(unit, gcd(s.count, gcd(s.p_first, s.d_first)))
    mine = [s for s in slices if (s.p_rank, s.d_rank) == (p_rank, d_rank)]
    if not mine:
        return (
            Split(1, 1, (), 1) if p_rank in idle_prefill_ranks(total, p_tp, d_tp, d_rank) else None
        )
    if prefill:
        runs = tuple((s.p_first // unit, s.d_first // unit, s.count // unit) for s in mine)
        fanout = len({s.d_rank for s in slices if s.p_rank == p_rank})
        return Split(p_heads // unit, d_heads // unit, runs, fanout)
    runs = tuple((s.d_first // unit, s.p_first // unit, s.count // unit) for s in mine)
    return Split(d_heads // unit, p_heads // unit, runs, 1)


def prefill_ranks(total: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The prefill ranks decode rank ``d_rank`` receives from."""
    return sorted({s.p_rank for s in head_slices(total, p_tp, d_tp) if s.d_rank == d_rank})


def idle_prefill_ranks(total: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The prefill ranks that feed no decode rank (replicas nobody reads) and that decode
    rank ``d_rank`` tells to let go of each request: idle rank ``p`` is told by decode
    rank ``p % d_tp``, so each idle rank hears from exactly one decode rank."""
    fed = {s.p_rank for s in head_slices(total, p_tp, d_tp)}
    return [p for p in range(p_tp) if p not in fed and p % d_tp == d_rank]


__all__ = [
    "HeadSlice",
    "Split",
    "check_pairing",
    "head_slices",
    "heads_per_rank",
    "idle_prefill_ranks",
    "pair_split",
    "prefill_ranks",
    "rank_heads",
]
