// Device memory for the CUDA model runner: owning device and pinned allocations, synchronous
// uploads, and the pipelined weight uploader (bf16 on the device, GGUF types dequantized on the
// way). Internal to src/backend/cuda (includes CUDA headers).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace kestrel::cuda {

// One device allocation, freed with its owner.
class DevMem {
 public:
  DevMem() = default;
  explicit DevMem(size_t bytes) { reset(bytes); }
  ~DevMem() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DevMem(DevMem&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void reset(size_t bytes) {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw Error("CUDA: out of device memory allocating " + std::to_string(bytes >> 20) + " MiB");
    }
    KESTREL_CUDA_CHECK(err);
    bytes_ = bytes;
  }
  // Grows (contents lost) to at least `bytes`.
  void reserve(size_t bytes) {
    if (bytes > bytes_) reset(bytes + bytes / 4);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory, for asynchronous copies.
class PinnedMem {
 public:
  ~PinnedMem() {
    if (p_ != nullptr) cudaFreeHost(p_);
  }
  void reserve(size_t bytes) {
    if (bytes <= bytes_) return;
    if (p_ != nullptr) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = bytes + bytes / 4;
    KESTREL_CUDA_CHECK(cudaMallocHost(&p_, bytes_));
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Streams weights to the device as bf16: worker threads convert rows (a plain copy for bf16
// checkpoints, dequantization through f32 for GGUF types and for a quantized checkpoint's GPTQ /
// AWQ / FP8 matrices, read from WeightView::quant) into one of three pinned staging buffers
// while the copies of the others run, so reading the checkpoint, converting and the PCIe transfer
// overlap. (The first version built each matrix in a pageable std::vector and copied it
// synchronously: 13.8 s for 16 GB with a warm page cache.)
class WeightUploader {
 public:
  explicit WeightUploader(cudaStream_t stream) : stream_(stream), pool_(0) {
    for (Stage& s : stages_) {
      KESTREL_CUDA_CHECK(cudaMallocHost(&s.host, kStageBytes));
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
  }
  ~WeightUploader() {
    cudaStreamSynchronize(stream_);
    for (Stage& s : stages_) {
      if (s.host != nullptr) cudaFreeHost(s.host);
      if (s.done != nullptr) cudaEventDestroy(s.done);
    }
  }
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;

  // The matrices' rows, in order, as one bf16 device allocation [sum n_out, n_in]. Generated
  // matrices (WeightView::random) are computed on the device; their host data is not read.
  // Errors: kestrel::Error if the matrices' n_in differ or CUDA fails.
  DevMem matrices(std::span<const WeightView* const> ws);

 private:
  static constexpr size_t kStageBytes = size_t{64} << 20;
  struct Stage {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  cudaStream_t stream_;
  ThreadPool pool_;
  std::array<Stage, 3> stages_{};
  size_t next_ = 0;
};

// Synchronous uploads of host data (bytes; f32 values as bf16; f32 values as they are).
// Errors: kestrel::Error when out of device memory or CUDA fails.
DevMem upload(const void* host, size_t bytes);
DevMem upload_bf16(const std::vector<float>& v);
DevMem upload_f32(const std::vector<float>& v);

}  // namespace kestrel::cuda
