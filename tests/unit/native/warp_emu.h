// A warp emulator that runs csrc/kv_pack.cu's kernels on the host, for
// tests/unit/test_kernels_emulated.py: each lane of a warp is a host thread, so lanes run
// the kernel's own code with their own threadIdx, and __shfl_xor_sync exchanges values
// between the 32 threads of a warp at a barrier.
//
// Force-included (g++ -include) before a copy of kv_pack.cu whose launches
// `kernel<<<grid, block, smem, stream>>>(args)` the test has rewritten to
// `::kvb_emu::launch(grid, block, smem, stream, [=] { kernel(args); })`. The CUDA
// headers (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h) give the conversions' host code, which
// rounds like the device instructions.
//
// What it checks beyond the results: every shuffle is reached by all 32 lanes of the
// warp with the same mask, offset and count (the kernels promise warp-uniform control
// flow), and a warp never reads a lane that has exited. A violation is recorded in
// first_error(); a configuration CUDA would refuse is left for cudaGetLastError. The
// kernels' memory accesses are checked by AddressSanitizer and UBSan (a misaligned
// 16-byte access too, as on the GPU), which the test compiles with.
//
// Not modelled: shared memory, __syncthreads, atomics, the memory model (the kernels use
// none of them; warps run one after another), timing.
#pragma once

// the attributes go before the CUDA headers, which keep definitions made first
#define __host__
#define __device__
#define __global__

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#undef __launch_bounds__
#define __launch_bounds__(...)

namespace kvb_emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

constexpr int kWarp = 32;

// One warp in flight: its lanes' shuffle slots and the barrier they meet at.
struct Warp {
  std::barrier<> meet{kWarp};
  uint32_t value[kWarp] = {};
  unsigned mask[kWarp] = {};
  int offset[kWarp] = {};
  int64_t count[kWarp] = {};
  bool exited[kWarp] = {};
};

// What a lane sees as its built-in variables.
struct Lane {
  Dim3 thread_idx, block_idx, grid_dim, block_dim;
  Warp* warp = nullptr;
  int64_t shuffles = 0;
};

inline thread_local Lane* current = nullptr;

inline std::mutex& error_lock() {
  static std::mutex m;
  return m;
}

// The first violation seen by this process (empty: none); a harness runs one call per
// process and reads it after launch() returns.
inline std::string& first_error() {
  static std::string e;
  return e;
}

inline void fail(const std::string& what) {
  const std::lock_guard<std::mutex> g(error_lock());
  if (first_error().empty()) first_error() = what;
}

inline float shfl_xor(unsigned mask, float v, int offset) {
  Lane& me = *current;
  Warp& w = *me.warp;
  const int lane = static_cast<int>(me.thread_idx.x) % kWarp;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  w.value[lane] = bits;
  w.mask[lane] = mask;
  w.offset[lane] = offset;
  w.count[lane] = ++me.shuffles;
  w.meet.arrive_and_wait();  // every live lane has published
  if (mask != 0xffffffffu) fail("a shuffle with a partial mask (the kernels shuffle over full warps)");
  uint32_t got = bits;  // an offset outside the warp reads nothing (and is reported)
  if (offset <= 0 || offset >= kWarp) {
    fail("a shuffle offset outside [1, 32)");
  } else {
    const int other = lane ^ offset;
    if (w.exited[other]) fail("a shuffle reads lane " + std::to_string(other) + ", which has exited: control flow is not warp-uniform");
    if (w.offset[other] != offset || w.count[other] != me.shuffles || w.mask[other] != mask)
      fail("lanes " + std::to_string(lane) + " and " + std::to_string(other) +
           " met at different shuffles: control flow is not warp-uniform");
    got = w.value[other];
  }
  w.meet.arrive_and_wait();  // every lane has read before the slots are reused
  float r;
  std::memcpy(&r, &got, 4);
  return r;
}

inline cudaError_t launch_error = cudaSuccess;

// What cudaGetLastError gives: the last bad launch configuration, then cleared.
inline cudaError_t take_launch_error() {
  const cudaError_t e = launch_error;
  launch_error = cudaSuccess;
  return e;
}

// Runs `kernel` for every thread of a grid of `grid` blocks of `block` threads: one warp
// at a time, its 32 lanes as host threads. A configuration CUDA would refuse runs
// nothing and leaves cudaErrorInvalidConfiguration for cudaGetLastError.
template <class F>
void launch(int grid, int block, int /*shared_bytes*/, cudaStream_t /*stream*/, F kernel) {
  if (grid <= 0 || block <= 0 || block > 1024) {
    launch_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (block % kWarp != 0) fail("a block of " + std::to_string(block) + " threads is not whole warps");
  for (int b = 0; b < grid; ++b) {
    for (int w0 = 0; w0 < block; w0 += kWarp) {
      Warp warp;
      std::vector<std::thread> lanes;
      lanes.reserve(kWarp);
      for (int l = 0; l < kWarp; ++l) {
        lanes.emplace_back([&, l] {
          Lane me;
          me.thread_idx.x = static_cast<unsigned>(w0 + l);
          me.block_idx.x = static_cast<unsigned>(b);
          me.grid_dim.x = static_cast<unsigned>(grid);
          me.block_dim.x = static_cast<unsigned>(block);
          me.warp = &warp;
          current = &me;
          kernel();
          warp.exited[l] = true;
          warp.meet.arrive_and_drop();
          current = nullptr;
        });
      }
      for (auto& t : lanes) t.join();
    }
  }
}

}  // namespace kvb_emu

#define threadIdx (::kvb_emu::current->thread_idx)
#define blockIdx (::kvb_emu::current->block_idx)
#define gridDim (::kvb_emu::current->grid_dim)
#define blockDim (::kvb_emu::current->block_dim)

inline float __shfl_xor_sync(unsigned mask, float v, int offset) { return ::kvb_emu::shfl_xor(mask, v, offset); }
inline float __uint_as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
