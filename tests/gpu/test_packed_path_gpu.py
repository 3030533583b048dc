"""The packed data path on GPU caches, through the runtime: vLLM-GPU-shaped caches (the
FlashAttention NHD layout, float16 / bfloat16), FP8 and exact, pushed layer by layer
over the loopback transport (device memory), each layer "computed" on the engine's
stream behind a GPU sleep and announced with its CUDA event, as the vLLM worker does.
The decode cache must equal the torch reference's pack -> unpack bit for bit (a layer
packed before its kernels finished would hold zeros), and every staging slot must be
given back. Likewise between vLLM 0.32's GPU views stored tokens first and heads first,
described by the vLLM adapter."""

from __future__ import annotations

import pytest
import runtime_pair
import torch

from kvbridge import ops
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.ops import jit
from kvbridge.runtime.endpoint import Endpoint

pytestmark = pytest.mark.gpu

L, NB, BS, H, HD = 4, 64, 16, 4, 128
SLEEP_CYCLES = 20_000_000  # ~10 ms per layer: the sender's side stream would overtake it


@pytest.fixture(scope="module", autouse=True)
def kernels():
    jit.load()  # a GPU run must use the kernels, not fall back to the reference


def cache(dtype: torch.dtype) -> tuple[torch.Tensor, CacheGeometry, CacheSpec]:
    """``(L, 2, blocks, block_size, heads, head_dim)`` zeros on the GPU and its geometry."""
    t = torch.zeros((L, 2, NB, BS, H, HD), dtype=dtype, device="cuda")
    spec = CacheSpec(
        num_layers=L,
        block_size=BS,
        num_kv_heads=H,
        head_dim=HD,
        dtype=str(dtype).removeprefix("torch."),
        layout="nhd",
    )
    bases = tuple(t[l, p].data_ptr() for l in range(L) for p in (0, 1))
    return (
        t,
        CacheGeometry(
            spec=spec, num_blocks=NB, plane_bases=bases, memory="device", device=t.device.index or 0
        ),
        spec,
    )


def endpoint(role: str, made, wire_dtype: str) -> Endpoint:
    t, geo, spec = made
    planes = [ops.kv_planes(t[l], "nhd") for l in range(L)]
    timeouts = {"receive_s": 20, "transfer_s": 20}
    return runtime_pair.endpoint(
        role, (t, geo), timeouts, spec, planes=planes, wire_dtype=wire_dtype, data_path="packed"
    )


@pytest.mark.parametrize("wire_dtype", ["fp8", "exact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layers_computed_on_the_gpu_arrive_packed_bit_for_bit(
    dtype: torch.dtype, wire_dtype: str
) -> None:
    p, d = cache(dtype), cache(dtype)
    P, D = endpoint("P", p, wire_dtype), endpoint("D", d, wire_dtype)
    pa, da = p[0], d[0]
    # 13 blocks, the last partial
    n, pblocks, dblocks = (
        200,
        list(range(3, 16)),
        list(range(40, 53)),
    )
    kv = torch.randn(
        (L, 2, len(pblocks), BS, H, HD), generator=torch.Generator().manual_seed(7)
    ).to(dtype)
    try:
        D.receiver.expect_push("g", P.address, dblocks, n)
        P.sender.track("g", pblocks, n)
        for layer in range(L):  # the engine's forward: each layer written after a GPU sleep
            torch.cuda._sleep(SLEEP_CYCLES)
            pa[layer][:, pblocks] = kv[layer].to("cuda", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            P.sender.layer_done("g", layer, n, ready=event)
        event = torch.cuda.Event()
        event.record()
        P.sender.prefill_done("g", ready=event)
        assert D.receiver.wait_finished(20) == (["g"], [])
        assert P.sender.wait_released(20) == ["g"]
        expected = torch.zeros((L, 2, NB, BS, H, HD), dtype=dtype)
        source = torch.zeros_like(expected)
        source[:, :, pblocks] = kv
        for layer in range(L):  # the specification, on the CPU
            region, fmt = ops.pack(
                ops.kv_planes(source[layer], "nhd"),
                pblocks,
                len(pblocks) * BS,
                fp8=wire_dtype == "fp8",
                chunk_tokens=BS,
            )
            ops.unpack(region, fmt, ops.kv_planes(expected[layer], "nhd"), dblocks)
        got = da.cpu()
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (
            "the decode cache differs from the reference round trip"
        )
        if wire_dtype == "exact":
            assert torch.equal(got[:, :, dblocks], kv)
        for ep in (P, D):
            assert ep.node.packed.allocator.free_slots == ep.node.packed.allocator.num_slots
    finally:
        D.close()
        P.close()


def vllm_gpu_views(order: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer views ``[blocks, heads, tokens, K|V]`` of one zeroed GPU
    allocation, stored tokens first (``LBNHC``) or heads first (``LBHNC``), layer after
    layer (the strides vLLM's ``create_kv_cache_views`` gives: checked against it on the
    CPU in ``tests/unit/test_vllm_cache.py``)."""
    c = 2 * HD
    page = BS * H * c
    strides = (page, BS * c, c, 1) if order == "LBHNC" else (page, c, H * c, 1)
    raw = torch.zeros(L * NB * page, dtype=dtype, device="cuda")
    return {
        f"model.layers.{l}.self_attn.attn": raw.as_strided((NB, H, BS, c), strides, l * NB * page)
        for l in range(L)
    }


@pytest.mark.parametrize("wire_dtype", ["fp8", "exact"])
@pytest.mark.parametrize(("p_order", "d_order"), [("LBNHC", "LBHNC"), ("LBHNC", "LBNHC")])
def test_vllm_gpu_views_of_different_orders_arrive_packed_bit_for_bit(
    p_order: str, d_order: str, wire_dtype: str
) -> None:
    from kvbridge.adapters.vllm.cache import geometry_from_tensors

    dtype = torch.bfloat16
    pv, dv = vllm_gpu_views(p_order, dtype), vllm_gpu_views(d_order, dtype)
    sides = {}
    for role, views in (("P", pv), ("D", dv)):
        geo = geometry_from_tensors(views, list(views), BS, cpu_backend=False)
        planes = [ops.kv_planes(v, geo.spec.layout) for v in views.values()]
        timeouts = {"receive_s": 20, "transfer_s": 20}
        sides[role] = runtime_pair.endpoint(
            role,
            (views, geo),
            timeouts,
            geo.spec,
            planes=planes,
            wire_dtype=wire_dtype,
            data_path="packed",
        )
    P, D = sides["P"], sides["D"]
    n, pblocks, dblocks = 200, list(range(3, 16)), list(range(40, 53))
    kv = torch.randn(
        (L, len(pblocks), H, BS, 2 * HD), generator=torch.Generator().manual_seed(9)
    ).to(dtype)
    try:
        D.receiver.expect_push("v", P.address, dblocks, n)
        P.sender.track("v", pblocks, n)
        for layer, view in enumerate(pv.values()):
            torch.cuda._sleep(SLEEP_CYCLES)
            view[pblocks] = kv[layer].to("cuda", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            P.sender.layer_done("v", layer, n, ready=event)
        P.sender.prefill_done("v")
        assert D.receiver.wait_finished(20) == (["v"], [])
        for layer, view in enumerate(dv.values()):  # the specification, on the CPU
            source = torch.zeros((NB, H, BS, 2 * HD), dtype=dtype)
            source[pblocks] = kv[layer]
            expected = torch.zeros_like(source)
            region, fmt = ops.pack(
                ops.kv_planes(source, "hnd_kv"),
                pblocks,
                len(pblocks) * BS,
                fp8=wire_dtype == "fp8",
                chunk_tokens=BS,
            )
            ops.unpack(region, fmt, ops.kv_planes(expected, "hnd_kv"), dblocks)
            assert torch.equal(view.cpu().view(torch.int16), expected.view(torch.int16)), (
                f"layer {layer} differs from the reference round trip"
            )
    finally:
        D.close()
        P.close()
