// RoPE (Su et al. 2021, RoFormer) on q and k, fused with writing K and V into the paged KV cache.
// One block per token: the block first computes the token's cos/sin table (rope_dim / 2 angles, in
// double like the CPU backend's rope, ops.cpp) into shared memory, then rotates every q and k head
// and writes k and v to the token's slot. The vector kernel moves 8 bf16 (16 bytes) per item.
#pragma once

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/kv_fp8.cuh"

namespace kestrel::cuda {

struct RopeWriteKvArgs {
  // Token t's q heads are read at q_src + t * q_stride and written rotated to q + t * n_head *
  // head_dim (the same place for the in-place form); k heads are read at k + t * k_stride and
  // rotated in place unless k_keep is false (the fused form writes rotated k only to the cache);
  // v heads are read at v + t * v_stride. Strides are in elements.
  const __nv_bfloat16* q_src;
  __nv_bfloat16* q;             // [n_tokens, n_head, head_dim] rotated output
  __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int64_t q_stride, k_stride, v_stride;
  bool k_keep;
  const int32_t* positions;     // [n_tokens]
  const int64_t* slot_mapping;  // [n_tokens]; a negative slot writes nothing to the cache
  const float* inv_freq;        // [rope_dim / 2]
  float position_scale;
  int32_t n_head, n_head_kv, head_dim, rope_dim;
  bool rotate_half;             // pair i with i + rope_dim/2 (HF), else 2i with 2i + 1 (GGUF)
  __nv_bfloat16* k_cache;       // [n_blocks, n_head_kv, block_size, head_dim]
  __nv_bfloat16* v_cache;
  int32_t block_size;
  // An FP8 cache (the kernel's kFp8 form; k_cache and v_cache unused): codes
  // [n_blocks, n_head_kv, block_size, head_dim], scales [n_blocks, n_head_kv, block_size].
  Fp8KvCache fp8;
};

// Offset of (slot, kv head) in a layer's cache; head_dim elements follow.
__device__ __forceinline__ int64_t cache_offset(int64_t slot, int32_t head, const RopeWriteKvArgs& a) {
  return kv_slot_offset(slot, head, a.n_head_kv, a.block_size, a.head_dim);
}

// Rotates 8 elements of one head (vector kernel): item r of the head's rotation items.
// x: the source head; out: where the rotated head goes (may be x, or null for none).
__device__ __forceinline__ void rope_chunk8(const __nv_bfloat16* x, __nv_bfloat16* out, __nv_bfloat16* cache, int r,
                                            const float* cs, const float* sn, const RopeWriteKvArgs& a) {
  const int half = a.rope_dim / 2;
  if (a.rotate_half) {
    const int i0 = 8 * r;
    float lo[8], hi[8], nlo[8], nhi[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(x + i0), lo);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(x + i0 + half), hi);
#pragma unroll
    for (int j = 0; j < 8; ++j) rope_rotate(lo[j], hi[j], cs[i0 + j], sn[i0 + j], nlo[j], nhi[j]);
    const uint4 plo = pack_bf16x8(nlo), phi = pack_bf16x8(nhi);
    if (out != nullptr) {
      *reinterpret_cast<uint4*>(out + i0) = plo;
      *reinterpret_cast<uint4*>(out + i0 + half) = phi;
    }
    if (cache != nullptr) {
      *reinterpret_cast<uint4*>(cache + i0) = plo;
      *reinterpret_cast<uint4*>(cache + i0 + half) = phi;
    }
  } else {
    const int e0 = 8 * r;
    float v[8], y[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(x + e0), v);
#pragma unroll
    for (int p = 0; p < 4; ++p) rope_rotate(v[2 * p], v[2 * p + 1], cs[4 * r + p], sn[4 * r + p], y[2 * p], y[2 * p + 1]);
    const uint4 py = pack_bf16x8(y);
    if (out != nullptr) *reinterpret_cast<uint4*>(out + e0) = py;
    if (cache != nullptr) *reinterpret_cast<uint4*>(cache + e0) = py;
  }
}

// Rotates one pair (scalar kernel): pair i of the head.
__device__ __forceinline__ void rope_pair(const __nv_bfloat16* x, __nv_bfloat16* out, __nv_bfloat16* cache, int i,
                                          const float* cs, const float* sn, const RopeWriteKvArgs& a) {
  const int half = a.rope_dim / 2;
  const int i0 = a.rotate_half ? i : 2 * i;
  const int i1 = a.rotate_half ? i + half : 2 * i + 1;
  float r0, r1;
  rope_rotate(__bfloat162float(x[i0]), __bfloat162float(x[i1]), cs[i], sn[i], r0, r1);
  const __nv_bfloat16 y0 = __float2bfloat16_rn(r0), y1 = __float2bfloat16_rn(r1);
  if (out != nullptr) {
    out[i0] = y0;
    out[i1] = y1;
  }
  if (cache != nullptr) {
    cache[i0] = y0;
    cache[i1] = y1;
  }
}

// An FP8 cache's rows of token t (kFp8): one warp per row (k heads, then v heads), each lane
// holding elements lane + 32 i; k rotated and rounded to bf16 as the bf16 cache would store it.
__device__ __forceinline__ void write_fp8_rows(const RopeWriteKvArgs& a, int64_t t, int64_t slot, const float* cs,
                                               const float* sn) {
  constexpr int kPer = 256 / kWarpSize;  // head_dim <= 256 (attention_supports_head_dim)
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int row = warp; row < 2 * a.n_head_kv; row += static_cast<int>(blockDim.x) / kWarpSize) {
    const bool is_k = row < a.n_head_kv;
    const int h = is_k ? row : row - a.n_head_kv;
    const __nv_bfloat16* x = is_k ? a.k + t * a.k_stride + h * a.head_dim : a.v + t * a.v_stride + h * a.head_dim;
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + i * kWarpSize;
      v[i] = e >= a.head_dim ? 0.0f
             : is_k ? __bfloat162float(__float2bfloat16_rn(rope_element(x, e, a.rope_dim, a.rotate_half, cs, sn)))
                    : __bfloat162float(x[e]);
    }
    const int64_t off = kv_slot_offset(slot, h, a.n_head_kv, a.block_size, a.head_dim);
    const int64_t soff = kv_scale_offset(slot, h, a.n_head_kv, a.block_size);
    warp_quantize_row_e4m3(v, a.head_dim, (is_k ? a.fp8.k : a.fp8.v) + off, (is_k ? a.fp8.k_scale : a.fp8.v_scale) + soff);
  }
}

// grid (n_tokens), blockDim.x a multiple of 32; dynamic shared memory: rope_dim floats.
// kVec: head_dim % 8 == 0 and (rotate_half ? (rope_dim / 2) % 8 : rope_dim % 8) == 0, 16-byte
// aligned tensors. Items per token: the rotation items of every q head; the rotation and
// pass-through items of every k head (k goes to the cache whole); the copy items of every v head.
// kFp8 (out of place only, k_keep false): the q items, then write_fp8_rows for k and v.
template <bool kVec, bool kFp8 = false>
__global__ void rope_write_kv_kernel(RopeWriteKvArgs a) {
  KESTREL_PDL_ENTRY();
  KESTREL_DYNAMIC_SMEM(smem);
  const int64_t t = blockIdx.x;
  const int half = a.rope_dim / 2;
  float* cs = reinterpret_cast<float*>(smem);
  float* sn = cs + half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cos_sin(a.positions[t], a.position_scale, a.inv_freq[i], cs[i], sn[i]);
  __syncthreads();

  const int64_t slot = a.slot_mapping[t];
  const int width = kVec ? 8 : 1;                           // elements per copy item
  const int n_rot = kVec ? (a.rotate_half ? half / 8 : a.rope_dim / 8) : half;
  const int n_pass = (a.head_dim - a.rope_dim) / width;     // k's unrotated tail, copied to the cache
  const int n_copy = a.head_dim / width;
  // Out of place (the fused form), q's unrotated tail is copied too.
  const int n_q_items = n_rot + (a.q_src != a.q ? n_pass : 0);
  const int n_q = a.n_head * n_q_items;
  const int n_k = kFp8 ? 0 : a.n_head_kv * (n_rot + n_pass);
  const int n_total = kFp8 ? n_q : n_q + n_k + a.n_head_kv * n_copy;
  if constexpr (kFp8) {
    if (slot >= 0) write_fp8_rows(a, t, slot, cs, sn);
  }
  for (int idx = threadIdx.x; idx < n_total; idx += blockDim.x) {
    if (idx < n_q) {
      const int h = idx / n_q_items, r = idx % n_q_items;
      const __nv_bfloat16* x = a.q_src + t * a.q_stride + h * a.head_dim;
      __nv_bfloat16* out = a.q + (t * a.n_head + h) * a.head_dim;
      if (r >= n_rot) {
        const int e = a.rope_dim + (r - n_rot) * width;
        if constexpr (kVec) {
          *reinterpret_cast<uint4*>(out + e) = *reinterpret_cast<const uint4*>(x + e);
        } else {
          out[e] = x[e];
        }
      } else if constexpr (kVec) {
        rope_chunk8(x, out, nullptr, r, cs, sn, a);
      } else {
        rope_pair(x, out, nullptr, r, cs, sn, a);
      }
    } else if (idx < n_q + n_k) {
      const int j = idx - n_q;
      const int h = j / (n_rot + n_pass), r = j % (n_rot + n_pass);
      __nv_bfloat16* x = a.k + t * a.k_stride + h * a.head_dim;
      __nv_bfloat16* cache = slot >= 0 ? a.k_cache + cache_offset(slot, h, a) : nullptr;
      if (r < n_rot) {
        if constexpr (kVec) {
          rope_chunk8(x, a.k_keep ? x : nullptr, cache, r, cs, sn, a);
        } else {
          rope_pair(x, a.k_keep ? x : nullptr, cache, r, cs, sn, a);
        }
      } else if (cache != nullptr) {
        const int e = a.rope_dim + (r - n_rot) * width;
        if constexpr (kVec) {
          *reinterpret_cast<uint4*>(cache + e) = *reinterpret_cast<const uint4*>(x + e);
        } else {
          cache[e] = x[e];
        }
      }
    } else if (slot >= 0) {
      const int j = idx - n_q - n_k;
      const int h = j / n_copy, e = (j % n_copy) * width;
      const __nv_bfloat16* x = a.v + t * a.v_stride + h * a.head_dim;
      __nv_bfloat16* cache = a.v_cache + cache_offset(slot, h, a);
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(cache + e) = *reinterpret_cast<const uint4*>(x + e);
      } else {
        cache[e] = x[e];
      }
    }
  }
}

}  // namespace kestrel::cuda
