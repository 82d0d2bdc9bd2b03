// In-process collectives: every rank publishes its buffer, the ranks wait at a barrier, each rank
// reduces its own contiguous chunk of the elements over all ranks' buffers into shared scratch
// (in rank order), and after a second barrier copies the whole sum back into its buffer; a third
// barrier keeps the buffers and the scratch alive until every rank has read them. abort() wakes
// every rank waiting at the barrier with an error.
#include "backend/communicator.h"
#include "backend/rank_threads.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace kestrel {

namespace {

struct InProcessGroup {
  explicit InProcessGroup(int n) : size(n), barrier(n), ptrs(static_cast<size_t>(n), nullptr) {}
  int size;
  AbortableBarrier barrier;
  std::vector<const void*> ptrs;  // each rank's buffer of the collective in progress
  std::vector<float> sum;         // the reduced elements
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  void all_reduce_sum(void* data, int64_t n, CommDtype dtype) override {
    if (g_->size == 1) return;
    InProcessGroup& g = *g_;
    // Rank 0 sizes the scratch before the first barrier: no rank touches it until after that barrier.
    if (rank_ == 0 && static_cast<int64_t>(g.sum.size()) < n) g.sum.resize(static_cast<size_t>(n));
    g.ptrs[static_cast<size_t>(rank_)] = data;
    g.barrier.arrive_and_wait();
    const int64_t i0 = n * rank_ / g.size, i1 = n * (rank_ + 1) / g.size;
    for (int r = 0; r < g.size; ++r) {
      float* s = g.sum.data();
      if (dtype == CommDtype::F32) {
        const float* p = static_cast<const float*>(g.ptrs[static_cast<size_t>(r)]);
        if (r == 0) std::copy(p + i0, p + i1, s + i0);
        else for (int64_t i = i0; i < i1; ++i) s[i] += p[i];
      } else {
        const uint16_t* p = static_cast<const uint16_t*>(g.ptrs[static_cast<size_t>(r)]);
        for (int64_t i = i0; i < i1; ++i) s[i] = (r == 0 ? 0.0f : s[i]) + bf16_to_fp32(p[i]);
      }
    }
    g.barrier.arrive_and_wait();
    if (dtype == CommDtype::F32) {
      std::memcpy(data, g.sum.data(), sizeof(float) * static_cast<size_t>(n));
    } else {
      uint16_t* out = static_cast<uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) out[i] = fp32_to_bf16(g.sum[static_cast<size_t>(i)]);
    }
    g.barrier.arrive_and_wait();
  }

  void all_gather(const float* in, int64_t n, float* out) override {
    InProcessGroup& g = *g_;
    g.ptrs[static_cast<size_t>(rank_)] = in;
    g.barrier.arrive_and_wait();
    for (int r = 0; r < g.size; ++r)
      std::memcpy(out + r * n, g.ptrs[static_cast<size_t>(r)], sizeof(float) * static_cast<size_t>(n));
    g.barrier.arrive_and_wait();
  }

  void host_barrier() override { g_->barrier.arrive_and_wait(); }
  void abort() override { g_->barrier.abort(); }

 private:
  std::shared_ptr<InProcessGroup> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_communicators(int size) {
  if (size < 1) throw Error("a communicator group needs at least one rank, got " + std::to_string(size));
  auto g = std::make_shared<InProcessGroup>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<InProcessCommunicator>(g, r));
  return out;
}

}  // namespace kestrel
