// matmul(): argument checks, kernel choice, activation quantization and the split of output rows
// over the thread pool. The arithmetic lives in matmul_scalar.cpp, matmul_avx2.cpp,
// matmul_avx512.cpp (+ matmul_other_avx512.cpp) and matmul_amx.cpp.
#include "backend/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "backend/cpu/matmul_avx512_internal.h"
#include "backend/cpu/matmul_kernels.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kestrel::cpu {
namespace {

// set_simd_level_for_testing and set_amx_enabled; read on every call so a test can switch paths.
std::atomic<int> g_level_cap{static_cast<int>(SimdLevel::Avx512)};
std::atomic<bool> g_amx_on{true};

const detail::MatmulKernels& active_kernels() {
#if defined(__x86_64__)
  switch (matmul_simd_level()) {
    case SimdLevel::Avx512: return detail::kernels_avx512();
    case SimdLevel::Avx2: return detail::kernels_avx2();
    default: break;
  }
#endif
  return detail::kernels_scalar();
}

// Below this many multiply-adds a second thread costs more (wake-up, a shared counter) than it
// saves: ~1 us of work.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

}  // namespace

void MatmulWorkspace::FreeAligned::operator()(uint8_t* p) const { std::free(p); }

MatmulWorkspace::MatmulWorkspace() = default;
MatmulWorkspace::~MatmulWorkspace() = default;

uint8_t* MatmulWorkspace::reserve(size_t n_bytes) {
  if (n_bytes > capacity_ || !buffer_) {
    const size_t cap = detail::align64(std::max<size_t>(n_bytes, 4096));
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, cap));
    if (p == nullptr) throw Error("MatmulWorkspace: cannot allocate " + std::to_string(cap) + " bytes");
    buffer_.reset(p);
    capacity_ = cap;
  }
  return buffer_.get();
}

namespace detail {
bool amx_allowed() { return g_amx_on.load(std::memory_order_relaxed); }
}  // namespace detail

void set_amx_enabled(bool enabled) { g_amx_on.store(enabled, std::memory_order_relaxed); }

bool matmul_uses_amx() {
#if defined(__x86_64__)
  return matmul_simd_level() == SimdLevel::Avx512 && detail::amx_allowed() && detail::amx_usable();
#else
  return false;
#endif
}

SimdLevel matmul_simd_level() {
  return std::min(simd_level(), static_cast<SimdLevel>(g_level_cap.load(std::memory_order_relaxed)));
}

void set_simd_level_for_testing(SimdLevel level) {
  g_level_cap.store(static_cast<int>(level), std::memory_order_relaxed);
}

float vec_dot_f32(const float* a, const float* b, int64_t n) {
  return active_kernels().vec_dot_f32(a, b, n);
}

void matmul(const WeightView& w, const float* x, int64_t n_tokens, float* y, MatmulWorkspace& ws,
            ThreadPool& pool) {
  float* const ys[1] = {y};
  matmul_multi(std::span<const WeightView>(&w, 1), x, n_tokens, ys, ws, pool);
}

void matmul_multi(std::span<const WeightView> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                  MatmulWorkspace& ws, ThreadPool& pool) {
  if (w.size() != y.size())
    throw Error("matmul_multi: " + std::to_string(w.size()) + " weights but " + std::to_string(y.size()) + " outputs");
  const size_t n_mat = w.size();
  if (n_mat == 0) return;
  for (const WeightView& wi : w) {
    if (!wi.type.self_contained() || !matmul_supports(wi.type.storage))
      throw Error("matmul: unsupported weight type " + std::string(type_name(wi.type.storage)) +
                  (wi.type.self_contained() ? "" : " with scales stored apart"));
    const int64_t bs = type_traits(wi.type.storage).block_size;
    if (wi.n_in <= 0 || wi.n_in % bs != 0)
      throw Error("matmul: n_in = " + std::to_string(wi.n_in) + " is not a positive multiple of the " +
                  std::string(type_name(wi.type.storage)) + " block size " + std::to_string(bs));
    if (wi.n_in != w[0].n_in)
      throw Error("matmul_multi: n_in " + std::to_string(wi.n_in) + " and " + std::to_string(w[0].n_in) + " differ");
  }
  if (n_tokens <= 0) return;
  const int64_t n_in = w[0].n_in;

  // Matrices of one weight type share one quantization of x (its layout depends only on the type,
  // n_in and n_tokens); act_of[i] is the first matrix of i's type.
  const detail::MatmulKernels& k = active_kernels();
  constexpr size_t kMaxMatrices = 16;
  if (n_mat > kMaxMatrices) throw Error("matmul_multi: more than 16 matrices");
  size_t act_of[kMaxMatrices], act_off[kMaxMatrices];
  size_t act_total = 0, scratch = 0;
  int64_t work = 0;
  for (size_t i = 0; i < n_mat; ++i) {
    act_of[i] = i;
    for (size_t j = 0; j < i; ++j)
      if (w[j].type.storage == w[i].type.storage) {
        act_of[i] = j;
        break;
      }
    act_off[i] = act_total;
    if (act_of[i] == i) act_total += detail::align64(k.act_bytes(w[i].type.storage, n_in, n_tokens));
    scratch = std::max(scratch, detail::align64(k.scratch_bytes(w[i].type.storage, n_in)));
    work += n_in * w[i].n_out * n_tokens;
  }
  if (work == 0) return;
  const int nth = work < kMinParallelWork ? 1 : pool.size();
  uint8_t* buf = ws.reserve(act_total + scratch * static_cast<size_t>(nth));

  for (size_t i = 0; i < n_mat; ++i) {
    if (act_of[i] != i || k.act_bytes(w[i].type.storage, n_in, n_tokens) == 0) continue;
    uint8_t* dst = buf + act_off[i];
    if (nth > 1 && n_tokens >= 32) {
      // Split at multiples of 16 tokens (see MatmulKernels::quantize_acts).
      const int64_t n_groups = (n_tokens + 15) / 16;
      pool.parallel_for(n_groups, 1, [&](int64_t g0, int64_t g1) {
        k.quantize_acts(w[i].type.storage, x, n_in, n_tokens, 16 * g0, std::min(n_tokens, 16 * g1), ws.activations_8bit, dst);
      });
    } else {
      k.quantize_acts(w[i].type.storage, x, n_in, n_tokens, 0, n_tokens, ws.activations_8bit, dst);
    }
  }

  detail::MatmulArgs args[kMaxMatrices];
  for (size_t i = 0; i < n_mat; ++i) {
    detail::MatmulArgs& a = args[i];
    a.w = w[i];
    a.w_row_bytes = row_bytes(w[i].type.storage, n_in);
    a.x = x;
    a.act = buf + act_off[act_of[i]];
    a.act_stride = k.act_stride(w[i].type.storage, n_in, n_tokens);
    a.n_tokens = n_tokens;
    a.y = y[i];
  }
  uint8_t* scratch_base = buf + act_total;

  if (nth == 1) {
    for (size_t i = 0; i < n_mat; ++i)
      if (w[i].n_out > 0) k.matmul_rows(args[i], 0, w[i].n_out, scratch_base);
    return;
  }
  // Rows go out in chunks from a shared counter rather than a fixed split, so a core slowed by
  // another process does not hold up the whole call. About 4 chunks per thread and matrix keep
  // the counter traffic negligible. Chunks of all matrices form one sequence (matrix by matrix),
  // so the threads never wait between matrices. A row's output does not depend on the chunk it
  // falls in, so each y[i] is bitwise that of a separate call.
  int64_t tile[kMaxMatrices], rows_per_chunk[kMaxMatrices], chunk_end[kMaxMatrices];
  int64_t n_chunks = 0;
  for (size_t i = 0; i < n_mat; ++i) {
    tile[i] = k.row_tile(w[i].type.storage, n_tokens);
    const int64_t n_tiles = (w[i].n_out + tile[i] - 1) / tile[i];
    const int64_t tiles_per_chunk = std::max<int64_t>(1, n_tiles / (4 * nth));
    rows_per_chunk[i] = tiles_per_chunk * tile[i];
    n_chunks += (n_tiles + tiles_per_chunk - 1) / tiles_per_chunk;
    chunk_end[i] = n_chunks;
  }
  std::atomic<int64_t> next{0};
  pool.run([&](int ith, int) {
    uint8_t* scr = scratch_base + static_cast<size_t>(ith) * scratch;
    size_t i = 0;
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) break;
      while (c >= chunk_end[i]) ++i;
      const int64_t first = i == 0 ? 0 : chunk_end[i - 1];
      const int64_t r0 = (c - first) * rows_per_chunk[i];
      const int64_t r1 = std::min(w[i].n_out, r0 + rows_per_chunk[i]);
      k.matmul_rows(args[i], r0, r1, scr);
    }
  });
}

}  // namespace kestrel::cpu
