"""The CUDA kernels of csrc/kv_pack.cu, run on the host by a warp emulator, equal the torch
reference byte for byte: both kernels (rows, tiles), every mode (copy, quantize,
dequantize, convert), 16-byte and one-element accesses, head slices, chunked regions,
several layers per call, block ids in the launch parameters or in memory, grids smaller
and larger than the work.

How: the kernels' source is compiled by the system C++ compiler with
tests/unit/native/warp_emu.h, which runs each lane of a warp as a host thread
(``__shfl_xor_sync`` meets at a barrier) and takes the float conversions from CUDA's own
headers; AddressSanitizer and UBSan (misaligned 16-byte accesses included) watch every
access, and the emulator fails a call whose shuffles are not warp-uniform. This checks
the kernels' logic on every CI run; the GPU tests (tests/gpu) remain the word on the
hardware. Needs a C++20 compiler and the CUDA headers (scripts/setup.sh installs them
from NVIDIA's wheels; or set $KVBRIDGE_CUDA_INCLUDE)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge import ops
from kvbridge.ops import reference
from kvbridge.ops.format import PackedFormat

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests/unit/native"
sys.path.insert(0, str(ROOT / "tests/gpu"))
from cases import block_ids, make_cache, planes  # noqa: E402  (the GPU tests' cases)

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
FLAGS = [
    "-std=c++20",
    "-O0",  # g++ takes about 70 s at -O0 with the sanitizers, 190 s at -O1; the run ~40 s more
    "-g",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=undefined",
    "-fno-omit-frame-pointer",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-pragmas",
    "-Werror",
    "-pthread",
]
LAUNCH = re.compile(r"(\w+<[^<>;]*>)<<<(.*?)>>>\(([^;]*?)\)(?=;|\s*$)", re.MULTILINE)


def cuda_include_dirs() -> list[str]:
    """Where cuda_fp8.h and its includes are: $KVBRIDGE_CUDA_INCLUDE (os.pathsep-separated),
    the headers scripts/setup.sh put beside the venv, or a CUDA toolkit."""
    if os.environ.get("KVBRIDGE_CUDA_INCLUDE"):
        return os.environ["KVBRIDGE_CUDA_INCLUDE"].split(os.pathsep)
    wheels = Path(sys.prefix) / "cuda-headers/nvidia/cu13/include"
    for d in (wheels, Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"):
        if (d / "cuda_fp8.h").exists() and (d / "nv/target").exists():
            return [str(d)]
    return []


def emulated_source() -> str:
    """kv_pack.cu with each ``kernel<<<grid, block, smem, stream>>>(args)`` turned into a
    call of the emulator's launch."""
    text = (ROOT / "csrc/kv_pack.cu").read_text()
    out, n = LAUNCH.subn(lambda m: f"::kvb_emu::launch({m[2]}, [=] {{ {m[1]}({m[3]}); }})", text)
    assert n == 2, f"expected the 2 kernel launches of csrc/kv_pack.cu, rewrote {n}: update LAUNCH"
    return out


def toolchain() -> tuple[str, list[str]]:
    """The C++ compiler and the CUDA include directories; skips the test without them."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH (apt-get install g++)")
    inc = cuda_include_dirs()
    if not inc:
        pytest.skip("no CUDA headers: run scripts/setup.sh or set KVBRIDGE_CUDA_INCLUDE")
    return cxx, inc


@pytest.fixture(scope="module")
def emulator() -> Path:
    """The harness binary, built once per source and flags (about a minute with the
    sanitizers) and kept under ~/.cache/kvbridge/emu."""
    cxx, inc = toolchain()
    src = emulated_source()
    key = hashlib.sha256(
        "\0".join(
            [
                src,
                *(p.read_text() for p in sorted(NATIVE.glob("*emu*"))),
                *(p.read_text() for p in sorted((ROOT / "csrc").glob("*.h"))),
                cxx,
                *FLAGS,
                *inc,
            ]
        ).encode()
    )
    cache = (
        Path(os.environ.get("KVBRIDGE_CACHE_DIR", Path.home() / ".cache/kvbridge"))
        / "emu"
        / key.hexdigest()[:16]
    )
    exe = cache / "kernels_emu"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "kv_pack_emu.cpp").write_text(src)
        tmp = cache / f"kernels_emu.{os.getpid()}"
        cmd = [
            cxx,
            *FLAGS,
            "-include",
            str(NATIVE / "warp_emu.h"),
            f"-I{ROOT / 'csrc'}",
            *(f"-I{d}" for d in inc),
            str(cache / "kv_pack_emu.cpp"),
            str(NATIVE / "kernels_emu.cpp"),
            "-o",
            str(tmp),
        ]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
        assert r.returncode == 0, f"building the emulated kernels failed:\n{r.stderr[-6000:]}"
        tmp.replace(exe)
    return exe


@functools.cache
def inline_limit(exe: Path) -> int:
    """kv_pack.h's kInlineIds as compiled: the most block ids a call carries in its
    kernel parameters."""
    return int(
        subprocess.run(
            [str(exe), "--inline-ids"], capture_output=True, text=True, check=True
        ).stdout
    )


def vector_ok(k: torch.Tensor, packed_elem: int) -> bool:
    """What csrc/api.cpp decides: 16-byte accesses when head_dim, the strides and every
    plane's start are multiples of the access width on both sides."""
    e = 16 // max(k.element_size(), packed_elem)
    return (
        k.shape[3] % e == 0
        and all(s % e == 0 for s in k.stride()[:3])
        and k.storage_offset() % e == 0
    )


def run_emulated(
    exe: Path,
    tmp: Path,
    *,
    op: str,
    kernel: str,
    layers,
    ids: torch.Tensor,
    fmt: PackedFormat,
    head_start: int,
    packed: torch.Tensor,
    vector: bool | None = None,
    num_sms: int = 1,
    inline_ids: bool | None = None,
) -> None:
    """One launch_pack / launch_unpack under the emulator; writes the results back into the
    layers' caches and ``packed`` (all CPU tensors). ``inline_ids``: the block ids travel in
    the kernels' parameters (default: when they fit, as csrc/api.cpp does for host ids)
    or in memory of their own."""
    k = layers[0][0]
    storages = []  # each layer's whole cache as bytes
    for kl, vl in layers:
        assert kl.untyped_storage().data_ptr() == vl.untyped_storage().data_ptr(), (
            "K and V of a layer share one cache tensor"
        )
        storages.append(torch.empty(0, dtype=torch.uint8).set_(kl.untyped_storage()))
    elem = k.element_size()
    packed_dtype = getattr(torch, fmt.dtype)  # float8_e4m3fn when scaled
    if vector is None:
        vector = all(vector_ok(t, packed_dtype.itemsize) for pair in layers for t in pair)
    header = [
        0 if op == "pack" else 1,
        ops.KERNELS.index(kernel),
        DTYPE_CODES[k.dtype],
        DTYPE_CODES[packed_dtype],
        int(fmt.scaled),
        int(vector),
        len(layers),
        fmt.num_tokens,
        fmt.num_heads,
        fmt.head_dim,
        max(fmt.ct, 1),
        k.shape[1],
        head_start,
        *k.stride()[:3],
        ids.numel(),
        storages[0].numel(),
        fmt.nbytes,
        fmt.chunk_stride,
        fmt.scales_offset if fmt.scaled else -1,
        packed.numel(),
        num_sms,
        int(ids.numel() <= inline_limit(exe) if inline_ids is None else inline_ids),
    ]
    offsets = [t.storage_offset() * elem for pair in layers for t in pair]
    call, result = tmp / "call.bin", tmp / "out.bin"
    with open(call, "wb") as f:
        f.write(np.asarray(header + offsets, dtype=np.int64).tobytes())
        f.write(ids.to(torch.int64).numpy().tobytes())
        f.writelines(s.numpy().tobytes() for s in storages)
        f.write(packed.numpy().tobytes())
    r = subprocess.run(
        [str(exe), str(call), str(result)], check=False, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"emulated {op} ({kernel}) failed:\n{r.stderr[-4000:]}"
    data = np.fromfile(result, dtype=np.uint8)
    n = storages[0].numel()
    for i, s in enumerate(storages):
        s.copy_(torch.from_numpy(data[i * n : (i + 1) * n].copy()))
    packed.copy_(torch.from_numpy(data[len(storages) * n :].copy()))


def _same_region(got: torch.Tensor, want: torch.Tensor, fmt: PackedFormat, layers: int = 1) -> None:
    """Values and scales of every layer's region bit for bit (padding is unspecified)."""
    for i in range(layers):
        gv, gs = reference.region_rows(got[i * fmt.nbytes :], fmt)
        wv, ws = reference.region_rows(want[i * fmt.nbytes :], fmt)
        assert torch.equal(gv.contiguous().view(torch.uint8), wv.contiguous().view(torch.uint8)), (
            f"layer {i}: values differ"
        )
        if fmt.scaled:
            assert torch.equal(
                gs.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8)
            ), f"layer {i}: scales differ"


@pytest.fixture(params=ops.KERNELS)
def kernel(request) -> str:
    return request.param


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PACK_CASES = [
    # layout, dtype, block_size, heads, dim, num_tokens, head range, fp8, chunk_tokens, layers
    *[
        (lay, dt, 16, 2, 64, 40, None, fp8, 0, 1)
        for lay, dt, fp8 in itertools.product(("fused", "nhd", "hnd"), DTYPES, (False, True))
    ],
    (
        "nhd",
        torch.bfloat16,
        16,
        4,
        128,
        100,
        None,
        True,
        24,
        2,
    ),  # chunks of 24 over blocks of 16: tiles of 8
    ("hnd", torch.bfloat16, 16, 4, 128, 77, (1, 3), True, 16, 1),  # chunks of one block, head slice
    (
        "hnd",
        torch.float16,
        64,
        4,
        64,
        200,
        None,
        False,
        64,
        1,
    ),  # 64 tokens x 4 heads per block: tiles split to 128 rows
    ("nhd", torch.float16, 16, 1, 64, 150, None, False, 0, 1),  # one lane holds a whole row
    ("nhd", torch.bfloat16, 16, 2, 96, 50, None, True, 0, 1),  # 12 chunks per row: idle lanes
    (
        "nhd",
        torch.bfloat16,
        16,
        2,
        96,
        50,
        None,
        False,
        0,
        1,
    ),  # 12 chunks, 8 per lane: the tile kernel's checked path
    ("nhd", torch.float32, 16, 2, 256, 30, None, True, 0, 1),  # two chunks per lane
    ("nhd", torch.float32, 16, 1, 1024, 20, None, False, 0, 1),  # 256 chunks per row: 8 per lane
    (
        "nhd",
        torch.bfloat16,
        16,
        3,
        6,
        45,
        None,
        True,
        5,
        1,
    ),  # 12-byte rows: one element per access; gcd 1
    ("nhd", torch.float32, 8, 1, 1, 31, None, False, 0, 2),
    ("nhd", torch.float8_e4m3fn, 16, 4, 128, 50, None, False, 0, 1),  # FP8 cache: bytes as they are
    ("nhd", torch.bfloat16, 16, 4, 128, 0, None, True, 0, 1),  # nothing to do
    (
        "latent",
        torch.bfloat16,
        16,
        1,
        288,
        40,
        None,
        True,
        16,
        2,
    ),  # MLA: halves of 576, head stride != head_dim
    ("latent", torch.float32, 16, 1, 288, 40, None, False, 0, 1),
]


@pytest.mark.parametrize("layout,dtype,bs,heads,dim,tokens,hr,fp8,chunk,nlayers", PACK_CASES)
def test_pack_equals_reference(
    emulator, tmp_path, kernel, layout, dtype, bs, heads, dim, tokens, hr, fp8, chunk, nlayers
):
    nb = max(4, 2 * (tokens // bs + 1))
    layers = [
        planes(make_cache(layout, nb, bs, heads, dim, dtype, "cpu", seed=tokens + dim + i), layout)
        for i in range(nlayers)
    ]
    ids = block_ids(nb, -(-tokens // bs), seed=bs)
    want, fmt = ops.pack(layers, ids, tokens, heads=hr, fp8=fp8, chunk_tokens=chunk)
    got = torch.full((max(want.numel(), 16),), 0x5A, dtype=torch.uint8)
    run_emulated(
        emulator,
        tmp_path,
        op="pack",
        kernel=kernel,
        layers=layers,
        ids=ids,
        fmt=fmt,
        head_start=hr[0] if hr else 0,
        packed=got,
    )
    _same_region(got, want, fmt, nlayers)


UNPACK_CASES = [
    # source (layout, dtype, bs), destination (layout, dtype, bs), heads: src, dst, packed range,
    # dst offset; fp8, chunk
    *[
        ((lay, dt, 16), (lay, dt, 16), 2, 2, None, 0, fp8, 0)
        for lay, dt, fp8 in itertools.product(("fused", "nhd", "hnd"), DTYPES, (False, True))
    ],
    (
        ("nhd", torch.bfloat16, 16),
        ("hnd", torch.float16, 32),
        4,
        4,
        None,
        0,
        True,
        16,
    ),  # layout, dtype, block size, chunks
    (
        ("fused", torch.float32, 16),
        ("nhd", torch.bfloat16, 32),
        2,
        2,
        None,
        0,
        False,
        0,
    ),  # conversions
    (("nhd", torch.bfloat16, 16), ("nhd", torch.float32, 16), 2, 2, None, 0, False, 24),
    (("hnd", torch.float16, 16), ("nhd", torch.bfloat16, 16), 2, 2, None, 0, False, 0),
    (
        ("nhd", torch.bfloat16, 16),
        ("nhd", torch.bfloat16, 16),
        4,
        2,
        (2, 4),
        0,
        True,
        0,
    ),  # TP 1 -> 2, rank 1
    (
        ("nhd", torch.bfloat16, 16),
        ("nhd", torch.bfloat16, 32),
        2,
        4,
        None,
        2,
        True,
        0,
    ),  # TP 2 -> 1, rank 1
    (("nhd", torch.float8_e4m3fn, 16), ("hnd", torch.float8_e4m3fn, 32), 4, 4, None, 0, False, 0),
    (
        ("nhd", torch.bfloat16, 16),
        ("nhd", torch.bfloat16, 16),
        3,
        3,
        None,
        0,
        True,
        5,
    ),  # dim 6: one element per access
    (
        ("hnd", torch.float16, 16),
        ("nhd", torch.float16, 16),
        2,
        2,
        None,
        0,
        False,
        0,
    ),  # dim 96 copy: partial lanes
    (
        ("latent", torch.float32, 16),
        ("latent", torch.bfloat16, 32),
        1,
        1,
        None,
        0,
        True,
        16,
    ),  # MLA halves of 576
]


@pytest.mark.parametrize("src,dst,src_heads,dst_heads,hr,offset,fp8,chunk", UNPACK_CASES)
def test_unpack_equals_reference(
    emulator, tmp_path, kernel, src, dst, src_heads, dst_heads, hr, offset, fp8, chunk
):
    (sl, sdt, sbs), (dl, ddt, dbs) = src, dst
    # head_dim 6 for 3 heads (one-element accesses), 96 for float16 copies (12 chunks of 8:
    # lanes left partly idle), else 64
    dim, tokens = (
        {3: 6, 2: 96 if sdt == ddt == torch.float16 else 64, 1: 288}.get(src_heads, 64),
        111,
    )
    snb, dnb = 2 * (tokens // sbs + 1), 2 * (tokens // dbs + 1)
    sk, sv = planes(make_cache(sl, snb, sbs, src_heads, dim, sdt, "cpu", seed=1), sl)
    region, fmt = ops.pack(
        (sk, sv),
        block_ids(snb, -(-tokens // sbs), 2),
        tokens,
        heads=hr,
        fp8=fp8,
        chunk_tokens=chunk,
    )
    dids = block_ids(dnb, -(-tokens // dbs), 3)
    want = make_cache(dl, dnb, dbs, dst_heads, dim, ddt, "cpu", seed=4)
    got = want.clone()
    reference.unpack(region, fmt, [planes(want, dl)], dids, offset)
    run_emulated(
        emulator,
        tmp_path,
        op="unpack",
        kernel=kernel,
        layers=[planes(got, dl)],
        ids=dids,
        fmt=fmt,
        head_start=offset,
        packed=region.clone(),
    )
    # the whole cache: written rows equal the reference, the rest untouched
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_sms", [1, 132])
def test_many_layers_and_grid_sizes(emulator, tmp_path, kernel, fp8, num_sms):
    """Five layers in one launch; a grid of 8 blocks that loops over the work, or one
    block per 8 warps of work."""
    layers = [
        planes(make_cache("hnd", 20, 16, 2, 128, torch.bfloat16, "cpu", seed=s), "hnd")
        for s in range(5)
    ]
    ids = block_ids(20, 8, 7)
    want, fmt = ops.pack(layers, ids, 120, fp8=fp8, chunk_tokens=16)
    got = torch.zeros_like(want)
    run_emulated(
        emulator,
        tmp_path,
        op="pack",
        kernel=kernel,
        layers=layers,
        ids=ids,
        fmt=fmt,
        head_start=0,
        packed=got,
        num_sms=num_sms,
    )
    _same_region(got, want, fmt, 5)
    dst = [make_cache("nhd", 10, 32, 2, 128, torch.float32, "cpu", seed=s) for s in range(5)]
    ref = [d.clone() for d in dst]
    reference.unpack(want, fmt, [planes(r, "nhd") for r in ref], block_ids(10, 4, 8), 0)
    run_emulated(
        emulator,
        tmp_path,
        op="unpack",
        kernel=kernel,
        layers=[planes(d, "nhd") for d in dst],
        ids=block_ids(10, 4, 8),
        fmt=fmt,
        head_start=0,
        packed=want.clone(),
        num_sms=num_sms,
    )
    assert all(
        torch.equal(d.view(torch.uint8), r.view(torch.uint8)) for d, r in zip(dst, ref, strict=True)
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_every_partial_last_pass(emulator, tmp_path, kernel, fp8):
    """3 heads and 33..47 tokens: the clipped last block holds 3..45 rows, every residue
    modulo the rows a warp moves per pass (16 for copies, 8 for FP8 at head_dim 128), so
    each kernel's bounds-checked last pass meets every count of missing rows."""
    cache = make_cache("nhd", 8, 16, 3, 128, torch.bfloat16, "cpu", seed=11)
    ids = block_ids(8, 3, 4)
    for tokens in range(33, 48):
        want, fmt = ops.pack(planes(cache, "nhd"), ids, tokens, fp8=fp8)
        got = torch.zeros_like(want)
        run_emulated(
            emulator,
            tmp_path,
            op="pack",
            kernel=kernel,
            layers=[planes(cache, "nhd")],
            ids=ids,
            fmt=fmt,
            head_start=0,
            packed=got,
        )
        _same_region(got, want, fmt)
        dst = make_cache("hnd", 8, 16, 3, 128, torch.float16, "cpu", seed=12)
        ref = dst.clone()
        reference.unpack(want, fmt, [planes(ref, "hnd")], ids, 0)
        run_emulated(
            emulator,
            tmp_path,
            op="unpack",
            kernel=kernel,
            layers=[planes(dst, "hnd")],
            ids=ids,
            fmt=fmt,
            head_start=0,
            packed=want.clone(),
        )
        assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8)), f"{tokens} tokens"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("inline_ids", [True, False])
def test_block_ids_inline_or_in_memory(emulator, tmp_path, kernel, fp8, inline_ids):
    """As many block ids as the kernel parameters hold (the last block partly filled),
    read from the parameters or from memory of their own: the reference's bytes both
    ways, pack and unpack."""
    n = inline_limit(emulator)
    cache = make_cache("nhd", n + 5, 2, 1, 16, torch.bfloat16, "cpu", seed=21)
    ids = block_ids(n + 5, n, 22)
    want, fmt = ops.pack(planes(cache, "nhd"), ids, 2 * n - 1, fp8=fp8)
    got = torch.zeros_like(want)
    run_emulated(
        emulator,
        tmp_path,
        op="pack",
        kernel=kernel,
        layers=[planes(cache, "nhd")],
        ids=ids,
        fmt=fmt,
        head_start=0,
        packed=got,
        inline_ids=inline_ids,
    )
    _same_region(got, want, fmt)
    dst = make_cache("nhd", n + 5, 2, 1, 16, torch.float32, "cpu", seed=23)
    ref = dst.clone()
    reference.unpack(want, fmt, [planes(ref, "nhd")], ids.flip(0), 0)
    run_emulated(
        emulator,
        tmp_path,
        op="unpack",
        kernel=kernel,
        layers=[planes(dst, "nhd")],
        ids=ids.flip(0),
        fmt=fmt,
        head_start=0,
        packed=want.clone(),
        inline_ids=inline_ids,
    )
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("fp8", [False, True])
def test_one_element_accesses_equal_vector_ones(emulator, tmp_path, kernel, fp8):
    """The launchers' non-vector path (taken for unaligned views) on shapes that also
    allow 16-byte accesses: same bytes as the reference."""
    layers = [planes(make_cache("nhd", 12, 16, 2, 64, torch.float16, "cpu", seed=3), "nhd")]
    ids = block_ids(12, 5, 1)
    want, fmt = ops.pack(layers, ids, 70, heads=(1, 2), fp8=fp8)
    got = torch.zeros_like(want)
    run_emulated(
        emulator,
        tmp_path,
        op="pack",
        kernel=kernel,
        layers=layers,
        ids=ids,
        fmt=fmt,
        head_start=1,
        packed=got,
        vector=False,
    )
    _same_region(got, want, fmt)


def test_emulator_catches_divergent_shuffles(tmp_path):
    """The emulator's own check: a kernel whose lanes shuffle a different number of
    times fails the call (so warp-uniformity of the real kernels is really checked)."""
    cxx, inc = toolchain()
    src = tmp_path / "diverge.cpp"
    src.write_text(
        "#include <cstdio>\n"
        "void k(int skip) { float x = threadIdx.x; if ((int)(threadIdx.x & 31) != skip) x = "
        "__shfl_xor_sync(0xffffffffu, x, 1);"
        " (void)x; }\n"
        "int main(int argc, char**) { kvb_emu::launch(1, 64, 0, nullptr, [=] { k(argc > 1 ? 3 : "
        "-1); });\n"
        '  std::printf("%s\\n", kvb_emu::first_error().c_str()); return 0; }\n'
    )
    exe = tmp_path / "diverge"
    subprocess.run(
        [
            cxx,
            "-std=c++20",
            "-O1",
            "-pthread",
            "-include",
            str(NATIVE / "warp_emu.h"),
            *(f"-I{d}" for d in inc),
            str(src),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
    )
    assert (
        subprocess.run(
            [str(exe)], check=False, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        == ""
    )
    out = subprocess.run(
        [str(exe), "diverge"], check=False, capture_output=True, text=True, timeout=60
    ).stdout
    assert "not warp-uniform" in out
