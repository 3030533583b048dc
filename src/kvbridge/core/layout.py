"""KV cache layout geometry: where each (layer, block) of a paged KV cache lives in memory.

Vocabulary
----------
- *block*: ``block_size`` consecutive tokens of one request (vLLM "block", SGLang "page").
- *plane*: one array of blocks for one layer. A layer has one plane when K and V share
  each block (``fused``, ``nhd_kv``, ``hnd_kv``, ``latent``), two (K then V) when they
  are stored apart (``nhd``, ``hnd``).
- *slot*: one (layer, plane, block) triple; its bytes are contiguous in memory. Slots are
  numbered ``(layer * planes_per_layer + plane) * num_blocks + block``; transports
  prepare one descriptor table over all slots once, and transfers select slots by index.

Layouts (shape of one block inside one plane, row-major)
--------------------------------------------------------
- ``fused``: per KV head, a half for the block's keys then a half for its values, each
  ``block_size * head_dim`` elements. vLLM's CPU backend allocates a layer as one tensor
  ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)`` and splits it in halves; the
  order inside a half is its kernel's (the ``vec`` kernel keeps keys dim-major, values
  token-major), so kvbridge moves fused blocks whole and never reads a token out of one.
- ``nhd``: K and V planes, each block ``(block_size, num_kv_heads, head_dim)``. vLLM's
  FlashAttention layer tensor before 0.32 ``(2, num_blocks, block_size, num_kv_heads, head_dim)``;
  SGLang's per-layer ``k_buffer`` / ``v_buffer`` of ``(num_pages * page_size, heads, dim)``.
- ``hnd``: K and V planes, each block ``(num_kv_heads, block_size, head_dim)``
  (FlashInfer's HND).
- ``nhd_kv``: one plane, each block ``(block_size, num_kv_heads, 2 * head_dim)``: per
  token and head its key, then its value. vLLM 0.32's GPU attention cache, a layer
  viewed as ``[blocks, heads, tokens, K|V]`` stored tokens before heads (its
  ``VLLM_KV_CACHE_LAYOUT=LBNHC``).
- ``hnd_kv``: one plane, each block ``(num_kv_heads, block_size, 2 * head_dim)``: the
  same view stored heads before tokens (``LBHNC``).
- ``latent``: one plane, each block ``(block_size, head_dim)``: multi-head latent
  attention (DeepSeek's MLA) caches one compressed vector per token (``kv_lora_rank``
  + ``qk_rope_head_dim`` values) from which the heads' keys and values are computed;
  ``num_kv_heads`` is 1. Every tensor-parallel rank holds the same latent cache. vLLM's
  MLA layer tensor ``(num_blocks, block_size, head_dim)``; SGLang's MLA ``kv_buffer``.

>>> spec = CacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64,
...                  dtype="bfloat16", layout="nhd")
>>> spec.planes_per_layer, spec.block_bytes
(2, 4096)
>>> geo = CacheGeometry(spec=spec, num_blocks=8, plane_bases=(0x10000, 0x20000, 0x30000, 0x40000))
>>> geo.slot(layer=1, plane=0, block=3), hex(geo.slot_address(19))
(19, '0x33000')

This module is pure Python (numpy only); the engine adapters compute base addresses
from their tensors and build a :class:`CacheGeometry` once per worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, get_args

import msgspec
import numpy as np

from kvbridge.errors import PlanError

Layout = Literal["fused", "nhd", "hnd", "nhd_kv", "hnd_kv", "latent"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
TOKEN_ROW_LAYOUTS = frozenset({"nhd", "hnd", "nhd_kv", "hnd_kv"})
"""Layouts that hold each (plane, token, head) as a row of ``head_dim`` values, whatever
their order in the block: any two pack into the same rows
(:attr:`~kvbridge.wire.peer_compat.CompatInfo.layout_key`)."""
MemoryKind = Literal["host", "device"]

#: Bytes per element of the cache dtypes kvbridge moves (torch dtype names, no prefix).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class CacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What two caches must share for a block-for-block copy between them.

    Everything here except addresses and block counts; it is part of the compatibility
    check of every handshake.
    """

    num_layers: int
    block_size: int
    """Tokens per block (vLLM block size, SGLang page size)."""
    num_kv_heads: int
    """KV heads held by this rank (after tensor-parallel split)."""
    head_dim: int
    dtype: str
    """Element type, a torch dtype name without ``torch.`` (``"bfloat16"``)."""
    layout: Layout

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"CacheSpec.dtype {self.dtype!r} is not supported; "
                f"supported: {', '.join(sorted(DTYPE_SIZES))}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"CacheSpec.layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.layout == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"a latent (MLA) cache has one KV head, got {self.num_kv_heads}")

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def planes_per_layer(self) -> int:
        return 2 if self.layout in ("nhd", "hnd") else 1

    @property
    def token_major(self) -> bool:
        """A block stores its tokens one after the other (each token's bytes together):
        its first ``n`` tokens are its first bytes (:meth:`CacheGeometry.in_blocks_of`)."""
        return self.layout in ("nhd", "nhd_kv", "latent")

    @property
    def heads_apart(self) -> bool:
        """A block stores each KV head's bytes together: a range of heads is a range of
        its bytes (:meth:`CacheGeometry.part_table`). A latent cache's one "head" is."""
        return self.layout in ("fused", "hnd", "hnd_kv", "latent")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one plane."""
        per_token_head = self.head_dim * (2 if self.layout in ("fused", "nhd_kv", "hnd_kv") else 1)
        return self.block_size * self.num_kv_heads * per_token_head * self.element_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers and planes of this rank."""
        return self.block_bytes * self.planes_per_layer * self.num_layers // self.block_size


MAX_PLANES = 1 << 16
"""Planes (layers x planes per layer) a :class:`CacheGeometry` may address; checked while
a peer's geometry is decoded, before its tuples are built."""
PlaneInts = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_PLANES)]


class CacheGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank's paged KV cache lives: a :class:`CacheSpec` plus addresses.

    Built once per worker by the engine adapter after the cache is allocated; sent to
    peers in the handshake so they can address our blocks. Immutable.
    """

    spec: CacheSpec
    num_blocks: int
    plane_bases: PlaneInts
    """Address of block 0 of every plane, ordered (layer, plane)."""
    block_stride: int = 0
    """Bytes from block ``b`` to ``b + 1`` within a plane; 0 means ``spec.block_bytes``
    (blocks packed back to back). Larger when blocks of several layers interleave."""
    memory: MemoryKind = "host"
    device: int = 0
    """CUDA device index for ``memory="device"``; 0 for host memory."""
    layer_bytes: PlaneInts = ()
    """Bytes that move of one block, per layer, where layers differ: a state-space
    layer (Mamba) keeps one state per request at the start of a page it shares with the
    attention layers' blocks (vLLM's hybrid manager), smaller than a block. Empty:
    ``spec.block_bytes`` in every layer. Only for one-plane layouts."""

    def __post_init__(self) -> None:
        if self.layer_bytes:
            if len(self.layer_bytes) != self.spec.num_layers or self.spec.planes_per_layer != 1:
                raise ValueError(
                    f"CacheGeometry.layer_bytes needs one entry per layer ({self.spec.num_layers}) "
                    f"of a one-plane layout, got {len(self.layer_bytes)} for {self.spec.layout}"
                )
            if any(not 0 < n <= self.stride for n in self.layer_bytes):
                raise ValueError(
                    "CacheGeometry.layer_bytes must be positive and at most the block stride "
                    f"({self.stride}): {self.layer_bytes}"
                )
        expected = self.spec.num_layers * self.spec.planes_per_layer
        if len(self.plane_bases) != expected:
            raise ValueError(
                f"CacheGeometry needs {expected} plane bases ({self.spec.num_layers} layers x "
                f"{self.spec.planes_per_layer} planes), got {len(self.plane_bases)}"
            )
        if self.num_blocks <= 0:
            raise ValueError(f"CacheGeometry.num_blocks must be positive, got {self.num_blocks}")
        if self.block_stride and self.block_stride < self.spec.block_bytes:
            raise ValueError(
                f"CacheGeometry.block_stride {self.block_stride} is smaller than one block "
                f"({self.spec.block_bytes} bytes): blocks would overlap"
            )
        if any(b <= 0 for b in self.plane_bases):
            raise ValueError("CacheGeometry.plane_bases must be positive addresses")

    # --- slots ---------------------------------------------------------------------------

    @property
    def stride(self) -> int:
        return self.block_stride or self.spec.block_bytes

    @property
    def num_slots(self) -> int:
        return len(self.plane_bases) * self.num_blocks

    def slot(self, layer: int, plane: int, block: int) -> int:
        """Index of one (layer, plane, block) in the slot numbering."""
        return (layer * self.spec.planes_per_layer + plane) * self.num_blocks + block

    def slot_address(self, slot: int) -> int:
        plane, block = divmod(slot, self.num_blocks)
        return self.plane_bases[plane] + block * self.stride

    def slot_table(self) -> np.ndarray:
        """``(num_slots, 3)`` uint64 array of ``(address, length, device)`` in slot order.

        Transports prepare this once per cache (ours and each peer's)."""
        bases = np.asarray(self.plane_bases, dtype=np.uint64)
        offsets = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.stride)
        table = np.empty((self.num_slots, 3), dtype=np.uint64)
        table[:, 0] = (bases[:, None] + offsets[None, :]).reshape(-1)
        table[:, 1] = (
            np.repeat(np.asarray(self.layer_bytes, dtype=np.uint64), self.num_blocks)
            if self.layer_bytes
            else self.spec.block_bytes
        )
        table[:, 2] = self.device
        return table

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes that move of one block of ``layer`` in one plane (:attr:`layer_bytes`)."""
        return self.layer_bytes[layer] if self.layer_bytes else self.spec.block_bytes

    def part_table(self, parts: int) -> np.ndarray:
        """Like :meth:`slot_table` with every slot cut into ``parts`` equal pieces, each
        ``num_kv_heads / parts`` heads of the block (row ``slot * parts + k`` is piece
        ``k``): what a peer with another tensor-parallel split addresses. Only layouts
        that keep a block's heads apart (:attr:`CacheSpec.heads_apart`) can be cut so.

        Raises:
            PlanError: the layout interleaves heads per token, or ``parts`` does not
                divide the heads.
        """
        if parts == 1:
            return self.slot_table()
        spec = self.spec
        if self.layer_bytes:
            raise PlanError(
                f"cannot cut the blocks of a cache with state-space layers into {parts} head ranges"
            )
        if not spec.heads_apart or spec.num_kv_heads % parts:
            raise PlanError(
                f"cannot cut {spec.layout} blocks of {spec.num_kv_heads} KV heads into {parts} "
                "head ranges"
            )
        piece = spec.block_bytes // parts
        table = np.repeat(self.slot_table(), parts, axis=0)
        table[:, 0] += np.tile(np.arange(parts, dtype=np.uint64) * np.uint64(piece), self.num_slots)
        table[:, 1] = piece
        return table

    def in_blocks_of(self, tokens: int) -> CacheGeometry:
        """The same memory addressed in blocks of ``tokens`` tokens (config
        ``transfer_block_size``): block ``b`` of this geometry is blocks ``b * m`` to
        ``b * m + m - 1`` of the result, ``m = block_size / tokens``
        (:func:`sub_block_ids`). Only caches that keep a block's tokens one after the
        other, blocks back to back, can be cut so.

        >>> spec = CacheSpec(
        ...     num_layers=1, block_size=64, num_kv_heads=2, head_dim=8, dtype="float16",
        ...     layout="nhd",
        ... )
        >>> geo = CacheGeometry(spec=spec, num_blocks=4, plane_bases=(0x1000, 0x9000))
        >>> geo = geo.in_blocks_of(16)
        >>> geo.spec.block_size, geo.num_blocks, hex(geo.slot_address(geo.slot(0, 1, 5)))
        (16, 16, '0x9a00')

        Raises:
            PlanError: ``tokens`` does not divide the block size, or the layout or the
                block stride keeps a block's sub-blocks apart.
        """
        spec = self.spec
        if tokens == spec.block_size:
            return self
        if tokens <= 0 or spec.block_size % tokens:
            raise PlanError(f"{tokens} does not divide the cache's block size {spec.block_size}")
        if self.layer_bytes:
            raise PlanError(
                "a cache with state-space layers keeps one state per request: its blocks cannot "
                f"be moved in blocks of {tokens} tokens"
            )
        if not spec.token_major:
            raise PlanError(
                f"a {spec.layout} cache does not store a block token by token: its blocks cannot "
                f"be moved in blocks of {tokens} tokens"
            )
        if self.stride != spec.block_bytes:
            raise PlanError(
                f"the cache's blocks are {self.stride} bytes apart, not back to back: they cannot "
                f"be moved in blocks of {tokens} tokens"
            )
        m = spec.block_size // tokens
        return msgspec.structs.replace(
            self,
            spec=msgspec.structs.replace(spec, block_size=tokens),
            num_blocks=self.num_blocks * m,
            block_stride=0,
        )

    def slots(
        self, block_ids: Sequence[int] | np.ndarray, layers: Iterable[int] | None = None
    ) -> np.ndarray:
        """Slot indices of ``block_ids`` in ``layers`` (default all), every plane.

        Ordered layer-major, then plane, then position in ``block_ids``, so that two
        caches with the same spec give position-wise matching slots.

        Raises:
            PlanError: a block id or layer is out of range.
        """
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            bad = blocks[(blocks < 0) | (blocks >= self.num_blocks)][0]
            raise PlanError(f"block id {int(bad)} out of range [0, {self.num_blocks})")
        layer_ids = (
            np.arange(self.spec.num_layers)
            if layers is None
            else np.fromiter(layers, dtype=np.int64)
        )
        if layer_ids.size and (layer_ids.min() < 0 or layer_ids.max() >= self.spec.num_layers):
            raise PlanError(f"layer out of range [0, {self.spec.num_layers}): {layer_ids.tolist()}")
        p = self.spec.planes_per_layer
        planes = (layer_ids[:, None] * p + np.arange(p)[None, :]).reshape(-1)
        return (planes[:, None] * self.num_blocks + blocks[None, :]).reshape(-1)

    # --- registration ----------------------------------------------------------------------

    def regions(self) -> list[tuple[int, int]]:
        """Memory spans ``(address, length)`` covering every slot, adjacent and overlapping
        spans merged; what a transport must register for this cache."""
        span = (self.num_blocks - 1) * self.stride + self.spec.block_bytes
        return merge_regions((base, span) for base in self.plane_bases)


def sub_block_ids(block_ids: Iterable[int], ratio: int, limit: int | None = None) -> list[int]:
    """Block ids of a cache of ``ratio``-times smaller blocks covering the same tokens
    (:meth:`CacheGeometry.in_blocks_of`): each id ``b`` becomes ``b * ratio`` to ``b *
    ratio + ratio - 1``; at most ``limit`` of them (the blocks the tokens fill). A
    negative id (no block: :data:`kvbridge.core.blocks.NONE`) stays one in each.

    >>> sub_block_ids([7, 2], 4, limit=6)
    [28, 29, 30, 31, 8, 9]
    >>> sub_block_ids([-1, 2], 2)
    [-1, -1, 4, 5]
    """
    out = [b * ratio + k if b >= 0 else b for b in block_ids for k in range(ratio)]
    return out if limit is None else out[: max(0, limit)]


def merge_regions(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort ``(address, length)`` spans and merge those that touch or overlap.

    >>> merge_regions([(100, 10), (0, 50), (50, 10), (105, 20)])
    [(0, 60), (100, 25)]
    """
    merged: list[tuple[int, int]] = []
    for addr, length in sorted(regions):
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            start, prev_len = merged[-1]
            merged[-1] = (start, max(prev_len, addr + length - start))
        else:
            merged.append((addr, length))
    return merged


__all__ = [
    "DTYPE_SIZES",
    "LAYOUTS",
    "TOKEN_ROW_LAYOUTS",
    "CacheGeometry",
    "CacheSpec",
    "Layout",
    "MemoryKind",
    "merge_regions",
    "sub_block_ids",
]
