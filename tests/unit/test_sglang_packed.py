"""The packed path (``wire_dtype: fp8``, or exact with ``data_path: packed``) for the
SGLang backend, without SGLang: two SGLang-shaped KV pools
(per-layer K and V buffers of ``(pages * page_size, heads, dim)``, as SGLang allocates
them), each seen through :func:`pool_planes` and packed / unpacked by a real
:class:`~kvbridge.runtime.packed.PackedPath` on the loopback transport; the bytes a
transport would move are copied slot for slot as :func:`room_slots` maps them. The decode
pages end up within FP8 error of the prefill's (exact: equal), the other pages
untouched."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvbridge.adapters.sglang.packed import (
    Part,
    RoomReservations,
    decode_parts,
    part_start,
    pool_planes,
    room_part,
    room_slots,
    typed_geometry,
    window_start,
)
from kvbridge.adapters.sglang.pools import kv_geometry
from kvbridge.errors import ConfigError, IncompatiblePeerError, PlanError
from kvbridge.runtime.packed import PackedPath, staging_descs
from kvbridge.transports.loopback import LoopbackTransport

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 12, 4, 2, 16


def sglang_pool(seed: int | None, dtype: torch.dtype = torch.bfloat16):
    """K and V buffers per layer and the opaque geometry SGLang's KVArgs give for them."""
    gen = torch.Generator().manual_seed(seed or 0)
    make = (
        (lambda: torch.randn(PAGES * PAGE, HEADS, DIM, generator=gen).to(dtype))
        if seed is not None
        else (lambda: torch.zeros(PAGES * PAGE, HEADS, DIM, dtype=dtype))
    )
    k = [make() for _ in range(LAYERS)]
    v = [make() for _ in range(LAYERS)]
    bufs = k + v
    geo = kv_geometry(
        page_size=PAGE,
        ptrs=[b.data_ptr() for b in bufs],
        lens=[b.numel() * b.element_size() for b in bufs],
        item_lens=[PAGE * HEADS * DIM * bufs[0].element_size()] * len(bufs),
    )
    return k, v, geo


def test_typed_geometry_finds_the_heads_and_refuses_rows_that_do_not_split() -> None:
    _, _, opaque = sglang_pool(1)
    typed = typed_geometry(opaque, dtype="bfloat16", head_dim=DIM)
    assert (typed.spec.num_kv_heads, typed.spec.head_dim, typed.spec.dtype) == (
        HEADS,
        DIM,
        "bfloat16",
    )
    assert typed.plane_bases == opaque.plane_bases and typed.num_blocks == opaque.num_blocks
    assert typed.spec.block_bytes == opaque.spec.block_bytes
    with pytest.raises(ConfigError, match="wire_dtype"):
        # 64 bytes per token: no whole heads
        typed_geometry(opaque, dtype="float32", head_dim=3 * DIM)
    with pytest.raises(ConfigError, match="wire_dtype"):
        typed_geometry(opaque, dtype="int4", head_dim=DIM)


def test_pool_planes_are_views_of_sglangs_buffers() -> None:
    k, v, opaque = sglang_pool(2)
    planes = pool_planes(typed_geometry(opaque, dtype="bfloat16", head_dim=DIM))
    assert len(planes) == LAYERS
    pk, pv = planes[3]
    assert tuple(pk.shape) == (PAGES, PAGE, HEADS, DIM)
    assert torch.equal(pk[5, 1], k[3][5 * PAGE + 1]) and torch.equal(pv[0, 3], v[3][3])
    pv[7, 2, 1, 4] = 42.0  # the same memory
    assert v[3][7 * PAGE + 2, 1, 4].item() == 42.0


def mla_pool(seed: int | None, latent: int = 576, dtype: torch.dtype = torch.bfloat16):
    """An SGLang MLA pool: one ``(pages * page_size, 1, latent)`` buffer per layer."""
    gen = torch.Generator().manual_seed(seed or 0)
    bufs = [
        torch.randn(PAGES * PAGE, 1, latent, generator=gen).to(dtype)
        if seed is not None
        else torch.zeros(PAGES * PAGE, 1, latent, dtype=dtype)
        for _ in range(LAYERS)
    ]
    geo = kv_geometry(
        page_size=PAGE,
        ptrs=[b.data_ptr() for b in bufs],
        lens=[b.numel() * b.element_size() for b in bufs],
        item_lens=[PAGE * latent * bufs[0].element_size()] * LAYERS,
        mla=True,
    )
    return bufs, geo


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "exact"])
def test_an_mla_pool_packs_as_its_vectors_halves_into_the_decode_pages(fp8: bool) -> None:
    """SGLang's MLA pool: the typed geometry is one latent 'head' of the whole row
    (whatever the model's head_dim), its planes are each vector's halves over the pool's
    memory, and a room's pages cross through staging: exact bit for bit, FP8 within
    FP8 error, the other pages untouched."""
    p_bufs, p_opaque = mla_pool(5)
    d_bufs, d_opaque = mla_pool(None)
    # the model's head_dim: ignored
    p_geo, d_geo = (typed_geometry(g, dtype="bfloat16", head_dim=64) for g in (p_opaque, d_opaque))
    assert (p_geo.spec.layout, p_geo.spec.num_kv_heads, p_geo.spec.head_dim) == ("latent", 1, 576)
    planes = pool_planes(p_geo)
    k, v = planes[2]
    assert tuple(k.shape) == (PAGES, PAGE, 1, 288)
    assert torch.equal(k[5, 1, 0], p_bufs[2][5 * PAGE + 1, 0, :288]) and torch.equal(
        v[5, 1, 0], p_bufs[2][5 * PAGE + 1, 0, 288:]
    )
    prefill = PackedPath(p_geo, planes, 1, LoopbackTransport("p"), fp8=fp8)
    decode = PackedPath(d_geo, pool_planes(d_geo), 1, LoopbackTransport("d"), fp8=fp8)
    src_pages, dst_pages = np.array([4, 9, 1]), np.array([0, 11, 3])
    first, dfirst = prefill.allocator.alloc(LAYERS * 3), decode.allocator.alloc(LAYERS * 3)
    prefill.pack(list(range(LAYERS)), src_pages, first)
    # what the transport moves
    decode.view(dfirst, LAYERS * 3).copy_(prefill.view(first, LAYERS * 3))
    for layer in range(LAYERS):
        decode.unpack(layer, dst_pages, dfirst + layer * 3)
        src = p_bufs[layer].view(PAGES, PAGE, 576)[torch.as_tensor(src_pages)]
        got = d_bufs[layer].view(PAGES, PAGE, 576)[torch.as_tensor(dst_pages)]
        if fp8:
            assert 0 < rows_rel_err(src, got) < 0.07, f"layer {layer}"
        else:
            assert torch.equal(src, got), f"layer {layer}"
        others = np.setdiff1d(np.arange(PAGES), dst_pages)
        assert not d_bufs[layer].view(PAGES, PAGE, 576)[torch.as_tensor(others)].any()


# Which prefill ranks SGLang 0.5.23's receiver connects an MLA decode rank to, the real
# one first (its dummy destinations go to the rest): written out from its rank mapping
# for these sizes, (prefill TP, decode TP) -> per decode rank.
SGLANG_MLA_TARGETS = {
    (1, 1): [[0]],
    (1, 2): [[0], [0]],
    (2, 4): [[0], [0], [1], [1]],
    (2, 1): [[0, 1]],
    (4, 2): [[0, 1], [2, 3]],
    (4, 1): [[0, 1, 2, 3]],
}


@pytest.mark.parametrize(("p_tp", "d_tp"), list(SGLANG_MLA_TARGETS))
def test_mla_pools_pair_on_the_packed_path_as_sglang_maps_their_ranks(p_tp: int, d_tp: int) -> None:
    """Every prefill rank SGLang connects a decode rank to pairs as the whole latent
    cache (part 0 of 1: whichever gets the real destination writes it), no other rank
    does, and the decode expects one source."""
    for d_rank, targets in enumerate(SGLANG_MLA_TARGETS[(p_tp, d_tp)]):
        for p_rank in range(p_tp):
            part = room_part(1, p_tp, d_tp, p_rank, d_rank, latent=True)
            if p_rank in targets:
                assert part == Part(index=0, sources=1, heads=1, p_heads=(0, 1), d_heads=(0, 1)), (
                    p_rank,
                    d_rank,
                )
            else:
                assert part is None, (p_rank, d_rank)
        assert decode_parts(1, p_tp, d_tp, d_rank, latent=True) == (
            room_part(1, p_tp, d_tp, targets[0], d_rank, latent=True),
        )


def test_mla_pools_of_tp_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="multiple of the other"):
        decode_parts(1, 2, 3, 0, latent=True)


# The same for an MHA pool (every target real), (KV heads, prefill TP, decode TP) -> per
# decode rank; with replicas on the decode side (more decode ranks than heads) too.
SGLANG_MHA_TARGETS = {
    (8, 1, 2): [[0], [0]],
    (8, 2, 1): [[0, 1]],
    (8, 2, 4): [[0], [0], [1], [1]],
    (8, 4, 2): [[0, 1], [2, 3]],
    (2, 1, 4): [[0], [0], [0], [0]],
    (2, 2, 4): [[0], [0], [1], [1]],
}


@pytest.mark.parametrize(("total", "p_tp", "d_tp"), list(SGLANG_MHA_TARGETS))
def test_mha_parts_come_from_the_prefill_ranks_sglang_connects(
    total: int, p_tp: int, d_tp: int
) -> None:
    """The packed parts of an MHA pool use kvbridge's own head split: for the pairings it
    accepts, each decode rank's sources must be exactly the ranks SGLang sends real
    destinations to, or a part would wait on a rank that never writes."""
    for d_rank, targets in enumerate(SGLANG_MHA_TARGETS[(total, p_tp, d_tp)]):
        sources = [p for p in range(p_tp) if room_part(total, p_tp, d_tp, p, d_rank) is not None]
        assert sources == targets, f"decode rank {d_rank}"
        parts = decode_parts(total, p_tp, d_tp, d_rank)
        assert [p.index for p in parts] == list(range(len(targets))) and {
            p.sources for p in parts
        } == {len(targets)}


def test_room_slots_are_layer_major_and_bounded() -> None:
    assert room_slots(10, 3, [1, 2], np.array([0, 2])).tolist() == [13, 15, 16, 18]
    with pytest.raises(PlanError, match="outside"):
        room_slots(0, 3, [0], np.array([3]))


def rows_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().reshape(-1, DIM), b.float().reshape(-1, DIM)
    return ((a - b).norm(dim=1) / a.norm(dim=1)).max().item()


TOTAL = 4  # the model's KV heads in the TP tests below


def tp_pools(
    tp: int, seed: int | None, *, pages: int = PAGES, layers: int = LAYERS, heads: int = TOTAL
) -> list:
    """One SGLang pool of ``layers`` layers over ``pages`` pages per rank of a
    TP-``tp`` instance: rank ``r`` holds heads ``[r * heads / tp, ...)`` of the same
    random model KV (zeros: ``seed`` None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    model = [
        torch.randn(pages * PAGE, heads, DIM, generator=gen).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]
    if seed is None:
        model = [torch.zeros_like(b) for b in model]
    n = heads // tp
    pools = []
    for r in range(tp):
        bufs = [b[:, r * n : (r + 1) * n].contiguous() for b in model]
        geo = kv_geometry(
            page_size=PAGE,
            ptrs=[b.data_ptr() for b in bufs],
            lens=[b.numel() * b.element_size() for b in bufs],
            item_lens=[PAGE * n * DIM * bufs[0].element_size()] * len(bufs),
        )
        pools.append((bufs, typed_geometry(geo, dtype="bfloat16", head_dim=DIM)))
    return pools


def _copy_chunks(
    src: PackedPath, src_chunks: np.ndarray, dst: PackedPath, dst_chunks: np.ndarray, heads: int
) -> None:
    """What a transport's write does: descriptor for descriptor, through both buffers'
    chunk tables (:func:`staging_descs` cut at the pairing's chunk size)."""
    size = src.chunk(heads).nbytes
    assert dst.chunk(heads).nbytes == size
    s_tab, d_tab = staging_descs(src.info, size), staging_descs(dst.info, size)
    for s, d in zip(src_chunks, dst_chunks, strict=True):
        ctypes.memmove(int(d_tab[d, 0]), int(s_tab[s, 0]), size)


@pytest.mark.parametrize("fp8", [False, True], ids=["exact", "fp8"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (1, 4), (4, 2)])
def test_a_room_moves_between_tp_sizes_through_staging_chunks(
    p_tp: int, d_tp: int, fp8: bool
) -> None:
    """What the manager does for one room, rank by rank: each decode rank reserves one
    part per source (:func:`decode_parts`); each prefill rank packs, per decode rank it
    feeds (:func:`room_part`), that rank's heads of the room's pages into chunks and
    writes them into the source's part of the run; each decode rank unpacks a part as
    its ``Done`` arrives and frees the run after the last. Exact: bit for bit; FP8:
    within FP8 error. Other pages stay untouched, every staging chunk comes back."""
    prefill = [
        (bufs, PackedPath(g, pool_planes(g), 1, LoopbackTransport(f"p{r}"), fp8=fp8))
        for r, (bufs, g) in enumerate(tp_pools(p_tp, 5))
    ]
    decode = [
        (bufs, PackedPath(g, pool_planes(g), 1, LoopbackTransport(f"d{r}"), fp8=fp8))
        for r, (bufs, g) in enumerate(tp_pools(d_tp, None))
    ]
    model = tp_pools(1, 5)[0][0]
    src_pages, dst_pages = np.array([4, 9, 1, 6, 2]), np.array([0, 11, 3, 8, 5])
    P = dst_pages.size
    rooms = []
    for d, (_, path) in enumerate(decode):
        parts = decode_parts(TOTAL, p_tp, d_tp, d)
        assert [p.d_heads for p in parts] == sorted(p.d_heads for p in parts) and parts[-1].d_heads[
            1
        ] == TOTAL // d_tp
        r = RoomReservations(path, num_layers=LAYERS, hold_s=5.0)
        res = r.reserve(77, dst_pages, parts)
        assert res is not None
        rooms.append((r, res))
    for p, (_, path) in enumerate(prefill):
        fed = [(d, room_part(TOTAL, p_tp, d_tp, p, d)) for d in range(d_tp)]
        fed = [(d, part) for d, part in fed if part is not None]
        assert fed, f"prefill rank {p} feeds no decode rank"
        for layers, positions in (
            ([0, 1], np.arange(P)),
            ([2, 3], np.array([0, 1, 2])),
            ([2, 3], np.array([3, 4])),
        ):
            for d, part in fed:  # as _post: one pack per head range
                count = len(layers) * positions.size
                run = path.reserve(count, part.heads)
                whole = part.heads == path.slot.num_heads
                path.pack(
                    layers, src_pages[positions], run.first, heads=None if whole else part.p_heads
                )
                res = rooms[d][1]
                dst = room_slots(res.part_first(part.index, LAYERS), P, layers, positions)
                _copy_chunks(
                    path, np.arange(run.first, run.first + count), decode[d][1], dst, part.heads
                )
                path.release(run)
        assert path.allocator.free_slots == path.allocator.num_slots
    for d, (bufs, path) in enumerate(decode):  # every source's Done, last one first
        r, res = rooms[d]
        for index in reversed(range(len(res.parts))):
            got, last = r.arrive(77, index)
            assert got == res and last == (index == 0)
            part = res.parts[index]
            whole = part.heads == path.slot.num_heads
            for layer in range(LAYERS):
                path.unpack(
                    layer,
                    res.pages,
                    res.part_first(index, LAYERS) + layer * P,
                    heads=None if whole else part.d_heads,
                )
        assert r.arrive(77, 0) == (None, False), "a repeated Done must not unpack twice"
        r.free(res)
        assert path.allocator.free_slots == path.allocator.num_slots
        n = TOTAL // d_tp
        for i, buf in enumerate(bufs):
            want = model[i].view(PAGES, PAGE, TOTAL, DIM)[
                torch.as_tensor(src_pages), :, d * n : (d + 1) * n
            ]
            got = buf.view(PAGES, PAGE, n, DIM)[torch.as_tensor(dst_pages)]
            if fp8:
                assert rows_rel_err(want, got) < 0.07, f"decode rank {d}, buffer {i}"
            else:
                assert torch.equal(want, got), f"decode rank {d}, buffer {i}"
            others = np.setdiff1d(np.arange(PAGES), dst_pages)
            assert buf.view(PAGES, PAGE, n, DIM)[torch.as_tensor(others)].abs().sum().item() == 0


def test_tp_sizes_that_do_not_pair_are_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="multiple"):
        decode_parts(TOTAL, 2, 3, 0)
    with pytest.raises(IncompatiblePeerError, match="replicas"):
        room_part(2, 4, 2, 0, 0)  # 4 prefill ranks hold 2 heads twice over
    assert room_part(TOTAL, 1, 2, 0, 1) is not None and room_part(TOTAL, 2, 4, 0, 3) is None


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "exact"])
def test_a_room_goes_through_packed_slots_into_the_decode_pages(fp8: bool) -> None:
    """FP8: within FP8 error; exact (``data_path: packed``): bit for bit."""
    pk, pv, p_opaque = sglang_pool(3)
    dk, dv, d_opaque = sglang_pool(None)
    p_geo, d_geo = (typed_geometry(g, dtype="bfloat16", head_dim=DIM) for g in (p_opaque, d_opaque))
    prefill = PackedPath(p_geo, pool_planes(p_geo), 1, LoopbackTransport("p"), fp8=fp8)
    decode = PackedPath(d_geo, pool_planes(d_geo), 1, LoopbackTransport("d"), fp8=fp8)
    reservations = RoomReservations(decode, num_layers=LAYERS, hold_s=5.0)
    src_pages = np.array([4, 9, 1, 6, 2])  # the prefill's pages of the room, in order
    dst_pages = np.array([0, 11, 3, 8, 5])  # the decode's (its Destination)
    res = reservations.reserve(77, dst_pages, decode_parts(HEADS, 1, 1, 0))
    assert res is not None

    def post(layers: list[int], positions: np.ndarray) -> None:
        """What the manager's _pack + one write do for one destination."""
        first = prefill.allocator.alloc(len(layers) * positions.size)
        prefill.pack(layers, src_pages[positions], first)
        src = np.arange(first, first + len(layers) * positions.size)
        dst = room_slots(res.first, dst_pages.size, layers, positions)
        for s, d in zip(src, dst, strict=True):
            decode.view(int(d), 1).copy_(prefill.view(int(s), 1))
        prefill.allocator.free(first, len(layers) * positions.size)

    post([0, 1], np.arange(5))  # two layers streamed whole
    post([2, 3], np.array([0, 1, 2]))  # the rest in two chunks
    post([2, 3], np.array([3, 4]))
    taken, last = reservations.arrive(77, 0)
    assert taken == res and last and reservations.arrive(77, 0) == (None, False)
    for layer in range(LAYERS):
        decode.unpack(layer, taken.pages, taken.first + layer * taken.pages.size)
    reservations.free(taken)
    assert decode.allocator.free_slots == decode.allocator.num_slots
    for layer in range(LAYERS):
        for buf_p, buf_d in ((pk, dk), (pv, dv)):
            src = buf_p[layer].view(PAGES, PAGE, HEADS, DIM)[torch.as_tensor(src_pages)]
            got = buf_d[layer].view(PAGES, PAGE, HEADS, DIM)[torch.as_tensor(dst_pages)]
            if fp8:
                assert rows_rel_err(src, got) < 0.07, f"layer {layer}"
            else:
                assert torch.equal(src, got), f"layer {layer}"
            others = np.setdiff1d(np.arange(PAGES), dst_pages)
            assert (
                buf_d[layer]
                .view(PAGES, PAGE, HEADS, DIM)[torch.as_tensor(others)]
                .abs()
                .sum()
                .item()
                == 0
            )


def test_reservations_end_once_and_retired_runs_wait_out_their_hold() -> None:
    _, _, opaque = sglang_pool(None)
    geo = typed_geometry(opaque, dtype="bfloat16", head_dim=DIM)
    path = PackedPath(geo, pool_planes(geo), 1, LoopbackTransport("d"), fp8=False)
    alloc = path.allocator
    total = alloc.num_slots
    r = RoomReservations(path, num_layers=3, hold_s=10.0)
    one = decode_parts(HEADS, 1, 1, 0)
    pages = total // 3 * 2 // 3  # a room of these takes about two thirds of the buffer
    a = r.reserve(1, np.arange(pages), one)
    assert a is not None and r.reserve(2, np.arange(pages), one) is None
    assert r.fits(total // 3, one) and not r.fits(total // 3 + 1, one)
    with pytest.raises(PlanError, match="no pages"):
        r.reserve(3, np.array([], dtype=np.int64), one)
    r.retire(1, now=100.0)
    r.retire(1, now=100.0)  # a second clear of the room frees nothing twice
    assert len(r) == 0 and r.arrive(1, 0) == (None, False)
    assert r.reap(now=109.0) == 0 and alloc.free_slots == total - 3 * pages
    assert r.reap(now=110.0) == 1 and alloc.free_slots == total
    b = r.reserve(2, np.arange(2), one)
    again = r.reserve(2, np.arange(2), one)  # the same room id again: the first run is held
    assert b is not None and again is not None and again.first != b.first
    assert r.arrive(2, 0) == (again, True)
    r.free(again)
    assert r.reap(now=float("inf")) == 1 and alloc.free_slots == total
    two = decode_parts(2 * HEADS, 2, 1, 0)  # two sources of HEADS // ... heads each
    c = r.reserve(4, np.arange(2), two)
    assert c is not None and c.part_first(1, 3) == c.first + 3 * 2
    assert (
        r.arrive(4, 1) == (c, False)
        and r.arrive(4, 1) == (None, False)
        and r.arrive(4, 2) == (None, False)
    )
    r.retire(4, now=0.0)  # cleared with one part in: held, then freed once
    assert r.arrive(4, 0) == (None, False) and r.reap(now=10.0) == 1 and alloc.free_slots == total


# --- a hybrid sliding-window pool (SGLang's SWAKVPool): window layers in a sub-pool of
# their own, fewer pages, the same rows; each part of a room run holds their chunks of
# the room's window pages after its full-attention layers.

WINDOW_LAYERS, WINDOW_PAGES = 2, 5


@pytest.mark.parametrize(("sources", "pages", "window_pages"), [(1, 3, 2), (2, 4, 1), (4, 1, 0)])
def test_window_chunks_follow_each_parts_full_layers_and_fill_the_run(
    sources: int, pages: int, window_pages: int
) -> None:
    """Every chunk of a room run belongs to exactly one (part, layer, position), full
    or window, and the run holds them all: what the prefill writes and the decode
    unpacks never overlap, nor reach past the run."""
    _, _, opaque = sglang_pool(None)
    path = PackedPath(
        typed_geometry(opaque, dtype="bfloat16", head_dim=DIM),
        pool_planes(typed_geometry(opaque, dtype="bfloat16", head_dim=DIM)),
        1,
        LoopbackTransport("d"),
        fp8=False,
    )
    r = RoomReservations(path, num_layers=LAYERS, hold_s=1.0, window_layers=WINDOW_LAYERS)
    parts = decode_parts(sources * HEADS, sources, 1, 0)
    res = r.reserve(9, np.arange(pages), parts, np.arange(window_pages))
    assert res is not None
    size = LAYERS * pages + WINDOW_LAYERS * window_pages
    seen: list[int] = []
    for part in parts:
        first = res.part_first(part.index, LAYERS)
        assert first == part_start(res.first, part.index, LAYERS, pages, res.window_chunks)
        seen += room_slots(first, pages, range(LAYERS), np.arange(pages)).tolist()
        seen += room_slots(
            window_start(first, LAYERS, pages),
            window_pages,
            range(WINDOW_LAYERS),
            np.arange(window_pages),
        ).tolist()
    assert sorted(seen) == list(range(res.first, res.first + sources * size))
    assert path.slots_for(sources * size, parts[0].heads) == res.run.slots
    with pytest.raises(PlanError, match="no sliding-window pages"):
        r.reserve(10, np.arange(pages), parts)  # a window pool's room without them
    with pytest.raises(PlanError, match="some sliding-window pages"):
        RoomReservations(path, num_layers=LAYERS, hold_s=1.0).reserve(
            11, np.arange(pages), parts, np.arange(1)
        )


def window_pools(tp: int, seed: int | None, heads: int = TOTAL) -> list:
    """Per rank of a TP-``tp`` instance: its window sub-pool (:func:`tp_pools` of
    ``WINDOW_LAYERS`` layers over ``WINDOW_PAGES`` pages)."""
    return tp_pools(tp, seed, pages=WINDOW_PAGES, layers=WINDOW_LAYERS, heads=heads)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_a_rooms_window_pages_cross_between_tp_sizes_after_its_full_layers(
    p_tp: int, d_tp: int
) -> None:
    """The window layers of a room, as the manager moves them on the packed path: each
    prefill rank packs the decode rank's heads of its window pages (the window pool
    seen through :meth:`PackedPath.sibling`) into chunks, written at
    :func:`window_start` of its part; the decode unpacks them into its window pages.
    Exact values, the other window pages untouched; full-attention chunks unread."""
    full_p, full_d = tp_pools(p_tp, 5), tp_pools(d_tp, None)
    win_p, win_d = window_pools(p_tp, 6), window_pools(d_tp, None)
    model = window_pools(1, 6)[0][0]

    def sides(full, win, name):
        out = []
        for r, ((_, g), (bufs, wg)) in enumerate(zip(full, win, strict=True)):
            path = PackedPath(g, pool_planes(g), 1, LoopbackTransport(f"{name}{r}"), fp8=False)
            out.append((path, path.sibling(pool_planes(wg)), bufs))
        return out

    prefill, decode = sides(full_p, win_p, "p"), sides(full_d, win_d, "d")
    pages, src_win, dst_win = np.arange(3), np.array([4, 1]), np.array([0, 3])
    rooms = []
    for d, (path, _, _) in enumerate(decode):
        r = RoomReservations(path, num_layers=LAYERS, hold_s=1.0, window_layers=WINDOW_LAYERS)
        rooms.append(r.reserve(5, pages, decode_parts(TOTAL, p_tp, d_tp, d), dst_win))
    for p, (path, window_kv, _) in enumerate(prefill):
        for d in range(d_tp):
            part = room_part(TOTAL, p_tp, d_tp, p, d)
            if part is None:
                continue
            res = rooms[d]
            count = WINDOW_LAYERS * src_win.size
            run = path.reserve(count, part.heads)
            whole = part.heads == path.slot.num_heads
            path.pack(
                range(WINDOW_LAYERS),
                src_win,
                run.first,
                heads=None if whole else part.p_heads,
                kv=window_kv,
            )
            first = window_start(res.part_first(part.index, LAYERS), LAYERS, pages.size)
            dst = room_slots(first, dst_win.size, range(WINDOW_LAYERS), np.arange(dst_win.size))
            _copy_chunks(
                path, np.arange(run.first, run.first + count), decode[d][0], dst, part.heads
            )
            path.release(run)
    for d, (path, window_kv, bufs) in enumerate(decode):
        res = rooms[d]
        for part in res.parts:
            first = window_start(res.part_first(part.index, LAYERS), LAYERS, pages.size)
            whole = part.heads == path.slot.num_heads
            for layer in range(WINDOW_LAYERS):
                path.unpack(
                    layer,
                    dst_win,
                    first + layer * dst_win.size,
                    heads=None if whole else part.d_heads,
                    kv=window_kv,
                )
        n = TOTAL // d_tp
        for i, buf in enumerate(bufs):
            want = model[i].view(WINDOW_PAGES, PAGE, TOTAL, DIM)[
                torch.as_tensor(src_win), :, d * n : (d + 1) * n
            ]
            got = buf.view(WINDOW_PAGES, PAGE, n, DIM)
            assert torch.equal(got[torch.as_tensor(dst_win)], want), f"decode rank {d}, buffer {i}"
            others = np.setdiff1d(np.arange(WINDOW_PAGES), dst_win)
            assert got[torch.as_tensor(others)].abs().sum().item() == 0


def test_a_window_pool_packs_beside_the_full_one_only_with_the_same_rows() -> None:
    """:meth:`PackedPath.sibling` takes a pool of other page count with the same rows,
    and refuses one whose rows differ (another head count), naming the direct path."""
    # each pool's buffers stay referenced: the geometries only point at them
    (full,), (same,), (wider,) = tp_pools(1, 1), window_pools(1, 2), window_pools(1, 2, 2 * TOTAL)
    path = PackedPath(full[1], pool_planes(full[1]), 1, LoopbackTransport("p"), fp8=True)
    assert path.sibling(pool_planes(same[1])).num_layers == WINDOW_LAYERS
    with pytest.raises(ConfigError, match="same rows") as err:
        path.sibling(pool_planes(wider[1]))
    assert err.value.key == "wire_dtype" and "direct path" in str(err.value)
