// The INT8 KV parts of the CPU attention kernel (attention_impl.h, ops.h): the query's 16-bit
// rounding, and on AVX-512 VNNI the chunk kernel that multiplies it with the codes in integers.
// Included only by attention_impl.h, inside its ISA namespace.

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
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t j0 = std::max<int64_t>(lo, tile_slot[t]), j1 = std::min<int64_t>(hi, tile_slot[t] + tile_n[t]);
    const int8_t* v = tile_v[t] + d - tile_slot[t] * hd;  // slot j's row at v + j * hd
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t* vr = v + j * hd;
      __m512 x[4];
      for (int i = 0; i < 4; ++i)
        x[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + 16 * i))));
      for (int r = 0; r < NR; ++r) {
        const __m512 pj = _mm512_set1_ps(p[r][j]);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(pj, x[i], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out[r] + d + 16 * i, acc[r][i]);
}

// attention_chunk for INT8 rows with one scale each and head_dim % 64 == 0 (v_dim = head_dim) on
// AVX-512 VNNI, in two passes over the chunk's keys instead of an online softmax per tile:
//  1. per tile of up to 16 keys of one block, the keys as vpdpbusd columns and every row's scores
//     with its 16-bit query planes, exact in int32 (i8_tile_scores), x dq x scale x key scale;
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
  int32_t* lo = AttentionScratch::take(w.lo, rows);
  int32_t* hi = AttentionScratch::take(w.hi, rows);
  int32_t* live = AttentionScratch::take(w.live, rows);
  float* s = AttentionScratch::take(w.s, rows * ss);  // row r's scores, then p x value scale, by slot
  float* vsc = AttentionScratch::take(w.vsc, ss);      // value scale by slot
  uint8_t* kt8 = AttentionScratch::take(w.kt8, hd * kKeyTile);
  for (int64_t i = 0; i < a.n_tokens; ++i) {
    const int64_t l = std::max(c_begin, a.kv_begin[i]) - cs, h = std::min(c_end, a.n_ctx[i]) - cs;
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t r = i * g_n + g;
      lo[r] = static_cast<int32_t>(l), hi[r] = static_cast<int32_t>(std::max(l, h));
      qs[r] = quantize_query_row(a.q + i * a.q_stride + g * hd, hd, q8 + r * 2 * hd, q8 + r * 2 * hd + hd, nullptr,
                                 qb + 2 * r) * a.scale;
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
      load_i8_key_columns(kc + elem, 0, nk, hd, kt8);
      const __mmask16 in = static_cast<__mmask16>((1u << nk) - 1);
      float ks[kKeyTile];
      _mm512_storeu_ps(ks, _mm512_maskz_loadu_ps(in, a.k_scale + elem / hd));
      _mm512_storeu_ps(vsc + slot, _mm512_maskz_loadu_ps(in, a.v_scale + elem / hd));
      const int8_t* q8r[4];
      const int32_t* br[4];
      float qsr[4];
      float* sr[4];
      int64_t li = 0;
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
      tile_slot[n_tiles] = static_cast<int32_t>(slot), tile_n[n_tiles] = static_cast<int32_t>(nk);
      tile_v[n_tiles++] = vc + elem;
    }
    ta = tb;
  }
  // Softmax over each row's slots [lo, hi), in 16-slot vectors from slot 0.
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16f neg_inf = splat16(-INFINITY), zero = {};
  for (int64_t r = 0; r < rows; ++r) {
    float* state = st + r * sw;
    state[0] = -INFINITY, state[1] = 0.0f;
    if (lo[r] >= hi[r]) {
      std::memset(state + 2, 0, sizeof(float) * static_cast<size_t>(hd));
      continue;
    }
    float* sr = s + r * ss;
    const int64_t v0 = lo[r] / 16 * 16;
    v16f vmax = neg_inf;
    for (int64_t j = v0; j < hi[r]; j += 16) {
      const v16i in = (lane + static_cast<int32_t>(j) >= lo[r]) & (lane + static_cast<int32_t>(j) < hi[r]);
      const v16f x = in ? load16(sr + j) : neg_inf;
      vmax = x > vmax ? x : vmax;
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; ++l) m = std::max(m, vmax[l]);
    v16f sum = zero;
    for (int64_t j = v0; j < hi[r]; j += 16) {
      const v16i in = (lane + static_cast<int32_t>(j) >= lo[r]) & (lane + static_cast<int32_t>(j) < hi[r]);
      const v16f p = in ? exp_lanes<v16f, v16i>(load16(sr + j) - m) : zero;
      sum += p;
      store16(sr + j, p * load16(vsc + j));
    }
    state[0] = m;
    state[1] = _mm512_reduce_add_ps(reinterpret_cast<__m512>(sum));
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
    for (int64_t d = 0; d < hd; d += 64) switch (n) {
        case 4: i8_chunk_values<4>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        case 3: i8_chunk_values<3>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        case 2: i8_chunk_values<2>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
        default: i8_chunk_values<1>(out, p, lo[r], hi[r], tile_slot, tile_n, tile_v, n_tiles, hd, d); break;
      }
    r += n;
  }
}
#endif

