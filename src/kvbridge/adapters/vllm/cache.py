"""vLLM's per-layer KV cache tensors -> :class:`~kvbridge.core.layout.CacheGeometry`.

Pure (reads shapes, strides and addresses; moves nothing), so it is unit-tested with
plain CPU tensors. Supported layouts of vLLM 0.32:

- CPU backend: per layer ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
  -> ``fused``;
- GPU attention backends (FlashAttention, FlashInfer, Triton): vLLM 0.32 views each
  layer as ``[num_blocks, num_kv_heads, block_size, K|V]`` (its ``create_kv_cache_views``;
  each token and head holds its key then its value, as the backends split them) over
  one allocation, in the physical order ``VLLM_KV_CACHE_LAYOUT`` chose: tokens before
  heads (``LBNHC``, ``BLNHC``) -> ``nhd_kv``, heads before tokens (``LBHNC``,
  ``BLHNC``) -> ``hnd_kv``; a block-outermost order interleaves the layers' blocks
  (the geometry's block stride). Orders that split a block's bytes (``LHBNC``,
  ``BHLNC``), and attention kernels with smaller blocks than vLLM's, are refused;
- older FlashAttention-style tensors ``(2, num_blocks, block_size, num_kv_heads,
  head_dim)`` -> ``nhd`` (K and V planes), or with heads before tokens -> ``hnd``;
- MLA backends (``mla``): ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` on GPU,
  the same with a heads axis of 1 on CPU ``(num_blocks, 1, block_size, ...)``
  -> ``latent``. Only the caller knows a cache is MLA: the CPU shape is also a
  one-head CPU attention cache.

State-space layers (Mamba, linear attention) beside attention layers (vLLM's hybrid
manager, ``state_layers``): vLLM gives such a layer a byte view ``(num_blocks, ...)`` of
the memory it shares with the attention layers, block ``b`` at the same stride, its
state (convolution then temporal, :func:`~kvbridge.adapters.vllm.compat.state_description`)
at the start of the block; the geometry moves those bytes of its blocks only
(``CacheGeometry.layer_bytes``).

Anything else raises with the shape it saw: kvbridge never guesses a layout.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
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
        raise KVBridgeError(
            f"several KV cache tensors share a layer index: {names}",
            fix="report this model to kvbridge",
        )
    return [n for _, n in indexed]


def _gpu_view(
    first: torch.Tensor, num_layers: int, block_size: int, dtype: str
) -> tuple[CacheSpec, int]:
    """The spec and block stride (bytes) of a GPU backend's ``[blocks, heads, tokens,
    K|V]`` layer view, from its strides: a block must be one dense run of bytes."""
    _num_blocks, heads, tokens, two_d = first.shape
    s = first.stride()
    if tokens != block_size:
        raise KVBridgeError(
            f"the attention kernel's blocks hold {tokens} tokens, vLLM's {block_size}: kvbridge "
            "moves vLLM's blocks whole",
            fix=f"start vLLM with --block-size {tokens}",
        )
    if two_d % 2 == 0 and s[3] == 1 and s[1] == two_d and s[2] == heads * two_d:
        layout = "nhd_kv"
    elif two_d % 2 == 0 and s[3] == 1 and s[2] == two_d and s[1] == tokens * two_d:
        layout = "hnd_kv"
    else:
        raise KVBridgeError(
            f"unsupported KV cache view: shape {tuple(first.shape)}, strides {s}: a block's heads "
            "and tokens do not form one dense run of bytes",
            fix="set VLLM_KV_CACHE_LAYOUT to LBNHC, LBHNC, BLNHC or BLHNC",
        )
    spec = CacheSpec(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=two_d // 2,
        dtype=dtype,
        layout=layout,
    )
    return spec, s[0] * first.element_size()


def geometry_from_tensors(
    kv_caches: Mapping[str, torch.Tensor],
    ordered: list[str],
    block_size: int,
    mla: bool = False,
    cpu_backend: bool | None = None,
    state_layers: Collection[str] = (),
) -> CacheGeometry:
    """Describe the cache whose per-layer tensors are ``kv_caches[name]`` for the layer
    names in ``ordered`` (model order); ``mla``: the model's attention is MLA (vLLM's
    ``model_config.use_mla``); ``cpu_backend``: the tensors are vLLM's CPU attention
    cache, whose ``[blocks, heads, tokens, 2 * head_dim]`` holds a head's keys then its
    values (default: the tensors are in host memory), not a GPU backend's view;
    ``state_layers``: the names of state-space layers (module docstring)."""
    attention = [n for n in ordered if n not in state_layers]
    for name in state_layers:
        if not hasattr(kv_caches[name], "data_ptr"):
            _refuse_state(name, f"a {type(kv_caches[name]).__name__}")
    first = kv_caches[attention[0]]
    if cpu_backend is None:
        cpu_backend = first.device.type == "cpu"
    dtype = str(first.dtype).removeprefix("torch.")
    shape = tuple(first.shape)
    es = first.element_size()
    tokens = [d for d in shape[1:-1] if d != 1]  # the latent cache's axes between blocks and values
    if (
        mla
        and tokens == [block_size]
        and first.stride(-1) == 1
        and first.stride(shape.index(block_size, 1)) == shape[-1]
    ):
        num_blocks, dim = shape[0], shape[-1]
        spec = CacheSpec(
            num_layers=len(ordered),
            block_size=block_size,
            num_kv_heads=1,
            head_dim=dim,
            dtype=dtype,
            layout="latent",
        )
        bases = [kv_caches[n].data_ptr() for n in ordered]
        stride = first.stride(0) * es
    elif mla:
        raise KVBridgeError(
            f"unsupported MLA KV cache layout: tensor of shape {shape}, strides {first.stride()} "
            f"on {first.device} (block size {block_size})",
            fix=(
                "kvbridge supports MLA caches of (blocks, block_size, latent) with each token's "
                "latent values contiguous"
            ),
        )
    elif len(shape) == 4 and not cpu_backend:
        spec, stride = _gpu_view(first, len(ordered), block_size, dtype)
        num_blocks = shape[0]
        bases = [kv_caches[n].data_ptr() for n in ordered]
    elif cpu_backend and len(shape) == 4 and shape[2] == block_size:
        num_blocks, heads, _, two_d = shape
        spec = CacheSpec(
            num_layers=len(ordered),
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=two_d // 2,
            dtype=dtype,
            layout="fused",
        )
        bases = [kv_caches[n].data_ptr() for n in ordered]
        stride = first.stride(0) * es
    elif len(shape) == 5 and shape[0] == 2 and block_size in (shape[2], shape[3]):
        _, num_blocks, a, b, dim = shape
        layout = "nhd" if a == block_size else "hnd"
        heads = b if layout == "nhd" else a
        spec = CacheSpec(
            num_layers=len(ordered),
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=dtype,
            layout=layout,
        )
        bases = [t[p].data_ptr() for t in (kv_caches[n] for n in ordered) for p in (0, 1)]
        stride = first.stride(1) * es
    else:
        raise KVBridgeError(
            f"unsupported KV cache layout: tensor of shape {shape} on {first.device} (block size "
            f"{block_size})",
            fix=(
                "kvbridge supports vLLM's CPU layout, its GPU [blocks, heads, tokens, K|V] views "
                "and (2, blocks, ...) layouts"
            ),
        )
    for name in attention:
        t = kv_caches[name]
        if tuple(t.shape) != shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise KVBridgeError(
                f"KV cache of layer {name} differs in shape or dtype from the first layer",
                fix="report this model to kvbridge",
            )
    layer_bytes = ()
    if state_layers:
        if spec.planes_per_layer != 1:
            raise KVBridgeError(
                f"state-space layers beside a {spec.layout} attention cache (K and V apart): not "
                "supported",
                fix="report this model to kvbridge",
            )
        layer_bytes = tuple(
            _state_bytes(kv_caches[n], n, num_blocks, stride)
            if n in state_layers
            else spec.block_bytes
            for n in ordered
        )
    memory = "host" if first.device.type == "cpu" else "device"
    device = 0 if memory == "host" else (first.device.index or 0)
    return CacheGeometry(
        spec=spec,
        num_blocks=num_blocks,
        plane_bases=tuple(bases),
        block_stride=stride if stride != spec.block_bytes else 0,
        memory=memory,
        device=device,
        layer_bytes=layer_bytes,
    )


def _state_bytes(t: torch.Tensor, name: str, num_blocks: int, stride: int) -> int:
    """Bytes of one block of state-space layer ``name``'s view ``t``: its blocks must
    lie where the attention layers' do (``num_blocks`` of them, ``stride`` bytes apart),
    each one dense run of bytes from the block's start."""
    fits = t.dim() >= 2 and t.shape[0] == num_blocks and t.stride(0) * t.element_size() == stride
    inner = tuple(t.shape[1:]) if fits else ()
    if not fits or any(
        t.stride(i + 1) != math.prod(inner[i + 1 :]) for i in range(len(inner)) if inner[i] != 1
    ):
        _refuse_state(
            name,
            f"shape {tuple(t.shape)}, strides {t.stride()}, where {num_blocks} blocks {stride} "
            "bytes apart were expected",
        )
    return math.prod(inner) * t.element_size()


def _refuse_state(name: str, what: str) -> None:
    raise KVBridgeError(
        f"unsupported state-space layer cache {name} ({what}): kvbridge moves a layer's state as "
        "one dense run of bytes at the start of each block",
        fix="report this model and vLLM version to kvbridge",
    )


__all__ = ["geometry_from_tensors", "layer_order"]
