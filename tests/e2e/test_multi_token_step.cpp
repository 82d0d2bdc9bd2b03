// Multi-token steps and choices sharing a prompt, on the real stories260K model and the CPU
// backend (whose forward pass is batch-invariant, so the comparisons are bitwise):
// - a decode step of 1 + k tokens (one sampled token and k drafts) gives k + 1 logits rows equal
//   to k + 1 one-token steps, and rolling the k drafts back (Scheduler::truncate) returns their
//   blocks and leaves the sequence decoding exactly as if they had never been run;
// - n choices of one prompt compute it once and give the outputs of n separate requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "backend/model_runner.h"
#if defined(KESTREL_HAS_CUDA)
#include "backend/cuda/cuda_runner.h"
#endif
#include "engine/engine.h"
#include "scheduler/scheduler.h"
#include "scheduler/step_batch.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel;

namespace {

using test::stories_path;

// A CPU runner, its KV manager and a scheduler over them, driven step by step.
struct Stepper {
  static constexpr int32_t kBlocks = 64;
  static constexpr int32_t kBlockSize = 4;  // small blocks: drafts cross block boundaries
  std::unique_ptr<ModelRunner> runner;
  KvManager kv{KvManagerConfig{kBlocks, kBlockSize, /*enable_prefix_caching=*/false}};
  Scheduler scheduler{SchedulerConfig{8, 512}, kv};
  StepBatch batch;
  int64_t n_vocab;

  Stepper(const LlamaModel& model, bool cuda) : n_vocab(model.hparams().n_vocab) {
    RunnerOptions o;
    o.block_size = kBlockSize;
    o.n_kv_blocks = kBlocks;
    o.kv_dtype = KvDtype::F32;
#if defined(KESTREL_HAS_CUDA)
    if (cuda) runner = make_cuda_model_runner(model, o);
#endif
    if (!cuda) runner = make_cpu_model_runner(model, o);
  }
  // One step: schedule, run, record. Returns every logits row of the step, [rows, n_vocab].
  std::vector<float> step(int64_t* n_scheduled = nullptr) {
    const SchedulerOutput out = scheduler.schedule();
    EXPECT_EQ(out.scheduled.size(), 1u);
    if (n_scheduled != nullptr) *n_scheduled = out.scheduled.at(0).n_new;
    if (!out.copies.empty()) runner->copy_blocks(out.copies);
    batch.build(out, kv);
    const std::span<const float> logits = runner->forward(batch.view());
    scheduler.on_step_done(out);
    return {logits.begin(), logits.end()};
  }
};

std::vector<float> row(const std::vector<float>& rows, int64_t i, int64_t n_vocab) {
  return {rows.begin() + i * n_vocab, rows.begin() + (i + 1) * n_vocab};
}

}  // namespace

// Equality of two logits rows: bitwise on the CPU; on the GPU (bf16 weights and KV, one-token
// passes through the GEMV and decode-attention kernels against multi-token ones through the GEMM
// and prefill attention) within 0.05 + 2% of the row's largest magnitude, with the same argmax.
static void expect_rows_equal(const std::vector<float>& got, const std::vector<float>& want, bool exact, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (exact) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  float scale = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    worst = std::max(worst, std::fabs(got[i] - want[i]));
  }
  EXPECT_LE(worst, 0.05f + 0.02f * scale) << what;
  EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
            std::max_element(want.begin(), want.end()) - want.begin())
      << what;
}

static void one_plus_k_steps(bool cuda) {
  const auto model = LlamaModel::load_gguf(stories_path());
  const int64_t n_vocab = model->hparams().n_vocab;
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395};
  // The tokens fed after the prompt: the one "sampled" token, then the drafts (any ids will do:
  // the comparison is of logits, not of a greedy path).
  const std::vector<int32_t> fed = {317, 426, 338, 401, 396, 267, 337, 410, 408};

  // Reference: the prompt, then each fed token in a step of its own.
  Stepper ref(*model, cuda);
  Sequence a;
  a.id = 1;
  a.tokens = prompt;
  a.n_prompt = static_cast<int64_t>(prompt.size());
  ref.scheduler.add(&a);
  ref.step();
  std::vector<std::vector<float>> single;
  for (int32_t t : fed) {
    a.tokens.push_back(t);
    int64_t n = 0;
    const auto rows = ref.step(&n);
    ASSERT_EQ(n, 1);
    ASSERT_EQ(rows.size(), static_cast<size_t>(n_vocab));
    single.push_back(rows);
  }

  for (int64_t k : {1, 4, 8}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    Stepper st(*model, cuda);
    Sequence s;
    s.id = 7;
    s.tokens = prompt;
    s.n_prompt = static_cast<int64_t>(prompt.size());
    st.scheduler.add(&s);
    st.step();
    // The sampled token and k drafts in one step: k + 1 rows, each equal to its single step's.
    s.tokens.insert(s.tokens.end(), fed.begin(), fed.begin() + 1 + k);
    s.n_draft = k;
    ASSERT_TRUE(s.is_decode());
    int64_t n = 0;
    const auto rows = st.step(&n);
    ASSERT_EQ(n, 1 + k);
    ASSERT_EQ(rows.size(), static_cast<size_t>((1 + k) * n_vocab));
    for (int64_t i = 0; i <= k; ++i)
      expect_rows_equal(row(rows, i, n_vocab), single[static_cast<size_t>(i)], !cuda, "row " + std::to_string(i));

    // Every draft rejected: back to prompt + the sampled token. The blocks past it go back.
    const int64_t kept = static_cast<int64_t>(prompt.size()) + 1;
    st.scheduler.truncate(&s, kept);
    EXPECT_EQ(s.n_draft, 0);
    EXPECT_EQ(s.n_computed, kept);
    const int32_t blocks_kept = static_cast<int32_t>((kept + Stepper::kBlockSize - 1) / Stepper::kBlockSize);
    EXPECT_EQ(st.kv.n_used_blocks(), blocks_kept);
    EXPECT_EQ(st.kv.n_free_blocks(), Stepper::kBlocks - blocks_kept);
    st.kv.check_invariants();
    // Decoding goes on as if the drafts had never run: the next tokens' logits are the reference's.
    for (size_t i = 1; i < 4; ++i) {
      s.tokens.push_back(fed[i]);
      const auto next = st.step(&n);
      ASSERT_EQ(n, 1);
      expect_rows_equal(next, single[i], !cuda, "decode after the rollback, token " + std::to_string(i));
    }
    st.scheduler.finish(&s);
    EXPECT_EQ(st.kv.n_free_blocks(), Stepper::kBlocks);
    EXPECT_EQ(st.kv.n_used_blocks(), 0);
    st.kv.check_invariants();
  }
}

TEST(MultiTokenStep, OnePlusKTokensGiveTheLogitsOfKPlusOneSingleStepsAndRollBackCleanly) {
  KESTREL_REQUIRE_FILE(stories_path());
  one_plus_k_steps(/*cuda=*/false);
}

#if defined(KESTREL_HAS_CUDA)
TEST(MultiTokenStepCuda, OnePlusKTokensGiveTheLogitsOfKPlusOneSingleStepsAndRollBackCleanly) {
  KESTREL_REQUIRE_FILE(stories_path());
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  one_plus_k_steps(/*cuda=*/true);
}
#endif

// n = 4 choices of a 300-token prompt submitted together: the engine computes the prompt once
// (EngineStats::n_prompt_tokens_computed, the /metrics counter kestrel_prompt_tokens_computed_total)
// and each choice's sampled output equals that of the same request sent alone with its seed.
TEST(MultiTokenStep, FourChoicesOfOnePromptComputeItOnceAndMatchSeparateRequests) {
  KESTREL_REQUIRE_FILE(stories_path());
  const auto model = LlamaModel::load_gguf(stories_path());
  const auto tok = Tokenizer::from_gguf(model->file());
  std::vector<int32_t> prompt = tok->encode("Once upon a time, there was a little girl named Lily.", true, false);
  for (int32_t i = 0; static_cast<int64_t>(prompt.size()) < 300; ++i) prompt.push_back(260 + (i * 37) % 240);
  ASSERT_EQ(prompt.size(), 300u);
  const uint64_t seed = 1234;
  auto request = [&](uint64_t s) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = 24;
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 0;
    r.sampling.top_p = 1.0f;
    r.sampling.min_p = 0.0f;
    r.sampling.seed = s;
    return r;
  };
  EngineConfig c;
  c.max_num_batched_tokens = 128;  // the prompt in three chunks; the choices wait for the last
  c.block_size = 16;
  c.kv_dtype = KvDtype::F32;

  Engine together(*model, nullptr, c);
  std::map<RequestId, std::vector<int32_t>> out;
  std::vector<RequestId> ids;
  for (uint64_t i = 0; i < 4; ++i) ids.push_back(together.add_request(request(seed + i)));
  std::map<RequestId, RequestMetrics> metrics;
  while (together.has_unfinished())
    for (const RequestOutput& o : together.step()) {
      out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) metrics[o.id] = o.metrics;
    }
  EXPECT_EQ(together.stats().n_prompt_tokens_computed, 300);
  EXPECT_EQ(together.stats().kv_blocks_used, 0);

  std::set<std::vector<int32_t>> distinct;
  for (uint64_t i = 0; i < 4; ++i) {
    Engine alone(*model, nullptr, c);
    alone.add_request(request(seed + i));
    std::vector<int32_t> ids_alone;
    while (alone.has_unfinished())
      for (const RequestOutput& o : alone.step()) ids_alone.insert(ids_alone.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    EXPECT_EQ(alone.stats().n_prompt_tokens_computed, 300);
    ASSERT_EQ(ids_alone.size(), 24u);
    EXPECT_EQ(out[ids[i]], ids_alone) << "choice " << i;
    EXPECT_EQ(metrics[ids[i]].n_prompt_tokens, 300);
    distinct.insert(ids_alone);
  }
  EXPECT_GT(distinct.size(), 1u) << "the seeds should give different samples";
}
