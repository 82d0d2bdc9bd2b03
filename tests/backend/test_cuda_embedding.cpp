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

}  // namespace
}  // namespace kestrel::test
