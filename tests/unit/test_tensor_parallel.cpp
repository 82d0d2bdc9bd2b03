// Tensor parallelism on the CPU (RunnerOptions::tensor_parallel_size, model/tensor_parallel.h):
// the in-process communicator's collectives against float64 sums, and the logits of models split
// over 2, 3 or 4 ranks against the same model on one rank and against transformers. A split only
// reorders the f32 sums of the row-parallel projections (each rank adds its slice of the input
// columns, then the ranks' partial sums are added), so the logits agree to a few f32 roundings of
// the largest activations: the bounds below are relative to the largest |logit|.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/communicator.h"
#include "backend/tensor_parallel_runner.h"
#include "core/dtype.h"
#include "engine/engine.h"
#include "hf_tiny_reference.h"
#include "model/tensor_parallel.h"
#include "npy.h"
#include "test_util.h"

namespace kestrel {
namespace {

// fn throws a kestrel::Error whose message contains phrase.
template <typename Fn>
::testing::AssertionResult error_has(Fn&& fn, const std::string& phrase) {
  const std::string msg = test::error_of(fn);
  if (msg.find(phrase) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected an error with \"" << phrase << "\", got \"" << msg << "\"";
}

// Runs fn(rank, comm) on one thread per rank of an in-process group of `size`.
template <typename Fn>
void on_ranks(int size, Fn fn) {
  auto comms = make_in_process_communicators(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { fn(r, *comms[static_cast<size_t>(r)]); });
  for (std::thread& t : threads) t.join();
}

TEST(InProcessCommunicator, AllReduceSumMatchesFloat64) {
  for (int size : {1, 2, 3, 4}) {
    const int64_t n = 1001;  // not a multiple of the ranks: uneven chunks
    std::vector<std::vector<float>> data(static_cast<size_t>(size), std::vector<float>(n));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto& d : data)
      for (float& x : d) x = u(rng);
    std::vector<double> want(n, 0.0);
    for (const auto& d : data)
      for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] += d[static_cast<size_t>(i)];
    // Three reductions in a row: the scratch and the barriers are reused.
    on_ranks(size, [&](int r, Communicator& c) {
      EXPECT_EQ(c.rank(), r);
      EXPECT_EQ(c.size(), size);
      std::vector<float> buf = data[static_cast<size_t>(r)];
      for (int k = 0; k < 3; ++k) {
        buf = data[static_cast<size_t>(r)];
        c.all_reduce_sum(buf.data(), n);
      }
      data[static_cast<size_t>(r)] = buf;
    });
    for (int r = 0; r < size; ++r)
      for (int64_t i = 0; i < n; ++i) {
        // size - 1 f32 additions of terms below 1 in magnitude: each rounding <= 2^-24 * size.
        EXPECT_NEAR(data[static_cast<size_t>(r)][static_cast<size_t>(i)], want[static_cast<size_t>(i)], 4e-7 * size)
            << "size " << size << " rank " << r << " element " << i;
        EXPECT_EQ(data[static_cast<size_t>(r)][static_cast<size_t>(i)], data[0][static_cast<size_t>(i)]);
      }
  }
}

TEST(InProcessCommunicator, AllReduceBf16RoundsTheF32SumOnce) {
  const int size = 3, n = 64;
  std::vector<std::vector<uint16_t>> data(size, std::vector<uint16_t>(n));
  for (int r = 0; r < size; ++r)
    for (int i = 0; i < n; ++i) data[r][i] = fp32_to_bf16(0.37f * static_cast<float>(i - 20) + static_cast<float>(r));
  std::vector<uint16_t> want(n);
  for (int i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < size; ++r) s += bf16_to_fp32(data[r][i]);
    want[i] = fp32_to_bf16(static_cast<float>(s));  // three bf16 values: their f32 sum is exact here
  }
  on_ranks(size, [&](int r, Communicator& c) { c.all_reduce_sum(data[r].data(), n, CommDtype::BF16); });
  for (int r = 0; r < size; ++r) EXPECT_EQ(data[r], want) << "rank " << r;
}

TEST(InProcessCommunicator, AllGatherOrdersByRank) {
  const int size = 4, n = 5;
  std::vector<std::vector<float>> out(size);
  on_ranks(size, [&](int r, Communicator& c) {
    std::vector<float> in(n);
    for (int i = 0; i < n; ++i) in[i] = static_cast<float>(10 * r + i);
    out[r].resize(size * n);
    c.all_gather(in.data(), n, out[r].data());
  });
  for (int r = 0; r < size; ++r)
    for (int k = 0; k < size; ++k)
      for (int i = 0; i < n; ++i) EXPECT_EQ(out[r][k * n + i], static_cast<float>(10 * k + i));
  EXPECT_TRUE(error_has([] { make_in_process_communicators(0); }, "at least one rank"));
}

// A rank that fails between collectives aborts the group: the ranks already waiting in an
// all-reduce, and every later collective, throw instead of waiting for it forever.
TEST(InProcessCommunicator, AbortReleasesTheRanksWaitingInACollective) {
  std::vector<std::string> errors(3);
  on_ranks(3, [&](int r, Communicator& c) {
    std::vector<float> buf(64, 1.0f);
    c.all_reduce_sum(buf.data(), 64);  // one that completes
    EXPECT_EQ(buf[0], 3.0f);
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are waiting by now
      c.abort();
      c.abort();  // twice is harmless
    } else {
      errors[static_cast<size_t>(r)] = test::error_of([&] { c.all_reduce_sum(buf.data(), 64); });
    }
    errors[static_cast<size_t>(r)] += "|" + test::error_of([&] { c.all_reduce_sum(buf.data(), 64, CommDtype::BF16); });
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("another rank failed"), std::string::npos) << e;
  // The waiting all-reduce itself threw (before the '|'), not only the later one.
  EXPECT_LT(errors[0].find("another rank failed"), errors[0].find('|')) << errors[0];
}

// The tensor-parallel driver over stand-in ranks that all-reduce inside their pass: one rank
// throws before its collective; the pass returns that rank's error (not the aborted collectives'
// of the others, which would otherwise wait forever), and the group refuses later passes. A bad
// batch is refused before any rank runs, and leaves the group usable.
TEST(TensorParallelRunner, AFailingRankEndsThePassWithItsErrorInsteadOfAHang) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  struct StandIn final : ModelRunner {
    StandIn(Communicator* c, int64_t width, const bool* fail) : comm(c), logits(width), fail(fail) {}
    std::span<const float> forward(const ForwardBatch& b) override {
      if (*fail && comm->rank() == 2) throw Error("rank 2 ran out of memory");
      std::vector<float> x(8, 1.0f);
      comm->all_reduce_sum(x.data(), 8);
      std::fill(logits.begin(), logits.end(), x[0] + static_cast<float>(comm->rank()));
      return {logits.data(), logits.size() * b.logits_indices.size()};
    }
    void copy_blocks(std::span<const BlockCopy>) override {}
    int32_t n_kv_blocks() const override { return 4; }
    int32_t block_size() const override { return 16; }
    KvDtype kv_dtype() const override { return KvDtype::F32; }
    int64_t kv_bytes_per_token() const override { return 8; }
    std::string description() const override { return "stand-in"; }
    Communicator* comm;
    std::vector<float> logits;
    const bool* fail;
  };
  const int size = 4;
  const int64_t V = model->hparams().n_vocab;
  bool fail = false;
  auto comms = make_in_process_communicators(size);
  std::vector<std::unique_ptr<LlamaModel>> shards;
  std::vector<std::unique_ptr<ModelRunner>> ranks;
  for (int r = 0; r < size; ++r) {
    shards.push_back(model->tensor_parallel_shard(r, size));
    ranks.push_back(std::make_unique<StandIn>(comms[static_cast<size_t>(r)].get(), V / size, &fail));
  }
  const auto tp = make_tensor_parallel_runner(std::move(shards), std::move(comms), std::move(ranks), model->hparams());
  const std::vector<int32_t> ids = {1}, pos = {0}, qs = {0, 1}, ctx = {1}, table = {0}, rows = {0};
  const std::vector<int64_t> slots = {0};
  ForwardBatch b{ids, pos, slots, qs, ctx, table, 1, rows};
  const std::span<const float> logits = tp->forward(b);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), V);
  for (int r = 0; r < size; ++r) EXPECT_EQ(logits[static_cast<size_t>(r * (V / size))], 4.0f + static_cast<float>(r));
  const std::vector<int32_t> bad_ids = {static_cast<int32_t>(V)};
  ForwardBatch bad{bad_ids, pos, slots, qs, ctx, table, 1, rows};
  EXPECT_FALSE(test::error_of([&] { tp->forward(bad); }).empty());
  EXPECT_EQ(tp->forward(b).size(), logits.size());  // still usable
  fail = true;
  EXPECT_EQ(test::error_of([&] { tp->forward(b); }), "rank 2 ran out of memory");
  fail = false;
  EXPECT_NE(test::error_of([&] { tp->forward(b); }).find("failed in an earlier step"), std::string::npos);
}

EngineConfig tp_config(int tp, int64_t chunk) {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.max_model_len = 256;
  c.max_num_batched_tokens = chunk;
  c.tensor_parallel_size = tp;
  c.n_threads = tp;  // one thread per rank: the ranks' pools do not spin against each other
  return c;
}

// max |a - b| / max |a|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    m = std::max(m, static_cast<double>(std::abs(a[i])));
  }
  return d / m;
}

std::vector<std::vector<int32_t>> random_prompts(int64_t n_vocab, int count, int length) {
  std::mt19937 rng(20251203);
  std::uniform_int_distribution<int32_t> id(3, static_cast<int32_t>(n_vocab - 1));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(count));
  for (auto& p : out) {
    p.push_back(1);  // BOS
    for (int i = 1; i < length + static_cast<int>(&p - out.data()) * 7; ++i) p.push_back(id(rng));
  }
  return out;
}

// Prefill (one pass and 5-token chunks) and decode (the prompt one token a step) logits of
// `prompt` split over `tp` ranks, against one rank; greedy continuations of `prompts` run together.
void expect_same_as_one_rank(const LlamaModel& model, int tp, const std::vector<std::vector<int32_t>>& prompts,
                             double bound) {
  const std::vector<int32_t>& prompt = prompts.back();
  for (int64_t chunk : {int64_t{512}, int64_t{5}, int64_t{1}}) {
    const std::vector<float> one = test::prompt_logits(model, prompt, tp_config(1, chunk));
    const std::vector<float> split = test::prompt_logits(model, prompt, tp_config(tp, chunk));
    const double rel = rel_diff(one, split);
    std::printf("tp %d, %lld-token steps: max |logit diff| / max |logit| %.3g\n", tp, static_cast<long long>(chunk), rel);
    EXPECT_LT(rel, bound) << "tp " << tp << " chunk " << chunk;
  }
  Engine one(model, nullptr, tp_config(1, 64));
  Engine split(model, nullptr, tp_config(tp, 64));
  EXPECT_EQ(test::greedy_ids(split, prompts, 24), test::greedy_ids(one, prompts, 24)) << "tp " << tp;
}

// stories260K: 8 query heads over 4 KV heads, FFN 172, vocabulary 512, f32 weights; 2 ranks hold 2
// KV heads each, 4 ranks one. Measured max relative difference: <= 6e-7 (AVX2); the bound 1e-5 is
// an f32 reorder's order of magnitude with room for other SIMD levels.
TEST(TensorParallel, Stories260KEqualsOneRank) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  ASSERT_EQ(model->hparams().n_head, 8);
  ASSERT_EQ(model->hparams().n_head_kv, 4);
  const auto prompts = random_prompts(model->hparams().n_vocab, 3, 20);
  for (int tp : {2, 4}) expect_same_as_one_rank(*model, tp, prompts, 1e-5);
}

// mistral-swa-tiny (bf16, 4 query heads over 2 KV heads, window 16): at 4 ranks each KV head is
// replicated on the two ranks whose query heads read it. Against transformers too: the last
// position's whole row of each reference prompt, bound 2e-5 absolute as in test_hf_tiny, and the
// argmax at every position.
TEST(TensorParallel, MistralSlidingWindowEqualsOneRankAndTransformers) {
  const std::string folder = test::data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  ASSERT_EQ(model->hparams().n_head_kv, 2);
  const std::vector<test::ReferencePrompt> refs = test::read_reference(folder);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : refs) prompts.push_back(p.ids);
  const int64_t V = model->hparams().n_vocab;
  for (int tp : {2, 4}) {
    expect_same_as_one_rank(*model, tp, prompts, 1e-5);
    for (const test::ReferencePrompt& p : refs) {
      const std::vector<float> logits = test::prompt_logits(*model, p.ids, tp_config(tp, 512));
      const int64_t L = static_cast<int64_t>(p.ids.size());
      const auto last = test::read_npy(folder + "/" + p.file_prefix + "_logits_last_position.npy");
      double worst = 0;
      for (int64_t v = 0; v < V; ++v)
        worst = std::max(worst, std::abs(logits[static_cast<size_t>((L - 1) * V + v)] - last.values[static_cast<size_t>(v)]));
      EXPECT_LT(worst, 2e-5) << "tp " << tp << " " << p.name;
      for (int64_t pos = 0; pos < L; ++pos) {
        const float* row = logits.data() + pos * V;
        EXPECT_EQ(std::max_element(row, row + V) - row, p.argmax[static_cast<size_t>(pos)]) << p.name << " " << pos;
      }
    }
  }
}

// SmolLM2-135M Q4_1: 9 query heads over 3 KV heads, FFN 1536, so 3 ranks; the output and down
// projections' column slices (192 and 512 columns) are whole Q4_1 blocks of 32, so the 16-bit
// activation blocks are those of one rank. This model magnifies f32 reorders (its residual stream
// has a few very large channels): measured max relative difference 1.3e-4 between 3 ranks and
// one, and 1.8e-4 between one rank's AVX-512 and scalar kernels (another summation order of the
// same arithmetic). Bound 5e-4, near the 3.3e-4 the 16-bit activations give against float64
// (backend/cpu/matmul.h); a wrong slice or a missing all-reduce moves the logits by O(1).
TEST(TensorParallel, QuantizedSmolLM2EqualsOneRank) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  const auto prompts = random_prompts(model->hparams().n_vocab, 2, 12);
  for (int64_t chunk : {int64_t{512}, int64_t{1}}) {
    const double rel = rel_diff(test::prompt_logits(*model, prompts[0], tp_config(1, chunk)),
                                test::prompt_logits(*model, prompts[0], tp_config(3, chunk)));
    std::printf("SmolLM2 tp 3, %lld-token steps: %.3g\n", static_cast<long long>(chunk), rel);
    EXPECT_LT(rel, 5e-4);
  }
  Engine one(*model, nullptr, tp_config(1, 64));
  Engine split(*model, nullptr, tp_config(3, 64));
  EXPECT_EQ(test::greedy_ids(split, prompts, 12), test::greedy_ids(one, prompts, 12));
}

TEST(TensorParallel, InvalidSplitsAreErrors) {
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  const ModelHparams& hp = model->hparams();
  EXPECT_TRUE(error_has([&] { validate_tensor_parallel(hp, 3); }, "does not divide the model's attention heads (8)"));
  EXPECT_TRUE(error_has([&] { validate_tensor_parallel(hp, 8); }, "does not divide the model's FFN width (172)"));
  EXPECT_TRUE(error_has([&] { validate_tensor_parallel(hp, 0); }, "at least 1"));
  EXPECT_TRUE(error_has([&] { Engine e(*model, nullptr, tp_config(3, 16)); }, "--tensor-parallel-size 3"));
  ModelHparams gqa = hp;
  gqa.n_head = 12, gqa.n_head_kv = 4, gqa.n_ff = 96, gqa.n_vocab = 96;
  EXPECT_NO_THROW(validate_tensor_parallel(gqa, 4));
  EXPECT_NO_THROW(validate_tensor_parallel(gqa, 12));
  EXPECT_TRUE(error_has([&] { validate_tensor_parallel(gqa, 6); }, "must divide the ranks"));
  ModelHparams moe = hp;
  moe.arch = "gemma3";
  EXPECT_TRUE(error_has([&] { validate_tensor_parallel(moe, 2); }, "not supported with tensor parallelism"));
  const std::string mixtral = test::data_dir() + "/hf-tiny/mixtral-tiny";
  if (test::file_exists(mixtral + "/config.json")) {
    const auto m = LlamaModel::load_hf_dir(mixtral);
    EXPECT_TRUE(error_has([&] { validate_tensor_parallel(m->hparams(), 2); },
                                  "with mixture-of-experts layers is not supported with tensor parallelism"));
  }
}

}  // namespace
}  // namespace kestrel
