// The host tier of the prefix cache on a real model (stories260K, CPU backend). A request whose
// prompt prefix was evicted from a small device pool finds it in the host tier: fewer prompt
// tokens are computed than without the tier, and the output is token-identical to a run without
// it and to a run in a pool large enough to keep everything (the CPU forward pass is
// batch-invariant, so equal K/V give equal bits). Mixed traffic (greedy, seeded, two choices of
// one prompt, n-gram drafts with rollback, preemption) keeps its tokens with the tier on.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>

#include "core/error.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using test::eog_ids;
using test::story_prompts;
using test::stories_path;
using Loaded = test::LoadedModel;

// 24 blocks of 8 tokens: one long prompt fills half the pool.
EngineConfig small_pool() {
  EngineConfig c;
  c.block_size = 8;
  c.max_model_len = 160;
  c.n_kv_blocks = 24;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 8;
  return c;
}

// Runs the requests one after another (each to its end), so each one's blocks are released into
// the prefix cache before the next arrives.
std::vector<std::vector<int32_t>> run_in_turn(Engine& e, const std::vector<Request>& requests) {
  std::vector<std::vector<int32_t>> out;
  for (const Request& r : requests) {
    e.add_request(r);
    std::vector<int32_t> ids;
    while (e.has_unfinished())
      for (const RequestOutput& o : e.step()) ids.insert(ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    out.push_back(std::move(ids));
  }
  return out;
}

Request greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

// `n` tokens of story text, from prompt `first` of story_prompts() on (cycling).
std::vector<int32_t> story_tokens(const Loaded& l, size_t first, size_t n) {
  const std::vector<std::string> texts = story_prompts();
  std::string text;
  std::vector<int32_t> ids;
  for (size_t i = first; ids.size() < n; ++i) {
    text += texts[i % texts.size()] + ". ";
    ids = l.tokenizer->encode(text, true, false);
  }
  ids.resize(n);
  return ids;
}

// Request A (a 110-token prompt), four others of 90 tokens that together need more blocks than
// the pool has, then B: A's prompt with another ending.
std::vector<Request> evict_then_share(const Loaded& l) {
  const std::vector<int32_t> a = story_tokens(l, 0, 110);
  std::vector<Request> out{greedy(a, 8)};
  for (size_t k = 0; k < 4; ++k) out.push_back(greedy(story_tokens(l, 8 + 5 * k, 90), 8));
  std::vector<int32_t> b = a;
  const std::vector<int32_t> tail = l.tokenizer->encode(" The end.", false, false);
  b.insert(b.end(), tail.begin(), tail.end());
  out.push_back(greedy(b, 24));
  return out;
}

}  // namespace

TEST(EngineOffload, AnEvictedPrefixIsBroughtBackFromHostMemory) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  const std::vector<Request> requests = evict_then_share(l);
  ASSERT_GT(requests.front().prompt.size(), 100u);

  EngineConfig roomy = small_pool();
  roomy.n_kv_blocks = 200;  // nothing is ever evicted
  Engine reference(*l.model, l.tokenizer.get(), roomy);
  const auto want = run_in_turn(reference, requests);
  EXPECT_EQ(reference.stats().n_offloaded_blocks, 0);

  Engine off(*l.model, l.tokenizer.get(), small_pool());
  const auto got_off = run_in_turn(off, requests);
  EngineConfig c = small_pool();
  c.cpu_offload_kv_bytes = 64 * test::kv_block_bytes(l, c);
  Engine on(*l.model, l.tokenizer.get(), c);
  EXPECT_EQ(on.stats().n_offload_blocks, 64);
  const auto got_on = run_in_turn(on, requests);

  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got_off[i], want[i]) << "request " << i;
    EXPECT_EQ(got_on[i], want[i]) << "request " << i;
  }
  const EngineStats& s = on.stats();
  std::printf("offload off: %lld prompt tokens computed; on: %lld (%lld blocks offloaded, %lld brought back)\n",
              static_cast<long long>(off.stats().n_prompt_tokens_computed),
              static_cast<long long>(s.n_prompt_tokens_computed), static_cast<long long>(s.n_offloaded_blocks),
              static_cast<long long>(s.n_offload_hit_blocks));
  EXPECT_GT(s.n_offloaded_blocks, 0);
  // B's whole shared prefix (13 full blocks of A's 110 tokens) comes back, not recomputed.
  EXPECT_GE(s.n_offload_hit_blocks, 13);
  EXPECT_LE(s.n_prompt_tokens_computed, off.stats().n_prompt_tokens_computed - 13 * 8);
  EXPECT_EQ(s.kv_blocks_used, 0);
  EXPECT_EQ(s.kv_blocks_free, s.n_kv_blocks);
  EXPECT_LE(s.offload_blocks_held, s.n_offload_blocks);
}

// Mixed traffic in a pool too small for it (preemption, evictions), with the host tier: the tokens of a pool that never evicts, for greedy, seeded and two-choice requests, with
// and without n-gram drafts (rollbacks of rejected drafts write into blocks the tier filled).
TEST(EngineOffload, MixedTrafficKeepsItsTokensWithTheHostTier) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  const std::vector<std::string> texts = story_prompts();
  std::vector<Request> requests;
  for (size_t i = 0; i < 24; ++i) {
    Request r;
    // Three families of prompts sharing a 48-token prefix, so hits are common; i % 4 == 3 repeats
    // the prompt of i - 1 (two choices of one prompt).
    const size_t j = i % 4 == 3 ? i - 1 : i;
    r.prompt = story_tokens(l, 3 * (j % 3), 48);
    const std::vector<int32_t> tail = l.tokenizer->encode(" " + texts[j], false, false);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.max_tokens = 32;
    r.stop_ids = eog_ids(*l.tokenizer);
    if (i % 4 == 0) {
      r.sampling.temperature = 0;
    } else {
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 2000 + i;
    }
    requests.push_back(std::move(r));
  }
  for (const bool spec : {false, true}) {
    EngineConfig c = small_pool();
    c.max_num_seqs = 4;
    if (spec) {
      c.speculative.method = SpecMethod::Ngram;
      c.speculative.num_speculative_tokens = 3;
    }
    EngineConfig roomy = c;
    roomy.n_kv_blocks = 0;
    Engine reference(*l.model, l.tokenizer.get(), roomy);
    const auto want = test::run_to_end(reference, requests);
    const int64_t bytes = test::kv_block_bytes(l, c);
    c.cpu_offload_kv_bytes = 48 * bytes;
    Engine e(*l.model, l.tokenizer.get(), c);
    const auto got = test::run_to_end(e, requests);
    for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(got[i], want[i]) << "spec " << spec << ", request " << i;
    const EngineStats& s = e.stats();
    std::printf("spec %d: %lld blocks offloaded, %lld brought back, %lld preemptions\n", spec,
                static_cast<long long>(s.n_offloaded_blocks), static_cast<long long>(s.n_offload_hit_blocks),
                static_cast<long long>(s.n_preemptions));
    EXPECT_GT(s.n_offloaded_blocks, 0);
    EXPECT_GT(s.n_offload_hit_blocks, 0);
    EXPECT_EQ(s.kv_blocks_used, 0);
    EXPECT_GT(s.n_preemptions, 0);
    if (spec) EXPECT_GT(s.spec_num_accepted_tokens, 0);
  }
}

TEST(EngineOffload, BadOffloadSettingsAreErrors) {
  KESTREL_REQUIRE_FILE(stories_path());
  const Loaded l = test::load_model(stories_path());
  EngineConfig c = small_pool();
  c.cpu_offload_kv_bytes = -1;
  EXPECT_NE(test::error_of([&] { Engine e(*l.model, l.tokenizer.get(), c); }).find("cpu_offload_kv_bytes"),
            std::string::npos);
  c.cpu_offload_kv_bytes = 1 << 20;
  c.enable_prefix_caching = false;
  EXPECT_NE(test::error_of([&] { Engine e(*l.model, l.tokenizer.get(), c); }).find("prefix caching"),
            std::string::npos);
}
