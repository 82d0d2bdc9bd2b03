// The dense layers' matrix product on the GPU through cuBLASLt:
//   y[n_tokens, n_out] = x[n_tokens, n_in] . W^T,  W [n_out, n_in] row-major (as checkpoints store
// weights), bf16 operands, f32 accumulation (CUBLAS_COMPUTE_32F), y bf16 (activations) or f32
// (logits). In cuBLAS's column-major terms this is C[n_out, n_tokens] = op_T(W) . X, the "TN"
// layout its kernels are fastest in.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

enum class GemmOutput { Bf16, F32 };

// The W8A8 GEMMs that run_fp8 computes unscaled, then scales (see there).
constexpr int64_t kFp8UnscaledMaxTokens = 128;
inline bool fp8_unscaled(int64_t n_tokens, int64_t n_out) {
  return n_tokens <= kFp8UnscaledMaxTokens && n_out % 8 == 0;
}
// The W8A8 products left unscaled for a consumer that scales them on the way in
// (CudaModelRunner::gemm_fp8): those over at most kFp8DeepInput inputs at any size, deeper ones up
// to kFp8DeepUnscaledMaxTokens tokens. Measured on an H100 (kestrel_cuda_bench fp8scalar, Llama-3.1-8B
// shapes): cuBLASLt's GEMM without scales beat its outer-vector-scale one by 6-21% for o (4096 ->
// 4096) and gate|up (4096 -> 28672) at 256-2048 tokens, and for down (14336 -> 4096) up to 512
// tokens, but lost 3% to it at 1024 and 2048.
constexpr int64_t kFp8DeepInput = 8192, kFp8DeepUnscaledMaxTokens = 512;
inline bool fp8_unscaled_deferred(int64_t n_tokens, int64_t n_in, int64_t n_out) {
  return n_out % 8 == 0 && (n_in <= kFp8DeepInput || n_tokens <= kFp8DeepUnscaledMaxTokens);
}

// Owns one cuBLASLt handle and its workspace (on the device current at construction) and caches,
// per (n_tokens, n_in, n_out, output type), the descriptors and the algorithm cuBLASLt's heuristic
// chose. Not thread-safe: one per stream-owning thread.
class Gemm {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;  // NVIDIA's advice for Hopper

  explicit Gemm(size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // x [n_tokens, n_in] bf16, w [n_out, n_in] bf16, y [n_tokens, n_out] bf16 or f32 by `out`; device
  // pointers, 16-byte aligned. Enqueued on stream; never synchronises.
  // Errors: kestrel::Error for a non-positive size, a misaligned pointer, no algorithm for the
  // shape, or a cuBLASLt failure (status name, call, file and line).
  void run(const bf16* x, const bf16* w, void* y, GemmOutput out, int64_t n_tokens, int64_t n_in, int64_t n_out,
           cudaStream_t stream);

  // W8A8: y [n_tokens, n_out] bf16 = (x_scale[t] * w_scale[o]) * sum_k e4m3(xq[t, k]) * e4m3(wq[o, k]),
  // f32 accumulation on the FP8 tensor cores. xq [n_tokens, n_in], wq [n_out, n_in] E4M3 codes
  // (16-byte aligned, n_in % 16 == 0), x_scale [n_tokens], w_scale [n_out] f32 (device).
  // Up to kFp8UnscaledMaxTokens tokens (fp8_unscaled) the codes' product is rounded to bf16 and then
  // scaled (scale_fp8_product: a second rounding, within one bf16 ulp more): at 16-128 tokens
  // cuBLASLt has one kernel for outer-vector scales and faster ones without (the 8B's o and down
  // projections at 64 tokens: 14.7 and 39.8 us against 9.5 and 24.4 on an H100;
  // docs/performance.md). Above, the scales are cuBLASLt's (one rounding).
  // Errors: as run(), and for missing scales.
  void run_fp8(const uint8_t* xq, const float* x_scale, const uint8_t* wq, const float* w_scale, bf16* y,
               int64_t n_tokens, int64_t n_in, int64_t n_out, cudaStream_t stream);

  // The codes' product alone: y [n_tokens, n_out] bf16 = sum_k e4m3(xq[t, k]) * e4m3(wq[o, k]),
  // for run_fp8 (then scale_fp8_product) or a consumer that applies x_scale[t] * w_scale[o] as
  // scale_fp8_product would (add_rms_norm_fp8, silu_mul_fp8; fp8_unscaled_deferred). Operands and
  // errors as run_fp8's (no scales), and kestrel::Error unless n_out % 8 == 0.
  void run_fp8_unscaled(const uint8_t* xq, const uint8_t* wq, bf16* y, int64_t n_tokens, int64_t n_in, int64_t n_out,
                        cudaStream_t stream);

  // Times up to kTuneCandidates of cuBLASLt's heuristic algorithms for this shape, each over every
  // matrix of `ws` in turn (all [n_out, n_in]; pass a model's layers, so the weights stream from
  // device memory as in a forward pass instead of sitting in L2), and makes the fastest the one
  // run() uses for the shape. The heuristic's first choice is kept unless another is faster by more
  // than 3%. With split_k, the candidates include split-K variants (f32 reduction) of those that
  // support it. Enqueues on stream and synchronises it; x and y as in run() (their contents are
  // not read for the result). Returns the chosen candidate's index (0 = the
  // heuristic's first choice; past the heuristic's list, a split-K variant). Errors: as run().
  static constexpr int kTuneCandidates = 8;
  int tune(const bf16* x, const bf16* const* ws, size_t n_ws, void* y, GemmOutput out, int64_t n_tokens,
           int64_t n_in, int64_t n_out, cudaStream_t stream, bool split_k = true);

  size_t cached_shapes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::cuda
