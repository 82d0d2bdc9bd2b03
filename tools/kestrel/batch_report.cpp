#include "batch_report.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace kestrel::cli {

void BatchSummary::add(const RequestMetrics& metrics, int64_t n_output) {
  n_prompt_tokens += metrics.n_prompt_tokens;
  n_output_tokens += n_output;
  if (n_output > 0) {
    sum_ttft_s += metrics.ttft_s;
    ++n_ttft;
  }
  if (n_output > 1) {
    sum_tpot_s += metrics.tpot_s;
    ++n_tpot;
  }
}

std::string BatchSummary::text() const {
  char buf[512];
  std::string out;
  std::snprintf(buf, sizeof buf,
                "kestrel batch: %lld requests (%lld with errors) in %.3f s: %.2f requests/s, output %.1f tok/s, "
                "prompt %.1f tok/s\n",
                static_cast<long long>(n_requests), static_cast<long long>(n_errors), wall_s,
                per_s(static_cast<double>(n_requests)), per_s(static_cast<double>(n_output_tokens)),
                per_s(static_cast<double>(n_prompt_tokens)));
  out += buf;
  std::snprintf(buf, sizeof buf,
                "kestrel batch: prefix cache hit rate %.1f%%, peak KV blocks %d/%d (KV %s, %.1f MiB), %lld preemptions "
                "(%lld by swap: %lld blocks out, %lld in), mean TTFT %.1f ms, mean TPOT %.2f ms\n",
                100.0 * engine.prefix_cache_hit_rate(), engine.peak_kv_blocks_used, engine.n_kv_blocks,
                std::string(kv_dtype_name(engine.kv_dtype)).c_str(), static_cast<double>(engine.kv_cache_bytes()) / (1 << 20),
                static_cast<long long>(engine.n_preemptions), static_cast<long long>(engine.n_swap_preemptions),
                static_cast<long long>(engine.n_swapped_out_blocks), static_cast<long long>(engine.n_swapped_in_blocks),
                mean_ttft_ms(), mean_tpot_ms());
  out += buf;
  if (engine.n_offload_blocks > 0) {
    std::snprintf(buf, sizeof buf,
                  "kestrel batch: host KV tier: %d blocks, %lld offloaded, %lld brought back for prefix hits\n",
                  engine.n_offload_blocks, static_cast<long long>(engine.n_offloaded_blocks),
                  static_cast<long long>(engine.n_offload_hit_blocks));
    out += buf;
  }
  if (engine.spec_num_drafts > 0) {
    std::snprintf(buf, sizeof buf,
                  "kestrel batch: speculative decoding: %lld draft tokens in %lld drafts, %lld accepted (%.1f%%), "
                  "mean accepted length %.2f, acceptance by position",
                  static_cast<long long>(engine.spec_num_draft_tokens), static_cast<long long>(engine.spec_num_drafts),
                  static_cast<long long>(engine.spec_num_accepted_tokens), 100.0 * engine.spec_acceptance_rate(),
                  engine.spec_mean_accepted_length());
    out += buf;
    for (const int64_t n : engine.spec_accepted_per_pos) {
      std::snprintf(buf, sizeof buf, " %.2f", static_cast<double>(n) / static_cast<double>(engine.spec_num_drafts));
      out += buf;
    }
    out += "\n";
  }
  return out;
}

Json BatchSummary::to_json() const {
  Json j;
  j["requests"] = n_requests;
  j["errors"] = n_errors;
  j["wall_s"] = wall_s;
  j["requests_per_s"] = per_s(static_cast<double>(n_requests));
  j["prompt_tokens"] = n_prompt_tokens;
  j["output_tokens"] = n_output_tokens;
  j["prompt_tokens_per_s"] = per_s(static_cast<double>(n_prompt_tokens));
  j["output_tokens_per_s"] = per_s(static_cast<double>(n_output_tokens));
  j["mean_ttft_ms"] = mean_ttft_ms();
  j["mean_tpot_ms"] = mean_tpot_ms();
  j["prefix_cache_hit_rate"] = engine.prefix_cache_hit_rate();
  j["prefix_cache_hit_tokens"] = engine.prefix_cache_hit_tokens;
  j["prefix_cache_queried_tokens"] = engine.prefix_cache_queried_tokens;
  j["peak_kv_blocks_used"] = engine.peak_kv_blocks_used;
  j["kv_blocks"] = engine.n_kv_blocks;
  j["kv_dtype"] = std::string(kv_dtype_name(engine.kv_dtype));
  j["kv_bytes_per_token"] = engine.kv_bytes_per_token;
  j["kv_cache_bytes"] = engine.kv_cache_bytes();
  j["preemptions"] = engine.n_preemptions;
  j["swap_preemptions"] = engine.n_swap_preemptions;
  j["swapped_out_blocks"] = engine.n_swapped_out_blocks;
  j["swapped_in_blocks"] = engine.n_swapped_in_blocks;
  j["swap_blocks"] = engine.n_swap_blocks;
  j["offloaded_blocks"] = engine.n_offloaded_blocks;
  j["offload_hit_blocks"] = engine.n_offload_hit_blocks;
  j["offload_blocks"] = engine.n_offload_blocks;
  j["host_to_device_bytes"] = engine.host_to_device_bytes;
  j["host_to_device_seconds"] = engine.host_to_device_seconds;
  j["steps"] = engine.n_steps;
  // Host time between a pass's results and the next launch, the device idle (EngineStats::host_seconds).
  j["host_seconds"] = engine.host_seconds;
  j["host_gaps"] = engine.n_host_gaps;
  j["mask_fill_seconds"] = engine.mask_fill_seconds;
  j["mask_wait_seconds"] = engine.mask_wait_seconds;
  j["pipelined_passes"] = engine.n_pipelined_passes;  // passes submitted while another was in flight
  j["prefill_tokens_computed"] = engine.n_prompt_tokens_computed;  // recomputation after preemption included
  j["spec_decode_num_drafts"] = engine.spec_num_drafts;
  j["spec_decode_num_draft_tokens"] = engine.spec_num_draft_tokens;
  j["spec_decode_num_accepted_tokens"] = engine.spec_num_accepted_tokens;
  j["spec_decode_num_accepted_tokens_per_pos"] = engine.spec_accepted_per_pos;
  j["spec_decode_acceptance_rate"] = engine.spec_acceptance_rate();
  j["spec_decode_mean_accepted_length"] = engine.spec_mean_accepted_length();
  return j;
}

BatchProgress::BatchProgress(int64_t n_total, bool enabled)
    : n_total_(n_total),
      enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void BatchProgress::update(int64_t n_done, int64_t n_generated) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const auto every = tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(5000);
  if (now - last_draw_ < every) return;
  last_draw_ = now;
  draw(n_done, n_generated, std::chrono::duration<double>(now - start_).count());
}

void BatchProgress::finish(int64_t n_done, int64_t n_generated) {
  if (!enabled_ || !tty_) return;  // without a terminal the summary says it all
  draw(n_done, n_generated, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  std::fputc('\n', stderr);
}

void BatchProgress::draw(int64_t n_done, int64_t n_generated, double elapsed_s) {
  const double tok_s = elapsed_s > 0 ? static_cast<double>(n_generated) / elapsed_s : 0;
  if (!tty_) {
    std::fprintf(stderr, "kestrel batch: %lld/%lld requests done, %.1f output tok/s\n",
                 static_cast<long long>(n_done), static_cast<long long>(n_total_), tok_s);
    return;
  }
  constexpr int kWidth = 30;
  const int filled = n_total_ > 0 ? static_cast<int>(kWidth * n_done / n_total_) : kWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  // \r redraws in place; \033[K clears what a longer earlier line left behind.
  std::fprintf(stderr, "\r\033[K[%s] %lld/%lld requests, %.1f tok/s", bar.c_str(), static_cast<long long>(n_done),
               static_cast<long long>(n_total_), tok_s);
  std::fflush(stderr);
}

}  // namespace kestrel::cli
