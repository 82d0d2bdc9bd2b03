// Building blocks of the sampling kernel (sampling.cuh): its constants and shared-memory layout,
// order-preserving keys of logits, the exact exponentials, block-wide reductions and scans, and the
// vectorised row walks. All functions are called by every thread of a block of kThreads threads;
// results are the same in every thread. Split from sampling.cuh to keep each file readable; see
// that file's header for the algorithm.
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
// mask (null: none): the row's token bitmask, bit i % 32 of word i / 32 set = token i allowed; a
// disallowed token reads as -inf, as grammar::apply_token_bitmask leaves it on the host. The four
// bits of a group lie in one word (bits 4g % 32 .. + 3 of word g / 8).
__device__ __forceinline__ void load_group(const float* __restrict__ x, const uint32_t* __restrict__ mask, int64_t n,
                                           int64_t g, bool vec, float (&v)[4]) {
  if (vec) {
    const float4 q = reinterpret_cast<const float4*>(x)[g];
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 4 * g + j < n ? x[4 * g + j] : 0.0f;
  }
  if (mask != nullptr) {
    const uint32_t bits = mask[g >> 3] >> ((g & 7) * 4);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (((bits >> j) & 1u) == 0) v[j] = -INFINITY;
  }
}

// Token i's logit under the mask (as load_group).
__device__ __forceinline__ float load_one(const float* __restrict__ x, const uint32_t* __restrict__ mask, int64_t i) {
  if (mask != nullptr && ((mask[i >> 5] >> (i & 31)) & 1u) == 0) return -INFINITY;
  return x[i];
}

// f(i, logit) for every token (masked as load_group), each thread taking groups threadIdx.x, + kThreads,
// ... (increasing ids), kUnroll loads in flight.
template <int kUnroll, class F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ x, const uint32_t* __restrict__ mask,
                                               int64_t n, bool vec, F&& f) {
  const int64_t n_groups = (n + 3) / 4;
  int64_t g = threadIdx.x;
  for (; g + (kUnroll - 1) * kThreads < n_groups; g += kUnroll * kThreads) {
    float v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_group(x, mask, n, g + u * kThreads, vec, v[u]);
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
    load_group(x, mask, n, g, vec, v);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * g + j < n) f(4 * g + j, v[j]);
  }
}

// Writes code(i, l) into sh.window for every token with keep(i, l) (called once per token, so it
// may accumulate), in no particular order: one atomic per warp and step hands out the slots.
// Returns how many matched, also when more than the window holds (the excess is not written).
template <class Keep, class Code>
__device__ uint32_t gather(const float* __restrict__ x, const uint32_t* __restrict__ mask, int64_t n, bool vec,
                           Keep&& keep, Code&& code, Shared& sh) {
  if (threadIdx.x == 0) sh.slot = 0;
  __syncthreads();
  const int lane = lane_id();
  const int64_t n_groups = (n + 3) / 4;
  const unsigned below = (1u << lane) - 1u;  // lanes before this one
  for (int64_t base = static_cast<int64_t>(warp_id()) * kWarpSize; base < n_groups; base += kThreads) {
    const int64_t g = base + lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (g < n_groups) load_group(x, mask, n, g, vec, v);
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

}  // namespace kestrel::cuda::sampling
