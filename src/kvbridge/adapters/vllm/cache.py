"""vLLM's per-layer KV cache tensors -> :class:`~kvbridge.core.layout.CacheGeometry`.

Pure (reads shapes, strides and addresses; moves nothing), so it is unit-tested with
plain CPU tensors. Supported layouts of vLLM 0.32:

- CPU backend: per layer ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
  -> ``fused``;
- FlashAttention-style GPU backends: ``(2, num_blocks, block_size, num_kv_heads,
  head_dim)`` -> ``nhd`` (K and V planes), or with heads before tokens -> ``hnd``;
- MLA backends (``mla``): ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` on GPU,
  the same with a heads axis of 1 on CPU ``(num_blocks, 1, block_size, ...)``
  -> ``latent``. Only the caller knows a cache is MLA: the CPU shape is also a
  one-head CPU attention cache.

Anything else raises with the shape it saw: kvbridge never guesses a layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    import torch


def layer_order(names: list[str], index_of) -> list[str]:
    """Layer names sorted by model layer index (``index_of(name) -> int``); a layer
    index must appear once."""
    indexed = sorted((index_of(n), n) for n in names)
    seen = [i for i, _ in indexed]
    if len(set(seen)) != len(seen):
        raise KVBridgeError(f"several KV cache tensors share a layer index: {names}", fix="report this model to kvbridge")
    return [n for _, n in indexed]


def geometry_from_tensors(kv_caches: Mapping[str, torch.Tensor], ordered: list[str], block_size: int, mla: bool = False) -> CacheGeometry:
    """Describe the cache whose per-layer tensors are ``kv_caches[name]`` for the layer
    names in ``ordered`` (model order); ``mla``: the model's attention is MLA (vLLM's
    ``model_config.use_mla``)."""
    first = kv_caches[ordered[0]]
    dtype = str(first.dtype).removeprefix("torch.")
    shape = tuple(first.shape)
    es = first.element_size()
    tokens = [d for d in shape[1:-1] if d != 1]  # the latent cache's axes between blocks and values
    if mla and tokens == [block_size] and first.stride(-1) == 1 and first.stride(shape.index(block_size, 1)) == shape[-1]:
        num_blocks, dim = shape[0], shape[-1]
        spec = CacheSpec(num_layers=len(ordered), block_size=block_size, num_kv_heads=1, head_dim=dim, dtype=dtype, layout="latent")
        bases = [kv_caches[n].data_ptr() for n in ordered]
        stride = first.stride(0) * es
    elif mla:
        raise KVBridgeError(
            f"unsupported MLA KV cache layout: tensor of shape {shape}, strides {first.stride()} on {first.device} (block size {block_size})",
            fix="kvbridge supports MLA caches of (blocks, block_size, latent) with each token's latent values contiguous",
        )
    elif first.device.type == "cpu" and len(shape) == 4 and shape[2] == block_size:
        num_blocks, heads, _, two_d = shape
        spec = CacheSpec(num_layers=len(ordered), block_size=block_size, num_kv_heads=heads, head_dim=two_d // 2, dtype=dtype, layout="fused")
        bases = [kv_caches[n].data_ptr() for n in ordered]
        stride = first.stride(0) * es
    elif len(shape) == 5 and shape[0] == 2 and block_size in (shape[2], shape[3]):
        _, num_blocks, a, b, dim = shape
        layout = "nhd" if a == block_size else "hnd"
        heads = b if layout == "nhd" else a
        spec = CacheSpec(num_layers=len(ordered), block_size=block_size, num_kv_heads=heads, head_dim=dim, dtype=dtype, layout=layout)
        bases = [t[p].data_ptr() for t in (kv_caches[n] for n in ordered) for p in (0, 1)]
        stride = first.stride(1) * es
    else:
        raise KVBridgeError(
            f"unsupported KV cache layout: tensor of shape {shape} on {first.device} (block size {block_size})",
            fix="kvbridge supports vLLM's CPU layout and FlashAttention-style (2, blocks, ...) layouts",
        )
    for name in ordered:
        t = kv_caches[name]
        if tuple(t.shape) != shape or t.dtype != first.dtype:
            raise KVBridgeError(f"KV cache of layer {name} differs in shape or dtype from the first layer", fix="hybrid models are not supported yet")
    memory = "host" if first.device.type == "cpu" else "device"
    device = 0 if memory == "host" else (first.device.index or 0)
    return CacheGeometry(
        spec=spec,
        num_blocks=num_blocks,
        plane_bases=tuple(bases),
        block_stride=stride if stride != spec.block_bytes else 0,
        memory=memory,
        device=device,
    )


__all__ = ["geometry_from_tensors", "layer_order"]
