// The CUDA backend's mixture-of-experts layers in whole models: the tiny Hugging Face folders
// mixtral-tiny (8 experts, top-2 renormalised) and qwen2-moe-tiny (top-4 not renormalised, a
// shared expert gated by sigmoid(x . w)) of ../shared/data/hf-tiny, eagerly and through captured
// decode graphs, against transformers' greedy continuations, the CPU backend's logits and its
// expert-usage counts. On a GPU in kestrel_tests; on the CPU emulation of the kernels in
// kestrel_cuda_emu_tests.
//
// bf16 activations move these models' router logits by up to about 0.03 (of magnitude ~2) from
// the CPU's f32 ones, so tokens whose k-th and (k+1)-th router logits are closer than that go to
// other experts now and then (emulated: 11 of 666 (position, layer) pairs in mixtral-tiny, 14 of
// 648 in qwen2-moe-tiny), after which logits legitimately differ by O(1). The real folders are
// therefore compared up to the first position routed differently (expect_cuda_matches, which
// tracks each position's experts through expert_token_counts), and copies of them whose experts
// are all equal, where routing moves the output continuously, at every position
// (expect_identical_experts_match).
// Logit tolerance: 0.05 + 2% of each row's largest magnitude (about 0.13 here), as
// test_cuda_model_runner.cpp compares stories260K. Measured worst |cuda - cpu| (emulation):
// mixtral-tiny 0.067 over the 59 prompt rows before the first routing differences (and 32 generated
// tokens compared, all equal to transformers'), qwen2-moe-tiny 0.038 over 19 rows (3 tokens); with
// identical experts, over every row of the three prompts, 0.075 and 0.073.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <regex>
#include <string>
#include <vector>

#include "backend/cuda/cuda_runner.h"
#include "backend/model_runner.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "hf_configs.h"
#include "hf_tiny_reference.h"
#include "io/safetensors.h"
#include "safetensors_builder.h"
#include "test_util.h"

using namespace kestrel;

namespace {

EngineConfig config() {
  EngineConfig c;
  c.block_size = 16;
  c.n_kv_blocks = 96;
  c.max_model_len = 256;
  c.max_num_batched_tokens = 24;  // prompts in chunks beside decodes
  c.kv_dtype = KvDtype::F32;      // the CPU side; the CUDA runner's cache is bf16
  return c;
}

RunnerOptions runner_options(bool eager) {
  RunnerOptions o;
  o.block_size = 16;
  o.n_kv_blocks = 96;
  o.enforce_eager = eager;
  test::skip_skinny_gemm_if_emulated(o);
  return o;
}

std::vector<float> prompt_logits(Engine& e, const std::vector<int32_t>& ids) {
  Request r;
  r.prompt = ids;
  r.max_tokens = 1;
  r.sampling.temperature = 0;
  r.prompt_logits = true;
  e.add_request(r);
  std::vector<float> got;
  while (e.has_unfinished())
    for (RequestOutput& o : e.step())
      if (!o.prompt_logits.empty()) got = std::move(o.prompt_logits);
  return got;
}

// Largest |got - want| over the rows, each row checked against 0.05 + 2% of its largest magnitude
// and for the same argmax where the CPU's top two differ by more than 0.1.
double expect_logits_close(const std::vector<float>& got, const std::vector<float>& want, int64_t n_vocab) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t row = 0; (row + 1) * n_vocab <= std::min(got.size(), want.size()); ++row) {
    const float* g = got.data() + row * n_vocab;
    const float* w = want.data() + row * n_vocab;
    float scale = 0, row_worst = 0;
    for (int64_t i = 0; i < n_vocab; ++i) {
      scale = std::max(scale, std::fabs(w[i]));
      row_worst = std::max(row_worst, std::fabs(g[i] - w[i]));
    }
    EXPECT_LE(row_worst, 0.05f + 0.02f * scale) << "row " << row;
    worst = std::max(worst, static_cast<double>(row_worst));
    std::vector<float> sorted(w, w + n_vocab);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > 0.1f)
      EXPECT_EQ(std::max_element(g, g + n_vocab) - g, std::max_element(w, w + n_vocab) - w) << "row " << row;
  }
  return worst;
}

// One prompt run token by token (one token per engine step: each prompt position, then each
// generated token), greedy, 32 tokens: its logits at every prompt position, the tokens, and the
// experts each position's token was routed to (the change of the runner's expert_token_counts
// over its step, [n_layer * E]).
struct Trace {
  std::vector<float> prompt_logits;
  std::vector<int32_t> tokens;
  std::vector<std::vector<uint64_t>> routed;  // [position]
};

Trace run_token_by_token(const LlamaModel& model, std::unique_ptr<ModelRunner> runner,
                         const std::vector<int32_t>& prompt) {
  const ModelRunner& counter = *runner;
  EngineConfig c = config();
  c.max_num_batched_tokens = 1;
  Engine e(model, nullptr, c, std::move(runner));
  Request r;
  r.prompt = prompt;
  r.max_tokens = 32;
  r.sampling.temperature = 0;
  r.prompt_logits = true;
  e.add_request(r);
  Trace t;
  std::vector<uint64_t> before = counter.expert_token_counts();
  while (e.has_unfinished()) {
    for (RequestOutput& o : e.step()) {
      EXPECT_NE(o.finish_reason, "error") << o.error;
      if (!o.prompt_logits.empty()) t.prompt_logits = std::move(o.prompt_logits);
      t.tokens.insert(t.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
    std::vector<uint64_t> now = counter.expert_token_counts();
    std::vector<uint64_t> step(now.size());
    for (size_t i = 0; i < now.size() && i < before.size(); ++i) step[i] = now[i] - before[i];
    if (std::any_of(step.begin(), step.end(), [](uint64_t v) { return v != 0; })) t.routed.push_back(step);
    before = std::move(now);
  }
  return t;
}

// What one backend's traces showed against the CPU's.
struct Agreement {
  int64_t rows = 0;    // prompt rows compared
  int64_t tokens = 0;  // generated tokens compared with the reference
  int64_t routed_same = 0, routed_total = 0;  // (position, layer) pairs routed as on the CPU
  double worst = 0;    // largest |cuda - cpu| logit over the rows compared
};

// The CUDA backend against the CPU backend and transformers' reference on one prompt's traces.
// bf16 activations move the router's logits by up to about 0.03 here (logits of magnitude ~2), so
// a token whose k-th and (k+1)-th router logits are closer than that may go to another expert than
// on the CPU, after which its logits and those of later positions legitimately differ by O(1). So
// the logits are compared at every prompt row before the first position routed differently (in any
// layer), the generated tokens with the reference's up to that position or the reference's first
// near-tie (top-1 minus top-2 below kNearTie), whichever comes first, and the routing of the
// positions up to the first differing token is tallied (expect_cuda_matches bounds it).
void compare(const test::ReferencePrompt& ref, const Trace& cpu, const Trace& gpu, int64_t n_layer, int64_t n_exp,
             int64_t n_vocab, Agreement& a) {
  constexpr double kNearTie = 0.05;
  const size_t L = ref.ids.size();
  size_t first_diff = 0;
  while (first_diff < std::min(cpu.routed.size(), gpu.routed.size()) && cpu.routed[first_diff] == gpu.routed[first_diff])
    ++first_diff;
  size_t same_input = L;  // positions whose tokens are the same on both sides
  while (same_input - L < std::min(cpu.tokens.size(), gpu.tokens.size()) &&
         cpu.tokens[same_input - L] == gpu.tokens[same_input - L])
    ++same_input;
  for (size_t p = 0; p < std::min({same_input, cpu.routed.size(), gpu.routed.size()}); ++p)
    for (int64_t l = 0; l < n_layer; ++l) {
      a.routed_same += std::equal(cpu.routed[p].begin() + l * n_exp, cpu.routed[p].begin() + (l + 1) * n_exp,
                                  gpu.routed[p].begin() + l * n_exp);
      ++a.routed_total;
    }
  const size_t rows = std::min(L, first_diff);
  const auto head = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin(), v.begin() + static_cast<int64_t>(std::min(v.size(), rows * n_vocab)));
  };
  a.worst = std::max(a.worst, expect_logits_close(head(gpu.prompt_logits), head(cpu.prompt_logits), n_vocab));
  a.rows += static_cast<int64_t>(rows);
  // Generated token j is sampled from the logits at position L - 1 + j.
  for (size_t j = 0; j < ref.greedy.size() && L - 1 + j < first_diff && j < gpu.tokens.size(); ++j) {
    EXPECT_EQ(gpu.tokens[j], ref.greedy[j]) << ref.name << " token " << j;
    ++a.tokens;
    if (ref.greedy_margins[j] < kNearTie) break;
  }
  std::printf("    %s: routed as on the CPU up to position %zu of %zu\n", ref.name.c_str(), first_diff, cpu.routed.size());
}

// The folder's three prompts: on the CPU backend, whose greedy continuations equal transformers',
// and on the CUDA backend eagerly and through decode graphs, each prompt token by token (compare);
// the routing must agree with the CPU's at 90% or more of the (position, layer) pairs compared (a
// wrongly uploaded router or expert agrees at few). Then the three prompts together, in chunks
// beside decodes (graphs: three sequences padded to the 4-sequence bucket): as many routed (token,
// expert) pairs per layer as on the CPU (the padding row is not counted). Returns the worst logit
// difference over the rows compared.
double expect_cuda_matches(const std::string& folder) {
  const auto model = LlamaModel::load_hf_dir(folder);
  const ModelHparams& hp = model->hparams();
  const int64_t n_exp = hp.moe.routing.n_expert;
  const auto ref = test::read_reference(folder);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : ref) prompts.push_back(p.ids);
  RunnerOptions cpu_options = runner_options(true);
  cpu_options.kv_dtype = KvDtype::F32;
  std::vector<Trace> cpu;
  for (const auto& p : ref) {
    cpu.push_back(run_token_by_token(*model, make_cpu_model_runner(*model, cpu_options), p.ids));
    EXPECT_EQ(cpu.back().tokens, p.greedy) << "the CPU backend, " << p.name;
  }
  auto cpu_runner = make_cpu_model_runner(*model, cpu_options);
  const ModelRunner& cpu_counter = *cpu_runner;
  Engine cpu_batch(*model, nullptr, config(), std::move(cpu_runner));
  test::greedy_ids(cpu_batch, prompts, 32);
  const std::vector<uint64_t> cpu_used = cpu_counter.expert_token_counts();

  double worst = 0;
  for (const bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "graph path");
    std::printf("  %s:\n", eager ? "eager" : "graphs");
    Agreement a;
    for (size_t i = 0; i < ref.size(); ++i)
      compare(ref[i], cpu[i], run_token_by_token(*model, make_cuda_model_runner(*model, runner_options(eager)), ref[i].ids),
              hp.n_layer, n_exp, hp.n_vocab, a);
    EXPECT_GE(a.routed_same * 10, a.routed_total * 9) << "the experts chosen differ from the CPU's too often";
    worst = std::max(worst, a.worst);
    std::printf("    %lld prompt rows and %lld tokens compared, worst |cuda - cpu| logit %.4f; routed as on the CPU at "
                "%lld of %lld (position, layer) pairs\n",
                static_cast<long long>(a.rows), static_cast<long long>(a.tokens), a.worst,
                static_cast<long long>(a.routed_same), static_cast<long long>(a.routed_total));

    auto runner = make_cuda_model_runner(*model, runner_options(eager));
    const ModelRunner& counter = *runner;
    Engine batch(*model, nullptr, config(), std::move(runner));
    test::greedy_ids(batch, prompts, 32);
    const std::vector<uint64_t> used = counter.expert_token_counts();
    EXPECT_EQ(used.size(), cpu_used.size());
    for (int64_t l = 0; l < hp.n_layer && used.size() == cpu_used.size(); ++l)
      EXPECT_EQ(std::accumulate(used.begin() + l * n_exp, used.begin() + (l + 1) * n_exp, uint64_t{0}),
                std::accumulate(cpu_used.begin() + l * n_exp, cpu_used.begin() + (l + 1) * n_exp, uint64_t{0}))
          << "layer " << l;
  }
  return worst;
}

// A copy of the HF folder whose routed experts all equal expert 0 (config.json rewritten as it is,
// model.safetensors with every "experts.E." tensor replaced by its "experts.0." one). Its routed
// output is (sum of the k weights) x expert_0(x), a continuous function of the router logits, so
// the bf16 noise that moves a near-tie token to another expert moves the output only as much as
// it moves the weights: every row can be compared with the CPU's.
std::string with_identical_experts(const std::string& folder, const test::TempDir& dir) {
  const SafetensorsFile f = SafetensorsFile::open(folder + "/model.safetensors");
  const std::regex expert(R"(experts\.[0-9]+\.)");
  test::SafetensorsBuilder b;
  for (const SafetensorsTensor& t : f.tensors()) {
    const SafetensorsTensor* src = f.find(std::regex_replace(t.name, expert, "experts.0."));
    EXPECT_NE(src, nullptr) << t.name;
    if (src == nullptr) src = &t;
    b.tensor(t.name, std::string(safetensors_dtype_name(t.dtype)), t.shape,
             std::vector<uint8_t>(src->data, src->data + src->n_bytes()));
  }
  dir.write("model.safetensors", test::bytes_of(b.build()));
  dir.write("config.json", test::read_file(folder + "/config.json"));
  return dir.path();
}

// The three prompts on the CPU backend and on the CUDA backend (eager, then graphs), together in
// chunks beside decodes: every prompt row's logits close to the CPU's, and the greedy
// continuations equal to the CPU's up to the CPU's first near-tie (top-1 minus top-2 below 0.05;
// those margins from the CPU's logits over prompt + continuation). Returns the worst difference.
double expect_cuda_matches_cpu(const LlamaModel& model, const std::vector<std::vector<int32_t>>& prompts) {
  constexpr double kNearTie = 0.05;
  const int64_t V = model.hparams().n_vocab;
  RunnerOptions cpu_options = runner_options(true);
  cpu_options.kv_dtype = KvDtype::F32;
  Engine cpu(model, nullptr, config(), make_cpu_model_runner(model, cpu_options));
  const auto want = test::greedy_ids(cpu, prompts, 32);
  std::vector<std::vector<float>> cpu_logits;
  std::vector<std::vector<double>> margins;
  for (size_t i = 0; i < prompts.size(); ++i) {
    cpu_logits.push_back(prompt_logits(cpu, prompts[i]));
    std::vector<int32_t> forced = prompts[i];
    forced.insert(forced.end(), want[i].begin(), want[i].end() - 1);
    const std::vector<float> l = prompt_logits(cpu, forced);
    margins.emplace_back();
    for (size_t row = prompts[i].size() - 1; (row + 1) * V <= l.size(); ++row) {
      std::vector<float> r(l.begin() + row * V, l.begin() + (row + 1) * V);
      std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<>());
      margins.back().push_back(r[0] - r[1]);
    }
  }
  double worst = 0;
  for (const bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "graph path");
    Engine gpu(model, nullptr, config(), make_cuda_model_runner(model, runner_options(eager)));
    const auto got = test::greedy_ids(gpu, prompts, 32);
    int equal = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      size_t j = 0;
      while (j < want[i].size() && j < got[i].size() && got[i][j] == want[i][j]) ++j;
      equal += j == want[i].size();
      if (j < want[i].size())
        EXPECT_LT(margins[i].at(j), kNearTie) << "prompt " << i << ": token " << j << " differs at a step whose margin is "
                                               << margins[i].at(j);
    }
    for (size_t i = 0; i < prompts.size(); ++i)
      worst = std::max(worst, expect_logits_close(prompt_logits(gpu, prompts[i]), cpu_logits[i], V));
    std::printf("  %s: %d of %zu continuations equal the CPU's throughout; worst |cuda - cpu| logit %.4f\n",
                eager ? "eager" : "graphs", equal, prompts.size(), worst);
  }
  return worst;
}

double expect_identical_experts_match(const std::string& folder) {
  test::TempDir dir;
  const auto model = LlamaModel::load_hf_dir(with_identical_experts(folder, dir));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : test::read_reference(folder)) prompts.push_back(p.ids);
  return expect_cuda_matches_cpu(*model, prompts);
}

}  // namespace

TEST(CudaMoeModel, MixtralTinyMatchesTransformersAndTheCpuBackend) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string folder = test::data_dir() + "/hf-tiny/mixtral-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  expect_cuda_matches(folder);
}

TEST(CudaMoeModel, Qwen2MoeTinyMatchesTransformersAndTheCpuBackend) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string folder = test::data_dir() + "/hf-tiny/qwen2-moe-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  expect_cuda_matches(folder);
}

TEST(CudaMoeModel, MixtralTinyWithIdenticalExpertsMatchesTheCpuBackendEverywhere) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string folder = test::data_dir() + "/hf-tiny/mixtral-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  expect_identical_experts_match(folder);
}

TEST(CudaMoeModel, Qwen2MoeTinyWithIdenticalExpertsMatchesTheCpuBackendEverywhere) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string folder = test::data_dir() + "/hf-tiny/qwen2-moe-tiny";
  KESTREL_REQUIRE_FILE(folder + "/reference.json");
  expect_identical_experts_match(folder);
}
