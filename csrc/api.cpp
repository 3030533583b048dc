// kvbridge: the one binding file. Registers torch.ops.kvbridge.pack / unpack (CUDA) and
// checks every input before a kernel sees it: dims, dtypes, devices, strides,
// contiguity, alignment, head ranges, buffer sizes and block-id bounds. Every failed
// check raises a Python RuntimeError saying what was wrong and what is expected.
//
// Contracts (see csrc/PACKED_FORMAT.md for the byte layout):
//   pack(k[], v[], block_ids, num_tokens, head_start, num_heads, fp8, chunk_tokens, out, kernel)
//   unpack(packed, packed_dtype, scaled, chunk_tokens, k[], v[], block_ids, num_tokens, head_start, num_heads, kernel)
// kernel: 0 = the row kernel, 1 = the tile kernel (csrc/kv_pack.h, Kernel); same bytes.
// k[i], v[i]: layer i's planes as (num_blocks, block_size, num_heads, head_dim) views, all
// with equal shapes and strides and a contiguous last dim (kvbridge.ops.kv_planes makes
// them); layer i's region starts at i * (region bytes) in out / packed.
// block_ids: 1-D int32/int64 on the CPU (checked on the host, no device sync; up to
// kInlineIds of them travel in the kernel's parameters, more through pinned memory) or
// on the planes' device (checked with one device sync). Kernels run on the current stream
// and return without waiting; the caller owns every buffer until the stream passes.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>

#include "kv_pack.h"

namespace kvbridge {
namespace {

constexpr int64_t kAlign = 16;

// Error messages are built without iostreams: c10::str formats through an ostream
// instantiated in this library, which crashed (inside std::ostream::_M_insert) when the
// extension's compiler was newer than the libstdc++ torch loads. A single std::string
// goes through c10::str untouched.
inline void put(std::string& s, const char* x) { s += x; }
inline void put(std::string& s, const std::string& x) { s += x; }
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T x) {
  s += std::to_string(x);
}
inline void put(std::string& s, c10::IntArrayRef a) {
  s += "(";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += ")";
}
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }
inline void put(std::string& s, at::ScalarType t) { s += c10::toString(t); }
template <class... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}
#define KVB_CHECK(cond, ...) TORCH_CHECK(cond, ::kvbridge::cat(__VA_ARGS__))

Dtype to_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return Dtype::kF32;
    case at::kHalf: return Dtype::kF16;
    case at::kBFloat16: return Dtype::kBF16;
    case at::kFloat8_e4m3fn: return Dtype::kF8E4M3;
    default:
      KVB_CHECK(false, "kvbridge: ", what, " has dtype ", t, "; supported: float32, float16, bfloat16, float8_e4m3fn");
  }
  return Dtype::kF32;  // not reached
}

int64_t align16(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Checked {
  Paged paged;
  Shape shape;
  Dtype dtype;
  at::Tensor ids;  // device ids (not inline): int64 on the planes' device, alive until launch
};

// Every layer's planes: same shape, strides, dtype and device as layer 0's K.
Checked check_planes(at::TensorList ks, at::TensorList vs, const at::Tensor& block_ids, int64_t num_tokens,
                     int64_t head_start, int64_t num_heads) {
  KVB_CHECK(!ks.empty() && ks.size() == vs.size(), "kvbridge: k and v must list the same number (>= 1) of layers, got ",
              ks.size(), " and ", vs.size());
  KVB_CHECK(static_cast<int64_t>(ks.size()) <= kMaxLayers, "kvbridge: at most ", kMaxLayers,
              " layers per call, got ", ks.size());
  const at::Tensor& k = ks[0];
  KVB_CHECK(k.is_cuda(), "kvbridge: the planes must be CUDA tensors, got ", k.device(),
              " (kvbridge.ops runs the torch reference on other devices)");
  KVB_CHECK(k.dim() == 4, "kvbridge: planes must be 4-D (num_blocks, block_size, num_heads, head_dim) views, got shape ",
              k.sizes(), "; kvbridge.ops.kv_planes makes them from a cache tensor");
  KVB_CHECK(k.stride(3) == 1, "kvbridge: the head_dim axis of the planes must be contiguous (stride 1), got strides ",
              k.strides());
  for (int d = 0; d < 3; ++d)
    KVB_CHECK(k.stride(d) > 0, "kvbridge: planes must have positive strides, got ", k.strides());
  Checked c;
  c.dtype = to_dtype(k.scalar_type(), "the KV cache");
  c.paged.num_layers = static_cast<int>(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    for (const at::Tensor* t : {&ks[i], &vs[i]}) {
      KVB_CHECK(t->device() == k.device() && t->sizes() == k.sizes() && t->strides() == k.strides() &&
                      t->scalar_type() == k.scalar_type(),
                  "kvbridge: layer ", i, " planes differ from layer 0's K: ", t->device(), " ", t->scalar_type(), " ",
                  t->sizes(), " strides ", t->strides(), " vs ", k.device(), " ", k.scalar_type(), " ", k.sizes(),
                  " strides ", k.strides());
    }
    c.paged.k[i] = ks[i].data_ptr();
    c.paged.v[i] = vs[i].data_ptr();
  }
  const int64_t num_blocks = k.size(0), block_size = k.size(1), heads = k.size(2), dim = k.size(3);
  KVB_CHECK(num_blocks > 0 && block_size > 0 && heads > 0 && dim > 0, "kvbridge: empty planes of shape ", k.sizes());
  KVB_CHECK(num_tokens >= 0, "kvbridge: num_tokens must be >= 0, got ", num_tokens);
  KVB_CHECK(head_start >= 0 && num_heads > 0 && head_start + num_heads <= heads, "kvbridge: head range [",
              head_start, ", ", head_start + num_heads, ") is outside the planes' ", heads, " heads");
  KVB_CHECK(static_cast<int64_t>(ks.size()) * 2 * num_tokens * num_heads < (int64_t{1} << 31), "kvbridge: ",
              ks.size(), " layers x ", num_tokens, " tokens x ", num_heads, " heads is too much for one call; split it");

  KVB_CHECK(block_ids.dim() == 1, "kvbridge: block_ids must be 1-D, got shape ", block_ids.sizes());
  KVB_CHECK(block_ids.scalar_type() == at::kLong || block_ids.scalar_type() == at::kInt,
              "kvbridge: block_ids must be int32 or int64, got ", block_ids.scalar_type());
  KVB_CHECK(block_ids.is_cpu() || block_ids.device() == k.device(), "kvbridge: block_ids must be on the CPU or on ",
              k.device(), ", got ", block_ids.device());
  const int64_t needed = (num_tokens + block_size - 1) / block_size;
  KVB_CHECK(block_ids.numel() >= needed, "kvbridge: ", num_tokens, " tokens in blocks of ", block_size, " need ",
              needed, " block ids, got ", block_ids.numel());
  at::Tensor ids = block_ids.slice(0, 0, needed).to(at::kLong).contiguous();
  if (needed > 0) {
    int64_t lo, hi;
    if (ids.is_cpu()) {  // no device work
      const int64_t* p = ids.data_ptr<int64_t>();
      lo = hi = p[0];
      for (int64_t i = 1; i < needed; ++i) {
        lo = std::min(lo, p[i]);
        hi = std::max(hi, p[i]);
      }
    } else {  // one device sync
      const auto mm = ids.aminmax();
      lo = std::get<0>(mm).item<int64_t>();
      hi = std::get<1>(mm).item<int64_t>();
    }
    KVB_CHECK(lo >= 0 && hi < num_blocks, "kvbridge: block id ", lo < 0 ? lo : hi, " is out of range [0, ",
                num_blocks, ")");
  }
  if (ids.is_cpu() && needed <= kInlineIds && num_blocks <= std::numeric_limits<int32_t>::max()) {
    // inside the kernel's parameters: the launch carries them, nothing else to wait for
    const int64_t* p = ids.data_ptr<int64_t>();
    c.paged.block_ids.device = nullptr;
    std::copy(p, p + needed, c.paged.block_ids.inline_ids);
  } else {
    // longer host lists go up through pinned memory without waiting; the caching host
    // allocator keeps the pinned copy until the transfer is done
    c.ids = ids.is_cpu() ? ids.pin_memory().to(k.device(), /*non_blocking=*/true) : ids;
    c.paged.block_ids.device = c.ids.data_ptr<int64_t>();
  }
  c.shape = Shape{static_cast<int>(num_tokens), static_cast<int>(num_heads), static_cast<int>(dim)};
  c.paged.stride_block = k.stride(0);
  c.paged.stride_token = k.stride(1);
  c.paged.stride_head = k.stride(2);
  c.paged.block_size = static_cast<int>(block_size);
  c.paged.head_start = static_cast<int>(head_start);
  return c;
}

void check_buffer(const at::Tensor& buf, const at::Tensor& k, int64_t nbytes, const char* what) {
  KVB_CHECK(buf.device() == k.device(), "kvbridge: ", what, " must be on ", k.device(), ", got ", buf.device());
  KVB_CHECK(buf.scalar_type() == at::kByte && buf.dim() == 1 && buf.is_contiguous(), "kvbridge: ", what,
              " must be a contiguous 1-D uint8 tensor, got ", buf.scalar_type(), " of shape ", buf.sizes());
  KVB_CHECK(buf.numel() >= nbytes, "kvbridge: ", what, " holds ", buf.numel(), " bytes, the region needs ", nbytes);
  KVB_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr()) % kAlign == 0, "kvbridge: ", what,
              " must start at a 16-byte aligned address");
}

// 16-byte accesses are possible when every chunk address is a multiple of the access width on
// both sides: every layer's base pointers and the strides on the cache side, and head_dim.
bool vector_ok(const Paged& p, const at::Tensor& k, int64_t cache_elem, int64_t packed_elem) {
  const int64_t e = 16 / std::max(cache_elem, packed_elem);
  bool ok = k.size(3) % e == 0;
  for (int d = 0; d < 3; ++d) ok = ok && k.stride(d) % e == 0;
  for (int i = 0; i < p.num_layers; ++i) {
    ok = ok && reinterpret_cast<uintptr_t>(p.k[i]) % (e * cache_elem) == 0;
    ok = ok && reinterpret_cast<uintptr_t>(p.v[i]) % (e * cache_elem) == 0;
  }
  return ok;
}

void check_head_dim(int64_t dim, int64_t cache_elem, int64_t packed_elem, bool vector) {
  const int64_t limit = max_head_dim(static_cast<int>(std::max(cache_elem, packed_elem)), vector);
  KVB_CHECK(dim <= limit, "kvbridge: head_dim ", dim, " exceeds the kernels' limit of ", limit,
              " for these dtypes and alignment");
}

int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

Kernel to_kernel(int64_t kernel) {
  KVB_CHECK(kernel == 0 || kernel == 1, "kvbridge: kernel must be 0 (rows) or 1 (tiles), got ", kernel);
  return static_cast<Kernel>(kernel);
}

// The chunked layout of csrc/PACKED_FORMAT.md (kvbridge/ops/format.py computes the same).
Packed regions(const at::Tensor& buf, int64_t num_tokens, int64_t chunk_tokens, int64_t num_heads, int64_t dim,
               int64_t elem, bool scaled) {
  const int64_t ct = chunk_tokens > 0 ? chunk_tokens : num_tokens;
  const int64_t chunks = ct > 0 ? (num_tokens + ct - 1) / ct : 0;
  const int64_t values = 2 * ct * num_heads * dim * elem;
  const int64_t scales_offset = align16(values);
  const int64_t chunk_bytes = align16(scaled ? scales_offset + 8 * ct * num_heads : values);
  return Packed{buf.data_ptr(), chunks * chunk_bytes, chunk_bytes, scaled ? scales_offset : -1};
}

// The packed side of a call, shared by pack and unpack (after check_planes): the regions'
// layout in `buf` (size and alignment checked), the chunk length the kernels use, and
// whether 16-byte accesses are possible.
struct Buffer {
  Packed regions;
  bool vector;
};

Buffer check_regions(Checked& c, at::TensorList k, const at::Tensor& buf, const char* what, int64_t chunk_tokens,
                     int64_t num_tokens, int64_t num_heads, int64_t cache_elem, int64_t packed_elem, bool scaled) {
  KVB_CHECK(chunk_tokens >= 0, "kvbridge: chunk_tokens must be >= 0, got ", chunk_tokens);
  const Packed p = regions(buf, num_tokens, chunk_tokens, num_heads, k[0].size(3), packed_elem, scaled);
  c.shape.chunk_tokens = static_cast<int>(chunk_tokens > 0 ? chunk_tokens : std::max<int64_t>(num_tokens, 1));
  check_buffer(buf, k[0], p.region_bytes * static_cast<int64_t>(k.size()), what);
  const bool vec = vector_ok(c.paged, k[0], cache_elem, packed_elem);
  check_head_dim(k[0].size(3), cache_elem, packed_elem, vec);
  return Buffer{p, vec};
}

void pack(at::TensorList k, at::TensorList v, const at::Tensor& block_ids, int64_t num_tokens, int64_t head_start,
          int64_t num_heads, bool fp8, int64_t chunk_tokens, const at::Tensor& out, int64_t kernel) {
  KVB_CHECK(!k.empty(), "kvbridge: no layers to pack");
  KVB_CHECK(k[0].is_cuda(), "kvbridge: the planes must be CUDA tensors, got ", k[0].device());
  const c10::cuda::CUDAGuard guard(k[0].device());
  Checked c = check_planes(k, v, block_ids, num_tokens, head_start, num_heads);
  KVB_CHECK(!(fp8 && c.dtype == Dtype::kF8E4M3),
              "kvbridge: the cache is already float8; pack it with fp8=False (its bytes are copied as they are)");
  const int64_t cache_elem = k[0].element_size(), packed_elem = fp8 ? 1 : cache_elem;
  const Buffer dst = check_regions(c, k, out, "out", chunk_tokens, num_tokens, num_heads, cache_elem, packed_elem, fp8);
  const cudaError_t err =
      launch_pack(to_kernel(kernel), c.paged, dst.regions, c.shape, c.dtype, fp8, dst.vector, num_sms(), at::cuda::getCurrentCUDAStream());
  KVB_CHECK(err == cudaSuccess, "kvbridge: pack kernel launch failed: ", cudaGetErrorString(err));
}

void unpack(const at::Tensor& packed, at::ScalarType packed_dtype, bool scaled, int64_t chunk_tokens, at::TensorList k,
            at::TensorList v, const at::Tensor& block_ids, int64_t num_tokens, int64_t head_start, int64_t num_heads,
            int64_t kernel) {
  KVB_CHECK(!k.empty(), "kvbridge: no layers to unpack into");
  KVB_CHECK(k[0].is_cuda(), "kvbridge: the planes must be CUDA tensors, got ", k[0].device());
  const c10::cuda::CUDAGuard guard(k[0].device());
  Checked c = check_planes(k, v, block_ids, num_tokens, head_start, num_heads);
  const Dtype pd = to_dtype(packed_dtype, "the packed region");
  if (scaled) {
    KVB_CHECK(pd == Dtype::kF8E4M3, "kvbridge: a scaled region holds float8_e4m3fn values, not ", packed_dtype);
    KVB_CHECK(c.dtype != Dtype::kF8E4M3,
                "kvbridge: a scaled region cannot go into a float8 cache (its own scales are the engine's); "
                "pack that cache with fp8=False");
  } else if (pd == Dtype::kF8E4M3 || c.dtype == Dtype::kF8E4M3) {
    KVB_CHECK(pd == c.dtype, "kvbridge: unscaled float8 values can only go into a float8 cache and back; got ",
                packed_dtype, " into ", k[0].scalar_type());
  }
  const int64_t cache_elem = k[0].element_size(), packed_elem = c10::elementSize(packed_dtype);
  const Buffer src = check_regions(c, k, packed, "packed", chunk_tokens, num_tokens, num_heads, cache_elem, packed_elem, scaled);
  const cudaError_t err = launch_unpack(to_kernel(kernel), src.regions, pd, scaled, c.paged, c.shape, c.dtype, src.vector, num_sms(),
                                        at::cuda::getCurrentCUDAStream());
  KVB_CHECK(err == cudaSuccess, "kvbridge: unpack kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace kvbridge

TORCH_LIBRARY(kvbridge, m) {
  m.def("pack(Tensor[] k, Tensor[] v, Tensor block_ids, int num_tokens, int head_start, int num_heads, bool fp8, "
        "int chunk_tokens, Tensor(a!) out, int kernel=0) -> ()");
  m.def("unpack(Tensor packed, ScalarType packed_dtype, bool scaled, int chunk_tokens, Tensor(a!)[] k, Tensor(b!)[] v, "
        "Tensor block_ids, int num_tokens, int head_start, int num_heads, int kernel=0) -> ()");
}

TORCH_LIBRARY_IMPL(kvbridge, CUDA, m) {
  m.impl("pack", &kvbridge::pack);
  m.impl("unpack", &kvbridge::unpack);
}
