// Kernels of matmul_other_avx512.cpp (Q4_K, Q6_K, F32, F16, BF16) called by the AVX-512 kernel
// table in matmul_avx512.cpp. Only call after checking that the CPU has AVX-512.
#pragma once

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {

// Quantizes one token for Q4_K / Q6_K weights into ActLayoutK (same bytes as the scalar path).
void avx512_quantize_act_k(const float* x, int64_t n_in, uint8_t* dst);
// y rows [r0, r1) for Q4_K, Q6_K, F32, F16 and BF16 weights.
void avx512_matmul_other(const MatmulArgs& a, int64_t r0, int64_t r1);

}  // namespace kestrel::cpu::detail
