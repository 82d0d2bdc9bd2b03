// The CUDA backend's part of disaggregated prefill (ModelRunner::read_kv_blocks / write_kv_blocks):
// the K/V of whole blocks to and from host memory, each block one record of every cache tensor's
// block bytes. The copies run on stream_ after the passes that wrote the K/V, and the host waits
// for them (a transfer is a rare, whole-prompt event; the server's pull waits on it anyway).
#include <cstddef>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

std::vector<CudaModelRunner::CacheTensor> CudaModelRunner::cache_tensors() const {
  std::vector<CacheTensor> t;
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    t.push_back({k_cache_[l].as<std::byte>(), static_cast<size_t>(cache_block_bytes_)});
    if (l < v_cache_.size()) t.push_back({v_cache_[l].as<std::byte>(), static_cast<size_t>(cache_block_bytes_)});
  }
  for (size_t l = 0; l < k_scale_.size(); ++l) {
    t.push_back({k_scale_[l].as<std::byte>(), static_cast<size_t>(scale_block_bytes_)});
    t.push_back({v_scale_[l].as<std::byte>(), static_cast<size_t>(scale_block_bytes_)});
  }
  return t;
}

void CudaModelRunner::kv_transfer_copy(std::span<const int32_t> blocks, std::byte* host, size_t host_bytes,
                                       bool to_host) const {
  use_device();
  const std::vector<CacheTensor> tensors = cache_tensors();
  size_t record = 0;
  for (const CacheTensor& t : tensors) record += t.bytes;
  if (host_bytes != blocks.size() * record)
    throw Error("CUDA KV transfer: " + std::to_string(host_bytes) + " bytes for " + std::to_string(blocks.size()) +
                " blocks of " + std::to_string(record) + " bytes");
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] < 0 || blocks[i] >= n_blocks_)
      throw Error("CUDA KV transfer: block " + std::to_string(blocks[i]) + " is outside the pool");
    std::byte* h = host + i * record;
    for (const CacheTensor& t : tensors) {
      std::byte* d = t.device + static_cast<size_t>(blocks[i]) * t.bytes;
      if (to_host) {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(h, d, t.bytes, cudaMemcpyDeviceToHost, stream_));
      } else {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(d, h, t.bytes, cudaMemcpyHostToDevice, stream_));
      }
      h += t.bytes;
    }
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaModelRunner::read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const {
  kv_transfer_copy(blocks, out.data(), out.size(), true);
}

void CudaModelRunner::write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) {
  kv_transfer_copy(blocks, const_cast<std::byte*>(in.data()), in.size(), false);
}

}  // namespace kestrel::cuda_runner
