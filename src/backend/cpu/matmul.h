// CPU matrix kernels: y = x · Wᵀ for every weight type kestrel loads from GGUF, plus row
// dequantization.
//
// Quantized weights are used as stored. The activations x are quantized to 16 bits per element
// (blocks of 32 with an f32 scale for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights, super-blocks of
// 256 for the K-quants Q2_K..Q6_K): Q = round(x / d), d = max|x_block| / 32385, kept as two int8
// planes Q = 255 q1 + q2 (|q1|, |q2| <= 127). The products are exact integer dot products of the weight quants with each
// plane (AVX-512 VNNI vpdpbusd, AMX TDPBUSD, AVX2 vpmaddubsw for the K-quants, or plain C++; the
// weights are loaded once for both planes), combined as 255 * sum(w q1) + sum(w q2) and scaled to
// f32 once per weight block (matmul_kernels.h, quantize_block_q16). AVX2 multiplies the 32-element
// formats' quants with Q itself as int16 (vpmaddwd): the same integer sums. The offset terms of Q4_1 / Q5_1 (and of
// Q4_0 / Q5_0 in the SIMD kernels) use the block sum d * sum(Q) on every path.
//
// Error bound. The only extra error besides f32 rounding is the rounding of x: each element moves
// by at most d / 2 = max|x_block| / 64770 (the f32 computation of x / d adds < 1 % of that), so
//   |y - y_exact| <= sum over blocks of max|x_block| / 64770 * sum|w_block|  (x 1.01),
// where y_exact uses the dequantized weights: ~250x tighter than the llama.cpp-style 8-bit
// activations (max|x_block| / 254 per element), which put SmolLM2's logits ~3e-2 (relative to
// max|logit|) away from a float64 reference; 16 bits give 3.3e-4. MatmulWorkspace::activations_8bit
// selects the 8-bit rounding for comparisons. F32 / F16 / BF16 weights multiply f32 activations
// directly (f32 accumulation).
//
// Decode (n_tokens == 1) runs a matrix-vector product split over output rows; prefill
// (n_tokens > 1) runs a blocked GEMM that unpacks a tile of weight rows once per pass of up to 128
// tokens (whose activations stay in L2) and reuses it for every token of the pass (AVX-512: 4 rows
// x 4 tokens in registers; from 8 tokens on, AMX-INT8 tiles of 16 rows x 16 tokens where the CPU
// has them). On AVX-512, 2-4 tokens on the formats whose unpacking takes gathers run the GEMV's
// arithmetic per token instead, the weights loaded once for all of them. Within one SIMD level a token's output is bitwise the same
// whatever else is in the call (GEMV, GEMM or AMX) and however many threads run it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace kestrel {

class ThreadPool;

namespace cpu {

using kestrel::WeightView;  // core/tensor.h

// Reusable scratch of matmul (quantized activations, unpacked weight tiles), one per model runner
// (or per thread that calls matmul). Grows to the largest call seen and is never shrunk; not
// thread-safe: one matmul at a time per workspace.
class MatmulWorkspace {
 public:
  MatmulWorkspace();
  ~MatmulWorkspace();
  MatmulWorkspace(const MatmulWorkspace&) = delete;
  MatmulWorkspace& operator=(const MatmulWorkspace&) = delete;

  // Rounds the activations of quantized-weight matmuls to 8 bits per block (the llama.cpp scheme,
  // ~250x the error of the default 16 bits; see the top of this file) instead of 16. For
  // comparisons only: it is no faster, the kernels are the same.
  bool activations_8bit = false;

  // A 64-byte aligned buffer of at least n_bytes; earlier pointers become invalid when it grows.
  uint8_t* reserve(size_t n_bytes);
  size_t capacity() const { return capacity_; }

 private:
  struct FreeAligned {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, FreeAligned> buffer_;
  size_t capacity_ = 0;
};

// True for the weight types matmul and dequantize_row accept: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool matmul_supports(GgmlType type);

// y[t, o] = sum_i W[o, i] * x[t, i] for t < n_tokens, o < w.n_out.
//   x: [n_tokens, w.n_in] f32, row-major.   y: [n_tokens, w.n_out] f32, row-major (overwritten).
// Uses every thread of `pool`. Throws kestrel::Error for an unsupported type or an n_in that is not
// a multiple of the block size; n_tokens == 0 or n_out == 0 is a no-op.
void matmul(const WeightView& w, const float* x, int64_t n_tokens, float* y, MatmulWorkspace& ws,
            ThreadPool& pool);

// y[i] = x · w[i]ᵀ for matrices that share their input x (same n_in; e.g. q / k / v, gate / up):
// as many matmul() calls, but x is quantized once per weight type and all rows run in one
// fork-join. Each y[i] is bitwise what matmul(w[i], x, n_tokens, y[i], ...) gives. At most 16
// matrices; throws kestrel::Error as matmul() does, or if w and y differ in size or the n_in differ.
void matmul_multi(std::span<const WeightView> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                  MatmulWorkspace& ws, ThreadPool& pool);

// Expands n elements (a multiple of the block size) of one row of `type` at src to f32.
// Follows the block layouts of ggml-common.h (see core/dtype.h). Throws kestrel::Error for a type
// matmul_supports() rejects.
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n);

// sum_i a[i] * b[i] in f32 (SIMD partial sums, so the rounding differs from a serial loop).
float vec_dot_f32(const float* a, const float* b, int64_t n);

// The SIMD level the kernels use: simd_level() (detected, capped by --cpu-isa), further capped
// by set_simd_level_for_testing().
SimdLevel matmul_simd_level();

// Caps the kernels' SIMD level for this process so one test binary can exercise every path; a
// level above what the CPU supports is ignored. Test hook only: not meant to change while another
// thread runs a kernel.
void set_simd_level_for_testing(SimdLevel level);

// True when calls with many tokens (prefill) run on AMX tiles: AVX-512 level, a CPU with
// AMX-INT8 whose OS grants the tile state, and AMX not switched off by set_amx_enabled(false).
// Only 32-element block weights (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) use it.
bool matmul_uses_amx();
// false keeps the AVX-512 kernels off AMX (the CLI's --no-amx; tests and benchmarks compare the
// paths). Not meant to change while another thread runs a kernel.
void set_amx_enabled(bool enabled);

}  // namespace cpu
}  // namespace kestrel
