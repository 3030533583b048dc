"""SGLang state-space states: a request's slot is one row of every state tensor, a
decode's states pair with a prefill's only alike, and between attention TP sizes what
SGLang publishes per state tensor becomes a split that is the same at every TP size
(``states.state_split``), and the segments each (prefill rank, decode rank) pair moves
(``states.state_cut``) rebuild every decode rank's rows from the prefill ranks' rows
exactly.

The reference here is how SGLang shards a state (``MambaPool`` tensors of
``Mamba2StateShape`` / ``KimiLinearStateShape``), written out per element: each
sub-block of a row (one for a single-axis state; GDN's conv state ``[q | k | v]``
three) is cut into TP contiguous channel ranges, a rank's row holds its range of every
sub-block in order, ``outer`` such rows per slot; a state of size 0 every rank holds
whole.
"""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest

from kvbridge.adapters.sglang.states import check_states, state_cut, state_sources, state_split
from kvbridge.core.rows import RowLayout
from kvbridge.errors import IncompatiblePeerError, PlanError


def sglang_states(slots: int, seed: int):
    """A state-space pool's states as SGLang registers them: per layer a conv state
    ``(slots, channels, width - 1)`` bfloat16-sized (here int16) and an SSM state
    ``(slots, heads, head_dim, state)`` float32, listed tensor-major (every layer's conv
    state, then every layer's SSM state); and their ``RowLayout``."""
    rng = np.random.default_rng(seed)
    conv = [rng.integers(-99, 99, (slots, 6, 2), dtype=np.int16) for _ in range(2)]
    ssm = [rng.standard_normal((slots, 2, 4, 3)).astype(np.float32) for _ in range(2)]
    tensors = conv + ssm
    layout = RowLayout.build(
        ptrs=[t.ctypes.data for t in tensors],
        lens=[t.nbytes for t in tensors],
        item_lens=[t[0].nbytes for t in tensors],
        what="state-space state tensors",
    )
    return tensors, layout


def test_a_state_slot_is_one_row_of_every_state_tensor() -> None:
    tensors, states = sglang_states(5, 0)
    table = states.table()
    got = [ctypes.string_at(int(table[s, 0]), int(table[s, 1])) for s in states.slots(3)]
    assert got == [t[3].tobytes() for t in tensors]
    with pytest.raises(PlanError, match="state-space state tensors have different row counts"):
        RowLayout.build(
            ptrs=[1, 2], lens=[5 * 24, 6 * 24], item_lens=[24, 24], what="state-space state tensors"
        )


def test_state_space_states_pair_only_alike_and_between_equal_tp_sizes() -> None:
    _, states = sglang_states(5, 1)
    check_states(None, None, prefill_tp=1, decode_tp=2)  # neither side has any
    check_states(states, states, prefill_tp=2, decode_tp=2)
    with pytest.raises(
        IncompatiblePeerError, match="has state-space layers and this prefill's has none"
    ):
        check_states(states, None, prefill_tp=1, decode_tp=1)
    with pytest.raises(
        IncompatiblePeerError, match="has no state-space layers and this prefill's has"
    ):
        check_states(None, states, prefill_tp=1, decode_tp=1)
    with pytest.raises(IncompatiblePeerError, match="between equal TP sizes only") as info:
        check_states(states, states, prefill_tp=1, decode_tp=2)
    assert "--tp-size" in str(info.value)
    # another state dtype (float16 SSM states): rows of other bytes
    halved = msgspec.structs.replace(
        states, item_lens=states.item_lens[:2] + tuple(i // 2 for i in states.item_lens[2:])
    )
    with pytest.raises(IncompatiblePeerError, match="--mamba-ssm-dtype"):
        check_states(halved, states, prefill_tp=1, decode_tp=1)


class Tensor:
    """One state tensor of the model at TP 1: ``outer`` rows of sub-blocks of
    ``blocks`` channels of ``width`` bytes each (``blocks == ()``: replicated, a
    whole item of ``width`` bytes). ``groups``: the conv sub-blocks SGLang publishes
    for it, when not its own (Kimi names its q, k, v convs' sizes on each of them)."""

    def __init__(
        self,
        blocks: tuple[int, ...],
        width: int,
        outer: int = 1,
        groups: list[int] | None = None,
    ) -> None:
        self.blocks, self.width, self.outer, self.groups = blocks, width, outer, groups

    def full_row(self, rng: np.random.Generator) -> np.ndarray:
        n = (sum(self.blocks) or 1) * self.width * self.outer
        return rng.integers(0, 256, n, dtype=np.uint8)

    def rank_row(self, full: np.ndarray, tp: int, rank: int) -> np.ndarray:
        """Rank ``rank`` of ``tp``'s row, element by element as SGLang shards it."""
        if not self.blocks:
            return full.copy()
        channels = sum(self.blocks)
        out = []
        for r in range(self.outer):
            row = full[r * channels * self.width : (r + 1) * channels * self.width]
            start = 0
            for size in self.blocks:
                per = size // tp
                for c in range(start + rank * per, start + (rank + 1) * per):
                    out.extend(row[c * self.width : (c + 1) * self.width])
                start += size
        return np.array(out, dtype=np.uint8)

    def published(self, tp: int) -> tuple[int, int, int, list[int] | None]:
        """(item_len, dim, outer count, shard groups) as ``KVArgs`` lists them."""
        if not self.blocks:
            return self.width, 0, 1, None
        dim = sum(self.blocks) // tp
        groups = self.groups or (list(self.blocks) if len(self.blocks) > 1 else None)
        return dim * self.width * self.outer, dim, self.outer, groups


def split_of(fields: list[Tensor], layers: int, tp: int):
    """What a rank of ``tp`` derives from SGLang's lists: tensors field by field, each
    once per layer."""
    entries = [(f, layer) for f in fields for layer in range(layers)]
    pub = [f.published(tp) for f, _ in entries]
    return state_split(
        item_lens=[p[0] for p in pub],
        dims=[p[1] for p in pub],
        outer_counts=[p[2] for p in pub],
        shard_groups=[p[3] for p in pub],
        layer_ids=[2 * layer + 1 for _, layer in entries],
        tp=tp,
    )


# GDN (Qwen3-Next): conv [q | k | v] channels of width 3 * 2 bytes (kernel 4,
# bfloat16), SSM state by value heads of head_k * head_v float32
GDN = [Tensor((8, 8, 16), 6), Tensor((4,), 16 * 16 * 4)]
# LFM2: one conv state of hidden channels, width 2 * 2 bytes
SHORT_CONV = [Tensor((16,), 4)]
# Kimi-style convs: (kernel - 1) rows of channels, each published with the sizes of
# all three; a state every rank keeps whole
KIMI = [
    Tensor((8,), 2, outer=3, groups=[8, 4, 4]),
    Tensor((4,), 2, outer=3, groups=[8, 4, 4]),
    Tensor((), 40),
    Tensor((4,), 64),
]
MODELS = {"gdn": GDN, "short_conv": SHORT_CONV, "kimi": KIMI}
SIZES = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("p_tp, d_tp", SIZES)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_pairs_segments_rebuild_every_decode_rank_s_state_exactly_once(
    model: str, p_tp: int, d_tp: int
) -> None:
    fields, layers = MODELS[model], 2
    split = split_of(fields, layers, p_tp)
    assert split is not None and split == split_of(fields, layers, d_tp)
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    tensors = [f for f in fields for _ in range(layers)]
    full = [t.full_row(rng) for t in tensors]
    for d in range(d_tp):
        sources = state_sources(split, p_tp, d_tp, d)
        got = [
            np.zeros_like(t.rank_row(row, d_tp, d)) for t, row in zip(tensors, full, strict=True)
        ]
        writes = [np.zeros(g.size, dtype=np.int64) for g in got]
        for p in range(p_tp):
            cut = state_cut(split, p_tp, d_tp, p, d, kv_sources=range(p_tp))
            assert bool(any(cut)) == (p in sources)
            for j, segments in enumerate(cut):
                src = tensors[j].rank_row(full[j], p_tp, p)
                for p_off, d_off, n in segments:
                    got[j][d_off : d_off + n] = src[p_off : p_off + n]
                    writes[j][d_off : d_off + n] += 1
        for j, t in enumerate(tensors):
            assert np.array_equal(got[j], t.rank_row(full[j], d_tp, d)), (model, j, d)
            assert (writes[j] == 1).all(), f"decode rank {d}, tensor {j}: bytes written {writes}"


def test_what_sglang_publishes_becomes_a_split_alike_at_every_tp_size() -> None:
    (conv,) = split_of(SHORT_CONV, 1, 2)
    assert conv.rows == 1 and [(s.units, s.width) for s in conv.sections] == [(16, 4)]
    gdn = split_of(GDN, 2, 2)
    assert [[(s.units, s.width) for s in t.sections] for t in gdn] == [
        [(8, 6), (8, 6), (16, 6)],
        [(8, 6), (8, 6), (16, 6)],
        [(4, 1024)],
        [(4, 1024)],
    ]
    kimi = split_of(KIMI, 1, 2)
    assert [t.rows for t in kimi] == [3, 3, 1, 1]
    assert [(s.units, s.width) for s in kimi[2].sections] == [(1, 40)]  # whole on every rank


def test_a_split_sglang_does_not_describe_is_none() -> None:
    # Mamba2: a conv state [x | B | C] (heads and groups split apart) without sub-blocks,
    # beside an SSM state
    assert split_of([Tensor((40,), 6), Tensor((4,), 256)], 2, 2) is None
    # this SGLang publishes nothing of it, or lists of another length
    kwargs = {
        "item_lens": [64, 64],
        "dims": [16, 16],
        "outer_counts": [1, 1],
        "shard_groups": [None, None],
        "layer_ids": [0, 2],
        "tp": 1,
    }
    assert state_split(**kwargs) is not None
    for name in ("dims", "outer_counts", "shard_groups", "layer_ids"):
        assert state_split(**{**kwargs, name: None}) is None
        assert state_split(**{**kwargs, name: kwargs[name][:1]}) is None
    # rows that are not whole channels
    assert state_split(**{**kwargs, "item_lens": [63, 64]}) is None


def states_of(split, tp: int) -> RowLayout:
    """A rank of ``tp``'s state tensors (eight slots)."""
    return RowLayout(
        ptrs=tuple(range(4096, 4096 * (len(split) + 1), 4096)),
        item_lens=tuple(t.nbytes(tp) for t in split),
        rows=8,
    )


def test_states_between_tp_sizes_pair_when_both_sides_describe_the_same_split() -> None:
    split = split_of(GDN, 2, 1)
    decode, prefill = states_of(split, 1), states_of(split, 2)
    check_states(decode, prefill, prefill_tp=2, decode_tp=1, their_split=split, my_split=split)
    for theirs, mine, side in ((None, split, "the decode's"), (split, None, "this prefill's")):
        with pytest.raises(IncompatiblePeerError, match=f"{side} SGLang does not say") as info:
            check_states(
                decode, prefill, prefill_tp=2, decode_tp=1, their_split=theirs, my_split=mine
            )
        assert "--tp-size" in str(info.value)
    # float16 SSM states on the decode: channels of other bytes
    other = split_of([GDN[0], Tensor((4,), 16 * 16 * 2)], 2, 1)
    with pytest.raises(IncompatiblePeerError, match="--mamba-ssm-dtype"):
        check_states(
            states_of(other, 1),
            prefill,
            prefill_tp=2,
            decode_tp=1,
            their_split=other,
            my_split=split,
        )
    # a registration whose rows are not what its split says at its TP size
    with pytest.raises(IncompatiblePeerError, match="its state rows") as info:
        check_states(prefill, prefill, prefill_tp=2, decode_tp=1, their_split=split, my_split=split)
    assert "same kvbridge version" in str(info.value)
    # four value heads do not split over three ranks
    with pytest.raises(IncompatiblePeerError, match="do not split over 3 ranks"):
        check_states(decode, prefill, prefill_tp=3, decode_tp=1, their_split=split, my_split=split)


def test_a_decode_rank_takes_states_only_from_the_prefill_ranks_it_takes_kv_from() -> None:
    split = split_of(SHORT_CONV, 2, 2)
    # two KV heads over two prefill ranks: the TP 1 decode takes from both
    for p in (0, 1):
        assert state_cut(split, 2, 1, p, 0, kv_sources=[0, 1]) == state_cut(
            split, 2, 1, p, 0, kv_sources=[0, 1, 2]
        )
    # one KV head, on both prefill ranks: SGLang pairs the decode rank with one of them,
    # yet it needs channels of both
    with pytest.raises(IncompatiblePeerError, match=r"from prefill ranks \[1\]") as info:
        state_cut(split, 2, 1, 0, 0, kv_sources=[0])
    assert "--tp-size" in str(info.value)
