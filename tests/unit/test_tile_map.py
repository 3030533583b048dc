"""The tile kernels' index math (csrc/tile_map.h), compiled for the host: every row of
a call is visited exactly once, at the addresses csrc/PACKED_FORMAT.md gives (computed
here from kvbridge.ops.format, independently of the header), and FastDiv divides
exactly. The kernels themselves are checked against the reference on a GPU
(tests/gpu/test_kernels.py); this part needs only a C++ compiler."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge import ops
from kvbridge.ops.format import PackedFormat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> ctypes.CDLL:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH (apt-get install g++)")
    lib = tmp_path_factory.mktemp("tile_map") / "tile_map_shim.so"
    subprocess.run(
        [
            cxx,
            "-O2",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tests/unit/native/tile_map_shim.cpp"),
            "-o",
            str(lib),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    so = ctypes.CDLL(str(lib))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    so.kvb_fastdiv.argtypes = [ctypes.c_uint32, ptr, ptr, i64]
    so.kvb_fastdiv.restype = None
    so.kvb_tile_rows.argtypes = [i32] * 7 + [i64] * 6 + [ptr, ptr, i64]
    so.kvb_tile_rows.restype = i64
    so.kvb_tile_tokens.argtypes = [i32] * 4
    so.kvb_tile_tokens.restype = i32
    return so


def test_fastdiv_divides_exactly(shim):
    rng = np.random.default_rng(0)
    divisors = {
        *range(1, 300),
        *(1 << k for k in range(31)),
        *((1 << k) + 1 for k in range(31)),
        *((1 << k) - 1 for k in range(2, 32)),
        *rng.integers(1, 1 << 31, 200).tolist(),
    }
    n = np.concatenate(
        [np.arange(0, 5000), (1 << 31) - 1 - np.arange(0, 5000), rng.integers(0, 1 << 31, 20000)]
    ).astype(np.uint32)
    q = np.empty_like(n)
    for d in sorted(divisors):
        shim.kvb_fastdiv(d, n.ctypes.data, q.ctypes.data, n.size)
        expected = n // np.uint32(d)
        bad = np.flatnonzero(q != expected)
        assert bad.size == 0, f"{n[bad[0]]} / {d}: got {q[bad[0]]}, expected {expected[bad[0]]}"


def _spec_rows(
    fmt: PackedFormat, layers: int, k: torch.Tensor, ids: list[int], head_start: int
) -> np.ndarray:
    """(layer, plane, paged element offset, values byte, scale byte) of every row, from
    the format and the planes' strides (scale column 0 for unscaled regions)."""
    sb, st, sh = k.stride(0), k.stride(1), k.stride(2)
    bs, ct, nh = k.shape[1], max(fmt.ct, 1), fmt.num_heads
    rows = []
    for layer, p, t, h in itertools.product(
        range(layers), range(2), range(fmt.num_tokens), range(nh)
    ):
        c, u = divmod(t, ct)
        r = (p * ct + u) * nh + h
        chunk = layer * fmt.nbytes + c * fmt.chunk_stride
        rows.append(
            (
                layer,
                p,
                ids[t // bs] * sb + (t % bs) * st + (head_start + h) * sh,
                chunk + r * fmt.head_dim * fmt.element_size,
                chunk + fmt.scales_offset + 4 * r if fmt.scaled else 0,
            )
        )
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


CASES = [
    # layout, num_blocks, block_size, heads, dim, num_tokens, head range, fp8, chunk_tokens, layers
    ("nhd", 8, 16, 4, 8, 100, None, False, 0, 1),
    ("nhd", 8, 16, 4, 8, 100, None, True, 16, 2),
    ("nhd", 8, 16, 4, 8, 77, (1, 3), True, 24, 3),  # chunks of 24 over blocks of 16: tiles of 8
    ("hnd", 8, 16, 4, 8, 128, None, False, 16, 2),
    ("hnd", 6, 32, 3, 8, 150, (1, 2), True, 0, 1),
    ("fused", 8, 16, 2, 8, 61, None, True, 5, 2),  # gcd(16, 5) = 1: one token per tile
    ("nhd", 40, 1, 2, 4, 33, None, False, 4, 1),
    ("nhd", 8, 16, 8, 4, 1, (7, 8), True, 16, 1),
    ("nhd", 8, 16, 8, 4, 0, None, True, 16, 2),
    (
        "nhd",
        6,
        64,
        8,
        4,
        256,
        None,
        True,
        0,
        2,
    ),  # 64-token tiles of 8 heads: split into 16-token tiles
    ("hnd", 6, 64, 3, 4, 300, None, False, 48, 1),  # gcd 16 x 3 heads: within the cap
    (
        "nhd",
        8,
        16,
        4,
        8,
        101,
        None,
        False,
        0,
        1,
    ),  # one chunk: tiles of a block whatever the token count
]


@pytest.mark.parametrize("layout,nb,bs,heads,dim,tokens,hr,fp8,chunk,layers", CASES)
def test_tiles_visit_every_row_once_at_its_format_address(
    shim, layout, nb, bs, heads, dim, tokens, hr, fp8, chunk, layers
):
    shape = {
        "nhd": (2, nb, bs, heads, dim),
        "hnd": (2, nb, heads, bs, dim),
        "fused": (nb, heads, bs, 2 * dim),
    }[layout]
    k, _ = ops.kv_planes(torch.zeros(shape, dtype=torch.bfloat16), layout)
    h0, h1 = hr or (0, heads)
    fmt = ops.packed_format(k, tokens, (h0, h1), fp8, chunk)
    ids = np.random.default_rng(tokens).permutation(nb)[: -(-tokens // bs)].astype(np.int64)
    want = _spec_rows(fmt, layers, k, ids.tolist(), h0)
    capacity = max(len(want), 1) + 8
    out = np.full((capacity, 5), -7, dtype=np.int64)
    n = shim.kvb_tile_rows(
        layers,
        tokens,
        h1 - h0,
        h0,
        bs,
        max(fmt.ct, 1),
        fmt.head_dim * fmt.element_size,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        fmt.nbytes,
        fmt.chunk_stride,
        fmt.scales_offset if fmt.scaled else -1,
        ids.ctypes.data,
        out.ctypes.data,
        capacity,
    )
    assert n == len(want), f"visited {n} rows, the call has {len(want)}"
    got = out[:n].copy()
    if not fmt.scaled:
        got[:, 4] = 0
    assert np.array_equal(_sorted_rows(got), _sorted_rows(want))
    assert len(np.unique(got[:, 3])) == n  # no row written twice


def _sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort(a.T[::-1])]


@pytest.mark.parametrize(
    "tokens,heads,block,chunk,tile",
    [
        (1001, 8, 16, 1001, 16),  # one chunk: the blocks alone decide (not gcd(16, 1001) = 1)
        (1000, 8, 16, 2000, 16),
        (7, 8, 16, 7, 16),
        (1001, 8, 16, 16, 16),  # chunks of a block
        (1001, 8, 16, 24, 8),  # chunks of 24 over blocks of 16: tiles must not cross either
        (1001, 8, 64, 1001, 16),  # 64 x 8 rows halved to 128 rows
        (1001, 1, 64, 1001, 64),
        (1001, 3, 45, 1001, 45),  # 135 rows, odd: not halved
    ],
)
def test_tile_size(shim, tokens, heads, block, chunk, tile):
    assert shim.kvb_tile_tokens(tokens, heads, block, chunk) == tile


def test_tile_map_refuses_rows_beyond_31_bits_in_a_block(shim):
    out = np.zeros((4, 5), dtype=np.int64)
    ids = np.zeros(1, dtype=np.int64)
    n = shim.kvb_tile_rows(
        1, 2, 1, 0, 2, 2, 16, 1 << 40, 1 << 31, 8, 64, 64, -1, ids.ctypes.data, out.ctypes.data, 4
    )
    assert n == -1
