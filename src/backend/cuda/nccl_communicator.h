// Communicator over NCCL for tensor parallelism on the GPUs of one host, one rank per GPU, the
// ranks threads of this process. The kestrel_nccl library, built when CMake finds NCCL; no runner
// drives it yet (the CPU backend's ranks use the in-process communicator, backend/communicator.h).
// Buffers are device pointers on the rank's GPU; each collective is enqueued on the rank's stream
// (set_stream) and ordered with the work around it there, so it can be captured in a CUDA graph.
// NVLink multicast (NVLS) is left to the launch environment: the device scripts export
// NCCL_NVLS_ENABLE=0.
#pragma once

#include <memory>
#include <vector>

#include "backend/communicator.h"

namespace kestrel::cuda {

class NcclCommunicator : public Communicator {
 public:
  // The stream (a cudaStream_t) later collectives are enqueued on; the default stream until set.
  virtual void set_stream(void* stream) = 0;
};

// One communicator per GPU 0..size-1 (ncclGetUniqueId once, then ncclCommInitRank for every rank
// inside one ncclGroupStart/End from this thread), rank r on device r. Errors: kestrel::Error
// naming the NCCL or CUDA error, or "needs N GPUs" when fewer devices are visible.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(int size);

}  // namespace kestrel::cuda
