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
fewer instructions per byte). The default is the faster one per case on an H100
(``benchmarks/results/ops.md``, :func:`_kernel`): tiles for FP8 regions (pack with
``fp8=True``, unpack of a scaled region: 86-96% of a device copy's bandwidth against
53-57% for rows' FP8 pack) and for exact copies of blocks under :data:`TILE_ROWS`
(token, head) rows (1 KV head per rank), rows for other exact copies (rows 1-4 points
ahead of tiles at 8 KV heads). ``kernel=`` or ``$KVBRIDGE_PACK_KERNEL`` picks one for
every case; the CPU path ignores the choice.

Host work per call: a caller that packs the same cache again and again (the runtime,
once per post) holds a :class:`PagedKV`, whose planes are checked once; the free
functions check the planes they are given on every call. On the kernels' path the
binding checks block-id bounds and every layer's planes itself, and its refusals are
raised as :class:`OpsInputError` like the front's own.

Calls are asynchronous on CUDA (the current stream); the caller keeps every tensor
alive and unmodified until the stream has passed them. Who calls: the runtime's
sender (pack, once per post of one or more layers) and receiver (unpack, once per
layer and arrival) through :class:`PagedKV`, and benchmarks.

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

import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

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
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


def device_bytes(address: int, nbytes: int, device: int) -> torch.Tensor:
    """The ``nbytes`` bytes of GPU memory at ``address`` on CUDA device ``device`` as a
    uint8 tensor, no copy: for caches an engine hands over as addresses (SGLang's KV
    pool). The memory's owner keeps it alive while the tensor is used."""
    return torch.as_tensor(_CudaArray(address, nbytes), device=f"cuda:{device}")


def kv_planes(
    cache: torch.Tensor | Sequence[torch.Tensor], layout: str, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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
            raise OpsInputError(
                "a latent (MLA) cache is one tensor, and kv_planes needs its block_size"
            )
        dim = cache.shape[-1]
        if dim % 2 or cache.stride(-1) != 1 or cache.numel() % (block_size * dim):
            raise OpsInputError(
                f"a latent cache holds blocks of {block_size} contiguous vectors of an even size, "
                f"got shape {tuple(cache.shape)}, strides {cache.stride()}"
            )
        try:
            rows = cache.view(-1, block_size, 1, dim)
        except RuntimeError as exc:
            raise OpsInputError(
                f"a latent cache of shape {tuple(cache.shape)}, strides {cache.stride()} is not "
                f"blocks of {block_size} vectors"
            ) from exc
        return rows[..., : dim // 2], rows[..., dim // 2 :]
    if not isinstance(cache, torch.Tensor):
        k, v = cache
        if k.dim() == 3:
            if not block_size:
                raise OpsInputError(
                    "token-major K/V buffers of shape (tokens, heads, dim) need block_size"
                )
            k = k.view(-1, block_size, *k.shape[1:])
            v = v.view(-1, block_size, *v.shape[1:])
        if layout == "hnd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        elif layout != "nhd":
            raise OpsInputError(f"a pair of K and V tensors has layout nhd or hnd, not {layout!r}")
        return k, v
    if layout in ("nhd_kv", "hnd_kv"):
        if cache.dim() != 4 or cache.shape[-1] % 2 or cache.stride(-1) != 1:
            raise OpsInputError(
                f"a {layout} cache is (num_blocks, num_heads, block_size, 2 * head_dim) with each "
                f"value row contiguous, got shape {tuple(cache.shape)}, strides {cache.stride()}"
            )
        d = cache.shape[-1] // 2
        rows = cache.transpose(1, 2)  # (blocks, tokens, heads, K|V)
        return rows[..., :d], rows[..., d:]
    if layout == "fused":
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise OpsInputError(
                "a fused cache is (num_blocks, num_heads, block_size, 2 * head_dim), got shape "
                f"{tuple(cache.shape)}"
            )
        n, h, b, two_d = cache.shape
        five = cache.view(n, h, 2, b, two_d // 2)
        return five[:, :, 0].transpose(1, 2), five[:, :, 1].transpose(1, 2)
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise OpsInputError(
            f"a {layout} cache is (2, num_blocks, ...), got shape {tuple(cache.shape)}"
        )
    if layout == "nhd":
        return cache[0], cache[1]
    if layout == "hnd":
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    raise OpsInputError(
        f"unknown layout {layout!r}; expected fused, nhd, hnd, nhd_kv, hnd_kv or latent"
    )


def packed_format(
    k: torch.Tensor,
    num_tokens: int,
    heads: tuple[int, int] | None = None,
    fp8: bool = False,
    chunk_tokens: int = 0,
) -> PackedFormat:
    """The format :func:`pack` produces for these planes and arguments."""
    h0, h1 = heads if heads is not None else (0, k.shape[2])
    dtype = FP8_DTYPE if fp8 else str(k.dtype).removeprefix("torch.")
    return PackedFormat(
        num_tokens=num_tokens,
        num_heads=h1 - h0,
        head_dim=k.shape[3],
        dtype=dtype,
        scaled=fp8,
        chunk_tokens=chunk_tokens,
    )


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
        raise OpsInputError(
            "layers must be (k, v) tensor pairs",
            fix="make them with kvbridge.ops.kv_planes(cache, layout)",
        )
    if k.dim() != 4:
        raise OpsInputError(
            "planes must be 4-D (num_blocks, block_size, num_heads, head_dim), got shape "
            f"{tuple(k.shape)}",
            fix="make them with kvbridge.ops.kv_planes(cache, layout)",
        )
    if k.dtype not in _CACHE_DTYPES:
        raise OpsInputError(
            f"cache dtype {k.dtype} is not supported; supported: float32, float16, bfloat16, "
            "float8_e4m3fn"
        )
    if k.stride(3) != 1:
        raise OpsInputError(
            f"the head_dim axis must be contiguous (stride 1), got strides {k.stride()}"
        )
    return layers


def _check_all(layers: list[Planes]) -> None:
    """Every layer's planes match layer 0's K (what the reference path relies on)."""
    k = layers[0][0]
    for i, pair in enumerate(layers):
        for t in pair:
            if (
                not isinstance(t, torch.Tensor)
                or t.shape != k.shape
                or t.stride() != k.stride()
                or t.dtype != k.dtype
                or t.device != k.device
            ):
                raise OpsInputError(
                    f"layer {i}'s planes differ from layer 0's K ({tuple(k.shape)}, strides "
                    f"{k.stride()}, {k.dtype}, {k.device}): "
                    "every layer of one call must have the same shape, strides, dtype and device"
                )


class _Cache(NamedTuple):
    """What a call needs to know of its planes (all layers alike), read from layer 0's K
    once: per call, reading tensor attributes costs more than the checks themselves."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    """torch dtype name without ``torch.``."""
    device: torch.device
    kernels: bool
    """The compiled kernels run these planes (CUDA tensors, the kernels load)."""


def _cache(k: torch.Tensor) -> _Cache:
    n, bs, heads, dim = k.shape
    return _Cache(n, bs, heads, dim, str(k.dtype).removeprefix("torch."), k.device, _use_kernels(k))


@functools.lru_cache(maxsize=1024)
def _format(
    num_tokens: int, num_heads: int, head_dim: int, dtype: str, scaled: bool, chunk_tokens: int
) -> tuple[PackedFormat, int]:
    """A format and its ``nbytes``: a runtime's calls repeat a few shapes."""
    fmt = PackedFormat(
        num_tokens=num_tokens,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        scaled=scaled,
        chunk_tokens=chunk_tokens,
    )
    return fmt, fmt.nbytes


def _block_ids(
    block_ids: Sequence[int] | np.ndarray | torch.Tensor, num_tokens: int, c: _Cache
) -> torch.Tensor:
    """The ``ceil(num_tokens / block_size)`` ids that hold the tokens, bounds-checked,
    as int64 where they were given (host ids cost the kernels no device sync). Ids going
    to the kernels are bounds-checked by the binding (host ids in a loop, device ids
    with one device sync), whose errors :func:`_launch` turns into ours. Host ids go
    through numpy: a list of ids becomes a tensor in a third of the time
    ``torch.as_tensor`` takes."""
    if num_tokens < 0:
        raise OpsInputError(f"num_tokens must be >= 0, got {num_tokens}")
    needed = -(-num_tokens // c.block_size)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise OpsInputError(
                f"block_ids must be a 1-D integer sequence, got {block_ids.dtype} of shape "
                f"{tuple(block_ids.shape)}"
            )
        if block_ids.numel() < needed:
            raise OpsInputError(
                f"{num_tokens} tokens in blocks of {c.block_size} need {needed} block ids, got "
                f"{block_ids.numel()}"
            )
        ids = block_ids[:needed].to(torch.int64)
        if needed and not c.kernels:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= c.num_blocks:
                raise OpsInputError(
                    f"block id {lo if lo < 0 else hi} is out of range [0, {c.num_blocks})"
                )
        return ids
    arr = np.ascontiguousarray(block_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise OpsInputError(f"block_ids must be a 1-D integer sequence, got shape {arr.shape}")
    if arr.size < needed:
        raise OpsInputError(
            f"{num_tokens} tokens in blocks of {c.block_size} need {needed} block ids, got "
            f"{arr.size}"
        )
    arr = arr[:needed]
    # the binding checks host ids itself (a C++ loop): the kernels' path skips this pass
    # (one pass: a negative id read as unsigned is larger than any block count)
    if needed and not c.kernels and int(arr.view(np.uint64).max()) >= c.num_blocks:
        lo = int(arr.min())
        raise OpsInputError(
            f"block id {lo if lo < 0 else int(arr.max())} is out of range [0, {c.num_blocks})"
        )
    return torch.from_numpy(arr)


def _check_heads(c: _Cache, start: int, count: int) -> None:
    if start < 0 or count <= 0 or start + count > c.num_heads:
        raise OpsInputError(
            f"head range [{start}, {start + count}) is outside the cache's {c.num_heads} heads"
        )


def _check_buffer(buf: torch.Tensor, nbytes: int, c: _Cache, what: str) -> None:
    if (
        not isinstance(buf, torch.Tensor)
        or buf.dtype != torch.uint8
        or buf.dim() != 1
        or not buf.is_contiguous()
    ):
        raise OpsInputError(f"{what} must be a contiguous 1-D uint8 tensor")
    if buf.device != c.device:
        raise OpsInputError(f"{what} is on {buf.device}, the cache on {c.device}")
    if buf.numel() < nbytes:
        raise OpsInputError(f"{what} holds {buf.numel()} bytes, the regions need {nbytes}")
    if buf.data_ptr() % 16:
        raise OpsInputError(f"{what} must start at a 16-byte aligned address")


KERNELS = ("rows", "tiles")
"""The CUDA kernels :func:`pack` and :func:`unpack` can run (``kernel=``)."""

TILE_ROWS = 128
"""Rows (tokens x packed heads) of the tile kernel's largest tile (``kTileRows`` in
``csrc/tile_map.h``). An exact copy whose cache blocks hold fewer rows runs on tiles by
default (see :func:`_kernel`)."""


def _kernel(name: str | None, scaled: bool, block_rows: int) -> int:
    """The binding's code of the kernel ``name``; default ``$KVBRIDGE_PACK_KERNEL``, else
    ``"tiles"`` for an FP8 (scaled) region or for blocks of fewer than
    :data:`TILE_ROWS` rows (``block_rows``: block size x packed heads), ``"rows"`` for
    the rest. Measured on an H100 (``benchmarks/results/ops.md``): tiles move FP8 at
    86-96% of a device copy (rows 53-57%). For exact copies rows lead by 1-4 points
    where a block fills a whole 128-row tile (8 KV heads); where tiles are small (1 KV
    head: 16-64 rows) tiles lead by 2-3 points at 1k tokens (85-86% against 82-83%,
    below the 85% goal) and trail by 0-3 from 8k (87-89% against 89-91%): tiles are
    the choice that stays at 85% or more in every measured case."""
    name = (
        name
        or os.environ.get("KVBRIDGE_PACK_KERNEL")
        or ("tiles" if scaled or block_rows < TILE_ROWS else "rows")
    )
    if name not in KERNELS:
        raise OpsInputError(
            f"unknown kernel {name!r}",
            fix=f"use one of {', '.join(KERNELS)} (kernel= or KVBRIDGE_PACK_KERNEL)",
        )
    return KERNELS.index(name)


def _binding():
    """The compiled ops, ``torch.ops.kvbridge`` (one place, so tests can stand in for it)."""
    return torch.ops.kvbridge


def _launch(op: str, *args) -> None:
    """Call the binding's ``op``. Its input checks (``csrc/api.cpp``: every layer's
    planes, block-id bounds, buffer sizes) fail as a ``RuntimeError`` whose message
    starts with "kvbridge: "; they are raised as :class:`OpsInputError` like the front's
    own, and anything else (a launch that failed) as it came."""
    try:
        getattr(_binding(), op)(*args)
    except RuntimeError as exc:
        text = str(exc)
        at = text.find("kvbridge: ")
        if at < 0 or "launch failed" in text:
            raise
        raise OpsInputError(text[at + len("kvbridge: ") :].split("\n", 1)[0]) from exc


def _use_kernels(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from kvbridge.ops import jit

    return jit.try_load()


class PagedKV:
    """A cache's layers as ``(k, v)`` planes (from :func:`kv_planes`), checked once, for
    repeated :meth:`pack` / :meth:`unpack` calls that pick layers by index.

    Who uses it: the runtime's packed path builds one per worker when the cache is
    registered and calls it once per post (pack) or arrival (unpack), from the
    sender's or receiver's thread. A call checks only what changes between calls
    (block ids, token count, head range, buffer) and hands the binding lists it
    already holds: the host work of a call is what limits short calls on a GPU
    (``csrc/NOTES.md``, "GPU results"). Same bytes and errors as the free functions.
    The engine owns the planes; they must stay allocated, with the shape they had
    here, while this object is used.

    >>> cache = torch.randn(2, 8, 16, 4, 64)                # 8 blocks, one layer, nhd
    >>> kv = PagedKV([kv_planes(cache, "nhd")])
    >>> region, fmt = kv.pack([3, 5], num_tokens=20)
    >>> bool(torch.equal(region, pack(kv_planes(cache, "nhd"), [3, 5], num_tokens=20)[0]))
    True
    """

    def __init__(self, layers: Planes | Sequence[Planes]) -> None:
        pairs = _layers(layers)
        _check_all(pairs)
        self.k = [p[0] for p in pairs]
        self.v = [p[1] for p in pairs]
        self._cache = _cache(self.k[0])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def _select(
        self, layers: Sequence[int] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if layers is None:
            return self.k, self.v
        if not layers or min(layers) < 0 or max(layers) >= len(self.k):
            raise OpsInputError(
                f"layers {list(layers)} are not a non-empty selection of this cache's "
                f"{len(self.k)} layers"
            )
        return [self.k[i] for i in layers], [self.v[i] for i in layers]

    def pack(
        self,
        block_ids: Sequence[int] | np.ndarray | torch.Tensor,
        num_tokens: int,
        *,
        layers: Sequence[int] | None = None,
        heads: tuple[int, int] | None = None,
        fp8: bool = False,
        chunk_tokens: int = 0,
        out: torch.Tensor | None = None,
        kernel: str | None = None,
    ) -> tuple[torch.Tensor, PackedFormat]:
        """:func:`pack` of the layers with indices ``layers`` (default all), in that
        order: region ``i`` holds layer ``layers[i]``."""
        ks, vs = self._select(layers)
        return _pack(
            ks,
            vs,
            self._cache,
            block_ids,
            num_tokens,
            heads,
            fp8,
            chunk_tokens,
            out,
            kernel,
            checked=True,
        )

    def unpack(
        self,
        packed: torch.Tensor,
        fmt: PackedFormat,
        block_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
        head_start: int = 0,
        kernel: str | None = None,
    ) -> None:
        """:func:`unpack` into the layers with indices ``layers`` (default all): region
        ``i`` goes to layer ``layers[i]``."""
        ks, vs = self._select(layers)
        _unpack(packed, fmt, ks, vs, self._cache, block_ids, head_start, kernel, checked=True)


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
    pairs = _layers(layers)
    ks = [p[0] for p in pairs]
    return _pack(
        ks,
        [p[1] for p in pairs],
        _cache(ks[0]),
        block_ids,
        num_tokens,
        heads,
        fp8,
        chunk_tokens,
        out,
        kernel,
        checked=False,
    )


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
    pairs = _layers(layers)
    ks = [p[0] for p in pairs]
    _unpack(
        packed,
        fmt,
        ks,
        [p[1] for p in pairs],
        _cache(ks[0]),
        block_ids,
        head_start,
        kernel,
        checked=False,
    )


def _pack(
    ks, vs, c: _Cache, block_ids, num_tokens, heads, fp8, chunk_tokens, out, kernel, checked: bool
) -> tuple[torch.Tensor, PackedFormat]:
    """:func:`pack` past the layers' own checks (``checked``: every layer was compared
    with the first; otherwise the binding or, for the reference, this does it)."""
    h0, h1 = heads if heads is not None else (0, c.num_heads)
    _check_heads(c, h0, h1 - h0)
    if fp8 and c.dtype == FP8_DTYPE:
        raise OpsInputError(
            "the cache is already float8",
            fix="pack it with fp8=False (its bytes are copied as they are)",
        )
    if chunk_tokens < 0:
        raise OpsInputError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    fmt, nbytes = _format(
        num_tokens, h1 - h0, c.head_dim, FP8_DTYPE if fp8 else c.dtype, fp8, chunk_tokens
    )
    ids = _block_ids(block_ids, num_tokens, c)
    total = len(ks) * nbytes
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=c.device)
    _check_buffer(out, total, c, "out")
    code = _kernel(kernel, fp8, c.block_size * (h1 - h0))
    if c.kernels:  # the binding checks every layer
        _launch("pack", ks, vs, ids, num_tokens, h0, h1 - h0, fp8, fmt.ct, out, code)
    else:
        pairs = list(zip(ks, vs, strict=True))
        if not checked:
            _check_all(pairs)
        reference.pack(pairs, ids.to(c.device), fmt, h0, out)
    return out[:total], fmt


def _unpack(
    packed, fmt: PackedFormat, ks, vs, c: _Cache, block_ids, head_start, kernel, checked: bool
) -> None:
    """:func:`unpack` past the layers' own checks (``checked``: as for :func:`_pack`)."""
    try:
        fmt.check()
    except KVBridgeError as exc:
        raise OpsInputError(str(exc)) from exc
    if fmt.head_dim != c.head_dim:
        raise OpsInputError(
            f"the region's head_dim {fmt.head_dim} differs from the cache's {c.head_dim}"
        )
    _check_heads(c, head_start, fmt.num_heads)
    if fmt.scaled and c.dtype == FP8_DTYPE:
        raise OpsInputError(
            "a scaled region cannot go into a float8 cache",
            fix="pack a float8 cache with fp8=False",
        )
    if not fmt.scaled and FP8_DTYPE in (fmt.dtype, c.dtype) and fmt.dtype != c.dtype:
        raise OpsInputError(
            f"unscaled float8 values only go into a float8 cache; got {fmt.dtype} into {c.dtype}"
        )
    ids = _block_ids(block_ids, fmt.num_tokens, c)
    _check_buffer(packed, len(ks) * _format(*fmt)[1], c, "packed")
    code = _kernel(kernel, fmt.scaled, c.block_size * fmt.num_heads)
    if c.kernels:
        _launch(
            "unpack",
            packed,
            getattr(torch, fmt.dtype),
            fmt.scaled,
            fmt.ct,
            ks,
            vs,
            ids,
            fmt.num_tokens,
            head_start,
            fmt.num_heads,
            code,
        )
    else:
        pairs = list(zip(ks, vs, strict=True))
        if not checked:
            _check_all(pairs)
        reference.unpack(packed, fmt, pairs, ids.to(c.device), head_start)


__all__ = [
    "KERNELS",
    "TILE_ROWS",
    "OpsInputError",
    "PackedFormat",
    "PagedKV",
    "device_bytes",
    "kv_planes",
    "pack",
    "packed_format",
    "unpack",
]
