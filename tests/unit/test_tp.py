"""Head ownership and rank pairing between tensor-parallel splits (``kvbridge.core.tp``),
checked against a per-head brute force over many model / TP-size combinations, and
the geometry's head-range tables."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.tp import check_pairing, head_slices, pair_split, prefill_ranks, rank_heads
from kvbridge.errors import IncompatiblePeerError, PlanError

SIZES = [1, 2, 4, 8, 16]
PAIRS = [
    (total, p, d)
    for total in (1, 2, 4, 8)
    for p in SIZES
    for d in SIZES
    if (d % p == 0 or (p % d == 0 and p <= total))
    and (total % p == 0 or p % total == 0)
    and (total % d == 0 or d % total == 0)
]


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), PAIRS)
def test_every_decode_head_comes_from_a_prefill_rank_holding_it(
    total: int, p_tp: int, d_tp: int
) -> None:
    check_pairing(total, p_tp, d_tp)
    covered = {}
    for s in head_slices(total, p_tp, d_tp):
        d_heads, p_heads = rank_heads(total, d_tp, s.d_rank), rank_heads(total, p_tp, s.p_rank)
        for k in range(s.count):
            assert d_heads[s.d_first + k] == p_heads[s.p_first + k], (
                "the slice pairs different heads"
            )
            key = (s.d_rank, s.d_first + k)
            assert key not in covered, "a decode head is fed twice"
            covered[key] = s.p_rank
    assert len(covered) == sum(len(rank_heads(total, d_tp, d)) for d in range(d_tp)), (
        "a decode head is fed by nobody"
    )
    # a decode rank reads from one prefill rank, or from p_tp / d_tp of them; every
    # prefill rank feeds someone (else it would hold requests until their lease ends)
    assert all(
        len(prefill_ranks(total, p_tp, d_tp, d)) == max(1, p_tp // d_tp) for d in range(d_tp)
    )
    assert {r for d in range(d_tp) for r in prefill_ranks(total, p_tp, d_tp, d)} == set(range(p_tp))


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), PAIRS)
def test_both_sides_of_a_pair_cut_blocks_into_the_same_head_ranges(
    total: int, p_tp: int, d_tp: int
) -> None:
    p_heads, d_heads = len(rank_heads(total, p_tp, 0)), len(rank_heads(total, d_tp, 0))
    for d in range(d_tp):
        written, cuts = [], set()
        for p in range(p_tp):
            ps, ds = (
                pair_split(total, p_tp, d_tp, p, d, prefill=True),
                pair_split(total, p_tp, d_tp, p, d, prefill=False),
            )
            if p not in prefill_ranks(total, p_tp, d_tp, d):
                assert ps is None and ds is None
                continue
            assert ps is not None and ds is not None
            assert (ps.local_parts, ps.remote_parts) == (ds.remote_parts, ds.local_parts)
            assert p_heads // ps.local_parts == d_heads // ds.local_parts, (
                "a part holds different head counts on the two sides"
            )
            assert [(b, a, n) for a, b, n in ps.runs] == list(ds.runs)
            assert ps.fanout == sum(
                1 for x in range(d_tp) if p in prefill_ranks(total, p_tp, d_tp, x)
            )
            written += [k for a, _, n in ds.runs for k in range(a, a + n)]
            cuts.add(ds.local_parts)
        assert len(cuts) == 1, "the decode rank's sources cut its blocks differently"
        assert sorted(written) == list(range(cuts.pop())), (
            "every part of the decode rank's blocks is written once"
        )


@pytest.mark.parametrize(
    ("total", "p_tp", "d_tp", "match"),
    [
        (4, 8, 4, "hold replicas of the model's 4 KV heads"),
        (4, 2, 3, "does not split 4 KV heads evenly"),
        (6, 4, 8, "does not split 6"),
        (12, 4, 6, "multiple of the other"),
    ],
)
def test_pairings_that_cannot_work(total: int, p_tp: int, d_tp: int, match: str) -> None:
    with pytest.raises(IncompatiblePeerError, match=match) as err:
        check_pairing(total, p_tp, d_tp)
    assert err.value.fix


@pytest.mark.parametrize("layout", ["fused", "hnd"])
def test_part_table_cuts_each_block_into_head_ranges(layout: str) -> None:
    spec = CacheSpec(
        num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float16", layout=layout
    )
    geo = CacheGeometry(
        spec=spec,
        num_blocks=3,
        plane_bases=tuple(0x1000 * (i + 1) for i in range(2 * spec.planes_per_layer)),
        block_stride=spec.block_bytes + 64,
    )
    whole = geo.slot_table()
    cut = geo.part_table(2)
    assert cut.shape == (2 * whole.shape[0], 3)
    for slot in range(geo.num_slots):
        for k in range(2):
            assert cut[2 * slot + k, 0] == whole[slot, 0] + k * spec.block_bytes // 2
    assert (cut[:, 1] == spec.block_bytes // 2).all()
    assert np.array_equal(geo.part_table(1), whole)


def test_part_table_refuses_what_cannot_be_cut() -> None:
    nhd = CacheSpec(
        num_layers=1, block_size=4, num_kv_heads=4, head_dim=8, dtype="float16", layout="nhd"
    )
    with pytest.raises(PlanError, match="cannot cut nhd"):
        CacheGeometry(spec=nhd, num_blocks=2, plane_bases=(0x1000, 0x2000)).part_table(2)
    fused = CacheSpec(
        num_layers=1, block_size=4, num_kv_heads=4, head_dim=8, dtype="float16", layout="fused"
    )
    with pytest.raises(PlanError, match="into 3 head ranges"):
        CacheGeometry(spec=fused, num_blocks=2, plane_bases=(0x1000,)).part_table(3)
