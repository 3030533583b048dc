"""Pack / unpack one layer's paged KV: kvbridge's packed data path.

The front of the ops package. :func:`pack` gathers the KV of a request's tokens from
paged caches into one contiguous *packed region* per layer (optionally FP8 with
scales, optionally a slice of the KV heads), several layers in one call; :func:`unpack`
scatters regions into paged caches of any supported layout, block size and dtype. The byte layout is
:class:`~kvbridge.ops.format.PackedFormat` (spec: ``csrc/PACKED_FORMAT.md``).

Dispatch: CUDA tensors go to the compiled kernels (built on first use, see
:mod:`kvbridge.ops.jit`), everything else, and CUDA tensors when the kernels cannot be
built, to the pure-torch :mod:`kvbridge.ops.reference`, which is the specification the
kernels are tested against. Both paths get the same checked inputs and give the same
bytes.

Two CUDA kernels give the same bytes: ``"rows"`` (one row per lane group, placed by its
index) and ``"tiles"`` (a warp per run of tokens inside one block, ``csrc/tile_map.h``;
fewer instructions per byte). The default is the faster one per mode on an H100
(``benchmarks/results/ops.md``): tiles for FP8 regions (pack with ``fp8=True``, unpack of
a scaled region: 86-96% of a device copy's bandwidth against 53-57% for rows' FP8
pack), rows for exact copies (rows 1-4 points ahead of tiles at 8 KV heads).
``kernel=`` or ``$KVBRIDGE_PACK_KERNEL`` picks one for every mode; the CPU path ignores
the choice.

Calls are asynchronous on CUDA (the current stream); the caller keeps every tensor
alive and unmodified until the stream has passed them. Who calls: the runtime's
sender (pack, once per layer and post) and receiver (unpack, once per layer and
arrival), and benchmarks.

>>> import torch
>>> cache = torch.randn(2, 8, 16, 4, 64)                # vLLM FlashAttention layout, 8 blocks
>>> k, v = kv_planes(cache, "nhd")
>>> region, fmt = pack((k, v), [3, 5], num_tokens=20)   # 20 tokens: block 3, then 4 of block 5
>>> fmt.num_tokens, fmt.num_heads, region.numel() == fmt.nbytes
(20, 4, True)
>>> other = torch.zeros(2, 4, 16, 4, 64)
>>> unpack(region, fmt, kv_planes(other, "nhd"), [1, 0])
>>> bool(torch.equal(other[:, 1], cache[:, 3]))
True
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.errors import KVBridgeError
from kvbridge.ops import reference
from kvbridge.ops.format import FP8_DTYPE, PackedFormat

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = (*_FLOAT_DTYPES, torch.float8_e4m3fn)


class OpsInputError(KVBridgeError, ValueError):
    """Bad input to :func:`pack` / :func:`unpack` (shape, dtype, device, range)."""


class _CudaArray:
    """``nbytes`` bytes at ``address``, described for ``torch.as_tensor``."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "strides": None, "version": 3}


def device_bytes(address: int, nbytes: int, device: int) -> torch.Tensor:
    """The ``nbytes`` bytes of GPU memory at ``address`` on CUDA device ``device`` as a
    uint8 tensor, no copy: for caches an engine hands over as addresses (SGLang's KV
    pool). The memory's owner keeps it alive while the tensor is used."""
    return torch.as_tensor(_CudaArray(address, nbytes), device=f"cuda:{device}")


def kv_planes(cache: torch.Tensor | Sequence[torch.Tensor], layout: str, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache as K and V views of shape ``(num_blocks, block_size,
    num_heads, head_dim)`` (no copy), the form :func:`pack` and :func:`unpack` take.

    ``layout`` (see :mod:`kvbridge.core.layout`):

    - ``"fused"``: vLLM's CPU cache ``(num_blocks, num_heads, block_size, 2 * head_dim)``,
      per head a keys half then a values half, each viewed as ``block_size`` rows of
      ``head_dim`` (the CPU kernel's own order inside a half: pack such blocks whole);
    - ``"nhd"``: ``(2, num_blocks, block_size, num_heads, head_dim)``, or a pair of K and V
      tensors of ``(num_blocks, block_size, heads, dim)`` or, with ``block_size``, SGLang's
      ``(num_pages * page_size, heads, dim)``;
    - ``"hnd"``: ``(2, num_blocks, num_heads, block_size, head_dim)``;
    - ``"nhd_kv"``, ``"hnd_kv"``: vLLM 0.32's GPU attention view ``(num_blocks,
      num_heads, block_size, 2 * head_dim)``, per token and head its key then its
      value, stored tokens or heads first (the strides say which; the views follow
      them);
    - ``"latent"`` (MLA, needs ``block_size``): one latent vector of ``dim`` values per
      token, e.g. vLLM's ``(num_blocks, block_size, dim)``, its CPU
      ``(num_blocks, 1, block_size, dim)`` or SGLang's ``(num_pages * page_size, 1,
      dim)``. There are no K and V: the two planes are the vector's halves, each one
      head of ``dim / 2`` values (``csrc/PACKED_FORMAT.md``, "Latent caches").

    >>> k, v = kv_planes(torch.zeros(10, 4, 16, 128), "fused")
    >>> tuple(k.shape), k.stride()
    ((10, 16, 4, 64), (8192, 64, 2048, 1))
    >>> k, v = kv_planes(torch.zeros(10, 16, 576), "latent", block_size=16)
    >>> tuple(k.shape), v.stride(), v.storage_offset()
    ((10, 16, 1, 288), (9216, 576, 576, 1), 288)
    """
    if layout == "latent":
        if not isinstance(cache, torch.Tensor) or not block_size:
            raise OpsInputError("a latent (MLA) cache is one tensor, and kv_planes needs its block_size")
        dim = cache.shape[-1]
        if dim % 2 or cache.stride(-1) != 1 or cache.numel() % (block_size * dim):
            raise OpsInputError(
                f"a latent cache holds blocks of {block_size} contiguous vectors of an even size, got shape {tuple(cache.shape)}, strides {cache.stride()}"
            )
        try:
            rows = cache.view(-1, block_size, 1, dim)
        except RuntimeError as exc:
            raise OpsInputError(f"a latent cache of shape {tuple(cache.shape)}, strides {cache.stride()} is not blocks of {block_size} vectors") from exc
        return rows[..., : dim // 2], rows[..., dim // 2 :]
    if not isinstance(cache, torch.Tensor):
        k, v = cache
        if k.dim() == 3:
            if not block_size:
                raise OpsInputError("token-major K/V buffers of shape (tokens, heads, dim) need block_size")
            k = k.view(-1, block_size, *k.shape[1:])
            v = v.view(-1, block_size, *v.shape[1:])
        if layout == "hnd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        elif layout != "nhd":
            raise OpsInputError(f"a pair of K and V tensors has layout nhd or hnd, not {layout!r}")
        return k, v
    if layout in ("nhd_kv", "hnd_kv"):
        if cache.dim() != 4 or cache.shape[-1] % 2 or cache.stride(-1) != 1:
            raise OpsInputError(f"a {layout} cache is (num_blocks, num_heads, block_size, 2 * head_dim) with each value row contiguous, got shape {tuple(cache.shape)}, strides {cache.stride()}")
        d = cache.shape[-1] // 2
        rows = cache.transpose(1, 2)  # (blocks, tokens, heads, K|V)
        return rows[..., :d], rows[..., d:]
    if layout == "fused":
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise OpsInputError(f"a fused cache is (num_blocks, num_heads, block_size, 2 * head_dim), got shape {tuple(cache.shape)}")
        n, h, b, two_d = cache.shape
        five = cache.view(n, h, 2, b, two_d // 2)
        return five[:, :, 0].transpose(1, 2), five[:, :, 1].transpose(1, 2)
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise OpsInputError(f"a {layout} cache is (2, num_blocks, ...), got shape {tuple(cache.shape)}")
    if layout == "nhd":
        return cache[0], cache[1]
    if layout == "hnd":
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    raise OpsInputError(f"unknown layout {layout!r}; expected fused, nhd, hnd, nhd_kv, hnd_kv or latent")


def packed_format(
    k: torch.Tensor, num_tokens: int, heads: tuple[int, int] | None = None, fp8: bool = False, chunk_tokens: int = 0
) -> PackedFormat:
    """The format :func:`pack` produces for these planes and arguments."""
    h0, h1 = heads if heads is not None else (0, k.shape[2])
    dtype = FP8_DTYPE if fp8 else str(k.dtype).removeprefix("torch.")
    return PackedFormat(num_tokens=num_tokens, num_heads=h1 - h0, head_dim=k.shape[3], dtype=dtype, scaled=fp8, chunk_tokens=chunk_tokens)


Planes = tuple[torch.Tensor, torch.Tensor]


def _layers(layers: Planes | Sequence[Planes]) -> list[Planes]:
    """Normalise one ``(k, v)`` pair or a sequence of them; check the first layer (the
    rest are checked by :func:`_check_all` or by the kernels' binding)."""
    if isinstance(layers, tuple) and len(layers) == 2 and isinstance(layers[0], torch.Tensor):
        layers = [layers]  # one layer
    layers = list(layers)
    if not layers:
        raise OpsInputError("no layers given")
    k = layers[0][0] if isinstance(layers[0], (tuple, list)) and len(layers[0]) == 2 else None
    if not isinstance(k, torch.Tensor):
        raise OpsInputError("layers must be (k, v) tensor pairs", fix="make them with kvbridge.ops.kv_planes(cache, layout)")
    if k.dim() != 4:
        raise OpsInputError(
            f"planes must be 4-D (num_blocks, block_size, num_heads, head_dim), got shape {tuple(k.shape)}",
            fix="make them with kvbridge.ops.kv_planes(cache, layout)",
        )
    if k.dtype not in _CACHE_DTYPES:
        raise OpsInputError(f"cache dtype {k.dtype} is not supported; supported: float32, float16, bfloat16, float8_e4m3fn")
    if k.stride(3) != 1:
        raise OpsInputError(f"the head_dim axis must be contiguous (stride 1), got strides {k.stride()}")
    return layers


def _check_all(layers: list[Planes]) -> None:
    """Every layer's planes match layer 0's K (what the reference path relies on)."""
    k = layers[0][0]
    for i, pair in enumerate(layers):
        for t in pair:
            if not isinstance(t, torch.Tensor) or t.shape != k.shape or t.stride() != k.stride() or t.dtype != k.dtype or t.device != k.device:
                raise OpsInputError(
                    f"layer {i}'s planes differ from layer 0's K ({tuple(k.shape)}, strides {k.stride()}, {k.dtype}, {k.device}): "
                    "every layer of one call must have the same shape, strides, dtype and device"
                )


def _block_ids(block_ids: Sequence[int] | np.ndarray | torch.Tensor, num_tokens: int, k: torch.Tensor) -> torch.Tensor:
    """The ``ceil(num_tokens / block_size)`` ids that hold the tokens, bounds-checked,
    as int64 where they were given (host ids cost the kernels no device sync)."""
    n_blocks, bs = k.shape[0], k.shape[1]
    if num_tokens < 0:
        raise OpsInputError(f"num_tokens must be >= 0, got {num_tokens}")
    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise OpsInputError(f"block_ids must be a 1-D integer sequence, got {ids.dtype} of shape {tuple(ids.shape)}")
    needed = -(-num_tokens // bs)
    if ids.numel() < needed:
        raise OpsInputError(f"{num_tokens} tokens in blocks of {bs} need {needed} block ids, got {ids.numel()}")
    ids = ids[:needed].to(torch.int64)
    if needed:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n_blocks:
            raise OpsInputError(f"block id {lo if lo < 0 else hi} is out of range [0, {n_blocks})")
    return ids


def _check_heads(k: torch.Tensor, start: int, count: int) -> None:
    if start < 0 or count <= 0 or start + count > k.shape[2]:
        raise OpsInputError(f"head range [{start}, {start + count}) is outside the cache's {k.shape[2]} heads")


def _check_buffer(buf: torch.Tensor, nbytes: int, k: torch.Tensor, what: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise OpsInputError(f"{what} must be a contiguous 1-D uint8 tensor")
    if buf.device != k.device:
        raise OpsInputError(f"{what} is on {buf.device}, the cache on {k.device}")
    if buf.numel() < nbytes:
        raise OpsInputError(f"{what} holds {buf.numel()} bytes, the regions need {nbytes}")
    if buf.data_ptr() % 16:
        raise OpsInputError(f"{what} must start at a 16-byte aligned address")


KERNELS = ("rows", "tiles")
"""The CUDA kernels :func:`pack` and :func:`unpack` can run (``kernel=``)."""


def _kernel(name: str | None, scaled: bool) -> int:
    """The binding's code of the kernel ``name``; default ``$KVBRIDGE_PACK_KERNEL``, else
    ``"tiles"`` for an FP8 (scaled) region and ``"rows"`` for the rest (module docstring)."""
    name = name or os.environ.get("KVBRIDGE_PACK_KERNEL") or ("tiles" if scaled else "rows")
    if name not in KERNELS:
        raise OpsInputError(f"unknown kernel {name!r}", fix=f"use one of {', '.join(KERNELS)} (kernel= or KVBRIDGE_PACK_KERNEL)")
    return KERNELS.index(name)


def _use_kernels(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from kvbridge.ops import jit

    return jit.try_load()


def pack(
    layers: Planes | Sequence[Planes],
    block_ids: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens: int,
    *,
    heads: tuple[int, int] | None = None,
    fp8: bool = False,
    chunk_tokens: int = 0,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, PackedFormat]:
    """Pack tokens ``[0, num_tokens)`` of one or more layers, one region per layer.

    Args:
        layers: one ``(k, v)`` pair from :func:`kv_planes` or a sequence of them (all of
            the same shape; one kernel launch packs them all).
        block_ids: the request's blocks in order; token ``t`` is in
            ``block_ids[t // block_size]``. Host ids cost no device sync.
        heads: ``(first, end)`` KV-head range to pack (a different TP on the other
            side); default all.
        fp8: quantize to float8 e4m3 with per-(plane, token, head) float32 scales. A
            float8 cache is packed with ``fp8=False`` (its bytes are copied).
        chunk_tokens: tokens per self-contained chunk of the region (kvbridge's
            runtime uses the block size, so each block's chunk can be sent on its
            own); 0: one chunk.
        out: uint8 buffer of ``len(layers) * fmt.nbytes`` bytes or more, 16-byte
            aligned (e.g. a view of a registered staging buffer); default a new tensor.
        kernel: which CUDA kernel (:data:`KERNELS`); the bytes are the same.

    Returns:
        ``(out[:len(layers) * fmt.nbytes], fmt)``; layer ``i``'s region starts at
        byte ``i * fmt.nbytes``.
    """
    layers = _layers(layers)
    k = layers[0][0]
    h0, h1 = heads if heads is not None else (0, k.shape[2])
    _check_heads(k, h0, h1 - h0)
    if fp8 and k.dtype == torch.float8_e4m3fn:
        raise OpsInputError("the cache is already float8", fix="pack it with fp8=False (its bytes are copied as they are)")
    if chunk_tokens < 0:
        raise OpsInputError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    fmt = packed_format(k, num_tokens, (h0, h1), fp8, chunk_tokens)
    ids = _block_ids(block_ids, num_tokens, k)
    total = len(layers) * fmt.nbytes
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=k.device)
    _check_buffer(out, total, k, "out")
    code = _kernel(kernel, fp8)
    if _use_kernels(k):  # the binding checks every layer
        torch.ops.kvbridge.pack([p[0] for p in layers], [p[1] for p in layers], ids, num_tokens, h0, h1 - h0, fp8, fmt.ct, out, code)
    else:
        _check_all(layers)
        reference.pack(layers, ids.to(k.device), fmt, h0, out)
    return out[:total], fmt


def unpack(
    packed: torch.Tensor,
    fmt: PackedFormat,
    layers: Planes | Sequence[Planes],
    block_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    head_start: int = 0,
    kernel: str | None = None,
) -> None:
    """Write the regions of format ``fmt`` in ``packed`` (layer ``i``'s at byte ``i *
    fmt.nbytes``) into tokens ``[0, fmt.num_tokens)`` of heads ``[head_start,
    head_start + fmt.num_heads)`` of each layer's planes, converting to their dtype
    (round to nearest even). Only the regions' tokens are written; the rest of the last
    block is left as it was. ``kernel``: as for :func:`pack`."""
    layers = _layers(layers)
    k = layers[0][0]
    try:
        fmt.check()
    except KVBridgeError as exc:
        raise OpsInputError(str(exc)) from exc
    if fmt.head_dim != k.shape[3]:
        raise OpsInputError(f"the region's head_dim {fmt.head_dim} differs from the cache's {k.shape[3]}")
    _check_heads(k, head_start, fmt.num_heads)
    cache_dtype = str(k.dtype).removeprefix("torch.")
    if fmt.scaled and cache_dtype == FP8_DTYPE:
        raise OpsInputError("a scaled region cannot go into a float8 cache", fix="pack a float8 cache with fp8=False")
    if not fmt.scaled and FP8_DTYPE in (fmt.dtype, cache_dtype) and fmt.dtype != cache_dtype:
        raise OpsInputError(f"unscaled float8 values only go into a float8 cache; got {fmt.dtype} into {cache_dtype}")
    ids = _block_ids(block_ids, fmt.num_tokens, k)
    _check_buffer(packed, len(layers) * fmt.nbytes, k, "packed")
    code = _kernel(kernel, fmt.scaled)
    if _use_kernels(k):
        torch.ops.kvbridge.unpack(
            packed, getattr(torch, fmt.dtype), fmt.scaled, fmt.ct, [p[0] for p in layers], [p[1] for p in layers], ids, fmt.num_tokens, head_start, fmt.num_heads, code
        )
    else:
        _check_all(layers)
        reference.unpack(packed, fmt, layers, ids.to(k.device), head_start)


__all__ = ["KERNELS", "OpsInputError", "PackedFormat", "device_bytes", "kv_planes", "pack", "packed_format", "unpack"]
