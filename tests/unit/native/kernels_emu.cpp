// Runs one pack or unpack call of csrc/kv_pack.cu's launchers on the host under the warp
// emulator (warp_emu.h), for tests/unit/test_kernels_emulated.py.
//
//   kernels_emu CALL OUT
//   kernels_emu --inline-ids      (prints kvbridge::kInlineIds)
//
// CALL: the int64 fields of `Call`, in order, then per layer the byte
// offsets of its K and V planes in its storage, then the block ids (int64), then each
// layer's cache storage (`storage_bytes` each), then the packed buffer. OUT: the storages
// and the packed buffer after the call, in the same order. Exit status 0, or 3 with the
// emulator's complaint on stderr (2: bad CALL). Every buffer is its own allocation of
// exactly its size, so AddressSanitizer sees any access outside it.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "kv_pack.h"

namespace {

struct Call {
  int64_t op;  // 0 pack, 1 unpack
  int64_t kernel, cache_dtype, packed_dtype, scaled, vector;
  int64_t num_layers, num_tokens, num_heads, head_dim, chunk_tokens;
  int64_t block_size, head_start, stride_block, stride_token, stride_head;
  int64_t num_ids, storage_bytes, region_bytes, chunk_bytes, scales_offset, packed_bytes, num_sms;
  int64_t inline_ids;  // 1: the ids go in the kernels' parameters (at most kInlineIds), 0: in their own allocation
};

struct Reader {
  const std::vector<char>& data;
  size_t at = 0;
  bool take(void* dst, size_t n) {
    if (at + n > data.size()) return false;
    std::copy(data.begin() + at, data.begin() + at + n, static_cast<char*>(dst));
    at += n;
    return true;
  }
};

}  // namespace

// The runtime call the launchers end with: the emulator's launch errors.
extern "C" cudaError_t cudaGetLastError() { return kvb_emu::take_launch_error(); }

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--inline-ids") {
    std::printf("%d\n", kvbridge::kInlineIds);
    return 0;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: kernels_emu CALL OUT\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Reader rd{data};
  Call c;
  if (!rd.take(&c, sizeof(c)) || c.num_layers < 1 || c.num_layers > kvbridge::kMaxLayers ||
      (c.inline_ids && c.num_ids > kvbridge::kInlineIds)) {
    std::fprintf(stderr, "kernels_emu: bad call header\n");
    return 2;
  }
  std::vector<int64_t> offsets(2 * c.num_layers);
  std::vector<int64_t> ids(c.num_ids);
  std::vector<std::unique_ptr<char[]>> storages;
  bool ok = rd.take(offsets.data(), offsets.size() * 8) && rd.take(ids.data(), ids.size() * 8);
  for (int64_t i = 0; ok && i < c.num_layers; ++i) {
    storages.emplace_back(new char[c.storage_bytes]);
    ok = rd.take(storages.back().get(), c.storage_bytes);
  }
  std::unique_ptr<char[]> packed(new char[c.packed_bytes]);
  ok = ok && rd.take(packed.get(), c.packed_bytes) && rd.at == data.size();
  if (!ok) {
    std::fprintf(stderr, "kernels_emu: the call's size does not match its header\n");
    return 2;
  }
  kvbridge::Paged paged{};
  paged.num_layers = static_cast<int>(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    paged.k[i] = storages[i].get() + offsets[2 * i];
    paged.v[i] = storages[i].get() + offsets[2 * i + 1];
  }
  paged.stride_block = c.stride_block;
  paged.stride_token = c.stride_token;
  paged.stride_head = c.stride_head;
  if (c.inline_ids) {
    paged.block_ids.device = nullptr;
    std::copy(ids.begin(), ids.end(), paged.block_ids.inline_ids);  // api.cpp checked they fit int32
  } else {
    paged.block_ids.device = ids.data();  // its own allocation, as on the device
  }
  paged.block_size = static_cast<int>(c.block_size);
  paged.head_start = static_cast<int>(c.head_start);
  const kvbridge::Packed regions{packed.get(), c.region_bytes, c.chunk_bytes, c.scaled ? c.scales_offset : -1};
  const kvbridge::Shape shape{static_cast<int>(c.num_tokens), static_cast<int>(c.num_heads), static_cast<int>(c.head_dim),
                              static_cast<int>(c.chunk_tokens)};
  const auto kernel = static_cast<kvbridge::Kernel>(c.kernel);
  const auto cache = static_cast<kvbridge::Dtype>(c.cache_dtype);
  const cudaError_t err =
      c.op == 0 ? kvbridge::launch_pack(kernel, paged, regions, shape, cache, c.scaled != 0, c.vector != 0,
                                        static_cast<int>(c.num_sms), nullptr)
                : kvbridge::launch_unpack(kernel, regions, static_cast<kvbridge::Dtype>(c.packed_dtype), c.scaled != 0,
                                          paged, shape, cache, c.vector != 0, static_cast<int>(c.num_sms), nullptr);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "kernels_emu: the launcher returned error %d\n", static_cast<int>(err));
    return 3;
  }
  if (!kvb_emu::first_error().empty()) {
    std::fprintf(stderr, "kernels_emu: %s\n", kvb_emu::first_error().c_str());
    return 3;
  }
  std::ofstream out(argv[2], std::ios::binary);
  for (auto& s : storages) out.write(s.get(), c.storage_bytes);
  out.write(packed.get(), c.packed_bytes);
  return out.good() ? 0 : 2;
}
