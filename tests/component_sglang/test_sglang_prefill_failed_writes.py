"""A room whose earlier write failed (its decode died) posts nothing more: the next
chunk or layer of it raises the write's error, which fails the room, instead of
queueing another write to the dead peer (on Mooncake each spends a second or more
reconnecting; a long prompt's chunks then took minutes to fail). On the prefill's own
``_post`` with a transport whose writes complete later, as NIXL's and Mooncake's do.
The servers' behaviour is in ``test_sglang_failures.py``. Runs in .venv-sglang."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

try:
    from kvbridge.adapters.sglang.admission import DecodeDestination
    from kvbridge.adapters.sglang.prefill import PrefillSide
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/component_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.errors import PeerDisconnectedError
from kvbridge.transports.base import Xfer

ROOM = 7


class LaterTransport:
    """Posts complete when the test says: ``finish(i)`` or ``fail(i, exc)``."""

    def __init__(self) -> None:
        self.posted: list[Xfer] = []

    def post(self, op, local, lidx, remote, ridx, notify=None) -> Xfer:
        xfer = Xfer("decode", 64 * len(lidx), len(lidx))
        self.posted.append(xfer)
        return xfer

    def poll(self, xfer: Xfer) -> bool:
        if xfer.error is not None:
            raise xfer.error
        return xfer.done

    def finish(self, i: int) -> None:
        self.posted[i].done = True

    def fail(self, i: int, exc: BaseException) -> None:
        self.posted[i].error = exc


def _prefill(transport: LaterTransport) -> PrefillSide:
    spec = CacheSpec(
        num_layers=2, block_size=16, num_kv_heads=1, head_dim=32, dtype="uint8", layout="nhd"
    )
    geometry = CacheGeometry(
        spec=spec, num_blocks=16, plane_bases=(4096,) * (spec.num_layers * spec.planes_per_layer)
    )
    prefill = PrefillSide.__new__(PrefillSide)  # the manager's state that _post touches
    prefill.transport = transport
    prefill.geometry = geometry
    prefill.kv_table = object()
    prefill.peers = {"decode": SimpleNamespace(part=None, kv=object(), geometry=geometry)}
    prefill._inflight, prefill._seen_done = {}, {}
    prefill._staging_outstanding = defaultdict(int)
    prefill._room_bytes, prefill._first_post = {}, {}
    prefill._count = lambda **fields: None
    return prefill


def _dest() -> DecodeDestination:
    return DecodeDestination(
        agent="decode",
        endpoint="127.0.0.1",
        dst_port=1,
        pages=np.arange(8, dtype=np.int64),
        aux_index=0,
        required_dst_info_num=1,
        decode_prefix_len=None,
        is_dummy=False,
    )


def _post_chunk(prefill: PrefillSide, first_page: int) -> int:
    pages = np.arange(first_page, first_page + 2, dtype=np.int64)
    return prefill._post(ROOM, [_dest()], pages, slice(first_page, first_page + 2))


def test_a_room_whose_write_failed_posts_nothing_more() -> None:
    transport = LaterTransport()
    prefill = _prefill(transport)
    assert _post_chunk(prefill, 0) == 1
    assert _post_chunk(prefill, 2) == 1, "writes still on their way fail nothing"
    transport.finish(0)
    transport.fail(1, PeerDisconnectedError("peer 'decode' disconnected during transfer"))
    with pytest.raises(PeerDisconnectedError, match="disconnected"):
        _post_chunk(prefill, 4)
    assert len(transport.posted) == 2, "a write was posted to the dead decode"
    assert len(prefill._inflight[ROOM]) == 2  # released once, by the room's release


def test_completed_writes_are_polled_once() -> None:
    transport = LaterTransport()
    prefill = _prefill(transport)
    for page in range(0, 8, 2):
        _post_chunk(prefill, page)
        transport.finish(len(transport.posted) - 1)
    polled = []
    transport.poll = lambda xfer: polled.append(xfer) or xfer.done  # type: ignore[method-assign]
    _post_chunk(prefill, 0)
    assert polled == [transport.posted[3]], "the completed prefix is polled again on every post"
