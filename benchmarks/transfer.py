"""Routine ``transfer``: KV-shaped transfers through kvbridge vs the raw transport.

One run, one machine, for each transport and block size:

- ``kvbridge request``: ``plan_blocks`` over all layers + one ``post`` on tables
  prepared once + ``wait`` (how a whole request moves);
- ``kvbridge per-layer``: one ``plan_blocks``, then one ``post`` per layer slice of it,
  then wait for all (how layer-wise streaming moves it);
- ``raw regions``: the same regions kvbridge's plan coalesces to, through the backend's
  own API (``initialize_xfer`` / ``batch_transfer_sync``), busy-polled: isolates
  kvbridge's own cost from the cost of the cache layout;
- ``raw large``: the same number of bytes as one contiguous region through the
  backend's own API, busy-polled (the best case the transport offers);
- ``memcpy``: the same bytes copied inside one process (the upper bound of loopback).

The target cache lives in a second process (:class:`kvbridge.transports.testing.Peer`).
Block ids are either contiguous on both sides (what a fresh allocator hands out; runs
coalesce) or fragmented (random, nothing coalesces).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.plan import plan_blocks, plan_regions
from kvbridge.transports.testing import Local, Peer, unique

LAYERS = 32
BLOCKS_PER_REQUEST = 64
CACHE_BLOCKS = 96  # per layer; leaves room for fragmented picks

# fused layout (vLLM CPU): block bytes = block_size * heads * 2 * head_dim * 2 (fp16)
BLOCK_SHAPES = {16: (16, 2, 128), 64: (16, 8, 128), 256: (64, 8, 128)}


@dataclass
class Result:
    transport: str
    block_kib: int
    scenario: str
    method: str
    nbytes: int
    descriptors: int
    times_s: list[float] = field(default_factory=list)

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.times_s) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.nbytes / statistics.median(self.times_s) / 1e9

    def to_json(self) -> dict:
        return asdict(self) | {
            "best_gbps": round(self.best_gbps, 3),
            "median_gbps": round(self.median_gbps, 3),
        }


def _geometry(block_kib: int, base: int) -> CacheGeometry:
    bs, heads, dim = BLOCK_SHAPES[block_kib]
    spec = CacheSpec(
        num_layers=LAYERS,
        block_size=bs,
        num_kv_heads=heads,
        head_dim=dim,
        dtype="float16",
        layout="fused",
    )
    assert spec.block_bytes == block_kib * 1024
    layer_bytes = CACHE_BLOCKS * spec.block_bytes
    return CacheGeometry(
        spec=spec,
        num_blocks=CACHE_BLOCKS,
        plane_bases=tuple(base + i * layer_bytes for i in range(LAYERS)),
    )


def _measure(cases: list[tuple[Result, Callable[[], object]]], reps: int) -> None:
    """Time every case ``reps`` times, round-robin, so machine noise hits all methods
    alike (a case measured only while the machine was busy would skew the ratios)."""
    for _, fn in cases:
        fn()  # warm-up: connections, page faults
    for _ in range(reps):
        for result, fn in cases:
            t0 = time.perf_counter()
            fn()
            result.times_s.append(time.perf_counter() - t0)


def _raw(
    loc: Local, peer_id: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> Callable[[], None]:
    """Write regions ``src[i] -> dst[i]`` through the backend's own API, busy-polled."""
    t = loc.t
    if t.name == "nixl":
        agent = t.agent  # type: ignore[attr-defined]
        zeros = np.zeros_like(length)
        local = agent.get_xfer_descs(
            np.stack([src, length, zeros], axis=1).astype(np.uint64), "DRAM"
        )
        remote = agent.get_xfer_descs(
            np.stack([dst, length, zeros], axis=1).astype(np.uint64), "DRAM"
        )

        def run() -> None:
            h = agent.initialize_xfer("WRITE", local, remote, peer_id, b"")
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            assert state == "DONE", state
            h.release()

        return run
    if t.name == "mooncake":
        from mooncake.engine import TransferOpcode

        engine, endpoint = t.engine, t.peer_endpoint(peer_id)  # type: ignore[attr-defined]
        args = (src.tolist(), dst.tolist(), length.tolist())

        def run() -> None:
            rc = engine.batch_transfer_sync(endpoint, *args, TransferOpcode.Write, None)
            assert rc == 0, rc

        return run
    raise ValueError(f"no raw baseline for transport {t.name!r}")


def _kvbridge(
    loc: Local, tables, geos, blocks, per_layer: bool, timeout: float
) -> Callable[[], None]:
    (lt, rt), (lg, rg), (lb, rb) = tables, geos, blocks
    t = loc.t

    def run() -> None:
        if per_layer:  # plan once (the destination is known), post each layer's slice
            plan = plan_blocks(lg, rg, lb, rb)
            xfers = []
            for layer in range(LAYERS):
                part = plan.for_layer(layer)
                xfers.append(t.post("write", lt, part.local_slots, rt, part.remote_slots))
        else:
            plan = plan_blocks(lg, rg, lb, rb)
            xfers = [t.post("write", lt, plan.local_slots, rt, plan.remote_slots)]
        for x in xfers:
            t.wait(x, timeout)
            t.release(x)

    return run


def run(
    transports: list[str], block_kibs: list[int], reps: int, log: Callable[[str], None]
) -> list[Result]:
    results: list[Result] = []
    rng = np.random.default_rng(0)
    for name in transports:
        for kib in block_kibs:
            probe = _geometry(kib, 4096)
            cache_bytes = LAYERS * CACHE_BLOCKS * probe.spec.block_bytes
            request_bytes = LAYERS * BLOCKS_PER_REQUEST * probe.spec.block_bytes
            log(f"{name}: {kib} KiB blocks, {request_bytes >> 20} MiB per request")
            with Peer(name, unique("bench-target"), nbytes=cache_bytes) as peer:
                loc = Local(name, nbytes=cache_bytes)
                try:
                    peer_id = loc.connect(peer)
                    lg, rg = _geometry(kib, loc.base), _geometry(kib, peer.base)
                    lt = loc.t.prepare(lg.slot_table())
                    rt = loc.t.prepare(rg.slot_table(), peer=peer_id)
                    loc.buf[:] = 1
                    scenarios = {
                        "contiguous": (
                            np.arange(BLOCKS_PER_REQUEST),
                            np.arange(BLOCKS_PER_REQUEST) + 16,
                        ),
                        "fragmented": (
                            rng.choice(CACHE_BLOCKS, BLOCKS_PER_REQUEST, replace=False),
                            rng.choice(CACHE_BLOCKS, BLOCKS_PER_REQUEST, replace=False),
                        ),
                    }
                    cases: list[tuple[Result, Callable[[], object]]] = []
                    for scenario, blocks in scenarios.items():
                        plan = plan_blocks(lg, rg, *blocks)
                        regions = plan_regions(plan, lg, rg)
                        for method, per_layer in (
                            ("kvbridge request", False),
                            ("kvbridge per-layer", True),
                        ):
                            fn = _kvbridge(loc, (lt, rt), (lg, rg), blocks, per_layer, timeout=60)
                            cases.append(
                                (Result(name, kib, scenario, method, plan.nbytes, len(regions)), fn)
                            )
                        raw_regions = _raw(loc, peer_id, *regions)
                        cases.append(
                            (
                                Result(
                                    name, kib, scenario, "raw regions", plan.nbytes, len(regions)
                                ),
                                raw_regions,
                            )
                        )
                    dst = np.empty(request_bytes, dtype=np.uint8)
                    one = [
                        np.array([v], dtype=np.uint64) for v in (loc.base, peer.base, request_bytes)
                    ]
                    cases.append(
                        (
                            Result(name, kib, "any", "raw large", request_bytes, 1),
                            _raw(loc, peer_id, *one),
                        )
                    )
                    cases.append(
                        (
                            Result(name, kib, "any", "memcpy", request_bytes, 1),
                            lambda dst=dst, src=loc.buf[:request_bytes]: np.copyto(dst, src),
                        )
                    )
                    _measure(cases, reps)
                    results.extend(r for r, _ in cases)
                finally:
                    loc.close()
    return results


def summarize(results: list[Result]) -> list[dict]:
    """kvbridge vs the raw transport, per (transport, block size, scenario)."""
    out = []
    keys = sorted({(r.transport, r.block_kib, r.scenario) for r in results if r.scenario != "any"})
    for key in keys:
        group = {
            r.method: r
            for r in results
            if (r.transport, r.block_kib) == key[:2] and r.scenario in (key[2], "any")
        }
        raw = group["raw large"].best_gbps
        out.append(
            {
                "transport": key[0],
                "block_kib": key[1],
                "scenario": key[2],
                "raw_best_gbps": round(raw, 3),
                "memcpy_best_gbps": round(group["memcpy"].best_gbps, 3),
                "request_best_gbps": round(group["kvbridge request"].best_gbps, 3),
                "per_layer_best_gbps": round(group["kvbridge per-layer"].best_gbps, 3),
                "raw_regions_best_gbps": round(group["raw regions"].best_gbps, 3),
                "request_vs_raw_regions": round(
                    group["kvbridge request"].best_gbps / group["raw regions"].best_gbps, 3
                ),
                "request_vs_raw_median": round(
                    group["kvbridge request"].median_gbps / group["raw large"].median_gbps, 3
                ),
                "request_vs_raw": round(group["kvbridge request"].best_gbps / raw, 3),
                "per_layer_vs_raw": round(group["kvbridge per-layer"].best_gbps / raw, 3),
                "descriptors_after_coalescing": group["kvbridge request"].descriptors,
            }
        )
    return out
