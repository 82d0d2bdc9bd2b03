// The CUDA backend's copies of K/V blocks through host memory, checked through the runner's
// forward pass (swap_roundtrip.h), for the bf16 cache and the FP8 one (codes and scales): the host
// swap space (pinned memory, copies on a stream of their own that the compute stream waits for),
// where swapped-out blocks come back with their K/V, also when one call copies blocks out and
// others back into the same device blocks (the two directions on two streams); and the block
// transfer of disaggregated prefill (read_kv_blocks / write_kv_blocks), where blocks read from one
// runner and written into other blocks of a fresh runner give the logits of the runner that
// computed them. On a GPU in
// kestrel_tests; on the emulated runtime in kestrel_cuda_emu_tests.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_runner.h"
#include "cuda_test_util.h"
#include "swap_roundtrip.h"
#include "test_util.h"

using namespace kestrel;

namespace {

// check(make_runner, n_vocab) on stories260K with an 8-block pool of 16-token blocks, once per
// cache dtype; skips without a GPU (or the emulation) or the model.
template <class Check>
void for_each_cache_dtype(Check&& check) {
  if (!test::cuda_unavailable_reason().empty()) GTEST_SKIP() << test::cuda_unavailable_reason();
  const std::string path = test::data_dir() + "/stories260K/stories260K.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto model = LlamaModel::load_gguf(path);
  for (const KvDtype dtype : {KvDtype::BF16, KvDtype::FP8}) {
    SCOPED_TRACE(kv_dtype_name(dtype));
    RunnerOptions o;
    o.block_size = 16;
    o.n_kv_blocks = 8;
    o.kv_dtype = dtype;
    o.enforce_eager = true;
    check([&] { return make_cuda_model_runner(*model, o); }, static_cast<int32_t>(model->hparams().n_vocab));
  }
}

}  // namespace

TEST(CudaModelRunner, SwappedBlocksComeBackWithTheirKeysAndValues) {
  for_each_cache_dtype([](auto make, int32_t n_vocab) { test::expect_swap_roundtrip_keeps_logits(make, n_vocab); });
}

TEST(CudaModelRunner, SwappedBlocksOutAndInAtOnceCopyEachBlockOutBeforeIn) {
  for_each_cache_dtype([](auto make, int32_t n_vocab) { test::expect_swap_out_in_orders_each_block(make, n_vocab); });
}

TEST(CudaModelRunner, TransferredBlocksGiveTheLogitsOfTheRunnerThatComputedThem) {
  for_each_cache_dtype([](auto make, int32_t n_vocab) { test::expect_kv_transfer_keeps_logits(make, n_vocab); });
}
