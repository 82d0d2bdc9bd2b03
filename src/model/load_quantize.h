// Weight quantization at load of a GGUF model (--quantization fp8 / rtn): each dense projection
// (q, k, v, o, gate, up, down) is dequantized from its GGUF type to f32, rounded to bf16 (the
// values the CUDA backend uploads for the unquantized model, "the bf16 model"), and quantized to
// one of the layouts a quantized Hugging Face checkpoint has (model/quantized_matrix.h), so both
// backends run it on their existing paths: the CPU on f32 host copies of the dequantized values,
// CUDA on its FP8 projections (per-row scales) or its INT4 kernels (cuda/int4_ops.h) where the
// shape allows, else on a bf16 upload of the dequantized values. Embeddings, norms and the LM head
// stay as the file has them.
//
//  - fp8: E4M3 codes with one f32 scale per output row, scale = max |w| / 448 (1 for an all-zero
//    row), code = e4m3(w / scale) (core/fp8.h: nearest even, saturating): what cuda/fp8_ops.h's
//    quantize_rows_fp8 makes of a bf16 matrix at load (the CUDA backend's --quantization fp8 on a
//    float checkpoint), as QuantFormat::Fp8 with block 1 x K.
//  - rtn: round-to-nearest asymmetric INT4 (vLLM's "rtn" method), groups of 128 inputs of one
//    output row (the last group shorter when K is not a multiple of 128), as QuantFormat::AwqGemm
//    (zero points stored as they are, 0..15) with f16 scales. Per group over inputs k:
//      lo = min(0, min_k w), hi = max(0, max_k w)
//      s  = the smallest f16 >= (hi - lo) / 15 (1 when hi == lo)
//      z  = round(-lo / s), q_k = clamp(round(w_k / s) + z, 0, 15)   (round: nearest, ties to even)
//    all in float64, and w_k is read back as s (q_k - z). Since s >= (hi - lo) / 15 and 0 lies in
//    [lo, hi], w_k / s + z stays within [-1/2, 15 + 1/2], so |w_k - s (q_k - z)| <= s / 2.
#pragma once

#include <cstdint>

namespace kestrel {

inline constexpr int64_t kRtnGroupSize = 128;

// The smallest f16 value >= x, as its bits (x finite, 0 <= x <= 65504).
uint16_t fp16_round_up(double x);

// RTN INT4 of w [n_out, n_in] f32 (above), group = inputs per group: codes [n_out, n_in] in 0..15,
// scales [n_out, ceil(n_in / group)] f16 bits, zeros [n_out, ceil(n_in / group)] in 0..15.
void rtn_int4_quantize(const float* w, int64_t n_out, int64_t n_in, int64_t group, uint8_t* codes, uint16_t* scales,
                       uint8_t* zeros);

// FP8 E4M3 of one row x [n] (above): writes codes [n], returns the scale.
float fp8_quantize_row(const float* x, int64_t n, uint8_t* codes);

}  // namespace kestrel
