// CUDA row gather: an exact copy of the chosen rows (repeats and any order allowed), and nothing
// written past the output.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

TEST(CudaGatherRows, CopiesTheChosenRowsExactly) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(11);
  for (const int64_t width : {576, 4096, 13}) {  // SmolLM2's and Llama-3.1-8B's n_embd; not 16-byte rows
    SCOPED_TRACE("width " + std::to_string(width));
    const int64_t n_in = 37;
    const std::vector<int32_t> rows = {36, 0, 5, 5, 17, 1};
    const auto in = random_bf16(static_cast<size_t>(n_in * width), rng);
    DeviceBuffer<uint16_t> d_in(in), d_out(static_cast<size_t>((rows.size() + 1) * width));
    DeviceBuffer<int32_t> d_rows(rows);
    d_out.poison();
    cuda::gather_rows(d_in.bf16(), d_rows.get(), static_cast<int64_t>(rows.size()), width, d_out.bf16(), nullptr);
    const auto out = d_out.download();
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t j = 0; j < width; ++j)
        ASSERT_EQ(out[i * static_cast<size_t>(width) + static_cast<size_t>(j)],
                  in[static_cast<size_t>(rows[i] * width + j)])
            << "row " << i;
    for (int64_t j = 0; j < width; ++j)
      ASSERT_EQ(out[rows.size() * static_cast<size_t>(width) + static_cast<size_t>(j)], 0xFFFF) << "stray write";
  }
}

}  // namespace
}  // namespace kestrel::test
