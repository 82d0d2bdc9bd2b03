// GGUF quantized weights kept in their blocks on the GPU (--cuda-gguf-weights in-place): the
// device layout, the host repack into it, and the kernels that read it (gguf_gemv.cuh): a decode
// GEMV that dequantizes in registers, the dequantization of a whole matrix to bf16 for cuBLASLt at
// larger batches, and the embedding lookup. Internal to src/backend/cuda; depends on core/error.h
// only (the block layouts are spelled out here from ggml's ggml-common.h, as core/dtype.h has them).
//
// Device layout of one matrix [n_out, n_in] of one type, rows of n_in / B blocks (B = 32, or 256
// for the K-quants), the same bytes as the GGUF tensor, split in two arrays:
//  - body: [n_out, n_in / B, body_bytes] the block's bytes without its f16 scale d where d would
//    break 4-byte alignment (Q4_0, Q5_0, Q8_0: d first; Q6_K: d last), else the whole block
//    (Q4_1, Q4_K, Q5_K). body_bytes: Q4_0 16 (qs), Q4_1 20, Q5_0 20 (qh then qs), Q8_0 32 (qs),
//    Q4_K 144, Q5_K 176, Q6_K 208 (ql, qh, scales).
//  - d: [n_out, n_in / B] f16 bits, for the split types only (empty for the others).
// So every 4-byte word a kernel reads is aligned, and a lane's load is one 32-bit word.
//
// Values: every kernel forms each weight exactly as cpu::dequantize_row does in f32 (the products
// of the f16 scales and the small integer quants are exact in f32 except Q6_K's (d sc) q, Q4_1's
// + m and the K-quants' - min, which round once, in the CPU's order) and rounds it to bf16 (round
// to nearest even): the values the bf16 upload (WeightUploader) holds, bit for bit. The GEMV then
// multiplies them with bf16 x on the tensor cores (exact products, f32 sums): it differs from the
// bf16 path only in the order of the sums.
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

// The GGUF types kept in place, with ggml's type numbers (GgmlType's values).
enum class GgufQuant : int32_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Whether ggml type number `type` is one of GgufQuant's.
bool gguf_quant_supported(int32_t type);
// Elements per block (32, or 256 for the K-quants), bytes per GGUF block, body bytes per block,
// and whether d is stored apart (body_bytes < block_bytes).
int64_t gguf_block_elems(GgufQuant t);
int64_t gguf_block_bytes(GgufQuant t);
int64_t gguf_body_bytes(GgufQuant t);
inline bool gguf_d_apart(GgufQuant t) { return gguf_body_bytes(t) < gguf_block_bytes(t); }
// Whether a matrix of n_in columns can take the layout: n_in a positive multiple of the block size
// (whole blocks per row) below 2^31.
bool gguf_layout_supports(GgufQuant t, int64_t n_in);

// Host repack: n_rows GGUF rows (src, rows back to back, n_in / B blocks each) into the layout's
// body [n_rows, n_in / B, body_bytes] and d [n_rows, n_in / B] (d unused unless gguf_d_apart).
void gguf_repack_rows(GgufQuant t, const uint8_t* src, int64_t n_rows, int64_t n_in, uint8_t* body, uint16_t* d);

// One matrix on the device (layout above).
struct GgufMatrix {
  GgufQuant type = GgufQuant::Q4_0;
  const uint8_t* body = nullptr;
  const uint16_t* d = nullptr;  // null unless gguf_d_apart(type)
  int64_t n_in = 0, n_out = 0;
};

// Decode GEMV: y[t, y_stride * t + o] = sum_k a(x)[t, k] W[o, k] for t < n_tokens <= kGgufGemvMaxTokens,
// W's values dequantized in registers and rounded to bf16 (above), exact products and f32 sums on
// the tensor cores, one rounding of the output (bf16, or f32 when f32_out). Operands as
// ProjectionOperands (x rows x_stride apart, 16-byte aligned; SwiGLU: [gate | up] rows of 2 n_in,
// silu(gate) * up rounded to bf16 as silu_mul does; `w` unused); y_stride (elements between output
// rows; 0: n_out) lets a part of a stacked projection write its columns of the stacked output.
// Errors: kestrel::Error for an unsupported shape, stride or alignment.
constexpr int64_t kGgufGemvMaxTokens = 8;
struct GgufGemvArgs : ProjectionOperands {
  GgufMatrix wq;
  int64_t y_stride = 0;
};
bool gguf_gemv_supports(int64_t n_tokens, const GgufMatrix& w);
void gguf_gemv(const GgufGemvArgs& args, cudaStream_t stream);

// out [n_out, n_in] bf16 rows out_stride elements apart = W's values (above), for cuBLASLt at batches
// above kGgufGemvMaxTokens. Errors: kestrel::Error for an unsupported shape or alignment.
void dequantize_gguf(const GgufMatrix& w, bf16* out, int64_t out_stride, cudaStream_t stream);

// out[t, :] = W[ids[t], :] * scale in f32 (W's bf16 values, as embedding() reads the bf16 table):
// the token embedding kept in place. A tensor-parallel rank's W holds the vocabulary rows
// [vocab_begin, vocab_begin + n_out): other ids give zero rows. Errors: kestrel::Error for a bad
// shape.
void gguf_embedding(const GgufMatrix& w, const int32_t* ids, int64_t n_tokens, float scale, float* out,
                    cudaStream_t stream, int64_t vocab_begin = 0);

}  // namespace kestrel::cuda
