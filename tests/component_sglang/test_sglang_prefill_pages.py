"""A prefill whose pages are larger than its decode's (``transfer_block_size``): how its
chunks become transfer pages, and the refusal of a decode that keeps its own radix
cache, on the prefill's own methods (no servers). The servers' behaviour is in
``test_sglang_pd.py`` (a pair with prefill pages of 32 and decode pages of 16). Runs in
.venv-sglang (``prefill`` imports SGLang's classes)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

try:
    from kvbridge.adapters.sglang.prefill import PrefillSide, _Chunk
    from kvbridge.adapters.sglang.registrations import PrefillRank, Registrations
    from kvbridge.wire import room_messages as wire
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.config import load_config
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.rows import RowLayout
from kvbridge.errors import IncompatiblePeerError
from kvbridge.wire.peer_compat import CompatInfo

UNIT = 16


def _chunk(pages: list[int], start: int) -> _Chunk:
    return _Chunk(
        room=1,
        pages=np.array(pages, dtype=np.int64),
        index_slice=slice(start, start + len(pages)),
        is_last=False,
        aux_index=None,
        queued_at=0.0,
    )


def _dest(num_pages: int) -> SimpleNamespace:
    return SimpleNamespace(pages=np.arange(100, 100 + num_pages, dtype=np.int64))


def test_a_chunk_of_larger_pages_is_sent_as_transfer_pages_cut_at_the_decode_s_list() -> None:
    prefill = SimpleNamespace(page_ratio=2)  # prefill pages of 32 tokens, decode pages of 16
    # a 70-token prompt: the prefill's pages 7, 3, 9 (96 tokens); the decode lists 5 pages
    first = PrefillSide._in_transfer_pages(prefill, _chunk([7, 3], 0), [_dest(5)])
    assert (first.pages.tolist(), first.index_slice) == ([14, 15, 6, 7], slice(0, 4))
    last = PrefillSide._in_transfer_pages(prefill, _chunk([9], 2), [_dest(5)])
    assert (last.pages.tolist(), last.index_slice) == ([18], slice(4, 5)), (
        "the half of page 9 past the prompt is not the decode's"
    )
    # a decode with pages of 64 lists whole pages of its own: 8 transfer pages for 70 tokens
    assert PrefillSide._in_transfer_pages(prefill, _chunk([9], 2), [_dest(8)]).pages.tolist() == [
        18,
        19,
    ]


def _registration(prefix_cache: bool, page_size: int) -> wire.Registration:
    spec = CacheSpec(
        num_layers=2, block_size=UNIT, num_kv_heads=1, head_dim=64, dtype="uint8", layout="nhd"
    )
    geometry = CacheGeometry(
        spec=spec, num_blocks=8, plane_bases=(4096,) * (spec.num_layers * spec.planes_per_layer)
    )
    return wire.Registration(
        agent="sglang-decode-r0-e",
        epoch="e",
        transport="nixl",
        transport_md=b"",
        geometry=geometry,
        aux=RowLayout(ptrs=(1,), item_lens=(64,), rows=3),
        ip="127.0.0.1",
        port=5,
        prefix_cache=prefix_cache,
        page_size=page_size,
        compat=COMPAT,
    )


COMPAT = CompatInfo(
    model="tiny", dtype="float16", layout="nhd", block_size=UNIT, num_layers=2,
    num_kv_heads=1, head_dim=64, total_kv_heads=1,
)  # fmt: skip
"""Both sides' compatibility info (the prefill's pages of 32 move as transfer pages of
16, the decode's block size)."""


def test_a_decode_whose_radix_hits_end_inside_the_prefill_s_pages_is_refused() -> None:
    config = load_config({"transfer_block_size": UNIT})
    rank = PrefillRank(  # pages of 32 tokens, moved as transfer pages of 16
        transport=config.transport,
        wire_dtype=config.wire_dtype,
        data_path=config.resolved_data_path,
        page_size=2 * UNIT,
        geometry=_registration(False, UNIT).geometry,
        aux_layout=_registration(False, UNIT).aux,
        compat=COMPAT,
    )  # no packed path, sliding-window or state-space layers
    prefill = Registrations(rank, None, lambda **fields: None, lambda *a: None)
    with pytest.raises(
        IncompatiblePeerError, match=r"radix cache.*pages of 16 tokens.*hold 32"
    ) as err:
        prefill.pairing(_registration(prefix_cache=True, page_size=16))
    assert "--disaggregation-decode-enable-radix-cache" in (err.value.fix or "")
    assert prefill.pairing(_registration(prefix_cache=False, page_size=16)) is None, (
        "every room starts at 0"
    )
    assert prefill.pairing(_registration(prefix_cache=True, page_size=64)) is None, (
        "its hits end on the prefill's pages too"
    )
    with pytest.raises(IncompatiblePeerError, match="radix cache"):
        # a decode that does not say its page size
        prefill.pairing(_registration(prefix_cache=True, page_size=0))
    same_pages = Registrations(
        dataclasses.replace(rank, page_size=UNIT),
        None,
        lambda **fields: None,
        lambda *a: None,
    )
    assert same_pages.pairing(_registration(prefix_cache=True, page_size=16)) is None
