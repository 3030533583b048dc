"""Pack / unpack throughput on a GPU, next to a device-to-device copy of the same bytes
and torch's index_select / index_copy_ (the unfused way to gather and scatter blocks).

For each geometry (model KV shape, block size, request length) the request's blocks
are a random subset of a paged cache twice the request's size, in vLLM's
FlashAttention layout (NHD). One timed iteration processes every layer once, each
layer with its own cache and buffers (at least 1 GiB touched per iteration, so the
50 MB L2 does not hold the data): pack and unpack in one call for all layers (what
the runtime does per post), index_select / index_copy_ one torch call per layer,
the copy one call for all the bytes. Pack and unpack run with each CUDA kernel of
``kvbridge.ops.KERNELS`` ("rows" and "tiles", each named explicitly); the bytes are the same.

Times are GPU times: CUDA-event medians over 5 calls queued back to back behind a
short GPU sleep, so that the host has queued every call before the first starts and
the events see the GPU's work alone (without the sleep, the first call's host work,
60-400 us, counted as GPU time). The host time to issue one call (checks, block ids,
launch) is reported apart, for ``ops.pack`` and for ``ops.PagedKV.pack`` (the runtime's
handle, planes checked once): where it exceeds the GPU time, a loop issuing such calls
is bound by the host, not by the kernel. Block ids are host ids: up to 1024 of them
(16k tokens in 16-token blocks) travel in the kernel's launch parameters, longer lists
are uploaded through pinned memory, so the host column compares the two.

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
"""Calls queued back to back per timed sample."""

SLEEP_CYCLES = 20_000_000
"""GPU clock cycles slept before each sample's first event (~10 ms at 1.7-2 GHz): more
than the host needs to queue INNER calls of any geometry here."""


def _time(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU waits while the host queues the calls
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


def _check_kernels_agree(fns: dict, exact, fp8, fmt, qfmt, layers: int) -> None:
    """Every kernel packs the same bytes as "rows" (values and scales; padding aside):
    a fast wrong kernel would make the numbers meaningless."""
    import torch

    from kvbridge import ops
    from kvbridge.ops import reference

    def rows(buf, f):
        return [
            reference.region_rows(buf[i * f.nbytes : (i + 1) * f.nbytes], f) for i in range(layers)
        ]

    def same(a, b):  # values or scales (None when unscaled), bit for bit
        return (a is None and b is None) or torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        )

    for name, buf, f in (("pack", exact, fmt), ("pack_fp8", fp8, qfmt)):
        fns[name]()
        want = [tuple(x.clone() if x is not None else None for x in r) for r in rows(buf, f)]
        for kernel in ops.KERNELS[1:]:
            buf.fill_(0x5A)
            fns[f"{name}_{kernel}"]()
            for i, (got, w) in enumerate(zip(rows(buf, f), want, strict=True)):
                if not all(same(a, b) for a, b in zip(got, w, strict=True)):
                    raise SystemExit(
                        f"{name} with kernel {kernel!r} differs from 'rows' in layer {i}: fix the "
                        "kernel first"
                    )


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
    caches = [
        torch.randn(2, cache_blocks, block_size, heads, dim, dtype=dtype, device="cuda")
        for _ in range(layers)
    ]
    planes = [ops.kv_planes(c, "nhd") for c in caches]
    ids_cpu = torch.randperm(cache_blocks, generator=g)[:nblk]
    ids_dev = ids_cpu.cuda()
    fmt = ops.packed_format(planes[0][0], tokens)
    qfmt = ops.packed_format(planes[0][0], tokens, fp8=True)
    exact = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda")
    fp8 = torch.empty(layers * qfmt.nbytes, dtype=torch.uint8, device="cuda")
    copy_src = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda").random_()
    copy_dst = torch.empty(layers * fmt.nbytes, dtype=torch.uint8, device="cuda")
    gathered = [
        torch.empty(2, nblk, block_size, heads, dim, dtype=dtype, device="cuda")
        for _ in range(layers)
    ]

    # one call per op moves every layer (one kernel launch), as the runtime does per post
    def ops_for(kernel: str) -> dict[str, Callable[[], None]]:
        return {
            "pack": lambda: ops.pack(planes, ids_cpu, tokens, out=exact, kernel=kernel),
            "pack_fp8": lambda: ops.pack(planes, ids_cpu, tokens, fp8=True, out=fp8, kernel=kernel),
            "unpack": lambda: ops.unpack(exact, fmt, planes, ids_cpu, kernel=kernel),
            "unpack_fp8": lambda: ops.unpack(fp8, qfmt, planes, ids_cpu, kernel=kernel),
        }

    def copy():  # the same bytes in one contiguous device-to-device copy: the bandwidth ceiling
        copy_dst.copy_(copy_src)

    def index_select():
        for c, out in zip(caches, gathered, strict=True):
            torch.index_select(c, 1, ids_dev, out=out)

    def index_copy():
        for c, src in zip(caches, gathered, strict=True):
            c.index_copy_(1, ids_dev, src)

    fns: dict[str, Callable[[], None]] = {"copy": copy}
    for kernel in ops.KERNELS:
        suffix = "" if kernel == "rows" else f"_{kernel}"
        fns.update({name + suffix: fn for name, fn in ops_for(kernel).items()})
    fns.update(index_select=index_select, index_copy=index_copy)
    fns["pack_fp8"]()
    # the caches now hold dequantized values: the exact ops move them the same way
    fns["unpack_fp8"]()
    _check_kernels_agree(fns, exact, fp8, fmt, qfmt, layers)
    t = {name: _time(fn, reps) for name, fn in fns.items()}
    kv = layer_bytes * layers  # the request's KV over the timed layers
    gathered_bytes = 2 * nblk * block_size * heads * dim * dtype.itemsize * 2 * layers
    moved = {
        "copy": 2 * fmt.nbytes * layers,
        "index_select": gathered_bytes,
        "index_copy": gathered_bytes,
    }
    for name in t:
        if name.startswith(("pack", "unpack")):
            moved[name] = kv + qfmt.nbytes * layers if "fp8" in name else 2 * kv
    gbps = {k: moved[k] / t[k] / 1e9 for k in t}
    host = {name: _host_us(fns[name]) for name in ("pack", "pack_fp8", "copy")}
    paged = ops.PagedKV(planes)  # what the runtime calls: planes checked once
    host["pack_paged"] = _host_us(lambda: paged.pack(ids_cpu, tokens, out=exact))
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


def run(
    geometries: list[str],
    block_sizes: list[int],
    token_counts: list[int],
    reps: int,
    log: Callable[[str], None],
) -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "the ops benchmark needs a CUDA GPU (the CPU path is the torch reference, not a kernel)"
        )
    results = []
    for geo in geometries:
        for bs in block_sizes:
            for n in token_counts:
                r = measure(geo, bs, n, reps)
                log(
                    f"{geo} block {bs} tokens {n}: "
                    + ", ".join(f"{k} {v:.0f} GB/s" for k, v in r["gbps"].items())
                )
                results.append(r)
                torch.cuda.empty_cache()
    return results


def device_info() -> dict:
    import torch

    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
