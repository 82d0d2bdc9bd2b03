// Helpers of the CUDA op benchmarks (bench_cuda_ops.cpp, bench_int4.cpp): device buffers of
// random data and the timing and report of one op.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"

namespace kestrel::bench {

using kestrel::cuda::bf16;

// A device buffer filled with random bf16 (or f32 / int) values from a fast host generator.
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t b) : bytes(b) { KESTREL_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(b, 16))); }
  ~Buf() { (void)cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
  void upload(const void* host) { KESTREL_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice)); }
};

inline uint64_t g_rng = 0x9E3779B97F4A7C15ull;
inline uint32_t next_u32() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return static_cast<uint32_t>(g_rng >> 16);
}
// Uniform in about [-1, 1), as bf16 bits: random mantissa and sign, exponent 2^-1 .. 2^-4.
inline void fill_bf16(Buf& b) {
  std::vector<uint16_t> h(b.bytes / 2);
  for (auto& x : h) {
    const uint32_t r = next_u32();
    x = static_cast<uint16_t>((r & 0x8000u) | ((123u + (r >> 16) % 3u) << 7) | (r & 0x7fu));
  }
  b.upload(h.data());
}
inline void fill_f32(Buf& b) {
  std::vector<float> h(b.bytes / 4);
  for (auto& x : h) x = static_cast<float>(next_u32() % 2000001u) * 1e-6f - 1.0f + 1e-7f;
  b.upload(h.data());
}
template <class T>
inline void fill(Buf& b, const std::vector<T>& v) {
  b.upload(v.data());
}

// Median milliseconds of fn over 20 timed runs after 5 warm-ups.
inline double time_ms(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    KESTREL_CUDA_CHECK(cudaEventRecord(a));
    fn();
    KESTREL_CUDA_CHECK(cudaEventRecord(b));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  KESTREL_CUDA_CHECK(cudaEventDestroy(a));
  KESTREL_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

inline void report(const std::string& op, const std::string& shape, double ms, double bytes, double flops) {
  std::printf("%-16s %-44s %9.1f us", op.c_str(), shape.c_str(), ms * 1e3);
  if (bytes > 0) std::printf("  %7.0f GB/s", bytes / (ms * 1e-3) / 1e9);
  if (flops > 0) std::printf("  %6.1f TFLOP/s", flops / (ms * 1e-3) / 1e12);
  std::printf("\n");
  std::fflush(stdout);
}

// INT4 W4A16 projections against bf16 (bench_int4.cpp).
void bench_int4();
// GGUF blocks in place: the decode GEMV of every kept type against bf16 (bench_gguf.cpp).
void bench_gguf();
void bench_fp8_scalar();
// A decode step's attention and projections on two streams, the batch in two halves (bench_overlap.cpp).
void bench_overlap();
// The streaming GEMVs' per-block timeline over a layer sequence (bench_stream_trace.cpp).
void bench_stream_trace();

}  // namespace kestrel::bench
