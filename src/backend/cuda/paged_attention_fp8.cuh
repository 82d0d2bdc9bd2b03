// The decode kernel's FP8 (E4M3) K/V path at head dims 64 and 128: codes go from a shared-memory
// stage straight into f16 mma fragments (cvt.rn.f16x2.e4m3x2, one instruction per two codes,
// exact: every E4M3 value is an f16 normal or zero), with no bf16 tile in between, and the
// products run as mma.sync m16n8k16 f16 with f32 accumulation.
//
// Transposed products. A decode item's query heads (a GQA group: 4 for Llama 3 8B) would fill 4
// of the 16 rows of an mma's A operand; as the n = 8 columns of S^T = K Q^T and O^T = V^T P^T
// instead, keys and dims take the 16 rows, so half the mma work (and half the accumulator
// registers) of Q K^T and P V with padded query rows. Groups above 8 take several head chunks.
// A warp takes 32 keys of each 128-key stage: two 16-key row tiles of S^T.
//
// Fragment slots (lane = 4 g + q; PTX ISA, "Matrix fragments for mma.m16n8k16"). A dot product
// does not depend on the order of its terms, so each lane reads contiguous codes and the k and m
// slots are assigned to dims to suit it:
// - S^T, row tile of 16 keys: lane (g, q) reads keys g and g + 8's codes [q D/4, (q + 1) D/4),
//   D/16 words each; word kk is k-step kk's A fragment: slots 2q, 2q + 1 = dims q D/4 + 4 kk +
//   {0, 1}, slots 2q + 8, 2q + 9 = dims q D/4 + 4 kk + {2, 3}. Q's B fragments take the same dims.
// - P^T: S^T's accumulator (lane (g, q): keys g, g + 8 x heads 2q, 2q + 1) is the layout of an
//   8 x 8 matrix fragment; movmatrix.trans turns each half into B's (keys 2q, 2q + 1 x head g).
// - O^T, 16 keys: lane (g, q) reads keys 2q, 2q + 1, 2q + 8, 2q + 9, codes [g D/8, (g + 1) D/8);
//   rows g and g + 8 of accumulator tile mt are dims g D/8 + 2 mt + {0, 1} (fp8_output_dim),
//   which the merge undoes.
// Stage rows are 16-byte chunks XOR-swizzled by row (fp8_chunk), so that both reads hit distinct
// banks at D = 128 (a quarter warp: 2 rows x 4 chunks for K, 4 rows x 2 chunks for V).
//
// Ranges. Q is bf16, whose range exceeds f16's: each query head is scaled by a power of two 2^e
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

// Query heads of a decode item on the fragment path: the mma's n (S^T and O^T have the heads as
// columns), so groups above 8 take several head chunks.
constexpr int kFp8Heads = 8;
// Keys of an FP8 stage on the fragment path with three stages, and each warp's share of them (two
// 16-key row tiles of S^T: two independent mma chains, one softmax step and O rescale per 32
// keys). With two stages the stages hold 64 keys (16 keys a warp: one row tile, 101 registers
// against 137, so four blocks an SM instead of three; AttentionParams::fp8_decode_key_tile).
constexpr int kFp8WarpKeys = 32;
constexpr int kFp8KeyTile = 4 * kFp8WarpKeys;

// movmatrix.m8n8.trans.b16: an 8 x 8 16-bit matrix in the mma fragment layout (lane 4 g + q holds
// row g, columns 2q and 2q + 1, low half first) comes back transposed in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
#if defined(KESTREL_CUDA_EMULATE)
  uint32_t all[32];
  emu::warp_exchange(&x, sizeof x, all);
  const int lane = emu::lane_id(), g = lane / 4, q = lane % 4;
  // Element (r, c) is lane 4 r + c / 2's half c % 2; this lane's are (2q, g) and (2q + 1, g).
  auto at = [&](int r, int c) { return (all[4 * r + c / 2] >> (16 * (c % 2))) & 0xffffu; };
  return at(2 * q, g) | at(2 * q + 1, g) << 16;
#else
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
#endif
}

// The item's query heads (Q tile rows 0 .. 7, bf16, swz layout) as f16 B fragments of S^T = K Q^T:
// lane (g, q) holds head g's dims q D/4 + 4 kk + {0, 1} (f[kk][0]) and + {2, 3} (f[kk][1]), the
// head scaled by 2^e_g (header comment, "Ranges"); head_log2[j] = scale_log2 x 2^-e of head 2q + j
// (the S^T columns the lane holds).
template <int D>
struct QFragmentsF16 {
  uint32_t f[D / 16][2];
  float head_log2[2];
  __device__ __forceinline__ void load(const __nv_bfloat16* sq, float scale_log2) {
    constexpr int kDims = D / 4, kChunks = kDims / 8;  // the lane's dims of a head, 16-byte chunks of them
    const int lane = threadIdx.x % kWarpSize, g = lane / 4, q = lane % 4;
    float v[kDims];
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float x[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(sq + swz<D>(g, q * kChunks + c)), x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[c * 8 + i] = x[i];
        amax = fmaxf(amax, fabsf(x[i]));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the head's 4 lanes
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    // amax in [2^x, 2^(x + 1)): e = 14 - x puts it in [2^14, 2^15); capped so that 2^e is a float.
    const int x = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 127;
    const int e = amax > 0.0f ? min(14 - x, 126) : 0;
    const float up = exp2_int(e);
    const float mine = scale_log2 * exp2_int(-e);
    head_log2[0] = __shfl_sync(0xffffffffu, mine, 8 * q);      // lane 4 (2q) holds head 2q
    head_log2[1] = __shfl_sync(0xffffffffu, mine, 8 * q + 4);  // head 2q + 1
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      f[kk][0] = pack_f16x2(v[4 * kk] * up, v[4 * kk + 1] * up);
      f[kk][1] = pack_f16x2(v[4 * kk + 2] * up, v[4 * kk + 3] * up);
    }
  }
};

// One warp's online-softmax state on the fragment path: O^T (D x 8 heads) as D / 16 accumulator
// tiles (lane (g, q) of tile mt: c0, c1 = dim fp8_output_dim(g, mt, 0), heads 2q, 2q + 1; c2, c3
// = dim fp8_output_dim(g, mt, 1), the same heads), and per head 2q + j the running max m[j] (log2
// units) and the lane's partial sum l[j] (summed over the 8 lanes of the head at the end).
template <int D>
struct WarpSoftmaxT {
  float o[D / 16][4];
  float m[2];
  float l[2];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }
};

// The dim of row g (h = 0) or g + 8 (h = 1) of O^T's accumulator tile mt: each lane reads the
// contiguous codes [g D/8, (g + 1) D/8) of a V row, word i of them holding tiles 2i and 2i + 1.
template <int D>
__device__ __forceinline__ int fp8_output_dim(int g, int mt, int h) {
  return g * (D / 8) + 2 * mt + h;
}

// load_kv_tile_fp8's stage of kFp8KeyTile keys, read by the fragment path: K codes [keys][D]
// (fp8_chunk layout), V codes likewise, K scales, V scales [keys] f32.
// The warp's kWarpKeys keys (16 or 32) at tile row key_off (absolute index of tile row 0: key0):
// S^T = K Q^T, the online softmax (keys outside [key_lo, key_end) masked when need_mask), O^T +=
// V^T P^T, P^T moved from S^T's accumulator layout into B fragments by movmatrix.
// v_exp: the warp's rho as a biased f32 exponent (the largest V scale seen is below 2^(v_exp - 126)).
template <int D, int kWarpKeys>
__device__ __forceinline__ void attend_tile_fp8(WarpSoftmaxT<D>& st, int& v_exp, const QFragmentsF16<D>& q,
                                                const unsigned char* stage, int key_off, int key0, bool need_mask,
                                                int key_end, int key_lo) {
  static_assert(kWarpKeys == 16 || kWarpKeys == 32, "one or two 16-key row tiles a warp");
  constexpr int kT = 4 * kWarpKeys, kKB = D / 4, kVB = D / 8;  // a lane's code bytes of a key row: K, V
  constexpr int kMT = kWarpKeys / 16;                           // the warp's 16-key row tiles
  const unsigned char* kc = stage;
  const unsigned char* vc = stage + kT * D;
  const auto* ks = reinterpret_cast<const float*>(stage + 2 * kT * D);
  const float* vs = ks + kT;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, qd = lane % 4, c2 = qd * 2;
  // S^T tile kt: c0, c1 = key key_off + 16 kt + g, heads 2q, 2q + 1; c2, c3 = that key + 8.
  float s[kMT][4], vk[kMT][2];
#pragma unroll
  for (int kt = 0; kt < kMT; ++kt) {
    const int r0 = key_off + kt * 16 + g, r1 = r0 + 8;
    uint32_t w0[kKB / 4], w1[kKB / 4];
#pragma unroll
    for (int h = 0; h < kKB / 16; ++h) {
      const uint4 x0 = *reinterpret_cast<const uint4*>(kc + fp8_chunk<D>(r0, qd * (kKB / 16) + h));
      const uint4 x1 = *reinterpret_cast<const uint4*>(kc + fp8_chunk<D>(r1, qd * (kKB / 16) + h));
      w0[4 * h] = x0.x;
      w0[4 * h + 1] = x0.y;
      w0[4 * h + 2] = x0.z;
      w0[4 * h + 3] = x0.w;
      w1[4 * h] = x1.x;
      w1[4 * h + 1] = x1.y;
      w1[4 * h + 2] = x1.z;
      w1[4 * h + 3] = x1.w;
    }
    s[kt][0] = s[kt][1] = s[kt][2] = s[kt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];  // A = K: rows g, g + 8 (keys), k slots 2q, 2q + 1 (a0, a1) and 2q + 8, 2q + 9 (a2, a3)
      e4m3x4_to_f16x2(w0[kk], a[0], a[2]);
      e4m3x4_to_f16x2(w1[kk], a[1], a[3]);
      mma_f16_16816(s[kt], a, q.f[kk]);
    }
    const float k0 = ks[r0], k1 = ks[r1];
    vk[kt][0] = vs[r0];
    vk[kt][1] = vs[r1];
    s[kt][0] *= q.head_log2[0] * k0;
    s[kt][1] *= q.head_log2[1] * k0;
    s[kt][2] *= q.head_log2[0] * k1;
    s[kt][3] *= q.head_log2[1] * k1;
    if (need_mask) {
      if (key0 + r0 >= key_end || key0 + r0 < key_lo) s[kt][0] = s[kt][1] = -INFINITY;
      if (key0 + r1 >= key_end || key0 + r1 < key_lo) s[kt][2] = s[kt][3] = -INFINITY;
    }
  }
  // Per head: the max over the warp's keys (keys vary with g: lanes 4 apart); the V scales' max.
  float mx[2] = {-INFINITY, -INFINITY}, vmax = 0.0f;
#pragma unroll
  for (int kt = 0; kt < kMT; ++kt) {
    mx[0] = fmaxf(mx[0], fmaxf(s[kt][0], s[kt][2]));
    mx[1] = fmaxf(mx[1], fmaxf(s[kt][1], s[kt][3]));
    vmax = fmaxf(vmax, fmaxf(vk[kt][0], vk[kt][1]));
  }
#pragma unroll
  for (int off = 4; off < kWarpSize; off *= 2) {
    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, off));
  }
  const int e_new = max(v_exp, min(static_cast<int>(__float_as_uint(vmax) >> 23), 252));  // vmax < 2^(e - 126)
  const float o_rescale = v_exp - e_new < -126 ? 0.0f : exp2_int(v_exp - e_new);
  const float v_unit = exp2_int(126 - e_new);
  v_exp = e_new;
  float base[2], oc[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float m_new = fmaxf(st.m[j], mx[j]);
    base[j] = m_new == -INFINITY ? 0.0f : m_new;  // a head with no key yet: keep everything at 0
    const float corr = exp2f(st.m[j] - base[j]);
    st.m[j] = m_new;
    st.l[j] *= corr;
    oc[j] = corr * o_rescale;
  }
  // Past the first tiles the max and rho rarely move: skip the rescale when no head's did.
  if (__ballot_sync(0xffffffffu, oc[0] != 1.0f || oc[1] != 1.0f) != 0) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      st.o[mt][0] *= oc[0];
      st.o[mt][1] *= oc[1];
      st.o[mt][2] *= oc[0];
      st.o[mt][3] *= oc[1];
    }
  }
  // P^T's B fragments: rows (keys) 2q, 2q + 1 (pb[kt][0]) and 2q + 8, 2q + 9 (pb[kt][1]), column
  // (head) g, each weight times its key's V scale over 2^rho.
  uint32_t pb[kMT][2];
#pragma unroll
  for (int kt = 0; kt < kMT; ++kt) {
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = exp2f(s[kt][i] - base[i & 1]);
    st.l[0] += p[0] + p[2];
    st.l[1] += p[1] + p[3];
    const float w0 = vk[kt][0] * v_unit, w1 = vk[kt][1] * v_unit;
    pb[kt][0] = movmatrix_trans(pack_f16x2(p[0] * w0, p[1] * w0));
    pb[kt][1] = movmatrix_trans(pack_f16x2(p[2] * w1, p[3] * w1));
  }
  // O^T += V^T P^T: A = V^T, rows (dims) of tile mt as fp8_output_dim, k slots the keys 2q, 2q + 1,
  // 2q + 8, 2q + 9 of the row tile; the lane reads kVB contiguous codes of each of those keys.
#pragma unroll
  for (int kt = 0; kt < kMT; ++kt) {
    uint32_t x[4][kVB / 4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = key_off + kt * 16 + c2 + (k & 1) + (k >> 1) * 8;
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
      // Tile 2i: dims 4i + {0, 1} of the lane's run (rows g, g + 8); tile 2i + 1: dims 4i + {2, 3}.
      uint32_t a0[4], a1[4];
      e4m3x4_to_f16x2(__byte_perm(x[0][i], x[1][i], 0x5140), a0[0], a0[1]);
      e4m3x4_to_f16x2(__byte_perm(x[0][i], x[1][i], 0x7362), a1[0], a1[1]);
      e4m3x4_to_f16x2(__byte_perm(x[2][i], x[3][i], 0x5140), a0[2], a0[3]);
      e4m3x4_to_f16x2(__byte_perm(x[2][i], x[3][i], 0x7362), a1[2], a1[3]);
      mma_f16_16816(st.o[2 * i], a0, pb[kt]);
      mma_f16_16816(st.o[2 * i + 1], a1, pb[kt]);
    }
  }
}

}  // namespace kestrel::cuda
