// Micro benchmarks of the CPU matmul kernels on SmolLM2-135M's shapes, and a whole-model estimate.
//
//   BM_Matmul/type/n_in/n_out/n_tokens/amx: one weight matrix, the same one every iteration
//     (small ones stay in cache, so this is the kernel's speed, not memory's).
//   BM_Smollm2Matmuls/n_tokens/head/amx: every linear layer of the model in forward order
//     (30 layers x q, k, v, o, gate, up, down, then the Q8_0 output head if head = 1), each with
//     its own weights (~96 MiB, like the real model), so it includes the memory traffic a real
//     decode step sees. Reports matmul-only tokens/s; attention, norms and the rest of the forward
//     pass come on top.
//   amx = 0 keeps AVX-512 machines on the vpdpbusd GEMM (what CPUs without AMX run); it changes
//   nothing for n_tokens < 8 or where AMX is absent.
//
// Threads: --threads=N (default: all cores). SIMD level: --cpu-isa=LEVEL (bench_main.cpp). On a shared
// machine use --benchmark_repetitions=N and read the min rows: a preempted worker thread stalls a
// fork-join call for a whole scheduler slice.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/matmul.h"
#include "bench_options.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

using namespace kestrel;
using namespace kestrel::cpu;

namespace {

ThreadPool& pool() {
  static ThreadPool p(kestrel::bench::g_threads);
  return p;
}

// Random quants with sane fp16 scales (random bytes there could be NaN or denormal).
std::vector<uint8_t> random_weights(GgmlType type, int64_t n_in, int64_t n_out, uint32_t seed) {
  std::vector<uint8_t> data(row_bytes(type, n_in) * static_cast<size_t>(n_out));
  std::mt19937 rng(seed);
  for (size_t i = 0; i + 4 <= data.size(); i += 4) {
    const uint32_t v = rng();
    std::memcpy(&data[i], &v, 4);
  }
  const auto& tr = type_traits(type);
  const uint16_t d = fp32_to_fp16(0.01f), m = fp32_to_fp16(-0.08f);
  for (size_t b = 0; b < data.size() / tr.block_bytes; ++b) {
    uint8_t* blk = data.data() + b * tr.block_bytes;
    if (type == GgmlType::Q4_0 || type == GgmlType::Q8_0 || type == GgmlType::Q4_1) std::memcpy(blk, &d, 2);
    if (type == GgmlType::Q4_1) std::memcpy(blk + 2, &m, 2);
  }
  return data;
}

std::vector<float> random_x(int64_t n, uint32_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = nd(rng);
  return x;
}

// Wall time of the benchmark loop, for a plain us-per-token counter: its "min" aggregate is the
// fastest repetition (rate counters such as tok/s aggregate the other way: their "min" row is the
// slowest repetition).
class LoopTimer {
 public:
  LoopTimer() : start_(std::chrono::steady_clock::now()) {}
  double us_per_token(const benchmark::State& state, int64_t n_tokens) const {
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_).count();
    return us / (static_cast<double>(state.iterations()) * static_cast<double>(n_tokens));
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// Selects the AMX switch for one benchmark and restores it afterwards.
struct AmxChoice {
  explicit AmxChoice(bool on) { set_amx_enabled(on); }
  ~AmxChoice() { set_amx_enabled(true); }
};

void BM_Matmul(benchmark::State& state) {
  const auto type = static_cast<GgmlType>(state.range(0));
  const int64_t n_in = state.range(1), n_out = state.range(2), n_tokens = state.range(3);
  const AmxChoice amx(state.range(4) != 0);
  const auto w = random_weights(type, n_in, n_out, 1);
  const auto x = random_x(n_in * n_tokens, 2);
  std::vector<float> y(static_cast<size_t>(n_out * n_tokens));
  MatmulWorkspace ws;
  const WeightView view{type, n_in, n_out, w.data()};
  const LoopTimer timer;
  for (auto _ : state) {
    matmul(view, x.data(), n_tokens, y.data(), ws, pool());
    benchmark::DoNotOptimize(y.data());
  }
  const double flops = 2.0 * n_in * n_out * n_tokens;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(n_tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["us/tok"] = timer.us_per_token(state, n_tokens);
  state.counters["GB/s(w)"] = benchmark::Counter(w.size() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(type_name(type)) + (n_tokens > 1 && matmul_uses_amx() ? " amx" : ""));
}

constexpr int64_t kQ41 = static_cast<int64_t>(GgmlType::Q4_1);
constexpr int64_t kQ80 = static_cast<int64_t>(GgmlType::Q8_0);

void shapes(benchmark::internal::Benchmark* b) {
  // 1: decode GEMV; 2-8: a few sequences decoding (or a 1 + k token verify step); 128: prefill.
  for (int64_t n_tokens : {1, 2, 4, 8, 128}) {
    for (int64_t amx : {1, 0}) {
      if (n_tokens == 1 && amx == 0) continue;  // the GEMV never uses AMX
      b->Args({kQ41, 576, 576, n_tokens, amx});    // q, o
      b->Args({kQ41, 576, 192, n_tokens, amx});    // k, v
      b->Args({kQ41, 576, 1536, n_tokens, amx});   // gate, up
      b->Args({kQ41, 1536, 576, n_tokens, amx});   // down
      b->Args({kQ80, 576, 49152, n_tokens, amx});  // output head
    }
  }
  b->ArgNames({"type", "n_in", "n_out", "n_tokens", "amx"});
}
// The machine may be shared: run with --benchmark_repetitions=N and read the "min" rows.
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
BENCHMARK(BM_Matmul)->Apply(shapes)->UseRealTime()->MinTime(0.3)->ComputeStatistics("min", min_of);

// SmolLM2-135M: n_embd 576, 9 heads / 3 KV heads of 64, FFN 1536, 30 layers, vocab 49152.
struct ModelWeights {
  struct Layer {
    std::vector<uint8_t> q, k, v, o, gate, up, down;
  };
  std::vector<Layer> layers;
  std::vector<uint8_t> head;
  ModelWeights() {
    uint32_t seed = 10;
    for (int l = 0; l < 30; ++l) {
      Layer L;
      L.q = random_weights(GgmlType::Q4_1, 576, 576, seed++);
      L.k = random_weights(GgmlType::Q4_1, 576, 192, seed++);
      L.v = random_weights(GgmlType::Q4_1, 576, 192, seed++);
      L.o = random_weights(GgmlType::Q4_1, 576, 576, seed++);
      L.gate = random_weights(GgmlType::Q4_1, 576, 1536, seed++);
      L.up = random_weights(GgmlType::Q4_1, 576, 1536, seed++);
      L.down = random_weights(GgmlType::Q4_1, 1536, 576, seed++);
      layers.push_back(std::move(L));
    }
    head = random_weights(GgmlType::Q8_0, 576, 49152, seed++);
  }
};

void BM_Smollm2Matmuls(benchmark::State& state) {
  static const ModelWeights model;
  const int64_t n_tokens = state.range(0);
  const bool with_head = state.range(1) != 0;
  const AmxChoice amx(state.range(2) != 0);
  const auto x576 = random_x(576 * n_tokens, 3), x1536 = random_x(1536 * n_tokens, 4);
  std::vector<float> y(static_cast<size_t>(49152 * n_tokens));
  MatmulWorkspace ws;
  auto mm = [&](const std::vector<uint8_t>& w, GgmlType t, int64_t n_in, int64_t n_out) {
    matmul(WeightView{t, n_in, n_out, w.data()}, n_in == 576 ? x576.data() : x1536.data(), n_tokens, y.data(),
           ws, pool());
  };
  const LoopTimer timer;
  for (auto _ : state) {
    for (const auto& L : model.layers) {
      mm(L.q, GgmlType::Q4_1, 576, 576);
      mm(L.k, GgmlType::Q4_1, 576, 192);
      mm(L.v, GgmlType::Q4_1, 576, 192);
      mm(L.o, GgmlType::Q4_1, 576, 576);
      mm(L.gate, GgmlType::Q4_1, 576, 1536);
      mm(L.up, GgmlType::Q4_1, 576, 1536);
      mm(L.down, GgmlType::Q4_1, 1536, 576);
    }
    if (with_head) mm(model.head, GgmlType::Q8_0, 576, 49152);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(n_tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["us/tok"] = timer.us_per_token(state, n_tokens);
}
// Decode (1 token, with the head); verify steps of 1 + k tokens (2, 3, 5, 9, 16: every token's logits); prefill of 128 tokens with the head for every token, and
// without it (a runner only needs the last token's logits); prefill with and without AMX.
BENCHMARK(BM_Smollm2Matmuls)
    ->Args({1, 1, 1})
    ->Args({2, 1, 1})
    ->Args({3, 1, 1})
    ->Args({5, 1, 1})
    ->Args({9, 1, 1})
    ->Args({16, 1, 1})
    ->Args({128, 1, 1})
    ->Args({128, 0, 1})
    ->Args({128, 1, 0})
    ->Args({128, 0, 0})
    ->ArgNames({"n_tokens", "head", "amx"})
    ->UseRealTime()->MinTime(1.0)->ComputeStatistics("min", min_of);

}  // namespace
