// The engine's internals (engine.cpp; beam groups in engine_beam.cpp): a request's state and
// Engine::Impl. Not part of the API: only the engine's own sources include it.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/thread_pool.h"
#include "engine/beam_search.h"
#include "engine/engine.h"
#include "engine/stop_checker.h"
#include "memory/kv_manager.h"
#include "sampling/grammar/matcher.h"
#include "sampling/sampler.h"
#include "scheduler/scheduler.h"
#include "scheduler/step_batch.h"
#include "spec/drafter.h"
#include "spec/verifier.h"
#include "tokenizer/stream_decoder.h"

namespace kestrel {
namespace engine_detail {

using Clock = std::chrono::steady_clock;
struct BeamGroup;

struct RequestState {
  RequestId id = 0;
  Request req;
  Sequence seq;
  std::optional<Sampler> sampler;
  // Request::grammar's state; the token bitmask of the next sample (the grammar's, less the stop
  // ids while min_tokens holds them back) and the masked logits row, reused every step.
  std::optional<grammar::GrammarMatcher> matcher;
  std::vector<uint32_t> token_mask;
  std::vector<float> masked_row;
  bool grammar_ended = false;
  std::string grammar_error;  // the matcher failed filling a mask (fill_token_mask): ends the request
  // Request::allowed_token_ids as a token bitmask ([bitmask_words] words; empty when not given).
  std::vector<uint32_t> allowed_mask;
  // The last mask filled left no token (allowed_token_ids, bad_words and the grammar rule out every
  // one): the request ends with an error instead of sampling from a row of -inf.
  bool mask_empty = false;
  std::optional<StreamDecoder> decoder;
  StopChecker stop_checker;
  Clock::time_point arrival, first_token;
  bool finished = false;
  // prompt_logprobs / prompt_logits: the next prompt token whose predicting row is wanted (the row
  // of position p predicts token p + 1; token 0 has none), the rows computed but not yet reported
  // (they go out with the first sampled token), and whether a prompt row held non-finite logits.
  int64_t next_prompt_target = 1;
  std::vector<LogprobSummary> pending_prompt_logprobs;
  std::vector<float> pending_prompt_logits;
  bool prompt_nan = false;
  // Why the copy of its transferred K/V failed (write_import; CUDA IPC): the request ends with
  // this error in the step of its import, which samples its last prompt token, and its blocks
  // go without reaching the prefix cache.
  std::string import_error;
  // The drafter's q for the draft tokens at the end of seq.tokens ([seq.n_draft, n_vocab]), empty
  // when they are one-hot (Draft::q).
  std::vector<float> draft_q;
  bool wants_prompt_rows() const { return req.prompt_logprobs >= 0 || req.prompt_logits; }
  // min_tokens: the next token may not be a stop id yet.
  bool bans_stop_ids() const { return seq.n_generated() < req.min_tokens && !req.stop_ids.empty(); }
  // allowed_token_ids or bad_words: every token is sampled under a mask, so no drafts either.
  bool filters_tokens() const { return !allowed_mask.empty() || !req.bad_words.empty(); }
  // The next token is sampled under a token mask (Engine::Impl::fill_token_mask).
  bool masks_row() const { return matcher.has_value() || bans_stop_ids() || filters_tokens(); }
  // Choices of one prompt (n > 1, or identical prompts queued together): a request added while an
  // identical prompt waits unstarted becomes that one's child. The child is not scheduled: when the
  // parent's prompt is computed it forks the parent's blocks and samples its first token from the
  // parent's last logits row, so the prompt is prefilled once.
  RequestState* parent = nullptr;         // set while waiting for the parent's prompt
  std::vector<RequestState*> children;    // children waiting for this request's prompt
  uint64_t prompt_hash = 0;
  // Beam search: the group whose beam this sequence is (null otherwise); the request's own state
  // owns it. beam_row: the beam's best next tokens, valid while has_beam_row; the sequence, fully
  // computed, is then not scheduled until every live beam of its group has its row.
  BeamGroup* group = nullptr;
  std::unique_ptr<BeamGroup> own_group;
  bool has_beam_row = false;
  BeamRow beam_row;
};

// A beam-search request's beams. slots: the states whose sequences beams use, the request's own
// first; a slot whose beam is not continued frees its blocks and takes the next fork. live[i]:
// the slot of the search's live beam i.
struct BeamGroup {
  BeamGroup(const BeamSearchParams& p, std::vector<int32_t> stop_ids, int64_t max_new_tokens)
      : search(p, std::move(stop_ids), max_new_tokens) {}
  BeamSearch search;
  RequestState* owner = nullptr;
  std::vector<RequestState*> slots;
  std::vector<RequestState*> live;
  std::string error;  // a beam's logits were not finite: the request ends with it after the step
};

// A row whose mask the request's own filters emptied: its error (RequestOutput::error_from_request).
struct NoTokenAllowedError : Error {
  NoTokenAllowedError() : Error("no token may be sampled: allowed_token_ids, bad_words and the grammar rule out every token") {}
};

}  // namespace engine_detail

struct Engine::Impl {
  using RequestState = engine_detail::RequestState;
  using BeamGroup = engine_detail::BeamGroup;
  Impl(const LlamaModel& m, const Tokenizer* t, const EngineConfig& c, std::unique_ptr<ModelRunner> r, DraftModel draft);

  // Speculative decoding: drafts for the running decodes (seq.n_draft, draft_q), before schedule().
  void propose_drafts();
  // Drops the drafts of a sequence that did not run them (they are proposals for one step).
  static void drop_drafts(RequestState& r) {
    r.seq.tokens.resize(r.seq.tokens.size() - static_cast<size_t>(r.seq.n_draft));
    r.seq.n_draft = 0;
    r.draft_q.clear();
  }
  // After verification: the rejected drafts' K/V go back to the pool, the accepted ones stay
  // computed, and the tokens return to the settled ones (post_process appends v.tokens).
  void settle_drafts(RequestState& r, const Verification& v);
  void refresh_kv_stats() {
    stats.kv_blocks_used = manager.n_used_blocks();
    stats.kv_blocks_free = manager.n_free_blocks();
    stats.kv_blocks_cached = manager.n_cached_blocks();
    stats.peak_kv_blocks_used = std::max(stats.peak_kv_blocks_used, stats.kv_blocks_used);
    stats.prefix_cache_queried_tokens = manager.prefix_queried_tokens();
    stats.prefix_cache_hit_tokens = manager.prefix_hit_tokens();
    stats.n_swapped_out_blocks = manager.n_swapped_out_blocks();
    stats.n_swapped_in_blocks = manager.n_swapped_in_blocks();
    stats.swap_blocks_free = manager.n_free_swap_blocks();
    stats.n_offloaded_blocks = manager.n_offloaded_blocks();
    stats.n_offload_hit_blocks = manager.n_offload_hit_blocks();
    stats.offload_blocks_held = manager.host_tier().n_held();
  }
  // PreemptionMode::Auto's costs: the swap's from the runner's host link, the recompute's from
  // the measured forward time per token of prefill-dominated steps (an exponential average).
  void measure_prefill(const SchedulerOutput& out, double seconds);
  double prefill_seconds_per_token = 0;
  void finish(RequestState& r, const std::string& reason, std::vector<RequestOutput>& outputs, RequestOutput* o);
  // A request that can share the prompt of `r` (queued, never scheduled, not a child), or null.
  RequestState* prompt_parent_for(const RequestState& r);
  // Hands r's waiting children to the scheduler on their own (r ends before its prompt is done).
  void release_children(RequestState& r);
  // Appends the tokens a step emitted for r (one, or accepted drafts and the token after them) and
  // reports them in one output; ends r at the first that stops it (the rest are dropped).
  // logprobs: [tokens.size()] or empty.
  void post_process(RequestState& r, std::span<const int32_t> tokens, std::vector<RequestOutput>& outputs,
                    std::vector<LogprobSummary> logprobs = {});

  // Beam search (engine_beam.cpp). start_beams: add_request's part. take_beam_row: a beam's
  // logits row in the sampling loop (its best tokens kept; the group marked for step_beams).
  // step_beams: after the sampling loop, one search step for every group whose live beams all
  // have their rows: beams not continued free their blocks, a beam continued k times forks k - 1
  // sequences sharing its blocks copy-on-write, each appends its token; a finished search ends
  // the request with its hypotheses. end_beams: finish's part (the other slots' sequences end).
  void start_beams(RequestState& r);
  void take_beam_row(RequestState& r, std::span<const float> row);
  void step_beams(std::vector<RequestOutput>& outputs);
  void end_beams(RequestState& owner, RequestOutput* o);
  std::vector<RequestId> beam_groups_ready;  // owners whose group got a row this step

  // Disaggregated prefill (engine_kv_transfer.cpp). hold_kv: finish's part for a do_remote_decode
  // request (its blocks shared by a held sequence, so freeing the request keeps them).
  // check_import: add_request's checks of Request::kv_import. write_import: the imported bytes
  // into the blocks admission gave the sequence, before the pass.
  struct HeldKv {
    SeqId seq = 0;  // the held sequence in the KvManager: the request id with kHeldSeqBit
    std::vector<int32_t> tokens;  // its computed tokens
  };
  static constexpr SeqId kHeldSeqBit = SeqId{1} << 63;
  std::unordered_map<RequestId, HeldKv> held_kv;
  // What both exports (export_held_kv, export_held_kv_ipc) start from: the held request's entry, out's
  // format and token count, its tokens copied to *tokens when asked. Errors: kestrel::Error when
  // the request holds no K/V.
  const HeldKv& held_export(RequestId id, std::vector<int32_t>* tokens, KvImport& out) const;
  void hold_kv(RequestState& r, RequestOutput& o);
  void check_import(const Request& req, int64_t n_prompt) const;
  void write_import(const SchedulerOutput::Import& im);
  // Requests waiting with a CUDA IPC import; expire_imports ends those past ipc_valid_until.
  std::vector<RequestId> ipc_imports;
  void expire_imports(std::vector<RequestOutput>& outputs);
  KvTransferFormat kv_format() const;

  const LlamaModel& model;
  const Tokenizer* tokenizer;
  EngineConfig config;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Drafter> drafter;  // null without speculative decoding
  std::vector<DraftRequest> draft_requests;
  std::vector<RequestState*> draft_owners;
  std::vector<Draft> drafts;
  KvManager manager;
  Scheduler scheduler;
  std::unordered_map<RequestId, std::unique_ptr<RequestState>> requests;
  std::vector<RequestOutput> pending;  // aborts reported by the next step
  RequestId next_id = 1;
  EngineStats stats;
  // Unstarted requests by the hash of their prompt (prompt_parent_for); entries may be stale.
  std::unordered_map<uint64_t, RequestId> unstarted_prompts;
  // Requests that sample in a pass and the logits row each samples from; children of a parent
  // whose prompt completes follow, each with a copy of the parent's row.
  struct SampleRow {
    RequestState* r;
    int32_t row;          // the last of its rows: the one the token after its drafts is sampled from
    int64_t n_draft = 0;  // rows row - n_draft .. row - 1 verify its draft tokens
  };
  // Logits rows after those: prompt positions whose logprobs or logits a request wants, each row
  // predicting prompt token `target` of `r`.
  struct PromptRow {
    RequestState* r;
    int64_t target;
    int32_t row;
  };
  // One forward pass: the scheduler's step, its flat batch and what its logits rows are for.
  struct Pass {
    SchedulerOutput out;
    StepBatch batch;
    std::vector<SampleRow> sampling;
    std::vector<PromptRow> prompt_rows;
    bool on_device = false;  // sampled by the runner (forward_sample)
    bool timed = false;      // submitted and collected in one step: its time is the pass's (measure_prefill)
    engine_detail::Clock::time_point start;
  };
  // Passes submitted to the runner and not yet collected, oldest first (ModelRunner::submit); their
  // sequences are in flight. More than one only where the runner pipelines (pipeline_depth).
  std::deque<Pass> passes;
  Pass spare_pass;  // the last pass finished: the next reuses its arrays
  // When the last pass's results came back with no other pass in flight (the device idle since);
  // unset while a pass is in flight or no work is waiting. EngineStats::host_seconds.
  std::optional<engine_detail::Clock::time_point> idle_since;
  void pass_launching() {
    if (!idle_since) return;
    stats.host_seconds += std::chrono::duration<double>(engine_detail::Clock::now() - *idle_since).count();
    ++stats.n_host_gaps;
    idle_since.reset();
  }
  // Passes to keep in flight: the runner's max_passes_in_flight, or 1 while speculative decoding
  // or a beam search runs (their steps change sequences the scheduler sees together).
  int pipeline_depth() const {
    // The runner first: a runner of one pass at a time (all but pipeline parallelism) needs no
    // look at the requests, which this would do every step.
    const int depth = runner->max_passes_in_flight();
    if (depth <= 1 || drafter) return 1;
    for (const auto& [id, r] : requests)
      if (r->own_group) return 1;
    return depth;
  }
  // Collects the oldest pass in flight and makes its outputs; drain: every pass in flight.
  void collect(std::vector<RequestOutput>& outputs);
  void drain(std::vector<RequestOutput>& outputs) {
    while (!passes.empty()) collect(outputs);
  }
  // A pass's logits (or, on_device, its sampled tokens) made into the requests' tokens and outputs.
  void finish_pass(Pass& p, std::span<const float> logits, std::span<const int32_t> device_tokens,
                   std::vector<RequestOutput>& outputs);
  void build_batch(Pass& p);
  void prompt_logprobs_from(const Pass& p, std::span<const float> logits);
  // The token mask of r's next sample ([bitmask_words] words): its grammar's (all ones without
  // one), within allowed_token_ids, less the bad_words ids banned after the tokens generated so far,
  // less its stop ids while min_tokens bans them, unless that leaves no token (the ban then
  // yields); sets r.mask_empty when no token is left. Writes only `mask` and r.mask_empty: safe for
  // different requests at once.
  void fill_token_mask(RequestState& r, std::span<uint32_t> mask) const;
  // r's logits row under its token mask (filled here), in r.masked_row. Errors: the grammar's
  // error (grammar::GrammarError), NoTokenAllowedError when the mask leaves no token.
  std::span<const float> masked_logits(RequestState& r, std::span<const float> row) const;
  // r's matcher on grammar g, whose token splits split_prefetcher computes ahead, in the
  // background, the first time g comes (CompiledGrammar::precompute_splits).
  void start_grammar(RequestState& r, const std::shared_ptr<const grammar::CompiledGrammar>& g);
  std::unique_ptr<grammar::SplitPrefetcher> split_prefetcher;
  // The token masks of a pass's masked rows for forward_sample: [n_rows, bitmask_words] words,
  // row sr.row of each sampling request that masks_row() (the other rows are not read). Requests
  // are filled in parallel on mask_pool (each matcher is its own; a grammar's shared token splits
  // are computed under its lock), which matters most for the first masks of a fresh grammar.
  void fill_token_masks(const Pass& p, std::span<uint32_t> masks);
  // The device-sampled tokens of a pass's grammar rows (no drafts, not in `skip`) accepted by
  // their matchers in parallel on mask_pool, as the masks were filled; grammar_accepted[i]: 1 when
  // sampling row i's token was accepted (grammar_ended set), 0 when refused, -1 when not a row here.
  void accept_device_tokens(const Pass& p, std::span<const int32_t> device_tokens, const std::vector<bool>& skip);
  // fn(i) for i in [0, n) on mask_pool, claimed one at a time (a mask that meets a split not
  // computed yet takes milliseconds where most take microseconds); inline below two.
  void for_each_grammar_row(size_t n, const std::function<void(size_t)>& fn);
  std::unique_ptr<ThreadPool> mask_pool;  // mask_threads() threads, started on first need
  int mask_threads() const;               // config.n_threads, at most 4 (engine_masks.cpp)
  std::vector<const SampleRow*> grammar_rows;  // the masked rows of the pass being filled
  std::vector<size_t> grammar_row_index;  // accept_device_tokens' rows (indices into p.sampling)
  std::vector<int8_t> grammar_accepted;
  std::vector<RowSampling> row_sampling;  // their device-sampling settings, when the runner samples
  std::vector<double> draft_uniforms;      // one verified sequence's peeked uniforms (Sampler::peek_uniforms)
};

}  // namespace kestrel
