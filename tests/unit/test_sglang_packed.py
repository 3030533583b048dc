"""The packed path (``wire_dtype: fp8``, or exact with ``data_path: packed``) for the
SGLang backend, without SGLang: two SGLang-shaped KV pools
(per-layer K and V buffers of ``(pages * page_size, heads, dim)``, as SGLang allocates
them), each seen through :func:`pool_planes` and packed / unpacked by a real
:class:`~kvbridge.runtime.packed.PackedPath` on the loopback transport; the bytes a
transport would move are copied slot for slot as :func:`room_slots` maps them. The decode
pages end up within FP8 error of the prefill's (exact: equal), the other pages
untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.adapters.sglang.layout import kv_geometry
from kvbridge.adapters.sglang.packed import RoomReservations, pool_planes, room_slots, typed_geometry
from kvbridge.errors import ConfigError, PlanError
from kvbridge.runtime.packed import PackedPath, SlotAllocator
from kvbridge.transports.loopback import LoopbackTransport

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 12, 4, 2, 16


def sglang_pool(seed: int | None, dtype: torch.dtype = torch.bfloat16):
    """K and V buffers per layer and the opaque geometry SGLang's KVArgs give for them."""
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(PAGES * PAGE, HEADS, DIM, generator=gen).to(dtype)) if seed is not None else (lambda: torch.zeros(PAGES * PAGE, HEADS, DIM, dtype=dtype))
    k = [make() for _ in range(LAYERS)]
    v = [make() for _ in range(LAYERS)]
    bufs = k + v
    geo = kv_geometry(
        page_size=PAGE, ptrs=[b.data_ptr() for b in bufs], lens=[b.numel() * b.element_size() for b in bufs],
        item_lens=[PAGE * HEADS * DIM * bufs[0].element_size()] * len(bufs),
    )  # fmt: skip
    return k, v, geo


def test_typed_geometry_finds_the_heads_and_refuses_rows_that_do_not_split() -> None:
    _, _, opaque = sglang_pool(1)
    typed = typed_geometry(opaque, dtype="bfloat16", head_dim=DIM)
    assert (typed.spec.num_kv_heads, typed.spec.head_dim, typed.spec.dtype) == (HEADS, DIM, "bfloat16")
    assert typed.plane_bases == opaque.plane_bases and typed.num_blocks == opaque.num_blocks
    assert typed.spec.block_bytes == opaque.spec.block_bytes
    with pytest.raises(ConfigError, match="wire_dtype"):
        typed_geometry(opaque, dtype="float32", head_dim=3 * DIM)  # 64 bytes per token: no whole heads
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


def test_room_slots_are_layer_major_and_bounded() -> None:
    assert room_slots(10, 3, [1, 2], np.array([0, 2])).tolist() == [13, 15, 16, 18]
    with pytest.raises(PlanError, match="outside"):
        room_slots(0, 3, [0], np.array([3]))


def rows_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().reshape(-1, DIM), b.float().reshape(-1, DIM)
    return ((a - b).norm(dim=1) / a.norm(dim=1)).max().item()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "exact"])
def test_a_room_goes_through_packed_slots_into_the_decode_pages(fp8: bool) -> None:
    """FP8: within FP8 error; exact (``data_path: packed``): bit for bit."""
    pk, pv, p_opaque = sglang_pool(3)
    dk, dv, d_opaque = sglang_pool(None)
    p_geo, d_geo = (typed_geometry(g, dtype="bfloat16", head_dim=DIM) for g in (p_opaque, d_opaque))
    prefill = PackedPath(p_geo, pool_planes(p_geo), 1, LoopbackTransport("p"), fp8=fp8)
    decode = PackedPath(d_geo, pool_planes(d_geo), 1, LoopbackTransport("d"), fp8=fp8)
    reservations = RoomReservations(decode.allocator, num_layers=LAYERS, hold_s=5.0)
    src_pages = np.array([4, 9, 1, 6, 2])  # the prefill's pages of the room, in order
    dst_pages = np.array([0, 11, 3, 8, 5])  # the decode's (its Destination)
    res = reservations.reserve(77, dst_pages)
    assert res is not None

    def post(layers: list[int], positions: np.ndarray) -> None:
        """What the manager's _pack + one write do for one destination."""
        first = prefill.allocator.alloc(len(layers) * positions.size)
        prefill.pack(layers, src_pages[positions], first)
        src = np.arange(first, first + len(layers) * positions.size)
        dst = room_slots(res.first, dst_pages.size, layers, positions)
        for s, d in zip(src, dst):
            decode.view(int(d), 1).copy_(prefill.view(int(s), 1))
        prefill.allocator.free(first, len(layers) * positions.size)

    post([0, 1], np.arange(5))  # two layers streamed whole
    post([2, 3], np.array([0, 1, 2]))  # the rest in two chunks
    post([2, 3], np.array([3, 4]))
    taken = reservations.take(77)
    assert taken == res and reservations.take(77) is None
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
            assert buf_d[layer].view(PAGES, PAGE, HEADS, DIM)[torch.as_tensor(others)].abs().sum().item() == 0


def test_reservations_end_once_and_retired_runs_wait_out_their_hold() -> None:
    alloc = SlotAllocator(3 * 6)
    r = RoomReservations(alloc, num_layers=3, hold_s=10.0)
    a = r.reserve(1, np.arange(4))
    assert a is not None and r.reserve(2, np.arange(3)) is None  # 12 of 18 slots taken
    with pytest.raises(PlanError, match="no pages"):
        r.reserve(3, np.array([], dtype=np.int64))
    r.retire(1, now=100.0)
    r.retire(1, now=100.0)  # a second clear of the room frees nothing twice
    assert len(r) == 0 and r.take(1) is None
    assert r.reap(now=109.0) == 0 and alloc.free_slots == 6
    assert r.reap(now=110.0) == 1 and alloc.free_slots == 18
    b = r.reserve(2, np.arange(2))
    again = r.reserve(2, np.arange(2))  # the same room id again: the first run is held
    assert b is not None and again is not None and again.first != b.first
    assert r.take(2) == again
    r.free(again)
    assert r.reap(now=float("inf")) == 1 and alloc.free_slots == 18
