"""SGLang's KV pool and metadata buffers as kvbridge descriptor tables. Pure; no I/O.

SGLang describes its caches in ``KVArgs`` as flat lists (see
docs/reference/sglang.md, "KVArgs and the KV pool on CPU"):

- ``kv_data_ptrs`` = ``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]``, one tensor per layer and
  plane; ``kv_item_lens[i]`` is the bytes of one *page* of tensor ``i``, and page ``p``
  of tensor ``i`` is at ``kv_data_ptrs[i] + p * kv_item_lens[i]`` (the MHA pool's
  token-major ``(pages * page_size, heads, head_dim)`` buffers: layout ``nhd``). An MLA
  pool has one tensor per layer, ``[KV_0 .. KV_{L-1}]``, its ``kv_buffer`` of
  ``(pages * page_size, 1, kv_lora_rank + qk_rope_head_dim)``: layout ``latent``.
- ``aux_data_ptrs``: the metadata buffers (first token, logprobs, ..., room), one row
  per request slot, ``aux_item_lens[j]`` bytes per row.
- ``state_data_ptrs[0]`` beside a hybrid pool (:func:`pool_states`): a sliding-window
  pool's window layers (as the KV lists), or a state-space pool's state tensors, one
  row per state slot (as the metadata buffers; what moves of them: :mod:`.states`).

:func:`kv_geometry` turns the first into a :class:`~kvbridge.core.layout.CacheGeometry`
(planes reordered to kvbridge's (layer, plane) order), so slot tables and slot indices
come from kvbridge's core. SGLang's decode does not know the head count or dtype
(``KVArgs.kv_head_num`` is unset there), so the spec describes a page as opaque bytes:
``uint8`` elements, one "head" of ``page_bytes / page_size`` per token. What a byte copy
needs to agree on is exactly that, plus the page size; SGLang itself checks the KV dtype
and layout of both sides before any transfer (``try_ensure_parallel_info``).

>>> geo = kv_geometry(page_size=16, ptrs=[0x1000, 0x9000, 0x5000, 0xd000],
...                   lens=[0x4000] * 4, item_lens=[0x800] * 4)
>>> geo.spec.num_layers, geo.num_blocks, [hex(b) for b in geo.plane_bases]
(2, 8, ['0x1000', '0x5000', '0x9000', '0xd000'])
>>> geo.slots([3, 4]).tolist()        # layer 0 K, layer 0 V, layer 1 K, layer 1 V
[3, 4, 11, 12, 19, 20, 27, 28]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from kvbridge.core.layout import CacheGeometry, CacheSpec, MemoryKind
from kvbridge.errors import IncompatiblePeerError, PlanError

PoolStates = Literal["swa", "mamba"]


def pool_states(state_types: Sequence[object] | None) -> PoolStates | None:
    """Which state SGLang registered beside a KV pool (``KVArgs.state_types``); called
    once per rank, when the manager starts.

    - None: an MHA or MLA pool, nothing beside it;
    - ``"swa"`` (exactly ``[SWA]``): its hybrid sliding-window pool. ``kv_data_ptrs``
      hold the full-attention layers, ``state_data_ptrs[0]`` the window layers' K and
      V, in the same ``[K.., V..]`` order, whose pages hold only each request's last
      window of tokens;
    - ``"mamba"`` (exactly ``[MAMBA]``): a hybrid pool with state-space layers
      (Mamba2, Gated DeltaNet, short convolutions). ``kv_data_ptrs`` hold the attention
      layers, ``state_data_ptrs[0]`` one tensor per (state, layer) (e.g. conv then
      SSM states), one row of ``state_item_lens[0][j]`` bytes per state slot; a request
      owns one slot on each side (its state index): :class:`~kvbridge.core.rows.RowLayout`
      describes them.

    Raises:
        PlanError: the pool carries other state (sparse-attention indexer tails, MXFP8
            block scales, several kinds at once, ...), which this backend does not
            move: without this check the server would start and fail every request.
    """
    names = [str(getattr(s, "name", s)) for s in state_types or ()]
    if not names:
        return None
    if names in (["SWA"], ["MAMBA"]):
        return names[0].lower()
    raise PlanError(
        "this model's SGLang KV pool carries state that kvbridge does not move yet "
        f"({', '.join(names)}); kvbridge supports MHA and MLA pools, sliding-window pools "
        "(SWA alone) and state-space pools (MAMBA alone)",
        fix=(
            "serve this model with one of SGLang's own backends "
            "(--disaggregation-transfer-backend mooncake or nixl)"
        ),
    )


def kv_geometry(
    *,
    page_size: int,
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    memory: MemoryKind = "host",
    device: int = 0,
    mla: bool = False,
) -> CacheGeometry:
    """The geometry of an SGLang KV pool from its ``KVArgs`` lists: an MHA pool, or with
    ``mla`` (SGLang's ``is_mla_backend``) an MLA pool.

    Raises:
        PlanError: the pool is not one K and one V tensor per layer (MLA: one tensor
            per layer) with equal pages (hybrid or draft pools are not supported by
            this backend yet).
    """
    n = len(ptrs)
    planes = 1 if mla else 2
    if n == 0 or n % planes or len(lens) != n or len(item_lens) != n:
        raise PlanError(
            f"SGLang KV pool has {n} buffers ({len(lens)} lengths, {len(item_lens)} page sizes); "
            "kvbridge supports "
            f"{'MLA pools: one latent buffer' if mla else 'MHA pools: one K and one V buffer'} per "
            "layer"
        )
    if len(set(item_lens)) != 1 or len(set(lens)) != 1:
        raise PlanError(
            "SGLang KV pool buffers differ in page bytes or length "
            f"(page bytes {sorted(set(item_lens))}, lengths {sorted(set(lens))}); "
            "kvbridge supports MHA and MLA pools with equal layers (no hybrid or draft pools yet)"
        )
    page_bytes = int(item_lens[0])
    if page_size <= 0 or page_bytes % page_size:
        raise PlanError(f"page bytes {page_bytes} are not a multiple of page_size {page_size}")
    layers = n // planes
    spec = CacheSpec(
        num_layers=layers,
        block_size=page_size,
        num_kv_heads=1,
        head_dim=page_bytes // page_size,
        dtype="uint8",
        layout="latent" if mla else "nhd",
    )
    bases = tuple(
        int(ptrs[plane * layers + layer]) for layer in range(layers) for plane in range(planes)
    )
    return CacheGeometry(
        spec=spec,
        num_blocks=int(lens[0]) // page_bytes,
        plane_bases=bases,
        memory=memory,
        device=device,
    )


def transfer_pages(pages, ratio: int) -> np.ndarray:
    """A room's SGLang page ids as transfer pages of ``1 / ratio`` of a page (the side
    with the larger pages, ``transfer_block_size``): page ``p`` is ``p *
    ratio`` to ``p * ratio + ratio - 1``, the same memory as
    :meth:`~kvbridge.core.layout.CacheGeometry.in_blocks_of` addresses.

    >>> transfer_pages([3, 1], 2).tolist()
    [6, 7, 2, 3]
    """
    pages = np.asarray(pages, dtype=np.int64)
    if ratio == 1:
        return pages
    return (pages[:, None] * ratio + np.arange(ratio)).reshape(-1)


def window_overlap(src: int, src_end: int, dst: int, dst_end: int) -> tuple[slice, slice]:
    """A sliding-window pool's window pages between sides with other page sizes
    (``transfer_block_size``): which of a prefill's ``src`` window pages and of a
    decode's ``dst`` (transfer pages, position order) hold the same positions, as a
    ``(src, dst)`` pair of equally long slices. Each list ends with the last page of the
    room's page list on its side, transfer page ``src_end`` / ``dst_end`` of it (both
    counted from the decode's prefix): SGLang starts each side's window at the same
    position rounded down to that side's own page, so the list with the larger pages
    starts earlier (at positions no window attention reads) and may end later (past the
    prompt, as its last full-attention page does). Equal page sizes: both lists whole.

    A 220-token prompt, a window from position 181, transfer pages of 16 tokens:

    >>> window_overlap(3, 14, 3, 14)   # pages of 16 on both sides: 176..223
    (slice(0, 3, None), slice(0, 3, None))
    >>> window_overlap(4, 14, 3, 14)   # the prefill's pages of 32 from 160, the decode's from 176
    (slice(1, 4, None), slice(0, 3, None))
    >>> window_overlap(3, 14, 4, 14)   # and the other way round
    (slice(0, 3, None), slice(1, 4, None))
    """
    lo = max(src_end - src, dst_end - dst)
    hi = max(lo, min(src_end, dst_end))
    s0, d0 = lo - (src_end - src), lo - (dst_end - dst)
    return slice(s0, s0 + hi - lo), slice(d0, d0 + hi - lo)


def pages_differ(theirs: CacheSpec | None, mine: CacheSpec) -> IncompatiblePeerError:
    """Why a decode's KV pages (``theirs``) cannot take this prefill's (``mine``),
    naming ``transfer_block_size`` when only the page size differs."""
    fix = None
    if theirs is not None and msgspec.structs.replace(theirs, block_size=mine.block_size) == mine:
        fix = (
            f"its pages hold {theirs.block_size} tokens, this prefill's {mine.block_size}: set "
            f"transfer_block_size {min(theirs.block_size, mine.block_size)} in KVBRIDGE_CONFIG on "
            "both instances (a prefill with larger pages than its decode's also needs a decode "
            "without --disaggregation-decode-enable-radix-cache)"
        )
    return IncompatiblePeerError(
        f"its KV pages ({theirs}) differ from this prefill's ({mine})", fix=fix
    )


def check_presence(theirs: object, mine: object, what: str) -> None:
    """Raise :class:`IncompatiblePeerError` when a decode's registration has ``what`` (a
    pool part: sliding-window layers, state-space layers; ``theirs`` not None) and this
    prefill has not, or the other way round."""
    if (mine is None) != (theirs is None):
        raise IncompatiblePeerError(
            f"its KV pool has {'no ' if theirs is None else ''}{what} and this prefill's "
            f"{'has none' if mine is None else 'has'}: serve the same model on both"
        )


def check_windows(
    theirs: CacheGeometry | None, mine: CacheGeometry | None, *, packed: bool = False
) -> None:
    """Raise :class:`IncompatiblePeerError` unless a decode's sliding-window layers
    (``theirs``, from its registration) and this prefill's (``mine``) are kept in pages
    alike, or neither side has any (:func:`pool_states`). ``packed``: the
    packed path, where each side's window rows equal its full-attention rows (checked
    at its start) and the packed format's check covers them, so only the layer count
    and page size must agree (the rows' bytes differ between TP sizes)."""
    check_presence(theirs, mine, "sliding-window layers")
    if mine is None:
        return
    if packed:
        ours, other = mine.spec, theirs.spec
        if (ours.num_layers, ours.block_size) != (other.num_layers, other.block_size):
            raise IncompatiblePeerError(
                f"its {other.num_layers} sliding-window layers in pages of {other.block_size} "
                f"tokens differ from this prefill's {ours.num_layers} in pages of "
                f"{ours.block_size}: serve the same model with the same --page-size on both"
            )
        return
    if theirs.spec != mine.spec:
        raise IncompatiblePeerError(
            f"its sliding-window pages ({theirs.spec}) differ from this prefill's ({mine.spec}): "
            "serve the same model with the same KV cache dtype on both"
        )


__all__ = [
    "PoolStates",
    "check_presence",
    "check_windows",
    "kv_geometry",
    "pages_differ",
    "pool_states",
    "transfer_pages",
]
