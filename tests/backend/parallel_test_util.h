// Helpers shared by the CUDA pipeline- and tensor-parallel tests (test_cuda_pipeline_parallel.cpp,
// test_cuda_tensor_parallel.cpp): the engine they run stories260K-sized models in, the per-row
// relative difference they bound, and the check that an error names what it should.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "test_util.h"

namespace kestrel::test {

// 96 blocks of 16 tokens, contexts up to 512, prompts in chunks of `chunk` tokens.
inline EngineConfig parallel_engine_config(int64_t chunk) {
  EngineConfig c;
  c.block_size = 16;
  c.n_kv_blocks = 96;
  c.max_model_len = 512;
  c.max_num_batched_tokens = chunk;
  return c;
}

// The largest |a - b| over the rows of `width` values, each over the row's largest |b|: 0 when
// equal bit for bit.
inline double worst_row_relative(const std::vector<float>& a, const std::vector<float>& b, int64_t width) {
  double worst = 0;
  for (size_t r = 0; r * static_cast<size_t>(width) < b.size(); ++r) {
    double scale = 1e-30, diff = 0;
    for (int64_t i = 0; i < width; ++i) {
      const size_t k = r * static_cast<size_t>(width) + static_cast<size_t>(i);
      scale = std::max(scale, std::fabs(double(b[k])));
      diff = std::max(diff, std::fabs(double(a[k]) - double(b[k])));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// fn throws a kestrel::Error whose message contains phrase.
template <typename Fn>
::testing::AssertionResult error_contains(Fn&& fn, const std::string& phrase) {
  const std::string msg = error_of(fn);
  if (msg.find(phrase) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected an error with \"" << phrase << "\", got \"" << msg << "\"";
}

}  // namespace kestrel::test
