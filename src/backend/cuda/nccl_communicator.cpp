#include "backend/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <set>
#include <string>
#include <type_traits>

#include "backend/rank_threads.h"
#include "core/error.h"

namespace kestrel::cuda {

namespace {

// The NCCL entry points used here, resolved from the library at first use.
struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommFinalize) CommFinalize;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclAllGather) AllGather;
  decltype(&ncclGetErrorString) GetErrorString;
};

NcclApi load() {
  const std::string soname = "libnccl.so." + std::to_string(NCCL_MAJOR);
  std::string tried = soname;
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? dlerror() : "";
#if defined(KESTREL_NCCL_LIBRARY_PATH)
  if (lib == nullptr) {
    tried += ", " + std::string(KESTREL_NCCL_LIBRARY_PATH);
    lib = dlopen(KESTREL_NCCL_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) why += std::string("; ") + dlerror();
  }
#endif
  if (lib == nullptr)
    throw Error("NCCL: cannot load the library (tried " + tried + "): " + why +
                ". Tensor parallelism on GPUs needs NCCL " + std::to_string(NCCL_MAJOR) +
                ": install it or put the folder holding " + soname + " on LD_LIBRARY_PATH");
  auto sym = [&](auto& fn, const char* name) {
    void* p = dlsym(lib, name);
    if (p == nullptr) throw Error("NCCL: " + soname + " has no symbol " + name);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  NcclApi a{};
  sym(a.GetUniqueId, "ncclGetUniqueId");
  sym(a.CommInitRank, "ncclCommInitRank");
  sym(a.CommDestroy, "ncclCommDestroy");
  sym(a.CommAbort, "ncclCommAbort");
  sym(a.CommFinalize, "ncclCommFinalize");
  sym(a.GroupStart, "ncclGroupStart");
  sym(a.GroupEnd, "ncclGroupEnd");
  sym(a.AllReduce, "ncclAllReduce");
  sym(a.AllGather, "ncclAllGather");
  sym(a.GetErrorString, "ncclGetErrorString");
  return a;  // the library stays open for the life of the process
}

const NcclApi& nccl() {
  static const NcclApi api = load();
  return api;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(std::string("NCCL ") + what + ": " + nccl().GetErrorString(r));
}

ncclDataType_t nccl_type(CommDtype t) { return t == CommDtype::F32 ? ncclFloat32 : ncclBfloat16; }

// The communicators of one group and their host barrier. abort() only marks the group (later
// collectives throw) and breaks the barrier: ncclCommAbort waits for the CUDA graphs that captured
// the communicator's work, which the ranks' runners still hold, so the communicators are aborted
// (or, unaborted, finalized) together when the group goes, after the runners.
struct NcclGroup {
  explicit NcclGroup(std::vector<ncclComm_t> c) : comms(std::move(c)), barrier(static_cast<int>(comms.size())) {}
  ~NcclGroup() {
    // One thread ending several ranks' communicators: in one group call (NCCL's rule for a thread
    // that drives several ranks), finalize before destroy.
    const NcclApi& api = nccl();
    api.GroupStart();
    for (ncclComm_t c : comms) aborted ? api.CommAbort(c) : api.CommFinalize(c);
    api.GroupEnd();
    if (!aborted)
      for (ncclComm_t c : comms) api.CommDestroy(c);
  }
  std::vector<ncclComm_t> comms;
  AbortableBarrier barrier;
  std::atomic<bool> aborted{false};
};

class Nccl final : public NcclCommunicator {
 public:
  Nccl(std::shared_ptr<NcclGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(g_->comms.size()); }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  void all_reduce_sum(void* data, int64_t n, CommDtype dtype) override {
    check_open();
    nccl_check(nccl().AllReduce(data, data, static_cast<size_t>(n), nccl_type(dtype), ncclSum, comm(), stream_),
               "all-reduce");
  }
  void all_gather(const float* in, int64_t n, float* out) override {
    check_open();
    nccl_check(nccl().AllGather(in, out, static_cast<size_t>(n), ncclFloat32, comm(), stream_), "all-gather");
  }
  void host_barrier() override { g_->barrier.arrive_and_wait(); }
  void abort() override {
    g_->aborted = true;
    g_->barrier.abort();
  }

 private:
  ncclComm_t comm() const { return g_->comms[static_cast<size_t>(rank_)]; }
  void check_open() const {
    if (g_->aborted) throw Error("tensor parallel: the NCCL group was aborted after a rank failed");
  }
  std::shared_ptr<NcclGroup> g_;
  int rank_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(std::span<const int> devices) {
  const int size = static_cast<int>(devices.size());
  int n_devices = 0;
  if (cudaGetDeviceCount(&n_devices) != cudaSuccess) n_devices = 0;
  if (size < 1) throw Error("NCCL: a communicator needs at least one rank");
  std::set<int> seen;
  for (int d : devices) {
    if (d < 0 || d >= n_devices)
      throw Error("NCCL: device " + std::to_string(d) + " is not visible (" + std::to_string(n_devices) + " visible)");
    if (!seen.insert(d).second)
      throw Error("NCCL: device " + std::to_string(d) + " holds two ranks (NCCL takes one rank per GPU)");
  }
  const NcclApi& api = nccl();
  ncclUniqueId id;
  nccl_check(api.GetUniqueId(&id), "unique id");
  std::vector<ncclComm_t> comms(static_cast<size_t>(size), nullptr);
  // The group call is closed and the communicators made so far aborted on any failure.
  std::string failed;
  ncclResult_t r0 = api.GroupStart();
  if (r0 != ncclSuccess) failed = std::string("group start: ") + api.GetErrorString(r0);
  for (int r = 0; r < size && failed.empty(); ++r) {
    if (cudaSetDevice(devices[static_cast<size_t>(r)]) != cudaSuccess) {
      failed = "cudaSetDevice(" + std::to_string(devices[static_cast<size_t>(r)]) + ") failed";
      break;
    }
    const ncclResult_t res = api.CommInitRank(&comms[static_cast<size_t>(r)], size, id, r);
    if (res != ncclSuccess) failed = std::string("init rank: ") + api.GetErrorString(res);
  }
  if (r0 == ncclSuccess) {
    const ncclResult_t end = api.GroupEnd();
    if (end != ncclSuccess && failed.empty()) failed = std::string("group end: ") + api.GetErrorString(end);
  }
  if (!failed.empty()) {
    for (ncclComm_t c : comms)
      if (c != nullptr) api.CommAbort(c);
    throw Error("NCCL " + failed);
  }
  auto group = std::make_shared<NcclGroup>(std::move(comms));
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<Nccl>(group, r));
  return out;
}

}  // namespace kestrel::cuda
