// The decode kernel's FP8 (E4M3) K/V path at head dims 64 and 128: codes go from a shared-memory
// stage straight into f16 mma fragments (cvt.rn.f16x2.e4m3x2, one instruction per two codes,
// exact: every E4M3 value is an f16 normal or zero), with no bf16 tile in between, and QK^T and PV
// run as mma.sync m16n8k16 f16 with f32 accumulation.
//
// Fragment slots (lane = 4 g + q; PTX ISA, "Matrix fragments for mma.m16n8k16"). A dot product
// does not depend on the order of its terms, so each lane reads contiguous codes and the k and n
// slots are assigned to dims to suit it:
// - QK^T, key group nt (8 keys): lane (g, q) reads key nt * 8 + g's codes [q D/4, (q + 1) D/4),
//   D/16 words; word kk is k-step kk's B fragment: slots 2q, 2q + 1 = dims q D/4 + 4 kk + {0, 1},
//   slots 2q + 8, 2q + 9 = dims q D/4 + 4 kk + {2, 3}. Q's A fragments take the same dims.
// - PV, 16 keys: lane (g, q) reads keys 2q, 2q + 1, 2q + 8, 2q + 9 (P's layout, unchanged), codes
//   [g D/8, (g + 1) D/8); output column 2q + j of n-tile dt (accumulator o[dt][2r + j]) is dim
//   (2q + j) D/8 + dt (fp8_output_dim), which the merge undoes.
// Stage rows are 16-byte chunks XOR-swizzled by row (fp8_chunk), so that both reads hit distinct
// banks at D = 128 (a quarter warp: 2 rows x 4 chunk pairs for K, 4 rows x 2 chunks for V).
//
// Ranges. Q is bf16, whose range exceeds f16's: each query row is scaled by a power of two 2^e
// that puts its largest magnitude in [2^14, 2^15) (exact, the scaled row fits f16; values more
// than 2^28 below the row's largest become f16 subnormals), and e comes off with the K scale.
// P: each weight p <= 1 is multiplied by its key's V scale and by 2^-rho, rho the warp's running
// V exponent (the largest V scale seen is below 2^rho), so the f16 weights are at most 1; the
// accumulator holds O / 2^rho and is rescaled when rho grows (with the softmax correction) and
// multiplied by 2^rho at the end. A weight below 2^-24 of the largest V scale seen rounds to 0
// in f16 (a key contributing under 448 x 2^-24 of that scale per value).
#pragma once

#include <cuda_fp16.h>

#include "backend/cuda/paged_attention.cuh"

namespace kestrel::cuda {

// Head dims of the fragment path; the others widen FP8 stages into a bf16 tile (widen_kv_rows).
template <int D>
constexpr bool kFp8Fragments = D == 64 || D == 128;

// Byte offset of 16-byte chunk c of row r in a stage's [keys][D] code tile (fragment path).
template <int D>
__device__ __forceinline__ int fp8_chunk(int r, int c) {
  return r * D + ((c ^ (r & (D / 16 - 1))) << 4);
}

// The dim of output column n (0 .. 7) of n-tile dt in the PV accumulator (header comment).
template <int D>
__device__ __forceinline__ int fp8_output_dim(int n, int dt) {
  return n * (D / 8) + dt;
}

#if defined(KESTREL_CUDA_EMULATE)
// The f16 bits of an E4M3 code's value (exact; NaN codes give an f16 NaN, as cvt does).
inline uint32_t emu_e4m3_to_f16_bits(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 8;
  int e = static_cast<int>((c >> 3) & 15u);
  uint32_t m = c & 7u;
  if (e == 15 && m == 7) return sign | 0x7e00u;
  if (e == 0) {
    if (m == 0) return sign;
    e = 1;  // subnormal: m / 8 x 2^-6, normalised
    while (m < 8) {
      m <<= 1;
      --e;
    }
    m -= 8;
  }
  return sign | static_cast<uint32_t>(e + 8) << 10 | m << 7;  // exponent bias 7 -> 15
}
inline float emu_f16(uint32_t packed, int half) {
  const uint32_t h = (packed >> (16 * half)) & 0xffffu;
  const int e = static_cast<int>((h >> 10) & 31u);
  const uint32_t m = h & 1023u;
  const float mag = e == 0    ? std::ldexp(static_cast<float>(m), -24)
                    : e == 31 ? (m ? NAN : INFINITY)
                              : std::ldexp(static_cast<float>(m | 1024u), e - 25);
  return (h & 0x8000u) ? -mag : mag;
}
// mma.m16n8k16 f16 on the warp's fragments (emu_mma_16816's layout, f16 elements).
inline void emu_mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  };
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Frag all[32];
  emu::warp_exchange(&mine, sizeof mine, all);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = (l % 4) * 2;
    for (int j = 0; j < 2; ++j) {
      A[g][c + j] = emu_f16(all[l].a[0], j);
      A[g + 8][c + j] = emu_f16(all[l].a[1], j);
      A[g][c + 8 + j] = emu_f16(all[l].a[2], j);
      A[g + 8][c + 8 + j] = emu_f16(all[l].a[3], j);
      B[c + j][g] = emu_f16(all[l].b[0], j);
      B[c + 8 + j][g] = emu_f16(all[l].b[1], j);
    }
  }
  const int lane = emu::lane_id();
  const int g = lane / 4, c = (lane % 4) * 2;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = c + (i & 1);
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] += s;
  }
}
#endif

// Four E4M3 codes (byte i = element i) as two f16x2 words, exactly: lo = {element 0, element 1},
// hi = {element 2, element 3}, low half first (cvt converts a 16-bit pair's low byte into the low half).
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(KESTREL_CUDA_EMULATE)
  lo = emu_e4m3_to_f16_bits(w & 0xffu) | emu_e4m3_to_f16_bits((w >> 8) & 0xffu) << 16;
  hi = emu_e4m3_to_f16_bits((w >> 16) & 0xffu) | emu_e4m3_to_f16_bits(w >> 24) << 16;
#else
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#endif
}

// d += A (16x16, row-major fragment a) * B (16x8, column fragment b), f16 in, f32 accumulate.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(KESTREL_CUDA_EMULATE)
  emu_mma_f16_16816(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

// 2^e as a float, for integer e in [-126, 127].
__device__ __forceinline__ float exp2_int(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// The warp's 16 query rows (the Q tile's rows 0 .. 15, bf16, swz layout) as f16 A fragments in
// the fragment path's dim order, row r scaled by 2^e_r (header comment, "Ranges");
// row_log2[i] = scale_log2 x 2^-e of the lane's rows g and g + 8.
template <int D>
struct QFragmentsF16 {
  uint32_t f[D / 16][4];
  float row_log2[2];
  __device__ __forceinline__ void load(const __nv_bfloat16* sq, float scale_log2) {
    constexpr int kDims = D / 4, kChunks = kDims / 8;  // the lane's dims of a row, 16-byte chunks of them
    const int lane = threadIdx.x % kWarpSize, g = lane / 4, q = lane % 4;
    float v[2][kDims];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float amax = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float x[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(sq + swz<D>(g + 8 * r, q * kChunks + c)), x);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[r][c * 8 + i] = x[i];
          amax = fmaxf(amax, fabsf(x[i]));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the row's 4 lanes
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      // amax in [2^x, 2^(x + 1)): e = 14 - x puts it in [2^14, 2^15); capped so that 2^e is a float.
      const int x = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 127;
      const int e = amax > 0.0f ? min(14 - x, 126) : 0;
      const float up = exp2_int(e);
      row_log2[r] = scale_log2 * exp2_int(-e);
#pragma unroll
      for (int i = 0; i < kDims; ++i) v[r][i] *= up;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      f[kk][0] = pack_f16x2(v[0][4 * kk], v[0][4 * kk + 1]);
      f[kk][1] = pack_f16x2(v[1][4 * kk], v[1][4 * kk + 1]);
      f[kk][2] = pack_f16x2(v[0][4 * kk + 2], v[0][4 * kk + 3]);
      f[kk][3] = pack_f16x2(v[1][4 * kk + 2], v[1][4 * kk + 3]);
    }
  }
};

// load_kv_tile_fp8's stage, read by the fragment path: K codes [kKeyTile][D] (fp8_chunk layout),
// V codes likewise, K scales, V scales [kKeyTile] f32.
// The warp's 16 keys at tile row key_off (absolute index of tile row 0: key0) against its rows:
// S = Q K^T, the online softmax (keys outside [key_lo, pos] masked when need_mask), O += P V.
// v_exp: the warp's rho as a biased f32 exponent (the largest V scale seen is below 2^(v_exp - 126)).
template <int D>
__device__ __forceinline__ void attend_tile_fp8(WarpSoftmax<D>& st, int& v_exp, const QFragmentsF16<D>& q,
                                                const unsigned char* stage, int key_off, int key0, bool need_mask,
                                                int pos, int key_lo) {
  constexpr int kKB = D / 4, kVB = D / 8;  // a lane's code bytes of a key row: K, V
  const unsigned char* kc = stage;
  const unsigned char* vc = stage + kKeyTile * D;
  const auto* ks = reinterpret_cast<const float*>(stage + 2 * kKeyTile * D);
  const float* vs = ks + kKeyTile;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, qd = lane % 4, c2 = qd * 2;
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int row = key_off + nt * 8 + g;
    uint32_t w[kKB / 4];
#pragma unroll
    for (int h = 0; h < kKB / 16; ++h) {
      const uint4 x = *reinterpret_cast<const uint4*>(kc + fp8_chunk<D>(row, qd * (kKB / 16) + h));
      w[4 * h] = x.x;
      w[4 * h + 1] = x.y;
      w[4 * h + 2] = x.z;
      w[4 * h + 3] = x.w;
    }
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[2];
      e4m3x4_to_f16x2(w[kk], b[0], b[1]);
      mma_f16_16816(s[nt], q.f[kk], b);
    }
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = key_off + nt * 8 + c2 + (j & 1);
      float v = s[nt][j] * (q.row_log2[j >> 1] * ks[r]);
      if (need_mask && (key0 + r > pos || key0 + r < key_lo)) v = -INFINITY;
      s[nt][j] = v;
      mx[j >> 1] = fmaxf(mx[j >> 1], v);
    }
  // The V scales of the lane's keys (2q, 2q + 1, 2q + 8, 2q + 9), their largest over the warp's 16.
  const float vk[4] = {vs[key_off + c2], vs[key_off + c2 + 1], vs[key_off + c2 + 8], vs[key_off + c2 + 9]};
  float vmax = fmaxf(fmaxf(vk[0], vk[1]), fmaxf(vk[2], vk[3]));
  vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
  vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
  const int e_new = max(v_exp, min(static_cast<int>(__float_as_uint(vmax) >> 23), 252));  // vmax < 2^(e - 126)
  const float o_rescale = v_exp - e_new < -126 ? 0.0f : exp2_int(v_exp - e_new);
  const float v_unit = exp2_int(126 - e_new);
  v_exp = e_new;
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(st.m[r], mx[r]);
    base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: keep everything at 0
    const float corr = exp2f(st.m[r] - base[r]);
    st.m[r] = m_new;
    st.l[r] *= corr;
    const float oc = corr * o_rescale;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      st.o[dt][2 * r] *= oc;
      st.o[dt][2 * r + 1] *= oc;
    }
  }
  float p[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) p[nt][j] = exp2f(s[nt][j] - base[j >> 1]);
  st.l[0] += p[0][0] + p[0][1] + p[1][0] + p[1][1];
  st.l[1] += p[0][2] + p[0][3] + p[1][2] + p[1][3];
  const float w0 = vk[0] * v_unit, w1 = vk[1] * v_unit, w2 = vk[2] * v_unit, w3 = vk[3] * v_unit;
  const uint32_t pa[4] = {pack_f16x2(p[0][0] * w0, p[0][1] * w1), pack_f16x2(p[0][2] * w0, p[0][3] * w1),
                          pack_f16x2(p[1][0] * w2, p[1][1] * w3), pack_f16x2(p[1][2] * w2, p[1][3] * w3)};
  // V: the lane's kVB codes of keys 2q, 2q + 1, 2q + 8, 2q + 9; byte t of word i is n-tile 4 i + t.
  uint32_t x[4][kVB / 4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int row = key_off + c2 + (k & 1) + (k >> 1) * 8;
    if constexpr (kVB == 16) {
      const uint4 u = *reinterpret_cast<const uint4*>(vc + fp8_chunk<D>(row, g));
      x[k][0] = u.x;
      x[k][1] = u.y;
      x[k][2] = u.z;
      x[k][3] = u.w;
    } else {
      static_assert(kVB == 8, "head dims 64 and 128");
      const uint2 u = *reinterpret_cast<const uint2*>(vc + fp8_chunk<D>(row, g >> 1) + (g & 1) * 8);
      x[k][0] = u.x;
      x[k][1] = u.y;
    }
  }
#pragma unroll
  for (int i = 0; i < kVB / 4; ++i) {
    uint32_t b0[4], b1[4];  // n-tiles 4 i .. 4 i + 3: keys {2q, 2q + 1}, keys {2q + 8, 2q + 9}
    e4m3x4_to_f16x2(__byte_perm(x[0][i], x[1][i], 0x5140), b0[0], b0[1]);
    e4m3x4_to_f16x2(__byte_perm(x[0][i], x[1][i], 0x7362), b0[2], b0[3]);
    e4m3x4_to_f16x2(__byte_perm(x[2][i], x[3][i], 0x5140), b1[0], b1[1]);
    e4m3x4_to_f16x2(__byte_perm(x[2][i], x[3][i], 0x7362), b1[2], b1[3]);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint32_t b[2] = {b0[t], b1[t]};
      mma_f16_16816(st.o[4 * i + t], pa, b);
    }
  }
}

}  // namespace kestrel::cuda
