"""The packed data path (``wire_dtype: fp8``) of the runtime on the in-process loopback
transport, with real torch KV caches on both sides: FP8 on the wire, layer by layer,
unpacked into the decode cache; staging slots released exactly once; clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import runtime_pair
import torch

from kvbridge import ops
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.lifecycle import SendPhase
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.transports.loopback import LoopbackTransport

L, N, BS, H, HD = 4, 48, 16, 2, 32
SPEC = CacheSpec(
    num_layers=L, block_size=BS, num_kv_heads=H, head_dim=HD, dtype="float32", layout="fused"
)


def make_cache(seed: int | None, num_blocks: int = N) -> tuple[torch.Tensor, CacheGeometry]:
    """vLLM-CPU-shaped layers (num_blocks, heads, block_size, 2 * head_dim)."""
    shape = (L, num_blocks, H, BS, 2 * HD)
    t = (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if seed is not None
        else torch.zeros(shape)
    )
    geo = CacheGeometry(
        spec=SPEC, num_blocks=num_blocks, plane_bases=tuple(t[i].data_ptr() for i in range(L))
    )
    return t, geo


def endpoint(role: str, cache, wire_dtype: str = "fp8", **cfg) -> Endpoint:
    planes = [ops.kv_planes(cache[0][i], "fused") for i in range(L)]
    return runtime_pair.endpoint(
        role, cache, spec=SPEC, planes=planes, wire_dtype=wire_dtype, **cfg
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm()).item()


@pytest.fixture
def pd() -> Iterator[tuple]:
    p, d = make_cache(1), make_cache(None)
    P, D = endpoint("P", p), endpoint("D", d)
    yield P, D, p[0], d[0]
    D.close()
    P.close()


def _prefill(
    P: Endpoint,
    tid: str,
    blocks: list[int],
    n: int,
    chunks: tuple[int, ...],
    cache: torch.Tensor | None = None,
    pull: bool = False,
) -> None:
    """Track, then compute: ``cache``'s contents stand for the KV the engine writes
    after ``track`` (which may clear the partial last block first)."""
    written = None if cache is None else cache[:, blocks].clone()
    P.sender.track(tid, blocks, n, pull=pull)
    if cache is not None:
        cache[:, blocks] = written
    for done in chunks:
        for layer in range(L):
            P.sender.layer_done(tid, layer, done)
    P.sender.prefill_done(tid)


def test_fp8_push_lands_every_layer_with_bounded_error_and_a_quarter_of_the_bytes(pd) -> None:
    P, D, pa, da = pd
    n, pblocks, dblocks = 200, list(range(13)), list(range(30, 43))  # 13 blocks, last partial
    D.receiver.expect_push("r", P.address, dblocks, n)
    _prefill(P, "r", pblocks, n, (64, n), pa)
    assert D.receiver.wait_finished(5) == (["r"], [])
    assert P.sender.wait_released(5) == ["r"]
    k_src, v_src = zip(*(ops.kv_planes(pa[i], "fused") for i in range(L)), strict=True)
    k_dst, v_dst = zip(*(ops.kv_planes(da[i], "fused") for i in range(L)), strict=True)
    for layer in range(L):
        src = torch.cat(
            [k_src[layer][pblocks].flatten(0, 1)[:n], v_src[layer][pblocks].flatten(0, 1)[:n]]
        )
        dst = torch.cat(
            [k_dst[layer][dblocks].flatten(0, 1)[:n], v_dst[layer][dblocks].flatten(0, 1)[:n]]
        )
        assert 0 < rel_err(src, dst) < 0.04, layer
    assert not da[:, :30].any() and not da[:, 43:].any(), "unpack wrote outside the destination"
    sent = P.stats.take().bytes_sent
    exact = L * len(pblocks) * SPEC.block_bytes  # what the exact path moves: K and V (fused)
    assert 3.5 < exact / sent <= 4.0, exact / sent  # FP8 values + 4-byte scales per 32 values
    assert D.stats.take().bytes_received == sent
    for ep in (P, D):
        assert ep.node.packed.allocator.free_slots == ep.node.packed.allocator.num_slots


def test_requests_wait_for_staging_slots_and_all_complete() -> None:
    # 4 layers x 13 blocks = 52 slots per request; the decode buffer holds fewer than two
    p, d = make_cache(1), make_cache(None)
    slot = ops.PackedFormat(
        num_tokens=BS, num_heads=H, head_dim=HD, dtype="float8_e4m3fn", scaled=True, chunk_tokens=BS
    ).nbytes
    mb = -(-(60 * slot) // (1 << 20))
    P, D = endpoint("P", p), endpoint("D", d, staging_mb=mb)
    D.node.packed.allocator.alloc(D.node.packed.allocator.num_slots - 60)  # leave 60 slots
    try:
        for i, base in enumerate((0, 13, 26)):
            D.receiver.expect_push(f"w{i}", P.address, list(range(base, base + 13)), 200)
        for i, base in enumerate((0, 13, 26)):
            _prefill(P, f"w{i}", list(range(base, base + 13)), 200, (200,))
        finished: list[str] = []
        for _ in range(3):
            done, failed = D.receiver.wait_finished(5)
            assert not failed
            finished += done
            if len(finished) == 3:
                break
        assert sorted(finished) == ["w0", "w1", "w2"]
        assert D.node.packed.allocator.free_slots == 60
    finally:
        D.close()
        P.close()


def test_a_request_larger_than_the_staging_buffer_fails_naming_staging_mb(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p, d = make_cache(1, 160), make_cache(None, 160)
    P, D = endpoint("P", p), endpoint("D", d, staging_mb=1)  # 455 slots of 2304 bytes
    try:
        assert D.node.packed.allocator.num_slots < 4 * 120
        D.receiver.expect_push("big", P.address, list(range(120)), 120 * BS)
        assert D.receiver.wait_finished(5) == ([], ["big"])
        assert any(
            "exceeds the staging buffer" in r.getMessage() and "raise staging_mb" in r.getMessage()
            for r in caplog.records
        )
        assert D.node.packed.allocator.free_slots == D.node.packed.allocator.num_slots
    finally:
        D.close()
        P.close()


def test_p_first_requests_are_written_like_pushed_ones(pd) -> None:
    """P-first on the packed path: the prefill has computed and holds the request; the
    decode side (given its kv_transfer_params) sends a destination instead of reading,
    for the tokens it lacks (here all but the first block), and the prefill writes every
    layer at once and lets go by itself."""
    P, D, pa, da = pd
    # 6 blocks, the first cached on D
    n, pblocks, dblocks = (
        90,
        [5, 6, 7, 8, 9, 10],
        [20, 21, 22, 23, 24],
    )
    _prefill(P, "q", pblocks, n, (n,), pa, pull=True)
    assert P.sender.phase("q") is SendPhase.HELD
    D.receiver.expect_pull("q", P.address, P.epoch, pblocks, dblocks, n, skip_tokens=BS)
    assert D.receiver.wait_finished(5) == (["q"], [])
    assert P.sender.wait_released(5) == ["q"]
    for layer in range(L):
        (ks, vs), (kd, vd) = ops.kv_planes(pa[layer], "fused"), ops.kv_planes(da[layer], "fused")
        src = torch.cat([ks[pblocks[1:]], vs[pblocks[1:]]])
        dst = torch.cat([kd[dblocks], vd[dblocks]])
        assert 0 < rel_err(src, dst) < 0.04, layer
    assert not da[:, :20].any() and not da[:, 25:].any(), "unpack wrote outside the destination"
    assert (
        D.stats.take().bytes_received
        == P.stats.take().bytes_sent
        == L * len(dblocks) * D.node.packed.slot.nbytes
    )
    for ep in (P, D):
        assert ep.node.packed.allocator.free_slots == ep.node.packed.allocator.num_slots


def test_a_p_first_request_larger_than_the_prefill_staging_goes_out_in_parts() -> None:
    """P-first: every layer is ready at once, but the prefill's staging holds fewer
    than all of them: the request goes out in posts of a quarter of the buffer (here
    one layer each) instead of failing."""
    p, d = make_cache(1, 160), make_cache(None, 160)
    # 455 and 910 slots of 2304 bytes
    P, D = (
        endpoint("P", p, staging_mb=1),
        endpoint("D", d, staging_mb=2),
    )
    try:
        n, blocks = 120 * BS, list(range(120))
        assert L * len(blocks) > P.node.packed.allocator.num_slots
        _prefill(P, "big", blocks, n, (n,), p[0], pull=True)
        D.receiver.expect_pull("big", P.address, P.epoch, blocks, blocks, n)
        assert D.receiver.wait_finished(10) == (["big"], [])
        assert P.sender.wait_released(5) == ["big"]
        assert P.stats.take().transfers == L
        for layer in range(L):
            assert 0 < rel_err(p[0][layer, :120], d[0][layer, :120]) < 0.04, layer
        assert not d[0][:, 120:].any()
        for ep in (P, D):
            assert ep.node.packed.allocator.free_slots == ep.node.packed.allocator.num_slots
    finally:
        D.close()
        P.close()


def test_p_first_from_a_restarted_prefill_is_refused(caplog: pytest.LogCaptureFixture, pd) -> None:
    """The kv_transfer_params name the epoch of the instance that computed the KV: a
    prefill with another epoch (it restarted) no longer holds it."""
    P, D, pa, _ = pd
    _prefill(P, "e", [1, 2], 20, (20,), pa, pull=True)
    D.receiver.expect_pull("e", P.address, "0123456789ab", [1, 2], [3, 4], 20)
    assert D.receiver.wait_finished(5) == ([], ["e"])
    assert any("restarted" in r.getMessage() for r in caplog.records)
    assert D.node.packed.allocator.free_slots == D.node.packed.allocator.num_slots


@pytest.mark.parametrize("secret", [None, "s"], ids=["no-secret", "secret"])
def test_fp8_prefill_and_exact_decode_are_refused_naming_wire_dtype(
    caplog: pytest.LogCaptureFixture, secret: str | None
) -> None:
    """Without a secret the decode learns that the wire dtypes differ, not the prefill's
    (issue 46); an authenticated decode is told the prefill's too."""
    cfg = {} if secret is None else {"secret": secret}
    P = endpoint("P", make_cache(1), **cfg)
    D = endpoint("D", make_cache(None), wire_dtype="exact", **cfg)
    said = "wire_dtype: ours='exact', peer" + ("='fp8'" if secret else "'s differs")
    try:
        D.receiver.expect_push("i", P.address, [1], 10)
        assert D.receiver.wait_finished(5) == ([], ["i"])
        assert any(
            said in r.getMessage() and "identical wire_dtype" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
    finally:
        D.close()
        P.close()


def test_fp8_refuses_what_it_cannot_pack_with_the_fix() -> None:
    import msgspec

    from kvbridge.errors import ConfigError
    from kvbridge.runtime.packed import PackedPath

    t, geo = make_cache(1)
    planes = [ops.kv_planes(t[i], "fused") for i in range(L)]
    with LoopbackTransport("refusals") as tr:
        fp8_cache = CacheGeometry(
            spec=msgspec.structs.replace(SPEC, dtype="float8_e4m3fn"),
            num_blocks=N,
            plane_bases=geo.plane_bases,
        )
        with pytest.raises(ConfigError, match="float16, bfloat16 or float32 caches"):
            PackedPath(fp8_cache, planes, 1, tr)


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_packed_sliding_layers_move_only_the_blocks_the_decode_holds(flow: str) -> None:
    """Two KV cache groups through staging (exact values, so bit for bit): layers 1 and 3
    a sliding window the decode holds from block 10 of 13 on. Full layers land whole,
    sliding ones there only; a post with nothing to write gives its staging back at once;
    every staging slot is free at the end on both sides."""
    from kvbridge.core.blocks import NONE, BlockTable
    from kvbridge.core.lifecycle import RecvPhase

    groups = ((0, 1, 0, 1), (0, 40))
    p, d = make_cache(1), make_cache(None)
    P = endpoint("P", p, wire_dtype="exact", data_path="packed", groups=groups)
    D = endpoint("D", d, wire_dtype="exact", data_path="packed", groups=groups)
    pa, da = p[0], d[0]
    try:
        n, full, sliding = 200, list(range(13)), list(range(13, 26))
        ours = BlockTable.grouped([list(range(30, 43)), [NONE] * 10 + [43, 44, 45]])
        theirs = BlockTable.grouped([full, sliding])
        if flow == "push":
            D.receiver.expect_push("h", P.address, ours, n)
            P.sender.track("h", theirs, n)
            for layer in (1, 3):  # nothing of the sliding layers is in the first 64 tokens' window
                P.sender.layer_done("h", layer, 64)
            # its notification came, nothing written
            runtime_pair.eventually(lambda: D.receiver.phase("h") is RecvPhase.RECEIVING)
            assert P.node.packed.allocator.free_slots == P.node.packed.allocator.num_slots
        else:
            P.sender.track("h", theirs, n, pull=True)
        for layer in range(L):
            P.sender.layer_done("h", layer, n)
        P.sender.prefill_done("h")
        if flow == "pull":
            D.receiver.expect_pull("h", P.address, P.epoch, theirs, ours, n)
        assert D.receiver.wait_finished(5) == (["h"], [])
        assert P.sender.wait_released(5) == ["h"]
        for layer in (0, 2):
            assert torch.equal(da[layer, 30:43], pa[layer, :13])
        for layer in (1, 3):
            assert torch.equal(da[layer, 43:46], pa[layer, 23:26])
            assert not da[layer, :43].any() and not da[layer, 46:].any(), (
                "a sliding layer got blocks outside its window"
            )
        assert (
            D.stats.take().bytes_received
            == P.stats.take().bytes_sent
            == (2 * 13 + 2 * 3) * P.node.packed.slot.nbytes
        )
        for ep in (P, D):
            runtime_pair.eventually(
                lambda ep=ep: (
                    ep.node.packed.allocator.free_slots == ep.node.packed.allocator.num_slots
                )
            )
    finally:
        D.close()
        P.close()


def test_fp8_with_kv_cache_groups_clears_each_group_s_partial_block_and_lands_the_window() -> None:
    """FP8 through staging with two groups: the partial last block is zeroed in both
    groups before the engine writes it (its unused rows would enter the scales), and the
    sliding layers' window lands with bounded error, nothing outside it."""
    from kvbridge.core.blocks import NONE, BlockTable

    groups = ((0, 1, 0, 1), (0, 40))
    p, d = make_cache(1), make_cache(None)
    P, D = endpoint("P", p, groups=groups), endpoint("D", d, groups=groups)
    pa, da = p[0], d[0]
    try:
        n = 200  # 13 blocks, the last holding 8 tokens
        theirs = BlockTable.grouped([list(range(13)), list(range(13, 26))])
        D.receiver.expect_push(
            "q", P.address, BlockTable.grouped([list(range(30, 43)), [NONE] * 10 + [43, 44, 45]]), n
        )
        written = pa[:, [12, 25]].clone()
        P.sender.track("q", theirs, n)
        assert not pa[:, [12, 25]].any(), "the partial last block of each group is cleared at track"
        pa[:, [12, 25]] = written  # what the engine's forward then writes
        for layer in range(L):
            P.sender.layer_done("q", layer, n)
        P.sender.prefill_done("q")
        assert D.receiver.wait_finished(5) == (["q"], [])
        assert P.sender.wait_released(5) == ["q"]
        for layer, src, dst in [
            (0, range(13), range(30, 43)),
            (2, range(13), range(30, 43)),
            (1, range(23, 26), range(43, 46)),
            (3, range(23, 26), range(43, 46)),
        ]:
            assert 0 < rel_err(pa[layer, list(src)], da[layer, list(dst)]) < 0.04, layer
        for layer in (1, 3):
            assert not da[layer, :43].any() and not da[layer, 46:].any()
    finally:
        D.close()
        P.close()
