"""Per-layer streaming bookkeeping of the SGLang backend (pure; no SGLang needed).

The simulation below replays what SGLang 0.5.23 does for one request on the prefill
(docs/reference/sglang.md, "The classes and who calls what" and "Per-layer hooks"):
forwards of at most ``chunk`` tokens after a radix-cache prefix, each followed by a chunk
send of the pages ``[start_send_idx, end)`` (a partial last page held back until the last
chunk), and checks that per-layer posts plus chunk sends post every (layer, decode page)
pair exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.adapters.sglang.streaming import (
    ForwardPlan,
    LayerReady,
    RoomProgress,
    coalesce,
    completed_span,
    streams,
)
from kvbridge.errors import PlanError


def sglang_request(
    prompt: int, page: int, chunk: int, radix_hit: int, decode_prefix: int
) -> list[tuple]:
    """What the prefill does for one request, in order: ``("forward", prefix_len,
    extend_len)`` and ``("send", index_slice)`` (decode page-list positions)."""
    events: list[tuple] = []
    start_send = decode_prefix
    done = radix_hit
    while done < prompt:
        extend = min(chunk, prompt - done)
        events.append(("forward", done, extend))
        done += extend
        last = done >= prompt
        end = done if last else done - done % page
        if end >= start_send:
            lo, hi = (start_send - decode_prefix) // page, -(-(end - decode_prefix) // page)
            if hi > lo or last:
                events.append(("send", slice(lo, hi)))
            start_send = end
    return events


def replay(prompt, page, chunk, radix_hit, decode_prefix, layers, hook_fires=lambda i: True):
    """Per-layer posts for every forward the hook fires on (the ``i``-th forward), and
    every chunk send; returns the progress, the post count of each (layer, position)
    pair, and the pairs that chunk sends posted."""
    pages = -(-(prompt - decode_prefix) // page)
    progress = RoomProgress(layers, pages)
    count = np.zeros((layers, pages), dtype=int)
    chunk_pairs = set()
    forward = 0
    for event in sglang_request(prompt, page, chunk, radix_hit, decode_prefix):
        if event[0] == "forward":
            lo, hi = completed_span(
                prefix_len=event[1],
                extend_len=event[2],
                prompt_len=prompt,
                decode_prefix_len=decode_prefix,
                page_size=page,
            )
            if hook_fires(forward) and hi > lo:
                for layer in range(layers):
                    for _group, pos in progress.take([layer], lo, hi):
                        count[layer, pos] += 1
            forward += 1
        else:
            s = event[1]
            for group, pos in progress.take(range(layers), s.start, s.stop):
                for layer in group:
                    count[layer, pos] += 1
                    chunk_pairs.update((layer, int(p)) for p in pos)
    return progress, count, chunk_pairs


def test_chunked_prompt_streams_every_page_once_and_chunks_post_nothing() -> None:
    # the integration test's chunked prompt: 200 tokens, page 16, chunk 64, 2 layers
    progress, count, chunk_pairs = replay(200, 16, 64, 0, 0, layers=2)
    assert (count == 1).all() and progress.complete()
    assert chunk_pairs == set()


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.integers(1, 400),
    page=st.sampled_from([1, 4, 16]),
    chunk=st.integers(1, 130),
    hit_pages=st.integers(0, 30),
    decode_pages=st.integers(0, 30),
    layers=st.integers(1, 4),
)
def test_every_pair_is_posted_exactly_once(
    prompt, page, chunk, hit_pages, decode_pages, layers
) -> None:
    # SGLang leaves at least one token to compute, and its cache hits are page-aligned
    radix_hit = min(hit_pages * page, (prompt - 1) // page * page)
    decode_prefix = min(decode_pages * page, (prompt - 1) // page * page)
    progress, count, chunk_pairs = replay(prompt, page, chunk, radix_hit, decode_prefix, layers)
    assert (count == 1).all(), count
    assert progress.complete()
    # chunk sends only filled the pages of the radix-cache hit that the decode lacks
    gap = {
        (layer, p)
        for layer in range(layers)
        for p in range(max(0, (radix_hit - decode_prefix) // page))
    }
    assert chunk_pairs == gap


@settings(max_examples=100, deadline=None)
@given(prompt=st.integers(1, 300), chunk=st.integers(1, 100), missed=st.sets(st.integers(0, 10)))
def test_forwards_the_hook_missed_are_covered_by_chunk_sends(prompt, chunk, missed) -> None:
    progress, count, _ = replay(
        prompt, 16, chunk, 0, 0, layers=3, hook_fires=lambda i: i not in missed
    )
    assert (count == 1).all() and progress.complete()


def test_spans_of_one_prompt_tile_its_pages() -> None:
    spans = [
        completed_span(
            prefix_len=p, extend_len=e, prompt_len=100, decode_prefix_len=0, page_size=16
        )
        for p, e in [(0, 30), (30, 30), (60, 30), (90, 10)]
    ]
    assert spans == [(0, 1), (1, 3), (3, 5), (5, 7)]


def test_span_errors_and_empty_spans() -> None:
    with pytest.raises(PlanError):
        completed_span(prefix_len=0, extend_len=8, prompt_len=8, decode_prefix_len=8, page_size=16)
    with pytest.raises(PlanError):
        completed_span(prefix_len=0, extend_len=8, prompt_len=8, decode_prefix_len=0, page_size=0)
    # a forward inside one page that does not end the prompt completes nothing
    lo, hi = completed_span(
        prefix_len=0, extend_len=10, prompt_len=100, decode_prefix_len=0, page_size=16
    )
    assert hi <= lo
    # the decode already holds everything this forward computes
    lo, hi = completed_span(
        prefix_len=0, extend_len=32, prompt_len=64, decode_prefix_len=48, page_size=16
    )
    assert hi <= lo


def test_take_groups_layers_with_the_same_missing_pages() -> None:
    p = RoomProgress(num_layers=3, num_pages=5)
    assert [(g, pos.tolist()) for g, pos in p.take([1], 1, 3)] == [((1,), [1, 2])]
    groups = {g: pos.tolist() for g, pos in p.take(range(3), 0, 5)}
    assert groups == {(0, 2): [0, 1, 2, 3, 4], (1,): [0, 3, 4]}
    assert p.take(range(3), 0, 5) == [] and p.complete()
    assert p.take([0], 2, 2) == []


def test_take_refuses_out_of_range() -> None:
    p = RoomProgress(num_layers=2, num_pages=4)
    with pytest.raises(PlanError):
        p.take([0], 3, 5)
    with pytest.raises(PlanError):
        p.take([2], 0, 1)
    with pytest.raises(PlanError):
        p.take([0], 2, 1)
    assert not p.posted.any()


def test_threshold() -> None:
    assert not streams(layerwise=False, min_tokens=0, prompt_len=4000)
    assert streams(layerwise=True, min_tokens=0, prompt_len=1)
    assert not streams(layerwise=True, min_tokens=128, prompt_len=127)
    assert streams(layerwise=True, min_tokens=128, prompt_len=128)


def test_coalesce_merges_one_forward_only_and_keeps_order() -> None:
    a, b = ForwardPlan((), lambda p, layer: None), ForwardPlan((), lambda p, layer: None)
    items = [
        LayerReady(a, (0,), "e0"),
        LayerReady(a, (1,), "e1"),
        LayerReady(b, (0,)),
        "chunk",
        LayerReady(b, (1,)),
        LayerReady(b, (2,), "e2"),
    ]
    out = coalesce(items)
    assert out[0] == LayerReady(a, (0, 1), "e1")
    assert out[1] == LayerReady(b, (0,)) and out[2] == "chunk"
    assert out[3] == LayerReady(b, (1, 2), "e2")
    assert coalesce([]) == []
