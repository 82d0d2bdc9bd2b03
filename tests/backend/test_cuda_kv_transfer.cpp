// The CUDA backend's K/V block transfer for disaggregated prefill (read_kv_blocks /
// write_kv_blocks through host memory): blocks read from one runner and written into other blocks
// of a fresh runner give the logits of the runner that computed them (swap_roundtrip.h), for the
// bf16 cache and the FP8 one (codes and scales). On a GPU in kestrel_tests; on the emulated runtime
// in kestrel_cuda_emu_tests.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_runner.h"
#include "cuda_test_util.h"
#include "swap_roundtrip.h"
#include "test_util.h"

using namespace kestrel;

TEST(CudaModelRunner, TransferredBlocksGiveTheLogitsOfTheRunnerThatComputedThem) {
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
    test::expect_kv_transfer_keeps_logits([&] { return make_cuda_model_runner(*model, o); },
                                          static_cast<int32_t>(model->hparams().n_vocab));
  }
}
