// FP8 E4M3 weights on the GPU (W8A16 skinny decode, W8A8 streaming decode and prefill): row-wise quantization and the
// projections that read E4M3 weight rows with one f32 scale per output row (per-channel
// scaling, as compressed-tensors' "channel" strategy and vLLM's dynamic FP8 store them).
// Internal to src/backend/cuda.
#pragma once

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

// Per-row quantization: scale[r] = max_c |x[r, c]| / 448 (1 for an all-zero row) and
// q[r, c] = e4m3(x[r, c] / scale[r]) (core/fp8.h: round to nearest even, saturating). x [rows, *]
// bf16 rows x_stride elements apart, 16-byte aligned; q [rows, cols] E4M3 codes, 8-byte aligned;
// scale [rows] f32. cols and x_stride multiples of 8. For weights at load ([n_out, n_in]: one scale
// per output channel) and activations per token (W8A8 GEMMs). Errors: kestrel::Error for a bad
// shape or alignment.
void quantize_rows_fp8(const bf16* x, int64_t x_stride, int64_t rows, int64_t cols, uint8_t* q, float* scale,
                       cudaStream_t stream);

// The outer scaling of an unscaled W8A8 product, in place: y[t, o] = bf16(y[t, o] * (x_scale[t] *
// w_scale[o])). y [n_tokens, n_out] bf16 16-byte aligned, w_scale [n_out] and x_scale
// [n_tokens] f32; n_out % 8 == 0. Gemm::run_fp8's second half at few tokens, and the scaling of a
// deferred product whose reader does not scale it (CudaModelRunner::settle_fp8).
// Errors: kestrel::Error for a bad shape or alignment.
void scale_fp8_product(bf16* y, const float* x_scale, const float* w_scale, int64_t n_tokens, int64_t n_out,
                       cudaStream_t stream);

// Producers of a W8A8 GEMM's input in one kernel, each the same bits as its unfused sequence:
// add_rms_norm_fp8 = [scale_fp8_product of `add`] + add_rms_norm + quantize_rows_fp8 of its output;
// silu_mul_fp8 = [scale_fp8_product of gate_up] + silu_mul + quantize_rows_fp8. residual [n_tokens,
// dim] f32 (in/out), add [n_tokens, dim] bf16 or null, weight [dim] bf16; gate_up [n_tokens, 2 n_ff]
// bf16. With add_x_scale [n_tokens] and add_w_scale [dim] (gu_x_scale [n_tokens] and gu_w_scale
// [2 n_ff]) the input is an unscaled W8A8 product (Gemm::run_fp8_unscaled), scaled on the way in;
// null for a scaled one. q [n_tokens, width] E4M3 codes, q_scale [n_tokens] f32 (may be the same
// array as the input's x scale). Widths: a multiple of 8 up to 32,768 (fp8_fused_width_supported),
// rows and vectors (the weight scales too) 16-byte aligned. Errors: kestrel::Error for a bad shape or alignment.
bool fp8_fused_width_supported(int64_t width);
void add_rms_norm_fp8(float* residual, const bf16* add, const float* add_x_scale, const float* add_w_scale,
                      const bf16* weight, uint8_t* q, float* q_scale, int64_t n_tokens, int64_t dim, float eps,
                      cudaStream_t stream);
void silu_mul_fp8(const bf16* gate_up, const float* gu_x_scale, const float* gu_w_scale, uint8_t* q, float* q_scale,
                  int64_t n_tokens, int64_t n_ff, cudaStream_t stream);

// Skinny GEMM over E4M3 weights for decode steps (skinny_gemm_fp8.cu): y[t, o] = w_scale[o] *
// sum_k a(x)[t, k] * e4m3(w[o, k]), the codes widened to bf16 exactly in registers, bf16 x f32
// accumulation on the tensor cores (mma.sync), one rounding of the output. x and a(x) as for
// skinny_gemm (ProjectionOperands; `w` unused); w [n_out, n_in] codes, 16-byte aligned;
// w_scale [n_out] f32. n_in % 16 == 0, at most kSkinnyFp8MaxTokens tokens (more go to the W8A8 GEMM). unroll (1, 2, 4) and
// warps (4, 8) pick a variant for benchmarks (0 = the default).
// Errors: kestrel::Error for an unsupported shape, stride or alignment, or an unbuilt variant.
constexpr int64_t kSkinnyFp8MaxTokens = 16;
struct SkinnyFp8Args : ProjectionOperands {
  const uint8_t* w8 = nullptr;
  const float* w_scale = nullptr;
  int unroll = 0;
  int warps = 0;
};
bool skinny_gemm_fp8_supports(int64_t n_tokens, int64_t n_in, int64_t n_out);
void skinny_gemm_fp8(const SkinnyFp8Args& args, cudaStream_t stream);

// The operands of the W8A8 streaming GEMV below: StreamGemvArgs (`w` unused, bf16 output only)
// with w8 [n_out, n_in] codes and w_scale [n_out] f32, 16-byte aligned.
struct StreamGemvFp8Args : StreamGemvArgs {
  const uint8_t* w8 = nullptr;
  const float* w_scale = nullptr;
};

// Streaming GEMV over E4M3 weights with E4M3 activations (W8A8) for one or two tokens
// (stream_gemv_w8a8.cuh has the design): y[t, o] = w_scale[o] * x_scale[t] * sum_k e4m3(w8[o, k])
// * e4m3(a(x)[t, k] / x_scale[t]), x_scale[t] = max_k |a(x)[t, k]| / 448 (1 for a zero row), the
// activation quantized as quantize_rows_fp8 does, f32 sums (the tensor cores' over 32 products,
// then f32 adds in a fixed order: the same bits for a row whatever the launch), one rounding to
// bf16. n_in a multiple of 2048 up to kStreamGemvMaxIn, at most kStreamGemvMaxRowsPerBlock rows per
// block (`blocks` as for stream_gemv; `stages` unused: a ring of 8 slabs of 16 KB at one token, 6 at two).
// Errors: kestrel::Error for an unsupported shape or a bad operand.
bool stream_gemv_w8a8_supports(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks = 0);
void stream_gemv_w8a8(const StreamGemvFp8Args& args, cudaStream_t stream);

}  // namespace kestrel::cuda
