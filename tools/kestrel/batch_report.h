// What `kestrel batch` tells the user on stderr: a progress bar while it runs, a summary at the end
// (also as JSON for --stats-json).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "batch_request.h"
#include "engine/engine.h"

namespace kestrel::cli {

// Totals over the run; the engine's own counters are copied in at the end.
struct BatchSummary {
  int64_t n_requests = 0;   // non-blank input lines
  int64_t n_errors = 0;     // of those, lines answered with an error
  int64_t n_prompt_tokens = 0;
  int64_t n_output_tokens = 0;
  double wall_s = 0;        // from the first request's submission to the last result
  double sum_ttft_s = 0;
  int64_t n_ttft = 0;       // requests with a first token
  double sum_tpot_s = 0;
  int64_t n_tpot = 0;       // requests with two tokens or more (TPOT is defined)
  EngineStats engine;

  // Adds a finished request.
  void add(const RequestMetrics& metrics, int64_t n_output);
  double mean_ttft_ms() const { return n_ttft > 0 ? 1e3 * sum_ttft_s / static_cast<double>(n_ttft) : 0; }
  double mean_tpot_ms() const { return n_tpot > 0 ? 1e3 * sum_tpot_s / static_cast<double>(n_tpot) : 0; }
  // Per second of wall time; 0 for an empty run.
  double per_s(double count) const { return wall_s > 0 ? count / wall_s : 0; }

  // Two lines, each starting "kestrel batch: ", each ending with "\n".
  std::string text() const;
  Json to_json() const;
};

// On a terminal: one line redrawn in place, at most ten times a second. Otherwise: a line every
// few seconds (logs stay short). Both print nothing when disabled.
class BatchProgress {
 public:
  BatchProgress(int64_t n_total, bool enabled);
  // n_done: requests with a result (errors included); n_generated: output tokens so far.
  void update(int64_t n_done, int64_t n_generated);
  // Ends the redrawn line so the summary starts on its own.
  void finish(int64_t n_done, int64_t n_generated);

 private:
  void draw(int64_t n_done, int64_t n_generated, double elapsed_s);

  int64_t n_total_;
  bool enabled_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace kestrel::cli
