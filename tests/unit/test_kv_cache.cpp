// KvCache's populate option: the pool's pages are resident right after construction (mincore), and
// without it a large pool is not (pages are touched only when a block is first written).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include "memory/kv_cache.h"

namespace kestrel {
namespace {

// Fraction of the whole pages inside [p, p + n) that are resident.
double resident_fraction(const void* p, size_t n) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (end <= begin) return 0.0;
  std::vector<unsigned char> v((end - begin) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, v.data()) != 0) return -1.0;
  size_t in = 0;
  for (unsigned char c : v) in += c & 1;
  return static_cast<double>(in) / static_cast<double>(v.size());
}

// 2 layers x 4 KV heads x 64 dims x f32 x 16 tokens = 16 KiB a block per layer and K/V; 2048
// blocks = 32 MiB per layer buffer (far above malloc's mmap threshold, so fresh zero pages).
constexpr int64_t kLayers = 2, kHeads = 4, kDim = 64;
constexpr int32_t kBlock = 16, kBlocks = 2048;
constexpr size_t kLayerBytes = size_t{kBlocks} * kBlock * kHeads * kDim * sizeof(float);

TEST(KvCache, PopulateMakesEveryPageResident) {
  KvCache kv(kLayers, kHeads, kDim, kBlock, kBlocks, KvDtype::F32, /*populate=*/true);
  for (int64_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(resident_fraction(kv.k(l), kLayerBytes), 1.0) << "layer " << l;
    EXPECT_EQ(resident_fraction(kv.v(l), kLayerBytes), 1.0) << "layer " << l;
  }
}

TEST(KvCache, WithoutPopulateALargePoolIsNotResident) {
  KvCache kv(kLayers, kHeads, kDim, kBlock, kBlocks, KvDtype::F32);
  // Nothing was written: at most malloc's own header page of each buffer is touched.
  EXPECT_LT(resident_fraction(kv.k(0), kLayerBytes), 0.01);
  EXPECT_LT(resident_fraction(kv.v(1), kLayerBytes), 0.01);
}

}  // namespace
}  // namespace kestrel
