#include "server/server_metrics.h"

#include <cstdint>
#include <cstdio>
#include <string>

#include "memory/kv_dtype.h"

namespace kestrel::cli {

namespace {
// Prometheus floats: shortest round-trip form is not needed; 9 significant digits are plenty.
std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

void header(std::string* out, const char* name, const char* type, const char* help) {
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string* out, const std::string& name, double value) { *out += name + " " + num(value) + "\n"; }
// Exact integers (byte counts pass 9 significant digits).
void sample_int(std::string* out, const std::string& name, int64_t value) {
  *out += name + " " + std::to_string(value) + "\n";
}

// Speculative decoding's counters under vLLM's names (vllm:spec_decode_num_drafts, ...
// num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos) with kestrel's prefix; the
// per-position one only when speculation is on. Acceptance rate = accepted / draft tokens; mean
// accepted length = 1 + accepted / drafts.
void render_spec_decode(const EngineStats& s, std::string* out) {
  header(out, "kestrel_spec_decode_num_drafts_total", "counter",
         "Speculative decoding: drafts verified (one per sequence and step with draft tokens).");
  sample(out, "kestrel_spec_decode_num_drafts_total", static_cast<double>(s.spec_num_drafts));
  header(out, "kestrel_spec_decode_num_draft_tokens_total", "counter", "Speculative decoding: draft tokens proposed and verified.");
  sample(out, "kestrel_spec_decode_num_draft_tokens_total", static_cast<double>(s.spec_num_draft_tokens));
  header(out, "kestrel_spec_decode_num_accepted_tokens_total", "counter", "Speculative decoding: draft tokens accepted.");
  sample(out, "kestrel_spec_decode_num_accepted_tokens_total", static_cast<double>(s.spec_num_accepted_tokens));
  if (s.spec_accepted_per_pos.empty()) return;
  header(out, "kestrel_spec_decode_num_accepted_tokens_per_pos_total", "counter",
         "Speculative decoding: draft tokens accepted at each draft position (0 = first).");
  for (size_t i = 0; i < s.spec_accepted_per_pos.size(); ++i)
    *out += "kestrel_spec_decode_num_accepted_tokens_per_pos_total{position=\"" + std::to_string(i) + "\"} " +
            std::to_string(s.spec_accepted_per_pos[i]) + "\n";
}

// One counter per (MoE layer, expert); nothing for a dense model or a backend that does not count
// (expert_tokens empty). Dense layers of a MoE model (DeepSeek's first layers) have no experts.
void render_expert_tokens(const EngineStats& st, std::string* out) {
  const auto n_expert = static_cast<size_t>(st.moe_n_expert);
  if (st.moe_layers.empty() || n_expert == 0 || st.expert_tokens.empty()) return;
  header(out, "kestrel_moe_expert_tokens_total", "counter",
         "Tokens routed to each expert of each mixture-of-experts layer (a token counts once per expert it selects).");
  for (const int32_t layer : st.moe_layers) {
    const size_t row = static_cast<size_t>(layer) * n_expert;
    if (row + n_expert > st.expert_tokens.size()) break;
    for (size_t e = 0; e < n_expert; ++e)
      *out += "kestrel_moe_expert_tokens_total{layer=\"" + std::to_string(layer) + "\",expert=\"" + std::to_string(e) +
              "\"} " + std::to_string(st.expert_tokens[row + e]) + "\n";
  }
}
}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}

void Histogram::observe(double x) {
  ++count_;
  sum_ += x;
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (x <= bounds_[i]) {
      ++counts_[i];
      return;
    }
}

void Histogram::render(const std::string& name, std::string* out) const {
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    *out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  *out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  sample(out, name + "_sum", sum_);
  *out += name + "_count " + std::to_string(count_) + "\n";
}

// Bucket bounds in seconds: TTFT from a cached prefix on a GPU (ms) to a long queue on a CPU
// (minutes); TPOT from a fast GPU decode to a crowded CPU batch.
ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640}),
      tpot_({0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20}),
      e2e_({0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920}) {}

void ServerMetrics::on_response(int status) {
  std::lock_guard lock(mutex_);
  ++responses_[status];
}

void ServerMetrics::on_finished(const RequestOutput& o) {
  const RequestMetrics& m = o.metrics;
  std::lock_guard lock(mutex_);
  ++finish_reasons_[o.finish_reason];
  prompt_tokens_ += m.n_prompt_tokens;
  generation_tokens_ += m.n_output_tokens;
  if (m.n_output_tokens > 0) ttft_.observe(m.ttft_s);
  if (m.n_output_tokens > 1) tpot_.observe(m.tpot_s);
  if (o.finish_reason == "stop" || o.finish_reason == "length") e2e_.observe(m.e2e_s);
}

void ServerMetrics::on_prompt_logprobs(int64_t n) {
  std::lock_guard lock(mutex_);
  prompt_logprob_tokens_ += n;
}

void ServerMetrics::on_kv_pull(bool cuda_ipc, double seconds) {
  std::lock_guard lock(mutex_);
  kv_pulls_[cuda_ipc ? 1 : 0] += 1;
  kv_pull_seconds_[cuda_ipc ? 1 : 0] += seconds;
}

std::string ServerMetrics::render(const EngineSnapshot& snap) const {
  std::string out;
  std::lock_guard lock(mutex_);
  header(&out, "kestrel_requests_total", "counter", "HTTP requests answered, by status code.");
  for (const auto& [status, n] : responses_)
    out += "kestrel_requests_total{status=\"" + std::to_string(status) + "\"} " + std::to_string(n) + "\n";
  header(&out, "kestrel_request_finished_total", "counter",
         "Engine requests (one per choice) finished, by finish reason.");
  for (const auto& [reason, n] : finish_reasons_)
    out += "kestrel_request_finished_total{finish_reason=\"" + reason + "\"} " + std::to_string(n) + "\n";
  header(&out, "kestrel_prompt_tokens_total", "counter", "Prompt tokens of finished requests (requested).");
  sample(&out, "kestrel_prompt_tokens_total", static_cast<double>(prompt_tokens_));
  header(&out, "kestrel_prompt_tokens_computed_total", "counter",
         "Prompt tokens run through the model: prefix-cache hits and prompts shared between choices are not, "
         "recomputation after preemption is.");
  sample(&out, "kestrel_prompt_tokens_computed_total", static_cast<double>(snap.stats.n_prompt_tokens_computed));
  header(&out, "kestrel_generation_tokens_total", "counter", "Tokens generated by finished requests.");
  sample(&out, "kestrel_generation_tokens_total", static_cast<double>(generation_tokens_));
  header(&out, "kestrel_prompt_logprob_tokens_total", "counter",
         "Prompt tokens whose logprobs were computed (echo with logprobs), once per prompt.");
  sample(&out, "kestrel_prompt_logprob_tokens_total", static_cast<double>(prompt_logprob_tokens_));
  header(&out, "kestrel_time_to_first_token_seconds", "histogram", "Seconds from arrival to the first token.");
  ttft_.render("kestrel_time_to_first_token_seconds", &out);
  header(&out, "kestrel_time_per_output_token_seconds", "histogram",
         "Mean seconds per output token after the first, per request.");
  tpot_.render("kestrel_time_per_output_token_seconds", &out);
  header(&out, "kestrel_e2e_request_latency_seconds", "histogram",
         "Seconds from arrival to the end of requests that finished with stop or length.");
  e2e_.render("kestrel_e2e_request_latency_seconds", &out);
  header(&out, "kestrel_num_requests_running", "gauge", "Sequences the scheduler is running.");
  sample(&out, "kestrel_num_requests_running", static_cast<double>(snap.n_running));
  header(&out, "kestrel_num_requests_waiting", "gauge", "Sequences waiting to be admitted.");
  sample(&out, "kestrel_num_requests_waiting", static_cast<double>(snap.n_waiting));
  header(&out, "kestrel_kv_blocks_used", "gauge", "KV cache blocks held by sequences.");
  sample(&out, "kestrel_kv_blocks_used", snap.stats.kv_blocks_used);
  header(&out, "kestrel_kv_transfer_held_requests", "gauge",
         "Finished prefills (do_remote_decode) whose K/V blocks wait for a consumer's pull.");
  sample(&out, "kestrel_kv_transfer_held_requests", static_cast<int64_t>(snap.n_held_kv));
  // Per transport: 0 = host (bytes in the pull's answer), 1 = cuda_ipc (device to device).
  const auto by_transport = [&](const std::string& name, auto value) {
    for (size_t t = 0; t < 2; ++t)
      out += name + "{kv_transport=\"" + (t == 1 ? "cuda_ipc" : "host") + "\"} " + value(t) + "\n";
  };
  header(&out, "kestrel_kv_transfer_pulls_total", "counter", "K/V pulls from a producer (consumer side).");
  by_transport("kestrel_kv_transfer_pulls_total", [&](size_t t) { return std::to_string(kv_pulls_[t]); });
  header(&out, "kestrel_kv_transfer_pull_seconds_total", "counter",
         "Seconds of the pulls' HTTP exchanges (CUDA IPC: with mapping the producer's handles).");
  by_transport("kestrel_kv_transfer_pull_seconds_total", [&](size_t t) { return num(kv_pull_seconds_[t]); });
  header(&out, "kestrel_kv_transfer_imports_total", "counter",
         "Pulled K/V written into this engine's blocks at admission.");
  by_transport("kestrel_kv_transfer_imports_total", [&](size_t t) { return std::to_string(snap.stats.kv_imports[t]); });
  header(&out, "kestrel_kv_transfer_import_bytes_total", "counter", "Bytes of K/V those writes moved.");
  by_transport("kestrel_kv_transfer_import_bytes_total",
               [&](size_t t) { return std::to_string(snap.stats.kv_import_bytes[t]); });
  header(&out, "kestrel_kv_transfer_import_seconds_total", "counter",
         "Seconds those writes took (host: host to device copies; cuda_ipc: device to device), waited for.");
  by_transport("kestrel_kv_transfer_import_seconds_total", [&](size_t t) { return num(snap.stats.kv_import_seconds[t]); });
  header(&out, "kestrel_kv_blocks_total", "gauge", "KV cache blocks in the pool.");
  sample(&out, "kestrel_kv_blocks_total", snap.stats.n_kv_blocks);
  header(&out, "kestrel_kv_cache_bytes_total", "gauge",
         "Bytes of the KV pool: blocks x block size x bytes per token (int8: codes and per-row scales).");
  sample_int(&out, "kestrel_kv_cache_bytes_total", snap.stats.kv_cache_bytes());
  header(&out, "kestrel_kv_cache_bytes_used", "gauge", "Bytes of the KV blocks held by sequences.");
  sample_int(&out, "kestrel_kv_cache_bytes_used",
             int64_t{snap.stats.kv_blocks_used} * snap.stats.kv_block_size * snap.stats.kv_bytes_per_token);
  header(&out, "kestrel_kv_bytes_per_token", "gauge", "KV cache bytes one token takes over all layers.");
  sample_int(&out, "kestrel_kv_bytes_per_token", snap.stats.kv_bytes_per_token);
  header(&out, "kestrel_kv_cache_info", "gauge", "The KV cache's element type (label dtype); always 1.");
  out += "kestrel_kv_cache_info{dtype=\"" + std::string(kv_dtype_name(snap.stats.kv_dtype)) + "\"} 1\n";
  header(&out, "kestrel_kv_blocks_cached", "gauge", "KV cache blocks indexed in the prefix cache.");
  sample(&out, "kestrel_kv_blocks_cached", snap.stats.kv_blocks_cached);
  header(&out, "kestrel_prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / tokens looked up.");
  sample(&out, "kestrel_prefix_cache_hit_rate", snap.stats.prefix_cache_hit_rate());
  header(&out, "kestrel_preemptions_total", "counter",
         "Sequences preempted for lack of KV blocks (recomputed, or swapped to host memory).");
  sample(&out, "kestrel_preemptions_total", static_cast<double>(snap.stats.n_preemptions));
  header(&out, "kestrel_swap_preemptions_total", "counter", "Of those, preempted by swap to host memory (--swap-space).");
  sample(&out, "kestrel_swap_preemptions_total", static_cast<double>(snap.stats.n_swap_preemptions));
  header(&out, "kestrel_kv_blocks_swapped_out_total", "counter", "KV blocks copied to the host swap space.");
  sample(&out, "kestrel_kv_blocks_swapped_out_total", static_cast<double>(snap.stats.n_swapped_out_blocks));
  header(&out, "kestrel_kv_blocks_swapped_in_total", "counter", "KV blocks copied back from the host swap space.");
  sample(&out, "kestrel_kv_blocks_swapped_in_total", static_cast<double>(snap.stats.n_swapped_in_blocks));
  header(&out, "kestrel_swap_blocks", "gauge", "Blocks of the host swap space (--swap-space).");
  sample(&out, "kestrel_swap_blocks", snap.stats.n_swap_blocks);
  header(&out, "kestrel_swap_blocks_free", "gauge", "Of those, free.");
  sample(&out, "kestrel_swap_blocks_free", snap.stats.swap_blocks_free);
  header(&out, "kestrel_kv_blocks_offloaded_total", "counter",
         "Cached KV blocks evicted from the device pool and copied to the host tier (--cpu-offload-kv-gb).");
  sample(&out, "kestrel_kv_blocks_offloaded_total", static_cast<double>(snap.stats.n_offloaded_blocks));
  header(&out, "kestrel_kv_offload_hits_total", "counter",
         "KV blocks of prefix-cache hits copied back from the host tier instead of recomputed.");
  sample(&out, "kestrel_kv_offload_hits_total", static_cast<double>(snap.stats.n_offload_hit_blocks));
  header(&out, "kestrel_kv_offload_blocks", "gauge", "Blocks of the host tier (--cpu-offload-kv-gb).");
  sample(&out, "kestrel_kv_offload_blocks", snap.stats.n_offload_blocks);
  header(&out, "kestrel_kv_offload_blocks_held", "gauge", "Of those, holding a cached block.");
  sample(&out, "kestrel_kv_offload_blocks_held", snap.stats.offload_blocks_held);
  render_spec_decode(snap.stats, &out);
  render_expert_tokens(snap.stats, &out);
  return out;
}

}  // namespace kestrel::cli
