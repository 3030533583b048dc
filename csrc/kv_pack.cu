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

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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
  const int64_t blk = p.block_ids[j];
  r.paged = blk * p.stride_block + static_cast<int64_t>(t - j * p.block_size) * p.stride_token +
            static_cast<int64_t>(p.head_start + h) * p.stride_head;
  const int c = t / s.chunk_tokens;
  const int64_t in_chunk = (static_cast<int64_t>(r.plane) * s.chunk_tokens + (t - c * s.chunk_tokens)) * s.num_heads + h;
  r.values_byte = c * k.chunk_bytes + in_chunk * s.head_dim * VALUE_BYTES;
  r.scale_byte = c * k.chunk_bytes + k.scales_offset + in_chunk * 4;
  return r;
}

// C chunks per lane, R = kItems / C rows per lane group and iteration; all compile-time
// so that the per-item bookkeeping stays in registers.
template <class In, class Out, int MODE, int E, int C, bool PACK>
__global__ void __launch_bounds__(kThreads) rows_kernel(Paged paged, Packed packed, Shape shape, Geometry geo) {
  using InChunk = Chunk<In, E>;
  using OutChunk = Chunk<Out, E>;
  using InElem = typename In::bits;
  using OutElem = typename Out::bits;
  using PackedElem = typename std::conditional<PACK, OutElem, InElem>::type;
  constexpr int ITEMS = items_for(MODE, C);
  constexpr int R = ITEMS / C;

  const int L = 1 << geo.lanes_log2;
  const int groups = 32 >> geo.lanes_log2;
  const int lane = threadIdx.x & 31;
  const int group = lane >> geo.lanes_log2;
  const int gl = lane & (L - 1);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  const int64_t step = static_cast<int64_t>(gridDim.x) * (kThreads / 32) * groups * R;

  for (int64_t base = warp * groups * R; base < geo.rows; base += step) {  // warp-uniform
    InChunk in[ITEMS];
    OutElem* dst[ITEMS];  // nullptr: no item
    float* scale[R];       // the row's scale (quantize, dequantize); nullptr: no row
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row64 = base + static_cast<int64_t>(r) * groups + group;
      const bool row_ok = row64 < geo.rows;
      const int layer = row_ok ? static_cast<int>(row64) / geo.layer_rows : 0;
      const int row = row_ok ? static_cast<int>(row64) - layer * geo.layer_rows : 0;
      const InElem* src = nullptr;
      OutElem* out = nullptr;
      scale[r] = nullptr;
      if (row_ok) {
        const RowPlace pl = place_row<sizeof(PackedElem)>(paged, packed, shape, row);
        char* region = static_cast<char*>(packed.base) + layer * packed.region_bytes;
        PackedElem* values = reinterpret_cast<PackedElem*>(region + pl.values_byte);
        scale[r] = reinterpret_cast<float*>(region + pl.scale_byte);
        if (PACK) {
          src = static_cast<const InElem*>(pl.plane ? paged.v[layer] : paged.k[layer]) + pl.paged;
          out = reinterpret_cast<OutElem*>(values);
        } else {
          src = reinterpret_cast<const InElem*>(values);
          out = static_cast<OutElem*>(pl.plane ? paged.v[layer] : paged.k[layer]) + pl.paged;
        }
      }
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const int i = r * C + j;
        const int chunk = gl + j * L;
        dst[i] = nullptr;
        if (row_ok && chunk < geo.nchunks) {
          in[i].raw = *reinterpret_cast<const decltype(in[i].raw)*>(src + chunk * E);
          dst[i] = out + chunk * E;
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
          if (dst[r * C + j] != nullptr) {
#pragma unroll
            for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(In::to_f(in[r * C + j].e[e])));
          }
        }
        for (int o = L >> 1; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        factor[r] = amax > 0.f ? kFp8Max / amax : 0.f;
        if (gl == 0 && scale[r] != nullptr) *scale[r] = amax / kFp8Max;
      } else if (MODE == kDequantize) {
        if (scale[r] != nullptr) factor[r] = *scale[r];
      }
    }

#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (dst[i] == nullptr) continue;
      OutChunk out;
      if (MODE == kCopy) {
        out.raw = reinterpret_cast<const decltype(out.raw)&>(in[i].raw);
      } else if (MODE == kQuantize && E % 2 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 2) {  // one cvt for two values; same rounding as one by one
          const float2 x = make_float2(In::to_f(in[i].e[e]) * factor[i / C], In::to_f(in[i].e[e + 1]) * factor[i / C]);
          const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
          out.e[e] = static_cast<OutElem>(q & 0xff);
          out.e[e + 1] = static_cast<OutElem>(q >> 8);
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          float x = In::to_f(in[i].e[e]);
          if (MODE == kQuantize || MODE == kDequantize) x = x * factor[i / C];
          out.e[e] = Out::from_f(x);
        }
      }
      *reinterpret_cast<decltype(out.raw)*>(dst[i]) = out.raw;
    }
  }
}

template <class In, class Out>
constexpr int vector_width() {
  return 16 / (sizeof(typename In::bits) > sizeof(typename Out::bits) ? sizeof(typename In::bits) : sizeof(typename Out::bits));
}

int ceil_log2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

template <class In, class Out, int MODE, bool PACK>
cudaError_t launch(const Paged& paged, const Packed& packed, const Shape& shape, bool vector, int num_sms, cudaStream_t stream) {
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
  const int rows_per_block = (kThreads / 32) * (32 >> geo.lanes_log2) *
                             (wide ? items_for(MODE, kMaxChunksPerLane) / kMaxChunksPerLane : items_for(MODE, 1));
  const int64_t needed = (static_cast<int64_t>(geo.rows) + rows_per_block - 1) / rows_per_block;
  const int64_t cap = static_cast<int64_t>(num_sms) * (2048 / kThreads);
  const int blocks = static_cast<int>(needed < cap ? needed : cap);
  if (vector && !wide)
    rows_kernel<In, Out, MODE, kVec, 1, PACK><<<blocks, kThreads, 0, stream>>>(paged, packed, shape, geo);
  else if (vector)
    rows_kernel<In, Out, MODE, kVec, kMaxChunksPerLane, PACK><<<blocks, kThreads, 0, stream>>>(paged, packed, shape, geo);
  else if (!wide)
    rows_kernel<In, Out, MODE, 1, 1, PACK><<<blocks, kThreads, 0, stream>>>(paged, packed, shape, geo);
  else
    rows_kernel<In, Out, MODE, 1, kMaxChunksPerLane, PACK><<<blocks, kThreads, 0, stream>>>(paged, packed, shape, geo);
  return cudaGetLastError();
}

template <bool PACK>
cudaError_t launch_copy(Dtype d, const Paged& pg, const Packed& pk, const Shape& s, bool vec, int sms, cudaStream_t st) {
  switch (d) {  // a bit copy only needs the element size
    case Dtype::kF32: return launch<F32, F32, kCopy, PACK>(pg, pk, s, vec, sms, st);
    case Dtype::kF16:
    case Dtype::kBF16: return launch<F16, F16, kCopy, PACK>(pg, pk, s, vec, sms, st);
    case Dtype::kF8E4M3: return launch<F8, F8, kCopy, PACK>(pg, pk, s, vec, sms, st);
  }
  return cudaErrorInvalidValue;
}

template <class In>
cudaError_t launch_convert(Dtype out, const Paged& pg, const Packed& pk, const Shape& s, bool vec, int sms, cudaStream_t st) {
  switch (out) {
    case Dtype::kF32: return launch<In, F32, kConvert, false>(pg, pk, s, vec, sms, st);
    case Dtype::kF16: return launch<In, F16, kConvert, false>(pg, pk, s, vec, sms, st);
    case Dtype::kBF16: return launch<In, BF16, kConvert, false>(pg, pk, s, vec, sms, st);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int max_head_dim(int element_bytes, bool vector) {
  const int e = vector ? 16 / element_bytes : 1;
  return 32 * kMaxChunksPerLane * e;
}

cudaError_t launch_pack(const Paged& src, const Packed& dst, const Shape& shape, Dtype cache, bool quantize, bool vector,
                        int num_sms, cudaStream_t stream) {
  if (!quantize) return launch_copy<true>(cache, src, dst, shape, vector, num_sms, stream);
  switch (cache) {
    case Dtype::kF32: return launch<F32, F8, kQuantize, true>(src, dst, shape, vector, num_sms, stream);
    case Dtype::kF16: return launch<F16, F8, kQuantize, true>(src, dst, shape, vector, num_sms, stream);
    case Dtype::kBF16: return launch<BF16, F8, kQuantize, true>(src, dst, shape, vector, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_unpack(const Packed& src, Dtype packed, bool scaled, const Paged& dst, const Shape& shape, Dtype cache,
                          bool vector, int num_sms, cudaStream_t stream) {
  if (scaled) {
    switch (cache) {
      case Dtype::kF32: return launch<F8, F32, kDequantize, false>(dst, src, shape, vector, num_sms, stream);
      case Dtype::kF16: return launch<F8, F16, kDequantize, false>(dst, src, shape, vector, num_sms, stream);
      case Dtype::kBF16: return launch<F8, BF16, kDequantize, false>(dst, src, shape, vector, num_sms, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  if (packed == cache) return launch_copy<false>(cache, dst, src, shape, vector, num_sms, stream);
  switch (packed) {
    case Dtype::kF32: return launch_convert<F32>(cache, dst, src, shape, vector, num_sms, stream);
    case Dtype::kF16: return launch_convert<F16>(cache, dst, src, shape, vector, num_sms, stream);
    case Dtype::kBF16: return launch_convert<BF16>(cache, dst, src, shape, vector, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvbridge
