"""Prefill and decode instances with different tensor-parallel sizes, on the runtime
(side channel, handshake, sender, receiver) over the loopback transport with real torch
caches, moving exact values directly (``exact``) or through staging (``packed``), or
FP8 (``fp8``): each decode rank gets exactly its KV heads of every
block from the prefill rank(s) that hold them, in both flows and both directions
(decode TP a multiple of the prefill's, or the other way round); a prefill rank lets
go of a request only when every decode rank it feeds is served, a decode rank
completes only when every source wrote; pairings that cannot work are refused at the
handshake naming the fix.

FP8: each prefill rank packs the head range a decode rank holds and the decode rank
unpacks every source's range into those heads. A head's FP8 values and scale do not
depend on which other heads travel with it, so every decode rank must hold exactly
what a one-piece pack and unpack of the prefill's whole cache gives for its heads, bit
for bit; the wrong head range, block or source shows up as a difference. Staging is
given back exactly once on both sides. ``packed`` (exact values through staging) must
give every decode rank its heads bit for bit, NHD caches included, which the direct
path refuses."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from kvbridge import ops
from kvbridge.config import load_config
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.lifecycle import SendPhase
from kvbridge.core.tp import head_slices, idle_prefill_ranks, prefill_ranks
from kvbridge.errors import KVBridgeError
from kvbridge.ops.format import FP8_DTYPE, PackedFormat
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.transports.loopback import LoopbackTransport
from kvbridge.wire.peer_compat import CompatInfo

L, N, BS, HD, TOTAL = 3, 40, 16, 32, 4
_names = itertools.count()


class Rank:
    """One worker: a torch cache of its KV heads in ``layout`` (random when ``seed`` is
    given, else zeros) and its endpoint, moving KV ``wire``: ``exact`` (direct),
    ``packed`` (exact values through staging) or ``fp8``."""

    def __init__(
        self,
        role: str,
        tp: int,
        rank: int,
        layout: str = "fused",
        *,
        seed: int | None = None,
        wire: str = "exact",
        total: int = TOTAL,
        timeout_s: float = 5,
        staging_mb: int = 64,
        state_bytes: int = 0,
    ) -> None:
        self.heads = max(1, total // tp)
        self.layout, self.wire, self.tp, self.rank = layout, wire, tp, rank
        self.block_axis = 1 if layout in ("fused", "latent") else 2
        if layout == "fused":  # vLLM's CPU cache: (block, head, token, 2 x dim) per layer
            shape = (L, N, self.heads, BS, 2 * HD)
        elif layout == "latent":
            # MLA: (block, token, vector) per layer; its halves pack as planes of HD
            assert total == 1, "an MLA model has one latent 'head'"
            shape = (L, N, BS, 2 * HD)
        else:  # (layer, K/V, block, ...): heads before tokens (hnd) or after (nhd)
            shape = (L, 2, N, *((self.heads, BS, HD) if layout == "hnd" else (BS, self.heads, HD)))
        self.cache = (
            torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            if seed is not None
            else torch.zeros(shape)
        )
        if layout in ("fused", "latent"):
            bases = tuple(self.cache[l].data_ptr() for l in range(L))
        else:
            bases = tuple(self.cache[l, k].data_ptr() for l in range(L) for k in range(2))
        dim = 2 * HD if layout == "latent" else HD
        spec = CacheSpec(
            num_layers=L,
            block_size=BS,
            num_kv_heads=self.heads,
            head_dim=dim,
            dtype="float32",
            layout=layout,
        )
        # state_bytes: layer 1 a state-space layer whose blocks hold that many bytes
        layer_bytes = (
            tuple(state_bytes if l == 1 else spec.block_bytes for l in range(L))
            if state_bytes
            else ()
        )
        geo = CacheGeometry(spec=spec, num_blocks=N, plane_bases=bases, layer_bytes=layer_bytes)
        dtype = "fp8" if wire == "fp8" else "exact"
        t = {
            "receive_s": timeout_s,
            "transfer_s": timeout_s,
            "lease_s": timeout_s,
            "handshake_s": 3,
        }
        path = "packed" if wire == "packed" else "auto"
        config = load_config(
            {"wire_dtype": dtype, "data_path": path, "staging_mb": staging_mb, "timeouts": t}
        )
        assert config.packed is (wire != "exact")
        compat = CompatInfo.from_spec(
            spec,
            model="m",
            wire_dtype=dtype,
            tp_size=tp,
            total_kv_heads=total,
            data_path=config.resolved_data_path,
        )
        self.ep = Endpoint(
            config,
            geo,
            compat,
            role,
            rank,
            send=role == "P",
            receive=role == "D",
            transport=LoopbackTransport(f"{role}{rank}-{next(_names)}"),
            planes=self.planes() if config.packed else None,
        )

    def planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [ops.kv_planes(self.cache[l], self.layout, BS) for l in range(L)]

    def kv(self, blocks: list[int]) -> torch.Tensor:
        """``(layer, K/V, block, token, head, dim)`` of ``blocks``."""
        return torch.stack([torch.stack([k[blocks], v[blocks]]) for k, v in self.planes()])

    def sent(self, blocks: list[int]) -> torch.Tensor:
        """What a decode side should hold of these blocks: their KV, or (FP8) what one
        pack and one unpack of all heads at once make of it (the ops are checked element
        by element in test_ops.py)."""
        if self.wire != "fp8":
            return self.kv(blocks)
        out = Rank.__new__(Rank)
        out.layout, out.cache = self.layout, torch.zeros_like(self.cache)
        for planes, dst in zip(self.planes(), out.planes(), strict=True):
            ops.unpack(*ops.pack(planes, blocks, len(blocks) * BS, fp8=True), dst, blocks)
        return out.kv(blocks)

    def wire_bytes(self, heads: int) -> int:
        """Bytes on the wire per layer and block for ``heads`` KV heads."""
        if self.wire != "fp8":  # a packed exact chunk is the block's bytes (a multiple of 16)
            return 2 * BS * heads * HD * 4
        return PackedFormat(
            num_tokens=BS,
            num_heads=heads,
            head_dim=HD,
            dtype=FP8_DTYPE,
            scaled=True,
            chunk_tokens=BS,
        ).nbytes

    def outside(self, blocks: list[int]) -> torch.Tensor:
        others = torch.tensor([b for b in range(N) if b not in blocks])
        return self.cache.index_select(self.block_axis, others)

    def staging_idle(self) -> bool:
        packed = self.ep.node.packed
        return packed is None or packed.allocator.free_slots == packed.allocator.num_slots


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for r in made:
        r.ep.close()


def _prefill_all(
    p: Rank,
    tid: str,
    blocks: list[int],
    n: int,
    pull: bool = False,
    chunks: tuple[int, ...] = (),
    tracked: bool = False,
) -> None:
    """Track (unless ``tracked``), compute (the cache's contents stand for the KV the
    forward pass writes after ``track``, which may clear the last block first), report
    every layer."""
    if not tracked:
        index = torch.tensor(blocks)
        written = p.cache.index_select(p.block_axis, index)
        p.ep.sender.track(tid, blocks, n, pull=pull)
        p.cache.index_copy_(p.block_axis, index, written)
    for done in (*chunks, n):
        for layer in range(L):
            p.ep.sender.layer_done(tid, layer, done)
    p.ep.sender.prefill_done(tid)


def _wait_sending(ps: list[Rank], tid: str) -> None:
    """Until every prefill rank holds the decode side's destination."""
    deadline = time.monotonic() + 5
    while any(p.ep.sender.phase(tid) is not SendPhase.SENDING for p in ps):
        assert time.monotonic() < deadline, "the destinations never arrived"
        time.sleep(0.002)


PUSH_ONE_TO_MANY = [
    ("exact", 2, "fused"),
    ("exact", 2, "hnd"),
    ("exact", 4, "fused"),
    ("packed", 2, "nhd"),
    ("packed", 4, "hnd"),
    ("fp8", 2, "fused"),
    ("fp8", 2, "hnd"),
    ("fp8", 2, "nhd"),
    ("fp8", 4, "fused"),
]


@pytest.mark.parametrize(("wire", "d_tp", "layout"), PUSH_ONE_TO_MANY)
def test_push_from_one_prefill_rank_to_every_decode_rank(
    ranks: list[Rank], wire: str, d_tp: int, layout: str
) -> None:
    p = Rank("P", 1, 0, layout, seed=1, wire=wire)
    ds = [Rank("D", d_tp, r, layout, wire=wire) for r in range(d_tp)]
    ranks += [p, *ds]
    # 150 tokens: 10 blocks, streamed
    n, pblocks, dblocks = (
        150,
        list(range(10)),
        list(range(12, 22)),
    )
    for d in ds[1:]:  # all decode ranks but the first ask before the prefill starts
        d.ep.receiver.expect_push("r", p.ep.address, dblocks, n)
    _prefill_all(p, "r", pblocks, n, chunks=(64,))
    for d in ds[1:]:
        assert d.ep.receiver.wait_finished(5) == (["r"], [])
    assert p.ep.sender.wait_released(0.3) == [], (
        "released while a decode rank still waits for its heads"
    )
    ds[0].ep.receiver.expect_push("r", p.ep.address, dblocks, n)  # the last one comes late
    assert ds[0].ep.receiver.wait_finished(5) == (["r"], [])
    assert p.ep.sender.wait_released(5) == ["r"]
    per, sent = TOTAL // d_tp, p.sent(pblocks)
    for d in ds:
        assert torch.equal(d.kv(dblocks), sent[..., d.rank * per : (d.rank + 1) * per, :]), (
            f"decode rank {d.rank}"
        )
        assert not d.outside(dblocks).any(), "bytes outside the destination blocks"
        assert d.ep.stats.take().bytes_received == L * len(dblocks) * d.wire_bytes(per)
        assert d.staging_idle()
    stats = p.ep.stats.take()
    assert stats.requests_sent == 1 and stats.bytes_sent == d_tp * L * len(pblocks) * p.wire_bytes(
        per
    )
    assert p.staging_idle()


@pytest.mark.parametrize("wire", ["exact", "packed", "fp8"])
def test_pull_releases_once_every_decode_rank_read_its_heads(ranks: list[Rank], wire: str) -> None:
    """P-first (on the packed path each decode rank sends a destination instead of
    reading, and the prefill writes its head range)."""
    p = Rank("P", 1, 0, seed=2, wire=wire)
    ds = [Rank("D", 2, r, wire=wire) for r in range(2)]
    ranks += [p, *ds]
    _prefill_all(p, "q", [3, 4, 5], 40, pull=True)
    ds[0].ep.receiver.expect_pull(
        "q", p.ep.address, p.ep.epoch, [3, 4, 5], [7, 8], 40, skip_tokens=16
    )
    assert ds[0].ep.receiver.wait_finished(5) == (["q"], [])
    assert p.ep.sender.wait_released(0.3) == [], "released before the second decode rank read"
    ds[1].ep.receiver.expect_pull(
        "q", p.ep.address, p.ep.epoch, [3, 4, 5], [7, 8], 40, skip_tokens=16
    )
    assert ds[1].ep.receiver.wait_finished(5) == (["q"], [])
    assert p.ep.sender.wait_released(5) == ["q"]
    for d in ds:
        assert torch.equal(d.kv([7, 8]), p.sent([4, 5])[..., 2 * d.rank : 2 * d.rank + 2, :])
        assert d.staging_idle()
    assert p.staging_idle()


@pytest.mark.parametrize("wire", ["exact", "packed", "fp8"])
def test_two_prefill_ranks_each_feed_their_decode_ranks(ranks: list[Rank], wire: str) -> None:
    """Prefill TP 2 (2 heads each), decode TP 4 (1 each): decode rank r reads from
    prefill rank r // 2, head r % 2 of it."""
    ps = [Rank("P", 2, r, seed=10 + r, wire=wire) for r in range(2)]
    ds = [Rank("D", 4, r, wire=wire) for r in range(4)]
    ranks += [*ps, *ds]
    for d in ds:
        d.ep.receiver.expect_push("t", ps[d.rank // 2].ep.address, [0, 1], 20)
    for p in ps:
        _prefill_all(p, "t", [5, 6], 20)
    for d in ds:
        assert d.ep.receiver.wait_finished(5) == (["t"], [])
        assert torch.equal(
            d.kv([0, 1]), ps[d.rank // 2].sent([5, 6])[..., d.rank % 2 : d.rank % 2 + 1, :]
        )
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["t"]


@pytest.mark.parametrize("wire", ["exact", "fp8"])
def test_decode_replicas_each_get_their_head(ranks: list[Rank], wire: str) -> None:
    """Two KV heads over decode TP 4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1."""
    p = Rank("P", 1, 0, seed=3, total=2, wire=wire)
    ds = [Rank("D", 4, r, total=2, wire=wire) for r in range(4)]
    ranks += [p, *ds]
    for d in ds:
        d.ep.receiver.expect_push("h", p.ep.address, [5, 6], 20)
    _prefill_all(p, "h", [1, 2], 20)
    sent = p.sent([1, 2])
    for d in ds:
        assert d.ep.receiver.wait_finished(5) == (["h"], [])
        assert torch.equal(d.kv([5, 6]), sent[..., d.rank // 2 : d.rank // 2 + 1, :]), (
            f"decode rank {d.rank}"
        )
    assert p.ep.sender.wait_released(5) == ["h"]


PUSH_MANY_TO_ONE = [
    ("exact", 2, "fused"),
    ("exact", 2, "hnd"),
    ("exact", 4, "fused"),
    ("packed", 2, "nhd"),
    ("packed", 4, "fused"),
    ("fp8", 2, "fused"),
    ("fp8", 2, "nhd"),
    ("fp8", 4, "hnd"),
]


@pytest.mark.parametrize(("wire", "p_tp", "layout"), PUSH_MANY_TO_ONE)
def test_push_from_every_prefill_rank_into_one_decode_rank(
    ranks: list[Rank], wire: str, p_tp: int, layout: str
) -> None:
    """Prefill TP 2 or 4, decode TP 1: each prefill rank writes its heads into the decode
    rank's blocks; the load completes only when all of them landed."""
    ps = [Rank("P", p_tp, r, layout, seed=20 + r, wire=wire) for r in range(p_tp)]
    d = Rank("D", 1, 0, layout, wire=wire)
    ranks += [*ps, d]
    n, pblocks, dblocks = 150, list(range(10)), list(range(12, 22))
    d.ep.receiver.expect_push("r", [p.ep.address for p in ps], dblocks, n)
    for p in ps[:-1]:
        _prefill_all(p, "r", pblocks, n)
        assert p.ep.sender.wait_released(5) == ["r"]
    assert d.ep.receiver.wait_finished(0.3) == ([], []), (
        "complete before the last prefill rank wrote its heads"
    )
    _prefill_all(ps[-1], "r", pblocks, n, chunks=(32, 96))
    assert d.ep.receiver.wait_finished(5) == (["r"], [])
    got, per = d.kv(dblocks), TOTAL // p_tp
    for p in ps:
        assert torch.equal(got[..., p.rank * per : (p.rank + 1) * per, :], p.sent(pblocks)), (
            f"heads of prefill rank {p.rank}"
        )
    assert d.ep.stats.take().bytes_received == p_tp * L * len(dblocks) * d.wire_bytes(per)
    assert d.staging_idle() and all(p.staging_idle() for p in ps)


@pytest.mark.parametrize("wire", ["exact", "packed", "fp8"])
def test_pull_reads_every_prefill_rank_then_releases_each(ranks: list[Rank], wire: str) -> None:
    ps = [Rank("P", 2, r, seed=30 + r, wire=wire) for r in range(2)]
    d = Rank("D", 1, 0, wire=wire)
    ranks += [*ps, d]
    for p in ps:
        _prefill_all(p, "q", [3, 4, 5], 40, pull=True)
    d.ep.receiver.expect_pull(
        "q",
        [p.ep.address for p in ps],
        [p.ep.epoch for p in ps],
        [3, 4, 5],
        [7, 8],
        40,
        skip_tokens=16,
    )
    assert d.ep.receiver.wait_finished(5) == (["q"], [])
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["q"]
        assert torch.equal(d.kv([7, 8])[..., 2 * p.rank : 2 * p.rank + 2, :], p.sent([4, 5]))
        assert p.staging_idle()
    assert d.staging_idle()


@pytest.mark.parametrize("wire", ["exact", "fp8"])
def test_a_dead_prefill_rank_fails_the_load_and_stops_the_others(
    ranks: list[Rank], wire: str
) -> None:
    """Two sources; one never answers (closed): the load fails, the other source is told
    to stop and releases its blocks, and the decode rank's blocks come back once it has."""
    # deadlines far beyond the waits below: only the decode side's abort ends it in time
    ps = [Rank("P", 2, r, seed=40 + r, timeout_s=60, wire=wire) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60, wire=wire)
    ranks += [*ps, d]
    ps[1].ep.close()
    d.ep.receiver.expect_push("x", [ps[0].ep.address, ps[1].ep.address], [1, 2], 20)
    ps[0].ep.sender.track("x", [5, 6], 20)
    assert d.ep.receiver.wait_finished(10) == ([], ["x"])
    assert ps[0].ep.sender.wait_released(10) == ["x"], (
        "the live source must let go once the decode side gave up"
    )
    assert d.staging_idle() and ps[0].staging_idle()


@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [(1, 2, 1), (1, 4, 2), (2, 4, 1)])
def test_idle_prefill_replicas_are_told_to_let_go(
    ranks: list[Rank], flow: str, total: int, p_tp: int, d_tp: int
) -> None:
    """More prefill replicas than the decode reads (an MLA model's one latent head on
    every rank; two KV heads over four ranks): each decode rank reads every head from
    one replica and tells the idle prefill ranks assigned to it to let go. Every
    prefill rank releases the request at once (leases are 60 s), the idle ones whether
    the word comes before they track the request (push: kept until they do) or after
    (P-first); a decode rank holds exactly its heads from the ranks that fed them."""
    ps = [Rank("P", p_tp, r, seed=70 + r, total=total, timeout_s=60) for r in range(p_tp)]
    ds = [Rank("D", d_tp, r, total=total, timeout_s=60) for r in range(d_tp)]
    ranks += [*ps, *ds]
    idle = {d.rank: idle_prefill_ranks(total, p_tp, d_tp, d.rank) for d in ds}
    assert (
        sorted(r for ranks in idle.values() for r in ranks)
        == sorted(set(range(p_tp)) - {s.p_rank for s in head_slices(total, p_tp, d_tp)})
        != []
    )
    pblocks, dblocks, n = [3, 4], [7, 8], 20

    def tell_idle(d: Rank) -> None:
        done = d.ep.receiver.release_idle(
            "m", [ps[i].ep.address for i in idle[d.rank]], [ps[i].ep.epoch for i in idle[d.rank]]
        )
        assert all(f.result(5) is None for f in done)  # answered: the idle ranks have the word

    for d in ds:
        sources = [ps[i] for i in prefill_ranks(total, p_tp, d_tp, d.rank)]
        if flow == "push":
            d.ep.receiver.expect_push("m", [p.ep.address for p in sources], dblocks, n)
            tell_idle(d)  # before any prefill rank tracks the request
    for p in ps:
        _prefill_all(p, "m", pblocks, n, pull=flow == "pull")
    for d in ds:
        if flow == "pull":
            sources = [ps[i] for i in prefill_ranks(total, p_tp, d_tp, d.rank)]
            d.ep.receiver.expect_pull(
                "m",
                [p.ep.address for p in sources],
                [p.ep.epoch for p in sources],
                pblocks,
                dblocks,
                n,
            )
            tell_idle(d)
        assert d.ep.receiver.wait_finished(5) == (["m"], [])
        for s in head_slices(total, p_tp, d_tp):
            if s.d_rank == d.rank:
                got = d.kv(dblocks)[..., s.d_first : s.d_first + s.count, :]
                assert torch.equal(
                    got, ps[s.p_rank].sent(pblocks)[..., s.p_first : s.p_first + s.count, :]
                ), f"decode rank {d.rank} from {s.p_rank}"
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["m"], (
            f"prefill rank {p.rank} still holds the request"
        )
    assert all(p.ep.stats.take().leases_expired == 0 for p in ps)


@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize("wire", ["packed", "fp8"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1)])
def test_latent_caches_move_on_the_packed_path_between_tp_sizes(
    ranks: list[Rank], flow: str, wire: str, p_tp: int, d_tp: int
) -> None:
    """An MLA model's latent cache (one vector per token, the same on every rank) packed
    as its vectors' halves, exact or FP8: every decode rank gets the whole cache from
    one prefill rank (what one pack and unpack make of it), the bytes of its blocks and
    nothing more, and every prefill rank lets go (an idle replica when told to)."""
    ps = [
        Rank("P", p_tp, r, "latent", seed=90 + r, wire=wire, total=1, timeout_s=60)
        for r in range(p_tp)
    ]
    ds = [Rank("D", d_tp, r, "latent", wire=wire, total=1, timeout_s=60) for r in range(d_tp)]
    ranks += [*ps, *ds]
    pblocks, dblocks, n = [3, 9, 4], [7, 1, 8], 40
    source_of = {}  # decode rank -> the one prefill rank it reads the whole cache from
    for d in ds:
        [source] = [ps[i] for i in prefill_ranks(1, p_tp, d_tp, d.rank)]
        source_of[d.rank] = source
        idle = [ps[i] for i in idle_prefill_ranks(1, p_tp, d_tp, d.rank)]
        if flow == "push":
            d.ep.receiver.expect_push("m", [source.ep.address], dblocks, n)
        if idle:
            assert all(
                f.result(5) is None
                for f in d.ep.receiver.release_idle(
                    "m", [p.ep.address for p in idle], [p.ep.epoch for p in idle]
                )
            )
    for p in ps:
        _prefill_all(p, "m", pblocks, n, pull=flow == "pull")
    for d in ds:
        source = source_of[d.rank]
        if flow == "pull":
            d.ep.receiver.expect_pull(
                "m", [source.ep.address], [source.ep.epoch], pblocks, dblocks, n
            )
        assert d.ep.receiver.wait_finished(5) == (["m"], [])
        assert torch.equal(d.kv(dblocks), source.sent(pblocks)), f"decode rank {d.rank}"
        assert not d.outside(dblocks).any(), "unpack wrote outside the request's blocks"
        assert d.ep.stats.take().bytes_received == L * len(dblocks) * d.wire_bytes(1)
    if wire == "fp8":  # what one pack and unpack make of it: FP8 noise, nothing worse
        a, b = ps[0].kv(pblocks), ps[0].sent(pblocks)
        assert 0 < ((a - b).norm() / a.norm()).item() < 0.04
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["m"], (
            f"prefill rank {p.rank} still holds the request"
        )
    assert all(r.staging_idle() for r in ranks)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "layout", "d_rank", "p_rank", "match", "fix"),
    [
        (
            3,
            2,
            "fused",
            0,
            0,
            "tensor parallel size 3 does not split 4 KV heads evenly",
            "divides the model's 4 KV heads",
        ),
        (1, 2, "nhd", 1, 0, "nhd interleaves heads", "data_path 'packed'"),
        (
            2,
            4,
            "fused",
            2,
            0,
            "decode rank 2 gets none of its KV heads from prefill rank 0",
            "reads from prefill ranks [1]",
        ),
    ],
)
def test_pairings_that_cannot_work_are_refused_at_the_handshake(
    ranks: list[Rank],
    p_tp: int,
    d_tp: int,
    layout: str,
    d_rank: int,
    p_rank: int,
    match: str,
    fix: str,
) -> None:
    d = Rank("D", d_tp, d_rank, layout)
    p = Rank("P", p_tp, p_rank, layout)
    ranks += [p, d]
    with pytest.raises(KVBridgeError, match="refused") as err:
        d.ep.node.connect(p.ep.address)
    assert match in str(err.value) and fix in str(err.value)


def test_states_of_unknown_layout_between_tp_sizes_are_refused_at_the_handshake(
    ranks: list[Rank],
) -> None:
    """A state is split across ranks by heads, groups and channels, not as a block's
    head ranges: without a state layout (test_states_tp.py) that says how, a decode of
    another TP size is refused, naming the flag."""
    d = Rank("D", 2, 0, state_bytes=100)
    p = Rank("P", 1, 0, state_bytes=100)
    ranks += [p, d]
    with pytest.raises(KVBridgeError, match="refused") as err:
        d.ep.node.connect(p.ep.address)
    assert "state-space layers between equal TP sizes only" in str(err.value)
    assert "same --tensor-parallel-size" in str(err.value)


@pytest.mark.parametrize("wire", ["exact", "fp8"])
def test_pull_from_a_dead_prefill_rank_fails_and_releases_the_other(
    ranks: list[Rank], wire: str
) -> None:
    """P-first with two sources, one gone: the load fails at once and the live source
    is released by the decode side, long before its lease would end."""
    ps = [Rank("P", 2, r, seed=50 + r, timeout_s=60, wire=wire) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60, wire=wire)
    ranks += [*ps, d]
    for p in ps:
        _prefill_all(p, "y", [3, 4], 20, pull=True)
    dead = ps[0].ep.address
    ps[0].ep.close()
    d.ep.receiver.expect_pull(
        "y", [dead, ps[1].ep.address], [ps[0].ep.epoch, ps[1].ep.epoch], [3, 4], [7, 8], 20
    )
    assert d.ep.receiver.wait_finished(10) == ([], ["y"])
    assert ps[1].ep.sender.wait_released(10) == ["y"], (
        "the live source must let go once the decode side gave up"
    )


@pytest.mark.parametrize("wire", ["exact", "packed", "fp8"])
def test_decode_abort_releases_every_source(ranks: list[Rank], wire: str) -> None:
    """The engine drops a request fed by two prefill ranks mid-way: both are told to
    stop (their leases are long), and the decode side's blocks (and staging) come back
    once both confirmed they no longer write."""
    ps = [Rank("P", 2, r, seed=60 + r, timeout_s=60, wire=wire) for r in range(2)]
    d = Rank("D", 1, 0, timeout_s=60, wire=wire)
    ranks += [*ps, d]
    for p in ps:
        p.ep.sender.track("z", [5, 6], 20)  # computing, nothing sent yet
    d.ep.receiver.expect_push("z", [p.ep.address for p in ps], [1, 2], 20)
    _wait_sending(ps, "z")
    assert wire == "exact" or not d.staging_idle(), "no staging reserved for the sources"
    assert d.ep.receiver.abort("z", "client gone")
    assert d.ep.receiver.wait_finished(10) == ([], ["z"])
    for p in ps:
        assert p.ep.sender.wait_released(10) == ["z"]
        assert p.staging_idle()
    assert d.staging_idle()


# --- FP8 only: staging chunks and the partial last block --------------------------------


def test_a_request_waits_for_staging_for_all_its_sources_then_completes(ranks: list[Rank]) -> None:
    """Two sources, room for one source's chunks only: no destination goes out (a request
    never holds part of its staging while it waits for the rest, so requests waiting for
    room cannot block each other); both go out once staging frees up."""
    ps = [Rank("P", 2, r, seed=70 + r, wire="fp8") for r in range(2)]
    d = Rank("D", 1, 0, wire="fp8", staging_mb=1)
    ranks += [*ps, d]
    packed = d.ep.node.packed
    keep = packed.allocator.num_slots - packed.slots_for(L * 4, 2) - 1
    held = packed.allocator.alloc(keep)
    assert held is not None
    for p in ps:
        p.ep.sender.track("s", [4, 5, 6, 7], 64)
    d.ep.receiver.expect_push("s", [p.ep.address for p in ps], [0, 1, 2, 3], 64)
    assert d.ep.receiver.wait_finished(0.3) == ([], [])
    assert all(p.ep.sender.phase("s") is SendPhase.HELD for p in ps), (
        "a destination went out without staging for every source"
    )
    assert packed.allocator.free_slots == packed.allocator.num_slots - keep, (
        "the waiting request holds staging"
    )
    packed.allocator.free(held, keep)
    _wait_sending(ps, "s")
    for p in ps:
        _prefill_all(p, "s", [4, 5, 6, 7], 64, tracked=True)
    assert d.ep.receiver.wait_finished(5) == (["s"], [])
    for p in ps:
        assert p.ep.sender.wait_released(5) == ["s"]
        assert torch.equal(
            d.kv([0, 1, 2, 3])[..., 2 * p.rank : 2 * p.rank + 2, :], p.sent([4, 5, 6, 7])
        )
    assert d.staging_idle()


def test_staging_runs_of_any_head_count_stay_inside_their_slots_and_apart() -> None:
    """Chunks of fewer heads than a slot (a peer with another split) are addressed in the
    buffer cut into chunks of their size: every run must lie inside the slots reserved
    for it, wherever those start, so runs never overlap; releasing gives every slot back."""
    from kvbridge.runtime.packed import PackedPath

    cache = torch.zeros(L, N, 4, BS, 2 * HD)
    spec = CacheSpec(
        num_layers=L, block_size=BS, num_kv_heads=4, head_dim=HD, dtype="float32", layout="fused"
    )
    geo = CacheGeometry(
        spec=spec, num_blocks=N, plane_bases=tuple(cache[l].data_ptr() for l in range(L))
    )
    with LoopbackTransport("staging-runs") as tr:
        packed = PackedPath(geo, [ops.kv_planes(cache[l], "fused") for l in range(L)], 1, tr)
        slot = packed.slot.nbytes
        taken: list[tuple[int, int]] = []
        runs = []
        for n, heads in itertools.cycle(itertools.product(range(1, 9), (1, 3, 2, 4))):
            # runs start at every slot phase
            run = packed.reserve(n, heads)
            if run is None:
                break
            size = PackedFormat(
                num_tokens=BS,
                num_heads=heads,
                head_dim=HD,
                dtype=FP8_DTYPE,
                scaled=True,
                chunk_tokens=BS,
            ).nbytes
            assert packed.chunk(heads).nbytes == size
            lo, hi = run.first * size, (run.first + n) * size
            assert run.slot * slot <= lo and hi <= (run.slot + run.slots) * slot, (n, heads, run)
            assert all(hi <= a or b <= lo for a, b in taken), "two runs share bytes"
            taken.append((lo, hi))
            table = packed.table_for(heads)
            assert int(table.descs[run.first + n - 1, 0]) == packed.info.base + hi - size
            assert int(table.descs[run.first, 1]) == size
            runs.append(run)
        assert len(runs) > 50
        for run in runs:
            packed.release(run)
        assert packed.allocator.free_slots == packed.allocator.num_slots


@pytest.mark.parametrize(
    ("wire", "layout", "n", "cleared"),
    [
        ("fp8", "fused", 150, True),
        ("fp8", "fused", 160, False),
        ("fp8", "hnd", 150, False),
        ("packed", "fused", 150, False),
    ],
    ids=["fused-partial", "fused-whole-blocks", "hnd", "exact-packed"],
)
def test_the_partial_last_block_is_cleared_before_the_engine_writes_it(
    ranks: list[Rank], wire: str, layout: str, n: int, cleared: bool
) -> None:
    """A fused block packs rows that mix tokens (vLLM CPU keeps keys dim-major): the
    unused tail of the prompt's last block would enter the FP8 scales with whatever an
    earlier request left there. The sender zeroes that block, and only that one, when
    the engine hands it over (first chunk or a later one); per-token rows (hnd, nhd)
    and prompts of whole blocks need nothing, nor exact packing (no scales)."""
    p = Rank("P", 1, 0, layout, seed=5, wire=wire)
    ranks.append(p)
    before = p.cache.clone()
    p.ep.sender.track("c", [3, 4, 5, 6], n)  # a chunk of 64 tokens: the last block not yet
    assert torch.equal(p.cache, before)
    p.ep.sender.add_blocks("c", [7, 8, 9, 10, 11, 12])  # the rest: blocks 4 to 9 of the prompt
    last = p.cache.index_select(p.block_axis, torch.tensor([12]))
    assert bool((last == 0).all()) is cleared
    assert torch.equal(
        p.outside([12]),
        before.index_select(p.block_axis, torch.tensor([b for b in range(N) if b != 12])),
    )
    p.ep.sender.abort("c", "test over")
