#include "backend/cuda/sampling.cuh"

#include <bit>
#include <climits>
#include <cmath>
#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

size_t sampling_workspace_bytes(int64_t n_rows, int64_t n_vocab) {
  (void)n_rows;
  (void)n_vocab;
  return 0;  // everything lives in the block's shared memory
}

void sample_tokens(const float* logits, const SampleParams* params, int64_t n_rows, int64_t n_vocab,
                   int32_t* tokens, void* workspace, cudaStream_t stream, const uint32_t* masks) {
  (void)workspace;
  if (n_rows < 0 || n_rows > INT32_MAX)
    throw Error("sample_tokens: n_rows = " + std::to_string(n_rows) + " must be in [0, 2^31)");
  if (n_vocab <= 0 || n_vocab > INT32_MAX)
    throw Error("sample_tokens: n_vocab = " + std::to_string(n_vocab) + " must be in [1, 2^31)");
  if (n_rows == 0) return;
  // Fixed-point masses of the radix select: n_vocab weights <= 1, each scaled by this, sum below 2^63.
  const int bits = static_cast<int>(std::bit_width(static_cast<uint64_t>(n_vocab)));
  const float fixed_scale = std::ldexp(1.0f, 63 - bits);
  auto* kernel = &sampling::sample_kernel;
  const size_t smem = sizeof(sampling::Shared);
  set_max_dynamic_smem(kernel, smem);
  KESTREL_LAUNCH(kernel, dim3(static_cast<unsigned>(n_rows)), dim3(sampling::kThreads), smem, stream, logits, params,
                 masks, n_vocab, fixed_scale, tokens);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
