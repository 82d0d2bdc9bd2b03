// CUDA embedding lookup against a plain-loop reference: bf16 -> f32 is exact, so outputs must match
// bit for bit.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaEmbedding, MatchesTableRows) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(1);
  struct Case {
    int64_t n_vocab, n_embd, n_tokens;
  };
  // 576: SmolLM2; 64: stories260K; 100 and 3: widths that are not whole 16-byte chunks (scalar kernel).
  for (const Case c : {Case{1000, 576, 7}, Case{512, 64, 9}, Case{50, 100, 1}, Case{300, 4096, 33}, Case{17, 3, 5}}) {
    SCOPED_TRACE("n_vocab " + std::to_string(c.n_vocab) + " n_embd " + std::to_string(c.n_embd) + " n_tokens " +
                 std::to_string(c.n_tokens));
    const auto table = random_bf16(static_cast<size_t>(c.n_vocab * c.n_embd), rng);
    std::vector<int32_t> ids(static_cast<size_t>(c.n_tokens));
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(c.n_vocab - 1));
    for (auto& id : ids) id = pick(rng);
    ids.back() = static_cast<int32_t>(c.n_vocab - 1);
    DeviceBuffer<uint16_t> d_table(table);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_out(static_cast<size_t>(c.n_tokens * c.n_embd));
    d_out.poison();
    cuda::embedding(d_table.bf16(), d_ids.get(), c.n_tokens, c.n_embd, 1.0f, d_out.get(), nullptr);
    const auto out = d_out.download();
    int64_t mismatches = 0;
    for (int64_t t = 0; t < c.n_tokens; ++t)
      for (int64_t i = 0; i < c.n_embd; ++i) {
        const float want = from_bf16(table[static_cast<size_t>(ids[static_cast<size_t>(t)] * c.n_embd + i)]);
        mismatches += out[static_cast<size_t>(t * c.n_embd + i)] != want;
      }
    EXPECT_EQ(mismatches, 0);
  }
}

// A tensor-parallel rank's table: rows [vocab_begin, vocab_begin + n_rows) of the vocabulary. Ids
// inside read their row, every other id (below, above, at the slice's ends) gives a zero row.
TEST(CudaEmbedding, VocabularySliceGivesZerosOutsideIt) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(2);
  for (const int64_t n_embd : {int64_t{64}, int64_t{100}}) {  // the 16-byte kernel and the scalar one
    SCOPED_TRACE("n_embd " + std::to_string(n_embd));
    const int64_t vocab_begin = 256, n_rows = 128;
    const auto table = random_bf16(static_cast<size_t>(n_rows * n_embd), rng);
    const std::vector<int32_t> ids = {0, 255, 256, 300, 383, 384, 511, 256};
    DeviceBuffer<uint16_t> d_table(table);
    DeviceBuffer<int32_t> d_ids(ids);
    const int64_t n = static_cast<int64_t>(ids.size());
    DeviceBuffer<float> d_out(static_cast<size_t>(n * n_embd));
    d_out.poison();
    cuda::embedding(d_table.bf16(), d_ids.get(), n, n_embd, 2.0f, d_out.get(), nullptr, vocab_begin, n_rows);
    const auto out = d_out.download();
    int64_t mismatches = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = ids[static_cast<size_t>(t)] - vocab_begin;
      for (int64_t i = 0; i < n_embd; ++i) {
        const float want = row < 0 || row >= n_rows ? 0.0f : 2.0f * from_bf16(table[static_cast<size_t>(row * n_embd + i)]);
        mismatches += out[static_cast<size_t>(t * n_embd + i)] != want;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

}  // namespace
}  // namespace kestrel::test
