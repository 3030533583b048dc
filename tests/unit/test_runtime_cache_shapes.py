"""Prefill and decode caches of different shapes, on runtime endpoints over the
loopback transport with real torch caches:

- different block sizes (config ``transfer_block_size``): both sides address their
  token-major caches (NHD, MLA latent) in blocks of a common divisor, and the decode
  cache ends up holding the prefill's tokens where its own blocks put them, on the
  direct path (push and P-first) and the packed path (exact and FP8);
- different layouts on the packed path: an NHD prefill and an HND decode (and the
  reverse) pack a block into the same rows, so they pair there, exact and FP8; the
  direct path, which copies blocks as they are, refuses them."""

from __future__ import annotations

import math

import pytest
import runtime_pair
import torch

from kvbridge import ops
from kvbridge.core.layout import CacheGeometry, CacheSpec, sub_block_ids
from kvbridge.errors import PlanError

L, H, HD, T = 3, 2, 16, 150
UNIT = 16
TOKENS = 512  # cache capacity in tokens, both sides


def nhd_cache(block_size: int, seed: int | None) -> tuple[torch.Tensor, CacheGeometry]:
    """Per layer vLLM's FlashAttention tensor ``(2, blocks, block_size, heads, dim)``,
    addressed in blocks of ``UNIT`` tokens."""
    n = TOKENS // block_size
    shape = (L, 2, n, block_size, H, HD)
    t = (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if seed is not None
        else torch.zeros(shape)
    )
    spec = CacheSpec(
        num_layers=L,
        block_size=block_size,
        num_kv_heads=H,
        head_dim=HD,
        dtype="float32",
        layout="nhd",
    )
    geo = CacheGeometry(
        spec=spec,
        num_blocks=n,
        plane_bases=tuple(t[l, p].data_ptr() for l in range(L) for p in range(2)),
    )
    return t, geo.in_blocks_of(UNIT)


def planes(t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the vLLM worker hands the packed path: ``kv_planes`` viewed in blocks of ``UNIT``."""
    return [tuple(p.view(-1, UNIT, H, HD) for p in ops.kv_planes(t[l], "nhd")) for l in range(L)]


def tokens(t: torch.Tensor, engine_blocks: list[int]) -> torch.Tensor:
    """``(layers, 2, tokens, heads, dim)``: the tokens of ``engine_blocks`` in order."""
    return t[:, :, engine_blocks].flatten(2, 3)


def transfer(
    P, D, flow: str, p_blocks: list[int], d_blocks: list[int], n: int, skip: int = 0
) -> None:
    """One prompt of ``n`` tokens from ``p_blocks`` into ``d_blocks`` (tokens from
    ``skip``), push (the destination first) or P-first; returns once D received it."""
    if flow == "push":
        D.receiver.expect_push("r", P.address, d_blocks, n, skip_tokens=skip)
    P.sender.track("r", p_blocks, n, pull=flow == "pull")
    for layer in range(L):
        P.sender.layer_done("r", layer, n)
    P.sender.prefill_done("r")
    if flow == "pull":
        D.receiver.expect_pull("r", P.address, P.epoch, p_blocks, d_blocks, n, skip_tokens=skip)
    assert D.receiver.wait_finished(5) == (["r"], [])


SPEC = CacheSpec(
    num_layers=L, block_size=UNIT, num_kv_heads=H, head_dim=HD, dtype="float32", layout="nhd"
)
PATHS = {"direct": {}, "packed": {"data_path": "packed"}, "fp8": {"wire_dtype": "fp8"}}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 64), (64, 32)], ids=["P16-D64", "P64-D32"])
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_decode_holds_the_prefill_tokens_in_its_own_blocks(
    p_bs: int, d_bs: int, path: str, flow: str
) -> None:
    p, d = nhd_cache(p_bs, 1), nhd_cache(d_bs, None)
    cfg = {**PATHS[path], "transfer_block_size": UNIT}
    packed = path != "direct"
    P = runtime_pair.endpoint("P", p, spec=SPEC, planes=planes(p[0]) if packed else None, **cfg)
    D = runtime_pair.endpoint("D", d, spec=SPEC, planes=planes(d[0]) if packed else None, **cfg)
    try:
        # the prefill's engine blocks, scattered; the decode has its first block cached
        p_engine = list(range(math.ceil(T / p_bs)))[::-1]
        d_engine = [3, 1, 5, 2, 7, 6, 4][: math.ceil(T / d_bs)]
        skip = d_bs
        p_ids = sub_block_ids(p_engine, p_bs // UNIT, math.ceil(T / UNIT))
        d_ids = sub_block_ids(d_engine[1:], d_bs // UNIT, math.ceil(T / UNIT) - skip // UNIT)
        transfer(P, D, flow, p_ids, d_ids, T, skip)
        assert P.sender.wait_released(5) == ["r"]
        want = tokens(p[0], p_engine)[:, :, skip:T]
        got = tokens(d[0], d_engine)[:, :, skip:T]
        if path == "fp8":
            err = ((got - want).norm() / want.norm()).item()
            assert 0 < err < 0.04, err
        else:
            assert torch.equal(got, want)
        # nothing outside the destination: the cached block, the other blocks, the
        # partial last block past the last transfer block
        end = math.ceil(T / UNIT) * UNIT
        assert not tokens(d[0], d_engine)[:, :, :skip].any()
        assert not tokens(d[0], d_engine)[:, :, end:].any()
        assert not d[0][:, :, sorted(set(range(d[0].shape[2])) - set(d_engine))].any()
    finally:
        D.close()
        P.close()


def test_latent_caches_split_into_smaller_blocks() -> None:
    spec = CacheSpec(
        num_layers=1, block_size=64, num_kv_heads=1, head_dim=576, dtype="bfloat16", layout="latent"
    )
    t = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    geo = CacheGeometry(spec=spec, num_blocks=4, plane_bases=(t.data_ptr(),)).in_blocks_of(16)
    # block 5 of 16 tokens is tokens 16..31 of engine block 1
    assert geo.slot_address(geo.slot(0, 0, 5)) == t[1, 16].data_ptr()
    assert geo.spec.block_bytes * 4 == spec.block_bytes


@pytest.mark.parametrize("layout", ["fused", "hnd"])
def test_layouts_that_keep_a_block_s_tokens_apart_cannot_be_split(layout: str) -> None:
    spec = CacheSpec(
        num_layers=1, block_size=32, num_kv_heads=2, head_dim=8, dtype="float16", layout=layout
    )
    geo = CacheGeometry(spec=spec, num_blocks=4, plane_bases=(0x1000,) * spec.planes_per_layer)
    with pytest.raises(PlanError, match="token by token"):
        geo.in_blocks_of(16)


def test_a_size_that_does_not_divide_the_block_or_interleaved_blocks_are_refused() -> None:
    spec = CacheSpec(
        num_layers=1, block_size=32, num_kv_heads=2, head_dim=8, dtype="float16", layout="nhd"
    )
    geo = CacheGeometry(spec=spec, num_blocks=4, plane_bases=(0x1000, 0x9000))
    with pytest.raises(PlanError, match="does not divide"):
        geo.in_blocks_of(12)
    with pytest.raises(PlanError, match="back to back"):
        CacheGeometry(
            spec=spec, num_blocks=4, plane_bases=(0x1000, 0x9000), block_stride=2 * spec.block_bytes
        ).in_blocks_of(16)


def cache(
    layout: str, seed: int | None, block_size: int = UNIT
) -> tuple[torch.Tensor, CacheGeometry, list]:
    """Per layer a ``(2, blocks, ...)`` tensor of ``layout`` (NHD or HND), its geometry
    and its K and V planes (what the vLLM worker makes of a FlashAttention or a
    FlashInfer HND cache)."""
    n = TOKENS // block_size
    inner = (block_size, H, HD) if layout == "nhd" else (H, block_size, HD)
    shape = (L, 2, n, *inner)
    t = (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if seed is not None
        else torch.zeros(shape)
    )
    spec = CacheSpec(
        num_layers=L,
        block_size=block_size,
        num_kv_heads=H,
        head_dim=HD,
        dtype="float32",
        layout=layout,
    )
    geo = CacheGeometry(
        spec=spec,
        num_blocks=n,
        plane_bases=tuple(t[l, p].data_ptr() for l in range(L) for p in range(2)),
    )
    return t, geo, [ops.kv_planes(t[l], layout) for l in range(L)]


def token_rows(t: torch.Tensor, layout: str, blocks: list[int]) -> torch.Tensor:
    """``(layers, 2, tokens, heads, dim)`` of ``blocks`` whatever the layout."""
    x = t[:, :, blocks]
    return (x if layout == "nhd" else x.transpose(3, 4)).flatten(2, 3)


@pytest.mark.parametrize("wire", ["exact", "fp8"])
@pytest.mark.parametrize(("p_layout", "d_layout"), [("nhd", "hnd"), ("hnd", "nhd")])
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_nhd_and_hnd_caches_pair_on_the_packed_path(
    p_layout: str, d_layout: str, wire: str, flow: str
) -> None:
    (pt, pg, pp), (dt, dg, dp) = cache(p_layout, 1), cache(d_layout, None)
    cfg = {"wire_dtype": "fp8"} if wire == "fp8" else {"data_path": "packed"}
    P = runtime_pair.endpoint("P", (pt, pg), spec=pg.spec, planes=pp, **cfg)
    D = runtime_pair.endpoint("D", (dt, dg), spec=dg.spec, planes=dp, **cfg)
    try:
        n, p_blocks, d_blocks = 70, [4, 9, 2, 7, 11], [3, 0, 8, 1, 5]
        transfer(P, D, flow, p_blocks, d_blocks, n)
        # whole blocks move (the last one's tail too), each token's rows where its layout keeps them
        want, got = token_rows(pt, p_layout, p_blocks), token_rows(dt, d_layout, d_blocks)
        if wire == "fp8":
            assert 0 < ((got - want).norm() / want.norm()).item() < 0.04
        else:
            assert torch.equal(got, want)
        assert not dt[:, :, sorted(set(range(dt.shape[2])) - set(d_blocks))].any()
    finally:
        D.close()
        P.close()


@pytest.mark.parametrize("secret", [None, "s"], ids=["no-secret", "secret"])
def test_nhd_and_hnd_caches_are_refused_on_the_direct_path(secret: str | None) -> None:
    """Without a secret the decode learns that the layouts differ, not the prefill's
    (issue 46); an authenticated decode is told the prefill's too."""
    from kvbridge.errors import IncompatiblePeerError

    cfg = {} if secret is None else {"secret": secret}
    (pt, pg, _), (dt, dg, _) = cache("nhd", 1), cache("hnd", None)
    P = runtime_pair.endpoint("P", (pt, pg), spec=pg.spec, **cfg)
    D = runtime_pair.endpoint("D", (dt, dg), spec=dg.spec, **cfg)
    said = "layout: ours='hnd', peer='nhd'" if secret else "layout: ours='hnd', peer's differs"
    try:
        with pytest.raises(IncompatiblePeerError, match=said) as info:
            D.node.connect(P.address)
        assert "fix: start prefill and decode with identical layout" in str(info.value)
    finally:
        D.close()
        P.close()


# --- vLLM 0.32's GPU attention views (built by vLLM's own create_kv_cache_views) -------------


def vllm_cache(
    name: str, block_size: int, seed: int | None
) -> tuple[dict[str, torch.Tensor], CacheGeometry, list]:
    """vLLM's views of a ``name`` (``VLLM_KV_CACHE_LAYOUT``) cache, described by the vLLM
    adapter in blocks of ``UNIT`` tokens, with the planes its worker hands the packed path."""
    from vllm_views import vllm_views

    from kvbridge.adapters.vllm.cache import geometry_from_tensors

    views = vllm_views(
        name,
        layers=L,
        blocks=TOKENS // block_size,
        block_size=block_size,
        heads=H,
        head_size=HD,
        seed=seed,
    )
    geo = geometry_from_tensors(views, list(views), block_size, cpu_backend=False)
    planes = [
        tuple(p.view(-1, UNIT, H, HD) for p in ops.kv_planes(v, geo.spec.layout))
        for v in views.values()
    ]
    return views, geo.in_blocks_of(UNIT), planes


def view_tokens(views: dict[str, torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """``(layers, tokens, heads, K|V)`` of ``blocks``, as the attention backends read them."""
    return torch.stack([v.transpose(1, 2)[blocks].flatten(0, 1) for v in views.values()])


@pytest.mark.parametrize(
    ("p_name", "d_name", "d_bs", "cfg"),
    [
        ("BLNHC", "BLNHC", UNIT, {}),  # direct: every layer's block interleaved in one allocation
        ("LBHNC", "LBHNC", UNIT, {}),
        (
            "LBNHC",
            "LBNHC",
            2 * UNIT,
            {"transfer_block_size": UNIT},
        ),  # direct, different block sizes
        ("LBNHC", "LBHNC", UNIT, {"data_path": "packed"}),  # tokens-first into heads-first
        ("LBHNC", "LBNHC", 2 * UNIT, {"wire_dtype": "fp8", "transfer_block_size": UNIT}),
        ("BLHNC", "BLNHC", UNIT, {"wire_dtype": "fp8"}),
    ],
)
@pytest.mark.parametrize("flow", ["push", "pull"])
def test_vllm_gpu_views_move_each_token_into_the_decode_s_view(
    p_name: str, d_name: str, d_bs: int, cfg: dict, flow: str
) -> None:
    (pv, pg, pp), (dv, dg, dp) = vllm_cache(p_name, UNIT, 1), vllm_cache(d_name, d_bs, None)
    packed = bool(cfg.get("data_path") or cfg.get("wire_dtype"))
    P = runtime_pair.endpoint("P", (pv, pg), spec=pg.spec, planes=pp if packed else None, **cfg)
    D = runtime_pair.endpoint("D", (dv, dg), spec=dg.spec, planes=dp if packed else None, **cfg)
    try:
        n = 150
        p_blocks = [9, 2, 14, 5, 0, 11, 7, 3, 12, 1]  # 10 blocks of 16
        d_engine = [6, 2, 9, 4, 0] if d_bs == UNIT * 2 else [12, 3, 8, 1, 15, 6, 10, 0, 4, 13]
        d_blocks = sub_block_ids(d_engine, d_bs // UNIT, math.ceil(n / UNIT))
        transfer(P, D, flow, p_blocks, d_blocks, n)
        want, got = (
            view_tokens(pv, p_blocks)[:, :n].float(),
            view_tokens(dv, d_engine)[:, :n].float(),
        )
        if cfg.get("wire_dtype") == "fp8":
            assert 0 < ((got - want).norm() / want.norm()).item() < 0.04
        else:
            assert torch.equal(got, want)
        others = sorted(set(range(next(iter(dv.values())).shape[0])) - set(d_engine))
        assert not any(v[others].any() for v in dv.values()), "written outside the destination"
    finally:
        D.close()
        P.close()
