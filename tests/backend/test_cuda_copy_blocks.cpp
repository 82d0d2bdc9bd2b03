// CUDA copy-on-write of KV blocks: destination blocks become exact copies of their sources in every
// cache tensor; every other block is left as it was.
#include <algorithm>
#include <memory>
#include <numeric>

#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaCopyBlocks, CopiesWholeBlocksInEveryCache) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(5);
  // block_bytes: 2 KV heads x 16 slots x 64 dims of bf16 (16-byte path); 3 x 5 x 1 of bf16 = 30
  // bytes (byte path).
  for (const int64_t block_bytes : {int64_t{2 * 16 * 64 * 2}, int64_t{30}}) {
    SCOPED_TRACE("block_bytes " + std::to_string(block_bytes));
    const int32_t n_blocks = 12, n_caches = 4, n_copies = 5;  // 2 layers x (K, V)
    std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> src(ids.begin(), ids.begin() + n_copies), dst(ids.begin() + n_copies, ids.begin() + 2 * n_copies);
    src[1] = src[0];  // one block copied to two places
    std::vector<std::vector<uint16_t>> before;
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> caches;
    std::vector<void*> ptrs;
    for (int32_t c = 0; c < n_caches; ++c) {
      before.push_back(random_bf16(static_cast<size_t>(n_blocks * block_bytes / 2), rng));
      caches.push_back(std::make_unique<DeviceBuffer<uint16_t>>(before.back()));
      ptrs.push_back(caches.back()->get());
    }
    DeviceBuffer<void*> d_ptrs(ptrs);
    DeviceBuffer<int32_t> d_src(src), d_dst(dst);
    cuda::copy_blocks(d_ptrs.get(), n_caches, d_src.get(), d_dst.get(), n_copies, block_bytes, nullptr);
    for (int32_t c = 0; c < n_caches; ++c) {
      auto want = before[static_cast<size_t>(c)];
      const auto* from = reinterpret_cast<const unsigned char*>(before[static_cast<size_t>(c)].data());
      auto* to = reinterpret_cast<unsigned char*>(want.data());
      for (int32_t i = 0; i < n_copies; ++i)
        std::copy(from + src[static_cast<size_t>(i)] * block_bytes, from + (src[static_cast<size_t>(i)] + 1) * block_bytes,
                  to + dst[static_cast<size_t>(i)] * block_bytes);
      EXPECT_TRUE(caches[static_cast<size_t>(c)]->download() == want) << "cache " << c;
    }
  }
}

}  // namespace
}  // namespace kestrel::test
