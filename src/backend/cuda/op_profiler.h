// Per-op GPU time of the CUDA runner's forward passes, for finding where a step's time goes on a
// device without nsys: CUDA events recorded on the stream between ops (--cuda-profile-ops;
// decode steps then run eagerly, not from graphs). Each mark(name) attributes the GPU time since
// the previous mark to `name`; collect() reads the pass's events after the stream has been
// synchronised; the destructor prints the totals per op to stderr: milliseconds, share of the
// total, calls and microseconds per call. Launch gaps count towards the op that follows them.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <string>
#include <vector>

namespace kestrel::cuda {

class OpProfiler {
 public:
  explicit OpProfiler(cudaStream_t stream) : stream_(stream) {}
  ~OpProfiler();
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

  void begin(const char* pass);   // the start of a forward pass; `pass` prefixes its op names
  void mark(const char* name);    // the op just enqueued ends here
  void collect();                 // after the stream is synchronised: adds this pass's times

 private:
  struct Total {
    double ms = 0;
    long calls = 0;
  };
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;  // reused across passes
  std::vector<std::string> names_;   // names_[i]: the op ending at events_[i + 1]
  std::string pass_;
  size_t used_ = 0;
  std::map<std::string, Total> totals_;
  long passes_ = 0;
};

}  // namespace kestrel::cuda
