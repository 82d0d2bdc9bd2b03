// INT4 weights (int4_ops.h): the launchers of int4_gemm.cuh's kernels and the layout's checks.
#include "backend/cuda/int4_gemm.cuh"

#include <algorithm>
#include <string>

#include "backend/cuda/int4_ops.h"

namespace kestrel::cuda {

namespace {

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// The group of column k is k >> shift: log2 G, or 31 for one group per row (k < 2^31).
int group_shift(const Int4Matrix& w) {
  if (w.group_size == w.n_in && !power_of_two(w.group_size)) return 31;
  int s = 0;
  while ((int64_t{1} << s) < w.group_size) ++s;
  return s;
}

std::string shape_of(const Int4Matrix& w) {
  return "n_in " + std::to_string(w.n_in) + ", n_out " + std::to_string(w.n_out) + ", group size " +
         std::to_string(w.group_size);
}

template <int kNT, int kU, int kR, int kWarps, int kGpt>
void launch_int4(const SkinnyInt4Args& a, const bf16* x, bf16* y, int n_tokens, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kSkinnyRows * kR))), block(kWarps * kWarpSize);
  const Int4Matrix& w = a.w4;
  const int ng = static_cast<int>(w.n_groups()), sh = group_shift(w), ni = static_cast<int>(a.n_in),
            no = static_cast<int>(a.n_out);
  if (a.swiglu) {
    auto* k = &skinny_gemm_int4_kernel<kNT, kU, kR, kWarps, kGpt, true>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, x, a.x_stride, w.codes, w.meta, ng, sh, w.scale_f16, y, n_tokens, ni, no);
  } else {
    auto* k = &skinny_gemm_int4_kernel<kNT, kU, kR, kWarps, kGpt, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, x, a.x_stride, w.codes, w.meta, ng, sh, w.scale_f16, y, n_tokens, ni, no);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

// The default variant of (kNT, kU, kR, kWarps) for every group layout and input.
template <int kNT, int kU, int kR, int kWarps>
void launch_any_group(const SkinnyInt4Args& a, const bf16* x, bf16* y, int n_tokens, cudaStream_t stream) {
  const int64_t G = a.w4.group_size;
  if (G == 32) return launch_int4<kNT, kU, kR, kWarps, 4>(a, x, y, n_tokens, stream);
  if (G == 64) return launch_int4<kNT, kU, kR, kWarps, 2>(a, x, y, n_tokens, stream);
  launch_int4<kNT, kU, kR, kWarps, 1>(a, x, y, n_tokens, stream);
}

// One launch of at most 32 tokens: the variant for (tokens, unroll, row groups, warps); the
// benchmark's other variants for group sizes from 128 without SwiGLU only.
void launch_slice(const SkinnyInt4Args& a, const bf16* x, bf16* y, int n_tokens, cudaStream_t stream) {
  const int u = a.unroll, r = a.row_groups, wp = a.warps;
  const bool dflt = u == 0 && r == 0 && wp == 0;
  const bool extra = a.w4.group_size >= 128 && !a.swiglu;
  auto is = [&](int uu, int rr, int ww) { return u == uu && r == rr && wp == ww; };
  // Defaults from kestrel_cuda_bench int4 on the H200 (docs/performance.md): 2 row groups of 8
  // warps up to 8 tokens (the fastest or within 4% of it at every 8B shape at 1 and 8 tokens),
  // one row group of 8 warps above.
  if (n_tokens <= 8) {
    if (dflt || is(1, 2, 8)) return launch_any_group<1, 1, 2, 8>(a, x, y, n_tokens, stream);
    if (extra && is(2, 1, 4)) return launch_int4<1, 2, 1, 4, 1>(a, x, y, n_tokens, stream);
    if (extra && is(1, 1, 8)) return launch_int4<1, 1, 1, 8, 1>(a, x, y, n_tokens, stream);
    if (extra && is(1, 2, 4)) return launch_int4<1, 1, 2, 4, 1>(a, x, y, n_tokens, stream);
  } else if (n_tokens <= 16) {
    if (dflt || is(1, 1, 8)) return launch_any_group<2, 1, 1, 8>(a, x, y, n_tokens, stream);
    if (extra && is(1, 2, 4)) return launch_int4<2, 1, 2, 4, 1>(a, x, y, n_tokens, stream);
    if (extra && is(1, 1, 4)) return launch_int4<2, 1, 1, 4, 1>(a, x, y, n_tokens, stream);
  } else {
    if (dflt || is(1, 1, 8)) return launch_any_group<4, 1, 1, 8>(a, x, y, n_tokens, stream);
    if (extra && is(1, 1, 4)) return launch_int4<4, 1, 1, 4, 1>(a, x, y, n_tokens, stream);
  }
  throw Error("skinny_gemm_int4: no kernel built for unroll " + std::to_string(u) + ", row groups " +
              std::to_string(r) + ", warps " + std::to_string(wp) + " at " + std::to_string(n_tokens) +
              " tokens and group size " + std::to_string(a.w4.group_size));
}

}  // namespace

bool int4_act_order_perm(const int32_t* g_idx, int64_t n_in, int64_t group_size, std::vector<int32_t>& perm) {
  perm.clear();
  if (group_size <= 0 || n_in % group_size != 0) return false;
  const int64_t n_groups = n_in / group_size;
  bool identity = true;
  std::vector<int64_t> count(static_cast<size_t>(n_groups), 0);
  for (int64_t k = 0; k < n_in; ++k) {
    const int32_t g = g_idx[k];
    if (g < 0 || g >= n_groups) return false;
    identity = identity && g == k / group_size;
    ++count[static_cast<size_t>(g)];
  }
  for (const int64_t c : count)
    if (c != group_size) return false;
  if (identity) return true;
  perm.resize(static_cast<size_t>(n_in));
  std::vector<int64_t> next(static_cast<size_t>(n_groups));
  for (int64_t g = 0; g < n_groups; ++g) next[static_cast<size_t>(g)] = g * group_size;
  for (int64_t k = 0; k < n_in; ++k) perm[static_cast<size_t>(next[static_cast<size_t>(g_idx[k])]++)] = static_cast<int32_t>(k);
  return true;
}

void pack_int4_rows(const uint8_t* q, int64_t n_rows, int64_t n_in, const int32_t* perm, uint32_t* words) {
  const int64_t n_words = n_in / 8;
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* src = q + r * n_in;
    uint32_t* dst = words + r * n_words;
    std::fill(dst, dst + n_words, 0u);
    for (int64_t k = 0; k < n_in; ++k) {
      const uint32_t code = src[perm != nullptr ? perm[k] : k] & 0xFu;
      dst[int4_word_of(k)] |= code << (4 * int4_nibble_of(k));
    }
  }
}

bool int4_layout_supports(int64_t n_in, int64_t n_out, int64_t group_size) {
  return n_in > 0 && n_in % 128 == 0 && n_in <= 0x7fffffff && n_out > 0 && n_out <= 0x7fffffff &&
         (group_size == n_in || (power_of_two(group_size) && group_size >= 32 && n_in % group_size == 0));
}

bool skinny_gemm_int4_supports(int64_t n_tokens, const Int4Matrix& w) {
  return n_tokens >= 1 && n_tokens <= kInt4SkinnyMaxTokens && int4_layout_supports(w.n_in, w.n_out, w.group_size);
}

void skinny_gemm_int4(const SkinnyInt4Args& a, cudaStream_t stream) {
  const Int4Matrix& w = a.w4;
  if (!skinny_gemm_int4_supports(a.n_tokens, w) || a.n_in != w.n_in || a.n_out != w.n_out || a.f32_out)
    throw Error("skinny_gemm_int4: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", " + shape_of(w) +
                (a.f32_out ? ", f32 output" : "") + ")");
  if (w.codes == nullptr || w.meta == nullptr) throw Error("skinny_gemm_int4: no codes or meta");
  if (w.perm != nullptr && a.swiglu)
    throw Error("skinny_gemm_int4: act-order input must be gathered first (int4_gather_columns)");
  ProjectionOperands checked = a;
  checked.w = reinterpret_cast<const bf16*>(w.codes);
  check_gemv_operands("skinny_gemm_int4", checked);
  if (reinterpret_cast<uintptr_t>(w.meta) % 16 != 0) throw Error("skinny_gemm_int4: meta not 16-byte aligned");
  constexpr int64_t kSlice = 32;
  // A chosen variant applies to the full slices; a shorter last slice takes its size's default.
  SkinnyInt4Args last = a;
  last.unroll = last.row_groups = last.warps = 0;
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kSlice) {
    const int n = static_cast<int>(std::min(kSlice, a.n_tokens - t0));
    const bool rest = t0 > 0 && n < kSlice;
    launch_slice(rest ? last : a, a.x + t0 * a.x_stride, static_cast<bf16*>(a.y) + t0 * a.n_out, n, stream);
  }
}

void dequantize_int4(const Int4Matrix& w, bf16* out, cudaStream_t stream) {
  if (!int4_layout_supports(w.n_in, w.n_out, w.group_size))
    throw Error("dequantize_int4: unsupported shape (" + shape_of(w) + ")");
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0) throw Error("dequantize_int4: output not 16-byte aligned");
  const int64_t n = w.n_out * (w.n_in / 8);
  const dim3 grid(static_cast<unsigned>(ceil_div(n, 256))), block(256);
  auto* k = &dequantize_int4_kernel;
  KESTREL_LAUNCH(k, grid, block, 0, stream, w.codes, w.meta, w.perm, w.n_in, w.n_out,
                 w.n_groups(), group_shift(w), w.scale_f16, out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void int4_gather_columns(const bf16* x, int64_t x_stride, const int32_t* perm, int64_t n_tokens, int64_t n_in,
                         bool swiglu, bf16* xp, cudaStream_t stream) {
  if (n_tokens <= 0 || n_in <= 0 || x_stride < (swiglu ? 2 * n_in : n_in) || perm == nullptr)
    throw Error("int4_gather_columns: bad shape (n_tokens " + std::to_string(n_tokens) + ", n_in " +
                std::to_string(n_in) + ", x_stride " + std::to_string(x_stride) + ")");
  const int64_t n = n_tokens * n_in;
  const dim3 grid(static_cast<unsigned>(ceil_div(n, 256))), block(256);
  if (swiglu) {
    auto* k = &int4_gather_columns_kernel<true>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, x, x_stride, perm, n_tokens, n_in, xp);
  } else {
    auto* k = &int4_gather_columns_kernel<false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, x, x_stride, perm, n_tokens, n_in, xp);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
