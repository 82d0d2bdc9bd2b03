// The server's Prometheus metrics (text exposition format 0.0.4, names prefixed kestrel_): HTTP
// requests by status, prompt and generation tokens, prompt tokens scored for echo with logprobs,
// TTFT / TPOT / end-to-end latency histograms, and the engine's gauges (running and waiting
// requests, KV blocks, prefix-cache hit rate, preemptions, tokens per MoE expert) read from the
// engine thread's snapshot.
// Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/engine_loop.h"

namespace kestrel::cli {

// A cumulative histogram: bucket i counts observations <= bounds[i]; +Inf is the total count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double x);
  // "<name>_bucket{le=...} n" lines, then _sum and _count.
  void render(const std::string& name, std::string* out) const;

 private:
  std::vector<double> bounds_;   // ascending, seconds
  std::vector<int64_t> counts_;  // [bounds_.size()], not cumulative
  int64_t count_ = 0;
  double sum_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  // One HTTP response (any route), by status code.
  void on_response(int status);
  // One finished engine request (a choice): its tokens and, when it produced any, its latencies.
  void on_finished(const RequestOutput& output);
  // Prompt positions whose logprobs the engine computed for echo with logprobs (a prompt of P
  // tokens: P - 1, once per prompt whatever n is).
  void on_prompt_logprobs(int64_t n);
  // A consumer's pull of a producer's K/V (disaggregated prefill): by CUDA IPC (the handles and
  // block ids) or through host memory (the bytes), and the seconds the HTTP exchange took (with
  // the handles' mapping for CUDA IPC).
  void on_kv_pull(bool cuda_ipc, double seconds);
  // The whole exposition, with the engine's gauges from `snapshot`.
  std::string render(const EngineSnapshot& snapshot) const;

 private:
  mutable std::mutex mutex_;
  std::map<int, int64_t> responses_;               // status -> count
  std::map<std::string, int64_t> finish_reasons_;  // "stop", "length", "abort", "error" -> count
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  int64_t prompt_logprob_tokens_ = 0;
  std::array<int64_t, 2> kv_pulls_{};       // [host, cuda_ipc]
  std::array<double, 2> kv_pull_seconds_{};
  Histogram ttft_, tpot_, e2e_;
};

}  // namespace kestrel::cli
