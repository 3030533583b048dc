"""Run every kernel variant once on small shapes; run under compute-sanitizer by
tests/gpu/test_kernels.py::test_memcheck_clean (exits non-zero on a wrong result)."""

from __future__ import annotations

import torch
from cases import block_ids, make_cache, planes

from kvbridge import ops
from kvbridge.ops import jit, reference


def main() -> None:
    jit.load()
    for kernel in ops.KERNELS:
        run(kernel)
    print("memcheck cases: ok")


def run(kernel: str) -> None:
    for layout in ("fused", "nhd", "hnd"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            for dim, fp8 in ((128, False), (128, True), (6, True), (96, False)):
                if fp8 and dtype == torch.float8_e4m3fn:
                    continue
                cache = make_cache(layout, 12, 16, 3, dim, dtype, "cuda", seed=dim)
                k, v = planes(cache, layout)
                ids = block_ids(12, 5, 1)
                region, fmt = ops.pack(
                    [(k, v), (v, k)], ids, 77, heads=(1, 3), fp8=fp8, chunk_tokens=16, kernel=kernel
                )
                other = torch.zeros_like(cache)
                other2 = torch.zeros_like(cache)
                ops.unpack(
                    region,
                    fmt,
                    [planes(other, layout), planes(other2, layout)],
                    ids,
                    head_start=1,
                    kernel=kernel,
                )
                torch.cuda.synchronize()
                back, _ = ops.pack(
                    [planes(other, layout), planes(other2, layout)],
                    ids,
                    77,
                    heads=(1, 3),
                    fp8=fp8,
                    chunk_tokens=16,
                    kernel=kernel,
                )
                if not fp8:
                    for i in range(2):
                        a = reference.region_rows(back[i * fmt.nbytes :].cpu(), fmt)[0]
                        b = reference.region_rows(region[i * fmt.nbytes :].cpu(), fmt)[0]
                        assert torch.equal(a, b), (kernel, layout, dtype, dim)
    # block ids read from device memory: given on the device, or too many for the kernel's
    # parameters (more than kv_pack.h's kInlineIds)
    cache = make_cache("nhd", 4200, 4, 2, 64, torch.bfloat16, "cuda", seed=5)
    k, v = planes(cache, "nhd")
    for ids in (block_ids(4200, 40, 2).cuda(), block_ids(4200, 4200, 3)):
        for fp8 in (False, True):
            region, fmt = ops.pack((k, v), ids, 4 * ids.numel() - 1, fp8=fp8, kernel=kernel)
            ops.unpack(region, fmt, planes(torch.zeros_like(cache), "nhd"), ids, kernel=kernel)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
