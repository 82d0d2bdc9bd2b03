// The INT8 KV parts of the CPU attention kernel (attention_impl.h, ops.h): the query's 16-bit
// rounding, and on AVX-512 VNNI and AVX2 the chunk kernel that multiplies it with the codes in
// integers (vpdpbusd over the two 8-bit planes, or vpmaddwd over the 16-bit query: the same exact
// sums, so the same scores). Included only by attention_impl.h, inside its ISA namespace.

// Round to the nearest integer, ties to even, for |x| < 2^22: the addition of 1.5 x 2^23 leaves
// no fraction bits (f32 arithmetic in the default rounding mode, as nearbyint).
inline float round_even(float x) {
  const float m = 12582912.0f;
  return (x + m) - m;
}
inline v16f round_even(v16f x) {
  const v16f m = splat16(12582912.0f);
  return (x + m) - m;
}

// quantize_query_q16 (ops.h) of one row of n elements, 16 at a time, with the same f32 products
// and roundings (the matmuls' activation constants, matmul_kernels.h), so the same planes on every
// ISA. Also writes bias[p] = 128 x the sum of plane p (vpdpbusd reads the codes as code + 128) and,
// unless qf is null, qf[i] = Q[i] x dq (the rounded row in f32).
KESTREL_INLINE float quantize_query_row(const float* q, int64_t n, int8_t* q1, int8_t* q2, float* qf, int32_t* bias) {
  const v16i magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                          0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const v16f largest = splat16(3.40282347e38f);
  v16f vmax = splat16(0.0f);
  v16i finite = ~v16i{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f ax = reinterpret_cast<v16f>(reinterpret_cast<v16i>(load16(q + i)) & magnitude);
    finite &= ax <= largest;  // false for inf and NaN
    vmax = ax > vmax ? ax : vmax;
  }
  float amax = 0.0f;
  bool ok = true;
  for (int l = 0; l < 16; ++l) amax = std::max(amax, vmax[l]), ok = ok && finite[l] != 0;
  for (int64_t t = i; t < n; ++t) ok = ok && std::isfinite(q[t]), amax = std::max(amax, std::fabs(q[t]));
  const float inv = detail::act_inverse_scale(amax, false), dq = detail::act_scale(amax);
  if (!ok || dq == 0.0f || !std::isfinite(inv)) {
    std::memset(q1, 0, static_cast<size_t>(n));
    std::memset(q2, 0, static_cast<size_t>(n));
    if (qf != nullptr)
      for (int64_t t = 0; t < n; ++t) qf[t] = ok ? 0.0f : NAN;
    bias[0] = bias[1] = 0;
    return ok ? 0.0f : NAN;
  }
  const v16f vinv = splat16(inv), inv255 = splat16(detail::kInvActSplit), k255 = splat16(detail::kActSplit),
             vdq = splat16(dq);
  v16f sum1 = splat16(0.0f), sum2 = splat16(0.0f);
  for (i = 0; i + 16 <= n; i += 16) {
    const v16f Q = round_even(load16(q + i) * vinv);
    const v16f h = round_even(Q * inv255);
    const v16f l = Q - k255 * h;
    sum1 += h, sum2 += l;
    const v16c c1 = __builtin_convertvector(__builtin_convertvector(h, v16i), v16c);
    const v16c c2 = __builtin_convertvector(__builtin_convertvector(l, v16i), v16c);
    std::memcpy(q1 + i, &c1, 16);
    std::memcpy(q2 + i, &c2, 16);
    if (qf != nullptr) store16(qf + i, Q * vdq);
  }
  float s1 = 0.0f, s2 = 0.0f;  // exact: integers below 2^24
  for (int l = 0; l < 16; ++l) s1 += sum1[l], s2 += sum2[l];
  for (; i < n; ++i) {
    const float Q = round_even(q[i] * inv);
    const float h = round_even(Q * detail::kInvActSplit);
    const float l = Q - static_cast<float>(detail::kActSplit) * h;
    q1[i] = static_cast<int8_t>(h), q2[i] = static_cast<int8_t>(l);
    s1 += h, s2 += l;
    if (qf != nullptr) qf[i] = Q * dq;
  }
  bias[0] = 128 * static_cast<int32_t>(s1);
  bias[1] = 128 * static_cast<int32_t>(s2);
  return dq;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// INT8 keys with AVX-512 VNNI. The tile's keys as vpdpbusd columns: kt8 + 64 m holds dword m (codes
// 4m .. 4m + 3) of each lane's key, lane i in dword i, each code + 128 as an unsigned byte; lanes
// outside [lane0, lane0 + nk) hold code 0. hd % 64 == 0.
KESTREL_INLINE void load_i8_key_columns(const int8_t* k, int64_t lane0, int64_t nk, int64_t hd, uint8_t* kt8) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    __m512i col[16];
    load_tile_dwords_transposed(reinterpret_cast<const char*>(k), lane0, nk, hd, d0, col);
    for (int m = 0; m < 16; ++m) _mm512_storeu_si512(kt8 + (d0 / 4 + m) * 64, _mm512_xor_si512(col[m], bias));
  }
}

// The 4 bytes at p in every dword lane.
KESTREL_INLINE __m512i broadcast_dword(const int8_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// s[r] = the scaled scores of NR rows against the tile: the exact integer sums
// sum_i Q_i x code_i = 255 sum q1 x code + sum q2 x code (each plane's sum over the codes + 128,
// less 128 x the plane's sum), then x dq x softmax scale (qs) x the key's scale, in f32. Integer
// sums: how they are split over accumulators changes no bit.
template <int NR>
KESTREL_INLINE void i8_tile_scores(const uint8_t* kt8, int64_t hd, const int8_t* const* q, const int32_t* const* bias,
                                   const float* qs, const float* ks, float* const* s) {
  // Independent vpdpbusd chains: one per row and plane from three rows on, else two (the even and
  // the odd columns).
  constexpr int E = NR >= 3 ? 1 : 2;
  __m512i a1[NR][E], a2[NR][E];
  for (int r = 0; r < NR; ++r)
    for (int e = 0; e < E; ++e) a1[r][e] = a2[r][e] = _mm512_setzero_si512();
  for (int64_t m = 0; m < hd / 4; m += E) {
    for (int e = 0; e < E; ++e) {
      const __m512i k = _mm512_loadu_si512(kt8 + 64 * (m + e));
      for (int r = 0; r < NR; ++r) {
        a1[r][e] = _mm512_dpbusd_epi32(a1[r][e], k, broadcast_dword(q[r] + 4 * (m + e)));       // plane 1
        a2[r][e] = _mm512_dpbusd_epi32(a2[r][e], k, broadcast_dword(q[r] + hd + 4 * (m + e)));  // plane 2
      }
    }
  }
  const __m512 kscale = _mm512_loadu_ps(ks), k255 = _mm512_set1_ps(255.0f);
  for (int r = 0; r < NR; ++r) {
    __m512i p1 = a1[r][0], p2 = a2[r][0];
    if constexpr (E == 2) p1 = _mm512_add_epi32(p1, a1[r][1]), p2 = _mm512_add_epi32(p2, a2[r][1]);
    p1 = _mm512_sub_epi32(p1, _mm512_set1_epi32(bias[r][0]));
    p2 = _mm512_sub_epi32(p2, _mm512_set1_epi32(bias[r][1]));
    const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), k255, _mm512_cvtepi32_ps(p2));
    _mm512_storeu_ps(s[r], _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(qs[r])), kscale));
  }
}

#endif

// The sum of 16 lanes as _mm512_reduce_add_ps adds them (GCC's tree: the upper 8 lanes to the
// lower, then the upper 4 of those, then lanes i and i + 2, then the two left), on any ISA, so the
// chunk kernel's softmax sums have the same bits on AVX2 as on AVX-512.
KESTREL_INLINE float reduce_add16(v16f x) {
  const v8f a = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15) + __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const float b0 = a[4] + a[0], b1 = a[5] + a[1], b2 = a[6] + a[2], b3 = a[7] + a[3];
  return (b0 + b2) + (b1 + b3);
}

// fn(j, codes) for the slots j of the chunk's tiles within [lo, hi), ascending, codes pointing at
// element d of slot j's value row (the value sums of the chunk kernel, on either ISA).
template <class Fn>
KESTREL_INLINE void for_each_value_slot(int64_t lo, int64_t hi, const int32_t* tile_slot, const int32_t* tile_n,
                                        const int8_t* const* tile_v, int64_t n_tiles, int64_t hd, int64_t d, Fn&& fn) {
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t j0 = std::max<int64_t>(lo, tile_slot[t]), j1 = std::min<int64_t>(hi, tile_slot[t] + tile_n[t]);
    const int8_t* v = tile_v[t] + d - tile_slot[t] * hd;  // slot j's row at v + j * hd
    for (int64_t j = j0; j < j1; ++j) fn(j, v + j * hd);
  }
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__)
// INT8 keys on AVX2 (no 8-bit dot product that fits a 16-bit query exactly): the query row as
// int16, Q_i = 255 q1_i + q2_i (quantize_query_q16's planes, |Q_i| <= 32512), and vpmaddwd with
// each key's codes widened to int16, so a score is the same exact integer sum_i Q_i x code_i that
// vpdpbusd forms from the planes (|sum| < 2^31 for head_dim <= 256, kI8ChunkMaxHeadDim).

// v[j]'s 8 lanes summed into lane j (exact: int32).
KESTREL_INLINE __m256i hsum_8x8_epi32(const __m256i* v) {
  // a: per 128-bit half h, the sums of v[0..3]'s lanes 4h .. 4h + 3; b: the same for v[4..7].
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_blend_epi32(a, b, 0xF0), _mm256_permute2x128_si256(a, b, 0x21));
}

// s[r][0 .. 16) = the scaled scores of NR rows against the tile's keys k (nk rows of hd codes,
// lanes past nk 0): sum_i Q_i x code_i in int32, then x dq x softmax scale (qs) x the key's scale,
// in f32, as i8_tile_scores on AVX-512 VNNI (the int32 sum converted once: the same value as
// 255 x f32(plane-1 sum) + f32(plane-2 sum) in one FMA, both exact before their one rounding).
template <int NR>
KESTREL_INLINE void i8_tile_scores_avx2(const int8_t* k, int64_t nk, int64_t hd, const int16_t* const* q,
                                        const float* qs, const float* ks, float* const* s) {
  for (int h = 0; h < 2; ++h) {  // keys 8 h .. 8 h + 7
    __m256i v[NR][8];
    for (int j = 0; j < 8; ++j) {
      __m256i acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_si256();
      if (8 * h + j < nk) {
        const int8_t* kr = k + (8 * h + j) * hd;
        for (int64_t d = 0; d < hd; d += 16) {
          const __m256i kw = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr + d)));
          for (int r = 0; r < NR; ++r)
            acc[r] = _mm256_add_epi32(
                acc[r], _mm256_madd_epi16(kw, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + d))));
        }
      }
      for (int r = 0; r < NR; ++r) v[r][j] = acc[r];
    }
    const __m256 kscale = _mm256_loadu_ps(ks + 8 * h);
    for (int r = 0; r < NR; ++r) {
      const __m256 sum = _mm256_cvtepi32_ps(hsum_8x8_epi32(v[r]));
      _mm256_storeu_ps(s[r] + 8 * h, _mm256_mul_ps(_mm256_mul_ps(sum, _mm256_set1_ps(qs[r])), kscale));
    }
  }
}

// out_r[d .. d + 32) = sum over slots j of the tiles, within [lo, hi), of p_r[j] x code_j, j
// ascending, for NR rows (as i8_chunk_values, in 32-element parts: 4 x NR accumulators, the
// rows' probabilities and one widened vector fit the 16 registers for NR <= 3).
template <int NR>
KESTREL_INLINE void i8_chunk_values_avx2(float* const* out, const float* const* p, int64_t lo, int64_t hi,
                                         const int32_t* tile_slot, const int32_t* tile_n, const int8_t* const* tile_v,
                                         int64_t n_tiles, int64_t hd, int64_t d) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for_each_value_slot(lo, hi, tile_slot, tile_n, tile_v, n_tiles, hd, d, [&](int64_t j, const int8_t* vr) {
    __m256 pj[NR];
    for (int r = 0; r < NR; ++r) pj[r] = _mm256_broadcast_ss(p[r] + j);
    for (int i = 0; i < 4; ++i) {
      const __m256 x =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vr + 8 * i))));
      for (int r = 0; r < NR; ++r) acc[r][i] = _mm256_fmadd_ps(pj[r], x, acc[r][i]);
    }
  });
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out[r] + d + 8 * i, acc[r][i]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// out_r[d .. d + 64) = sum over slots j of the tiles, within [lo, hi), of p_r[j] x code_j, j
// ascending, for NR rows over the same slots: one f32 FMA chain per row and element, each code
// widened once for all the rows, straight from the cache.
template <int NR>
KESTREL_INLINE void i8_chunk_values(float* const* out, const float* const* p, int64_t lo, int64_t hi,
                                    const int32_t* tile_slot, const int32_t* tile_n, const int8_t* const* tile_v,
                                    int64_t n_tiles, int64_t hd, int64_t d) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  for_each_value_slot(lo, hi, tile_slot, tile_n, tile_v, n_tiles, hd, d, [&](int64_t j, const int8_t* vr) {
    __m512 x[4];
    for (int i = 0; i < 4; ++i)
      x[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + 16 * i))));
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(pj, x[i], acc[r][i]);
    }
  });
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out[r] + d + 16 * i, acc[r][i]);
}
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__)
#define KESTREL_I8_CHUNK 1
// Whether attention_chunk_i8 takes rows of this head_dim: whole 64-byte slabs for the VNNI key
// columns; on AVX2 whole 32-element value parts, and int32 score sums that cannot overflow.
constexpr int64_t kI8ChunkMaxHeadDim = 256;
constexpr bool i8_chunk_supports(int64_t hd) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return hd > 0 && hd % 64 == 0;
#else
  return hd > 0 && hd % 32 == 0 && hd <= kI8ChunkMaxHeadDim;
#endif
}

// attention_chunk for INT8 rows with one scale each and i8_chunk_supports(head_dim) (v_dim =
// head_dim) on AVX-512 VNNI or AVX2, in two passes over the chunk's keys instead of an online
// softmax per tile:
//  1. per tile of up to 16 keys of one block, every row's scores with its 16-bit query, exact in
//     int32 (i8_tile_scores: the keys as vpdpbusd columns and the query's planes;
//     i8_tile_scores_avx2: vpmaddwd), x dq x scale x key scale;
//  2. per row, over its slots: the chunk's maximum m, p = exp(s - m) in 16-slot vectors from the
//     chunk's start (lanes outside the row's keys 0), their sum, p x the value scales; then the
//     values, sum_j p_j x codes_j in key order (i8_chunk_values).
// The state is the chunk's (max, sum, output) as attention_chunk's. A row's scores are integer sums
// and its softmax and values run over its own slots in a fixed order, so its bits do not depend on
// the other rows of the call.
inline void attention_chunk_i8(const AttentionArgs& a, int64_t chunk, float* st, AttentionScratch& w) {
  constexpr int64_t C = kAttentionChunk, kPad = 16;
  const int64_t hd = a.head_dim, g_n = a.group, rows = a.n_tokens * g_n, sw = 2 + hd, ss = C + kPad;
  int64_t lo_all, hi_all;
  attention_key_range(a, lo_all, hi_all);
  const int64_t cs = (lo_all / C + chunk) * C;  // the position of slot 0
  const int64_t c_begin = std::max(lo_all, cs), c_end = std::min(hi_all, cs + C);
  const int8_t* kc = static_cast<const int8_t*>(a.k_cache);
  const int8_t* vc = static_cast<const int8_t*>(a.v_cache);
  const int64_t bs = a.block_size;
  int8_t* q8 = AttentionScratch::take(w.q8, rows * 2 * hd);
  int32_t* qb = AttentionScratch::take(w.q8_bias, rows * 2);
  float* qs = AttentionScratch::take(w.q8_scale, rows);
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  int16_t* q16 = AttentionScratch::take(w.q16, rows * hd);
#endif
  int32_t* lo = AttentionScratch::take(w.lo, rows);
  int32_t* hi = AttentionScratch::take(w.hi, rows);
  int32_t* live = AttentionScratch::take(w.live, rows);
  float* s = AttentionScratch::take(w.s, rows * ss);  // row r's scores, then p x value scale, by slot
  float* vsc = AttentionScratch::take(w.vsc, ss);      // value scale by slot
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  uint8_t* kt8 = AttentionScratch::take(w.kt8, hd * kKeyTile);
#endif
  for (int64_t i = 0; i < a.n_tokens; ++i) {
    const int64_t l = std::max(c_begin, a.kv_begin[i]) - cs, h = std::min(c_end, a.n_ctx[i]) - cs;
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t r = i * g_n + g;
      lo[r] = static_cast<int32_t>(l), hi[r] = static_cast<int32_t>(std::max(l, h));
      qs[r] = quantize_query_row(a.q + i * a.q_stride + g * hd, hd, q8 + r * 2 * hd, q8 + r * 2 * hd + hd, nullptr,
                                 qb + 2 * r) * a.scale;
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
      for (int64_t e = 0; e < hd; ++e)
        q16[r * hd + e] = static_cast<int16_t>(detail::kActSplit * q8[r * 2 * hd + e] + q8[r * 2 * hd + hd + e]);
#endif
    }
  }
  // This head's keys, values and their scales of the block holding position pos.
  const auto prefetch_block = [&](int64_t pos) {
    if (pos >= hi_all) return;
    const int64_t b0 = static_cast<int64_t>(a.block_table[pos / bs]) * a.block_stride + a.head_offset;
    for (int64_t b = 0; b < bs * hd; b += 64) prefetch_line(kc + b0 + b), prefetch_line(vc + b0 + b);
    const float* ksb = a.k_scale + b0 / hd;
    const float* vsb = a.v_scale + b0 / hd;
    for (int64_t b = 0; b < bs; b += 16) prefetch_line(ksb + b), prefetch_line(vsb + b);
    prefetch_line(ksb + bs - 1), prefetch_line(vsb + bs - 1);
  };
  int32_t tile_slot[C], tile_n[C];
  const int8_t* tile_v[C];
  int64_t n_tiles = 0;
  for (int64_t ta = c_begin; ta < c_end;) {
    const int64_t off = ta % bs, block_start = ta - off;
    const int64_t tb = std::min({c_end, block_start + bs, ta + kKeyTile});
    const int64_t nk = tb - ta, slot = ta - cs;
    const int64_t elem = static_cast<int64_t>(a.block_table[ta / bs]) * a.block_stride + a.head_offset + off * hd;
    // Blocks are anywhere in memory and decode reads each once: the block kPrefetchBlocks ahead is
    // fetched as each block starts (and the ones before it as the chunk starts). Measured on an
    // AMD EPYC VM, 8192 keys on one thread: 14.2 ms without prefetches, 8.9 ms one block ahead,
    // 7.4 two, 6.3-6.8 four.
    constexpr int64_t kPrefetchBlocks = 4;
    if (off == 0) prefetch_block(block_start + kPrefetchBlocks * bs);
    if (ta == c_begin)
      for (int64_t d = off == 0 ? 1 : 0; d < kPrefetchBlocks; ++d) prefetch_block(block_start + d * bs);
    int64_t n_live = 0;
    for (int64_t r = 0; r < rows; ++r)
      if (lo[r] < slot + nk && hi[r] > slot) live[n_live++] = static_cast<int32_t>(r);
    if (n_live > 0) {
      float ks[kKeyTile];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      const __mmask16 in = static_cast<__mmask16>((1u << nk) - 1);
      _mm512_storeu_ps(ks, _mm512_maskz_loadu_ps(in, a.k_scale + elem / hd));
      _mm512_storeu_ps(vsc + slot, _mm512_maskz_loadu_ps(in, a.v_scale + elem / hd));
#else
      for (int64_t j = 0; j < kKeyTile; ++j) {
        ks[j] = j < nk ? a.k_scale[elem / hd + j] : 0.0f;
        vsc[slot + j] = j < nk ? a.v_scale[elem / hd + j] : 0.0f;
      }
#endif
      float qsr[4];
      float* sr[4];
      int64_t li = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      load_i8_key_columns(kc + elem, 0, nk, hd, kt8);
      const int8_t* q8r[4];
      const int32_t* br[4];
      const auto take_rows = [&](int n) {
        for (int k = 0; k < n; ++k) {
          const int64_t r = live[li + k];
          q8r[k] = q8 + r * 2 * hd, br[k] = qb + 2 * r, qsr[k] = qs[r], sr[k] = s + r * ss + slot;
        }
      };
      for (; li + 4 <= n_live; li += 4) take_rows(4), i8_tile_scores<4>(kt8, hd, q8r, br, qsr, ks, sr);
      if (li + 3 == n_live) take_rows(3), i8_tile_scores<3>(kt8, hd, q8r, br, qsr, ks, sr), li += 3;
      if (li + 2 <= n_live) take_rows(2), i8_tile_scores<2>(kt8, hd, q8r, br, qsr, ks, sr), li += 2;
      for (; li < n_live; ++li) take_rows(1), i8_tile_scores<1>(kt8, hd, q8r, br, qsr, ks, sr);
#else
      const int16_t* q16r[3];
      const auto take_rows = [&](int n) {
        for (int k = 0; k < n; ++k) {
          const int64_t r = live[li + k];
          q16r[k] = q16 + r * hd, qsr[k] = qs[r], sr[k] = s + r * ss + slot;
        }
      };
      const int8_t* kt = kc + elem;
      for (; li + 3 <= n_live; li += 3) take_rows(3), i8_tile_scores_avx2<3>(kt, nk, hd, q16r, qsr, ks, sr);
      if (li + 2 <= n_live) take_rows(2), i8_tile_scores_avx2<2>(kt, nk, hd, q16r, qsr, ks, sr), li += 2;
      if (li < n_live) take_rows(1), i8_tile_scores_avx2<1>(kt, nk, hd, q16r, qsr, ks, sr), ++li;
#endif
      tile_slot[n_tiles] = static_cast<int32_t>(slot), tile_n[n_tiles] = static_cast<int32_t>(nk);
      tile_v[n_tiles++] = vc + elem;
    }
    ta = tb;
  }
  // Softmax over each row's slots [lo, hi), in 16-slot vectors from slot 0 (without AVX-512, as
  // two 8-lane halves: GCC scalarizes 16-lane compares and selects on AVX2; every lane's operations
  // and the sum's tree are the same).
#if defined(__AVX512F__)
  using VF = v16f;
  using VI = v16i;
  constexpr int kW = 16;
  const VI lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const auto loadw = [](const float* p) { return load16(p); };
  const auto storew = [](float* p, VF v) { store16(p, v); };
#else
  using VF = v8f;
  using VI = v8i;
  constexpr int kW = 8;
  const VI lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const auto loadw = [](const float* p) { return load8(p); };
  const auto storew = [](float* p, VF v) { store8(p, v); };
#endif
  constexpr int kParts = 16 / kW;
  const VF neg_inf = VF{} - INFINITY, zero = {};
  for (int64_t r = 0; r < rows; ++r) {
    float* state = st + r * sw;
    state[0] = -INFINITY, state[1] = 0.0f;
    if (lo[r] >= hi[r]) {
      std::memset(state + 2, 0, sizeof(float) * static_cast<size_t>(hd));
      continue;
    }
    float* sr = s + r * ss;
    const int64_t v0 = lo[r] / 16 * 16;
    VF vmax = neg_inf;
    for (int64_t j = v0; j < hi[r]; j += kW) {
      const VI in = (lane + static_cast<int32_t>(j) >= lo[r]) & (lane + static_cast<int32_t>(j) < hi[r]);
      const VF x = in ? loadw(sr + j) : neg_inf;
      vmax = x > vmax ? x : vmax;
    }
    float m = -INFINITY;
    for (int l = 0; l < kW; ++l) m = std::max(m, vmax[l]);
    VF sum[kParts] = {};
    for (int64_t j = v0; j < hi[r]; j += 16)
      for (int h = 0; h < kParts; ++h) {
        const int64_t jh = j + h * kW;
        const VI in = (lane + static_cast<int32_t>(jh) >= lo[r]) & (lane + static_cast<int32_t>(jh) < hi[r]);
        const VF p = in ? exp_lanes<VF, VI>(loadw(sr + jh) - m) : zero;
        sum[h] += p;
        storew(sr + jh, p * loadw(vsc + jh));
      }
    state[0] = m;
#if defined(__AVX512F__)
    state[1] = reduce_add16(sum[0]);
#else
    state[1] = reduce_add16(__builtin_shufflevector(sum[0], sum[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#endif
  }
  // Values, up to four consecutive rows over the same slots (a token's query heads) at a time.
  for (int64_t r = 0; r < rows;) {
    if (lo[r] >= hi[r]) {
      ++r;
      continue;
    }
    int n = 1;
    while (n < 4 && r + n < rows && lo[r + n] == lo[r] && hi[r + n] == hi[r]) ++n;
    float* out[4];
    const float* p[4];
    for (int i = 0; i < n; ++i) out[i] = st + (r + i) * sw + 2, p[i] = s + (r + i) * ss;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    for (int64_t d = 0; d < hd; d += 64) switch (n) {
        case 4: i8_chunk_values<4>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        case 3: i8_chunk_values<3>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        case 2: i8_chunk_values<2>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        default: i8_chunk_values<1>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
      }
#else
    if (n == 4) n = 3;  // three rows' accumulators fill the 16 registers
    for (int64_t d = 0; d < hd; d += 32) switch (n) {
        case 3: i8_chunk_values_avx2<3>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        case 2: i8_chunk_values_avx2<2>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        default: i8_chunk_values_avx2<1>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
      }
#endif
    r += n;
  }
}
#endif

