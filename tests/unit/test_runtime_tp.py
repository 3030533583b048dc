"""Prefill and decode instances with different tensor-parallel sizes, on the runtime
(side channel, handshake, sender, receiver) over the loopback transport with real numpy
caches: each decode rank gets exactly its KV heads of every block from the prefill
rank(s) that hold them, in both flows and both directions (decode TP a multiple of the
prefill's, or the other way round); a prefill rank lets go of a request only when every
decode rank it feeds is served, a decode rank completes only when every source wrote;
pairings that cannot work are refused at the handshake naming the fix."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.config import load_config
from kvbridge.core.lifecycle import SendPhase
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.errors import KVBridgeError
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.transports.loopback import LoopbackTransport
from kvbridge.wire.compat import CompatInfo

L, N, BS, HD, TOTAL = 3, 24, 16, 8, 4
_names = itertools.count()


class Rank:
    """One worker: its cache (numpy, heads on axis ``head_axis``) and its endpoint."""

    def __init__(self, role: str, tp: int, rank: int, layout: str = "fused", seed: int | None = None, timeout_s: float = 5) -> None:
        heads = max(1, TOTAL // tp)
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
        config = load_config({"timeouts": {"receive_s": timeout_s, "transfer_s": timeout_s, "lease_s": timeout_s, "handshake_s": 3}})
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


@pytest.mark.parametrize(("p_tp", "layout"), [(2, "fused"), (2, "hnd"), (4, "fused")])
def test_push_from_every_prefill_rank_into_one_decode_rank(ranks: list[Rank], p_tp: int, layout: str) -> None:
    """Prefill TP 2 or 4, decode TP 1: each prefill rank writes its heads into the decode
    rank's blocks; the load completes only when all of them landed."""
    ps = [Rank("P", p_tp, r, layout, seed=20 + r) for r in range(p_tp)]
    d = Rank("D", 1, 0, layout)
    ranks += [*ps, d]
    n, pblocks, dblocks = 150, list(range(10)), list(range(12, 22))
    d.ep.receiver.expect_push("r", [p.ep.address for p in ps], dblocks, n)
    for p in ps[:-1]:
        _prefill_all(p, "r", pblocks, n)
        assert p.ep.sender.wait_released(5) == ["r"]
    assert d.ep.receiver.wait_finished(0.3) == ([], []), "complete before the last prefill rank wrote its heads"
    _prefill_all(ps[-1], "r", pblocks, n)
    assert d.ep.receiver.wait_finished(5) == (["r"], [])
    per = TOTAL // p_tp
    for p in ps:
        np.testing.assert_array_equal(d.blocks(dblocks, range(p.rank * per, (p.rank + 1) * per)), p.blocks(pblocks))
    assert d.ep.stats.take().bytes_received == d.blocks(dblocks).nbytes


def test_pull_reads_every_prefill_rank_then_releases_each(ranks: list[Rank]) -> None:
    ps = [Rank("P", 2, r, seed=30 + r) for r in range(2)]
    d = Rank("D", 1, 0)
    ranks += [*ps, d]
    for p in ps:
        _prefill_all(p, "q", [3, 4, 5], 40, pull=True)
    d.ep.receiver.expect_pull("q", [p.ep.address for p in ps], [p.ep.epoch for p in ps], [3, 4, 5], [7, 8], 40, skip_tokens=16)
    assert d.ep.receiver.wait_finished(5) == (["q"], [])
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["q"]
        np.testing.assert_array_equal(d.blocks([7, 8], range(2 * p.rank, 2 * p.rank + 2)), p.blocks([4, 5]))


def test_a_dead_prefill_rank_fails_the_load_and_stops_the_others(ranks: list[Rank]) -> None:
    """Two sources; one never answers (closed): the load fails, the other source is told
    to stop and releases its blocks, and the decode rank's blocks come back once it has."""
    # deadlines far beyond the waits below: only the decode side's abort ends it in time
    ps = [Rank("P", 2, r, seed=40 + r, timeout_s=60) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60)
    ranks += [*ps, d]
    ps[1].ep.close()
    d.ep.receiver.expect_push("x", [ps[0].ep.address, ps[1].ep.address], [1, 2], 20)
    ps[0].ep.sender.track("x", [5, 6], 20)
    assert d.ep.receiver.wait_finished(10) == ([], ["x"])
    assert ps[0].ep.sender.wait_released(10) == ["x"], "the live source must let go once the decode side gave up"


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "layout", "d_rank", "p_rank", "match", "fix"),
    [
        (8, 2, "fused", 0, 0, "hold replicas of the model's 4 KV heads", "--tensor-parallel-size of at least 8"),
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


def test_pull_from_a_dead_prefill_rank_fails_and_releases_the_other(ranks: list[Rank]) -> None:
    """P-first with two sources, one gone: the load fails at once and the live source
    is released by the decode side, long before its lease would end."""
    ps = [Rank("P", 2, r, seed=50 + r, timeout_s=60) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60)
    ranks += [*ps, d]
    for p in ps:
        _prefill_all(p, "y", [3, 4], 20, pull=True)
    dead = ps[0].ep.address
    ps[0].ep.close()
    d.ep.receiver.expect_pull("y", [dead, ps[1].ep.address], [ps[0].ep.epoch, ps[1].ep.epoch], [3, 4], [7, 8], 20)
    assert d.ep.receiver.wait_finished(10) == ([], ["y"])
    assert ps[1].ep.sender.wait_released(10) == ["y"], "the live source must let go once the decode side gave up"


def test_decode_abort_releases_every_source(ranks: list[Rank]) -> None:
    """The engine drops a request fed by two prefill ranks mid-way: both are told to
    stop (their leases are long), and the decode side's blocks come back once both
    confirmed they no longer write."""
    ps = [Rank("P", 2, r, seed=60 + r, timeout_s=60) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60)
    ranks += [*ps, d]
    for p in ps:
        p.ep.sender.track("z", [5, 6], 20)  # computing, nothing sent yet
    d.ep.receiver.expect_push("z", [p.ep.address for p in ps], [1, 2], 20)
    deadline = time.monotonic() + 5
    while any(p.ep.sender.phase("z") is not SendPhase.SENDING for p in ps):  # both hold our destination
        assert time.monotonic() < deadline, "the destinations never arrived"
        time.sleep(0.002)
    assert d.ep.receiver.abort("z", "client gone")
    assert d.ep.receiver.wait_finished(10) == ([], ["z"])
    for p in ps:
        assert p.ep.sender.wait_released(10) == ["z"]
