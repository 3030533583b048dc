"""Prefill and decode instances with different tensor-parallel sizes, on the runtime
(side channel, handshake, sender, receiver) over the loopback transport with real numpy
caches: each decode rank gets exactly its KV heads of every block from the prefill rank
that holds them, in both flows; the prefill lets go of a request only when every decode
rank it feeds is served; pairings that cannot work are refused at the handshake naming
the fix."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.config import load_config
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.errors import KVBridgeError
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.transports.loopback import LoopbackTransport
from kvbridge.wire.compat import CompatInfo

L, N, BS, HD, TOTAL = 3, 24, 16, 8, 4
_names = itertools.count()


class Rank:
    """One worker: its cache (numpy, heads on axis ``head_axis``) and its endpoint."""

    def __init__(self, role: str, tp: int, rank: int, layout: str = "fused", seed: int | None = None) -> None:
        heads = TOTAL // tp
        spec = CacheSpec(num_layers=L, block_size=BS, num_kv_heads=heads, head_dim=HD, dtype="float32", layout=layout)
        if layout == "fused":  # (layer, block, head, token, 2 x dim): vLLM's CPU layout
            shape, self.block_axis, self.head_axis = (L, N, heads, BS, 2 * HD), 1, 2
        else:  # (layer, K/V, block, ...): heads before tokens (hnd) or after (nhd)
            inner = (heads, BS, HD) if layout == "hnd" else (BS, heads, HD)
            shape, self.block_axis, self.head_axis = (L, 2, N, *inner), 2, 3 if layout == "hnd" else 4
        rng = np.random.default_rng(seed)
        self.cache = rng.standard_normal(shape, dtype=np.float32) if seed is not None else np.zeros(shape, np.float32)
        if layout == "fused":
            bases = tuple(self.cache[l].ctypes.data for l in range(L))
        else:
            bases = tuple(self.cache[l, k].ctypes.data for l in range(L) for k in range(2))
        geo = CacheGeometry(spec=spec, num_blocks=N, plane_bases=bases)
        compat = CompatInfo.from_spec(spec, model="m", tp_size=tp, total_kv_heads=TOTAL)
        config = load_config({"timeouts": {"receive_s": 5, "transfer_s": 5, "lease_s": 5}})
        self.ep = Endpoint(config, geo, compat, role, rank, send=role == "P", receive=role == "D", transport=LoopbackTransport(f"{role}{rank}-{next(_names)}"))
        self.tp, self.rank = tp, rank

    def blocks(self, ids: list[int], heads: range | None = None) -> np.ndarray:
        out = np.take(self.cache, ids, axis=self.block_axis)
        return out if heads is None else np.take(out, list(heads), axis=self.head_axis)


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for r in made:
        r.ep.close()


def _prefill_all(p: Rank, tid: str, blocks: list[int], n: int, pull: bool = False) -> None:
    p.ep.sender.track(tid, blocks, n, pull=pull)
    for layer in range(L):
        p.ep.sender.layer_done(tid, layer, n)
    p.ep.sender.prefill_done(tid)


@pytest.mark.parametrize(("d_tp", "layout"), [(2, "fused"), (2, "hnd"), (4, "fused")])
def test_push_from_one_prefill_rank_to_every_decode_rank(ranks: list[Rank], d_tp: int, layout: str) -> None:
    p = Rank("P", 1, 0, layout, seed=1)
    ds = [Rank("D", d_tp, r, layout) for r in range(d_tp)]
    ranks += [p, *ds]
    n, pblocks, dblocks = 150, list(range(10)), list(range(12, 22))  # 150 tokens: 10 blocks, streamed
    for d in ds[1:]:  # all decode ranks but the first ask before the prefill starts
        d.ep.receiver.expect_push("r", p.ep.address, dblocks, n)
    _prefill_all(p, "r", pblocks, n)
    for d in ds[1:]:
        assert d.ep.receiver.wait_finished(5) == (["r"], [])
    assert p.ep.sender.wait_released(0.3) == [], "released while a decode rank still waits for its heads"
    ds[0].ep.receiver.expect_push("r", p.ep.address, dblocks, n)  # the last one comes late
    assert ds[0].ep.receiver.wait_finished(5) == (["r"], [])
    assert p.ep.sender.wait_released(5) == ["r"]
    per = TOTAL // d_tp
    for d in ds:
        np.testing.assert_array_equal(d.blocks(dblocks), p.blocks(pblocks, range(d.rank * per, (d.rank + 1) * per)))
        assert not np.delete(d.cache, dblocks, axis=d.block_axis).any(), "bytes outside the destination blocks"
        assert d.ep.stats.take().bytes_received == d.blocks(dblocks).nbytes
    stats = p.ep.stats.take()
    assert stats.requests_sent == 1 and stats.bytes_sent == p.blocks(pblocks).nbytes


def test_pull_releases_once_every_decode_rank_read_its_heads(ranks: list[Rank]) -> None:
    p = Rank("P", 1, 0, seed=2)
    ds = [Rank("D", 2, r) for r in range(2)]
    ranks += [p, *ds]
    _prefill_all(p, "q", [3, 4, 5], 40, pull=True)
    ds[0].ep.receiver.expect_pull("q", p.ep.address, p.ep.epoch, [3, 4, 5], [7, 8], 40, skip_tokens=16)
    assert ds[0].ep.receiver.wait_finished(5) == (["q"], [])
    assert p.ep.sender.wait_released(0.3) == [], "released before the second decode rank read"
    ds[1].ep.receiver.expect_pull("q", p.ep.address, p.ep.epoch, [3, 4, 5], [7, 8], 40, skip_tokens=16)
    assert ds[1].ep.receiver.wait_finished(5) == (["q"], [])
    assert p.ep.sender.wait_released(5) == ["q"]
    for d in ds:
        np.testing.assert_array_equal(d.blocks([7, 8]), p.blocks([4, 5], range(2 * d.rank, 2 * d.rank + 2)))


def test_two_prefill_ranks_each_feed_their_decode_ranks(ranks: list[Rank]) -> None:
    """Prefill TP 2 (2 heads each), decode TP 4 (1 each): decode rank r reads from
    prefill rank r // 2, head r % 2 of it."""
    ps = [Rank("P", 2, r, seed=10 + r) for r in range(2)]
    ds = [Rank("D", 4, r) for r in range(4)]
    ranks += [*ps, *ds]
    for d in ds:
        d.ep.receiver.expect_push("t", ps[d.rank // 2].ep.address, [0, 1], 20)
    for p in ps:
        _prefill_all(p, "t", [5, 6], 20)
    for d in ds:
        assert d.ep.receiver.wait_finished(5) == (["t"], [])
        np.testing.assert_array_equal(d.blocks([0, 1]), ps[d.rank // 2].blocks([5, 6], range(d.rank % 2, d.rank % 2 + 1)))
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["t"]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "layout", "d_rank", "p_rank", "match", "fix"),
    [
        (2, 1, "fused", 0, 0, "decode TP size must be the prefill's or a multiple", "--tensor-parallel-size"),
        (1, 2, "nhd", 1, 0, "nhd interleaves heads", "VLLM_KV_CACHE_LAYOUT=HND"),
        (2, 4, "fused", 2, 0, "decode rank 2 gets none of its KV heads from prefill rank 0", "reads from prefill ranks [1]"),
    ],
)
def test_pairings_that_cannot_work_are_refused_at_the_handshake(ranks: list[Rank], p_tp: int, d_tp: int, layout: str, d_rank: int, p_rank: int, match: str, fix: str) -> None:
    d = Rank("D", d_tp, d_rank, layout)
    p = Rank("P", p_tp, p_rank, layout)
    ranks += [p, d]
    with pytest.raises(KVBridgeError, match="refused") as err:
        d.ep.node.connect(p.ep.address)
    assert match in str(err.value) and fix in str(err.value)
