"""The CUDA kernels equal the torch reference bit for bit (pack and unpack, exact and
FP8 bytes and scales) for every layout, dtype, block size, head slice and alignment,
and reject bad inputs; compute-sanitizer's memcheck finds nothing."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import LAYOUTS, block_ids, make_cache, planes

from kvbridge import ops
from kvbridge.ops import jit, reference

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    jit.load()  # raises when the build fails: a GPU run must not fall back silently
    assert hasattr(torch.ops.kvbridge, "pack")


@pytest.fixture(params=ops.KERNELS)
def kernel(request, monkeypatch):
    """Each kernel in turn (both must give the reference's bytes): ops.pack / unpack
    read $KVBRIDGE_PACK_KERNEL when no kernel= is given."""
    monkeypatch.setenv("KVBRIDGE_PACK_KERNEL", request.param)
    return request.param


def _ref_pack(k, v, ids, num_tokens, heads, fp8, chunk=0):
    """The reference on CPU copies: the specification, away from the GPU's torch ops."""
    kc, vc = k.cpu(), v.cpu()
    out = torch.full(
        (ops.packed_format(kc, num_tokens, heads, fp8, chunk).nbytes,), 0xA5, dtype=torch.uint8
    )
    region, fmt = ops.pack(
        (kc, vc), ids, num_tokens, heads=heads, fp8=fp8, chunk_tokens=chunk, out=out
    )
    return region, fmt


def _assert_same_region(got, want, fmt, what=""):
    """Values and scales bit for bit (padding between chunks is unspecified)."""
    gv, gs = reference.region_rows(got.cpu(), fmt)
    wv, ws = reference.region_rows(want.cpu(), fmt)
    assert torch.equal(gv.contiguous().view(torch.uint8), wv.contiguous().view(torch.uint8)), (
        f"values differ {what}"
    )
    if fmt.scaled:
        assert torch.equal(gs.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8)), (
            f"scales differ {what}"
        )


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    )


PACK_CASES = [
    # layout, dtype, block_size, heads, dim, num_tokens, head range, fp8
    *[
        (lay, dt, 16, 8, 128, 1000, None, fp8)
        for lay, dt, fp8 in itertools.product(LAYOUTS, DTYPES, (False, True))
    ],
    ("nhd", torch.bfloat16, 64, 8, 128, 4096, None, True),
    ("hnd", torch.bfloat16, 16, 8, 128, 1000, (0, 4), "chunked"),  # chunks of one block, FP8
    (
        "nhd",
        torch.bfloat16,
        16,
        8,
        128,
        1000,
        None,
        "chunks across blocks",
    ),  # chunks of 24 tokens: tiles of 8, FP8
    (
        "nhd",
        torch.float16,
        16,
        1,
        64,
        4000,
        None,
        False,
    ),  # one head of 64: a lane holds a whole row
    ("hnd", torch.float16, 32, 8, 128, 777, (2, 6), True),
    ("nhd", torch.bfloat16, 16, 8, 128, 333, (4, 8), False),
    ("fused", torch.float32, 16, 4, 64, 100, (1, 2), True),
    ("nhd", torch.bfloat16, 16, 2, 96, 250, None, True),  # 12 chunks per row: idle lanes
    ("nhd", torch.float32, 16, 2, 256, 250, None, True),  # two chunks per lane
    ("nhd", torch.bfloat16, 16, 3, 6, 90, None, True),  # 12-byte rows: one element per access
    ("nhd", torch.float32, 8, 1, 1, 31, None, False),
    ("nhd", torch.float8_e4m3fn, 16, 8, 128, 500, None, False),  # FP8 cache: bytes as they are
    ("nhd", torch.bfloat16, 16, 8, 128, 0, None, True),
    (
        "latent",
        torch.bfloat16,
        64,
        1,
        288,
        1000,
        None,
        True,
    ),  # MLA: the halves of 576-value vectors
    ("latent", torch.bfloat16, 64, 1, 288, 1000, None, False),
]


@pytest.mark.parametrize("layout,dtype,bs,heads,dim,tokens,hr,fp8", PACK_CASES)
def test_pack_equals_reference(kernel, layout, dtype, bs, heads, dim, tokens, hr, fp8):
    chunk = {"chunked": bs, "chunks across blocks": bs + bs // 2}.get(fp8, 0)
    fp8 = bool(fp8)
    nb = max(4, 2 * (tokens // bs + 1))
    cache = make_cache(layout, nb, bs, heads, dim, dtype, "cuda", seed=tokens + dim)
    k, v = planes(cache, layout)
    ids = block_ids(nb, -(-tokens // bs), seed=bs)
    want, fmt = _ref_pack(k, v, ids, tokens, hr, fp8, chunk)
    out = torch.full((fmt.nbytes,), 0x5A, dtype=torch.uint8, device="cuda")
    got, got_fmt = ops.pack((k, v), ids, tokens, heads=hr, fp8=fp8, chunk_tokens=chunk, out=out)
    torch.cuda.synchronize()
    assert got_fmt == fmt
    _assert_same_region(got, want, fmt)


UNPACK_CASES = [
    (("nhd", torch.bfloat16, 16), ("hnd", torch.float16, 32), 8, 8, None, 0, "chunked"),
    # source (layout, dtype, bs), destination (layout, dtype, bs), heads: src, dst, packed range,
    # dst offset; fp8
    *[
        ((lay, dt, 16), (lay, dt, 16), 8, 8, None, 0, fp8)
        for lay, dt, fp8 in itertools.product(LAYOUTS, DTYPES, (False, True))
    ],
    (
        ("nhd", torch.bfloat16, 16),
        ("hnd", torch.bfloat16, 64),
        8,
        8,
        None,
        0,
        True,
    ),  # layout + block size
    (
        ("fused", torch.float32, 16),
        ("nhd", torch.bfloat16, 32),
        4,
        4,
        None,
        0,
        False,
    ),  # dtype conversion
    (("nhd", torch.bfloat16, 16), ("nhd", torch.float32, 16), 8, 8, None, 0, False),
    (("hnd", torch.float16, 16), ("nhd", torch.bfloat16, 16), 8, 8, None, 0, False),
    (
        ("nhd", torch.bfloat16, 16),
        ("nhd", torch.bfloat16, 16),
        8,
        4,
        (4, 8),
        0,
        True,
    ),  # TP 1 -> 2, rank 1
    (
        ("nhd", torch.bfloat16, 16),
        ("nhd", torch.bfloat16, 32),
        4,
        8,
        None,
        4,
        True,
    ),  # TP 2 -> 1, rank 1
    (("nhd", torch.float8_e4m3fn, 16), ("hnd", torch.float8_e4m3fn, 32), 8, 8, None, 0, False),
    (("nhd", torch.bfloat16, 16), ("nhd", torch.bfloat16, 16), 3, 3, None, 0, True),
    (("latent", torch.bfloat16, 64), ("latent", torch.bfloat16, 16), 1, 1, None, 0, True),
]


@pytest.mark.parametrize("src,dst,src_heads,dst_heads,hr,offset,fp8", UNPACK_CASES)
def test_unpack_equals_reference(kernel, src, dst, src_heads, dst_heads, hr, offset, fp8):
    (sl, sdt, sbs), (dl, ddt, dbs) = src, dst
    chunk = sbs if fp8 == "chunked" else 0
    fp8 = bool(fp8)
    dim, tokens = {3: 6, 1: 288}.get(src_heads, 128), 1111
    snb, dnb = 2 * (tokens // sbs + 1), 2 * (tokens // dbs + 1)
    scache = make_cache(sl, snb, sbs, src_heads, dim, sdt, "cuda", seed=1)
    sk, sv = planes(scache, sl)
    region, fmt = ops.pack(
        (sk, sv),
        block_ids(snb, -(-tokens // sbs), 2),
        tokens,
        heads=hr,
        fp8=fp8,
        chunk_tokens=chunk,
    )
    dids = block_ids(dnb, -(-tokens // dbs), 3)
    base = make_cache(dl, dnb, dbs, dst_heads, dim, ddt, "cpu", seed=4)
    want, got = base.clone(), base.clone().cuda()
    reference.unpack(region.cpu(), fmt, [planes(want, dl)], dids, offset)
    ops.unpack(region, fmt, planes(got, dl), dids, head_start=offset)
    torch.cuda.synchronize()
    assert _bytes_equal(got, want)  # the whole cache: written rows equal, the rest untouched


@pytest.mark.parametrize("fp8", [False, True])
def test_many_layers_in_one_call(kernel, fp8):
    layers = [
        planes(make_cache("hnd", 40, 16, 4, 128, torch.bfloat16, "cuda", seed=s), "hnd")
        for s in range(5)
    ]
    ids = block_ids(40, 19, 7)
    got, fmt = ops.pack(layers, ids, 300, fp8=fp8, chunk_tokens=16)
    for i, (k, v) in enumerate(layers):
        want, _ = _ref_pack(k, v, ids, 300, None, fp8, 16)
        _assert_same_region(got[i * fmt.nbytes : (i + 1) * fmt.nbytes], want, fmt, f"layer {i}")
    dst = [make_cache("nhd", 20, 32, 4, 128, torch.float32, "cuda", seed=s) for s in range(5)]
    ref = [d.cpu() for d in dst]
    ops.unpack(got, fmt, [planes(d, "nhd") for d in dst], block_ids(20, 10, 8))
    reference.unpack(got.cpu(), fmt, [planes(r, "nhd") for r in ref], block_ids(20, 10, 8), 0)
    torch.cuda.synchronize()
    assert all(_bytes_equal(d, r) for d, r in zip(dst, ref, strict=True))


def test_device_block_ids_and_unaligned_views(kernel):
    cache = make_cache("nhd", 64, 16, 8, 128, torch.bfloat16, "cuda", seed=9)
    k, v = planes(cache, "nhd")
    ids = block_ids(64, 20, 5)
    a, fmt = ops.pack((k, v), ids.cuda(), 300, fp8=True)
    b, _ = ops.pack((k, v), ids, 300, fp8=True)
    _assert_same_region(a, b, fmt)
    # a view starting one element in: no 16-byte accesses possible, same result
    k1, v1 = k[..., 1:], v[..., 1:]
    want, fmt = _ref_pack(k1, v1, ids, 300, None, True)
    got, _ = ops.pack((k1, v1), ids, 300, fp8=True)
    _assert_same_region(got, want, fmt)


@pytest.mark.parametrize("count", [256, 257, 4096, 4097, 5000])
def test_host_block_ids_inline_or_uploaded(kernel, count):
    """Host ids up to kv_pack.h's kInlineIds (256 before CUDA 12.1, else 4096) travel in
    the kernel's parameters, longer lists through pinned memory: counts on both sides of
    either limit give the reference's bytes, pack and unpack, every block used."""
    cache = make_cache("nhd", count + 3, 4, 2, 64, torch.bfloat16, "cuda", seed=count)
    k, v = planes(cache, "nhd")
    ids = block_ids(count + 3, count, count)
    tokens = 4 * count - 1  # the last block partly filled
    for fp8 in (False, True):
        got, fmt = ops.pack((k, v), ids, tokens, fp8=fp8)
        want, _ = _ref_pack(k, v, ids, tokens, None, fp8)
        _assert_same_region(got, want, fmt, f"fp8={fp8}")
        dst = make_cache("hnd", count + 3, 4, 2, 64, torch.float16, "cuda", seed=count + 1)
        ref = dst.cpu()
        ops.unpack(got, fmt, planes(dst, "hnd"), ids.flip(0))
        reference.unpack(got.cpu(), fmt, [planes(ref, "hnd")], ids.flip(0), 0)
        torch.cuda.synchronize()
        assert _bytes_equal(dst, ref), f"unpack, fp8={fp8}"


def test_kernels_reject_bad_input_with_clear_errors():
    cache = make_cache("nhd", 8, 16, 4, 64, torch.bfloat16, "cuda", seed=1)
    k, v = planes(cache, "nhd")
    out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")

    def call(k, v, *args):  # args as before chunk_tokens was added: insert chunk_tokens=0
        return torch.ops.kvbridge.pack([k], [v], *args[:-1], 0, args[-1])

    with pytest.raises(RuntimeError, match="out of range"):
        call(k, v, torch.tensor([0, 8]), 32, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="need 2 block ids"):
        call(k, v, torch.tensor([0]), 32, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="head range"):
        call(k, v, torch.tensor([0]), 16, 2, 4, False, out)
    with pytest.raises(RuntimeError, match="4-D"):
        call(cache, v, torch.tensor([0]), 16, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="contiguous"):
        call(k.transpose(2, 3), v.transpose(2, 3), torch.tensor([0]), 16, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="bytes, the region needs"):
        call(k, v, torch.tensor([0]), 16, 0, 4, False, out[:100])
    with pytest.raises(RuntimeError, match="chunk_tokens must be"):
        torch.ops.kvbridge.pack([k], [v], torch.tensor([0]), 16, 0, 4, False, -1, out)
    with pytest.raises(RuntimeError, match="uint8"):
        call(k, v, torch.tensor([0]), 16, 0, 4, False, out.view(torch.float32))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        call(k, v, torch.tensor([0.0]), 16, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="already float8"):
        k8, v8 = planes(cache.to(torch.float8_e4m3fn), "nhd")
        call(k8, v8, torch.tensor([0]), 16, 0, 4, True, out)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        call(k, v, torch.tensor([0]), 16, 0, 4, False, out[1:])
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        call(k.cpu(), v.cpu(), torch.tensor([0]), 16, 0, 4, False, out)
    with pytest.raises(RuntimeError, match="scaled region cannot go into a float8 cache"):
        torch.ops.kvbridge.unpack(
            out, torch.float8_e4m3fn, True, 0, [k8], [v8], torch.tensor([0]), 16, 0, 4
        )
    with pytest.raises(RuntimeError, match=r"kernel must be 0 \(rows\) or 1 \(tiles\)"):
        torch.ops.kvbridge.pack([k], [v], torch.tensor([0]), 16, 0, 4, False, 0, out, 2)
    with pytest.raises(RuntimeError, match="layer 1 planes differ"):
        torch.ops.kvbridge.pack([k, k], [v, v[:, :8]], torch.tensor([0]), 16, 0, 4, False, 0, out)


def test_the_front_raises_the_bindings_checks_as_ops_input_errors():
    """On the kernels' path the front leaves block-id bounds to the binding (no second
    pass over the ids); its refusal still reaches the caller as OpsInputError, for host
    and device ids, through ops.pack and PagedKV alike."""
    cache = make_cache("nhd", 8, 16, 4, 64, torch.bfloat16, "cuda", seed=1)
    k, v = planes(cache, "nhd")
    with pytest.raises(ops.OpsInputError, match=r"block id 8 is out of range \[0, 8\)"):
        ops.pack((k, v), [0, 8], 32)
    with pytest.raises(ops.OpsInputError, match=r"block id -1 is out of range \[0, 8\)"):
        ops.PagedKV([(k, v)]).pack(torch.tensor([-1], device="cuda"), 16)
    region, fmt = ops.pack((k, v), [0, 1], 32)
    with pytest.raises(ops.OpsInputError, match=r"block id 9 is out of range \[0, 8\)"):
        ops.unpack(region, fmt, (k, v), [9, 1])


@pytest.mark.skipif(
    shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not installed"
)
def test_memcheck_clean():
    script = Path(__file__).with_name("memcheck_cases.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(script.parent), *sys.path]))
    proc = subprocess.run(
        [
            "compute-sanitizer",
            "--tool",
            "memcheck",
            "--error-exitcode",
            "3",
            "--leak-check",
            "no",
            sys.executable,
            str(script),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail
    assert "memcheck cases: ok" in proc.stdout, tail
