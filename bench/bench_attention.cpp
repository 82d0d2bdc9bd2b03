// Decode attention of the CPU backend over a long context, by KV cache dtype:
//   BM_Smollm2DecodeAttention/n_ctx/dtype: one decode token's attention in every layer of a
//     SmolLM2-135M-shaped model (30 layers, 3 KV heads of 64, 3 query heads per KV head), each
//     layer with its own paged cache of n_ctx keys (f32, f16 or int8 with per-row scales; at
//     2048 keys the whole cache is 94, 47 or 25 MiB), so the memory traffic is a real step's.
//     dtype: 0 = f32, 1 = f16, 2 = int8. Reports keys/s (n_ctx x layers x KV heads per second) and
//     the cache bytes read per second.
// Threads: --threads=N (default: all cores); tasks are (layer, KV head) pairs as in the runner.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "bench_options.h"
#include "core/thread_pool.h"
#include "memory/kv_cache.h"

using namespace kestrel;

namespace {

constexpr int64_t kLayers = 30, kKvHeads = 3, kHeadDim = 64, kGroup = 3;
constexpr int32_t kBlockSize = 16;

void BM_Smollm2DecodeAttention(benchmark::State& state) {
  const int64_t n_ctx = state.range(0);
  const KvDtype dtype = state.range(1) == 0 ? KvDtype::F32 : state.range(1) == 1 ? KvDtype::F16 : KvDtype::INT8;
  const int32_t n_blocks = static_cast<int32_t>((n_ctx + kBlockSize - 1) / kBlockSize);
  KvCache kv(kLayers, kKvHeads, kHeadDim, kBlockSize, n_blocks, dtype);
  ThreadPool pool(bench::g_threads);
  // Every row written through the runner's conversions, from random keys and values.
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
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::vector<float> q(static_cast<size_t>(kKvHeads * kGroup * kHeadDim)), out(q.size());
  for (float& x : q) x = nd(rng);
  for (auto _ : state) {
    pool.parallel_for(kLayers * kKvHeads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t l = task / kKvHeads, h = task % kKvHeads;
        cpu::AttentionArgs a{};
        a.q = q.data() + h * kGroup * kHeadDim;
        a.k_cache = kv.k(l);
        a.v_cache = kv.v(l);
        a.kv_dtype = dtype;
        a.k_scale = kv.k_scale(l);
        a.v_scale = kv.v_scale(l);
        a.block_stride = kKvHeads * kBlockSize * kHeadDim;
        a.head_offset = h * kBlockSize * kHeadDim;
        a.block_table = table.data();
        a.block_size = kBlockSize;
        a.n_ctx = n_ctx;
        a.head_dim = kHeadDim;
        a.group = kGroup;
        a.scale = 0.125f;
        a.out = out.data() + h * kGroup * kHeadDim;
        op.attention(a);
      }
    });
    benchmark::DoNotOptimize(out.data());
  }
  const double keys = static_cast<double>(n_ctx * kLayers * kKvHeads);
  state.counters["keys/s"] = benchmark::Counter(keys, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/s"] = benchmark::Counter(static_cast<double>(n_ctx * kv.bytes_per_token()),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::OneK::kIs1024);
}

BENCHMARK(BM_Smollm2DecodeAttention)
    ->ArgsProduct({{512, 2048, 8192}, {0, 1, 2}})
    ->ArgNames({"n_ctx", "dtype"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
