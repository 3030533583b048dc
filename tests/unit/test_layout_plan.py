"""Geometry and planning checked against real numpy caches: numpy indexing is the
reference for which bytes a (layer, block) holds."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.plan import coalesce, plan_blocks, plan_regions
from kvbridge.errors import PlanError

L, N, BS, H, D = 3, 6, 4, 2, 8


def read(addr: int, nbytes: int) -> bytes:
    return ctypes.string_at(addr, nbytes)


def make_cache(layout: str, seed: int, dtype=np.float32, cross_layer: bool = False):
    """A KV cache laid out as the named engine does, plus its geometry and a function
    returning the exact bytes of (layer, plane, block) by numpy indexing."""
    rng = np.random.default_rng(seed)
    heads = 1 if layout == "latent" else H
    spec = CacheSpec(
        num_layers=L,
        block_size=BS,
        num_kv_heads=heads,
        head_dim=D,
        dtype=np.dtype(dtype).name,
        layout=layout,
    )
    if cross_layer:  # blocks of all layers interleaved: (N, L, 2, BS, H, D)
        arr = rng.standard_normal((N, L, 2, BS, H, D)).astype(dtype)
        bases = tuple(arr[0, l, p].ctypes.data for l in range(L) for p in range(2))
        geo = CacheGeometry(spec=spec, num_blocks=N, plane_bases=bases, block_stride=arr[0].nbytes)
        return [arr], geo, lambda l, p, b: arr[b, l, p].tobytes()
    if layout == "fused":  # vLLM CPU: per layer (N, H, BS, 2D)
        layers = [rng.standard_normal((N, H, BS, 2 * D)).astype(dtype) for _ in range(L)]
        bases = tuple(t.ctypes.data for t in layers)
        block = lambda l, p, b: layers[l][b].tobytes()  # noqa: E731
    elif layout == "latent":  # MLA: per layer (N, BS, D), one latent vector per token
        layers = [rng.standard_normal((N, BS, D)).astype(dtype) for _ in range(L)]
        bases = tuple(t.ctypes.data for t in layers)
        block = lambda l, p, b: layers[l][b].tobytes()  # noqa: E731
    else:  # per layer (2, N, BS, H, D) for nhd, (2, N, H, BS, D) for hnd
        shape = (2, N, BS, H, D) if layout == "nhd" else (2, N, H, BS, D)
        layers = [rng.standard_normal(shape).astype(dtype) for _ in range(L)]
        bases = tuple(t[p].ctypes.data for t in layers for p in range(2))
        block = lambda l, p, b: layers[l][p, b].tobytes()  # noqa: E731
    return layers, CacheGeometry(spec=spec, num_blocks=N, plane_bases=bases), block


@pytest.mark.parametrize("layout", ["fused", "nhd", "hnd", "latent"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_slot_addresses_match_numpy_indexing(layout: str, dtype) -> None:
    keep, geo, block = make_cache(layout, 0, dtype)
    planes = 1 if layout in ("fused", "latent") else 2
    assert geo.spec.planes_per_layer == planes
    assert geo.num_slots == L * planes * N
    table = geo.slot_table()
    for l in range(L):
        for p in range(planes):
            for b in range(N):
                s = geo.slot(l, p, b)
                addr, length, dev = (int(v) for v in table[s])
                assert (addr, dev) == (geo.slot_address(s), 0)
                assert read(addr, length) == block(l, p, b)
    # bytes per token across the whole cache, from the arrays themselves
    total = sum(t.nbytes for t in keep)
    assert geo.spec.bytes_per_token == total // (N * BS)


def test_cross_layer_stride() -> None:
    _, geo, block = make_cache("nhd", 1, cross_layer=True)
    for s in geo.slots([0, 5, 2]):
        l_p, b = divmod(int(s), N)
        assert read(geo.slot_address(int(s)), geo.spec.block_bytes) == block(l_p // 2, l_p % 2, b)
    # the interleaved cache is one region
    assert len(geo.regions()) == 1


def test_regions_cover_every_slot_and_merge() -> None:
    keep, geo, _ = make_cache("nhd", 2)
    regions = geo.regions()
    # each layer tensor holds K then V back to back: one region per layer
    assert sorted(regions) == sorted((t.ctypes.data, t.nbytes) for t in keep)
    table = geo.slot_table()
    for addr, length, _ in table.tolist():
        assert any(a <= addr and addr + length <= a + n for a, n in regions)


def test_slots_order_and_bounds() -> None:
    _, geo, _ = make_cache("nhd", 3)
    slots = geo.slots([4, 1], layers=[2, 0])
    expected = [geo.slot(l, p, b) for l in (2, 0) for p in (0, 1) for b in (4, 1)]
    assert slots.tolist() == expected
    with pytest.raises(PlanError, match="block id 6 out of range"):
        geo.slots([6])
    with pytest.raises(PlanError, match="block id -1"):
        geo.slots([-1])
    with pytest.raises(PlanError, match="layer out of range"):
        geo.slots([0], layers=[3])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plane_bases": (4096,)}, "needs 6 plane bases"),
        ({"num_blocks": 0}, "num_blocks must be positive"),
        ({"block_stride": 8}, "blocks would overlap"),
    ],
)
def test_geometry_rejects_inconsistent_input(kwargs: dict, message: str) -> None:
    spec = CacheSpec(
        num_layers=L, block_size=BS, num_kv_heads=H, head_dim=D, dtype="float32", layout="nhd"
    )
    args = {
        "spec": spec,
        "num_blocks": N,
        "plane_bases": tuple(range(4096, 4096 * 7, 4096)),
    } | kwargs
    with pytest.raises(ValueError, match=message):
        CacheGeometry(**args)


def test_spec_rejects_unknown_dtype_and_layout() -> None:
    with pytest.raises(ValueError, match="dtype 'complex64' is not supported"):
        CacheSpec(
            num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="complex64", layout="nhd"
        )
    with pytest.raises(ValueError, match="layout 'nhwc'"):
        CacheSpec(
            num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32", layout="nhwc"
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a latent .MLA. cache has one KV head, got 2"):
        CacheSpec(
            num_layers=1,
            block_size=16,
            num_kv_heads=2,
            head_dim=576,
            dtype="float32",
            layout="latent",
        )


def naive_coalesce(src, dst, length):
    """Reference: walk the pairs sorted by source, extending the current run."""
    runs: list[list[int]] = []
    for s, d, n in sorted(zip(src, dst, length, strict=True)):
        if n == 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
    return runs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.sampled_from([0, 4, 8])),
        max_size=30,
        unique_by=lambda t: t[0],
    )
)
def test_coalesce_matches_reference(triples) -> None:
    src = [t[0] * 8 for t in triples]
    dst = [t[1] * 8 for t in triples]
    lens = [t[2] for t in triples]
    r = coalesce(np.array(src), np.array(dst), np.array(lens))
    assert [
        list(x) for x in zip(r.src.tolist(), r.dst.tolist(), r.length.tolist(), strict=True)
    ] == naive_coalesce(src, dst, lens)
    assert r.nbytes == sum(lens)


def test_coalesce_rejects_ragged_input() -> None:
    with pytest.raises(PlanError, match="differ in length"):
        coalesce(np.array([0, 8]), np.array([0]), np.array([8, 8]))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["fused", "nhd", "hnd", "latent"]),
    st.permutations(range(N)),
    st.permutations(range(N)),
    st.integers(1, N),
    st.sets(st.integers(0, L - 1), min_size=1),
)
def test_plan_moves_the_right_bytes(layout, src_perm, dst_perm, count, layers) -> None:
    """Executing a plan with memmove equals copying block by block with numpy."""
    _, src_geo, src_block = make_cache(layout, 10)
    _dst_keep, dst_geo, dst_block = make_cache(layout, 11)
    src_blocks, dst_blocks = list(src_perm[:count]), list(dst_perm[:count])
    before = {
        (l, p, b): dst_block(l, p, b)
        for l in range(L)
        for p in range(src_geo.spec.planes_per_layer)
        for b in range(N)
    }
    plan = plan_blocks(src_geo, dst_geo, src_blocks, dst_blocks, layers=sorted(layers))
    assert (
        plan.nbytes
        == count * len(layers) * src_geo.spec.planes_per_layer * src_geo.spec.block_bytes
    )
    regions = plan_regions(plan, src_geo, dst_geo)
    assert regions.nbytes == plan.nbytes and len(regions) <= plan.num_descriptors
    for s, d, n in zip(
        regions.src.tolist(), regions.dst.tolist(), regions.length.tolist(), strict=True
    ):
        ctypes.memmove(d, s, n)
    moved = {
        (l, p, db): sb
        for sb, db in zip(src_blocks, dst_blocks, strict=True)
        for l in layers
        for p in range(src_geo.spec.planes_per_layer)
    }
    for key, old in before.items():
        want = src_block(key[0], key[1], moved[key]) if key in moved else old
        assert dst_block(*key) == want, key


def test_contiguous_blocks_coalesce_to_one_region_per_plane() -> None:
    _, a, _ = make_cache("nhd", 20)
    _, b, _ = make_cache("nhd", 21)
    plan = plan_blocks(a, b, [1, 2, 3, 4], [0, 1, 2, 3])
    assert plan.num_descriptors == 4 * L * 2
    assert len(plan_regions(plan, a, b)) == L * 2


def test_plan_refuses_different_specs_and_lengths() -> None:
    _, a, _ = make_cache("nhd", 30)
    _, b, _ = make_cache("hnd", 31)
    with pytest.raises(PlanError, match="layout: 'nhd' vs 'hnd'"):
        plan_blocks(a, b, [0], [0])
    with pytest.raises(PlanError, match="1 local vs 2 remote"):
        plan_blocks(a, a, [0], [0, 1])


def test_layer_slices_equal_single_layer_plans() -> None:
    _, a, _ = make_cache("hnd", 40)
    _, b, _ = make_cache("hnd", 41)
    whole = plan_blocks(a, b, [5, 0, 3], [1, 2, 4])
    for layer in range(L):
        single = plan_blocks(a, b, [5, 0, 3], [1, 2, 4], layers=[layer])
        part = whole.for_layer(layer)
        assert part.layers == (layer,)
        np.testing.assert_array_equal(part.local_slots, single.local_slots)
        np.testing.assert_array_equal(part.remote_slots, single.remote_slots)
    partial = plan_blocks(a, b, [1], [1], layers=[2, 0])
    np.testing.assert_array_equal(
        partial.for_layer(0).local_slots, plan_blocks(a, b, [1], [1], layers=[0]).local_slots
    )
    with pytest.raises(PlanError, match="layer 1 is not part of this plan"):
        partial.for_layer(1)


def _run_slots(
    src_geo: CacheGeometry,
    dst_geo: CacheGeometry,
    lidx: np.ndarray,
    ridx: np.ndarray,
    into_local: bool = False,
) -> None:
    """Execute paired slot indices with memmove (a write local -> remote, or a read)."""
    for ls, rs in zip(lidx.tolist(), ridx.tolist(), strict=True):
        src, dst = (
            (dst_geo.slot_address(rs), src_geo.slot_address(ls))
            if into_local
            else (src_geo.slot_address(ls), dst_geo.slot_address(rs))
        )
        ctypes.memmove(dst, src, src_geo.spec.block_bytes)


@pytest.mark.parametrize("layout", ["fused", "nhd"])
def test_grouped_plan_moves_each_layer_s_group_and_skips_what_the_destination_lacks(
    layout: str,
) -> None:
    """Layers 0 and 2 in group 0 (full attention), layer 1 in group 1 (a sliding window
    whose first two positions the destination does not hold): every block of group 0,
    group 1's last two only; nothing else of the destination changes."""
    from kvbridge.core.blocks import NONE, BlockTable
    from kvbridge.core.plan import plan_grouped

    _, src_geo, src_block = make_cache(layout, 50)
    _, dst_geo, dst_block = make_cache(layout, 51)
    planes = src_geo.spec.planes_per_layer
    src = BlockTable.grouped([[0, 1, 2, 3], [4, 5, 1, 0]])  # the groups' ids are unrelated
    dst = BlockTable.grouped([[5, 4, 3, 2], [NONE, NONE, 0, 1]])
    before = {
        (l, p, b): dst_block(l, p, b) for l in range(L) for p in range(planes) for b in range(N)
    }
    lidx, ridx = plan_grouped(src_geo, dst_geo, src, dst, layer_groups=(0, 1, 0))
    _run_slots(src_geo, dst_geo, lidx, ridx)
    moved = {
        (l, p, d): s
        for l in (0, 2)
        for p in range(planes)
        for s, d in zip([0, 1, 2, 3], [5, 4, 3, 2], strict=True)
    }
    moved |= {(1, p, d): s for p in range(planes) for s, d in ((1, 0), (0, 1))}
    for key, old in before.items():
        want = src_block(key[0], key[1], moved[key]) if key in moved else old
        assert dst_block(*key) == want, key
    assert lidx.size == (2 * 4 + 2) * planes

    # the other direction: a read into local blocks; only the layers asked for
    lidx, ridx = plan_grouped(
        dst_geo, src_geo, dst, src, layer_groups=(0, 1, 0), layers=[1], into_local=True
    )
    assert lidx.size == 2 * planes


def test_grouped_plan_refuses_lost_blocks_and_tables_that_do_not_fit() -> None:
    from kvbridge.core.blocks import NONE, BlockTable
    from kvbridge.core.plan import plan_grouped

    _, a, _ = make_cache("nhd", 60)
    _, b, _ = make_cache("nhd", 61)
    src = BlockTable.grouped([[0, 1], [NONE, 2]])
    dst = BlockTable.grouped([[3, 4], [5, 0]])
    with pytest.raises(
        PlanError,
        match=r"group 1: the destination expects position 0 .* which the source no longer holds",
    ):
        plan_grouped(a, b, src, dst, layer_groups=(0, 1, 0))
    # the other way nothing is lost
    lidx, _ = plan_grouped(b, a, dst, src, layer_groups=(0, 1, 0), into_local=False)
    assert lidx.size == (2 * 2 + 1) * 2
    with pytest.raises(
        PlanError,
        match="2 \\(local\\) and 1 \\(remote\\) KV cache groups for a cache whose layers form 2",
    ):
        plan_grouped(a, b, src, BlockTable.flat([3, 4]), layer_groups=(0, 1, 0))
    with pytest.raises(PlanError, match="2 local vs 1 remote"):
        plan_grouped(a, b, src, dst[:1], layer_groups=(0, 1, 0))
    with pytest.raises(PlanError, match="differ in length"):
        BlockTable.grouped([[1, 2], [3]])


def test_block_tables_slice_join_and_cross_the_wire() -> None:
    from kvbridge.core.blocks import NONE, BlockTable

    t = BlockTable.grouped([[1, 2, 3], [NONE, 5, 6]])
    assert len(t) == 3 and t.num_groups == 2 and list(t) == [(1, NONE), (2, 5), (3, 6)]
    assert t[1:] + t[:1] == BlockTable.grouped([[2, 3, 1], [5, 6, NONE]])
    assert BlockTable.from_wire(*t.to_wire()) == t
    assert BlockTable.from_wire([7, 8]) == [7, 8] and BlockTable.of([7, 8]).to_wire() == (
        [7, 8],
        [],
    )
    with pytest.raises(
        PlanError, match="one block list per request; the request has 2 KV cache groups"
    ):
        t.flat_ids()
    with pytest.raises(PlanError, match="cannot join block tables of 2 and 1"):
        t + BlockTable.flat([1])


def test_grouped_plan_between_tp_splits_pairs_each_group_s_head_ranges() -> None:
    """A prefill of TP 1 (2 heads) writing to decode rank 1 of TP 2 (1 head): per group
    the head-range plan of the positions the destination holds, nothing else."""
    from kvbridge.core.blocks import NONE, BlockTable
    from kvbridge.core.plan import plan_grouped, plan_parts
    from kvbridge.core.tp import pair_split

    _, src, _ = make_cache("hnd", 70)
    half = CacheSpec(
        num_layers=L, block_size=BS, num_kv_heads=1, head_dim=D, dtype="float32", layout="hnd"
    )
    dst = CacheGeometry(
        spec=half, num_blocks=N, plane_bases=tuple(0x100000 * (i + 1) for i in range(2 * L))
    )
    split = pair_split(2, 1, 2, 0, 1, prefill=True)
    ours, theirs = (
        BlockTable.grouped([[0, 1, 2], [3, 4, 5]]),
        BlockTable.grouped([[2, 3, 4], [NONE, NONE, 0]]),
    )
    lidx, ridx = plan_grouped(src, dst, ours, theirs, layer_groups=(0, 1, 0), split=split)
    full = plan_parts(src, dst, [0, 1, 2], [2, 3, 4], split, layers=[0, 2])
    window = plan_parts(src, dst, [5], [0], split, layers=[1])
    np.testing.assert_array_equal(lidx, np.concatenate([full.local_slots, window.local_slots]))
    np.testing.assert_array_equal(ridx, np.concatenate([full.remote_slots, window.remote_slots]))


def test_state_layers_move_only_their_state_and_refuse_head_and_token_cuts() -> None:
    """A state-space layer's block holds its state at the start of a page the size of an
    attention block (vLLM's hybrid manager): its slots are that many bytes, at the same
    addresses; head ranges (another TP split) and smaller transfer blocks cannot cut it."""
    spec = CacheSpec(
        num_layers=3, block_size=BS, num_kv_heads=H, head_dim=D, dtype="float32", layout="fused"
    )
    pages = [np.arange(N * spec.block_bytes, dtype=np.uint8).reshape(N, -1) for _ in range(3)]
    geo = CacheGeometry(
        spec=spec,
        num_blocks=N,
        plane_bases=tuple(p.ctypes.data for p in pages),
        layer_bytes=(spec.block_bytes, 100, spec.block_bytes),
    )
    table = geo.slot_table()
    assert (
        table[:, 0].tolist()
        == CacheGeometry(spec=spec, num_blocks=N, plane_bases=geo.plane_bases)
        .slot_table()[:, 0]
        .tolist()
    )
    assert table[:, 1].tolist() == [spec.block_bytes] * N + [100] * N + [spec.block_bytes] * N
    assert [geo.layer_block_bytes(layer) for layer in range(3)] == [
        spec.block_bytes,
        100,
        spec.block_bytes,
    ]
    with pytest.raises(PlanError, match="state-space layers into 2 head ranges"):
        geo.part_table(2)
    with pytest.raises(PlanError, match="cannot be moved in blocks of 2 tokens"):
        geo.in_blocks_of(2)
    with pytest.raises(ValueError, match="one entry per layer"):
        CacheGeometry(spec=spec, num_blocks=N, plane_bases=geo.plane_bases, layer_bytes=(100,))
    with pytest.raises(ValueError, match="at most the block stride"):
        CacheGeometry(
            spec=spec,
            num_blocks=N,
            plane_bases=geo.plane_bases,
            layer_bytes=(100, spec.block_bytes + 1, 100),
        )
    nhd = CacheSpec(
        num_layers=1, block_size=BS, num_kv_heads=H, head_dim=D, dtype="float32", layout="nhd"
    )
    with pytest.raises(ValueError, match="one-plane layout"):
        CacheGeometry(spec=nhd, num_blocks=N, plane_bases=(0x1000, 0x9000), layer_bytes=(100,))
