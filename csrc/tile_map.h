// kvbridge: where the tile kernels of csrc/kv_pack.cu read and write, as plain C++ that
// compiles for the host too (tests/unit/test_tile_map.py builds it with the system
// compiler and checks every address against kvbridge/ops/format.py, no GPU needed).
//
// A *tile* is one plane (K or V) of one layer over a run of tokens that lies inside one
// cache block and one packed chunk: tokens [i * g, i * g + g) with g a divisor of
// gcd(block_size, chunk_tokens), or of block_size when the region is a single chunk
// (halved while a tile has more than kTileRows rows, so that big blocks still give every
// warp a tile), clipped to num_tokens. Its rows, (token, head) in that order, are
// consecutive rows of the packed chunk, so a tile costs one block-id lookup and a few
// divisions, and each of its rows a multiply-high (FastDiv) and two multiply-adds,
// where the row kernel spends four integer divisions per row.
#pragma once

#include <cstdint>
#include <numeric>

#if defined(__CUDACC__)
#define KVB_HD __host__ __device__ __forceinline__
#else
#define KVB_HD inline
#endif

namespace kvbridge {

// Rows (tokens x heads) above which a tile is split, when its token count is even.
constexpr int kTileRows = 128;

// n / d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 fixed on the host: a multiply-high,
// an add and a shift (Granlund and Montgomery's round-up method; (mulhi + n) cannot
// overflow 32 bits because mulhi <= n < 2^31).
struct FastDiv {
  uint32_t d = 1;
  uint32_t m = 1;
  uint32_t s = 0;

  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << s) - d) / d + 1);
  }

  KVB_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, m);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * m) >> 32);
#endif
    return (hi + n) >> s;
  }
};

// One tile: which planes, how many rows, where its first row is on each side.
struct Tile {
  int layer;
  int plane;          // 0 = K, 1 = V
  int rows;           // tokens in the tile x num_heads
  int64_t paged;      // element offset of the first row (token, head_start) in the plane
  int64_t values;     // byte offset of the first row's values from the packed base
  int64_t scales;     // byte offset of the first row's scale (scaled regions only)
};

struct TileMap {
  int num_tiles;        // layers x 2 x tiles_per_plane
  int tile_tokens;      // g: divides block_size and chunk_tokens
  int num_tokens;
  int num_heads;
  int head_start;
  int chunk_tokens;
  int block_size;
  int row_bytes;        // head_dim x packed element size
  int64_t stride_block;  // paged strides, elements
  int stride_token;      // a block's rows are within 2^31 elements of its first
  int stride_head;
  int64_t region_bytes;
  int64_t chunk_bytes;
  int64_t scales_offset;
  FastDiv per_layer;     // 2 x tiles_per_plane
  FastDiv per_plane;     // tiles_per_plane
  FastDiv by_block;      // block_size
  FastDiv by_chunk;      // chunk_tokens
  FastDiv by_heads;      // num_heads

  // Tile `i` (0 <= i < num_tiles); `block_ids[j]` is the request's j-th block (a
  // pointer, or kv_pack.h's BlockIds).
  template <class Ids>
  KVB_HD Tile tile(int i, const Ids& block_ids) const {
    Tile t;
    t.layer = static_cast<int>(per_layer.div(i));
    const int in_layer = i - t.layer * static_cast<int>(per_layer.d);
    t.plane = in_layer >= static_cast<int>(per_plane.d);
    const int t0 = (in_layer - t.plane * static_cast<int>(per_plane.d)) * tile_tokens;
    const int n = num_tokens - t0 < tile_tokens ? num_tokens - t0 : tile_tokens;
    t.rows = n * num_heads;
    const int j = static_cast<int>(by_block.div(t0));
    const int c = static_cast<int>(by_chunk.div(t0));
    t.paged = block_ids[j] * stride_block + static_cast<int64_t>(t0 - j * block_size) * stride_token +
              static_cast<int64_t>(head_start) * stride_head;
    const int64_t chunk = t.layer * region_bytes + c * chunk_bytes;
    const int64_t row0 = (static_cast<int64_t>(t.plane) * chunk_tokens + (t0 - c * chunk_tokens)) * num_heads;
    t.values = chunk + row0 * row_bytes;
    t.scales = chunk + scales_offset + row0 * 4;
    return t;
  }

  // Element offset of row `r` (0 <= r < t.rows) of a tile from the tile's first row
  // (t.paged); the row's values are at t.values + r * row_bytes, its scale at
  // t.scales + 4 * r.
  KVB_HD int paged_row(int r) const {
    const int dt = static_cast<int>(by_heads.div(r));
    return dt * stride_token + (r - dt * num_heads) * stride_head;
  }
};

// The map of a call: `layers` layers of `num_tokens` tokens (heads [head_start, +num_heads)
// of planes with the given element strides and block size) into regions of
// `chunk_tokens` tokens per chunk (>= 1) laid out as csrc/PACKED_FORMAT.md says. The
// caller has checked that every row index of the call fits 31 bits. Returns false (and
// leaves `m` unusable) when a row's offset within its block does not fit 31 bits.
inline bool make_tile_map(TileMap& m, int layers, int num_tokens, int num_heads, int head_start, int block_size,
                          int chunk_tokens, int row_bytes, int64_t stride_block, int64_t stride_token,
                          int64_t stride_head, int64_t region_bytes, int64_t chunk_bytes, int64_t scales_offset) {
  const int64_t last = (block_size - 1) * stride_token + (num_heads - 1) * stride_head;
  if (stride_token < 0 || stride_head < 0 || last >= (int64_t{1} << 31)) return false;
  // one chunk (chunk_tokens >= num_tokens) has no boundary to respect: tiles follow the
  // blocks, whatever num_tokens is (the gcd with it would make 1-token tiles of odd counts)
  m.tile_tokens = chunk_tokens >= num_tokens ? block_size : std::gcd(block_size, chunk_tokens);
  while (m.tile_tokens % 2 == 0 && static_cast<int64_t>(m.tile_tokens) * num_heads > kTileRows) m.tile_tokens /= 2;
  const int per_plane = (num_tokens + m.tile_tokens - 1) / m.tile_tokens;
  m.num_tiles = layers * 2 * per_plane;
  m.num_tokens = num_tokens;
  m.num_heads = num_heads;
  m.head_start = head_start;
  m.chunk_tokens = chunk_tokens;
  m.block_size = block_size;
  m.row_bytes = row_bytes;
  m.stride_block = stride_block;
  m.stride_token = static_cast<int>(stride_token);
  m.stride_head = static_cast<int>(stride_head);
  m.region_bytes = region_bytes;
  m.chunk_bytes = chunk_bytes;
  m.scales_offset = scales_offset;
  m.per_layer = FastDiv(static_cast<uint32_t>(2 * (per_plane > 0 ? per_plane : 1)));
  m.per_plane = FastDiv(static_cast<uint32_t>(per_plane > 0 ? per_plane : 1));
  m.by_block = FastDiv(static_cast<uint32_t>(block_size));
  m.by_chunk = FastDiv(static_cast<uint32_t>(chunk_tokens));
  m.by_heads = FastDiv(static_cast<uint32_t>(num_heads));
  return true;
}

}  // namespace kvbridge
