// The FP8 (E4M3) paged KV cache on the device (cuda_ops.h, Fp8KvCache): each cached row (one
// token's K or V of one KV head, head_dim values) is stored as E4M3 codes with one f32 scale,
// value = code x scale, scale = amax(row) / 448 (1 for an all-zero row) and code = e4m3(x / scale)
// rounded to nearest even with saturation (core/fp8.h; the convention of quantize_rows_fp8 for
// weights, and of the planner's kv_bytes_per_token: head_dim bytes + 4 per row). Codes
// [n_blocks, n_head_kv, block_size, head_dim] u8 (the bf16 cache's layout, one byte an element),
// scales [n_blocks, n_head_kv, block_size] f32. The writers (rope_write_kv, the decode kernel's
// fused RoPE) quantize the bf16 value the bf16 cache would hold; the attention kernels widen the
// codes exactly, to bf16 (fp8.cuh) or, in the decode kernel at head dims 64 and 128, to f16
// (paged_attention_fp8.cuh), and apply the scales in f32: a key's to its score column, a value's
// to its softmax weight before P V.
#pragma once

#include "backend/cuda/fp8.cuh"

namespace kestrel::cuda {

// 4 bytes global -> shared (cp.async.ca), zero-filled when !valid (gmem must still be a valid
// address). Both 4-byte aligned.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
#if defined(KESTREL_CUDA_EMULATE)
  emu::async_copy(smem, gmem, 4, valid ? 4 : 0);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)),
               "l"(__cvta_generic_to_global(gmem)), "r"(valid ? 4 : 0)
               : "memory");
#endif
}

// Offset of (slot, kv head)'s scale in a layer's scale array [n_blocks, n_head_kv, block_size].
__device__ __forceinline__ int64_t kv_scale_offset(int64_t slot, int32_t head, int32_t n_head_kv, int32_t block_size) {
  return kv_slot_offset(slot, head, n_head_kv, block_size, 1);
}

// One warp quantizes a row of n <= 32 kPer values held by its lanes (lane l holds elements
// l + 32 i in v[i]; the others are ignored) into codes [n] and *scale (lane 0 writes it).
template <int kPer>
__device__ __forceinline__ void warp_quantize_row_e4m3(const float (&v)[kPer], int n, uint8_t* codes, float* scale) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (lane + i * kWarpSize < n) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + i * kWarpSize;
    if (e < n) codes[e] = static_cast<uint8_t>(f32x2_to_e4m3x2(v[i] / s, 0.0f) & 0xFFu);
  }
  if (lane == 0) *scale = s;
}

// Element e of a head after RoPE (before rounding): x the head's head_dim bf16 values, cs / sn its
// cos / sin table; elements at or past rope_dim pass through. rope_write_kv's pairing.
__device__ __forceinline__ float rope_element(const __nv_bfloat16* x, int e, int rope_dim, bool rotate_half,
                                              const float* cs, const float* sn) {
  if (e >= rope_dim) return __bfloat162float(x[e]);
  const int half = rope_dim / 2;
  const int e0 = rotate_half ? (e < half ? e : e - half) : e & ~1;
  const int e1 = rotate_half ? e0 + half : e0 + 1;
  const int i = rotate_half ? e0 : e0 / 2;
  float y0, y1;
  rope_rotate(__bfloat162float(x[e0]), __bfloat162float(x[e1]), cs[i], sn[i], y0, y1);
  return e == e0 ? y0 : y1;
}

// Sixteen E4M3 codes (one 16-byte chunk, element j in byte j) as sixteen bf16 in two 16-byte
// chunks (elements 0..7, 8..15), exactly.
__device__ __forceinline__ void e4m3x16_to_bf16x16(const uint4& c, uint4& lo, uint4& hi) {
  e4m3x4_to_bf16x2(c.x, lo.x, lo.y);
  e4m3x4_to_bf16x2(c.y, lo.z, lo.w);
  e4m3x4_to_bf16x2(c.z, hi.x, hi.y);
  e4m3x4_to_bf16x2(c.w, hi.z, hi.w);
}

}  // namespace kestrel::cuda
