// Disaggregated prefill at the engine level (stories260K, CPU backend): a producer engine prefills
// each request (max_tokens 1, do_remote_decode) and holds its K/V; a consumer engine imports the
// held bytes (export_held_kv -> Request::kv_import), computes only the last prompt token and
// decodes. The reference is one engine running the same requests whole: the CPU forward pass is
// batch-invariant, so equal K/V give equal bits and the tokens must be identical, seeded sampling
// included. Afterwards neither engine holds a block.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {

using Loaded = test::LoadedModel;

// 32 requests: even ones greedy, odd ones seeded sampling; 48 new tokens at most.
std::vector<Request> requests_of(const Loaded& l) {
  const std::vector<std::string> texts = test::story_prompts();
  std::vector<Request> out;
  for (size_t i = 0; i < 32; ++i) {
    Request r;
    r.prompt = l.tokenizer->encode(texts[i], true, false);
    r.max_tokens = 48;
    r.stop_ids = test::eog_ids(*l.tokenizer);
    r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    r.sampling.seed = 500 + i;
    out.push_back(std::move(r));
  }
  return out;
}

EngineConfig config_of(int32_t block_size) {
  EngineConfig c;
  c.block_size = block_size;
  c.max_model_len = 128;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 16;
  return c;
}

std::map<RequestId, std::vector<int32_t>> run(Engine& e, bool aborts = false) {
  std::map<RequestId, std::vector<int32_t>> out;
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      auto& ids = out[o.id];
      ids.insert(ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      EXPECT_TRUE(!o.finished || o.finish_reason == "stop" || o.finish_reason == "length" ||
                  (aborts && o.finish_reason == "abort"))
          << o.error;
    }
  return out;
}

// The producer's half: every request prefilled and held; returns the ids in request order.
std::vector<RequestId> prefill_all(Engine& producer, const std::vector<Request>& requests) {
  std::vector<RequestId> ids;
  std::map<RequestId, size_t> index;
  for (Request r : requests) {
    r.max_tokens = 1;
    r.do_remote_decode = true;
    ids.push_back(producer.add_request(std::move(r)));
    index[ids.back()] = ids.size() - 1;
  }
  while (producer.has_unfinished())
    for (const RequestOutput& o : producer.step()) {
      if (!o.finished || o.finish_reason == "abort") continue;
      // The finished output names the held blocks (vLLM's remote_block_ids) and their tokens.
      EXPECT_EQ(o.kv_held_blocks, producer.held_kv_blocks(o.id));
      EXPECT_EQ(o.kv_held_tokens, static_cast<int64_t>(requests[index.at(o.id)].prompt.size()));
      EXPECT_TRUE(o.finish_reason == "length" || o.finish_reason == "stop") << o.error;
    }
  return ids;
}

}  // namespace

TEST(EngineKvTransfer, ProducerPrefillAndConsumerDecodeGiveTheTokensOfOneEngine) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const Loaded l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l);
  Engine reference(*l.model, l.tokenizer.get(), config_of(8));
  std::vector<RequestId> ref_ids;
  for (const Request& r : requests) ref_ids.push_back(reference.add_request(r));
  auto want = run(reference);

  Engine producer(*l.model, l.tokenizer.get(), config_of(8));
  Engine consumer(*l.model, l.tokenizer.get(), config_of(8));
  const std::vector<RequestId> held = prefill_all(producer, requests);
  EXPECT_EQ(producer.n_held_kv(), requests.size());
  EXPECT_GT(producer.stats().kv_blocks_used, 0);
  std::vector<RequestId> ids;
  int64_t n_prompt_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<int32_t> tokens;
    auto im = std::make_shared<KvImport>(producer.export_held_kv(held[i], &tokens));
    EXPECT_EQ(tokens, requests[i].prompt) << "request " << i;
    EXPECT_EQ(im->n_tokens, static_cast<int64_t>(requests[i].prompt.size()));
    EXPECT_EQ(producer.held_kv_blocks(held[i]).size(), (requests[i].prompt.size() + 7) / 8);
    producer.release_held_kv(held[i]);
    Request r = requests[i];
    r.kv_import = std::move(im);
    ids.push_back(consumer.add_request(std::move(r)));
    n_prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
  }
  EXPECT_EQ(producer.n_held_kv(), 0u);
  EXPECT_EQ(producer.stats().kv_blocks_used, 0);
  const auto got = run(consumer);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_FALSE(want[ref_ids[i]].empty());
    EXPECT_EQ(got.at(ids[i]), want[ref_ids[i]]) << "request " << i;
  }
  // The consumer computed one prompt token per request (the last); the producer the rest.
  EXPECT_EQ(consumer.stats().n_prompt_tokens_computed, static_cast<int64_t>(requests.size()));
  EXPECT_LE(producer.stats().n_prompt_tokens_computed, n_prompt_tokens);
  EXPECT_GT(n_prompt_tokens, 10 * static_cast<int64_t>(requests.size()));
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
}

// A producer with prefix caching: a prompt that extends an earlier one takes the earlier one's
// full blocks from the cache, and the transfer still carries all of its blocks.
TEST(EngineKvTransfer, PrefixCacheHitOnTheProducerTransfersEveryBlock) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const Loaded l = test::load_model(test::stories_path());
  std::vector<Request> first = requests_of(l);
  first.resize(1);
  Request longer = first[0];
  const std::vector<int32_t> tail = l.tokenizer->encode(" They went to the park and", false, false);
  longer.prompt.insert(longer.prompt.end(), tail.begin(), tail.end());
  ASSERT_GE(first[0].prompt.size(), 8u);

  Engine reference(*l.model, l.tokenizer.get(), config_of(8));
  const RequestId ref_id = reference.add_request(longer);
  const auto want = run(reference).at(ref_id);

  Engine producer(*l.model, l.tokenizer.get(), config_of(8));
  producer.release_held_kv(prefill_all(producer, first)[0]);
  const RequestId held = prefill_all(producer, {longer})[0];
  EXPECT_EQ(producer.stats().prefix_cache_hit_tokens, static_cast<int64_t>(first[0].prompt.size()) / 8 * 8);
  Engine consumer(*l.model, l.tokenizer.get(), config_of(8));
  Request r = longer;
  r.kv_import = std::make_shared<KvImport>(producer.export_held_kv(held));
  EXPECT_EQ(r.kv_import->n_tokens, static_cast<int64_t>(longer.prompt.size()));
  producer.release_held_kv(held);
  const RequestId id = consumer.add_request(std::move(r));
  EXPECT_EQ(run(consumer).at(id), want);
  EXPECT_EQ(producer.stats().kv_blocks_used, 0);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);

  // The consumer's own prefix cache then holds the longer prompt's full blocks: a second import of
  // it takes them from there and writes only the blocks after them; the tokens stay the same.
  const RequestId again = prefill_all(producer, {longer})[0];
  Request r2 = longer;
  r2.kv_import = std::make_shared<KvImport>(producer.export_held_kv(again));
  producer.release_held_kv(again);
  const int64_t hits_before = consumer.stats().prefix_cache_hit_tokens;
  const RequestId id2 = consumer.add_request(std::move(r2));
  EXPECT_EQ(run(consumer).at(id2), want);
  EXPECT_EQ(consumer.stats().prefix_cache_hit_tokens - hits_before,
            static_cast<int64_t>(longer.prompt.size() - 1) / 8 * 8);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
}

// Aborts: a held request released without a pull, a consumer request aborted before and after
// admission, a producer request aborted mid-prefill (nothing is held): no block stays used.
TEST(EngineKvTransfer, AbortsOnEitherSideLeaveNoBlockUsed) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const Loaded l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l);
  Engine producer(*l.model, l.tokenizer.get(), config_of(8));
  const std::vector<RequestId> held = prefill_all(producer, {requests[0], requests[1]});
  Request mid = requests[2];
  mid.do_remote_decode = true;
  mid.max_tokens = 1;
  const RequestId aborted = producer.add_request(mid);
  producer.abort_request(aborted);
  run(producer, /*aborts=*/true);
  EXPECT_EQ(producer.n_held_kv(), 2u);
  Engine consumer(*l.model, l.tokenizer.get(), config_of(8));
  std::vector<RequestId> ids;
  for (size_t i = 0; i < 2; ++i) {
    Request r = requests[i];
    r.kv_import = std::make_shared<KvImport>(producer.export_held_kv(held[i]));
    ids.push_back(consumer.add_request(std::move(r)));
  }
  EXPECT_NE(test::error_of([&] { producer.export_held_kv(aborted); }).find("holds no K/V"), std::string::npos);
  for (RequestId id : held) producer.release_held_kv(id);
  producer.release_held_kv(held[0]);  // a second release is ignored
  EXPECT_EQ(producer.stats().kv_blocks_used, 0);
  consumer.abort_request(ids[0]);  // before admission
  consumer.step();
  consumer.step();
  EXPECT_GT(consumer.stats().kv_blocks_used, 0);
  consumer.abort_request(ids[1]);  // while decoding
  run(consumer, /*aborts=*/true);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
}

TEST(EngineKvTransfer, MismatchedLayoutsAndSizesAreErrors) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const Loaded l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l);
  Engine producer(*l.model, l.tokenizer.get(), config_of(8));
  const RequestId held = prefill_all(producer, {requests[0]})[0];
  const auto im = std::make_shared<KvImport>(producer.export_held_kv(held));
  Engine consumer16(*l.model, l.tokenizer.get(), config_of(16));
  Request r = requests[0];
  r.kv_import = im;
  EXPECT_NE(test::error_of([&] { consumer16.add_request(r); }).find("block_size is 8, this engine's 16"),
            std::string::npos);
  EngineConfig f32 = config_of(8);
  f32.kv_dtype = KvDtype::F32;
  Engine consumer_f32(*l.model, l.tokenizer.get(), f32);
  EXPECT_NE(test::error_of([&] { consumer_f32.add_request(r); }).find("kv_dtype is f16, this engine's f32"),
            std::string::npos);
  Engine consumer(*l.model, l.tokenizer.get(), config_of(8));
  auto short_bytes = std::make_shared<KvImport>(*im);
  short_bytes->bytes.pop_back();
  r.kv_import = short_bytes;
  EXPECT_NE(test::error_of([&] { consumer.add_request(r); }).find("expected"), std::string::npos);
  auto too_many = std::make_shared<KvImport>(*im);
  too_many->n_tokens = static_cast<int64_t>(r.prompt.size()) + 1;
  r.kv_import = too_many;
  EXPECT_NE(test::error_of([&] { consumer.add_request(r); }).find("must be in [1, n_prompt]"), std::string::npos);
  EXPECT_FALSE(consumer.has_unfinished());
  producer.release_held_kv(held);
}
