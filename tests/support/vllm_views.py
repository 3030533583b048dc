"""vLLM 0.32's GPU attention cache as vLLM itself lays it out: one int8 allocation
viewed per layer as ``[blocks, heads, tokens, K|V]`` by its ``create_kv_cache_views``
for a ``VLLM_KV_CACHE_LAYOUT``, on the CPU (tests of ``adapters.vllm.cache`` and of
the runtime on such caches)."""

from __future__ import annotations

import torch


def vllm_views(
    layout_name: str,
    *,
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float16,
    mla: bool = False,
) -> dict[str, torch.Tensor]:
    """Layer name -> vLLM's view of it, in model order; random bytes (``seed``) or zeros.
    ``mla``: an MLA cache (one latent vector of ``head_size`` values per token)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    kind = MLAAttentionSpec if mla else FullAttentionSpec
    spec = kind(
        block_size=block_size, num_kv_heads=1 if mla else heads, head_size=head_size, dtype=dtype
    )
    page = spec.page_size_bytes
    compact = layout.is_layer_compact
    tensor = KVCacheTensor(
        size=layers * blocks * page,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        layer_stride=blocks * page if compact else page,
        block_stride=page if compact else layers * page,
    )
    if seed is None:
        raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
    else:  # finite values of the dtype, whatever their bytes
        raw = (
            torch.randn(
                layers * blocks * page // torch.finfo(dtype).bits * 8,
                generator=torch.Generator().manual_seed(seed),
            )
            .to(dtype)
            .view(torch.int8)
        )
    return dict(
        zip(tensor.layers, create_kv_cache_views(raw, spec, blocks, layout, tensor), strict=True)
    )
