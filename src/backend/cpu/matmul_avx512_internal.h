// Kernels of matmul_other_avx512.cpp (K-quants, F32, F16, BF16) and matmul_amx.cpp called by
// the AVX-512 kernel table in matmul_avx512.cpp. Only call after checking that the CPU has AVX-512.
#pragma once

#include "backend/cpu/matmul_kernels.h"

namespace kestrel::cpu::detail {

// Quantizes one token for K-quant weights into ActLayoutK (same bytes as the scalar path).
void avx512_quantize_act_k(const float* x, int64_t n_in, bool bits8, uint8_t* dst);
// y rows [r0, r1) for K-quant, F32, F16 and BF16 weights.
void avx512_matmul_other(const MatmulArgs& a, int64_t r0, int64_t r1);

// AMX (matmul_amx.cpp), for 32-element block weights and several tokens. amx_usable() checks
// CPUID and asks Linux for the tile state (once); the others may only be called when it is true.
bool amx_usable();
size_t amx_act_bytes(int64_t n_in, int64_t n_tokens);
void amx_quantize_acts(const float* x, int64_t n_in, int64_t n_tokens, int64_t t0, int64_t t1, bool bits8,
                       uint8_t* dst);
size_t amx_scratch_bytes(int64_t n_in);
void amx_matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, uint8_t* scratch);

}  // namespace kestrel::cpu::detail
