// Host emulation of the CUDA execution model, for running this folder's kernels on a CPU
// (KESTREL_CUDA_EMULATE). The kernels' source is compiled by the host compiler and each launch
// runs its blocks one after another; a block's threads are fibers (cooperative user-level threads,
// one OS thread) that switch only at barriers and warp collectives, in a random order each time,
// so a missing __syncthreads or cp.async wait shows up as a wrong result instead of hiding behind a
// fixed schedule. Emulated: threadIdx/blockIdx/blockDim/gridDim, __syncthreads, __syncwarp,
// __shfl_xor_sync, static and dynamic shared memory (dynamic shared memory is filled with 0xFF,
// a NaN pattern, before each block), cp.async (each copy lands either when issued or at its
// wait_group, at random) and, in device_common.cuh, ldmatrix and mma.sync through warp exchanges.
// atomicAdd, __threadfence, __ballot_sync and __popc are provided too: an atomic is a plain read-modify-write,
// exact because a fiber never switches inside one (so a missing atomic goes unnoticed here).
// Not emulated: timing, occupancy, memory ordering between blocks.
//
// Only device_common.cuh includes this header, and only when KESTREL_CUDA_EMULATE is defined: the
// real build never sees it. Used by the CPU test binary kestrel_cuda_emu_tests (CMakeLists.txt).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

namespace kestrel::cuda::emu {

// The calling fiber's coordinates (valid inside a launch only).
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void sync_block();  // __syncthreads: waits for every live (not yet returned) thread of the block
void sync_warp();   // __syncwarp with a full mask: every lane of the warp must be live
// Warp collective: every lane contributes `bytes` bytes (<= 64) from `mine`; `all` receives the 32
// contributions, lane 0 first.
void warp_exchange(const void* mine, size_t bytes, void* all);
int lane_id();

unsigned char* dynamic_smem();

// cp.async: copies `src_bytes` (0..16) from src and zero-fills the rest of the 16 bytes at dst.
void async_copy16(void* dst, const void* src, int src_bytes);
// cp.async of `size` bytes (4, 8 or 16): `src_bytes` (0..size) from src, the rest of the size zero-filled.
void async_copy(void* dst, const void* src, int size, int src_bytes);
void async_commit();
void async_wait(int n_pending);  // cp.async.wait_group n_pending

// Runs `body` once per thread of every block of the grid (blocks in order, threads as fibers).
// Errors: kestrel::Error on a barrier deadlock (threads of a block waiting on different
// barriers), a warp collective with returned lanes, or a block larger than 1024 threads.
void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body);

}  // namespace kestrel::cuda::emu

// The CUDA built-ins the kernels use, as host code.
#define threadIdx (::kestrel::cuda::emu::thread_idx())
#define blockIdx (::kestrel::cuda::emu::block_idx())
#define blockDim (::kestrel::cuda::emu::block_dim())
#define gridDim (::kestrel::cuda::emu::grid_dim())

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __shared__
#define __shared__ static  // blocks run one at a time, so a static local is one block's shared array
#undef __launch_bounds__
#define __launch_bounds__(...)

inline void __syncthreads() { ::kestrel::cuda::emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::kestrel::cuda::emu::sync_warp(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  T all[32];
  ::kestrel::cuda::emu::warp_exchange(&v, sizeof v, all);
  return all[::kestrel::cuda::emu::lane_id() ^ lane_mask];
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src_lane) {
  T all[32];
  ::kestrel::cuda::emu::warp_exchange(&v, sizeof v, all);
  return all[src_lane & 31];
}
template <class T>
inline unsigned __ballot_sync(unsigned, T predicate) {
  const bool mine = predicate != 0;
  bool all[32];
  ::kestrel::cuda::emu::warp_exchange(&mine, sizeof mine, all);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= all[l] ? 1u << l : 0u;
  return bits;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned all[32];
  ::kestrel::cuda::emu::warp_exchange(&v, sizeof v, all);
  unsigned m = all[0];
  for (int l = 1; l < 32; ++l) m = all[l] > m ? all[l] : m;
  return m;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
  unsigned all[32];
  ::kestrel::cuda::emu::warp_exchange(&v, sizeof v, all);
  unsigned m = all[0];
  for (int l = 1; l < 32; ++l) m = all[l] < m ? all[l] : m;
  return m;
}
inline long long __double_as_longlong(double d) {
  long long b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}
// Fibers switch only at barriers and warp collectives and blocks run one after another, so no other
// thread can run between this read and this write.
template <class T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
inline void __threadfence() {}  // blocks run one after another: every write is already visible
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// PTX prmt (default mode): byte i of the result is byte (s >> 4 i) & 7 of {y:x} (x bytes 0-3).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long xy = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((xy >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
}
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
using std::max;  // CUDA's integer min/max overloads
using std::min;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
