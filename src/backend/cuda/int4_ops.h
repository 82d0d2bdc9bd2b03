// INT4 weights on the GPU (W4A16): GPTQ and AWQ 4-bit checkpoints repacked at load into one
// device layout, the decode projection that reads it (int4 codes turned into bf16 in registers,
// bf16 x bf16 -> f32 on the tensor cores), the dequantization to bf16 that larger batches take
// before cuBLASLt, and the activation gather of act-order (desc_act) checkpoints.
// Internal to src/backend/cuda.
//
// Device layout of one matrix W [n_out, n_in] (y = x W^T), after the input channels are put in
// the physical order `perm` (act order: channels sorted by group; else the identity):
//  - codes: uint32 [n_out, n_in / 8], 4-bit unsigned codes q. Physical column k of a row lives in
//    word 16 T + 4 t + c, nibble 4 (e % 2) + e / 2, where T = k / 128, c = (k % 128) / 32,
//    t = (k % 32) / 8, e = k % 8 (int4_word_of, int4_nibble_of). So the 16-byte load of lane
//    t of a tile T holds, per 32-column chunk c, the 8 columns 32 c + 8 t .. + 7 that the bf16
//    skinny GEMM's lane t reads of x (skinny_gemm.cuh), and a shift and a mask of one word give
//    the bf16 pairs {k, k + 1} of a mma.sync A fragment with an exponent OR-ed in (below).
//  - meta: uint32 [n_out, n_groups]: bits 0-15 the group's scale s as stored (f16 or bf16 bits,
//    scale_f16 says which), bits 16-31 the bf16 bits of 128 + z (z the zero point, 0..16).
//    W[n, perm[k]] = s[n, k / G] * (q[n, k] - z[n, k / G]) (GPTQ v1 stores z - 1, AWQ z itself;
//    model/quantized_matrix.h has the checkpoint formulas).
// The decode kernel forms q - z exactly as bf16 ((128 + q) - (128 + z), the "magic number"
// conversion: q OR-ed into the mantissa of 128.0), sums x (q - z) over each 32-column chunk on the
// tensor cores (exact products, f32 sums) and multiplies the chunk's sum by s in f32: the result
// is the f32 dot product of x with the exactly dequantized weights, with no bf16 rounding of W.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

// One INT4 matrix on the device (layout above). group_size: a power of two from 32, or n_in for
// one group per row. perm: [n_in] int32, physical column k holds input channel perm[k]; null for
// the identity.
struct Int4Matrix {
  const uint32_t* codes = nullptr;
  const uint32_t* meta = nullptr;
  const int32_t* perm = nullptr;
  int64_t n_in = 0, n_out = 0, group_size = 0;
  bool scale_f16 = true;
  int64_t n_groups() const { return group_size > 0 ? n_in / group_size : 0; }
};

// Whether a matrix of this shape can take the layout: n_in a positive multiple of 128 (whole
// 16-byte loads per lane), group_size a power of two >= 32 dividing n_in, or n_in itself.
bool int4_layout_supports(int64_t n_in, int64_t n_out, int64_t group_size);

// The layout's place of physical column k of a row: its word and the nibble in it.
inline int64_t int4_word_of(int64_t k) { return 16 * (k / 128) + 4 * ((k % 32) / 8) + (k % 128) / 32; }
inline int int4_nibble_of(int64_t k) { return static_cast<int>(4 * (k % 2) + (k % 8) / 2); }
// One meta word: the scale's 16 bits as stored and the zero point z (0..16).
inline uint32_t int4_meta_word(uint16_t scale_bits, int zero) {
  // bf16 of 128 + z: exponent of 128 (0x4300), z in the top mantissa bits below 2^7.
  return scale_bits | (static_cast<uint32_t>(0x4300 | zero) << 16);
}

// Host side of the repack at load.
// The act-order permutation: the input channels sorted by group (stable), so that physical
// columns [g G, (g + 1) G) are group g's. g_idx [n_in] in [0, n_in / G). Returns false when a
// group does not have exactly G members (the layout cannot hold it); perm is left empty when the
// order is already k / G (no permutation needed).
bool int4_act_order_perm(const int32_t* g_idx, int64_t n_in, int64_t group_size, std::vector<int32_t>& perm);
// Packs n_rows rows of codes q [n_rows, n_in] (one code 0..15 per byte, input-channel order) into
// words [n_rows, n_in / 8] of the layout, physical column k taking channel perm[k] (perm null:
// the identity). n_in a multiple of 128.
void pack_int4_rows(const uint8_t* q, int64_t n_rows, int64_t n_in, const int32_t* perm, uint32_t* words);

// Decode projection over INT4 weights (int4_gemm.cuh): y[t, o] = sum_k a(x)[t, perm[k]] W[o, perm[k]]
// with the products of x and q - z exact and f32 sums, one f32 multiply by each chunk's scale, one
// rounding of the output to bf16. Operands as ProjectionOperands (x rows x_stride apart; SwiGLU
// input [gate | up] rows of 2 n_in; bf16 output only; `w` unused). With a perm, x must already be
// gathered into physical order (int4_gather_columns) and swiglu is false. Up to
// kInt4SkinnyMaxTokens tokens, in launches of at most 32 (each reads W once).
// unroll (tiles of 128 columns per warp step: 1, 2), row_groups (16-row groups per block: 1, 2)
// and warps (4, 8) pick a variant for benchmarks (all 0: the default).
// Errors: kestrel::Error for an unsupported shape, stride, alignment or unbuilt variant.
constexpr int64_t kInt4SkinnyMaxTokens = 64;
struct SkinnyInt4Args : ProjectionOperands {
  Int4Matrix w4;
  int unroll = 0;
  int row_groups = 0;
  int warps = 0;
};
bool skinny_gemm_int4_supports(int64_t n_tokens, const Int4Matrix& w);
void skinny_gemm_int4(const SkinnyInt4Args& args, cudaStream_t stream);

// Streaming GEMV over INT4 weights for one or two tokens: groups of 128 on stream_gemv_w4a16.cuh
// (with stages 0), other group sizes (or stages 4 / 6) on stream_gemv_narrow.cuh; their headers
// have the designs.
// y[t, o] = sum_k a(x)[t, k] W[o, k] for a matrix without act order (perm null), the products of x
// and q - z exact, f32 sums over each 128-column tile (tensor cores) times its group scale, the
// tiles' sums in a fixed order (the same bits for a row whatever the launch), one rounding to bf16. The operands and the fused
// input norm as StreamGemvArgs (`w` unused, bf16 output only). n_in a multiple of 2048 up to
// kStreamGemvMaxIn; group_size a power of two >= 128 (a lane's 32 codes in one group); at most
// kStreamGemvMaxRowsPerBlock rows per block; blocks and stages as for stream_gemv.
// Errors: kestrel::Error for an unsupported shape or a bad operand (as stream_gemv).
struct StreamGemvInt4Args : StreamGemvArgs {
  Int4Matrix w4;
};
bool stream_gemv_int4_supports(int64_t n_tokens, const Int4Matrix& w, int blocks = 0, int stages = 0);
void stream_gemv_int4(const StreamGemvInt4Args& args, cudaStream_t stream);

// out [n_out, n_in] bf16 = W in the input channels' own order (column perm[k] from physical k):
// s * (q - z) in f32 rounded to bf16 (round to nearest even), the values WeightUploader makes
// from the checkpoint on the host, bit for bit. For cuBLASLt at batches above
// kInt4SkinnyMaxTokens. Errors: kestrel::Error for an unsupported shape.
void dequantize_int4(const Int4Matrix& w, bf16* out, cudaStream_t stream);

// Act order: xp[t, k] = a(x)[t, perm[k]] for k < n_in, where a is the identity or, with swiglu,
// silu(gate) * up rounded to bf16 as silu_mul rounds it (x rows [gate | up] of 2 n_in).
// x rows x_stride apart; xp [n_tokens, n_in] bf16. Errors: kestrel::Error for a bad shape.
void int4_gather_columns(const bf16* x, int64_t x_stride, const int32_t* perm, int64_t n_tokens, int64_t n_in,
                         bool swiglu, bf16* xp, cudaStream_t stream);

}  // namespace kestrel::cuda
