// Sampler cost per token on SmolLM2's 49152-wide vocabulary, for the usual settings.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "sampling/sampler.h"

namespace {

constexpr int32_t kVocab = 49152;

// Model-like logits: 20 strong candidates (10 down to 0.5) over a long tail in [-10, 0), so the
// top 20 hold about 92% of the mass, roughly what a trained LM gives mid-sentence.
std::vector<float> make_logits() {
  std::vector<float> logits(kVocab);
  kestrel::Rng rng(99);
  for (float& l : logits) l = static_cast<float>(rng.next_double() * 10.0 - 10.0);
  for (int i = 0; i < 20; ++i) logits[(i * 7919) % kVocab] = 10.0f - static_cast<float>(i) * 0.5f;
  return logits;
}

void run(benchmark::State& state, const kestrel::SamplingParams& params) {
  const std::vector<float> logits = make_logits();
  const std::vector<int32_t> previous(256, 17);
  kestrel::Sampler sampler(params, kVocab);
  for (auto _ : state) benchmark::DoNotOptimize(sampler.sample(logits, previous));
}

void BM_SampleGreedy(benchmark::State& state) {
  kestrel::SamplingParams params;
  params.temperature = 0.0f;
  run(state, params);
}

void BM_SampleTopK40(benchmark::State& state) {
  kestrel::SamplingParams params;
  params.top_k = 40;
  params.temperature = 0.8f;
  run(state, params);
}

void BM_SampleTopP09(benchmark::State& state) {
  kestrel::SamplingParams params;
  params.top_p = 0.9f;
  params.temperature = 0.8f;
  run(state, params);
}

void BM_SampleLlamaCppDefaults(benchmark::State& state) {
  // llama.cpp's CLI defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8, penalty 1.1.
  kestrel::SamplingParams params;
  params.top_k = 40;
  params.top_p = 0.95f;
  params.min_p = 0.05f;
  params.temperature = 0.8f;
  params.repetition_penalty = 1.1f;
  run(state, params);
}

void BM_SampleFullDistribution(benchmark::State& state) {
  kestrel::SamplingParams params;  // temperature 1, nothing truncated: softmax over all 49152
  run(state, params);
}

}  // namespace

BENCHMARK(BM_SampleGreedy);
BENCHMARK(BM_SampleTopK40);
BENCHMARK(BM_SampleTopP09);
BENCHMARK(BM_SampleLlamaCppDefaults);
BENCHMARK(BM_SampleFullDistribution);
