// Token sampling on the GPU (cuda_ops.h: sample_tokens), the CPU Sampler's chain top_k -> top_p ->
// min_p -> temperature -> inverse-CDF draw (src/sampling/logits_processors.cpp, sampler.cpp).
// Over 800 lines: one kernel whose paths share the helpers below, kept in one file so that their
// numerics can be read against the CPU code in one place.
//
// One block of 1024 threads per row; no sort of the vocabulary and no workspace. Every "pass" reads
// the row once (from HBM the first time, from L2 after: a 128256-wide f32 row is 513 KB).
//   A  max, argmax, NaN check. Greedy rows end here.
// Rank order (top_k or top_p cuts, so the CPU list is sorted when the draw happens):
//   B  count histogram over 2048 bins of the distance to the max, floor((max - logit) * 64) in f32
//      (monotone in the logit, so a run of bins is a rank-order prefix; 31.98 and beyond share the
//      last bin), plus sum(exp(logit - max)) when top_p runs without top_k. From it the window: the
//      fewest leading bins sure to hold what top_k / top_p / min_p keep (top_p through a lower
//      bound of each bin's mass).
//   C  when the window has <= 8192 tokens: they are gathered into shared memory and sorted in rank
//      order (counting ranks for short lists, bitonic otherwise), and the rest runs on that list as
//      the CPU does: top_k prefix, softmax and prefix sums for top_p, the min_p prefix,
//      temperature, softmax, the draw. Exponentials in f64 and probabilities rounded to f32, sums
//      in f64: the CPU's numbers, up to the order of the f64 additions.
//   Otherwise (flat distributions, top_k > 8192) each cut is a radix select over the 64-bit rank
//   code (order-preserving logit bits, then the complement of the id): per 8-bit digit a pass
//   histograms counts and fixed-point masses with shared-memory integer atomics (exact, so the
//   result does not depend on their order), until the digit's bin fits the window, which is then
//   gathered and sorted. Masses there are f32 exponentials (about 2 ulp from the CPU's).
// Id order (only min_p and temperature):
//   the kept tokens are gathered and sorted by id when they fit the window (exact as above), else
//   a pass sums 32 contiguous slices of the row (f32 exponentials, f64 sums), the slice holding
//   the target is split into 32 pieces and summed again, and one warp walks the piece with warp
//   prefix sums.
// Costs (128256-wide rows, one block per row): greedy 1 pass; rank order with a small window
// about 3 passes; id order 2 to 3 passes; the radix fallback up to about 4 passes per cut.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_common.cuh"

namespace kestrel::cuda::sampling {

using u64 = unsigned long long;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kWindow = 8192;  // tokens sorted in shared memory
constexpr int kBins = 2048;    // distance-to-max bins of pass B
constexpr float kBinsPerUnit = 64.0f;
constexpr int kBinCopies = 4;  // histogram copies (warp % copies) to spread atomic contention
constexpr int kDigits = 256;   // radix select: 8 bits per pass
constexpr int kDigitCopies = 4;
constexpr int32_t kNone = 0x7fffffff;
constexpr int32_t kNeedRadix = -2;  // finish_rank: the window did not hold the top_p cut

struct DigitHistogram {
  uint32_t count[kDigitCopies][kDigits];
  u64 mass[kDigitCopies][kDigits];
};

// One value per thread for the block reductions and scans, padded (t + t / 32) so that lane l of
// warp 0 reading the 32 values of warp l touches distinct banks.
constexpr int kPadded = kThreads + kThreads / kWarpSize;
union Word {
  double f64;
  u64 u;
  int32_t i32;
};
template <class T>
__device__ __forceinline__ T& as(Word& w) {
  if constexpr (std::is_floating_point_v<T>) return w.f64;
  else if constexpr (sizeof(T) == 8) return w.u;
  else return w.i32;
}

// The block's shared memory (dynamic: about 105 KB).
struct Shared {
  union {
    uint32_t bins[kBinCopies][kBins];  // pass B
    DigitHistogram digits;             // radix select
    u64 window[kWindow];               // gathered list: ~rank code (rank order) or id << 32 | key
  };
  float e[kWindow];  // f32 exponentials of the window entries
  Word red[kPadded];
  Word total;
  uint32_t slot;
  u64 bcast[2];
  double bcast_f64[2];
  int32_t bcast_i32[2];
};

// ---- keys -------------------------------------------------------------------------------------

// Order-preserving image of a non-NaN float (-0 taken as +0, which the CPU's compares tie).
__device__ __forceinline__ uint32_t order_key(float l) {
  uint32_t u = __float_as_uint(l);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_logit(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// Larger code = earlier in rank order (descending logit, then ascending id). Unique per token.
__device__ __forceinline__ u64 rank_code(float l, int64_t i) {
  return (static_cast<u64>(order_key(l)) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}
__device__ __forceinline__ int32_t code_id(u64 c) { return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(c)); }
__device__ __forceinline__ float code_logit(u64 c) { return key_logit(static_cast<uint32_t>(c >> 32)); }

// Window entries sort ascending: ~rank code for rank order, id << 32 | key for id order.
__device__ __forceinline__ void decode(u64 entry, bool by_id, float& l, int32_t& id) {
  if (by_id) {
    l = key_logit(static_cast<uint32_t>(entry));
    id = static_cast<int32_t>(entry >> 32);
  } else {
    l = code_logit(~entry);
    id = code_id(~entry);
  }
}

__device__ __forceinline__ int dist_bin(float max, float l) {
  const float d = (max - l) * kBinsPerUnit;  // >= 0; +inf for l = -inf
  return d < static_cast<float>(kBins - 1) ? static_cast<int>(d) : kBins - 1;
}

// ---- exponentials -----------------------------------------------------------------------------

// The CPU's softmax weight exp(s - s_max), where s = l (temperature 1, s_max = max) or
// s = f32((l - max) / temperature) (s_max = 0), in f64 as the CPU computes it.
__device__ __forceinline__ double exact_weight(float l, double max, double inv_t, bool scaled) {
  if (!scaled) return exp(static_cast<double>(l) - max);
  const float s = static_cast<float>((static_cast<double>(l) - max) * inv_t);
  return exp(static_cast<double>(s));
}

// The same weight in f32 arithmetic for whole-row passes (no f64 conversions per token): l - max
// exactly as a float pair (TwoSum), s rounded as the CPU rounds it up to rare ties, then expf
// (2 ulp). No a * b + c is left for the compiler to contract, so every call site rounds alike.
struct Weigher {
  float max;
  float inv_t_hi, inv_t_lo;  // 1 / temperature as a float pair
  bool scaled;
  __device__ float operator()(float l) const {
    if (l == -INFINITY) return 0.0f;
    const float d = l - max;
    const float back = d - l;
    const float err = (l - (d - back)) + (-max - back);
    if (!scaled) {
      const float e = expf(d);
      return fmaf(e, err, e);
    }
    const float hi = d * inv_t_hi;
    if (hi == -INFINITY) return 0.0f;
    const float lo = fmaf(d, inv_t_hi, -hi) + fmaf(err, inv_t_hi, d * inv_t_lo);
    return expf(hi + lo);
  }
};

// ---- block primitives (all threads call them; results are the same in every thread) ------------

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

struct Plus {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Min {
  template <class T>
  __device__ T operator()(T a, T b) const { return b < a ? b : a; }
};
struct Max {
  template <class T>
  __device__ T operator()(T a, T b) const { return b > a ? b : a; }
};

// Lane 0's butterfly result in every lane (f64 sums differ in the last bit between lanes).
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return __shfl_sync(0xffffffffu, v, 0);
}

template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = lane_id();
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const T y = __shfl_sync(0xffffffffu, v, lane >= o ? lane - o : lane);
    if (lane >= o) v += y;
  }
  return v;
}

// The block primitives go through shared memory, and only warp 0 shuffles: two barriers each,
// every combination in a fixed order (deterministic f64 sums), the result read back by all.

// op over every thread's v.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, Shared& sh) {
  const int t = static_cast<int>(threadIdx.x);
  as<T>(sh.red[t + t / kWarpSize]) = v;
  __syncthreads();
  if (t < kWarpSize) {
    Word* mine = sh.red + t * (kWarpSize + 1);  // warp t's 32 values
    T acc[4] = {as<T>(mine[0]), as<T>(mine[1]), as<T>(mine[2]), as<T>(mine[3])};
#pragma unroll
    for (int i = 4; i < kWarpSize; i += 4)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = op(acc[q], as<T>(mine[i + q]));
    const T a = warp_reduce(op(op(acc[0], acc[1]), op(acc[2], acc[3])), op);
    if (t == 0) as<T>(sh.total) = a;
  }
  __syncthreads();
  return as<T>(sh.total);
}

// Sum of v over the threads before this one (thread order); *total: over all threads.
template <class T>
__device__ T block_exclusive_scan(T v, Shared& sh, T* total) {
  const int t = static_cast<int>(threadIdx.x);
  as<T>(sh.red[t + t / kWarpSize]) = v;
  __syncthreads();
  if (t < kWarpSize) {
    Word* mine = sh.red + t * (kWarpSize + 1);
    T sum = T(0);
    for (int i = 0; i < kWarpSize; ++i) sum += as<T>(mine[i]);
    const T incl = warp_inclusive_scan(sum);
    T run = __shfl_sync(0xffffffffu, incl, t > 0 ? t - 1 : 0);
    if (t == 0) run = T(0);
    for (int i = 0; i < kWarpSize; ++i) {
      const T x = as<T>(mine[i]);
      as<T>(mine[i]) = run;
      run += x;
    }
    if (t == kWarpSize - 1) as<T>(sh.total) = incl;
  }
  __syncthreads();
  *total = as<T>(sh.total);
  return as<T>(sh.red[t + t / kWarpSize]);
}

// ---- row access -------------------------------------------------------------------------------

// Tokens 4g .. 4g + 3 (a 16-byte load when vec: n % 4 == 0 and a 16-byte aligned row); 0 past n.
__device__ __forceinline__ void load_group(const float* __restrict__ x, int64_t n, int64_t g, bool vec,
                                           float (&v)[4]) {
  if (vec) {
    const float4 q = reinterpret_cast<const float4*>(x)[g];
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 4 * g + j < n ? x[4 * g + j] : 0.0f;
  }
}

// f(i, logit) for every token, each thread taking groups threadIdx.x, + kThreads, ... (increasing
// ids), kUnroll loads in flight.
template <int kUnroll, class F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ x, int64_t n, bool vec, F&& f) {
  const int64_t n_groups = (n + 3) / 4;
  int64_t g = threadIdx.x;
  for (; g + (kUnroll - 1) * kThreads < n_groups; g += kUnroll * kThreads) {
    float v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_group(x, n, g + u * kThreads, vec, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = 4 * (g + u * kThreads) + j;
        if (i < n) f(i, v[u][j]);
      }
  }
  for (; g < n_groups; g += kThreads) {
    float v[4];
    load_group(x, n, g, vec, v);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * g + j < n) f(4 * g + j, v[j]);
  }
}

// Writes code(i, l) into sh.window for every token with keep(i, l) (called once per token, so it
// may accumulate), in no particular order: one atomic per warp and step hands out the slots.
// Returns how many matched, also when more than the window holds (the excess is not written).
template <class Keep, class Code>
__device__ uint32_t gather(const float* __restrict__ x, int64_t n, bool vec, Keep&& keep, Code&& code, Shared& sh) {
  if (threadIdx.x == 0) sh.slot = 0;
  __syncthreads();
  const int lane = lane_id();
  const int64_t n_groups = (n + 3) / 4;
  const unsigned below = (1u << lane) - 1u;  // lanes before this one
  for (int64_t base = static_cast<int64_t>(warp_id()) * kWarpSize; base < n_groups; base += kThreads) {
    const int64_t g = base + lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (g < n_groups) load_group(x, n, g, vec, v);
    bool match[4];
    unsigned ballot[4];
    uint32_t n_step = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      match[j] = g < n_groups && 4 * g + j < n && keep(4 * g + j, v[j]);
      ballot[j] = __ballot_sync(0xffffffffu, match[j]);
      n_step += static_cast<uint32_t>(__popc(ballot[j]));
    }
    if (n_step == 0) continue;
    uint32_t pos = 0;
    if (lane == 0) pos = atomicAdd(&sh.slot, n_step);
    pos = __shfl_sync(0xffffffffu, pos, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (match[j]) {
        const uint32_t at = pos + static_cast<uint32_t>(__popc(ballot[j] & below));
        if (at < kWindow) sh.window[at] = code(4 * g + j, v[j]);
      }
      pos += static_cast<uint32_t>(__popc(ballot[j]));
    }
  }
  __syncthreads();
  const uint32_t n_matched = sh.slot;
  __syncthreads();
  return n_matched;
}

// Sorts sh.window[0, n) ascending (entries are distinct). Short lists (top_k's usual window) by
// rank: each entry counts the smaller ones, two barriers; longer ones bitonic over the next power
// of two, padded with ~0.
__device__ void sort_window(Shared& sh, uint32_t n) {
  if (n <= 256) {
    const uint32_t t = threadIdx.x;
    const u64 mine = t < n ? sh.window[t] : 0;
    uint32_t rank = 0;
    if (t < n)
      for (uint32_t j = 0; j < n; ++j) rank += sh.window[j] < mine;
    __syncthreads();
    if (t < n) sh.window[rank] = mine;
    __syncthreads();
    return;
  }
  uint32_t size = 1;
  while (size < n) size <<= 1;
  for (uint32_t i = n + threadIdx.x; i < size; i += kThreads) sh.window[i] = ~0ull;
  __syncthreads();
  for (uint32_t k = 2; k <= size; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      for (uint32_t i = threadIdx.x; i < size; i += kThreads) {
        const uint32_t partner = i ^ j;
        if (partner > i) {
          const u64 a = sh.window[i], b = sh.window[partner];
          if ((a > b) == ((i & k) == 0)) {
            sh.window[i] = b;
            sh.window[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// This thread's contiguous share [begin, end) of n list entries (prefix sums in list order).
struct Share {
  uint32_t begin, end;
  __device__ explicit Share(uint32_t n) {
    const uint32_t per = (n + kThreads - 1) / kThreads;
    begin = threadIdx.x * per < n ? threadIdx.x * per : n;
    end = begin + per < n ? begin + per : n;
  }
};

// ---- one row ----------------------------------------------------------------------------------

struct Row {
  const float* x;
  int64_t n;
  bool vec;
  float max;
  // The chain, as make_processor_chain builds it.
  bool top_k_on, top_p_on, min_p_on, scaled;
  uint32_t top_k;
  float top_p;
  float min_p_threshold;  // f32(max + ln(min_p)); -inf when off
  double inv_t;
  double uniform;
  float fixed_scale;  // 2^(63 - bit_width(n)): n weights <= 1 sum below 2^63
  Weigher draw_w;     // draw weights (temperature applied)
  Weigher raw_w;      // top_p weights (temperature 1)
};

// The draw over the first n entries of the sorted window, as Sampler::draw does it: softmax (f64
// exponentials, f32 probs), target = uniform * sum of the f32 probs, the first entry whose running
// sum exceeds it (else the last with a nonzero prob). Returns the token id.
__device__ int32_t draw_from_window(const Row& r, uint32_t n, bool by_id, Shared& sh) {
  const Share my(n);
  double s = 0.0;
  for (uint32_t j = my.begin; j < my.end; ++j) {
    float l;
    int32_t id;
    decode(sh.window[j], by_id, l, id);
    const double e = exact_weight(l, static_cast<double>(r.max), r.inv_t, r.scaled);
    s += e;
    sh.e[j] = static_cast<float>(e);
  }
  const double inv = 1.0 / block_reduce(s, Plus{}, sh);
  double local = 0.0;
  for (uint32_t j = my.begin; j < my.end; ++j) local += static_cast<float>(static_cast<double>(sh.e[j]) * inv);
  double total;
  double cum = block_exclusive_scan(local, sh, &total);
  const double target = r.uniform * total;
  int32_t first = kNone, last_nonzero = -1;
  for (uint32_t j = my.begin; j < my.end; ++j) {
    const float p = static_cast<float>(static_cast<double>(sh.e[j]) * inv);
    cum += p;
    if (first == kNone && target < cum) first = static_cast<int32_t>(j);
    if (p > 0.0f) last_nonzero = static_cast<int32_t>(j);
  }
  first = block_reduce(first, Min{}, sh);
  if (first == kNone) {
    first = block_reduce(last_nonzero, Max{}, sh);
    if (first < 0) first = 0;
  }
  float l;
  int32_t id;
  decode(sh.window[first], by_id, l, id);
  return id;
}

// Rank order, the window [0, n_w) sorted: top_k, top_p, min_p as the CPU applies them, then the draw.
// s_out: sum of exp(l - max) over the tokens outside the window (top_p without top_k). whole: the
// window is the whole row; min_p_bound: it holds every token min_p keeps. Returns kNeedRadix when
// the top_p cut lies past the window (the window's bound guarantees it never does, barring rounding).
__device__ int32_t finish_rank(const Row& r, uint32_t n_w, double s_out, bool whole, bool min_p_bound, Shared& sh) {
  const Share my(n_w);
  const uint32_t n_k = r.top_k_on && r.top_k < n_w ? r.top_k : n_w;
  uint32_t n_p = 0xffffffffu;
  if (r.top_p_on) {
    // TopP::apply: softmax over what top_k kept (the whole vocabulary without top_k), then the
    // first rank-order prefix whose f64 sum of f32 probs is >= top_p.
    double s = 0.0;
    for (uint32_t j = my.begin; j < my.end && j < n_k; ++j) {
      const double e = exact_weight(code_logit(~sh.window[j]), static_cast<double>(r.max), 1.0, false);
      s += e;
      sh.e[j] = static_cast<float>(e);
    }
    const double inv = 1.0 / (block_reduce(s, Plus{}, sh) + (r.top_k_on ? 0.0 : s_out));
    double local = 0.0;
    for (uint32_t j = my.begin; j < my.end && j < n_k; ++j)
      local += static_cast<float>(static_cast<double>(sh.e[j]) * inv);
    double total;
    double cum = block_exclusive_scan(local, sh, &total);
    int32_t first = kNone;
    for (uint32_t j = my.begin; j < my.end && j < n_k; ++j) {
      cum += static_cast<float>(static_cast<double>(sh.e[j]) * inv);
      if (cum >= static_cast<double>(r.top_p)) {
        first = static_cast<int32_t>(j);
        break;
      }
    }
    first = block_reduce(first, Min{}, sh);
    if (first != kNone) {
      n_p = static_cast<uint32_t>(first) + 1;
    } else if (r.top_k_on || whole) {
      n_p = n_k;  // rounding left the total just short of top_p: the CPU keeps everything
    } else if (!min_p_bound) {
      return kNeedRadix;
    }
  }
  uint32_t n_m = 0xffffffffu;
  if (r.min_p_on) {
    uint32_t c = 0;
    for (uint32_t j = my.begin; j < my.end; ++j) c += code_logit(~sh.window[j]) >= r.min_p_threshold;
    n_m = static_cast<uint32_t>(block_reduce(static_cast<int32_t>(c), Plus{}, sh));
  }
  uint32_t n_keep = n_k < n_p ? n_k : n_p;
  n_keep = n_keep < n_m ? n_keep : n_m;
  return draw_from_window(r, n_keep, false, sh);
}

// ---- radix select (rank order, when the window is too small) -----------------------------------

enum class Target { kCount, kFraction, kUniform };
struct SelectSpec {
  bool mass;       // weights: Weigher * fixed_scale, else 1 per token
  Target target;   // kCount: cum >= value; kFraction: cum >= ceil(value * total); kUniform: cum > floor(value * total)
  double value;
  Weigher w;
};
struct Cut {
  bool found;
  u64 code;  // rank code of the token where the running weight reaches the target
};

__device__ __forceinline__ u64 weight_of(const SelectSpec& s, const Row& r, float l) {
  return s.mass ? static_cast<u64>(s.w(l) * r.fixed_scale) : 1ull;
}

// Among the tokens with rank code >= min_code, in rank order, the first at which the running weight
// reaches the target. One pass per 8-bit digit of the code, the histogram restricted to the codes
// that share the digits chosen so far; once the chosen digit's bin fits the window, it is gathered,
// sorted and scanned. Integer weights make every sum exact, whatever order the atomics land in.
__device__ Cut select_cut(const Row& r, u64 min_code, const SelectSpec& s, Shared& sh) {
  const bool strict = s.target == Target::kUniform;
  u64 prefix = 0, above = 0, target = 0;
  int n_bits = 0;
  const int copy = warp_id() % kDigitCopies;
  const int t = static_cast<int>(threadIdx.x);
  for (int level = 0; level < 8; ++level) {
    const int shift = 56 - 8 * level;
    for (int i = t; i < kDigitCopies * kDigits; i += kThreads) {
      sh.digits.count[i / kDigits][i % kDigits] = 0;
      sh.digits.mass[i / kDigits][i % kDigits] = 0;
    }
    __syncthreads();
    for_each_logit<1>(r.x, r.n, r.vec, [&](int64_t i, float l) {
      const u64 c = rank_code(l, i);
      if (c < min_code || (n_bits > 0 && (c >> (64 - n_bits)) != prefix)) return;
      const int d = static_cast<int>((c >> shift) & 0xffu);
      atomicAdd(&sh.digits.count[copy][d], 1u);
      if (s.mass) atomicAdd(&sh.digits.mass[copy][d], weight_of(s, r, l));
    });
    __syncthreads();
    // Thread t holds digit 255 - t, so thread order is rank order and the prefix sums are the
    // weights of the bins at or above each digit.
    uint32_t count = 0;
    u64 weight = 0;
    if (t < kDigits) {
      for (int c = 0; c < kDigitCopies; ++c) {
        count += sh.digits.count[c][kDigits - 1 - t];
        weight += sh.digits.mass[c][kDigits - 1 - t];
      }
      if (!s.mass) weight = count;
    }
    u64 total;
    const u64 at_or_above = block_exclusive_scan(weight, sh, &total) + weight;
    if (level == 0) {
      const double v = s.value * static_cast<double>(total);
      if (s.target == Target::kCount) {
        target = static_cast<u64>(s.value);
      } else if (s.target == Target::kFraction) {
        target = ceil(v) >= static_cast<double>(total) ? total : static_cast<u64>(ceil(v));
      } else {
        target = floor(v) >= static_cast<double>(total) ? total - 1 : static_cast<u64>(floor(v));
      }
      if (strict ? total <= target : total < target) return Cut{false, 0};
    }
    const bool meets = t < kDigits && (strict ? above + at_or_above > target : above + at_or_above >= target);
    const int32_t chosen = block_reduce(meets ? t : kNone, Min{}, sh);
    if (t == chosen) {
      sh.bcast[0] = above + at_or_above - weight;
      sh.bcast[1] = count;
    }
    __syncthreads();
    above = sh.bcast[0];
    const u64 bin_count = sh.bcast[1];
    __syncthreads();
    prefix = (prefix << 8) | static_cast<u64>(kDigits - 1 - chosen);
    n_bits += 8;
    if (bin_count > kWindow && level < 7) continue;

    const int nb = n_bits;
    const u64 pre = prefix;
    const uint32_t n_bin = gather(
        r.x, r.n, r.vec,
        [&](int64_t i, float l) {
          const u64 c = rank_code(l, i);
          return c >= min_code && (c >> (64 - nb)) == pre;
        },
        [](int64_t i, float l) { return ~rank_code(l, i); }, sh);
    sort_window(sh, n_bin);
    const Share my(n_bin);
    u64 local = 0;
    for (uint32_t j = my.begin; j < my.end; ++j) local += weight_of(s, r, code_logit(~sh.window[j]));
    u64 bin_total;
    u64 cum = above + block_exclusive_scan(local, sh, &bin_total);
    int32_t first = kNone;
    for (uint32_t j = my.begin; j < my.end; ++j) {
      cum += weight_of(s, r, code_logit(~sh.window[j]));
      if (strict ? cum > target : cum >= target) {
        first = static_cast<int32_t>(j);
        break;
      }
    }
    first = block_reduce(first, Min{}, sh);
    const u64 code = first != kNone ? ~sh.window[first] : 0;
    __syncthreads();  // read by every thread before the next select reuses the window
    return Cut{first != kNone, code};
  }
  return Cut{false, 0};
}

__device__ int32_t radix_path(const Row& r, Shared& sh) {
  u64 min_code = 0;  // each cut keeps the rank codes >= min_code
  if (r.top_k_on)
    min_code = select_cut(r, 0, SelectSpec{false, Target::kCount, static_cast<double>(r.top_k), r.raw_w}, sh).code;
  if (r.top_p_on) {
    const Cut c = select_cut(r, min_code, SelectSpec{true, Target::kFraction, static_cast<double>(r.top_p), r.raw_w}, sh);
    if (c.found) min_code = c.code;
  }
  if (r.min_p_on) {
    const u64 m = static_cast<u64>(order_key(r.min_p_threshold)) << 32;
    min_code = m > min_code ? m : min_code;
  }
  const Cut d = select_cut(r, min_code, SelectSpec{true, Target::kUniform, r.uniform, r.draw_w}, sh);
  return d.found ? code_id(d.code) : -1;
}

// ---- rank order ---------------------------------------------------------------------------------

__device__ int32_t rank_path(const Row& r, Shared& sh) {
  const int t = static_cast<int>(threadIdx.x);
  // Pass B: distance histogram (the last bin is counted as the remainder, without atomics).
  for (int i = t; i < kBinCopies * kBins; i += kThreads) sh.bins[i / kBins][i % kBins] = 0;
  __syncthreads();
  const bool need_sum = r.top_p_on && !r.top_k_on;
  const int copy = warp_id() % kBinCopies;
  float sum_f = 0.0f;
  for_each_logit<1>(r.x, r.n, r.vec, [&](int64_t, float l) {
    const int b = dist_bin(r.max, l);
    if (b < kBins - 1) atomicAdd(&sh.bins[copy][b], 1u);
    if (need_sum) sum_f += r.raw_w(l);  // f32 is enough for the window's bound (1e-4 slack)
  });
  __syncthreads();
  uint32_t c0 = 0, c1 = 0;  // bins 2t and 2t + 1
  for (int c = 0; c < kBinCopies; ++c) {
    c0 += sh.bins[c][2 * t];
    c1 += sh.bins[c][2 * t + 1];
  }
  const u64 counted = block_reduce(static_cast<u64>(c0) + c1, Plus{}, sh);
  if (t == kThreads - 1) c1 = static_cast<uint32_t>(static_cast<u64>(r.n) - counted);
  u64 n_total;
  const u64 before = block_exclusive_scan(static_cast<u64>(c0) + c1, sh, &n_total);
  const u64 upto0 = before + c0, upto1 = upto0 + c1;  // tokens in bins <= 2t, <= 2t + 1

  int32_t w = kBins - 1;  // last bin of the window
  if (r.top_k_on) {
    const int32_t cand = upto0 >= r.top_k ? 2 * t : (upto1 >= r.top_k ? 2 * t + 1 : kNone);
    const int32_t w_k = block_reduce(cand, Min{}, sh);
    w = w_k < w ? w_k : w;
  }
  if (need_sum) {
    // Bin b holds distances below (b + 1) / 64 (f32 rounding aside), so exp(-(b + 1) / 64) bounds
    // each of its tokens' weights from below; the window ends where that bound reaches top_p.
    const double sum = block_reduce(static_cast<double>(sum_f), Plus{}, sh);
    const double lb0 = c0 * exp(-(2.0 * t + 1.0) / kBinsPerUnit) * (1.0 - 1e-4);
    const double lb1 = t == kThreads - 1 ? 0.0 : c1 * exp(-(2.0 * t + 2.0) / kBinsPerUnit) * (1.0 - 1e-4);
    double lb_total;
    const double lb_before = block_exclusive_scan(lb0 + lb1, sh, &lb_total);
    const double need = static_cast<double>(r.top_p) * sum * (1.0 + 1e-4);
    const int32_t cand = lb_before + lb0 >= need ? 2 * t : (lb_before + lb0 + lb1 >= need ? 2 * t + 1 : kNone);
    const int32_t w_p = block_reduce(cand, Min{}, sh);
    w = w_p < w ? w_p : w;
  }
  bool min_p_bound = false;
  if (r.min_p_on && !(r.top_k_on && r.top_p_on)) {  // top_p over top_k needs all of top_k's mass
    const int32_t w_m = dist_bin(r.max, r.min_p_threshold);
    min_p_bound = w_m <= w;
    w = w_m < w ? w_m : w;
  }
  const u64 n_w = block_reduce((2 * t <= w ? static_cast<u64>(c0) : 0ull) + (2 * t + 1 <= w ? c1 : 0u), Plus{}, sh);
  if (n_w > kWindow) return radix_path(r, sh);

  // Pass C: gather the window (and sum the mass outside it for top_p without top_k).
  double s_out = 0.0;
  const uint32_t n_got = gather(
      r.x, r.n, r.vec,
      [&](int64_t, float l) {
        if (dist_bin(r.max, l) <= w) return true;
        if (need_sum) s_out += r.raw_w(l);
        return false;
      },
      [](int64_t i, float l) { return ~rank_code(l, i); }, sh);
  s_out = block_reduce(s_out, Plus{}, sh);
  sort_window(sh, n_got);
  const int32_t token = finish_rank(r, n_got, s_out, w == kBins - 1, min_p_bound, sh);
  return token == kNeedRadix ? radix_path(r, sh) : token;
}

// ---- id order -----------------------------------------------------------------------------------

// Id order, tokens >= min_p_threshold, too many for the window: the row's groups of 4 tokens are
// split into 32 slices, one per warp; the slice where the running sum (f32 within a group, f64
// across) passes uniform * total is split again into 32, and the warp of that piece walks it with
// warp prefix sums. Rounding can put the target just past a piece by 1e-16: then the last piece,
// or token, with mass is taken (as the CPU does when the target rounds up to the total).
struct Piece {
  int64_t begin, end;  // groups
  double start;        // running sum before the piece
  double target;
  bool past;           // the target was not passed: take the last token with mass
};

__device__ __forceinline__ void group_weights(const Row& r, int64_t g, float (&e)[4]) {
  float v[4];
  load_group(r.x, r.n, g, r.vec, v);
#pragma unroll
  for (int j = 0; j < 4; ++j) e[j] = 4 * g + j < r.n && v[j] >= r.min_p_threshold ? r.draw_w(v[j]) : 0.0f;
}

// Splits the groups [from.begin, from.end) into 32 pieces (warp w sums piece w) and picks the one
// where from.start + running sum passes the target (uniform * total when from.target < 0).
__device__ Piece pick_piece(const Row& r, const Piece& from, Shared& sh) {
  const int lane = lane_id(), warp = warp_id(), t = static_cast<int>(threadIdx.x);
  const int64_t per = (from.end - from.begin + kWarps - 1) / kWarps;
  auto piece_begin = [&](int w) { return from.begin + w * per < from.end ? from.begin + w * per : from.end; };
  double acc = 0.0;
  const int64_t end = piece_begin(warp) + per < from.end ? piece_begin(warp) + per : from.end;
  for (int64_t g = piece_begin(warp) + lane; g < end; g += kWarpSize) {
    float e[4];
    group_weights(r, g, e);
    acc += static_cast<double>(((e[0] + e[1]) + e[2]) + e[3]);
  }
  sh.red[t + t / kWarpSize].f64 = acc;
  __syncthreads();
  if (warp == 0) {  // lane = piece
    double mine = 0.0;
    for (int i = 0; i < kWarpSize; ++i) mine += sh.red[lane * (kWarpSize + 1) + i].f64;
    const double upto = from.start + warp_inclusive_scan(mine);
    const double target = from.target >= 0.0 ? from.target : r.uniform * __shfl_sync(0xffffffffu, upto, kWarpSize - 1);
    const int32_t passing = warp_reduce(upto > target && mine > 0.0 ? lane : kNone, Min{});
    const int32_t last = warp_reduce(mine > 0.0 ? lane : -1, Max{});
    const int32_t pick = passing == kNone ? last : passing;
    const double start = __shfl_sync(0xffffffffu, upto, pick > 0 ? pick - 1 : 0);
    if (lane == 0) {
      sh.bcast_i32[0] = pick;
      sh.bcast_i32[1] = passing == kNone;
      sh.bcast_f64[0] = pick > 0 ? start : from.start;
      sh.bcast_f64[1] = target;
    }
  }
  __syncthreads();
  const int32_t pick = sh.bcast_i32[0];
  Piece out{piece_begin(pick < 0 ? 0 : pick), 0, sh.bcast_f64[0], sh.bcast_f64[1], from.past || sh.bcast_i32[1] != 0};
  out.end = out.begin + per < from.end ? out.begin + per : from.end;
  if (pick < 0) out.end = out.begin;  // no mass at all (cannot happen: the max token has weight 1)
  __syncthreads();
  return out;
}

__device__ int32_t draw_by_slices(const Row& r, Shared& sh) {
  const Piece slice = pick_piece(r, Piece{0, (r.n + 3) / 4, 0.0, -1.0, false}, sh);
  const Piece piece = pick_piece(r, slice, sh);
  // The walk, by warp 0: running sums in group order (the groups' f32 sums as above).
  if (warp_id() == 0) {
    const int lane = lane_id();
    double carry = piece.start;
    int64_t found = -1, last_nonzero = -1;
    for (int64_t base = piece.begin; base < piece.end; base += kWarpSize) {
      const int64_t g = base + lane;
      float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (g < piece.end) group_weights(r, g, e);
      const float c0 = e[0], c1 = c0 + e[1], c2 = c1 + e[2], c3 = c2 + e[3];
      const double incl = warp_inclusive_scan(static_cast<double>(c3));
      const double b = carry + (incl - static_cast<double>(c3));
      if (!piece.past) {
        int32_t hit = kNone;
        if (b + c0 > piece.target) hit = 0;
        else if (b + c1 > piece.target) hit = 1;
        else if (b + c2 > piece.target) hit = 2;
        else if (b + c3 > piece.target) hit = 3;
        hit = warp_reduce(hit == kNone ? kNone : lane * 4 + hit, Min{});
        if (hit != kNone) {
          found = 4 * (base + hit / 4) + hit % 4;
          break;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (e[j] > 0.0f) last_nonzero = 4 * g + j;
      carry += __shfl_sync(0xffffffffu, incl, kWarpSize - 1);
    }
    last_nonzero = warp_reduce(static_cast<long long>(last_nonzero), Max{});
    if (lane == 0) sh.bcast_i32[0] = static_cast<int32_t>(found >= 0 ? found : last_nonzero);
  }
  __syncthreads();
  return sh.bcast_i32[0];
}

__device__ int32_t id_path(const Row& r, Shared& sh) {
  // MinP::remove_below keeps id order; with min_p off every token stays (-inf ones with weight 0).
  if (!r.min_p_on && r.n <= kWindow) {
    for (int64_t i = threadIdx.x; i < r.n; i += kThreads) sh.window[i] = (static_cast<u64>(i) << 32) | order_key(r.x[i]);
    __syncthreads();
    return draw_from_window(r, static_cast<uint32_t>(r.n), true, sh);
  }
  if (r.min_p_on) {
    const uint32_t n_kept = gather(
        r.x, r.n, r.vec, [&](int64_t, float l) { return l >= r.min_p_threshold; },
        [](int64_t i, float l) { return (static_cast<u64>(i) << 32) | order_key(l); }, sh);
    if (n_kept <= kWindow) {
      sort_window(sh, n_kept);
      return draw_from_window(r, n_kept, true, sh);
    }
  }
  return draw_by_slices(r, sh);
}

// ---- kernel -------------------------------------------------------------------------------------

// logits [n_rows, n] f32, params [n_rows], tokens [n_rows]. grid (n_rows), block (kThreads),
// dynamic shared memory sizeof(Shared).
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, const SampleParams* __restrict__ params, int64_t n,
                  float fixed_scale, int32_t* __restrict__ tokens) {
  KESTREL_DYNAMIC_SMEM(smem);
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  const int64_t row = blockIdx.x;
  const SampleParams p = params[row];
  Row r{};
  r.x = logits + row * n;
  r.n = n;
  r.vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(r.x) % 16 == 0;

  // Pass A: the largest rank code is the max with the lowest id among equals (argmax); a NaN
  // counts as ~0, above every code.
  u64 best = 0;
  for_each_logit<4>(r.x, n, r.vec, [&](int64_t i, float l) {
    const u64 c = l != l ? ~0ull : rank_code(l, i);
    best = c > best ? c : best;
  });
  best = block_reduce(best, Max{}, sh);
  const bool nan = best == ~0ull;
  const float top = code_logit(best);

  int32_t token;
  if (nan) {
    token = -1;
  } else if (!(p.temperature > 0.0f)) {
    token = code_id(best);
  } else if (!(fabsf(top) <= FLT_MAX)) {
    token = -1;  // +inf, or every logit -inf: the CPU softmax has no distribution either
  } else {
    r.max = top;
    r.top_k_on = p.top_k > 0 && p.top_k < n;
    r.top_k = r.top_k_on ? static_cast<uint32_t>(p.top_k) : 0u;
    r.top_p_on = p.top_p < 1.0f && (r.top_k_on ? r.top_k : n) > 1;
    r.top_p = p.top_p;
    r.min_p_on = p.min_p > 0.0f;
    const double min_p = p.min_p < 1.0f ? static_cast<double>(p.min_p) : 1.0;
    r.min_p_threshold = r.min_p_on ? static_cast<float>(static_cast<double>(top) + log(min_p)) : -INFINITY;
    r.scaled = p.temperature != 1.0f;
    r.inv_t = 1.0 / static_cast<double>(p.temperature);
    r.uniform = p.uniform;
    r.fixed_scale = fixed_scale;
    const float inv_t_hi = static_cast<float>(r.inv_t);
    r.draw_w = Weigher{top, inv_t_hi, static_cast<float>(r.inv_t - static_cast<double>(inv_t_hi)), r.scaled};
    r.raw_w = Weigher{top, 1.0f, 0.0f, false};
    token = r.top_k_on || r.top_p_on ? rank_path(r, sh) : id_path(r, sh);
  }
  if (threadIdx.x == 0) tokens[row] = token;
}

}  // namespace kestrel::cuda::sampling
