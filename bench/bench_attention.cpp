// Attention of the CPU backend (paged_attention, as the runner calls it once per layer) in a
// SmolLM2-135M-shaped model (30 layers, 3 KV heads of 64, 3 query heads per KV head), each layer
// with its own paged cache (f32, f16 or int8 with per-row scales; at 2048 keys the whole cache is
// 94, 47 or 25 MiB), so the memory traffic is a real pass's. dtype: 0 = f32, 1 = f16, 2 = int8.
//   BM_Smollm2DecodeAttention/n_ctx/dtype: one decode token after n_ctx - 1 keys, every layer.
//     Reports keys/s (n_ctx x layers x KV heads per second) and the cache bytes read per second.
//   BM_Smollm2PrefillAttention/n_tokens/dtype: a causal prefill of n_tokens tokens, every layer.
//     Reports (query, key) pairs per second over all query heads.
// Threads: --threads=N (default: all cores).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cpu/paged_attention.h"
#include "bench_options.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"

using namespace kestrel;

namespace {

constexpr int64_t kLayers = 30, kKvHeads = 3, kHeadDim = 64, kGroup = 3;
constexpr int32_t kBlockSize = 16;

// A cache of n_ctx keys per layer, every row written through the runner's conversions from random
// keys and values.
struct Smollm2Cache {
  KvCache kv;
  std::vector<int32_t> table;
  Smollm2Cache(int64_t n_ctx, KvDtype dtype)
      : kv(kLayers, kKvHeads, kHeadDim, kBlockSize, static_cast<int32_t>((n_ctx + kBlockSize - 1) / kBlockSize), dtype),
        table(static_cast<size_t>(kv.n_blocks())) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> row(kHeadDim);
    const auto& op = cpu::ops();
    for (int64_t l = 0; l < kLayers; ++l)
      for (int64_t slot = 0; slot < n_ctx; ++slot)
        for (int64_t h = 0; h < kKvHeads; ++h)
          for (int part = 0; part < 2; ++part) {
            for (float& x : row) x = nd(rng);
            const int64_t off = kv.offset(slot, h);
            void* base = part == 0 ? kv.k(l) : kv.v(l);
            if (dtype == KvDtype::F32) {
              std::copy(row.begin(), row.end(), static_cast<float*>(base) + off);
            } else if (dtype == KvDtype::F16) {
              op.f32_to_f16(row.data(), static_cast<uint16_t*>(base) + off, kHeadDim);
            } else {
              float* scales = part == 0 ? kv.k_scale(l) : kv.v_scale(l);
              scales[off / kHeadDim] = cpu::quantize_row_int8(row.data(), static_cast<int8_t*>(base) + off, kHeadDim);
            }
          }
    std::iota(table.begin(), table.end(), 0);
  }
  cpu::AttentionArgs layer(int64_t l) const {
    cpu::AttentionArgs a{};
    a.k_cache = kv.k(l);
    a.v_cache = kv.v(l);
    a.kv_dtype = kv.dtype();
    a.k_scale = kv.k_scale(l);
    a.v_scale = kv.v_scale(l);
    a.block_stride = kKvHeads * kBlockSize * kHeadDim;
    a.block_size = kBlockSize;
    a.head_dim = kHeadDim;
    a.group = kGroup;
    a.scale = 0.125f;
    return a;
  }
};

KvDtype dtype_arg(int64_t x) { return x == 0 ? KvDtype::F32 : x == 1 ? KvDtype::F16 : KvDtype::INT8; }

// n_tokens query tokens at positions [n_ctx - n_tokens, n_ctx) through all layers.
void run_layers(benchmark::State& state, const Smollm2Cache& c, int64_t n_ctx, int64_t n_tokens) {
  ThreadPool pool(bench::g_threads);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t q_dim = kKvHeads * kGroup * kHeadDim;
  std::vector<float> q(static_cast<size_t>(n_tokens * q_dim)), out(q.size()), states;
  for (float& x : q) x = nd(rng);
  std::vector<int64_t> ctx(static_cast<size_t>(n_tokens)), begin(ctx.size(), 0);
  for (int64_t t = 0; t < n_tokens; ++t) ctx[static_cast<size_t>(t)] = n_ctx - n_tokens + t + 1;
  const int32_t query_start[2] = {0, static_cast<int32_t>(n_tokens)};
  const cpu::AttentionBatch b{1, query_start, c.table.data(), static_cast<int64_t>(c.table.size()), ctx.data(),
                              begin.data(), q.data(), q_dim, out.data(), q_dim, kKvHeads, kBlockSize * kHeadDim};
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) cpu::paged_attention(pool, c.layer(l), b, states);
    benchmark::DoNotOptimize(out.data());
  }
}

void BM_Smollm2DecodeAttention(benchmark::State& state) {
  const int64_t n_ctx = state.range(0);
  const Smollm2Cache c(n_ctx, dtype_arg(state.range(1)));
  run_layers(state, c, n_ctx, 1);
  const double keys = static_cast<double>(n_ctx * kLayers * kKvHeads);
  state.counters["keys/s"] = benchmark::Counter(keys, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/s"] = benchmark::Counter(static_cast<double>(n_ctx * c.kv.bytes_per_token()),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::OneK::kIs1024);
}

void BM_Smollm2PrefillAttention(benchmark::State& state) {
  const int64_t n = state.range(0);
  const Smollm2Cache c(n, dtype_arg(state.range(1)));
  run_layers(state, c, n, n);
  const double pairs = static_cast<double>(n * (n + 1) / 2 * kLayers * kKvHeads * kGroup);
  state.counters["pairs/s"] = benchmark::Counter(pairs, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_Smollm2PrefillAttention)
    ->ArgsProduct({{128, 2048}, {1}})
    ->ArgNames({"n_tokens", "dtype"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_Smollm2DecodeAttention)
    ->ArgsProduct({{512, 2048, 8192}, {0, 1, 2}})
    ->ArgNames({"n_ctx", "dtype"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
