// cuda::Gemm for the CPU emulation of the CUDA backend (KESTREL_CUDA_EMULATE), where cuBLASLt is
// not available: the same product y = x . W^T over bf16 operands with f32 accumulation, as a plain
// loop (row by row, one k order), rounded to bf16 or kept f32 as cuBLASLt would store it (and
// run_fp8's two roundings where it scales after the product). tune() has nothing to choose
// between and keeps candidate 0.
#include <cstring>
#include <string>

#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/gemm.h"
#include "core/error.h"
#include "core/fp8.h"

namespace kestrel::cuda {

namespace {
float bf16_to_f32(const bf16& h) {
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_bf16_bits(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
}  // namespace

struct Gemm::Impl {};

Gemm::Gemm(size_t) : impl_(std::make_unique<Impl>()) {}
Gemm::~Gemm() = default;

void Gemm::run(const bf16* x, const bf16* w, void* y, GemmOutput out, int64_t n_tokens, int64_t n_in, int64_t n_out,
               cudaStream_t) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0)
    throw Error("Gemm: sizes must be positive, got " + std::to_string(n_tokens) + " x " + std::to_string(n_in) +
                " -> " + std::to_string(n_out));
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n_in; ++i) acc += bf16_to_f32(x[t * n_in + i]) * bf16_to_f32(w[o * n_in + i]);
      if (out == GemmOutput::F32) {
        static_cast<float*>(y)[t * n_out + o] = acc;
      } else {
        const uint16_t b = f32_to_bf16_bits(acc);
        std::memcpy(static_cast<unsigned char*>(y) + 2 * (t * n_out + o), &b, 2);
      }
    }
}

void Gemm::run_fp8(const uint8_t* xq, const float* x_scale, const uint8_t* wq, const float* w_scale, bf16* y,
                   int64_t n_tokens, int64_t n_in, int64_t n_out, cudaStream_t stream) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0 || n_in % 16 != 0)
    throw Error("gemm fp8: sizes must be positive and n_in a multiple of 16");
  if (x_scale == nullptr || w_scale == nullptr) throw Error("gemm fp8: missing scales");
  // Unscaled (as the device does it): the codes' product rounded to bf16, then scale_fp8_product.
  if (fp8_unscaled(n_tokens, n_out)) {
    run_fp8_unscaled(xq, wq, y, n_tokens, n_in, n_out, stream);
    scale_fp8_product(y, x_scale, w_scale, n_tokens, n_out, stream);
    return;
  }
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n_in; ++i) acc += e4m3_to_float(xq[t * n_in + i]) * e4m3_to_float(wq[o * n_in + i]);
      const uint16_t b = f32_to_bf16_bits(acc * (x_scale[t] * w_scale[o]));
      std::memcpy(reinterpret_cast<unsigned char*>(y) + 2 * (t * n_out + o), &b, 2);
    }
}

void Gemm::run_fp8_unscaled(const uint8_t* xq, const uint8_t* wq, bf16* y, int64_t n_tokens, int64_t n_in,
                            int64_t n_out, cudaStream_t) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0 || n_in % 16 != 0 || n_out % 8 != 0)
    throw Error("gemm fp8 unscaled: sizes must be positive, n_in a multiple of 16 and n_out of 8 (n_tokens " +
                std::to_string(n_tokens) + ", n_in " + std::to_string(n_in) + ", n_out " + std::to_string(n_out) + ")");
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n_in; ++i) acc += e4m3_to_float(xq[t * n_in + i]) * e4m3_to_float(wq[o * n_in + i]);
      const uint16_t b = f32_to_bf16_bits(acc);
      std::memcpy(reinterpret_cast<unsigned char*>(y) + 2 * (t * n_out + o), &b, 2);
    }
}

int Gemm::tune(const bf16*, const bf16* const*, size_t, void*, GemmOutput, int64_t, int64_t, int64_t, cudaStream_t,
               bool) {
  return 0;
}

size_t Gemm::cached_shapes() const { return 0; }

}  // namespace kestrel::cuda
