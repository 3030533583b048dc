"""Per-layer streaming bookkeeping of the SGLang backend. Pure: no SGLang, no torch, no I/O.

Who uses what (see :mod:`.prefill` and docs/reference/sglang.md, "Per-layer hooks"):

- the scheduler thread, once per prefill forward (``ForwardBatch.init_new`` hook), asks
  :func:`streams` whether a request is streamed per layer and :func:`completed_span`
  which positions of its decode page list that forward completes, and builds a
  :class:`ForwardPlan`; the attention hook then hands ``(plan, layer)`` to the transfer
  thread as a :class:`LayerReady`, once per layer, without blocking;
- the transfer thread owns one :class:`RoomProgress` per streamed room: every
  ``(layer, page position)`` pair it posts is marked there, so each pair goes out once,
  whether by a per-layer post or by the chunk send that SGLang asks for afterwards
  (:meth:`RoomProgress.take`). :func:`coalesce` merges layers that became ready while
  the thread was busy into one post.

Positions are indices into the decode's page list for the room (SGLang's ``index_slice``
coordinates): position ``i`` holds prompt tokens ``[(i + d) * page, (i + d + 1) * page)``
where ``d = decode_prefix_len // page`` (the decode already has its cached prefix).

>>> completed_span(prefix_len=64, extend_len=64, prompt_len=200, decode_prefix_len=0, page_size=16)
(4, 8)
>>> completed_span(prefix_len=192, extend_len=8, prompt_len=200, decode_prefix_len=0, page_size=16)
(12, 13)
>>> p = RoomProgress(num_layers=2, num_pages=4)
>>> [(layers, pos.tolist()) for layers, pos in p.take([0], 0, 2)]
[((0,), [0, 1])]
>>> [(layers, pos.tolist()) for layers, pos in p.take([0, 1], 0, 4)]    # the chunk send
[((0,), [2, 3]), ((1,), [0, 1, 2, 3])]
>>> p.take([0, 1], 0, 4)
[]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from kvbridge.errors import PlanError


def streams(*, layerwise: bool, min_tokens: int, prompt_len: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens is sent per layer (config ``layerwise``
    and ``layerwise_min_tokens``); otherwise it keeps the per-chunk path.

    >>> [streams(layerwise=True, min_tokens=128, prompt_len=n) for n in (127, 128)]
    [False, True]
    """
    return layerwise and prompt_len >= min_tokens


def completed_span(
    *, prefix_len: int, extend_len: int, prompt_len: int, decode_prefix_len: int, page_size: int
) -> tuple[int, int]:
    """Decode page-list positions ``[lo, hi)`` that one prefill forward completes.

    The forward writes prompt tokens ``[prefix_len, prefix_len + extend_len)`` (tokens
    below ``prefix_len`` were in the cache before it: an earlier chunk, or a radix-cache
    hit). Once it has passed a layer, that layer holds every full page up to the
    forward's end, and the partial last page too when the forward reaches the end of
    the prompt (SGLang's own rule: a partial page goes with the last chunk). Pages
    below ``prefix_len``'s page were complete before this forward and are not
    included: an earlier forward posted them, or (radix hits) the chunk send does.
    ``hi <= lo`` means nothing to post.

    >>> from functools import partial
    >>> span = partial(completed_span, page_size=16)
    >>> span(prefix_len=0, extend_len=12, prompt_len=12, decode_prefix_len=0)
    (0, 1)
    >>> span(prefix_len=0, extend_len=40, prompt_len=100, decode_prefix_len=0)
    (0, 2)
    >>> # page 2 was partial:
    >>> span(prefix_len=40, extend_len=40, prompt_len=100, decode_prefix_len=0)
    (2, 5)
    >>> # the decode holds 3 pages:
    >>> span(prefix_len=32, extend_len=32, prompt_len=64, decode_prefix_len=48)
    (0, 1)
    """
    if page_size <= 0:
        raise PlanError(f"page_size must be positive, got {page_size}")
    if decode_prefix_len % page_size:
        raise PlanError(f"decode prefix {decode_prefix_len} is not page-aligned (page {page_size})")
    end = min(prefix_len + extend_len, prompt_len)
    hi = -(-end // page_size) if end >= prompt_len else end // page_size
    lo = max(prefix_len, decode_prefix_len) // page_size
    base = decode_prefix_len // page_size
    return lo - base, max(lo, hi) - base


class ReqSpan(NamedTuple):
    """One streamed request of a forward: the room, the positions ``[lo, hi)`` of its
    decode page list this forward completes, and the prefill page ids holding them."""

    room: int
    lo: int
    hi: int
    src_pages: np.ndarray


class ForwardPlan(NamedTuple):
    """What one prefill forward will complete, per streamed request. Built by the
    scheduler thread before the forward, read by the transfer thread; immutable.
    ``on_layer(plan, layer)`` is called by the attention hook after each layer."""

    spans: tuple[ReqSpan, ...]
    on_layer: Callable[[ForwardPlan, int], None]


class LayerReady(NamedTuple):
    """``layers`` of ``plan``'s forward are in the KV pool (once ``event``, a device
    event or None on host memory, has completed)."""

    plan: ForwardPlan
    layers: tuple[int, ...]
    event: object = None


def coalesce(items: Iterable[object]) -> list[object]:
    """Merge runs of :class:`LayerReady` of the same forward into one (their layers in
    order; the last event, which the stream reaches after the earlier ones). Other
    items keep their place: a chunk is never moved across a layer.

    >>> plan = ForwardPlan((), lambda p, layer: None)
    >>> items = [LayerReady(plan, (0,)), LayerReady(plan, (1,)), "chunk", LayerReady(plan, (2,))]
    >>> [x if isinstance(x, str) else x.layers for x in coalesce(items)]
    [(0, 1), 'chunk', (2,)]
    """
    out: list[object] = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, LayerReady) and isinstance(prev, LayerReady) and prev.plan is item.plan:
            out[-1] = LayerReady(item.plan, prev.layers + item.layers, item.event)
        else:
            out.append(item)
    return out


class RoomProgress:
    """Which ``(layer, position)`` pairs of one room have been posted. Owned by the
    transfer thread (not thread-safe); created at the room's first per-layer post,
    dropped when the room's transfers are released."""

    __slots__ = ("chunk_writes", "layer_writes", "posted")

    def __init__(self, num_layers: int, num_pages: int) -> None:
        self.posted = np.zeros((num_layers, num_pages), dtype=bool)
        self.layer_writes = 0
        """Writes posted from the attention hook (one per group and destination)."""
        self.chunk_writes = 0
        """Writes posted by chunk sends (gaps: radix-cache hits, missed layers)."""

    @property
    def num_pages(self) -> int:
        return int(self.posted.shape[1])

    def take(
        self, layers: Sequence[int], lo: int, hi: int
    ) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """Mark the pairs of ``layers`` x ``[lo, hi)`` as posted and return those that
        were not, grouped: ``(layers, positions)`` with the same positions for every
        layer of a group (one write each). Empty when everything was posted.

        Raises:
            PlanError: positions or layers out of range.
        """
        num_layers, num_pages = self.posted.shape
        if not 0 <= lo <= hi <= num_pages:
            raise PlanError(
                f"page positions [{lo}, {hi}) outside the room's {num_pages} destination pages"
            )
        if hi == lo:
            return []
        rows = np.asarray(layers, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= num_layers):
            raise PlanError(f"layers {rows.tolist()} outside [0, {num_layers})")
        groups: dict[bytes, list[int]] = {}
        todo = ~self.posted[rows, lo:hi]
        for layer, row in zip(rows.tolist(), todo, strict=True):
            if row.any():
                groups.setdefault(row.tobytes(), []).append(layer)
        self.posted[rows, lo:hi] = True
        return [
            (tuple(group), lo + np.flatnonzero(np.frombuffer(key, dtype=bool)))
            for key, group in groups.items()
        ]

    def complete(self) -> bool:
        """Every pair posted."""
        return bool(self.posted.all())


__all__ = [
    "ForwardPlan",
    "LayerReady",
    "ReqSpan",
    "RoomProgress",
    "coalesce",
    "completed_span",
    "streams",
]
