"""SGLang's state-space states (a hybrid pool's ``state_data_ptrs[0]``, one row per state
slot, :func:`.pools.pool_states`): a request's slot, whether a decode's states take a
prefill's, and which bytes of a slot's row each pair of ranks of different attention TP
sizes moves. Pure; no I/O. The prefill's control thread checks and cuts once per
registration (:func:`check_states`, :func:`state_cut`); both sides derive their split
once, at start-up (:func:`state_split`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvbridge.adapters.sglang.pools import check_presence
from kvbridge.core.rows import RowLayout
from kvbridge.core.states import (
    Section,
    Segment,
    StateLayout,
    StateTensor,
    state_prefill_ranks,
    state_segments,
)
from kvbridge.errors import IncompatiblePeerError


def state_slot(state_indices) -> int | None:
    """A state-space pool's state slot of a request from SGLang's ``state_indices`` (one
    entry per state type, here the one, MAMBA: the request's slot, as a one-element
    array or a list of one); None when it names no slot or several (kvbridge moves one
    state per request).

    >>> state_slot([[np.array(7)]]), state_slot([np.array([3])]), state_slot([[1, 2]])
    (7, 3, None)
    """
    if not state_indices or state_indices[0] is None:
        return None
    rows = np.asarray(state_indices[0], dtype=np.int64).reshape(-1)
    return int(rows[0]) if rows.size == 1 else None


def state_split(
    *,
    item_lens: Sequence[int],
    dims: Sequence[int] | None,
    outer_counts: Sequence[int] | None,
    shard_groups: Sequence[Sequence[int] | None] | None,
    layer_ids: Sequence[int] | None,
    tp: int,
) -> tuple[StateTensor, ...] | None:
    """How each state tensor's row (one state slot) splits over attention TP ranks, the
    same at every TP size (:class:`~kvbridge.core.states.StateTensor` in bytes:
    ``uint8`` elements), from what SGLang publishes per tensor
    (:func:`.compat.state_split_info`: the sliced axis' size on this rank, the rows
    before it, the conv state's sub-blocks split apart, the layer); or None when it does
    not say enough, and the states then move between equal TP sizes only. Called once
    per rank, when the manager starts.

    A tensor is ``rows`` (``outer_counts``) rows of channels (or heads) of equal bytes:
    one section split contiguously over the ranks, or, where SGLang names sub-blocks
    (Gated DeltaNet's conv state ``[q | k | v]``, ``shard_groups`` summing to the
    channels at TP 1), one section per sub-block. A size of 0 marks a state every rank
    holds whole (one unit, replicated). SGLang lists the tensors field by field (conv
    states first, then SSM states), each field once per layer: a conv state of a pool
    that also keeps SSM states and names no sub-blocks is Mamba2's ``[x | B | C]``
    (heads and groups split apart), whose split SGLang does not describe: None.

    >>> state_split(item_lens=[256] * 2, dims=[64] * 2, outer_counts=[1] * 2,
    ...             shard_groups=[None] * 2, layer_ids=[0, 2], tp=2)[0]
    StateTensor(dtype='uint8', rows=1, sections=(Section(units=128, width=4),))
    """
    n = len(item_lens)
    if (
        dims is None
        or outer_counts is None
        or shard_groups is None
        or layer_ids is None
        or not n
        or not len(dims) == len(outer_counts) == len(shard_groups) == len(layer_ids) == n
    ):
        return None
    layers = len(set(layer_ids))
    if n % layers:
        return None
    fields = n // layers
    out: list[StateTensor] = []
    for j, (item, dim, outer, groups) in enumerate(
        zip(item_lens, dims, outer_counts, shard_groups, strict=True)
    ):
        if dim == 0:  # every rank holds it whole
            out.append(StateTensor("uint8", 1, (Section(1, int(item)),)))
            continue
        if dim < 0 or outer <= 0 or item % (dim * outer):
            return None
        if groups and sum(groups) == dim * tp and all(g % tp == 0 for g in groups):
            units = tuple(int(g) for g in groups)
        elif not groups and fields > 1 and j < layers:
            return None  # Mamba2's conv state: x, B and C split apart, undescribed
        else:
            units = (dim * tp,)
        width = item // (dim * outer)
        out.append(StateTensor("uint8", int(outer), tuple(Section(u, width) for u in units)))
    return tuple(out)


def check_states(
    theirs: RowLayout | None,
    mine: RowLayout | None,
    *,
    prefill_tp: int,
    decode_tp: int,
    their_split: Sequence[StateTensor] | None = None,
    my_split: Sequence[StateTensor] | None = None,
) -> None:
    """Raise :class:`IncompatiblePeerError` unless a decode's state-space states
    (``theirs``, from its registration) take this prefill's, or neither side has any
    (:func:`.pools.pool_states`). Called by the prefill's control thread per registration.

    A request's state is one slot's row of every tensor on each side. Between equal TP
    sizes each rank moves its rows whole to the decode rank of its rank, so the rows
    must be equal; between others each rank moves the parts of its rows that the
    decode rank holds (:func:`state_cut`), so both sides must describe the same split
    (:func:`state_split`, ``their_split`` from the registration).
    """
    check_presence(theirs, mine, "state-space layers")
    if mine is None:
        return
    dtypes = "(--mamba-ssm-dtype, SGLANG_MAMBA_CONV_DTYPE)"
    if prefill_tp == decode_tp:
        if theirs.item_lens != mine.item_lens:
            raise IncompatiblePeerError(
                f"its {len(theirs.item_lens)} state tensors of {sorted(set(theirs.item_lens))} "
                f"bytes per slot differ from this prefill's {len(mine.item_lens)} of "
                f"{sorted(set(mine.item_lens))}: serve the same model with the same state "
                f"dtypes {dtypes} on both"
            )
        return
    if their_split is None or my_split is None:
        side = "this prefill's" if my_split is None else "the decode's"
        raise IncompatiblePeerError(
            f"prefill attention TP {prefill_tp}, decode TP {decode_tp}: {side} SGLang does not "
            "say how its state-space states split over TP ranks (it names the sub-blocks of "
            "Gated DeltaNet conv states and single-axis states; not Mamba2's conv states), "
            "so kvbridge moves them between equal TP sizes only",
            fix="serve prefill and decode with the same --tp-size",
        )
    if tuple(their_split) != tuple(my_split):
        raise IncompatiblePeerError(
            f"its {len(their_split)} state tensors split over TP ranks otherwise than this "
            f"prefill's {len(my_split)}: serve the same model with the same state dtypes "
            f"{dtypes} on both"
        )
    for tp in (prefill_tp, decode_tp):
        if not StateLayout(kind="sglang", tensors=tuple(my_split)).splits_over(tp):
            raise IncompatiblePeerError(
                f"this model's state-space heads or channels do not split over {tp} ranks",
                fix="serve prefill and decode with a --tp-size that divides them",
            )
    for rows, tp, whose in ((theirs, decode_tp, "its"), (mine, prefill_tp, "this prefill's")):
        sizes = [t.nbytes(tp) for t in my_split]
        if list(rows.item_lens) != sizes:
            raise IncompatiblePeerError(
                f"{whose} state rows ({sorted(set(rows.item_lens))} bytes) are not what their "
                f"split gives at TP {tp} ({sorted(set(sizes))}): serve the same model with the "
                "same kvbridge version on both"
            )


def state_cut(
    split: Sequence[StateTensor],
    p_tp: int,
    d_tp: int,
    p_rank: int,
    d_rank: int,
    *,
    kv_sources: Iterable[int],
) -> tuple[tuple[Segment, ...], ...]:
    """Per state tensor, the ``(prefill offset, decode offset, bytes)`` of one slot's
    row that prefill rank ``p_rank`` (of ``p_tp``) writes into decode rank ``d_rank``'s
    (of ``d_tp``): empty where the pair shares none of it. Called by the prefill's
    control thread once per registration of a decode of another TP size.

    Raises:
        IncompatiblePeerError: the decode rank needs states from a prefill rank not in
            ``kv_sources``, the ranks SGLang pairs it with (those holding its KV heads).
    """
    missing = state_sources(split, p_tp, d_tp, d_rank) - set(kv_sources)
    if missing:
        raise IncompatiblePeerError(
            f"prefill TP {p_tp}, decode TP {d_tp}: decode rank {d_rank} would need "
            f"state-space states from prefill ranks {sorted(missing)}, which send it none "
            "of its KV heads",
            fix="serve prefill and decode with the same --tp-size",
        )
    cuts: dict[StateTensor, tuple[Segment, ...]] = {}
    for t in split:
        if t not in cuts:
            layout = StateLayout(kind="sglang", tensors=(t,))
            cuts[t] = tuple(state_segments(layout, p_tp, d_tp, p_rank, d_rank))
    return tuple(cuts[t] for t in split)


def state_sources(split: Sequence[StateTensor], p_tp: int, d_tp: int, d_rank: int) -> set[int]:
    """The prefill ranks holding part of decode rank ``d_rank``'s states."""
    layout = StateLayout(kind="sglang", tensors=tuple(dict.fromkeys(split)))
    return state_prefill_ranks(layout, p_tp, d_tp, d_rank)


__all__ = ["check_states", "state_cut", "state_slot", "state_sources", "state_split"]
