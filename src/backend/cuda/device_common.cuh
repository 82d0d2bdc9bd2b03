// Device helpers shared by the kernels of this folder: bf16 packing, warp and block reductions,
// and thin wrappers over the PTX instructions the attention kernel uses (ldmatrix, mma.sync
// m16n8k16 bf16, cp.async). Under KESTREL_CUDA_EMULATE (emulate.h) the same functions run on the
// host, so the kernels can be tested on a machine without a GPU; the fragment layouts emulated
// here are those of the PTX ISA ("Matrix fragments for mma.m16n8k16", "ldmatrix").
#pragma once

#if defined(KESTREL_CUDA_EMULATE)
#include "backend/cuda/emulate.h"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "backend/cuda/cuda_check.h"

// Kernel launch and dynamic shared memory, spelled once for both builds.
// Every launch asks for programmatic dependent launch (PDL; CUDA Programming Guide, "Programmatic
// Dependent Launch and Synchronization"): the next kernel in the stream may be scheduled while
// this one drains. So EVERY kernel of this folder starts with KESTREL_PDL_ENTRY() (wait for the
// previous kernel's results, then let the next kernel launch) before it touches global memory,
// except for reads of data no kernel writes (weights), which may come first: skinny_gemm streams
// its first weight tiles before it waits. No load of the previous kernel's output may execute
// before the wait, in source or in the compiled code: ptxas may move a read-only-path load
// (ld.global.nc, which a const __restrict__ dereference can become) above griddepcontrol.wait,
// so kernels with work before the wait read such data with ld_dependent16, and
// scripts/device/pdl_audit.py fails on any compiler-made read-only load before a wait in the
// SASS (the device test calls run it). cuBLASLt's kernels and memcpys in between are ordinary
// stream dependencies. Off with KESTREL_PDL=0 (pdl_enabled).
#if defined(KESTREL_CUDA_EMULATE)
#define KESTREL_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::kestrel::cuda::emu::launch((grid), (block), (smem), [&] { kernel(__VA_ARGS__); })
#define KESTREL_DYNAMIC_SMEM(name) unsigned char* name = ::kestrel::cuda::emu::dynamic_smem()
#else
#define KESTREL_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::kestrel::cuda::launch_pdl((kernel), (grid), (block), (smem), (stream), __VA_ARGS__)
#define KESTREL_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
#define KESTREL_PDL_ENTRY()            \
  do {                                 \
    ::kestrel::cuda::pdl_wait();       \
    ::kestrel::cuda::pdl_launch_next(); \
  } while (0)

namespace kestrel::cuda {

// griddepcontrol (PTX ISA, sm_90): wait until the grids this one depends on have completed and
// their writes are visible; allow the dependent grid to be scheduled. No-ops without PDL.
__device__ __forceinline__ void pdl_wait() {
#if !defined(KESTREL_CUDA_EMULATE)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Brings the line holding p into L1 (a hint; no fault, nothing returned).
__device__ __forceinline__ void prefetch_l1(const void* p) {
#if !defined(KESTREL_CUDA_EMULATE)
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}
// Brings the 128-byte line holding p into L2 (a hint; no fault, nothing returned).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if !defined(KESTREL_CUDA_EMULATE)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}
__device__ __forceinline__ void pdl_launch_next() {
#if !defined(KESTREL_CUDA_EMULATE)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 16 bytes of a stream read once (weights, which no kernel writes): the read-only path, no L1
// allocation; may be issued before pdl_wait().
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}

// A weight stream's 4 or 8 bytes (scales, meta words, a K-quant super-block's scales that
// neighbouring lanes read again from L2): the read-only path without L1 allocation, like
// ld_stream16, so it may come before pdl_wait() (the no-allocate form is what pdl_audit.py takes
// for a weight stream).
__device__ __forceinline__ uint32_t ld_stream4(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint2 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
#endif
}

// 16 bytes that the preceding grid wrote, read after pdl_wait(): ld.global.cg (cached at L2 only,
// coherent), as volatile asm, so it stays where it is written. A plain dereference of a
// const __restrict__ pointer becomes ld.global.nc, the read-only path, which assumes the data does
// not change while the kernel runs; under PDL it does (the previous grid is still writing). In
// stream_gemv, whose weight cp.asyncs precede the wait, such loads returned the previous step's
// data on the H200 (one token; the decode check and CudaPdlInputs.GemvReadsWhatThePrecedingKernelWrote).
__device__ __forceinline__ uint4 ld_dependent16(const void* p) {
#if defined(KESTREL_CUDA_EMULATE)
  uint4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
#endif
}

// Element offset of (slot, KV head) in one layer's paged cache [n_blocks, n_head_kv, block_size,
// head_dim] (KvCache::offset): head_dim elements follow.
__device__ __forceinline__ int64_t kv_slot_offset(int64_t slot, int32_t head, int32_t n_head_kv, int32_t block_size,
                                                  int32_t head_dim) {
  return ((slot / block_size * n_head_kv + head) * block_size + slot % block_size) * head_dim;
}

// One RoPE rotation of the pair (x0, x1) by the angle whose cosine and sine are c and s:
// y0 = x0 c - x1 s, y1 = x0 s + x1 c, each as one fma over a rounded product, spelled out so that
// every kernel that rotates (rope_write_kv, the decode attention's fused RoPE) gives the same bits.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float& y0, float& y1) {
  y0 = fmaf(x0, c, -(x1 * s));
  y1 = fmaf(x0, s, x1 * c);
}

// The RoPE angle of frequency inv_freq at a position (divided by position_scale, linear scaling),
// in double like the CPU backend's rope (ops.cpp), as the cosine and sine rounded to float.
__device__ __forceinline__ void rope_cos_sin(int32_t position, float position_scale, float inv_freq, float& c,
                                             float& s) {
  const double pos = static_cast<double>(position) / static_cast<double>(position_scale);
  double sd, cd;
  sincos(pos * static_cast<double>(inv_freq), &sd, &cd);
  c = static_cast<float>(cd);
  s = static_cast<float>(sd);
}

#if !defined(KESTREL_CUDA_EMULATE)
// kernel<<<grid, block, smem, stream>>>(args...) with the programmatic-stream-serialization
// attribute when pdl_enabled(). Errors: kestrel::Error for a failed launch.
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
#endif

constexpr int kWarpSize = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Lets a kernel use more than the default 48 KB of dynamic shared memory.
template <class Kernel>
void set_max_dynamic_smem(Kernel kernel, size_t bytes) {
#if defined(KESTREL_CUDA_EMULATE)
  (void)kernel;
  (void)bytes;
#else
  if (bytes > 48 * 1024)
    KESTREL_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
#endif
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

// 8 bf16 (one 16-byte load) to f32 and back.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, returned to every thread. blockDim.x: a multiple of 32, at most 1024;
// scratch: 32 floats of shared memory. Contains two __syncthreads: call it from all threads.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int n_warps = static_cast<int>(blockDim.x) / kWarpSize;
  v = warp_reduce_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = warp_reduce_sum(lane < n_warps ? scratch[lane] : 0.0f);
  __syncthreads();  // scratch can be reused
  return v;
}

#if defined(KESTREL_CUDA_EMULATE)
inline uint32_t emu_bits(const void* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}
inline float emu_bf16(uint32_t packed, int half) {
  return __uint_as_float(half ? (packed & 0xffff0000u) : (packed << 16));
}
inline void emu_ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const void* rows[32];
  emu::warp_exchange(&row, sizeof row, rows);
  const int lane = emu::lane_id();
  for (int i = 0; i < 4; ++i) {
    uint32_t e[2];
    for (int j = 0; j < 2; ++j) {
      const int rr = trans ? (lane % 4) * 2 + j : lane / 4;
      const int cc = trans ? lane / 4 : (lane % 4) * 2 + j;
      e[j] = emu_bits(static_cast<const unsigned char*>(rows[i * 8 + rr]) + cc * 2);
    }
    r[i] = e[0] | (e[1] << 16);
  }
}
inline void emu_mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  };
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Frag all[32];
  emu::warp_exchange(&mine, sizeof mine, all);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = (l % 4) * 2;
    for (int j = 0; j < 2; ++j) {
      A[g][c + j] = emu_bf16(all[l].a[0], j);
      A[g + 8][c + j] = emu_bf16(all[l].a[1], j);
      A[g][c + 8 + j] = emu_bf16(all[l].a[2], j);
      A[g + 8][c + 8 + j] = emu_bf16(all[l].a[3], j);
      B[c + j][g] = emu_bf16(all[l].b[0], j);
      B[c + 8 + j][g] = emu_bf16(all[l].b[1], j);
    }
  }
  const int lane = emu::lane_id();
  const int g = lane / 4, c = (lane % 4) * 2;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = c + (i & 1);
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] += s;
  }
}
#else
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// ldmatrix .x4: lane l gives the address of row l % 8 of 8x8 matrix l / 8 (16 bytes of bf16 in
// shared memory); r[i] receives matrix i's elements (l / 4, 2 (l % 4) + {0, 1}), or with .trans
// the elements (2 (l % 4) + {0, 1}, l / 4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(KESTREL_CUDA_EMULATE)
  emu_ldmatrix_x4(r, row, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row))
               : "memory");
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(KESTREL_CUDA_EMULATE)
  emu_ldmatrix_x4(r, row, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row))
               : "memory");
#endif
}

// d += A (16x16, row-major fragment a) * B (16x8, column fragment b), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(KESTREL_CUDA_EMULATE)
  emu_mma_16816(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// 16 bytes global -> shared without passing through registers; when !valid the 16 bytes are
// zero-filled instead (gmem must still be a valid address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(KESTREL_CUDA_EMULATE)
  emu::async_copy16(smem, gmem, valid ? 16 : 0);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(__cvta_generic_to_global(gmem)), "r"(valid ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(KESTREL_CUDA_EMULATE)
  emu::async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(KESTREL_CUDA_EMULATE)
  emu::async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace kestrel::cuda
