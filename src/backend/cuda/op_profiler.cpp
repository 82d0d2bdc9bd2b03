#include "backend/cuda/op_profiler.h"

#include <algorithm>
#include <cstdio>

#include "backend/cuda/cuda_check.h"

namespace kestrel::cuda {

void OpProfiler::begin(const char* pass) {
  pass_ = pass;
  used_ = 0;
  names_.clear();
  mark(nullptr);
}

void OpProfiler::mark(const char* name) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(events_[used_], stream_));
  if (used_ > 0) names_.push_back(pass_ + " " + name);
  ++used_;
}

void OpProfiler::collect() {
  if (used_ < 2) return;
  for (size_t i = 0; i + 1 < used_; ++i) {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    Total& t = totals_[names_[i]];
    t.ms += ms;
    ++t.calls;
  }
  ++passes_;
  used_ = 0;
}

OpProfiler::~OpProfiler() {
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  if (totals_.empty()) return;
  std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double sum = 0;
  for (const auto& r : rows) sum += r.second.ms;
  std::fprintf(stderr, "op profile: %ld forward passes, %.3f ms of GPU time between the first and last op\n",
               passes_, sum);
  std::fprintf(stderr, "  %-30s %10s %7s %9s %10s\n", "op", "ms", "share", "calls", "us/call");
  for (const auto& [name, t] : rows)
    std::fprintf(stderr, "  %-30s %10.3f %6.1f%% %9ld %10.2f\n", name.c_str(), t.ms, 100.0 * t.ms / sum, t.calls,
                 1e3 * t.ms / static_cast<double>(t.calls));
}

}  // namespace kestrel::cuda
