// Host-side entry points to csrc/tile_map.h for tests/unit/test_tile_map.py (ctypes):
// the tile kernels' index math, compiled by the system C++ compiler, no GPU.
#include <cstdint>

#include "tile_map.h"

extern "C" {

// q[i] = n[i] / d by FastDiv(d).
void kvb_fastdiv(uint32_t d, const uint32_t* n, uint32_t* q, int64_t count) {
  const kvbridge::FastDiv f(d);
  for (int64_t i = 0; i < count; ++i) q[i] = f.div(n[i]);
}

// Every row the tile kernels visit, in visiting order, as (layer, plane, paged element
// offset, values byte offset, scale byte offset); returns the number of rows, -1 when
// make_tile_map refuses the strides, -2 when `capacity` rows are not enough.
int64_t kvb_tile_rows(int layers, int num_tokens, int num_heads, int head_start, int block_size, int chunk_tokens,
                      int row_bytes, int64_t stride_block, int64_t stride_token, int64_t stride_head,
                      int64_t region_bytes, int64_t chunk_bytes, int64_t scales_offset, const int64_t* block_ids,
                      int64_t* out, int64_t capacity) {
  kvbridge::TileMap m;
  if (!kvbridge::make_tile_map(m, layers, num_tokens, num_heads, head_start, block_size, chunk_tokens, row_bytes,
                               stride_block, stride_token, stride_head, region_bytes, chunk_bytes, scales_offset))
    return -1;
  int64_t n = 0;
  for (int i = 0; i < m.num_tiles; ++i) {
    const kvbridge::Tile t = m.tile(i, block_ids);
    for (int r = 0; r < t.rows; ++r, ++n) {
      if (n >= capacity) return -2;
      int64_t* row = out + 5 * n;
      row[0] = t.layer;
      row[1] = t.plane;
      row[2] = t.paged + m.paged_row(r);
      row[3] = t.values + static_cast<int64_t>(r) * m.row_bytes;
      row[4] = t.scales + 4 * static_cast<int64_t>(r);
    }
  }
  return n;
}

// Tokens per tile of a call (before clipping to num_tokens), with strides that fit.
int kvb_tile_tokens(int num_tokens, int num_heads, int block_size, int chunk_tokens) {
  kvbridge::TileMap m;
  const int64_t stride_head = 8, stride_token = stride_head * num_heads;
  if (!kvbridge::make_tile_map(m, 1, num_tokens, num_heads, 0, block_size, chunk_tokens, 16,
                               stride_token * block_size, stride_token, stride_head, 0, 0, -1))
    return -1;
  return m.tile_tokens;
}
}
