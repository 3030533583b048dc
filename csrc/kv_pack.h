// kvbridge: launchers of the pack / unpack kernels (csrc/kv_pack.cu).
//
// Called only by csrc/api.cpp, after it has checked every input; nothing here checks
// again. Contracts, the byte layout of a packed region and the quantization formula are
// in csrc/PACKED_FORMAT.md; the pure-torch specification is kvbridge/ops/reference.py.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kvbridge {

// Element types the kernels move. Codes are internal to csrc/.
enum class Dtype : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF8E4M3 = 3 };

// Which kernel moves the rows: one row per lane group, placed by its global index
// (kRows), or one tile of consecutive rows per warp (kTiles, csrc/tile_map.h; a call
// whose rows lie more than 2^31 elements apart within a block runs kRows instead).
enum class Kernel : int { kRows = 0, kTiles = 1 };

// Most layers one launch moves (kernel parameters hold their addresses).
constexpr int kMaxLayers = 128;

// Kernel parameters may take 32 KiB since CUDA 12.1 (4 KiB before); kv_pack.cu checks
// that both kernels' fit. Block ids a call carries inside them: the launch copies them
// to the GPU with the call, so a request of up to kInlineIds blocks (64k tokens in
// 16-token blocks) costs no allocation, host-to-device copy or event of its own. On an
// H100 a 32k-token call in 16-token blocks moved 83% of a device copy's bandwidth with
// its 2048 ids uploaded, 89% with them inline (csrc/NOTES.md, "GPU results").
#if CUDART_VERSION >= 12010
constexpr int kMaxParamBytes = 32764;
constexpr int kInlineIds = 4096;
#else
constexpr int kMaxParamBytes = 4096;
constexpr int kInlineIds = 256;
#endif

// The request's blocks in order: `device[j]` (int64 in device memory) when `device` is
// set, else `inline_ids[j]` (api.cpp chooses: host ids that fit go inline). Read once
// per row (row kernel) or tile (tile kernel); the branch is the same for every lane.
struct BlockIds {
  const int64_t* device;
  int32_t inline_ids[kInlineIds];

  __host__ __device__ __forceinline__ int64_t operator[](int j) const {
    return device != nullptr ? device[j] : inline_ids[j];
  }
};

// One side of a copy that is a paged cache: the K and V planes of `num_layers` layers,
// each indexed (block, token-in-block, head, element) with the same strides, in
// elements (api.cpp checks it).
struct Paged {
  void* k[kMaxLayers];
  void* v[kMaxLayers];
  int num_layers;
  int64_t stride_block;
  int64_t stride_token;
  int64_t stride_head;
  int block_size;
  int head_start;  // first head of the range this copy touches
  BlockIds block_ids;
};

// Packed regions, one per layer, back to back every `region_bytes`. A region is a run of
// chunks of `chunk_tokens` tokens every `chunk_bytes` (multiples of 16); a chunk holds
// values (2, chunk_tokens, num_heads, head_dim) then, when scaled, float32 scales
// (2, chunk_tokens, num_heads) at `scales_offset` from the chunk's start.
struct Packed {
  void* base;
  int64_t region_bytes;
  int64_t chunk_bytes;
  int64_t scales_offset;  // -1 unless scaled
};

struct Shape {
  int num_tokens;
  int num_heads;
  int head_dim;
  int chunk_tokens;
};

// pack: paged (dtype `cache`) -> packed. `quantize`: values become float8 e4m3 with
// scales; otherwise they are copied bit for bit (packed dtype == cache dtype).
// `vector`: the launcher may use 16-byte accesses (api.cpp checked the alignment).
cudaError_t launch_pack(Kernel kernel, const Paged& src, const Packed& dst, const Shape& shape, Dtype cache, bool quantize,
                        bool vector, int num_sms, cudaStream_t stream);

// unpack: packed (dtype `packed`, scaled or not) -> paged (dtype `cache`): a bit copy
// when the dtypes are equal and unscaled, else converted through float32 with
// round-to-nearest-even.
cudaError_t launch_unpack(Kernel kernel, const Packed& src, Dtype packed, bool scaled, const Paged& dst, const Shape& shape,
                          Dtype cache, bool vector, int num_sms, cudaStream_t stream);

// Largest head_dim the kernels take for an element size and access width.
int max_head_dim(int element_bytes, bool vector);

}  // namespace kvbridge
