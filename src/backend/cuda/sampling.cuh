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
#include "backend/cuda/sampling_blocks.cuh"

namespace kestrel::cuda::sampling {

// ---- one row ----------------------------------------------------------------------------------

struct Row {
  const float* x;
  const uint32_t* mask;  // the row's token bitmask, or null (load_group)
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
    for_each_logit<1>(r.x, r.mask, r.n, r.vec, [&](int64_t i, float l) {
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
        r.x, r.mask, r.n, r.vec,
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
  for_each_logit<1>(r.x, r.mask, r.n, r.vec, [&](int64_t, float l) {
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
      r.x, r.mask, r.n, r.vec,
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
  load_group(r.x, r.mask, r.n, g, r.vec, v);
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
    for (int64_t i = threadIdx.x; i < r.n; i += kThreads)
      sh.window[i] = (static_cast<u64>(i) << 32) | order_key(load_one(r.x, r.mask, i));
    __syncthreads();
    return draw_from_window(r, static_cast<uint32_t>(r.n), true, sh);
  }
  if (r.min_p_on) {
    const uint32_t n_kept = gather(
        r.x, r.mask, r.n, r.vec, [&](int64_t, float l) { return l >= r.min_p_threshold; },
        [](int64_t i, float l) { return (static_cast<u64>(i) << 32) | order_key(l); }, sh);
    if (n_kept <= kWindow) {
      sort_window(sh, n_kept);
      return draw_from_window(r, n_kept, true, sh);
    }
  }
  return draw_by_slices(r, sh);
}

// ---- kernel -------------------------------------------------------------------------------------

// logits [n_rows, n] f32, params [n_rows], masks [n_rows, (n + 31) / 32] (read where
// params[row].masked; may be null when no row is), tokens [n_rows]. grid (n_rows), block
// (kThreads), dynamic shared memory sizeof(Shared).
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, const SampleParams* __restrict__ params,
                  const uint32_t* __restrict__ masks, int64_t n, float fixed_scale, int32_t* __restrict__ tokens) {
  KESTREL_PDL_ENTRY();
  KESTREL_DYNAMIC_SMEM(smem);
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  const int64_t row = blockIdx.x;
  const SampleParams p = params[row];
  Row r{};
  r.x = logits + row * n;
  r.mask = p.masked != 0 ? masks + row * ((n + 31) / 32) : nullptr;
  r.n = n;
  r.vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(r.x) % 16 == 0;

  // Pass A: the largest rank code is the max with the lowest id among equals (argmax); a NaN
  // counts as ~0, above every code.
  u64 best = 0;
  for_each_logit<4>(r.x, r.mask, n, r.vec, [&](int64_t i, float l) {
    const u64 c = l != l ? ~0ull : rank_code(l, i);
    best = c > best ? c : best;
  });
  best = block_reduce(best, Max{}, sh);
  const bool nan = best == ~0ull;
  const float top = code_logit(best);

  int32_t token;
  if (nan || !(fabsf(top) <= FLT_MAX)) {
    // NaN, +inf, or every logit -inf: an error for greedy and sampled rows alike, as the CPU
    // sampler's NonFiniteLogitsError (argmax over +inf would hide a model fault).
    token = -1;
  } else if (!(p.temperature > 0.0f)) {
    token = code_id(best);
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
