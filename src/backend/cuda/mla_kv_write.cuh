// The per-token preparation of multi-head latent attention (mla_ops.h, mla_kv_write): the latent's
// RMSNorm and the RoPE key's rotation written as one cache row, and the low-rank query's RMSNorm.
// One block per token: the cos / sin table of its position in shared memory first (in double, as
// rope_write_kv), then each norm's sum of squares over the block, then the element-wise writes.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mla_ops.h"

namespace kestrel::cuda {

constexpr int kMlaKvWriteThreads = 128;

// Sum of x[i]^2 over this thread's i (i = threadIdx.x + j blockDim.x, i < dim), f32.
__device__ __forceinline__ float mla_sum_squares(const __nv_bfloat16* x, int dim) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = __bfloat162float(x[i]);
    ss += v * v;
  }
  return ss;
}

// out[i] = x[i] * inv * w[i] for this thread's i, inv = rsqrt(mean(x^2) + eps) from the block's sum.
__device__ __forceinline__ void mla_scale_row(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out,
                                              int dim, float inv) {
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    out[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * inv * __bfloat162float(w[i]));
}

// grid (n_tokens), kMlaKvWriteThreads threads, dynamic shared memory rope_dim floats. The rows'
// loads and sums of squares are issued before the position's cos / sin (double precision, the
// longest step of a decode token's block), and the block reductions' barriers publish the table.
__global__ void __launch_bounds__(kMlaKvWriteThreads) mla_kv_write_kernel(MlaKvWriteArgs a) {
  KESTREL_PDL_ENTRY();
  KESTREL_DYNAMIC_SMEM(smem);
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const int half = a.rope_dim / 2, r = a.kv_lora_rank;
  float* cs = reinterpret_cast<float*>(smem);
  float* sn = cs + half;
  const int32_t pos = a.positions[t];
  const int64_t slot = a.slot_mapping[t];
  const __nv_bfloat16* x = a.kv + t * a.kv_stride;
  const __nv_bfloat16* qa = a.qa != nullptr ? a.qa + t * a.qa_stride : nullptr;
  const float ss_kv = mla_sum_squares(x, r);
  const float ss_qa = qa != nullptr ? mla_sum_squares(qa, a.q_lora_rank) : 0.0f;
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cos_sin(pos, a.position_scale, a.inv_freq[i], cs[i], sn[i]);
  const float inv_kv = rsqrtf(block_reduce_sum(ss_kv, scratch) / static_cast<float>(r) + a.eps);
  if (qa != nullptr) {
    const float inv_qa = rsqrtf(block_reduce_sum(ss_qa, scratch) / static_cast<float>(a.q_lora_rank) + a.eps);
    mla_scale_row(qa, a.qa_norm, a.qa_out + t * a.q_lora_rank, a.q_lora_rank, inv_qa);
  }
  if (slot < 0) return;
  // Row offset of the slot in [n_blocks, block_size, r + R] (one KV head).
  __nv_bfloat16* row = a.cache + kv_slot_offset(slot, 0, 1, a.block_size, r + a.rope_dim);
  mla_scale_row(x, a.kv_norm, row, r, inv_kv);
  for (int p = threadIdx.x; p < half; p += blockDim.x) {
    const int e0 = a.rotate_half ? p : 2 * p, e1 = a.rotate_half ? p + half : 2 * p + 1;
    float y0, y1;
    rope_rotate(__bfloat162float(x[r + e0]), __bfloat162float(x[r + e1]), cs[p], sn[p], y0, y1);
    row[r + e0] = __float2bfloat16_rn(y0);
    row[r + e1] = __float2bfloat16_rn(y1);
  }
}

}  // namespace kestrel::cuda
