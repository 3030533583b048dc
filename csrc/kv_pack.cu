// kvbridge: fused pack / unpack of one layer's paged KV (gather or scatter, head slice,
// dtype conversion, float8 e4m3 quantization with per-(plane, token, head) scales).
//
// Work split. A *row* is one (plane, token, head): head_dim elements, contiguous in the
// packed region (row r starts at element r * head_dim) and in every supported cache
// layout. A row is cut into chunks of E elements (16 bytes on the wider side when the
// addresses allow, else one element); a group of L lanes (a power of two <= 32) owns a
// row, each lane C chunks of it (C = 1, or 8 for rows wider than 32 chunks). Each thread
// keeps kItems chunks in flight: R = kItems/C rows per group per iteration, so every
// load of an iteration is issued before the first store. Layers are rows too: one
// launch moves every layer of a call. The loop over rows is warp-uniform, so the per-row max reduction for the
// scales can use full-warp shuffles.
//
// Rounding matches kvbridge/ops/reference.py bit for bit: float32 IEEE arithmetic (this
// file must not be built with --use_fast_math), round-to-nearest-even conversions.

#include "kv_pack.h"
#include "tile_map.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

namespace kvbridge {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int kMaxChunksPerLane = 8;
constexpr float kFp8Max = 448.f;

template <int BYTES> struct Raw;
template <> struct Raw<16> { using type = uint4; };
template <> struct Raw<8> { using type = uint2; };
template <> struct Raw<4> { using type = uint32_t; };
template <> struct Raw<2> { using type = uint16_t; };
template <> struct Raw<1> { using type = uint8_t; };

struct F32 {
  using bits = uint32_t;
  static __device__ __forceinline__ float to_f(bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ bits from_f(float f) { return __float_as_uint(f); }
};
struct F16 {
  using bits = uint16_t;
  static __device__ __forceinline__ float to_f(bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ bits from_f(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct BF16 {
  using bits = uint16_t;
  static __device__ __forceinline__ float to_f(bits b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  static __device__ __forceinline__ bits from_f(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
struct F8 {
  using bits = uint8_t;
  static __device__ __forceinline__ float to_f(bits b) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
  }
  static __device__ __forceinline__ bits from_f(float f) {
    return static_cast<bits>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
  }
};

// E elements of type T, loadable as one access of E * sizeof(T::bits) bytes.
template <class T, int E>
union Chunk {
  typename Raw<E * sizeof(typename T::bits)>::type raw;
  typename T::bits e[E];
};

enum Mode : int { kCopy = 0, kConvert = 1, kQuantize = 2, kDequantize = 3 };

// Chunks a thread keeps in flight per iteration. Converting modes hold fewer, so that
// more warps fit an SM and hide each other's compute phase (measured on an H100: FP8
// pack gained from more warps, while capping registers instead made it spill).
constexpr int items_for(int mode, int chunks_per_lane) {
  return chunks_per_lane > (mode == kCopy ? kItems : kItems / 2) ? chunks_per_lane : (mode == kCopy ? kItems : kItems / 2);
}

struct Geometry {
  int lanes_log2;   // L = 1 << lanes_log2 lanes per row
  int nchunks;      // head_dim / E
  int layer_rows;   // 2 * num_tokens * num_heads
  int rows;         // num_layers * layer_rows
};

// A row of one layer: where it starts in the paged planes (element offset of head_dim
// chunk 0), which plane (K = 0, V = 1), and where it starts in the layer's region
// (byte offset of its values, and of its scale).
struct RowPlace {
  int64_t paged;
  int plane;
  int64_t values_byte;
  int64_t scale_byte;
};

template <int VALUE_BYTES>
__device__ __forceinline__ RowPlace place_row(const Paged& p, const Packed& k, const Shape& s, int row) {
  RowPlace r;
  const int per_plane = s.num_tokens * s.num_heads;
  r.plane = row >= per_plane;
  const int rem = row - r.plane * per_plane;
  const int t = rem / s.num_heads;
  const int h = rem - t * s.num_heads;
  const int j = t / p.block_size;
  const int64_t blk = p.block_ids[j];  // warp-uniform branch: inline or device ids
  r.paged = blk * p.stride_block + static_cast<int64_t>(t - j * p.block_size) * p.stride_token +
            static_cast<int64_t>(p.head_start + h) * p.stride_head;
  const int c = t / s.chunk_tokens;
  const int64_t in_chunk = (static_cast<int64_t>(r.plane) * s.chunk_tokens + (t - c * s.chunk_tokens)) * s.num_heads + h;
  r.values_byte = c * k.chunk_bytes + in_chunk * s.head_dim * VALUE_BYTES;
  r.scale_byte = c * k.chunk_bytes + k.scales_offset + in_chunk * 4;
  return r;
}

// Moves R rows (one per lane group; this lane's chunks gl, gl + L, ..., C of them): the
// loads of every row first, then the scale of each row (quantize: max over the group's
// lanes; dequantize: read), then the stores. src[r] == nullptr: no row r. `scale[r]`: the
// row's float32 scale in the packed region (quantize writes it from lane 0 of the group).
// Warp-uniform control flow (the reduction shuffles over the full warp). FULL: every row
// is there and L * C == nchunks, so nothing is checked.
template <class In, class Out, int MODE, int E, int C, int R, bool FULL>
__device__ __forceinline__ void move_rows(const typename In::bits* const (&src)[R], typename Out::bits* const (&dst)[R],
                                          float* const (&scale)[R], int gl, int L, int nchunks) {
  using InChunk = Chunk<In, E>;
  using OutChunk = Chunk<Out, E>;
  using OutElem = typename Out::bits;
  constexpr int ITEMS = R * C;
  InChunk in[ITEMS];
  OutElem* out_at[ITEMS];  // nullptr: no item
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const int i = r * C + j;
      const int chunk = gl + j * L;
      out_at[i] = nullptr;
      if (FULL || (src[r] != nullptr && chunk < nchunks)) {
        in[i].raw = *reinterpret_cast<const decltype(in[i].raw)*>(src[r] + chunk * E);
        out_at[i] = dst[r] + chunk * E;
      }
    }
  }

  float factor[R];  // per row: 448 / amax (quantize) or the row's scale (dequantize)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    factor[r] = 0.f;
    if (MODE == kQuantize) {
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        if (FULL || out_at[r * C + j] != nullptr) {
#pragma unroll
          for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(In::to_f(in[r * C + j].e[e])));
        }
      }
      for (int o = L >> 1; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      factor[r] = amax > 0.f ? kFp8Max / amax : 0.f;
      if (gl == 0 && (FULL || src[r] != nullptr)) *scale[r] = amax / kFp8Max;
    } else if (MODE == kDequantize) {
      if (FULL || src[r] != nullptr) factor[r] = *scale[r];
    }
  }

#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!FULL && out_at[i] == nullptr) continue;
    OutChunk out;
    if constexpr (MODE == kCopy) {
      out.raw = reinterpret_cast<const decltype(out.raw)&>(in[i].raw);
    } else if constexpr (MODE == kQuantize && E % 4 == 0) {
      // one cvt for two values (same rounding as one by one), two cvts per 32-bit word
      uint32_t word[E / 4];
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        const float f = factor[i / C];
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(In::to_f(in[i].e[e]) * f, In::to_f(in[i].e[e + 1]) * f),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(In::to_f(in[i].e[e + 2]) * f, In::to_f(in[i].e[e + 3]) * f), __NV_SATFINITE, __NV_E4M3);
        word[e / 4] = lo | hi << 16;
      }
      memcpy(&out.raw, word, sizeof(word));
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float x = In::to_f(in[i].e[e]);
        if (MODE == kQuantize || MODE == kDequantize) x = x * factor[i / C];
        out.e[e] = Out::from_f(x);
      }
    }
    *reinterpret_cast<decltype(out.raw)*>(out_at[i]) = out.raw;
  }
}

// The lane's place in its warp: L lanes per row (a power of two), G = 32 / L groups;
// `group` is this lane's row in the warp, `gl` its lane within the row.
struct Lanes {
  int L, G, group, gl;
  __device__ __forceinline__ explicit Lanes(int lanes) {
    const int lane = threadIdx.x & 31;
    L = lanes;
    G = 32 / lanes;
    group = lane / lanes;
    gl = lane % lanes;
  }
};

// Row kernel: C chunks per lane, R = ITEMS / C rows per lane group and iteration; all
// compile-time so that the per-item bookkeeping stays in registers. Each row's place
// is computed from its global index (four integer divisions).
template <class In, class Out, int MODE, int E, int C, bool PACK>
__global__ void __launch_bounds__(kThreads) rows_kernel(Paged paged, Packed packed, Shape shape, Geometry geo) {
  using InElem = typename In::bits;
  using OutElem = typename Out::bits;
  using PackedElem = typename std::conditional<PACK, OutElem, InElem>::type;
  constexpr int R = items_for(MODE, C) / C;

  const Lanes ln(1 << geo.lanes_log2);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  const int64_t step = static_cast<int64_t>(gridDim.x) * (kThreads / 32) * ln.G * R;

  for (int64_t base = warp * ln.G * R; base < geo.rows; base += step) {  // warp-uniform
    const InElem* src[R];
    OutElem* dst[R];
    float* scale[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row64 = base + static_cast<int64_t>(r) * ln.G + ln.group;
      src[r] = nullptr;
      dst[r] = nullptr;
      scale[r] = nullptr;
      if (row64 < geo.rows) {
        const int layer = static_cast<int>(row64) / geo.layer_rows;
        const int row = static_cast<int>(row64) - layer * geo.layer_rows;
        const RowPlace pl = place_row<sizeof(PackedElem)>(paged, packed, shape, row);
        char* region = static_cast<char*>(packed.base) + layer * packed.region_bytes;
        PackedElem* values = reinterpret_cast<PackedElem*>(region + pl.values_byte);
        scale[r] = reinterpret_cast<float*>(region + pl.scale_byte);
        if (PACK) {
          src[r] = static_cast<const InElem*>(pl.plane ? paged.v[layer] : paged.k[layer]) + pl.paged;
          dst[r] = reinterpret_cast<OutElem*>(values);
        } else {
          src[r] = reinterpret_cast<const InElem*>(values);
          dst[r] = static_cast<OutElem*>(pl.plane ? paged.v[layer] : paged.k[layer]) + pl.paged;
        }
      }
    }
    move_rows<In, Out, MODE, E, C, R, false>(src, dst, scale, ln.gl, ln.L, geo.nchunks);
  }
}

// Tile kernel: a warp moves one tile (csrc/tile_map.h) at a time, G = 32 / L rows per
// pass, each lane C chunks of its row (R = 1: the row's place and scale are paid once
// per C chunks). A tile's rows are consecutive in the packed region, so a row's place
// is one multiply-high and a few multiply-adds from the tile's. LT > 0: L = LT lanes
// and L * C == nchunks (the launcher checked), so a row's chunk offsets are immediates
// and only the tile's last pass checks anything; LT == 0: L = 1 << lanes_log2, every
// chunk checked.
template <class In, class Out, int MODE, int E, int C, int LT, bool PACK>
__global__ void __launch_bounds__(kThreads) tiles_kernel(Paged paged, Packed packed, TileMap map, int lanes_log2, int nchunks) {
  using InElem = typename In::bits;
  using OutElem = typename Out::bits;
  using PagedElem = typename std::conditional<PACK, InElem, OutElem>::type;

  const Lanes ln(LT > 0 ? LT : 1 << lanes_log2);
  const int warps = gridDim.x * (kThreads / 32);
  char* const base = static_cast<char*>(packed.base);
  for (int w = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); w < map.num_tiles; w += warps) {  // warp-uniform
    const Tile t = map.tile(w, paged.block_ids);
    PagedElem* const plane = static_cast<PagedElem*>(t.plane ? paged.v[t.layer] : paged.k[t.layer]) + t.paged;
    for (int first = 0; first < t.rows; first += ln.G) {
      const int row = first + ln.group;
      const InElem* src[1] = {nullptr};
      OutElem* dst[1] = {nullptr};
      float* const scale[1] = {reinterpret_cast<float*>(base + t.scales) + row};
      if (row < t.rows) {
        char* const values = base + t.values + static_cast<int64_t>(row) * map.row_bytes;
        PagedElem* const paged_at = plane + map.paged_row(row);
        src[0] = reinterpret_cast<const InElem*>(PACK ? reinterpret_cast<char*>(paged_at) : values);
        dst[0] = reinterpret_cast<OutElem*>(PACK ? values : reinterpret_cast<char*>(paged_at));
      }
      if (LT > 0 && first + ln.G <= t.rows)
        move_rows<In, Out, MODE, E, C, 1, true>(src, dst, scale, ln.gl, ln.L, nchunks);
      else
        move_rows<In, Out, MODE, E, C, 1, false>(src, dst, scale, ln.gl, ln.L, nchunks);
    }
  }
}

// Both kernels' parameters fit one launch (kv_pack.h sizes kInlineIds for it).
static_assert(sizeof(Paged) + sizeof(Packed) + sizeof(Shape) + sizeof(Geometry) <= kMaxParamBytes, "rows_kernel parameters");
static_assert(sizeof(Paged) + sizeof(Packed) + sizeof(TileMap) + 2 * sizeof(int) <= kMaxParamBytes, "tiles_kernel parameters");

template <class In, class Out>
constexpr int vector_width() {
  return 16 / (sizeof(typename In::bits) > sizeof(typename Out::bits) ? sizeof(typename In::bits) : sizeof(typename Out::bits));
}

int ceil_log2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

template <class In, class Out, int MODE, int E, int C, bool PACK>
void launch_rows(const Paged& paged, const Packed& packed, const Shape& shape, const Geometry& geo, int num_sms,
                 cudaStream_t stream) {
  constexpr int R = items_for(MODE, C) / C;
  const int rows_per_block = (kThreads / 32) * (32 >> geo.lanes_log2) * R;
  const int64_t needed = (static_cast<int64_t>(geo.rows) + rows_per_block - 1) / rows_per_block;
  const int64_t cap = static_cast<int64_t>(num_sms) * (2048 / kThreads);
  rows_kernel<In, Out, MODE, E, C, PACK><<<static_cast<int>(needed < cap ? needed : cap), kThreads, 0, stream>>>(
      paged, packed, shape, geo);
}

// Tiles: each lane takes as many chunks of its row as the mode keeps in flight (kC =
// items_for(MODE, 1)), or 8 when a row needs more than 32 such lanes. Rows of 1, 2, 4
// or 8 lanes of exactly kC chunks (e.g. head_dim 64-256 in 16-bit types) get a kernel
// with the lane count built in.
template <class In, class Out, int MODE, int E, bool PACK>
void launch_tiles(const TileMap& map, int nchunks, int num_sms, cudaStream_t stream, const Paged& paged,
                  const Packed& packed) {
  constexpr int kC = items_for(MODE, 1);
  const int64_t needed = (static_cast<int64_t>(map.num_tiles) + kThreads / 32 - 1) / (kThreads / 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, static_cast<int64_t>(num_sms) * (2048 / kThreads)));
  const int lanes = nchunks % kC == 0 ? nchunks / kC : 0;
#define KVB_TILES(C, LT, LOG2) tiles_kernel<In, Out, MODE, E, C, LT, PACK><<<blocks, kThreads, 0, stream>>>(paged, packed, map, LOG2, nchunks)
  if (E > 1 && lanes == 1) KVB_TILES(kC, 1, 0);
  else if (E > 1 && lanes == 2) KVB_TILES(kC, 2, 1);
  else if (E > 1 && lanes == 4) KVB_TILES(kC, 4, 2);
  else if (E > 1 && lanes == 8) KVB_TILES(kC, 8, 3);
  else if (nchunks <= 32 * kC) KVB_TILES(kC, 0, ceil_log2((nchunks + kC - 1) / kC));
  else KVB_TILES(kMaxChunksPerLane, 0, 5);
#undef KVB_TILES
}

template <class In, class Out, int MODE, bool PACK>
cudaError_t launch(Kernel kernel, const Paged& paged, const Packed& packed, const Shape& shape, bool vector, int num_sms,
                   cudaStream_t stream) {
  constexpr int kVec = vector_width<In, Out>();
  const int E = vector ? kVec : 1;
  Geometry geo;
  geo.nchunks = shape.head_dim / E;
  geo.layer_rows = 2 * shape.num_tokens * shape.num_heads;
  geo.rows = paged.num_layers * geo.layer_rows;
  if (geo.rows == 0) return cudaSuccess;
  // a row fits one lane group (C = 1) or takes a full warp with up to 8 chunks per lane
  const bool wide = geo.nchunks > 32;
  geo.lanes_log2 = wide ? 5 : ceil_log2(geo.nchunks);
  if (geo.nchunks > 32 * kMaxChunksPerLane) return cudaErrorInvalidValue;  // api.cpp checks first
  using PackedElem = typename std::conditional<PACK, typename Out::bits, typename In::bits>::type;
  TileMap map;
  const bool tiles = kernel == Kernel::kTiles &&
                     make_tile_map(map, paged.num_layers, shape.num_tokens, shape.num_heads, paged.head_start,
                                   paged.block_size, shape.chunk_tokens, shape.head_dim * static_cast<int>(sizeof(PackedElem)),
                                   paged.stride_block, paged.stride_token, paged.stride_head, packed.region_bytes,
                                   packed.chunk_bytes, packed.scales_offset);
  if (tiles && vector)
    launch_tiles<In, Out, MODE, kVec, PACK>(map, geo.nchunks, num_sms, stream, paged, packed);
  else if (tiles)
    launch_tiles<In, Out, MODE, 1, PACK>(map, geo.nchunks, num_sms, stream, paged, packed);
  else if (vector && !wide)
    launch_rows<In, Out, MODE, kVec, 1, PACK>(paged, packed, shape, geo, num_sms, stream);
  else if (vector)
    launch_rows<In, Out, MODE, kVec, kMaxChunksPerLane, PACK>(paged, packed, shape, geo, num_sms, stream);
  else if (!wide)
    launch_rows<In, Out, MODE, 1, 1, PACK>(paged, packed, shape, geo, num_sms, stream);
  else
    launch_rows<In, Out, MODE, 1, kMaxChunksPerLane, PACK>(paged, packed, shape, geo, num_sms, stream);
  return cudaGetLastError();
}

template <bool PACK>
cudaError_t launch_copy(Kernel kn, Dtype d, const Paged& pg, const Packed& pk, const Shape& s, bool vec, int sms, cudaStream_t st) {
  switch (d) {  // a bit copy only needs the element size
    case Dtype::kF32: return launch<F32, F32, kCopy, PACK>(kn, pg, pk, s, vec, sms, st);
    case Dtype::kF16:
    case Dtype::kBF16: return launch<F16, F16, kCopy, PACK>(kn, pg, pk, s, vec, sms, st);
    case Dtype::kF8E4M3: return launch<F8, F8, kCopy, PACK>(kn, pg, pk, s, vec, sms, st);
  }
  return cudaErrorInvalidValue;
}

template <class In>
cudaError_t launch_convert(Kernel kn, Dtype out, const Paged& pg, const Packed& pk, const Shape& s, bool vec, int sms, cudaStream_t st) {
  switch (out) {
    case Dtype::kF32: return launch<In, F32, kConvert, false>(kn, pg, pk, s, vec, sms, st);
    case Dtype::kF16: return launch<In, F16, kConvert, false>(kn, pg, pk, s, vec, sms, st);
    case Dtype::kBF16: return launch<In, BF16, kConvert, false>(kn, pg, pk, s, vec, sms, st);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int max_head_dim(int element_bytes, bool vector) {
  const int e = vector ? 16 / element_bytes : 1;
  return 32 * kMaxChunksPerLane * e;
}

cudaError_t launch_pack(Kernel kernel, const Paged& src, const Packed& dst, const Shape& shape, Dtype cache, bool quantize,
                        bool vector, int num_sms, cudaStream_t stream) {
  if (!quantize) return launch_copy<true>(kernel, cache, src, dst, shape, vector, num_sms, stream);
  switch (cache) {
    case Dtype::kF32: return launch<F32, F8, kQuantize, true>(kernel, src, dst, shape, vector, num_sms, stream);
    case Dtype::kF16: return launch<F16, F8, kQuantize, true>(kernel, src, dst, shape, vector, num_sms, stream);
    case Dtype::kBF16: return launch<BF16, F8, kQuantize, true>(kernel, src, dst, shape, vector, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_unpack(Kernel kernel, const Packed& src, Dtype packed, bool scaled, const Paged& dst, const Shape& shape,
                          Dtype cache, bool vector, int num_sms, cudaStream_t stream) {
  if (scaled) {
    switch (cache) {
      case Dtype::kF32: return launch<F8, F32, kDequantize, false>(kernel, dst, src, shape, vector, num_sms, stream);
      case Dtype::kF16: return launch<F8, F16, kDequantize, false>(kernel, dst, src, shape, vector, num_sms, stream);
      case Dtype::kBF16: return launch<F8, BF16, kDequantize, false>(kernel, dst, src, shape, vector, num_sms, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  if (packed == cache) return launch_copy<false>(kernel, cache, dst, src, shape, vector, num_sms, stream);
  switch (packed) {
    case Dtype::kF32: return launch_convert<F32>(kernel, cache, dst, src, shape, vector, num_sms, stream);
    case Dtype::kF16: return launch_convert<F16>(kernel, cache, dst, src, shape, vector, num_sms, stream);
    case Dtype::kBF16: return launch_convert<BF16>(kernel, cache, dst, src, shape, vector, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvbridge
