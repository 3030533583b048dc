"""The SGLang backend's packed path on a GPU KV pool, without SGLang: per-layer K and V
buffers on the GPU as SGLang allocates them, handed over as addresses (KVArgs), seen
through :func:`pool_planes` (views of the same memory) and packed / unpacked by a
:class:`~kvbridge.runtime.packed.PackedPath` on the GPU; the decode pages must equal
those the same steps give on CPU pools (the reference ops) bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvbridge.adapters.sglang.packed import pool_planes, typed_geometry
from kvbridge.adapters.sglang.pools import kv_geometry
from kvbridge.ops import jit
from kvbridge.runtime.packed import PackedPath
from kvbridge.transports.loopback import LoopbackTransport

pytestmark = pytest.mark.gpu

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 32, 16, 4, 128
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def kernels():
    jit.load()


def pool(device: str, seed: int | None) -> tuple[list[torch.Tensor], object]:
    """K buffers then V buffers, ``(pages * page_size, heads, dim)`` bfloat16, and the
    typed geometry of their addresses."""
    gen = torch.Generator().manual_seed(seed or 0)
    bufs = [
        (
            torch.randn(PAGES * PAGE, HEADS, DIM, generator=gen)
            if seed is not None
            else torch.zeros(PAGES * PAGE, HEADS, DIM)
        )
        .to(torch.bfloat16)
        .to(device)
        for _ in range(2 * LAYERS)
    ]
    opaque = kv_geometry(
        page_size=PAGE,
        ptrs=[b.data_ptr() for b in bufs],
        lens=[b.numel() * b.element_size() for b in bufs],
        item_lens=[PAGE * HEADS * DIM * 2] * len(bufs),
        memory="host" if device == "cpu" else "device",
        device=0,
    )
    return bufs, typed_geometry(opaque, dtype="bfloat16", head_dim=DIM)


def round_trip(device: str, fp8: bool) -> list[torch.Tensor]:
    p_bufs, p_geo = pool(device, 3)
    d_bufs, d_geo = pool(device, None)
    planes = pool_planes(p_geo)
    pv = planes[1][1]
    assert pv.device.type == device and pv.data_ptr() == p_bufs[LAYERS + 1].data_ptr()
    prefill = PackedPath(p_geo, planes, 8, LoopbackTransport(f"sg-p-{next(_names)}"), fp8=fp8)
    decode = PackedPath(
        d_geo, pool_planes(d_geo), 8, LoopbackTransport(f"sg-d-{next(_names)}"), fp8=fp8
    )
    src_pages, dst_pages = np.array([4, 9, 1, 30]), np.array([0, 11, 3, 31])
    first, dfirst = prefill.allocator.alloc(LAYERS * 4), decode.allocator.alloc(LAYERS * 4)
    prefill.pack(list(range(LAYERS)), src_pages, first)
    # what the transport moves
    decode.view(dfirst, LAYERS * 4).copy_(prefill.view(first, LAYERS * 4))
    for layer in range(LAYERS):
        decode.unpack(layer, dst_pages, dfirst + layer * 4)
    return [b.cpu() for b in d_bufs]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "exact"])
def test_a_gpu_pool_packs_and_unpacks_as_the_reference_does_on_cpu(fp8: bool) -> None:
    gpu, cpu = round_trip("cuda", fp8), round_trip("cpu", fp8)
    for i, (g, c) in enumerate(zip(gpu, cpu, strict=True)):
        assert torch.equal(g.view(torch.int16), c.view(torch.int16)), f"buffer {i}"
    assert any(c.any() for c in cpu), "nothing was unpacked"
