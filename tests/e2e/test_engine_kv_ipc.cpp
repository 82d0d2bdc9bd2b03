// Disaggregated prefill at the engine level with the K/V left in the producer's pool (CUDA IPC's
// path: Engine::export_held_kv_ipc -> KvImport::ipc -> ModelRunner::copy_kv_blocks_ipc at
// admission), on stories260K and the CPU backend. PeerRunner stands in for the GPU: its "handle"
// names the producer's runner in this process, and its block copy goes through that runner's
// read_kv_blocks / write_kv_blocks. The reference is one engine running the same requests whole
// (the CPU pass is batch-invariant: identical tokens); also checked: the producer's blocks stay
// held until the import is written, an import whose hold ended before admission ends with an
// error, a copy that fails ends its request (not the engine) with an error, and either way the
// consumer's release runs once.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>

#include "core/error.h"
#include "engine/engine.h"
#include "test_util.h"

using namespace kestrel;

namespace {

constexpr int32_t kBlocks = 256;

class PeerRunner final : public ModelRunner {
 public:
  explicit PeerRunner(const LlamaModel& model) {
    RunnerOptions o;
    o.block_size = 8;
    o.n_kv_blocks = kBlocks;
    inner_ = make_cpu_model_runner(model, o);
  }
  std::span<const float> forward(const ForwardBatch& b) override { return inner_->forward(b); }
  void copy_blocks(std::span<const BlockCopy> copies) override { inner_->copy_blocks(copies); }
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override {
    inner_->read_kv_blocks(blocks, out);
  }
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override {
    inner_->write_kv_blocks(blocks, in);
  }
  std::string device_uuid() const override { return "GPU-00000000-0000-0000-0000-000000000001"; }
  KvIpcMemory export_kv_ipc() const override {
    KvIpcMemory m;
    m.device_uuid = device_uuid();
    const PeerRunner* self = this;
    m.handles = {std::string(reinterpret_cast<const char*>(&self), sizeof self)};
    m.block_bytes = {inner_->kv_bytes_per_token() * inner_->block_size()};
    m.n_blocks = inner_->n_kv_blocks();
    return m;
  }
  void copy_kv_blocks_ipc(const KvIpcMemory& peer, std::span<const int32_t> src, std::span<const int32_t> dst) override {
    if (fail_copies) throw Error("CUDA IPC: cudaIpcOpenMemHandle of the producer's KV cache failed: test");
    const PeerRunner* from = nullptr;
    std::memcpy(&from, peer.handles.at(0).data(), sizeof from);
    std::vector<std::byte> block(static_cast<size_t>(peer.block_bytes.at(0)));
    ASSERT_EQ(src.size(), dst.size());
    for (size_t i = 0; i < src.size(); ++i) {
      from->read_kv_blocks(src.subspan(i, 1), block);
      inner_->write_kv_blocks(dst.subspan(i, 1), block);
    }
    n_copied += static_cast<int64_t>(src.size());
  }
  int32_t n_kv_blocks() const override { return inner_->n_kv_blocks(); }
  int32_t block_size() const override { return inner_->block_size(); }
  KvDtype kv_dtype() const override { return inner_->kv_dtype(); }
  int64_t kv_bytes_per_token() const override { return inner_->kv_bytes_per_token(); }
  std::string description() const override { return "peer wrapper over " + inner_->description(); }

  int64_t n_copied = 0;
  bool fail_copies = false;  // as when the producer's memory cannot be mapped

 private:
  std::unique_ptr<ModelRunner> inner_;
};

EngineConfig config() {
  EngineConfig c;
  c.block_size = 8;
  c.max_model_len = 128;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 16;
  c.n_kv_blocks = kBlocks;
  return c;
}

std::vector<Request> requests_of(const test::LoadedModel& l, size_t n) {
  const std::vector<std::string> texts = test::story_prompts();
  std::vector<Request> out;
  for (size_t i = 0; i < n; ++i) {
    Request r;
    r.prompt = l.tokenizer->encode(texts[i], true, false);
    r.max_tokens = 32;
    r.stop_ids = test::eog_ids(*l.tokenizer);
    r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    r.sampling.seed = 700 + i;
    out.push_back(std::move(r));
  }
  return out;
}

std::map<RequestId, RequestOutput> run(Engine& e) {
  std::map<RequestId, RequestOutput> out;
  while (e.has_unfinished())
    for (RequestOutput& o : e.step()) {
      RequestOutput& all = out[o.id];
      all.new_token_ids.insert(all.new_token_ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) all.finish_reason = o.finish_reason, all.error = o.error;
    }
  return out;
}

// The producer's half: each request prefilled (max_tokens 1) and held; the ids in order.
std::vector<RequestId> prefill_all(Engine& producer, const std::vector<Request>& requests) {
  std::vector<RequestId> ids;
  for (Request r : requests) {
    r.max_tokens = 1;
    r.do_remote_decode = true;
    ids.push_back(producer.add_request(std::move(r)));
  }
  run(producer);
  return ids;
}

}  // namespace

TEST(EngineKvIpc, ImportsCopiedFromTheProducersPoolGiveTheTokensOfOneEngine) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const test::LoadedModel l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l, 12);
  Engine reference(*l.model, l.tokenizer.get(), config());
  std::vector<RequestId> ref_ids;
  for (const Request& r : requests) ref_ids.push_back(reference.add_request(r));
  const auto want = run(reference);

  auto producer_runner = std::make_unique<PeerRunner>(*l.model);
  auto consumer_runner = std::make_unique<PeerRunner>(*l.model);
  PeerRunner& into = *consumer_runner;
  Engine producer(*l.model, l.tokenizer.get(), config(), std::move(producer_runner));
  Engine consumer(*l.model, l.tokenizer.get(), config(), std::move(consumer_runner));
  const std::vector<RequestId> held = prefill_all(producer, requests);
  std::vector<RequestId> ids;
  int released = 0;
  int64_t n_blocks = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<int32_t> tokens;
    auto im = std::make_shared<KvImport>(producer.export_held_kv_ipc(held[i], &tokens));
    EXPECT_EQ(tokens, requests[i].prompt);
    EXPECT_TRUE(im->bytes.empty());
    EXPECT_EQ(im->ipc_blocks, producer.held_kv_blocks(held[i]));
    n_blocks += static_cast<int64_t>(im->ipc_blocks.size());
    // The consumer's release (the server's DELETE) frees the producer's blocks.
    im->remote_hold = std::shared_ptr<void>(nullptr, [&, id = held[i]](void*) {
      ++released;
      producer.release_held_kv(id);
    });
    Request r = requests[i];
    r.kv_import = std::move(im);
    ids.push_back(consumer.add_request(std::move(r)));
  }
  // Nothing is copied or released before admission: the producer still holds every block.
  EXPECT_EQ(released, 0);
  EXPECT_EQ(producer.n_held_kv(), requests.size());
  const auto got = run(consumer);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_FALSE(want.at(ref_ids[i]).new_token_ids.empty());
    EXPECT_EQ(got.at(ids[i]).new_token_ids, want.at(ref_ids[i]).new_token_ids) << "request " << i;
  }
  EXPECT_EQ(released, static_cast<int>(requests.size()));
  EXPECT_EQ(producer.n_held_kv(), 0u);
  EXPECT_EQ(producer.stats().kv_blocks_used, 0);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
  // Every block of the imported tokens was copied (12 different prompts: no consumer cache hit
  // on a whole block of another), counted under cuda_ipc, none under host.
  EXPECT_EQ(into.n_copied, n_blocks);
  EXPECT_EQ(consumer.stats().kv_imports[1], static_cast<int64_t>(requests.size()));
  EXPECT_EQ(consumer.stats().kv_import_bytes[1], n_blocks * 8 * into.kv_bytes_per_token());
  EXPECT_EQ(consumer.stats().kv_imports[0], 0);
  EXPECT_EQ(consumer.stats().n_prompt_tokens_computed, static_cast<int64_t>(requests.size()));
}

TEST(EngineKvIpc, AnImportWhoseHoldEndedBeforeAdmissionEndsWithAnError) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const test::LoadedModel l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l, 2);
  Engine producer(*l.model, l.tokenizer.get(), config(), std::make_unique<PeerRunner>(*l.model));
  Engine consumer(*l.model, l.tokenizer.get(), config(), std::make_unique<PeerRunner>(*l.model));
  const std::vector<RequestId> held = prefill_all(producer, requests);
  int released = 0;
  std::vector<RequestId> ids;
  for (size_t i = 0; i < 2; ++i) {
    auto im = std::make_shared<KvImport>(producer.export_held_kv_ipc(held[i]));
    im->remote_hold = std::shared_ptr<void>(nullptr, [&](void*) { ++released; });
    // Request 0's hold ended a second ago; request 1's lasts.
    if (i == 0) im->ipc_valid_until = std::chrono::steady_clock::now() - std::chrono::seconds(1);
    Request r = requests[i];
    r.kv_import = std::move(im);
    ids.push_back(consumer.add_request(std::move(r)));
  }
  const auto got = run(consumer);
  EXPECT_EQ(got.at(ids[0]).finish_reason, "error");
  EXPECT_NE(got.at(ids[0]).error.find("hold on the K/V ended"), std::string::npos) << got.at(ids[0]).error;
  EXPECT_TRUE(got.at(ids[0]).new_token_ids.empty());
  EXPECT_NE(got.at(ids[1]).finish_reason, "error") << got.at(ids[1]).error;
  EXPECT_EQ(released, 2);
  EXPECT_EQ(consumer.stats().kv_imports[1], 1);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
  for (RequestId id : held) producer.release_held_kv(id);
}

TEST(EngineKvIpc, MismatchedBlockListsAndTensorsAreErrors) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const test::LoadedModel l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l, 1);
  Engine producer(*l.model, l.tokenizer.get(), config(), std::make_unique<PeerRunner>(*l.model));
  Engine consumer(*l.model, l.tokenizer.get(), config(), std::make_unique<PeerRunner>(*l.model));
  const RequestId held = prefill_all(producer, requests)[0];
  const KvImport im = producer.export_held_kv_ipc(held);
  Request r = requests[0];
  auto fewer = std::make_shared<KvImport>(im);
  fewer->ipc_blocks.pop_back();
  r.kv_import = fewer;
  EXPECT_NE(test::error_of([&] { consumer.add_request(r); }).find("remote blocks for"), std::string::npos);
  auto wider = std::make_shared<KvImport>(im);
  wider->ipc->block_bytes[0] += 2;
  r.kv_import = wider;
  EXPECT_NE(test::error_of([&] { consumer.add_request(r); }).find("bytes per block"), std::string::npos);
  EXPECT_FALSE(consumer.has_unfinished());
  // A backend without IPC (the CPU runner) cannot export.
  Engine cpu(*l.model, l.tokenizer.get(), config());
  const RequestId cpu_held = prefill_all(cpu, requests)[0];
  EXPECT_NE(test::error_of([&] { cpu.export_held_kv_ipc(cpu_held); }).find("no CUDA IPC"), std::string::npos);
  EXPECT_EQ(cpu.n_held_kv(), 1u);
  producer.release_held_kv(held);
}

TEST(EngineKvIpc, AFailedCopyEndsItsRequestWithAnErrorAndTheEngineServesOn) {
  KESTREL_REQUIRE_FILE(test::stories_path());
  const test::LoadedModel l = test::load_model(test::stories_path());
  const std::vector<Request> requests = requests_of(l, 3);
  Engine producer(*l.model, l.tokenizer.get(), config(), std::make_unique<PeerRunner>(*l.model));
  auto consumer_runner = std::make_unique<PeerRunner>(*l.model);
  PeerRunner& into = *consumer_runner;
  into.fail_copies = true;
  Engine consumer(*l.model, l.tokenizer.get(), config(), std::move(consumer_runner));
  const std::vector<RequestId> held = prefill_all(producer, requests);
  int released = 0;
  std::vector<RequestId> ids;
  for (size_t i = 0; i < 2; ++i) {
    auto im = std::make_shared<KvImport>(producer.export_held_kv_ipc(held[i]));
    im->remote_hold = std::shared_ptr<void>(nullptr, [&](void*) { ++released; });
    Request r = requests[i];
    r.kv_import = std::move(im);
    ids.push_back(consumer.add_request(std::move(r)));
  }
  const auto got = run(consumer);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.at(ids[i]).finish_reason, "error");
    EXPECT_NE(got.at(ids[i]).error.find("cudaIpcOpenMemHandle"), std::string::npos) << got.at(ids[i]).error;
    EXPECT_TRUE(got.at(ids[i]).new_token_ids.empty());
  }
  EXPECT_EQ(released, 2);
  EXPECT_EQ(consumer.stats().kv_imports[1], 0);
  EXPECT_EQ(consumer.stats().kv_blocks_used, 0);
  // The engine serves on: the third request through host memory gives its tokens.
  Engine reference(*l.model, l.tokenizer.get(), config());
  const RequestId ref = reference.add_request(requests[2]);
  Request r = requests[2];
  r.kv_import = std::make_shared<KvImport>(producer.export_held_kv(held[2]));
  const RequestId id = consumer.add_request(std::move(r));
  EXPECT_EQ(run(consumer).at(id).new_token_ids, run(reference).at(ref).new_token_ids);
  for (RequestId h : held) producer.release_held_kv(h);
}
