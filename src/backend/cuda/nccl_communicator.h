// Communicator over NCCL for tensor parallelism on the GPUs of one host, one rank per GPU, the
// ranks threads of this process (cuda_tensor_parallel.cpp). Buffers are device pointers on the
// rank's GPU; each collective is enqueued on the rank's stream (set_stream) and ordered with the
// work around it there, so it can be captured in a CUDA graph. NCCL is loaded with dlopen on first
// use (libnccl.so.2, then the toolkit's copy found at build time), so the binary runs without it
// until tensor parallelism is asked for on GPUs. NVLink multicast (NVLS) is left to the launch
// environment: the device scripts export NCCL_NVLS_ENABLE=0.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "backend/communicator.h"

namespace kestrel::cuda {

class NcclCommunicator : public Communicator {
 public:
  // The stream (a cudaStream_t) later collectives are enqueued on; the default stream until set.
  virtual void set_stream(void* stream) = 0;
};

// One communicator per device of `devices` (distinct CUDA device ids; rank r on devices[r]):
// ncclGetUniqueId once, then ncclCommInitRank for every rank inside one ncclGroupStart/End from
// this thread. Errors: kestrel::Error when NCCL cannot be loaded, naming the NCCL or CUDA error,
// or when a device repeats or is not visible.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(std::span<const int> devices);

}  // namespace kestrel::cuda
