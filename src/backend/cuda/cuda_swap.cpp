// The CUDA backend's host swap space (preemption by swap and the prefix cache's host tier,
// ModelRunner::swap_out / swap_in / swap_out_in): one pinned buffer holding, per cache tensor,
// n_swap_blocks blocks of that tensor's block bytes.
// Copies go on streams of their own, ordered after the work already on the compute stream (the
// passes that wrote the K/V), and the compute stream waits on events after them, so the next
// copy_blocks or forward pass (which may write a swapped-out block, now free) runs after them;
// the host meanwhile builds the next batch. Device -> host copies run on swap_stream_; swap_out_in
// puts its host -> device copies on load_stream_, so the two directions overlap (the copy engines
// run both at once over PCIe, which is full duplex), each tensor's copies in waiting only for that
// tensor's copies out (a block copied in may be one just copied out).
#include <cstddef>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

void CudaModelRunner::allocate_swap_space(int32_t n_blocks) {
  use_device();
  KESTREL_ASSERT(n_swap_blocks_ == 0 && n_blocks > 0, "CUDA: swap space allocated twice or empty");
  const size_t n_tensors = k_cache_.size() + v_cache_.size() + k_scale_.size() + v_scale_.size();
  const size_t per_block = (k_cache_.size() + v_cache_.size()) * static_cast<size_t>(cache_block_bytes_) +
                           (k_scale_.size() + v_scale_.size()) * static_cast<size_t>(scale_block_bytes_);
  swap_host_.reserve(per_block * static_cast<size_t>(n_blocks));
  n_swap_blocks_ = n_blocks;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&swap_stream_, cudaStreamNonBlocking));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&load_stream_, cudaStreamNonBlocking));
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&swap_after_pass_, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&swap_done_, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&load_done_, cudaEventDisableTiming));
  tensor_out_done_.resize(n_tensors);
  for (cudaEvent_t& e : tensor_out_done_) KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
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
  use_device();
  collect_h2d_timing();
  return h2d_;
}

std::vector<CudaModelRunner::SwapTensor> CudaModelRunner::swap_tensors() {
  std::vector<SwapTensor> tensors;
  std::byte* region = swap_host_.as<std::byte>();
  for (const CacheTensor& t : cache_tensors()) {
    tensors.push_back({t.device, region, t.bytes});
    region += static_cast<size_t>(n_swap_blocks_) * t.bytes;
  }
  return tensors;
}

std::vector<CudaModelRunner::SwapRun> CudaModelRunner::swap_runs(std::span<const BlockSwap> swaps) const {
  // Runs of pairs consecutive on both sides, ascending or descending (a prefix evicted tail
  // first), go as one copy per tensor from the run's lowest pair.
  std::vector<SwapRun> runs;
  const auto n_swap = static_cast<size_t>(n_swap_blocks_);
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
    runs.push_back({static_cast<size_t>(d0), static_cast<size_t>(h0), n});
    i += n;
  }
  return runs;
}

void CudaModelRunner::copy_runs(const SwapTensor& t, std::span<const SwapRun> runs, bool out, cudaStream_t s) {
  for (const SwapRun& r : runs) {
    std::byte* d = t.device + r.device * t.bytes;
    std::byte* h = t.host + r.host * t.bytes;
    if (out) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(h, d, r.n * t.bytes, cudaMemcpyDeviceToHost, s));
    } else {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(d, h, r.n * t.bytes, cudaMemcpyHostToDevice, s));
    }
  }
}

void CudaModelRunner::swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) {
  use_device();
  if (out.empty() && in.empty()) return;
  if (n_swap_blocks_ == 0) throw Error("CUDA: swap without swap space (allocate_swap_space)");
  const std::vector<SwapTensor> tensors = swap_tensors();
  const std::vector<SwapRun> runs_out = swap_runs(out), runs_in = swap_runs(in);
  // Both streams start after the work already on stream_ (the passes that wrote the blocks
  // copied out, and last read the blocks copied into).
  KESTREL_CUDA_CHECK(cudaEventRecord(swap_after_pass_, stream_));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(swap_stream_, swap_after_pass_, 0));
  if (!in.empty()) {
    collect_h2d_timing();
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(load_stream_, swap_after_pass_, 0));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    copy_runs(tensors[i], runs_out, true, swap_stream_);
    if (in.empty()) continue;
    // Tensors are disjoint device memory: tensor i's copies in wait for its own copies out only.
    if (!out.empty()) {
      KESTREL_CUDA_CHECK(cudaEventRecord(tensor_out_done_[i], swap_stream_));
      KESTREL_CUDA_CHECK(cudaStreamWaitEvent(load_stream_, tensor_out_done_[i], 0));
    }
    // From the first copy in that can start: the figure is the copies' own time, not the wait.
    if (i == 0) KESTREL_CUDA_CHECK(cudaEventRecord(h2d_start_, load_stream_));
    copy_runs(tensors[i], runs_in, false, load_stream_);
  }
  if (!out.empty()) {
    KESTREL_CUDA_CHECK(cudaEventRecord(swap_done_, swap_stream_));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, swap_done_, 0));
  }
  if (!in.empty()) {
    KESTREL_CUDA_CHECK(cudaEventRecord(h2d_stop_, load_stream_));
    h2d_pending_ = true;
    for (const SwapTensor& t : tensors) h2d_.bytes += static_cast<int64_t>(in.size() * t.bytes);
    KESTREL_CUDA_CHECK(cudaEventRecord(load_done_, load_stream_));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, load_done_, 0));
  }
}

void CudaModelRunner::swap_out(std::span<const BlockSwap> swaps) { swap_out_in(swaps, {}); }
void CudaModelRunner::swap_in(std::span<const BlockSwap> swaps) { swap_out_in({}, swaps); }

}  // namespace kestrel::cuda_runner
