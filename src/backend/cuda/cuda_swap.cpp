// The CUDA backend's host swap space (preemption by swap, ModelRunner::swap_out / swap_in): one
// pinned buffer holding, per cache tensor, n_swap_blocks blocks of that tensor's block bytes.
// Copies go on a stream of their own, ordered after the work already on the compute stream (the
// passes that wrote the K/V), and the compute stream waits on an event after them, so the next
// copy_blocks or forward pass (which may write a swapped-out block, now free) runs after them;
// the host meanwhile builds the next batch.
#include <cstddef>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

void CudaModelRunner::allocate_swap_space(int32_t n_blocks) {
  KESTREL_ASSERT(n_swap_blocks_ == 0 && n_blocks > 0, "CUDA: swap space allocated twice or empty");
  const size_t n_tensors = k_cache_.size() + v_cache_.size();
  const size_t per_block = n_tensors * static_cast<size_t>(cache_block_bytes_ + scale_block_bytes_);
  swap_host_.reserve(per_block * static_cast<size_t>(n_blocks));
  n_swap_blocks_ = n_blocks;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&swap_stream_, cudaStreamNonBlocking));
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&swap_after_pass_, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&swap_done_, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaEventCreate(&h2d_start_));
  KESTREL_CUDA_CHECK(cudaEventCreate(&h2d_stop_));
}

void CudaModelRunner::collect_h2d_timing() {
  if (!h2d_pending_) return;
  // The pass after the copies waited for them, so this rarely blocks.
  KESTREL_CUDA_CHECK(cudaEventSynchronize(h2d_stop_));
  float ms = 0;
  KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, h2d_start_, h2d_stop_));
  h2d_.seconds += 1e-3 * static_cast<double>(ms);
  h2d_pending_ = false;
}

ModelRunner::HostCopyTotals CudaModelRunner::host_to_device_totals() {
  collect_h2d_timing();
  return h2d_;
}

void CudaModelRunner::swap_copy(std::span<const BlockSwap> swaps, bool out) {
  if (swaps.empty()) return;
  if (n_swap_blocks_ == 0) throw Error("CUDA: swap without swap space (allocate_swap_space)");
  // Every tensor's device base, its region of the swap buffer and the bytes of one block, in the
  // swap buffer's order.
  struct Tensor {
    std::byte* device;
    std::byte* host;
    size_t bytes;
  };
  std::vector<Tensor> tensors;
  std::byte* region = swap_host_.as<std::byte>();
  const auto n_swap = static_cast<size_t>(n_swap_blocks_);
  const auto add = [&](const DevMem& t, int64_t bytes) {
    tensors.push_back({t.as<std::byte>(), region, static_cast<size_t>(bytes)});
    region += n_swap * static_cast<size_t>(bytes);
  };
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    add(k_cache_[l], cache_block_bytes_);
    if (l < v_cache_.size()) add(v_cache_[l], cache_block_bytes_);
  }
  for (size_t l = 0; l < k_scale_.size(); ++l) {
    add(k_scale_[l], scale_block_bytes_);
    add(v_scale_[l], scale_block_bytes_);
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(swap_after_pass_, stream_));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(swap_stream_, swap_after_pass_, 0));
  if (!out) {
    collect_h2d_timing();
    KESTREL_CUDA_CHECK(cudaEventRecord(h2d_start_, swap_stream_));
  }
  // Runs of pairs consecutive on both sides, ascending or descending (a prefix evicted tail
  // first), go as one copy per tensor from the run's lowest pair.
  for (size_t i = 0; i < swaps.size();) {
    size_t n = 1;
    for (const int32_t step : {1, -1}) {
      while (i + n < swaps.size() && swaps[i + n].device == swaps[i].device + step * static_cast<int32_t>(n) &&
             swaps[i + n].host == swaps[i].host + step * static_cast<int32_t>(n))
        ++n;
      if (n > 1) break;
    }
    const bool down = n > 1 && swaps[i + 1].device < swaps[i].device;
    const int32_t d0 = down ? swaps[i + n - 1].device : swaps[i].device;
    const int32_t h0 = down ? swaps[i + n - 1].host : swaps[i].host;
    KESTREL_ASSERT(d0 >= 0 && d0 + static_cast<int64_t>(n) <= n_blocks_ && h0 >= 0 && h0 + n <= n_swap,
                   "CUDA: swap of a block outside the pools");
    for (const Tensor& t : tensors) {
      std::byte* d = t.device + static_cast<size_t>(d0) * t.bytes;
      std::byte* h = t.host + static_cast<size_t>(h0) * t.bytes;
      if (out) {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(h, d, n * t.bytes, cudaMemcpyDeviceToHost, swap_stream_));
      } else {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(d, h, n * t.bytes, cudaMemcpyHostToDevice, swap_stream_));
      }
    }
    i += n;
  }
  if (!out) {
    KESTREL_CUDA_CHECK(cudaEventRecord(h2d_stop_, swap_stream_));
    h2d_pending_ = true;
    for (const Tensor& t : tensors) h2d_.bytes += static_cast<int64_t>(swaps.size() * t.bytes);
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(swap_done_, swap_stream_));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, swap_done_, 0));
}

void CudaModelRunner::swap_out(std::span<const BlockSwap> swaps) { swap_copy(swaps, true); }
void CudaModelRunner::swap_in(std::span<const BlockSwap> swaps) { swap_copy(swaps, false); }

}  // namespace kestrel::cuda_runner
