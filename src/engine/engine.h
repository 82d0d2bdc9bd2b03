// The serving engine: many requests share one model and one paged KV cache and are scheduled per
// iteration (continuous batching, Yu et al. 2022, "Orca"; PagedAttention, Kwon et al. 2023).
//
// Engine::step() is one iteration: the scheduler picks decode tokens and prefill chunks under a
// token budget, the model runner computes them in one flat batch, each sequence samples its next
// token, and finished sequences free their KV blocks. Where the runner pipelines passes (pipeline
// parallelism: ModelRunner::max_passes_in_flight), a step submits a pass of the sequences not in
// flight and returns the outputs of the oldest pass once as many are in flight as the pipeline
// has stages, so each stage works on one. The engine is single-threaded: the caller
// (the batch command, the HTTP server's engine thread) owns it and calls step() in a loop.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/model_runner.h"
#include "memory/kv_dtype.h"
#include "engine/beam_search.h"
#include "model/llama_weights.h"
#include "sampling/logprobs.h"
#include "sampling/sampling_params.h"
#include "scheduler/scheduler.h"
#include "spec/drafter.h"
#include "spec/speculative_config.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

namespace grammar {
class CompiledGrammar;
}

// The context a request may use when EngineConfig::max_model_len is 0: the model's, at most this.
inline constexpr int64_t kDefaultMaxModelLen = 8192;

struct EngineConfig {
  int32_t block_size = 16;               // tokens per KV block
  int32_t n_kv_blocks = 0;               // blocks in the KV pool; 0 = sized from max_model_len and max_num_seqs (CPU: capped at 2 GiB of KV)
  int32_t max_num_seqs = 64;             // running sequences per step at most
  int64_t max_num_batched_tokens = 512;  // tokens (decode + prefill) per step at most
  int64_t max_model_len = 0;             // prompt + output tokens per sequence; 0 = the model's training context, capped at 8192
  bool enable_prefix_caching = true;     // reuse full KV blocks of earlier identical prefixes
  KvDtype kv_dtype = KvDtype::F16;       // element type of the cached K and V
  int n_threads = 0;                     // CPU threads; 0 = all hardware threads
  bool populate_kv = false;              // CPU: the whole KV pool resident at start (the server's choice; see KvCache)
  // Preemption by swap (vLLM's --swap-space and --preemption-mode): bytes of host memory for
  // swapped-out KV blocks (0 = none: every preemption recomputes), and how a preempted sequence's
  // K/V are kept (scheduler.h states the auto rule). Swap needs swap_space_bytes > 0.
  int64_t swap_space_bytes = 0;
  PreemptionMode preemption_mode = PreemptionMode::Auto;
  // Host tier of the prefix cache (--cpu-offload-kv-gb): bytes of host memory (CUDA: pinned) for
  // cached KV blocks the device pool evicts, brought back on a prefix hit instead of recomputed
  // (KvManager's header). 0 = none. Needs prefix caching and a model without sliding windows.
  int64_t cpu_offload_kv_bytes = 0;
  int tensor_parallel_size = 1;          // CPU: ranks the model is split over (RunnerOptions::tensor_parallel_size)
  int pipeline_parallel_size = 1;        // stages the layers are split over (RunnerOptions::pipeline_parallel_size)
  // Speculative decoding (src/spec): a drafter proposes up to num_speculative_tokens per running
  // decode, verified in the same step by rejection sampling; the output distribution is unchanged.
  SpeculativeConfig speculative;
  // Where drafts are verified when the runner samples on the device (CUDA): true = there, each of
  // the 1 + k rows sampled by the device sampler and only token ids copied back, for requests whose
  // chain it implements, without logprobs and with a one-hot q (n-gram, greedy draft model);
  // false = every verify step copies its logits to the host (verify_drafts).
  bool speculative_verify_on_device = true;
};

using RequestId = uint64_t;

// Disaggregated prefill (vLLM's prefill/decode disaggregation with a KV connector): the layout of
// a transferred KV block, which both engines must share. A block's bytes are
// ModelRunner::read_kv_blocks's record: bytes_per_token x block_size.
struct KvTransferFormat {
  int32_t block_size = 0;
  KvDtype kv_dtype = KvDtype::F16;
  int64_t bytes_per_token = 0;   // over all layers (ModelRunner::kv_bytes_per_token)
  int64_t n_layer = 0, n_head_kv = 0, head_dim = 0;
  int32_t tensor_parallel_size = 1;
  int64_t bytes_per_block() const { return bytes_per_token * block_size; }
};
// Errors: kestrel::Error naming the first field in which `remote` differs from `local`.
void check_kv_transfer_format(const KvTransferFormat& local, const KvTransferFormat& remote);

// K/V of a sequence's leading tokens, computed by another engine: the whole blocks that hold
// positions [0, n_tokens), either as bytes (each block's record in order,
// kv_transfer_format().bytes_per_block() bytes each) or, when ipc is set, left in the producer's
// pool on this GPU (CUDA IPC): ipc_blocks[b] is the producer's block of block b
// (KvManager::kNoBlock: none, before a sliding window), copied device to device at admission
// (ModelRunner::copy_kv_blocks_ipc) if that comes before ipc_valid_until (the producer may free
// them after it; a request still waiting then ends with an error).
struct KvImport {
  KvTransferFormat format;
  int64_t n_tokens = 0;
  std::vector<std::byte> bytes;
  std::optional<KvIpcMemory> ipc;
  std::vector<int32_t> ipc_blocks;
  std::chrono::steady_clock::time_point ipc_valid_until = std::chrono::steady_clock::time_point::max();
  // Released with the last copy of this import (the blocks written, the request refused, aborted
  // or ended): the server's deleter tells the producer it may free its blocks. Null: nothing to tell.
  std::shared_ptr<void> remote_hold;
};

// What a client asks for, already tokenized.
struct Request {
  std::vector<int32_t> prompt;          // token ids, at least one
  int64_t max_tokens = 256;             // new tokens at most; < 0 = until max_model_len
  SamplingParams sampling;
  // Tokens that end generation (EOS, <|im_end|>, vLLM's stop_token_ids): reported in output_ids,
  // their text left out of the output text (vLLM's default). Each in [0, n_vocab).
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop;        // stop strings (OpenAI `stop`): generation ends when the text contains one; the text is cut before it
  // vLLM's include_stop_str_in_output: the stop string that ends the output stays in its text (the
  // text is cut right after it, and nothing is held back while streaming, as vLLM streams it), and
  // so does the text of the stop id that ends it (EOS and end-of-turn tokens are special: their
  // text appears only with skip_special_tokens false).
  bool include_stop_str_in_output = false;
  // vLLM's skip_special_tokens: the text leaves special tokens (CONTROL, UNKNOWN, UNUSED) out; false
  // writes their text (Tokenizer::decode's skip_special).
  bool skip_special_tokens = true;
  // vLLM's allowed_token_ids: when not empty, only these ids may be sampled; every other token's
  // logit is -inf through the row's token mask (as a grammar's). Each in [0, n_vocab).
  std::vector<int32_t> allowed_token_ids;
  // vLLM's bad_words as token ids (the caller tokenizes each word, with and without a leading
  // space, as vLLM's SamplingParams.update_from_tokenizer does): a word's last id is banned (-inf
  // through the token mask) wherever the generated tokens just before it are the word's other ids,
  // so a one-token word is banned everywhere (vLLM's apply_bad_words; the prompt does not count).
  // Each word non-empty, each id in [0, n_vocab).
  std::vector<std::vector<int32_t>> bad_words;
  // vLLM's min_tokens: until this many tokens are generated, no stop id can be sampled (their
  // logits are masked to -inf, as a grammar's mask is, unless that would leave no token: a grammar
  // that can only end, or stop ids covering the vocabulary) and no stop string ends generation (a
  // match counts only when the token that completes it is token min_tokens or later). 0 = none;
  // at most max_tokens when that is positive, and at most max_model_len - prompt tokens. Not with
  // beam search.
  int64_t min_tokens = 0;
  int32_t logprobs = -1;                // -1: none; 0..kMaxRequestLogprobs: each sampled token's logprob plus this many top alternatives
  // -1: none; 0..kMaxRequestLogprobs: the logprob of every prompt token after the first, given the
  // tokens before it, plus this many top alternatives (OpenAI completions' echo with logprobs,
  // vLLM's prompt_logprobs). Such a request computes its whole prompt (no prefix-cache hit), in
  // chunks of at most kMaxPromptLogprobRowsPerStep tokens.
  int32_t prompt_logprobs = -1;
  // The raw logits of every prompt position, [n_prompt, n_vocab] f32 row-major (row p predicts
  // token p + 1; the last row is the one the first token is sampled from), returned with the first
  // sampled token (RequestOutput::prompt_logits). Such a request computes its whole prompt as
  // prompt_logprobs does. For dumping logits to compare against a reference implementation.
  bool prompt_logits = false;
  // Structured output (sampling/grammar/matcher.h): the grammar the generated text must follow.
  // Each step, the tokens it cannot take get -inf before the sampling chain; the sampled token
  // advances it; once it has ended (EOS taken, or nothing can follow) the request finishes with
  // "stop". Its vocabulary must be the model's tokenizer's. Null: unconstrained. Where the backend
  // samples on the device, the mask goes with the row (ModelRunner::forward_sample), computed while
  // the device runs the layers; with logprobs or a host-only chain the row is sampled on the host.
  std::shared_ptr<const grammar::CompiledGrammar> grammar;
  // Beam search (beam_search.h) when beam.enabled(): the request owns beam_width live sequences
  // that fork the prompt's KV blocks copy-on-write and share their prefixes; sampling params are
  // not used (beams rank the raw logits' log-softmax). It ends at a stop id, max_tokens or
  // max_model_len, and reports one finished output with RequestOutput::beams. Not with logprobs,
  // prompt_logprobs, prompt_logits, stop strings or a grammar (add_request refuses them).
  BeamSearchParams beam;
  // Disaggregated prefill, producer side (vLLM's kv_transfer_params.do_remote_decode): when the
  // request finishes by "stop" or "length", the K/V blocks of its computed tokens stay held (not
  // freed) under its id until release_held_kv, so another engine can pull them (export_held_kv).
  bool do_remote_decode = false;
  // Consumer side (do_remote_prefill): the K/V of the prompt's first kv_import->n_tokens tokens;
  // the engine computes only the prompt's rest (at least its last token) and decodes as if it had
  // prefilled. Its format must equal kv_transfer_format(), n_tokens be in [1, n_prompt] and its
  // prompt the one the K/V were computed from (the caller's word: the producer's tokens). Not with
  // prompt_logprobs, prompt_logits or beam search.
  std::shared_ptr<const KvImport> kv_import;
};

inline constexpr int32_t kMaxRequestLogprobs = 20;
// A request with prompt_logprobs prefills at most this many prompt tokens per step (each one's
// logits row is kept: 256 x 128k vocabulary x 4 B = 131 MB).
inline constexpr int64_t kMaxPromptLogprobRowsPerStep = 256;

// Timings and counts of one request, complete when it finishes.
struct RequestMetrics {
  int64_t n_prompt_tokens = 0;
  int64_t n_cached_prompt_tokens = 0;   // prompt tokens whose KV came from the prefix cache (first schedule)
  int64_t n_output_tokens = 0;          // beam search: the returned hypotheses' tokens together
  int32_t n_preemptions = 0;
  double ttft_s = 0;                    // seconds from add_request to the first output token
  double tpot_s = 0;                    // mean seconds per output token after the first (0 when <= 1 token)
  double e2e_s = 0;                     // seconds from add_request to finish
};

// News about one request from one step.
struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> new_token_ids;   // tokens sampled in this step: 0, 1, or with speculative decoding up to 1 + num_speculative_tokens
  std::vector<LogprobSummary> logprobs; // [new_token_ids.size()] when the request asked for logprobs, else empty
  // With the first sampled token of a request that asked for prompt_logprobs: prompt positions 1 ..
  // n_prompt - 1 in order, each the prompt token's logprob (chosen) and the top alternatives at
  // that position; position 0 has none. Empty on every other output.
  std::vector<LogprobSummary> prompt_logprobs;
  // With the first sampled token of a request that asked for prompt_logits: [n_prompt, n_vocab] f32.
  std::vector<float> prompt_logits;
  std::string text_delta;               // new text that is final (whole UTF-8 characters, never part of a stop string); empty without a tokenizer
  // Beam search, on the finished output: the best beam.n_best hypotheses, best first, each with
  // its text; new_token_ids and text_delta then hold the best one's. Empty on every other output.
  std::vector<BeamHypothesis> beams;
  // Request::do_remote_decode, on the finished output: the blocks held for a pull
  // (Engine::held_kv_blocks, vLLM's remote_block_ids) and how many tokens they hold; empty and 0
  // when nothing is held (the request was aborted or failed).
  std::vector<int32_t> kv_held_blocks;
  int64_t kv_held_tokens = 0;
  bool finished = false;
  std::string finish_reason;            // when finished: "stop" (stop id or stop string), "length", "abort", "error"
  // With "stop": what ended the request (vLLM's stop_reason comes from them): the stop string that
  // matched ("" when none did), or the stop id sampled (-1 when none was: a stop string, or a
  // grammar that ended).
  std::string stop_string;
  int32_t stop_token = -1;
  std::string error;                    // with "error": what went wrong (e.g. NaN logits from corrupt weights)
  // With "error": the request's own fields caused it (allowed_token_ids, bad_words and its grammar
  // left no token to sample, or its grammar proved too ambiguous to match), a client error rather
  // than the server's.
  bool error_from_request = false;
  RequestMetrics metrics;               // complete when finished
};

// Counters over the engine's life.
struct EngineStats {
  int64_t n_steps = 0;                   // forward passes
  // Of those, passes submitted while another was in flight (pipeline parallelism: the runner's
  // stages work on several passes at once; ModelRunner::max_passes_in_flight).
  int64_t n_pipelined_passes = 0;
  int64_t n_prompt_tokens_computed = 0;  // prefill tokens run through the model (recompute included)
  // Host time on the critical path: seconds from a pass's results reaching the engine (no other
  // pass in flight) to the launch of the next pass, summed over the n_host_gaps such gaps. The
  // device has nothing to run meanwhile: finishing the pass's outputs, the caller's handling of
  // them, drafting, scheduling and building the next batch.
  double host_seconds = 0;
  int64_t n_host_gaps = 0;
  // Seconds the engine thread spent filling token masks of device-sampled steps, which runs while
  // the device computes the step's layers (a step waits for the longer of the two).
  double mask_fill_seconds = 0;
  // Of the device's time, seconds it sat idle after a step's layers waiting for those masks
  // (ModelRunner::mask_wait_seconds; 0 on the host backends).
  double mask_wait_seconds = 0;
  int64_t n_generated_tokens = 0;
  int64_t n_preemptions = 0;
  int64_t n_swap_preemptions = 0;           // of those, by swap to host memory
  int64_t n_swapped_out_blocks = 0;         // KV blocks copied to the host swap pool
  int64_t n_swapped_in_blocks = 0;          // KV blocks copied back from it
  int32_t n_swap_blocks = 0;                // blocks in the host swap pool
  int32_t swap_blocks_free = 0;             // of those, free now
  int64_t n_offloaded_blocks = 0;           // evicted cached KV blocks copied to the host tier
  int64_t n_offload_hit_blocks = 0;         // host tier blocks copied back for prefix hits
  int32_t n_offload_blocks = 0;             // blocks in the host tier
  int32_t offload_blocks_held = 0;          // of those, holding a cached block now
  // Host -> device KV copies (swap-ins and host tier hits): bytes, and the seconds they took on
  // the device (ModelRunner::host_to_device_totals; 0 where the backend does not time them).
  int64_t host_to_device_bytes = 0;
  double host_to_device_seconds = 0;
  // Disaggregated prefill, consumer side: imported K/V written into this engine's blocks, by
  // transport (0: bytes through host memory, 1: CUDA IPC device to device): imports, bytes, and
  // the seconds the writes took (wall clock, the copies waited for).
  std::array<int64_t, 2> kv_imports{}, kv_import_bytes{};
  std::array<double, 2> kv_import_seconds{};
  int64_t prefix_cache_queried_tokens = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_cache_hit_tokens = 0;      // of those, tokens found
  int32_t n_kv_blocks = 0;
  int32_t kv_block_size = 0;                // tokens per KV block
  KvDtype kv_dtype = KvDtype::F16;          // element type of the cached K and V
  // Bytes one token takes in the KV pool over all layers, the per-row scales of int8 included
  // (ModelRunner::kv_bytes_per_token); the pool holds n_kv_blocks x kv_block_size x this.
  int64_t kv_bytes_per_token = 0;
  int64_t kv_cache_bytes() const { return int64_t{n_kv_blocks} * kv_block_size * kv_bytes_per_token; }
  int32_t peak_kv_blocks_used = 0;          // most blocks held by sequences at once
  int32_t kv_blocks_used = 0;               // blocks held by sequences now
  int32_t kv_blocks_free = 0;               // blocks free now (unused, or cached and evictable)
  int32_t kv_blocks_cached = 0;             // blocks indexed in the prefix cache now (held or not)
  // Mixture of experts: the layers that route (ascending; empty for a dense model), the experts
  // per layer, and the tokens routed to each expert since start-up, [n_layer * moe_n_expert]
  // layer-major (the runner's expert_token_counts(), refreshed after every forward pass; empty
  // when the backend does not count them).
  std::vector<int32_t> moe_layers;
  int32_t moe_n_expert = 0;
  std::vector<uint64_t> expert_tokens;
  // Speculative decoding, as vLLM's spec_decode counters: drafts verified (one per sequence and
  // step that had draft tokens), draft tokens in them, of those accepted, and accepted per draft
  // position ([num_speculative_tokens]; position 0 holds the draft token right after the sampled one).
  int64_t spec_num_drafts = 0;
  int64_t spec_num_draft_tokens = 0;
  int64_t spec_num_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_pos;
  // Tokens a verified draft step emits on average: 1 + accepted / drafts (vLLM's mean acceptance
  // length); 0 before any draft.
  double spec_mean_accepted_length() const {
    return spec_num_drafts > 0 ? 1.0 + static_cast<double>(spec_num_accepted_tokens) / static_cast<double>(spec_num_drafts)
                               : 0.0;
  }
  double spec_acceptance_rate() const {
    return spec_num_draft_tokens > 0
               ? static_cast<double>(spec_num_accepted_tokens) / static_cast<double>(spec_num_draft_tokens)
               : 0.0;
  }
  double prefix_cache_hit_rate() const {
    return prefix_cache_queried_tokens > 0
               ? static_cast<double>(prefix_cache_hit_tokens) / static_cast<double>(prefix_cache_queried_tokens)
               : 0.0;
  }
};

// The KV blocks one sequence holds at most: ceil(max_model_len / block_size), or, when every layer
// is windowed (ModelHparams::kv_lookback() > 0; the scheduler releases the blocks before the window
// after each step), at most those of the window plus the largest chunk a step adds and one more
// for a window that starts inside a block: ceil((window + max_num_batched_tokens) / block_size) + 1.
// The KV pool must hold this many.
int64_t kv_blocks_per_sequence(const ModelHparams& hp, int64_t max_model_len, int32_t block_size,
                               int64_t max_num_batched_tokens);

class Engine {
 public:
  // The model and the tokenizer must outlive the engine; tokenizer may be null (no text, no stop
  // strings). runner: the backend (make_cpu_model_runner, or CUDA's), whose KV pool then sets
  // n_kv_blocks and must use config.block_size; null = a CPU runner made from the config.
  // Errors: kestrel::Error on a bad config (non-positive sizes, a KV pool smaller than one
  // sequence: kv_blocks_per_sequence), a negative swap_space_bytes or one over 2^31 blocks,
  // preemption_mode swap without swap space, or a backend without host swap space; a negative
  // cpu_offload_kv_bytes, or a positive one without prefix caching or with a windowed model.
  // draft: the draft model of config.speculative's draft_model method (its drafter owns it; its
  // runner, when given, runs on the target's device with a pool of draft_kv_blocks). Errors also:
  // those of make_drafter (draft_model without a draft, a draft whose vocabulary differs).
  Engine(const LlamaModel& model, const Tokenizer* tokenizer, const EngineConfig& config,
         std::unique_ptr<ModelRunner> runner = nullptr, DraftModel draft = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request. Errors (kestrel::Error, nothing queued): empty prompt, a token
  // id (prompt, stop id, allowed_token_ids or bad_words id) outside the vocabulary, an empty bad
  // word, prompt + 1 longer than max_model_len, invalid sampling params, min_tokens negative, above
  // a positive max_tokens or above what the context leaves after the prompt, stop strings without
  // a tokenizer, invalid beam params or fields beam search does not take.
  RequestId add_request(Request request);
  // Ends a waiting or running request and frees its blocks; the next step() reports it finished
  // with "abort". Unknown or finished ids are ignored. Passes in flight are collected first (their
  // outputs come with the next step, before the abort's).
  void abort_request(RequestId id);
  // One iteration: schedule, run the model, sample, post-process. Returns news for every request
  // that got a token or finished in this step (with pipelined passes: in the pass collected).
  std::vector<RequestOutput> step();
  bool has_unfinished() const;
  size_t n_waiting() const;
  size_t n_running() const;
  // Passes submitted to the runner whose outputs a later step returns (pipelined passes; else 0
  // between steps).
  size_t n_passes_in_flight() const;

  // Disaggregated prefill. kv_transfer_format: this engine's block layout. export_held_kv: the
  // held K/V of finished do_remote_decode request `id` (n_tokens: its computed tokens; the
  // tokens themselves in `tokens` when given). release_held_kv: frees them (their full blocks stay
  // in the prefix cache); an unknown id is ignored. Errors: kestrel::Error when `id` holds none.
  KvTransferFormat kv_transfer_format() const;
  KvImport export_held_kv(RequestId id, std::vector<int32_t>* tokens = nullptr) const;
  // The same without the bytes: the runner's CUDA IPC export (ModelRunner::export_kv_ipc) and the
  // held blocks (KvImport::ipc, ipc_blocks); the blocks stay held. Errors: export_held_kv's, and
  // the runner's when it has no IPC.
  KvImport export_held_kv_ipc(RequestId id, std::vector<int32_t>* tokens = nullptr) const;
  // The physical blocks request `id` holds (vLLM's remote_block_ids), empty when none.
  std::vector<int32_t> held_kv_blocks(RequestId id) const;
  void release_held_kv(RequestId id);
  size_t n_held_kv() const;

  const EngineStats& stats() const;
  const EngineConfig& config() const;  // with 0-defaults resolved
  const ModelRunner& runner() const;
  // The speculative drafter (null without speculative decoding).
  const Drafter* drafter() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel
