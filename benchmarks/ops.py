"""Pack / unpack throughput on a GPU, next to a device-to-device copy of the same bytes
and torch's index_select / index_copy_ (the unfused way to gather and scatter blocks).

For each geometry (model KV shape, block size, request length) the request's blocks
are a random subset of a paged cache twice the request's size, in vLLM's
FlashAttention layout (NHD). One timed iteration processes every layer once, each
layer with its own cache and buffers (at least 1 GiB touched per iteration, so the
50 MB L2 does not hold the data): pack and unpack in one call for all layers (what
the runtime does per post), index_select / index_copy_ one torch call per layer,
the copy one call for all the bytes. Times are CUDA-event medians over 5 calls
queued back to back (the host's checks and id upload for the next call overlap the
GPU's work, as in a serving loop); the host time to issue one call is reported apart.

Bandwidth counts bytes read plus bytes written (what a copy of N bytes moves is 2N):
pack and unpack move the KV once in each direction, FP8 pack reads the KV and writes
the smaller region, FP8 unpack the reverse.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

GEOMETRIES = {
    # name: (layers, KV heads per rank, head_dim, dtype)
    "llama3-8b": (32, 8, 128, "bfloat16"),
    "llama3-70b-tp8": (80, 1, 128, "bfloat16"),
}


INNER = 5
"""Calls queued back to back per timed sample: the GPU time of a call, with the host's
work for the next call overlapping it (as in a serving loop)."""


def _time(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(INNER):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / INNER)
    return statistics.median(times)


def _host_us(fn: Callable[[], None], n: int = 20) -> float:
    """Host time to issue one call (checks, id upload, launch), GPU not waited for."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def measure(geometry: str, block_size: int, tokens: int, reps: int) -> dict:
    import torch

    from kvbridge import ops
    from kvbridge.ops import jit

    jit.load()
    num_layers, heads, dim, dtype_name = GEOMETRIES[geometry]
    dtype = getattr(torch, dtype_name)
    nblk = -(-tokens // block_size)
    cache_blocks = 2 * nblk
    layer_bytes = 2 * tokens * heads * dim * dtype.itemsize
    # enough layers that one iteration touches >= 1 GiB, at most the model's
    layers = max(2, min(num_layers, -(-(1 << 30) // (4 * layer_bytes))))
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, cache_blocks, block_size, heads, dim, dtype=dtype, device="cuda") for _ in range(layers)]
    planes = [ops.kv_planes(c, "nhd") for c in caches]
    ids_cpu = torch.randperm(cache_blocks, generator=g)[:nblk]
    ids_dev = ids_cpu.cuda()
    fmt = ops.packed_format(planes[0][0], tokens)
    qfmt = ops.packed_format(planes[0][0], tokens, fp8=True)
    exact = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda")
    fp8 = torch.empty(layers * qfmt.nbytes, dtype=torch.uint8, device="cuda")
    copy_src = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda").random_()
    copy_dst = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda")
    gathered = [torch.empty(2, nblk, block_size, heads, dim, dtype=dtype, device="cuda") for _ in range(layers)]

    # one call per op moves every layer (one kernel launch), as the runtime does per post
    def pack():
        ops.pack(planes, ids_cpu, tokens, out=exact)

    def pack_fp8():
        ops.pack(planes, ids_cpu, tokens, fp8=True, out=fp8)

    def unpack():
        ops.unpack(exact, fmt, planes, ids_cpu)

    def unpack_fp8():
        ops.unpack(fp8, qfmt, planes, ids_cpu)

    def copy():  # the same bytes in one contiguous device-to-device copy: the bandwidth ceiling
        copy_dst.copy_(copy_src)

    def index_select():
        for c, out in zip(caches, gathered):
            torch.index_select(c, 1, ids_dev, out=out)

    def index_copy():
        for c, src in zip(caches, gathered):
            c.index_copy_(1, ids_dev, src)

    pack_fp8()
    unpack_fp8()  # the caches now hold dequantized values: the exact ops move them the same way
    t = {name: _time(fn, reps) for name, fn in (
        ("copy", copy), ("pack", pack), ("pack_fp8", pack_fp8), ("unpack", unpack), ("unpack_fp8", unpack_fp8),
        ("index_select", index_select), ("index_copy", index_copy),
    )}
    kv = layer_bytes * layers  # the request's KV over the timed layers
    moved = {
        "copy": 2 * fmt.nbytes * layers,
        "pack": 2 * kv,
        "unpack": 2 * kv,
        "pack_fp8": kv + qfmt.nbytes * layers,
        "unpack_fp8": kv + qfmt.nbytes * layers,
        "index_select": 2 * nblk * block_size * heads * dim * dtype.itemsize * 2 * layers,
        "index_copy": 2 * nblk * block_size * heads * dim * dtype.itemsize * 2 * layers,
    }
    gbps = {k: moved[k] / t[k] / 1e9 for k in t}
    host = {"pack": _host_us(pack), "pack_fp8": _host_us(pack_fp8), "copy": _host_us(copy)}
    return {
        "geometry": geometry,
        "block_size": block_size,
        "tokens": tokens,
        "layers_timed": layers,
        "layer_kv_bytes": layer_bytes,
        "seconds": t,
        "gbps": gbps,
        "vs_copy": {k: gbps[k] / gbps["copy"] for k in gbps},
        "host_us_per_call": host,
    }


def run(geometries: list[str], block_sizes: list[int], token_counts: list[int], reps: int, log: Callable[[str], None]) -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the ops benchmark needs a CUDA GPU (the CPU path is the torch reference, not a kernel)")
    results = []
    for geo in geometries:
        for bs in block_sizes:
            for n in token_counts:
                r = measure(geo, bs, n, reps)
                log(f"{geo} block {bs} tokens {n}: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in r["gbps"].items()))
                results.append(r)
                torch.cuda.empty_cache()
    return results


def device_info() -> dict:
    import torch

    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda}
