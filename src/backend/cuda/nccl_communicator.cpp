#include "backend/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "core/error.h"

namespace kestrel::cuda {

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(CommDtype t) { return t == CommDtype::F32 ? ncclFloat32 : ncclBfloat16; }

class Nccl final : public NcclCommunicator {
 public:
  Nccl(ncclComm_t comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~Nccl() override { ncclCommDestroy(comm_); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  void all_reduce_sum(void* data, int64_t n, CommDtype dtype) override {
    nccl_check(ncclAllReduce(data, data, static_cast<size_t>(n), nccl_type(dtype), ncclSum, comm_, stream_),
               "all-reduce");
  }
  void all_gather(const float* in, int64_t n, float* out) override {
    nccl_check(ncclAllGather(in, out, static_cast<size_t>(n), ncclFloat32, comm_, stream_), "all-gather");
  }

 private:
  ncclComm_t comm_;
  int rank_, size_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(int size) {
  int n_devices = 0;
  if (cudaGetDeviceCount(&n_devices) != cudaSuccess) n_devices = 0;
  if (size < 1 || size > n_devices)
    throw Error("tensor parallelism over " + std::to_string(size) + " ranks needs " + std::to_string(size) +
                " GPUs; " + std::to_string(n_devices) + " visible");
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "unique id");
  std::vector<ncclComm_t> comms(static_cast<size_t>(size));
  nccl_check(ncclGroupStart(), "group start");
  for (int r = 0; r < size; ++r) {
    if (cudaSetDevice(r) != cudaSuccess) throw Error("cudaSetDevice(" + std::to_string(r) + ") failed");
    nccl_check(ncclCommInitRank(&comms[static_cast<size_t>(r)], size, id, r), "init rank");
  }
  nccl_check(ncclGroupEnd(), "group end");
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<Nccl>(comms[static_cast<size_t>(r)], r, size));
  return out;
}

}  // namespace kestrel::cuda
