// Disaggregated prefill between processes on one GPU (CUDA IPC; cuda_kv_transfer.cpp): the device
// to device block copy, checked through the runner's forward pass as the host transfer is
// (swap_roundtrip.h): a peer pool's blocks copied into other blocks of a fresh runner give the
// logits of the runner that computed them, in one run of consecutive blocks or several; and the
// IPC handles themselves, which a second process maps. One process cannot map its own handles,
// and the CPU emulation none at all: there the calls end in kestrel::Error, never an abort, which
// is what sends a server's pull through host memory. On a GPU in kestrel_tests; on the emulated
// runtime in kestrel_cuda_emu_tests.
#include <gtest/gtest.h>

#include <filesystem>

#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/cuda_runner.h"
#include "cuda_test_util.h"
#include "swap_roundtrip.h"
#include "test_util.h"

using namespace kestrel;
using kestrel::cuda_runner::CudaModelRunner;

namespace {

struct Fixture {
  std::unique_ptr<LlamaModel> model;
  RunnerOptions options;
  std::unique_ptr<ModelRunner> make() const { return make_cuda_model_runner(*model, options); }
};

// stories260K with a 8-block pool of 16-token blocks; null (after GTEST_SKIP) without a GPU (or
// the emulation) or the model.
std::unique_ptr<Fixture> fixture(KvDtype dtype) {
  if (!test::cuda_unavailable_reason().empty()) return nullptr;
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  if (!std::filesystem::exists(path)) return nullptr;
  auto f = std::make_unique<Fixture>();
  f->model = LlamaModel::load_gguf(path);
  f->options.block_size = 16;
  f->options.n_kv_blocks = 8;
  f->options.kv_dtype = dtype;
  f->options.enforce_eager = true;
  return f;
}

CudaModelRunner& as_cuda(ModelRunner& r) { return dynamic_cast<CudaModelRunner&>(r); }

std::vector<int32_t> prompt_of(int32_t n_vocab) {
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 20; ++i) prompt.push_back(1 + (i * 37) % (n_vocab - 1));
  return prompt;
}

}  // namespace

TEST(CudaKvIpc, CopiedPeerBlocksGiveTheLogitsOfTheRunnerThatComputedThem) {
  for (const KvDtype dtype : {KvDtype::BF16, KvDtype::FP8}) {
    SCOPED_TRACE(kv_dtype_name(dtype));
    const auto f = fixture(dtype);
    if (f == nullptr) GTEST_SKIP() << "no GPU, emulation or stories260K";
    const auto n_vocab = static_cast<int32_t>(f->model->hparams().n_vocab);
    const std::vector<int32_t> next = {7 % n_vocab};
    const auto producer = f->make();
    test::run_one(*producer, prompt_of(n_vocab), 0, {1, 2});
    const std::vector<float> want = test::run_one(*producer, next, 20, {1, 2});
    const std::vector<std::byte*> peer = as_cuda(*producer).cache_tensor_bases();

    // Destination blocks 5, 3: two runs; 4, 5: one run of both.
    for (const std::vector<int32_t>& dst : {std::vector<int32_t>{5, 3}, std::vector<int32_t>{4, 5}}) {
      const auto consumer = f->make();
      as_cuda(*consumer).copy_kv_blocks_from(peer, producer->n_kv_blocks(), std::vector<int32_t>{1, 2}, dst);
      EXPECT_EQ(test::run_one(*consumer, next, 20, dst), want);
      // Blocks that received nothing give other logits, so the comparison can fail.
      EXPECT_NE(test::run_one(*consumer, next, 20, {0, 1}), want);
    }
    const auto consumer = f->make();
    CudaModelRunner& c = as_cuda(*consumer);
    EXPECT_THROW(c.copy_kv_blocks_from(peer, producer->n_kv_blocks(), std::vector<int32_t>{1, 8},
                                       std::vector<int32_t>{1, 2}),
                 Error);  // outside the peer's pool
    EXPECT_THROW(c.copy_kv_blocks_from(peer, producer->n_kv_blocks(), std::vector<int32_t>{1},
                                       std::vector<int32_t>{1, 2}),
                 Error);
    EXPECT_THROW(c.copy_kv_blocks_from(std::span<std::byte* const>(peer).first(1), producer->n_kv_blocks(),
                                       std::vector<int32_t>{1}, std::vector<int32_t>{1}),
                 Error);
  }
}

TEST(CudaKvIpc, HandlesOfThisProcessDoNotOpenHereAndFailWithAnError) {
  const auto f = fixture(KvDtype::BF16);
  if (f == nullptr) GTEST_SKIP() << "no GPU, emulation or stories260K";
  const auto producer = f->make();
  const auto consumer = f->make();
  const std::string uuid = producer->device_uuid();
  ASSERT_EQ(uuid.size(), 40u) << uuid;  // "GPU-" and 36 characters
  EXPECT_EQ(uuid.substr(0, 4), "GPU-");
  EXPECT_EQ(consumer->device_uuid(), uuid);
  const size_t n_tensors = as_cuda(*producer).cache_tensor_bases().size();
  KvIpcMemory peer;
  peer.device_uuid = uuid;
  peer.n_blocks = producer->n_kv_blocks();
  const int64_t block_bytes = producer->kv_bytes_per_token() * producer->block_size() / static_cast<int64_t>(n_tensors);
  bool exported = false;
  try {
    peer = producer->export_kv_ipc();
    exported = true;
  } catch (const Error&) {  // the emulation: no IPC
    peer.handles.assign(n_tensors, std::string(64, '\0'));
    peer.block_bytes.assign(n_tensors, block_bytes);
  }
#if defined(KESTREL_CUDA_EMULATE)
  EXPECT_FALSE(exported);
#endif
  if (exported) {
    EXPECT_EQ(peer.device_uuid, uuid);
    ASSERT_EQ(peer.handles.size(), n_tensors);
    for (const std::string& h : peer.handles) EXPECT_EQ(h.size(), 64u);
    EXPECT_EQ(peer.block_bytes, std::vector<int64_t>(n_tensors, block_bytes));
    EXPECT_EQ(producer->export_kv_ipc().handles, peer.handles);  // made once
  }
  EXPECT_THROW(consumer->open_kv_ipc(peer), Error);
  EXPECT_THROW(consumer->copy_kv_blocks_ipc(peer, std::vector<int32_t>{1}, std::vector<int32_t>{1}), Error);
  // Another GPU, or another geometry, is refused before any handle is opened.
  KvIpcMemory other = peer;
  other.device_uuid = "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff";
  EXPECT_NE(test::error_of([&] { consumer->open_kv_ipc(other); }).find("the producer runs on GPU-ffffffff"),
            std::string::npos);
  other = peer;
  other.block_bytes[0] += 2;
  EXPECT_NE(test::error_of([&] { consumer->open_kv_ipc(other); }).find("bytes per block"), std::string::npos);
  other = peer;
  other.handles.pop_back();
  EXPECT_NE(test::error_of([&] { consumer->open_kv_ipc(other); }).find("tensors"), std::string::npos);
}
