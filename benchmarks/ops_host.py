"""Host work of one pack / unpack call, without a GPU: what the Python front of
``kvbridge.ops`` and torch's dispatcher cost before a kernel would be launched.

On a GPU, short calls are bound by the host (``benchmarks/results/ops.md``: 52-177 us to
issue one pack call on an H100's host, more than the kernel's GPU time below ~8k tokens
of thin layers), and the runtime's sender and receiver make one call per post or
arrival, on a Python thread beside the engine's. This routine isolates the host part on
any machine: the CPU planes go through the kernels' path of the front module
(``ops._use_kernels`` answers yes) into a do-nothing operator registered with the
binding's schema (namespace ``kvbridge_probe``), so every check, conversion and the
dispatch of the plane lists are paid, and no copy.

Methods, each a call with the block ids as a Python list (as the runtime passes them):

- ``free``: ``ops.pack`` / ``ops.unpack`` given the layers' planes, what the runtime
  called up to 0.1 (it built the list of planes per call, then the front checked them);
- ``paged``: ``ops.PagedKV.pack`` / ``.unpack`` selecting layers by index on planes
  checked once, what the runtime calls now.

Cases: Llama-3-8B (32 layers x 8 KV heads) and Llama-3-70B at TP 8 (80 x 1), 16-token
blocks, 1k and 8k tokens, one layer per call (layer-wise streaming as layers finish) or
every layer in one call. Methods are timed round-robin, each sample the mean of
``CALLS`` calls; the table shows medians.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

GEOMETRIES = {
    # name: (layers, KV heads per rank, head_dim)
    "llama3-8b": (32, 8, 128),
    "llama3-70b-tp8": (80, 1, 128),
}
METHODS = ("free", "paged")
CALLS = 200
"""Calls per timed sample."""

_SCHEMA = {
    "pack": (
        "pack(Tensor[] k, Tensor[] v, Tensor block_ids, int num_tokens, int head_start, "
        "int num_heads, bool fp8, int chunk_tokens, Tensor(a!) out, int kernel=0) -> ()"
    ),
    "unpack": (
        "unpack(Tensor packed, ScalarType packed_dtype, bool scaled, int chunk_tokens, "
        "Tensor(a!)[] k, Tensor(b!)[] v, Tensor block_ids, int num_tokens, int head_start, "
        "int num_heads, int kernel=0) -> ()"
    ),
}


@functools.cache
def _probe_library():
    """The library defining ``kvbridge_probe`` (kept alive: its operators go with it)."""
    import torch

    lib = torch.library.Library("kvbridge_probe", "DEF")
    for name, schema in _SCHEMA.items():
        lib.define(schema)
        lib.impl(name, lambda *args: None, "CPU")
    return lib


def _probe_binding():
    """``torch.ops.kvbridge_probe``: the binding's two operators, doing nothing on CPU."""
    import torch

    _probe_library()
    return torch.ops.kvbridge_probe


def _sample(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS * 1e6


def measure(geometry: str, tokens: int, per_call: str, reps: int, block_size: int = 16) -> dict:
    import torch

    from kvbridge import ops

    num_layers, heads, dim = GEOMETRIES[geometry]
    nblk = -(-tokens // block_size)
    # one cache for every layer: no copy is made
    cache = torch.zeros(2 * nblk + 1, heads, block_size, 2 * dim, dtype=torch.bfloat16)
    planes = [ops.kv_planes(cache, "nhd_kv")] * num_layers
    kv = ops.PagedKV(planes)
    ids = list(range(1, 2 * nblk + 1, 2))
    picks = (
        [[layer] for layer in range(num_layers)]
        if per_call == "one layer"
        else [list(range(num_layers))]
    )
    fmt = ops.packed_format(planes[0][0], tokens, chunk_tokens=block_size)
    buf = torch.zeros(len(picks[0]) * fmt.nbytes, dtype=torch.uint8)

    def free_pack():  # as the runtime's packed path did: planes picked per call
        for pick in picks:
            ops.pack(
                [planes[layer] for layer in pick], ids, tokens, chunk_tokens=block_size, out=buf
            )

    def paged_pack():
        for pick in picks:
            kv.pack(ids, tokens, layers=pick, chunk_tokens=block_size, out=buf)

    def free_unpack():
        for pick in picks:
            ops.unpack(buf, fmt, [planes[layer] for layer in pick], ids)

    def paged_unpack():
        for pick in picks:
            kv.unpack(buf, fmt, ids, layers=pick)

    fns = {
        "pack/free": free_pack,
        "pack/paged": paged_pack,
        "unpack/free": free_unpack,
        "unpack/paged": paged_unpack,
    }
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):  # round-robin: noise hits every method alike
        for name, fn in fns.items():
            samples[name].append(_sample(fn) / len(picks))
    us = {name: statistics.median(s) for name, s in samples.items()}
    return {
        "geometry": geometry,
        "block_size": block_size,
        "tokens": tokens,
        "per_call": per_call,
        "layers_per_call": len(picks[0]),
        "us_per_call": us,
        "samples_us": samples,
        "paged_vs_free": {op: us[f"{op}/paged"] / us[f"{op}/free"] for op in ("pack", "unpack")},
    }


def run(reps: int, token_counts: list[int], log: Callable[[str], None]) -> list[dict]:
    from kvbridge import ops

    binding = _probe_binding()
    saved = ops._use_kernels, ops._binding
    ops._use_kernels, ops._binding = (lambda t: True), (lambda: binding)
    try:
        results = []
        for geo in GEOMETRIES:
            for tokens in token_counts:
                for per_call in ("one layer", "all layers"):
                    r = measure(geo, tokens, per_call, reps)
                    log(
                        f"{geo} {tokens} tokens, {per_call}: "
                        + ", ".join(f"{k} {v:.1f} us" for k, v in r["us_per_call"].items())
                    )
                    results.append(r)
        return results
    finally:
        ops._use_kernels, ops._binding = saved


__all__ = ["GEOMETRIES", "METHODS", "measure", "run"]
