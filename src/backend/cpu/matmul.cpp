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

// Test hooks (set_simd_level_for_testing, set_amx_for_testing); read on every call so a test can
// switch paths.
std::atomic<int> g_level_cap{static_cast<int>(SimdLevel::Avx512)};
std::atomic<bool> g_amx_on{true};

bool amx_env_allows() {
  static const bool allowed = [] {
    const char* e = std::getenv("KESTREL_AMX");
    return e == nullptr || std::string(e) != "0";
  }();
  return allowed;
}

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
bool amx_allowed() { return g_amx_on.load(std::memory_order_relaxed) && amx_env_allows(); }
}  // namespace detail

void set_amx_for_testing(bool enabled) { g_amx_on.store(enabled, std::memory_order_relaxed); }

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
  if (!matmul_supports(w.type))
    throw Error("matmul: unsupported weight type " + std::string(type_name(w.type)));
  const int64_t bs = type_traits(w.type).block_size;
  if (w.n_in <= 0 || w.n_in % bs != 0)
    throw Error("matmul: n_in = " + std::to_string(w.n_in) + " is not a positive multiple of the " +
                std::string(type_name(w.type)) + " block size " + std::to_string(bs));
  if (n_tokens <= 0 || w.n_out <= 0) return;

  const detail::MatmulKernels& k = active_kernels();
  const size_t act_bytes = detail::align64(k.act_bytes(w.type, w.n_in, n_tokens));
  const size_t scratch = detail::align64(k.scratch_bytes(w.type, w.n_in));
  const int64_t work = w.n_in * w.n_out * n_tokens;
  const int nth = work < kMinParallelWork ? 1 : pool.size();
  uint8_t* buf = ws.reserve(act_bytes + scratch * static_cast<size_t>(nth));

  if (act_bytes != 0) {
    if (nth > 1 && n_tokens >= 32) {
      // Split at multiples of 16 tokens (see MatmulKernels::quantize_acts).
      const int64_t n_groups = (n_tokens + 15) / 16;
      pool.parallel_for(n_groups, 1, [&](int64_t g0, int64_t g1) {
        k.quantize_acts(w.type, x, w.n_in, n_tokens, 16 * g0, std::min(n_tokens, 16 * g1), ws.activations_8bit, buf);
      });
    } else {
      k.quantize_acts(w.type, x, w.n_in, n_tokens, 0, n_tokens, ws.activations_8bit, buf);
    }
  }

  detail::MatmulArgs args;
  args.w = w;
  args.w_row_bytes = row_bytes(w.type, w.n_in);
  args.x = x;
  args.act = buf;
  args.act_stride = k.act_stride(w.type, w.n_in, n_tokens);
  args.n_tokens = n_tokens;
  args.y = y;
  uint8_t* scratch_base = buf + act_bytes;

  if (nth == 1) {
    k.matmul_rows(args, 0, w.n_out, scratch_base);
    return;
  }
  // Rows go out in chunks from a shared counter rather than a fixed split, so a core slowed by
  // another process does not hold up the whole call. About 4 chunks per thread keep the counter
  // traffic negligible.
  const int64_t tile = k.row_tile(w.type, n_tokens);
  const int64_t n_tiles = (w.n_out + tile - 1) / tile;
  const int64_t tiles_per_chunk = std::max<int64_t>(1, n_tiles / (4 * nth));
  const int64_t n_chunks = (n_tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  std::atomic<int64_t> next{0};
  pool.run([&](int ith, int) {
    uint8_t* scr = scratch_base + static_cast<size_t>(ith) * scratch;
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) break;
      const int64_t r0 = c * tiles_per_chunk * tile;
      const int64_t r1 = std::min(w.n_out, r0 + tiles_per_chunk * tile);
      k.matmul_rows(args, r0, r1, scr);
    }
  });
}

}  // namespace kestrel::cpu
