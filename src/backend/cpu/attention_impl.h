// The CPU attention kernel (ops.h: attention, attention_chunks, attention_merge), part of ops_impl.h:
// included only there, inside its ISA namespace, after the vector helpers it uses.

constexpr int64_t kKeyTile = 16;  // keys per tile: two vectors of scores per query row

// The widest float vector the ISA holds in one register: 16 lanes on AVX-512, 8 elsewhere (where
// 16-float vectors are two registers each to GCC, and the loops below that keep many of them
// spill). Every element gets the same operations at either width.
#if defined(__AVX512F__)
using vnf = v16f;
constexpr int kLanes = 16;
inline vnf loadn(const float* p) { return load16(p); }
inline void storen(float* p, vnf v) { store16(p, v); }
inline vnf splatn(float x) { return splat16(x); }
inline vnf fman(vnf a, vnf b, vnf c) { return fma16(a, b, c); }
#else
using vnf = v8f;
constexpr int kLanes = 8;
inline vnf loadn(const float* p) { return load8(p); }
inline void storen(float* p, vnf v) { store8(p, v); }
inline vnf splatn(float x) { return splat8(x); }
inline vnf fman(vnf a, vnf b, vnf c) { return fma8(a, b, c); }
#endif

// Fetches the cache line holding p into L1. Not __builtin_prefetch: GCC 12 deletes a call whose
// only effect is that builtin (it counts as no side effect), and with it the prefetches of a
// lambda whose address depends on a load (the block table), as in attention_chunk_i8.
KESTREL_INLINE void prefetch_line(const void* p) {
#if defined(__x86_64__)
  __asm__ volatile("prefetcht0 %0" ::"m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// Per-thread scratch of the attention kernel (grown to the largest call seen).
struct AttentionScratch {
  std::vector<float> kt;     // [head_dim, 16]: the tile's keys transposed, f32 (int8: the codes)
  std::vector<float> vt;     // [16, v_dim]: the tile's values, f32 (int8: the codes)
  std::vector<float> s;      // [rows, 16]: scores, then probabilities
  std::vector<float> acc;    // [rows, 2 + v_dim]: the merged state
  std::vector<float> st;     // [rows, 2 + v_dim]: the chunk's state
  std::vector<int32_t> lo, hi;  // [rows]: the row's keys in the tile, lanes [lo, hi)
  std::vector<int32_t> live;    // rows with keys in the tile
  std::vector<float> corr;      // [rows]: the tile's rescaling of each row's state
  // INT8 KV: the query rows rounded to 16 bits (quantize_query_q16): the planes [rows][2][head_dim],
  // their sums x 128 [rows][2], dq x softmax scale [rows], and the rows as f32 [rows][head_dim].
  std::vector<int8_t> q8;
  std::vector<int32_t> q8_bias;
  std::vector<float> q8_scale;
  std::vector<float> qf;
  std::vector<uint8_t> kt8;     // [head_dim / 4][64]: the tile's int8 keys as vpdpbusd columns
  std::vector<int16_t> q16;     // [rows][head_dim]: the query rows as int16 (AVX2's vpmaddwd)
  std::vector<float> vsc;       // [chunk + 16]: the chunk's value scales by slot
  // n elements at a 64-byte boundary (a vector load across two cache lines costs two).
  template <class V>
  static V* take(std::vector<V>& v, int64_t n) {
    constexpr int64_t pad = 64 / sizeof(V);
    if (static_cast<int64_t>(v.size()) < n + pad) v.resize(static_cast<size_t>(n + pad));
    const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - at % 64) % 64) / sizeof(V);
  }
};
inline AttentionScratch& attention_scratch() {
  thread_local AttentionScratch s;
  return s;
}

#if defined(__AVX512BW__)
// The 64 bytes at column byte `byte0` of tile lanes 0..15 (rows of `row_bytes`, row 0 at lane
// lane0, only lanes [lane0, lane0 + nk) read; the others zero) transposed as 16 x 16 dwords: col[m]
// holds dword m of every lane, lane i in dword i (four rounds of 32- and 64-bit unpacks and 128-bit
// lane shuffles). The key loaders below widen what each dword holds.
KESTREL_INLINE void load_tile_dwords_transposed(const char* k, int64_t lane0, int64_t nk, int64_t row_bytes, int64_t byte0,
                                        __m512i (&col)[16]) {
  __m512i r[16], a[16];
  for (int64_t j = 0; j < kKeyTile; ++j)
    r[j] = j >= lane0 && j < lane0 + nk ? _mm512_loadu_si512(k + (j - lane0) * row_bytes + byte0)
                                        : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: dwords 4L.. of rows i, i + 1 interleaved
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4G + c] lane L: dword 4L + c of rows 4G .. 4G + 3
    r[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i lo01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), hi01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i lo23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), hi23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    col[c] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);  // dword 4 l + c: l = 0..3
    col[4 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    col[8 + c] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
    col[12 + c] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
  }
}

// The f16 keys' elements [0, hd - hd % 32) into kt as load_keys_transposed below: each 32-element
// slab of the 16 rows is transposed as 16 x 16 pairs of halves, the two halves of a pair separated
// by one word permute, and only then widened to f32 (exact), so a tile costs a third of the
// shuffles of transposing floats. Returns the elements done.
inline int64_t load_f16_keys_transposed_avx512(const uint16_t* k, int64_t lane0, int64_t nk, int64_t hd, float* kt) {
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24, 22,
                                         20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  int64_t d0 = 0;
  for (; d0 + 32 <= hd; d0 += 32) {
    __m512i col[16];
    load_tile_dwords_transposed(reinterpret_cast<const char*>(k), lane0, nk, 2 * hd, 2 * d0, col);
    for (int m = 0; m < 16; ++m) {  // pair m of all 16 rows: elements d0 + 2m and d0 + 2m + 1
      const __m512i x = _mm512_permutexvar_epi16(split, col[m]);
      const int64_t d = d0 + 2 * m;
      _mm512_storeu_ps(kt + d * kKeyTile, _mm512_cvtph_ps(_mm512_castsi512_si256(x)));
      _mm512_storeu_ps(kt + (d + 1) * kKeyTile, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)));
    }
  }
  return d0;
}

// The int8 keys' elements [0, hd - hd % 64) into kt as load_keys_transposed below: each 64-element
// slab of the 16 rows is transposed as 16 x 16 dwords (quads of codes), the four codes of a quad
// brought together across the rows by a byte shuffle within each 128-bit lane and a dword permute,
// and only then widened to f32 (exact). Returns the elements done.
KESTREL_INLINE int64_t load_i8_keys_transposed_avx512(const int8_t* k, int64_t lane0, int64_t nk, int64_t hd, float* kt) {
  // Lane L holds rows 4L .. 4L + 3, byte 4 r + e = row 4L + r's code e: to byte 4 e + r.
  const __m512i by_code = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  // Dword e of lane L (code e of rows 4L ..) to dword 4 e + L: bytes 16 e .. 16 e + 15 = code e of rows 0..15.
  const __m512i by_lane = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  int64_t d0 = 0;
  for (; d0 + 64 <= hd; d0 += 64) {
    __m512i col[16];
    load_tile_dwords_transposed(reinterpret_cast<const char*>(k), lane0, nk, hd, d0, col);
    for (int m = 0; m < 16; ++m) {  // quad m of all 16 rows: elements d0 + 4m .. d0 + 4m + 3
      const __m512i x = _mm512_permutexvar_epi32(by_lane, _mm512_shuffle_epi8(col[m], by_code));
      float* dst = kt + (d0 + 4 * m) * kKeyTile;
      _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(x))));
      _mm512_storeu_ps(dst + kKeyTile, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 1))));
      _mm512_storeu_ps(dst + 2 * kKeyTile, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 2))));
      _mm512_storeu_ps(dst + 3 * kKeyTile, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 3))));
    }
  }
  return d0;
}
#endif

// kt[d * 16 + lane0 + j] = key j's element d for j < nk, 0 in the other lanes; keys row-major,
// stride hd.
template <class T>
void load_keys_transposed(const T* k, int64_t lane0, int64_t nk, int64_t hd, float* kt) {
  int64_t d_begin = 0;
#if defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) d_begin = load_f16_keys_transposed_avx512(k, lane0, nk, hd, kt);
  if constexpr (std::is_same_v<T, int8_t>) d_begin = load_i8_keys_transposed_avx512(k, lane0, nk, hd, kt);
#endif
  for (int64_t j0 = 0; j0 < kKeyTile; j0 += 8) {
    const auto valid = [&](int64_t i) { return j0 + i >= lane0 && j0 + i < lane0 + nk; };
    const T* base = k + (j0 - lane0) * hd;  // lane j0's row (only valid lanes' rows are read)
    int64_t d = d_begin;
    for (; d + 8 <= hd; d += 8) {
      v8f r[8];
      for (int64_t i = 0; i < 8; ++i) r[i] = valid(i) ? load8(base + i * hd + d) : v8f{};
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i) store8(kt + (d + i) * kKeyTile + j0, r[i]);
    }
    for (; d < hd; ++d)
      for (int64_t i = 0; i < 8; ++i) kt[d * kKeyTile + j0 + i] = valid(i) ? to_f32(base[i * hd + d]) : 0.0f;
  }
}

// acc[r] = sum over d in [d0, d1) of q_r[d] x kt[d][0 .. 16): per lane two FMA chains, over the even
// and the odd offsets d - d0 in ascending order, added at the end (two chains per row so that one
// row alone keeps FMAs in flight). Row r's scores do not depend on the other rows of the block.
template <int NR>
inline void score_rows(const float* const* q, const float* kt, int64_t d0, int64_t d1, v16f* acc) {
  // Without AVX-512 the tile's two 8-key halves go one after the other: the 16-key chains of four
  // rows and their keys would not fit the 16 registers.
  vnf part[kKeyTile / kLanes][NR];
  for (int h = 0; h < kKeyTile / kLanes; ++h) {
    vnf e[NR] = {}, o[NR] = {};
    const float* kh = kt + kLanes * h;
    int64_t d = d0;
    for (; d + 2 <= d1; d += 2) {
      const vnf k0 = loadn(kh + d * kKeyTile), k1 = loadn(kh + (d + 1) * kKeyTile);
      for (int r = 0; r < NR; ++r) {
        e[r] = fman(splatn(q[r][d]), k0, e[r]);
        o[r] = fman(splatn(q[r][d + 1]), k1, o[r]);
      }
    }
    if (d < d1) {
      const vnf k0 = loadn(kh + d * kKeyTile);
      for (int r = 0; r < NR; ++r) e[r] = fman(splatn(q[r][d]), k0, e[r]);
    }
    for (int r = 0; r < NR; ++r) part[h][r] = e[r] + o[r];
  }
  for (int r = 0; r < NR; ++r)
#if defined(__AVX512F__)
    acc[r] = part[0][r];
#else
    acc[r] = __builtin_shufflevector(part[0][r], part[1][r], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// s[r] = the scaled scores of NR rows against the tile (ks, krs: the keys' int8 scales, or null).
template <int NR>
inline void tile_scores(const AttentionArgs& a, const float* const* q, const float* kt, const float* ks,
                        const float* krs, int64_t vd, float* const* s) {
  v16f acc[NR];
  if (krs != nullptr) {  // MLA int8: the latent and the RoPE key each with their own scale
    v16f rope[NR];
    score_rows<NR>(q, kt, 0, vd, acc);
    score_rows<NR>(q, kt, vd, a.head_dim, rope);
    const v16f k = load16(ks), kr = load16(krs);
    for (int r = 0; r < NR; ++r) store16(s[r], (acc[r] * k + rope[r] * kr) * a.scale);
    return;
  }
  score_rows<NR>(q, kt, 0, a.head_dim, acc);
  for (int r = 0; r < NR; ++r) store16(s[r], ks != nullptr ? acc[r] * load16(ks) * a.scale : acc[r] * a.scale);
}

// o = o x c + sum over j in [lo, hi) of p[j] x v[j], j ascending (v rows of stride vs), for
// elements [d, vd). The path an element takes depends only on d and vd, and every path gives an
// element the same operations (a product by c, then one FMA per key).
inline void accumulate_values(float* o, float c, const float* p, int64_t lo, int64_t hi, const float* v, int64_t vs,
                              int64_t d, int64_t vd) {
  for (; d + 4 * kLanes <= vd; d += 4 * kLanes) {
    vnf acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = loadn(o + d + kLanes * i) * c;
    for (int64_t j = lo; j < hi; ++j) {
      const vnf pj = splatn(p[j]);
      const float* vr = v + j * vs + d;
      for (int i = 0; i < 4; ++i) acc[i] = fman(pj, loadn(vr + kLanes * i), acc[i]);
    }
    for (int i = 0; i < 4; ++i) storen(o + d + kLanes * i, acc[i]);
  }
  for (; d + 8 <= vd; d += 8) {
    v8f acc = load8(o + d) * c;
    for (int64_t j = lo; j < hi; ++j) acc = fma8(splat8(p[j]), load8(v + j * vs + d), acc);
    store8(o + d, acc);
  }
  for (; d < vd; ++d) {
    float acc = o[d] * c;
    for (int64_t j = lo; j < hi; ++j) acc = fma1(p[j], v[j * vs + d], acc);
    o[d] = acc;
  }
}

// The same for two rows over the same keys: each value vector loaded once for both.
inline void accumulate_values2(float* o0, float c0, const float* p0, float* o1, float c1, const float* p1, int64_t lo,
                               int64_t hi, const float* v, int64_t vs, int64_t vd) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= vd; d += 4 * kLanes) {
    vnf a0[4], a1[4];
    for (int i = 0; i < 4; ++i) a0[i] = loadn(o0 + d + kLanes * i) * c0, a1[i] = loadn(o1 + d + kLanes * i) * c1;
    for (int64_t j = lo; j < hi; ++j) {
      const vnf q0 = splatn(p0[j]), q1 = splatn(p1[j]);
      const float* vr = v + j * vs + d;
      for (int i = 0; i < 4; ++i) {
        const vnf x = loadn(vr + kLanes * i);
        a0[i] = fman(q0, x, a0[i]);
        a1[i] = fman(q1, x, a1[i]);
      }
    }
    for (int i = 0; i < 4; ++i) storen(o0 + d + kLanes * i, a0[i]), storen(o1 + d + kLanes * i, a1[i]);
  }
  accumulate_values(o0, c0, p0, lo, hi, v, vs, d, vd);
  accumulate_values(o1, c1, p1, lo, hi, v, vs, d, vd);
}

// One tile's online-softmax step for N rows (row r = rows[i]): the tile's maximum over lanes
// [lo[r], hi[r]) of its scores s + 16 r, the state's rescaling corr[r], the probabilities (x the
// value scales vs for INT8) written over the scores, and the state's max and sum (st + r * sw). The
// rows' steps are independent and written side by side, so their exp chains overlap.
#if defined(__AVX512F__)
template <int N, bool kScaled>
KESTREL_INLINE void softmax_rows(const int32_t* rows, const int32_t* lo, const int32_t* hi, float* s, float* st, int64_t sw,
                         float* corr, const float* vs) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16f neg_inf = splat16(-INFINITY), zero = {};
  v16i in[N];
  v16f sv[N], p[N];
  float m_new[N];
  for (int i = 0; i < N; ++i) {
    const int64_t r = rows[i];
    const float* state = st + r * sw;
    in[i] = (lane >= lo[r]) & (lane < hi[r]);
    sv[i] = load16(s + r * kKeyTile);
    const v16f mx = in[i] ? sv[i] : neg_inf;
    const v8f mlo = __builtin_shufflevector(mx, mx, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f mhi = __builtin_shufflevector(mx, mx, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8f m8 = mlo > mhi ? mlo : mhi;
    const float tile_max = std::max(std::max(std::max(m8[0], m8[1]), std::max(m8[2], m8[3])),
                                    std::max(std::max(m8[4], m8[5]), std::max(m8[6], m8[7])));
    m_new[i] = std::max(state[0], tile_max);
    // exp(-inf) = 0 on the row's first tile; exp(0) = 1 exactly where the maximum stays.
    corr[r] = m_new[i] == state[0] ? 1.0f : std::exp(state[0] - m_new[i]);
  }
  for (int i = 0; i < N; ++i) {
    const v16f shifted = sv[i] - m_new[i];
#if defined(__AVX512F__)
    p[i] = exp_lanes<v16f, v16i>(shifted);
#else
    const v8f e0 = exp8(__builtin_shufflevector(shifted, shifted, 0, 1, 2, 3, 4, 5, 6, 7));
    const v8f e1 = exp8(__builtin_shufflevector(shifted, shifted, 8, 9, 10, 11, 12, 13, 14, 15));
    p[i] = __builtin_shufflevector(e0, e1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
  }
  for (int i = 0; i < N; ++i) {
    const int64_t r = rows[i];
    float* state = st + r * sw;
    v16f pi = in[i] ? p[i] : zero;
    const v8f p8 = __builtin_shufflevector(pi, pi, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(pi, pi, 8, 9, 10, 11, 12, 13, 14, 15);
    state[1] = state[1] * corr[r] + hsum8(p8);
    if constexpr (kScaled) pi = pi * load16(vs);
    store16(s + r * kKeyTile, pi);
    state[0] = m_new[i];
  }
}
#else
// The same step in 8-lane halves (each lane's operations, and the halves' sum, as above): with
// 16-float vectors the rows' masks, scores and probabilities (two registers each) spilled on
// AVX2. The scores are read again from the scratch row for the exponentials instead of kept.
template <int N, bool kScaled>
KESTREL_INLINE void softmax_rows(const int32_t* rows, const int32_t* lo, const int32_t* hi, float* s, float* st, int64_t sw,
                         float* corr, const float* vs) {
  const v8i lane0 = {0, 1, 2, 3, 4, 5, 6, 7}, lane1 = lane0 + 8;
  const v8f neg_inf = splat8(-INFINITY), zero = {};
  float m_new[N];
  for (int i = 0; i < N; ++i) {
    const int64_t r = rows[i];
    const float* state = st + r * sw;
    const v8i in0 = (lane0 >= lo[r]) & (lane0 < hi[r]), in1 = (lane1 >= lo[r]) & (lane1 < hi[r]);
    const v8f mlo = in0 ? load8(s + r * kKeyTile) : neg_inf;
    const v8f mhi = in1 ? load8(s + r * kKeyTile + 8) : neg_inf;
    const v8f m8 = mlo > mhi ? mlo : mhi;
    const float tile_max = std::max(std::max(std::max(m8[0], m8[1]), std::max(m8[2], m8[3])),
                                    std::max(std::max(m8[4], m8[5]), std::max(m8[6], m8[7])));
    m_new[i] = std::max(state[0], tile_max);
    // exp(-inf) = 0 on the row's first tile; exp(0) = 1 exactly where the maximum stays.
    corr[r] = m_new[i] == state[0] ? 1.0f : std::exp(state[0] - m_new[i]);
  }
  for (int i = 0; i < N; ++i) {
    const int64_t r = rows[i];
    float* state = st + r * sw;
    float* sr = s + r * kKeyTile;
    const v8i in0 = (lane0 >= lo[r]) & (lane0 < hi[r]), in1 = (lane1 >= lo[r]) & (lane1 < hi[r]);
    const v8f e0 = exp8(load8(sr) - m_new[i]), e1 = exp8(load8(sr + 8) - m_new[i]);
    v8f p0 = in0 ? e0 : zero, p1 = in1 ? e1 : zero;
    state[1] = state[1] * corr[r] + hsum8(p0 + p1);
    if constexpr (kScaled) p0 = p0 * load8(vs), p1 = p1 * load8(vs + 8);
    store8(sr, p0);
    store8(sr + 8, p1);
    state[0] = m_new[i];
  }
}
#endif

#include "backend/cpu/attention_int8_impl.h"

// One chunk's online softmax for every row of the call: st rows [max, sum, output[vd]].
template <class T>
void attention_chunk(const AttentionArgs& a, int64_t chunk, float* st, AttentionScratch& w) {
  constexpr bool kQuantized = std::is_same_v<T, int8_t>;
#if defined(KESTREL_I8_CHUNK)
  if constexpr (kQuantized)
    if (a.k_rope_scale == nullptr && i8_chunk_supports(a.head_dim) && (a.v_dim == 0 || a.v_dim == a.head_dim))
      return attention_chunk_i8(a, chunk, st, w);
#endif
  const int64_t hd = a.head_dim, vd = a.v_dim > 0 ? a.v_dim : hd, g_n = a.group;
  const int64_t rows = a.n_tokens * g_n, sw = 2 + vd;
  for (int64_t r = 0; r < rows; ++r) {
    st[r * sw] = -INFINITY;
    st[r * sw + 1] = 0.0f;
    std::memset(st + r * sw + 2, 0, sizeof(float) * static_cast<size_t>(vd));
  }
  int64_t lo_all, hi_all;
  attention_key_range(a, lo_all, hi_all);
  const int64_t c_abs = lo_all / kAttentionChunk + chunk;
  const int64_t c_begin = std::max(lo_all, c_abs * kAttentionChunk);
  const int64_t c_end = std::min(hi_all, (c_abs + 1) * kAttentionChunk);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int64_t bs = a.block_size;
  float* kt = AttentionScratch::take(w.kt, hd * kKeyTile);
  float* vt = std::is_same_v<T, float> ? nullptr : AttentionScratch::take(w.vt, kKeyTile * vd);
  float* s = AttentionScratch::take(w.s, rows * kKeyTile);
  int32_t* lo = AttentionScratch::take(w.lo, rows);
  int32_t* hi = AttentionScratch::take(w.hi, rows);
  int32_t* live = AttentionScratch::take(w.live, rows);
  float ks[kKeyTile] = {}, krs[kKeyTile] = {}, vs[kKeyTile] = {};
  // Row r's query (token r / group, head r % group); INT8: its rounded copy.
  const float* q_base = a.q;
  int64_t q_token_stride = a.q_stride;
  auto row_q = [&](int64_t r) { return q_base + (r / g_n) * q_token_stride + (r % g_n) * hd; };
  // INT8 with one scale per key row (not MLA's latent + RoPE rows): the query rows rounded to 16
  // bits (quantize_query_q16), here used as f32 values (AVX-512 VNNI and AVX2: attention_chunk_i8).
  if (kQuantized && a.k_rope_scale == nullptr) {
    int8_t* q8 = AttentionScratch::take(w.q8, rows * 2 * hd);
    int32_t* q8_bias = AttentionScratch::take(w.q8_bias, rows * 2);
    float* qr = AttentionScratch::take(w.qf, rows * hd);
    for (int64_t r = 0; r < rows; ++r)
      quantize_query_row(row_q(r), hd, q8 + r * 2 * hd, q8 + r * 2 * hd + hd, qr + r * hd, q8_bias + 2 * r);
    q_base = qr, q_token_stride = g_n * hd;
  }
  for (int64_t ta = c_begin; ta < c_end;) {
    const int64_t off = ta % bs, block_start = ta - off;
    const int64_t tb = std::min({c_end, block_start + bs, block_start + (off / kKeyTile + 1) * kKeyTile});
    const int64_t nk = tb - ta;
    // Lane j holds key t_abs + j, t_abs being where the tile starts whatever the rows' ranges (the
    // partition's cut before ta): so a row's lanes, and its sums over them, are the same in any call.
    const int64_t t_abs = std::max(block_start + off / kKeyTile * kKeyTile, c_abs * kAttentionChunk);
    const int64_t lane0 = ta - t_abs;
    int64_t n_live = 0;
    for (int64_t i = 0; i < a.n_tokens; ++i) {
      const int64_t l = std::max(ta, a.kv_begin[i]) - t_abs, h = std::min(tb, a.n_ctx[i]) - t_abs;
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t r = i * g_n + g;
        lo[r] = static_cast<int32_t>(l), hi[r] = static_cast<int32_t>(h);
        if (l < h) live[n_live++] = static_cast<int32_t>(r);
      }
    }
    if (n_live == 0) {
      ta = tb;
      continue;
    }
    // The tile's keys: nk rows of head_dim, contiguous within the block.
    const int64_t elem = static_cast<int64_t>(a.block_table[ta / bs]) * a.block_stride + a.head_offset + off * hd;
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    int64_t next_bytes = 0;
    // Part q of 4 of the next block's lines: keys, keys, values, values.
    const auto prefetch_part = [&](int q) {
      const char* p = q < 2 ? next_k : next_v;
      const int64_t half = next_bytes / 2, b0 = (q % 2) * half, b1 = q % 2 ? next_bytes : half;
      for (int64_t b = b0; b < b1; b += 64) prefetch_line(p + b);
    };
    if (tb == block_start + bs && tb + bs < hi_all) {
      // Blocks are elsewhere in memory: fetch this head's keys and values of the block after the
      // next while this tile is computed (decode reads each once, from memory; one block ahead
      // left 8192 keys on one thread at 13.6 ms against 11.3 ms, measured on an AMD EPYC VM), in
      // four parts between the tile's phases: a burst of all its lines stalls on the line fill
      // buffers, and the tile's work waits behind it.
      const int64_t next = static_cast<int64_t>(a.block_table[(tb + bs) / bs]) * a.block_stride + a.head_offset;
      next_k = reinterpret_cast<const char*>(kc + next);
      next_v = reinterpret_cast<const char*>(vc + next);
      next_bytes = bs * hd * static_cast<int64_t>(sizeof(T));
    }
    prefetch_part(0);
    load_keys_transposed(kc + elem, lane0, nk, hd, kt);
    prefetch_part(1);
    // Lane j's value row at v + j * v_stride (only the rows' lanes [lo, hi) are read).
    const float* v;
    int64_t v_stride = vd;
    if constexpr (std::is_same_v<T, float>) {
      v = vc + elem - lane0 * hd;
      v_stride = hd;
    } else {
      for (int64_t j = 0; j < nk; ++j) {
        const T* src = vc + elem + j * hd;
        float* dst = vt + (lane0 + j) * vd;
        int64_t d = 0;
        for (; d + 16 <= vd; d += 16) store16(dst + d, load16(src + d));
        for (; d + 8 <= vd; d += 8) store8(dst + d, load8(src + d));
        for (; d < vd; ++d) dst[d] = to_f32(src[d]);
      }
      v = vt;
    }
    const float* ksp = nullptr;
    const float* krsp = nullptr;
    if constexpr (kQuantized) {
      const int64_t row0 = elem / hd - lane0;  // lane 0's row
      for (int64_t j = 0; j < kKeyTile; ++j) {
        const bool in = j >= lane0 && j < lane0 + nk;
        ks[j] = in ? a.k_scale[row0 + j] : 0.0f;
        vs[j] = in ? a.v_scale[row0 + j] : 0.0f;
        if (a.k_rope_scale != nullptr) krs[j] = in ? a.k_rope_scale[row0 + j] : 0.0f;
      }
      ksp = ks;
      krsp = a.k_rope_scale != nullptr ? krs : nullptr;
    }
    // Scores, four rows at a time.
    int64_t li = 0;
    const float* qr[4];
    float* sr[4];
    for (; li + 4 <= n_live; li += 4) {
      for (int k = 0; k < 4; ++k) qr[k] = row_q(live[li + k]), sr[k] = s + live[li + k] * kKeyTile;
      tile_scores<4>(a, qr, kt, ksp, krsp, vd, sr);
    }
    if (li + 3 == n_live) {  // a GQA group of three heads at one token: one pass over the keys
      for (int k = 0; k < 3; ++k) qr[k] = row_q(live[li + k]), sr[k] = s + live[li + k] * kKeyTile;
      tile_scores<3>(a, qr, kt, ksp, krsp, vd, sr);
      li += 3;
    }
    if (li + 2 <= n_live) {
      for (int k = 0; k < 2; ++k) qr[k] = row_q(live[li + k]), sr[k] = s + live[li + k] * kKeyTile;
      tile_scores<2>(a, qr, kt, ksp, krsp, vd, sr);
      li += 2;
    }
    for (; li < n_live; ++li) {
      qr[0] = row_q(live[li]), sr[0] = s + live[li] * kKeyTile;
      tile_scores<1>(a, qr, kt, ksp, krsp, vd, sr);
    }
    prefetch_part(2);
    // Online softmax (over each row's lanes [lo, hi); the others masked: -inf for the max, 0 for
    // the sum, whose tree over the 16 lanes is fixed), up to four rows at a time, then the values,
    // two rows at a time where their keys agree.
    float* corr = AttentionScratch::take(w.corr, rows);
    {
      int64_t k = 0;
      for (; k + 4 <= n_live; k += 4) softmax_rows<4, kQuantized>(live + k, lo, hi, s, st, sw, corr, vs);
      switch (n_live - k) {
        case 3: softmax_rows<3, kQuantized>(live + k, lo, hi, s, st, sw, corr, vs); break;
        case 2: softmax_rows<2, kQuantized>(live + k, lo, hi, s, st, sw, corr, vs); break;
        case 1: softmax_rows<1, kQuantized>(live + k, lo, hi, s, st, sw, corr, vs); break;
        default: break;
      }
    }
    prefetch_part(3);
    for (int64_t k = 0; k < n_live;) {
      const int64_t r = live[k];
      if (k + 1 < n_live && lo[live[k + 1]] == lo[r] && hi[live[k + 1]] == hi[r]) {
        const int64_t r1 = live[k + 1];
        accumulate_values2(st + r * sw + 2, corr[r], s + r * kKeyTile, st + r1 * sw + 2, corr[r1], s + r1 * kKeyTile,
                           lo[r], hi[r], v, v_stride, vd);
        k += 2;
      } else {
        accumulate_values(st + r * sw + 2, corr[r], s + r * kKeyTile, lo[r], hi[r], v, v_stride, 0, vd);
        k += 1;
      }
    }
    ta = tb;
  }
}

// acc row = merge(acc row, st row) for every row, in that order; an empty state (max -inf) is skipped.
inline void merge_states(float* acc, const float* st, int64_t rows, int64_t vd) {
  const int64_t sw = 2 + vd;
  for (int64_t r = 0; r < rows; ++r) {
    float* A = acc + r * sw;
    const float* B = st + r * sw;
    if (B[0] == -INFINITY) continue;
    if (A[0] == -INFINITY) {
      std::memcpy(A, B, sizeof(float) * static_cast<size_t>(sw));
      continue;
    }
    const float m = std::max(A[0], B[0]);
    const float ea = std::exp(A[0] - m), eb = std::exp(B[0] - m);
    A[0] = m;
    A[1] = fma1(B[1], eb, A[1] * ea);
    int64_t d = 0;
    for (; d + 8 <= vd; d += 8) store8(A + 2 + d, fma8(load8(B + 2 + d), splat8(eb), load8(A + 2 + d) * ea));
    for (; d < vd; ++d) A[2 + d] = fma1(B[2 + d], eb, A[2 + d] * ea);
  }
}

// out rows = acc output / acc sum (zeros for a row without keys).
inline void write_output(const AttentionArgs& a, const float* acc, int64_t vd) {
  const int64_t sw = 2 + vd;
  for (int64_t r = 0; r < a.n_tokens * a.group; ++r) {
    float* o = a.out + (r / a.group) * a.out_stride + (r % a.group) * vd;
    const float* A = acc + r * sw;
    const float inv = A[0] != -INFINITY && A[1] > 0.0f ? 1.0f / A[1] : 0.0f;
    if (inv == 0.0f) {
      std::memset(o, 0, sizeof(float) * static_cast<size_t>(vd));
      continue;
    }
    int64_t d = 0;
    for (; d + 8 <= vd; d += 8) store8(o + d, load8(A + 2 + d) * inv);
    for (; d < vd; ++d) o[d] = A[2 + d] * inv;
  }
}

inline void init_states(float* acc, int64_t rows, int64_t vd) {
  for (int64_t r = 0; r < rows; ++r) acc[r * (2 + vd)] = -INFINITY;
}

template <class T>
void attention_impl(const AttentionArgs& a) {
  AttentionScratch& w = attention_scratch();
  const int64_t vd = a.v_dim > 0 ? a.v_dim : a.head_dim, rows = a.n_tokens * a.group;
  const int64_t n = attention_state_floats(a);
  float* acc = AttentionScratch::take(w.acc, n);
  float* st = AttentionScratch::take(w.st, n);
  init_states(acc, rows, vd);
  const int64_t chunks = attention_chunk_count(a);
  for (int64_t c = 0; c < chunks; ++c) {
    attention_chunk<T>(a, c, st, w);
    merge_states(acc, st, rows, vd);
  }
  write_output(a, acc, vd);
}

template <class T>
void attention_chunks_impl(const AttentionArgs& a, int64_t c0, int64_t c1, float* states) {
  AttentionScratch& w = attention_scratch();
  for (int64_t c = c0; c < c1; ++c) attention_chunk<T>(a, c, states + (c - c0) * attention_state_floats(a), w);
}

#define KESTREL_KV_DISPATCH(fn, ...)                                                                       \
  switch (a.kv_dtype) {                                                                                    \
    case KvDtype::F32: fn<float>(__VA_ARGS__); break;                                                      \
    case KvDtype::F16: fn<uint16_t>(__VA_ARGS__); break;                                                   \
    case KvDtype::INT8: fn<int8_t>(__VA_ARGS__); break;                                                    \
    default:                                                                                               \
      KESTREL_ASSERT(false, "CPU attention: KV dtype " + std::string(kv_dtype_name(a.kv_dtype)) + " has no kernel"); \
  }

void attention(const AttentionArgs& a) { KESTREL_KV_DISPATCH(attention_impl, a) }
void attention_chunks(const AttentionArgs& a, int64_t c0, int64_t c1, float* states) {
  KESTREL_KV_DISPATCH(attention_chunks_impl, a, c0, c1, states)
}
#undef KESTREL_KV_DISPATCH

void attention_merge(const AttentionArgs& a, int64_t n_chunks, const float* states) {
  AttentionScratch& w = attention_scratch();
  const int64_t vd = a.v_dim > 0 ? a.v_dim : a.head_dim, rows = a.n_tokens * a.group;
  const int64_t n = attention_state_floats(a);
  float* acc = AttentionScratch::take(w.acc, n);
  init_states(acc, rows, vd);
  for (int64_t c = 0; c < n_chunks; ++c) merge_states(acc, states + c * n, rows, vd);
  write_output(a, acc, vd);
}

