// Helpers for the CUDA op tests: device buffers, bf16 on the host, random data, error norms, and
// the skip when there is no GPU. Under KESTREL_CUDA_EMULATE (kestrel_cuda_emu_tests) "device"
// memory is host memory with guard bytes on both sides, checked on every download, so a kernel
// writing out of bounds fails the test.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"

namespace kestrel::test {

// True in kestrel_cuda_emu_tests (the kernels on the CPU emulation, slow): tests keep their
// emulated shapes small and add bigger ones only on a real GPU.
#if defined(KESTREL_CUDA_EMULATE)
inline constexpr bool kCudaEmulated = true;
#else
inline constexpr bool kCudaEmulated = false;
#endif

// Model-level tests on the emulation: the bf16 skinny GEMM costs about a second per decode step of
// a 32000-row LM head there (2000 blocks of fibers), the plain loop standing in for cuBLASLt a few
// milliseconds, so few-token projections take the latter (skinny_max_tokens 0). The skinny kernel
// itself is checked in test_cuda_skinny_gemm.cpp; on a GPU the default kernels run.
template <class RunnerOptions>
void skip_skinny_gemm_if_emulated(RunnerOptions& o) {
  if constexpr (kCudaEmulated) o.cuda.skinny_max_tokens = 0;
}

// Why no CUDA device can be used ("" when one can). Asked once per process.
inline const std::string& cuda_unavailable_reason() {
  static const std::string reason = [] {
#if defined(KESTREL_CUDA_EMULATE)
    return std::string();
#else
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    }
    return n == 0 ? std::string("cudaGetDeviceCount returned 0 devices") : std::string();
#endif
  }();
  return reason;
}

// Waits for the device; a kernel fault surfaces here as kestrel::Error.
inline void sync_device() {
#if !defined(KESTREL_CUDA_EMULATE)
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A device allocation of n elements of T (T = uint16_t for bf16 data).
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
#if defined(KESTREL_CUDA_EMULATE)
    raw_ = static_cast<unsigned char*>(std::aligned_alloc(kGuard, kGuard * 2 + round_up(bytes())));
    std::memset(raw_, kCanary, kGuard * 2 + round_up(bytes()));
    ptr_ = reinterpret_cast<T*>(raw_ + kGuard);
#else
    if (n_ > 0) KESTREL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes()));
#endif
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
#if defined(KESTREL_CUDA_EMULATE)
    std::free(raw_);
#else
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
#endif
  }

  T* get() const { return ptr_; }
  cuda::bf16* bf16() const { return reinterpret_cast<cuda::bf16*>(ptr_); }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    if (n_ > 0) KESTREL_CUDA_CHECK(copy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    sync_device();
    std::vector<T> host(n_);
    if (n_ > 0) KESTREL_CUDA_CHECK(copy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
#if defined(KESTREL_CUDA_EMULATE)
    const unsigned char* tail = reinterpret_cast<const unsigned char*>(ptr_) + bytes();
    const size_t tail_bytes = kGuard + round_up(bytes()) - bytes();
    bool intact = true;
    for (size_t i = 0; i < kGuard; ++i) intact = intact && raw_[i] == kCanary;
    for (size_t i = 0; i < tail_bytes; ++i) intact = intact && tail[i] == kCanary;
    EXPECT_TRUE(intact) << "a kernel wrote outside a buffer of " << bytes() << " bytes";
#endif
    return host;
  }
  // All bytes 0xFF: NaN as f32 and as bf16, and an invalid index as int, so that an element no
  // kernel writes fails the comparison.
  void poison() {
#if defined(KESTREL_CUDA_EMULATE)
    std::memset(ptr_, 0xFF, bytes());
#else
    if (n_ > 0) KESTREL_CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes()));
#endif
  }

 private:
#if defined(KESTREL_CUDA_EMULATE)
  static constexpr size_t kGuard = 256;
  static constexpr unsigned char kCanary = 0xA5;
  static size_t round_up(size_t b) { return (b + kGuard - 1) / kGuard * kGuard; }
  static cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
    std::memcpy(dst, src, bytes);
    return cudaSuccess;
  }
  unsigned char* raw_ = nullptr;
#else
  static cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    return cudaMemcpy(dst, src, bytes, kind);
  }
#endif
  size_t n_;
  T* ptr_ = nullptr;
};

// Uniform in [lo, hi), rounded to bf16, never exactly zero (zeros hide unwritten outputs).
inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    float f = dist(rng);
    if (f == 0.0f) f = 0.5f * hi;
    x = to_bf16(f);
  }
  return v;
}
inline std::vector<float> random_f32(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(rng);
    if (x == 0.0f) x = 0.5f * hi;
  }
  return v;
}

inline std::vector<float> bf16_to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = from_bf16(v[i]);
  return f;
}

// ||out - ref|| / ||ref|| (Euclidean norms, in double); +inf if out holds a NaN or an infinity.
inline double rel_error(const std::vector<float>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Runs launch(y) on a poisoned output of n_y elements, f32 or bf16, and returns it as f32 (for
// the GEMV tests' two output types).
template <class Launch>
std::vector<float> run_to_f32(size_t n_y, bool f32_out, Launch&& launch) {
  if (f32_out) {
    DeviceBuffer<float> d_y(n_y);
    d_y.poison();
    launch(static_cast<void*>(d_y.get()));
    return d_y.download();
  }
  DeviceBuffer<uint16_t> d_y(n_y);
  d_y.poison();
  launch(static_cast<void*>(d_y.get()));
  return bf16_to_f32(d_y.download());
}

// y = x . W^T in float64 for the GEMV tests: x [n_tokens, *] bf16 rows x_stride apart, w [n_out,
// n_in] bf16; returns y [n_tokens, n_out].
inline std::vector<double> gemv_reference(const std::vector<uint16_t>& x, int64_t x_stride,
                                          const std::vector<uint16_t>& w, int64_t n_tokens, int64_t n_in,
                                          int64_t n_out) {
  std::vector<double> ref(static_cast<size_t>(n_tokens * n_out));
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      double s = 0.0;
      for (int64_t k = 0; k < n_in; ++k)
        s += static_cast<double>(from_bf16(x[static_cast<size_t>(t * x_stride + k)])) *
             from_bf16(w[static_cast<size_t>(o * n_in + k)]);
      ref[static_cast<size_t>(t * n_out + o)] = s;
    }
  return ref;
}

}  // namespace kestrel::test

#define KESTREL_REQUIRE_CUDA()                                                         \
  do {                                                                                 \
    const std::string& why_ = ::kestrel::test::cuda_unavailable_reason();              \
    if (!why_.empty()) GTEST_SKIP() << "CUDA op test needs a GPU (" << why_ << ")";    \
  } while (0)
