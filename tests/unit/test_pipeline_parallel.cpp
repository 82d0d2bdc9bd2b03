// Pipeline parallelism on the CPU (RunnerOptions::pipeline_parallel_size, model/pipeline_parallel.h):
// a model's layers split over 2 or 3 stages, a step's batch in micro-batches through them, against
// the same model in one stage, and against transformers. A stage runs its layers with the
// arithmetic of the whole model (the residual stream is handed on in f32 as it is), and the CPU
// kernels compute each token's row the same way whatever the other rows of the batch, so the
// logits, the K/V and the greedy tokens are asserted equal bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/model_runner.h"
#include "engine/engine.h"
#include "hf_tiny_reference.h"
#include "model/pipeline_parallel.h"
#include "npy.h"
#include "test_util.h"

namespace kestrel {
namespace {

template <typename Fn>
::testing::AssertionResult error_has(Fn&& fn, const std::string& phrase) {
  const std::string msg = test::error_of(fn);
  if (msg.find(phrase) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected an error with \"" << phrase << "\", got \"" << msg << "\"";
}

EngineConfig pp_config(int pp, int64_t chunk) {
  EngineConfig c;
  c.kv_dtype = KvDtype::F32;
  c.max_model_len = 256;
  c.max_num_batched_tokens = chunk;
  c.pipeline_parallel_size = pp;
  c.n_threads = pp;  // one thread per stage: the stages' pools do not spin against each other
  return c;
}

std::vector<std::vector<int32_t>> random_prompts(int64_t n_vocab, int count, int length) {
  std::mt19937 rng(20251204);
  std::uniform_int_distribution<int32_t> id(3, static_cast<int32_t>(n_vocab - 1));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(count));
  for (size_t k = 0; k < out.size(); ++k) {
    out[k].push_back(1);  // BOS
    for (size_t i = 1; i < static_cast<size_t>(length) + k * 7; ++i) out[k].push_back(id(rng));
  }
  return out;
}

TEST(PipelineParallel, StageLayersSplitEvenly) {
  ModelHparams hp;
  hp.arch = "llama";
  hp.n_layer = 30;
  // 30 layers over 4 stages: 8, 8, 7, 7.
  const int64_t want[4][2] = {{0, 8}, {8, 16}, {16, 23}, {23, 30}};
  for (int s = 0; s < 4; ++s) {
    const PipelineStageLayers l = pipeline_stage_layers(hp, s, 4);
    EXPECT_EQ(l.begin, want[s][0]) << "stage " << s;
    EXPECT_EQ(l.end, want[s][1]) << "stage " << s;
  }
}

// One sequence's prefill (one pass: split into token ranges over the stages; 5-token chunks; one
// token a step) and greedy continuations of several prompts run together (mixed prefill and
// decode steps of several sequences: micro-batches of whole sequences).
void expect_same_as_one_stage(const LlamaModel& model, int pp, const std::vector<std::vector<int32_t>>& prompts) {
  for (int64_t chunk : {int64_t{512}, int64_t{5}, int64_t{1}}) {
    const std::vector<float> one = test::prompt_logits(model, prompts.back(), pp_config(1, chunk));
    const std::vector<float> split = test::prompt_logits(model, prompts.back(), pp_config(pp, chunk));
    EXPECT_EQ(one, split) << "pp " << pp << ", " << chunk << "-token steps";
  }
  Engine one(model, nullptr, pp_config(1, 64));
  Engine split(model, nullptr, pp_config(pp, 64));
  EXPECT_EQ(test::greedy_ids(split, prompts, 24), test::greedy_ids(one, prompts, 24)) << "pp " << pp;
}

// stories260K: 5 layers; 2 stages hold 3 + 2, 3 stages 2 + 2 + 1.
TEST(PipelineParallel, Stories260KEqualsOneStage) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  ASSERT_EQ(model->hparams().n_layer, 5);
  const auto prompts = random_prompts(model->hparams().n_vocab, 5, 20);
  for (int pp : {2, 3}) expect_same_as_one_stage(*model, pp, prompts);
}

// mistral-swa-tiny (bf16, 3 layers, 4 query heads over 2 KV heads, window 16): 3 stages of one
// layer. Against transformers too: the last position's row of each reference prompt, bound 2e-5
// absolute as in test_hf_tiny, and the argmax at every position.
TEST(PipelineParallel, MistralSlidingWindowEqualsOneStageAndTransformers) {
  const std::string folder = test::data_dir() + "/hf-tiny/mistral-swa-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  const auto model = LlamaModel::load_hf_dir(folder);
  ASSERT_EQ(model->hparams().n_layer, 3);
  ASSERT_EQ(model->hparams().n_head_kv, 2);
  const std::vector<test::ReferencePrompt> refs = test::read_reference(folder);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : refs) prompts.push_back(p.ids);
  const int64_t V = model->hparams().n_vocab;
  for (int pp : {2, 3}) {
    expect_same_as_one_stage(*model, pp, prompts);
    for (const test::ReferencePrompt& p : refs) {
      const std::vector<float> logits = test::prompt_logits(*model, p.ids, pp_config(pp, 512));
      const int64_t L = static_cast<int64_t>(p.ids.size());
      const auto last = test::read_npy(folder + "/" + p.file_prefix + "_logits_last_position.npy");
      double worst = 0;
      for (int64_t v = 0; v < V; ++v)
        worst = std::max(worst, std::abs(logits[static_cast<size_t>((L - 1) * V + v)] - last.values[static_cast<size_t>(v)]));
      EXPECT_LT(worst, 2e-5) << "pp " << pp << " " << p.name;
      for (int64_t pos = 0; pos < L; ++pos) {
        const float* row = logits.data() + pos * V;
        EXPECT_EQ(std::max_element(row, row + V) - row, p.argmax[static_cast<size_t>(pos)]) << p.name << " " << pos;
      }
    }
  }
}

// A hand-made step of four sequences (two prefills, two decodes over cached context) with the
// logits rows in an order other than the tokens', straight to the runners: the rows come back in
// the batch's order, and the stages' K/V records, concatenated in stage order, are the one-stage
// record (KvCache::read_block is layer-major).
TEST(PipelineParallel, MixedStepRowsAndKvRecordEqualOneStage) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const int32_t bs = 16, blocks_per_seq = 4;
  // Sequence s: cached[s] tokens already in the cache (written by a first step), then new[s].
  const std::vector<int32_t> cached = {0, 0, 9, 21}, fresh = {7, 12, 1, 1};
  const auto prompts = random_prompts(model->hparams().n_vocab, 4, 22);
  RunnerOptions o;
  o.block_size = bs;
  o.n_kv_blocks = 4 * blocks_per_seq;
  o.kv_dtype = KvDtype::F32;
  std::vector<int32_t> tables(4 * blocks_per_seq);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  auto step = [&](ModelRunner& r, const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
    return test::forward_token_ranges(r, prompts, tables, blocks_per_seq, bs, from, to);
  };
  std::vector<int32_t> zero(4, 0), end(4);
  for (int s = 0; s < 4; ++s) end[s] = cached[s] + fresh[s];
  o.pipeline_parallel_size = 1;
  const auto one = make_cpu_model_runner(*model, o);
  // Slots no step writes hold whatever the pool held: zeros in both, so the records compare.
  const std::vector<std::byte> zeros(static_cast<size_t>(tables.size() * bs * one->kv_bytes_per_token()));
  one->write_kv_blocks(tables, zeros);
  step(*one, zero, cached);
  const std::vector<float> want = step(*one, cached, end);
  std::vector<std::byte> want_kv(static_cast<size_t>(tables.size() * bs * one->kv_bytes_per_token()));
  one->read_kv_blocks(tables, want_kv);
  for (int pp : {2, 3}) {
    o.pipeline_parallel_size = pp;
    const auto split = make_cpu_model_runner(*model, o);
    EXPECT_EQ(split->kv_bytes_per_token(), one->kv_bytes_per_token());
    split->write_kv_blocks(tables, zeros);
    step(*split, zero, cached);
    EXPECT_EQ(step(*split, cached, end), want) << "pp " << pp;
    std::vector<std::byte> kv(want_kv.size());
    split->read_kv_blocks(tables, kv);
    EXPECT_TRUE(kv == want_kv) << "pp " << pp;
    // The one-stage record written back into the stages reads back the same.
    split->write_kv_blocks(tables, want_kv);
    split->read_kv_blocks(tables, kv);
    EXPECT_TRUE(kv == want_kv) << "pp " << pp;
  }
}

// Requests of several kinds at once: greedy and seeded sampling, and identical prompts (n > 1:
// one prefill, then forks whose copy-on-write copies run with no pass in flight).
std::vector<Request> mixed_requests(int64_t n_vocab) {
  const auto prompts = random_prompts(n_vocab, 12, 20);
  std::vector<Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.prompt = prompts[i];
    r.max_tokens = 24 + static_cast<int64_t>(i % 5);
    if (i % 2 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.seed = 1000 + i;
    }
    requests.push_back(r);
  }
  for (uint64_t k = 0; k < 3; ++k) {
    Request r = requests[0];
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 77 + k;
    requests.push_back(r);
  }
  return requests;
}

// A pipelined engine (2 and 3 stages, up to one pass per stage in flight) against one stage, on
// the same requests: the same tokens, bit for bit (the CPU kernels compute a row the same
// whatever else is in its pass, so neither the passes' composition nor their order shows), with
// a pool large enough for every request, and one small enough that the scheduler preempts
// (recompute, and swap) while passes are in flight. Most passes go in behind another one.
TEST(PipelineParallel, PassesInFlightGiveTheTokensOfOneStage) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const std::vector<Request> requests = mixed_requests(model->hparams().n_vocab);
  Engine one(*model, nullptr, pp_config(1, 64));
  const auto want = test::run_to_end(one, requests);
  for (int pp : {2, 3}) {
    Engine split(*model, nullptr, pp_config(pp, 64));
    EXPECT_EQ(split.runner().max_passes_in_flight(), pp);
    EXPECT_EQ(test::run_to_end(split, requests), want) << "pp " << pp;
    const EngineStats& st = split.stats();
    // Measured: 2 stages 58 of 63 passes behind another, 3 stages 82 of 90; the others start
    // the run, fork the identical prompts' blocks (with no pass in flight) or end it.
    EXPECT_GT(st.n_pipelined_passes, st.n_steps * 3 / 4) << "pp " << pp << ": " << st.n_pipelined_passes << " of " << st.n_steps;
    EXPECT_EQ(st.kv_blocks_used, 0) << "pp " << pp;
  }
  for (PreemptionMode mode : {PreemptionMode::Recompute, PreemptionMode::Swap}) {
    EngineConfig c = pp_config(2, 64);
    c.block_size = 16;
    c.n_kv_blocks = 24;  // the requests hold up to ~90 blocks together
    c.preemption_mode = mode;
    if (mode == PreemptionMode::Swap) c.swap_space_bytes = int64_t{8} << 20;
    Engine split(*model, nullptr, c);
    EXPECT_EQ(test::run_to_end(split, requests), want) << preemption_mode_name(mode);
    EXPECT_GT(split.stats().n_preemptions, 0) << preemption_mode_name(mode);
    if (mode == PreemptionMode::Swap) EXPECT_GT(split.stats().n_swap_preemptions, 0);
    // Measured: 146 (recompute) and 135 (swap) of 158 passes behind another.
    EXPECT_GT(split.stats().n_pipelined_passes, split.stats().n_steps / 2) << preemption_mode_name(mode);
    EXPECT_EQ(split.stats().kv_blocks_used, 0) << preemption_mode_name(mode);
  }
}

// Aborts while passes are in flight: the aborted requests end with "abort" after a prefix of
// their tokens, the others give one stage's tokens, and no block stays held.
TEST(PipelineParallel, AbortsWhilePassesAreInFlight) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const auto prompts = random_prompts(model->hparams().n_vocab, 8, 20);
  Engine one(*model, nullptr, pp_config(1, 64));
  const auto want = test::greedy_ids(one, prompts, 32);
  Engine split(*model, nullptr, pp_config(2, 64));
  std::vector<RequestId> ids;
  for (const auto& p : prompts) {
    Request r;
    r.prompt = p;
    r.max_tokens = 32;
    r.sampling.temperature = 0;
    ids.push_back(split.add_request(r));
  }
  std::vector<std::vector<int32_t>> got(prompts.size());
  std::vector<std::string> reason(prompts.size());
  auto take = [&](const std::vector<RequestOutput>& outs) {
    for (const RequestOutput& o : outs) {
      const size_t i = static_cast<size_t>(std::find(ids.begin(), ids.end(), o.id) - ids.begin());
      ASSERT_LT(i, ids.size());
      got[i].insert(got[i].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) reason[i] = o.finish_reason;
    }
  };
  int64_t n_aborted = 0;
  for (int step = 0; split.has_unfinished(); ++step) {
    take(split.step());
    if (step == 12 || step == 20) {
      EXPECT_EQ(split.n_passes_in_flight(), 2u) << "step " << step;
      for (size_t i : {size_t{1}, size_t{4}, size_t{6}})
        if (reason[i].empty() && (step == 12) == (i != 6)) {
          split.abort_request(ids[i]);
          ++n_aborted;
        }
      EXPECT_EQ(split.n_passes_in_flight(), 0u) << "step " << step;
    }
  }
  EXPECT_EQ(n_aborted, 3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (i == 1 || i == 4 || i == 6) {
      EXPECT_EQ(reason[i], "abort") << i;
      ASSERT_LE(got[i].size(), want[i].size()) << i;
      EXPECT_TRUE(std::equal(got[i].begin(), got[i].end(), want[i].begin())) << i;
      EXPECT_LT(got[i].size(), want[i].size()) << i;
    } else {
      EXPECT_EQ(reason[i], "length") << i;
      EXPECT_EQ(got[i], want[i]) << i;
    }
  }
  EXPECT_EQ(split.stats().kv_blocks_used, 0);
}

TEST(PipelineParallel, InvalidSizesAreErrors) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const auto model = LlamaModel::load_gguf(test::stories_path());
  const ModelHparams& hp = model->hparams();
  EXPECT_NO_THROW(validate_pipeline_parallel(hp, 5));
  EXPECT_TRUE(error_has([&] { validate_pipeline_parallel(hp, 6); }, "exceeds the model's layers (5)"));
  EXPECT_TRUE(error_has([&] { validate_pipeline_parallel(hp, 0); }, "at least 1, got 0"));
  EXPECT_TRUE(error_has([&] { model->pipeline_stage(2, 2); }, "pipeline stage 2 outside [0, 2)"));
  EXPECT_TRUE(error_has([&] { Engine e(*model, nullptr, pp_config(6, 16)); }, "--pipeline-parallel-size 6"));
  EngineConfig both = pp_config(2, 16);
  both.tensor_parallel_size = 2;
  EXPECT_TRUE(error_has([&] { Engine e(*model, nullptr, both); }, "one way at a time"));
  ModelHparams gemma = hp;
  gemma.arch = "gemma3";
  EXPECT_TRUE(error_has([&] { validate_pipeline_parallel(gemma, 2); }, "not supported with pipeline parallelism"));
  const std::string mixtral = test::data_dir() + "/hf-tiny/mixtral-tiny";
  if (test::file_exists(mixtral + "/config.json")) {
    const auto m = LlamaModel::load_hf_dir(mixtral);
    EXPECT_TRUE(error_has([&] { validate_pipeline_parallel(m->hparams(), 2); },
                          "with mixture-of-experts layers is not supported with pipeline parallelism"));
  }
}

}  // namespace
}  // namespace kestrel
