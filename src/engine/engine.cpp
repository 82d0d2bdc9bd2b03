#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "core/error.h"
#include "engine/engine_impl.h"
#include "engine/stop_checker.h"
#include "memory/kv_manager.h"
#include "sampling/candidate_list.h"
#include "sampling/grammar/matcher.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"
#include "scheduler/scheduler.h"
#include "scheduler/step_batch.h"
#include "spec/drafter.h"
#include "spec/verifier.h"
#include "tokenizer/stream_decoder.h"
#include "backend/kv_geometry.h"

namespace kestrel {

using engine_detail::Clock;
using engine_detail::NoTokenAllowedError;
using engine_detail::RequestState;

namespace {
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

constexpr int64_t kDefaultKvBytes = int64_t{2} << 30;  // 2 GiB of K/V when n_kv_blocks is 0

}  // namespace

int64_t kv_blocks_per_sequence(const ModelHparams& hp, int64_t max_model_len, int32_t block_size,
                               int64_t max_num_batched_tokens) {
  const int64_t whole = (max_model_len + block_size - 1) / block_size;
  const int64_t lookback = hp.kv_lookback();
  if (lookback <= 0 || max_num_batched_tokens <= 0) return whole;
  return std::min(whole, (lookback + max_num_batched_tokens + block_size - 1) / block_size + 1);
}

namespace {

EngineConfig resolve(const EngineConfig& in, const ModelHparams& hp, const ModelRunner* runner) {
  EngineConfig c = in;
  if (c.block_size <= 0) throw Error("block_size must be positive, got " + std::to_string(c.block_size));
  if (c.max_model_len < 0) throw Error("max_model_len must be >= 0, got " + std::to_string(c.max_model_len));
  if (c.n_kv_blocks < 0) throw Error("n_kv_blocks must be >= 0, got " + std::to_string(c.n_kv_blocks));
  if (c.max_model_len == 0) c.max_model_len = std::min(hp.n_ctx_train, kDefaultMaxModelLen);
  if (c.max_model_len > hp.n_ctx_train)
    throw Error("max_model_len " + std::to_string(c.max_model_len) + " exceeds the model's context of " +
                std::to_string(hp.n_ctx_train));
  // A windowed model needs its window and a step; one with a layer that reads every key (most
  // models, Gemma 3's global layers) its whole max_model_len.
  const int64_t blocks_per_seq = kv_blocks_per_sequence(hp, c.max_model_len, c.block_size, c.max_num_batched_tokens);
  const int64_t lookback = hp.kv_lookback();
  if (runner != nullptr) {
    if (runner->block_size() != c.block_size)
      throw Error("the backend's KV blocks hold " + std::to_string(runner->block_size()) + " tokens but block_size is " +
                  std::to_string(c.block_size));
    c.n_kv_blocks = runner->n_kv_blocks();
    c.kv_dtype = runner->kv_dtype();
  }
  if (c.n_kv_blocks == 0) {
    const int64_t bytes_per_block = kv_bytes_per_token(kv_geometry(hp), c.kv_dtype) * c.block_size;
    const int64_t cap = std::max<int64_t>(blocks_per_seq, kDefaultKvBytes / bytes_per_block);
    c.n_kv_blocks = static_cast<int32_t>(std::min<int64_t>(blocks_per_seq * std::max(1, c.max_num_seqs), cap));
  }
  if (c.swap_space_bytes < 0)
    throw Error("swap_space must be >= 0 bytes, got " + std::to_string(c.swap_space_bytes));
  if (c.cpu_offload_kv_bytes < 0)
    throw Error("cpu_offload_kv_bytes must be >= 0, got " + std::to_string(c.cpu_offload_kv_bytes));
  if (c.cpu_offload_kv_bytes > 0 && !c.enable_prefix_caching)
    throw Error("cpu_offload_kv_bytes needs prefix caching (the host tier holds prefix-cache blocks)");
  if (c.cpu_offload_kv_bytes > 0 && lookback > 0)
    throw Error("cpu_offload_kv_bytes does not apply to a model whose every layer has a sliding window of " +
                std::to_string(lookback) + " tokens (its sequences skip cached blocks before the window)");
  if (c.preemption_mode == PreemptionMode::Swap && c.swap_space_bytes == 0)
    throw Error("preemption_mode swap needs swap_space > 0 (host memory for the swapped KV blocks)");
  if (c.n_kv_blocks < blocks_per_seq) {
    if (lookback > 0 && blocks_per_seq < (c.max_model_len + c.block_size - 1) / c.block_size)
      throw Error("a KV pool of " + std::to_string(c.n_kv_blocks) + " blocks of " + std::to_string(c.block_size) +
                  " tokens cannot hold one sequence's sliding window of " + std::to_string(lookback) +
                  " tokens plus a step of max_num_batched_tokens " + std::to_string(c.max_num_batched_tokens) +
                  " (needs " + std::to_string(blocks_per_seq) +
                  " blocks): raise the blocks or lower max_num_batched_tokens");
    throw Error("a KV pool of " + std::to_string(c.n_kv_blocks) + " blocks of " + std::to_string(c.block_size) +
                " tokens cannot hold one sequence of max_model_len " + std::to_string(c.max_model_len) +
                " (needs " + std::to_string(blocks_per_seq) + " blocks): raise the blocks or lower max_model_len");
  }
  return c;
}

// Blocks of the runner's geometry that `bytes` of host memory hold (`what` names the setting).
int32_t host_blocks(int64_t bytes, const char* what, const EngineConfig& c, const ModelRunner& runner) {
  const int64_t block_bytes = runner.kv_bytes_per_token() * c.block_size;
  const int64_t n = bytes / block_bytes;
  if (n > INT32_MAX / 2)
    throw Error(std::string(what) + " of " + std::to_string(bytes) + " bytes is over 2^30 KV blocks");
  return static_cast<int32_t>(n);
}

std::unique_ptr<ModelRunner> cpu_runner(const LlamaModel& m, const EngineConfig& c) {
  RunnerOptions o;
  o.block_size = c.block_size;
  o.n_kv_blocks = c.n_kv_blocks;
  o.kv_dtype = c.kv_dtype;
  o.n_threads = c.n_threads;
  o.populate_kv = c.populate_kv;
  o.tensor_parallel_size = c.tensor_parallel_size;
  o.pipeline_parallel_size = c.pipeline_parallel_size;
  return make_cpu_model_runner(m, o);
}

}  // namespace

Engine::Impl::Impl(const LlamaModel& m, const Tokenizer* t, const EngineConfig& c, std::unique_ptr<ModelRunner> r,
                   DraftModel draft)
    : model(m),
      tokenizer(t),
      config(resolve(c, m.hparams(), r.get())),
      runner(r ? std::move(r) : cpu_runner(m, config)),
      manager(KvManagerConfig{config.n_kv_blocks, config.block_size, config.enable_prefix_caching,
                              host_blocks(config.swap_space_bytes, "swap_space", config, *runner),
                              host_blocks(config.cpu_offload_kv_bytes, "cpu_offload_kv_bytes", config, *runner)}),
      scheduler(SchedulerConfig{config.max_num_seqs, config.max_num_batched_tokens, m.hparams().kv_lookback(),
                                config.preemption_mode},
                manager) {
  stats.n_swap_blocks = manager.n_swap_blocks();
  stats.n_offload_blocks = manager.host_tier().n_blocks();
  // One host buffer: the swap pool's blocks, then the host tier's (KvManager's ids).
  if (stats.n_swap_blocks + stats.n_offload_blocks > 0)
    runner->allocate_swap_space(stats.n_swap_blocks + stats.n_offload_blocks);
  stats.n_kv_blocks = config.n_kv_blocks;
  stats.kv_block_size = config.block_size;
  stats.kv_dtype = runner->kv_dtype();
  stats.kv_bytes_per_token = runner->kv_bytes_per_token();
  const ModelHparams& hp = m.hparams();
  if (hp.moe.enabled()) {
    stats.moe_n_expert = static_cast<int32_t>(hp.moe.routing.n_expert);
    for (int64_t l = 0; l < hp.n_layer; ++l)
      if (hp.moe.is_moe_layer(l)) stats.moe_layers.push_back(static_cast<int32_t>(l));
    stats.expert_tokens = runner->expert_token_counts();  // zeros: counters exist from the start
  }
  if (config.speculative.enabled()) {
    DrafterContext dc;
    dc.target = &m;
    dc.target_tokenizer = t;
    dc.max_num_seqs = config.max_num_seqs;
    dc.max_model_len = config.max_model_len;
    dc.max_num_batched_tokens = config.max_num_batched_tokens;
    dc.block_size = config.block_size;
    dc.enable_prefix_caching = config.enable_prefix_caching;
    dc.kv_dtype = config.kv_dtype;
    dc.n_threads = config.n_threads;
    drafter = make_drafter(config.speculative, dc, std::move(draft));
    stats.spec_accepted_per_pos.assign(static_cast<size_t>(config.speculative.num_speculative_tokens), 0);
  }
  refresh_kv_stats();
}


Engine::Engine(const LlamaModel& model, const Tokenizer* tokenizer, const EngineConfig& config,
               std::unique_ptr<ModelRunner> runner, DraftModel draft)
    : impl_(std::make_unique<Impl>(model, tokenizer, config, std::move(runner), std::move(draft))) {}
Engine::~Engine() = default;

const EngineStats& Engine::stats() const { return impl_->stats; }
const EngineConfig& Engine::config() const { return impl_->config; }
const ModelRunner& Engine::runner() const { return *impl_->runner; }
const Drafter* Engine::drafter() const { return impl_->drafter.get(); }
size_t Engine::n_waiting() const { return impl_->scheduler.n_waiting(); }
size_t Engine::n_running() const { return impl_->scheduler.n_running(); }
size_t Engine::n_passes_in_flight() const { return impl_->passes.size(); }
bool Engine::has_unfinished() const { return !impl_->requests.empty() || !impl_->pending.empty(); }

RequestId Engine::add_request(Request request) {
  Impl& m = *impl_;
  const int64_t n_vocab = m.model.hparams().n_vocab;
  const int64_t n_prompt = static_cast<int64_t>(request.prompt.size());
  if (n_prompt == 0) throw Error("empty prompt: nothing to condition on");
  for (int32_t t : request.prompt)
    if (t < 0 || t >= n_vocab)
      throw Error("prompt token id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(n_vocab));
  if (n_prompt + 1 > m.config.max_model_len)
    throw Error("prompt of " + std::to_string(n_prompt) + " tokens exceeds the context: max_model_len " +
                std::to_string(m.config.max_model_len) + " must hold it and at least one output token");
  if (request.max_tokens == 0) throw Error("max_tokens must be >= 1 (or < 0 for no limit), got 0");
  if (request.min_tokens < 0) throw Error("min_tokens must be >= 0, got " + std::to_string(request.min_tokens));
  if (request.max_tokens > 0 && request.min_tokens > request.max_tokens)
    throw Error("min_tokens (" + std::to_string(request.min_tokens) + ") must be at most max_tokens (" +
                std::to_string(request.max_tokens) + ")");
  if (request.min_tokens > m.config.max_model_len - n_prompt)
    throw Error("min_tokens (" + std::to_string(request.min_tokens) + ") must be at most the " +
                std::to_string(m.config.max_model_len - n_prompt) + " tokens the context (max_model_len " +
                std::to_string(m.config.max_model_len) + ") leaves after the prompt");
  // Stop ids, allowed ids and bad words index the token mask.
  for (int32_t t : request.stop_ids)
    if (t < 0 || t >= n_vocab)
      throw Error("stop token id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(n_vocab));
  for (int32_t t : request.allowed_token_ids)
    if (t < 0 || t >= n_vocab)
      throw Error("allowed token id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(n_vocab));
  for (const std::vector<int32_t>& word : request.bad_words) {
    if (word.empty()) throw Error("a bad word has no tokens");
    for (int32_t t : word)
      if (t < 0 || t >= n_vocab)
        throw Error("bad word token id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(n_vocab));
  }
  if (request.logprobs < -1 || request.logprobs > kMaxRequestLogprobs)
    throw Error("logprobs must be in [-1, " + std::to_string(kMaxRequestLogprobs) + "], got " +
                std::to_string(request.logprobs));
  if (request.prompt_logprobs < -1 || request.prompt_logprobs > kMaxRequestLogprobs)
    throw Error("prompt_logprobs must be in [-1, " + std::to_string(kMaxRequestLogprobs) + "], got " +
                std::to_string(request.prompt_logprobs));
  if (!request.stop.empty() && m.tokenizer == nullptr) throw Error("stop strings need a tokenizer");
  if (request.kv_import) m.check_import(request, n_prompt);
  for (const std::string& s : request.stop)
    if (s.empty()) throw Error("stop strings must not be empty");
  auto r = std::make_unique<RequestState>();
  r->sampler.emplace(request.sampling, static_cast<int32_t>(n_vocab));  // validates the params
  if (request.grammar) {
    if (request.grammar->vocab().n_vocab > n_vocab)
      throw Error("grammar: its vocabulary (" + std::to_string(request.grammar->vocab().n_vocab) +
                  " tokens) is larger than the model's (" + std::to_string(n_vocab) + ")");
    m.start_grammar(*r, request.grammar);
  }
  const size_t mask_words = grammar::bitmask_words(static_cast<int32_t>(n_vocab));
  if (!request.allowed_token_ids.empty()) {
    r->allowed_mask.assign(mask_words, 0u);
    for (const int32_t t : request.allowed_token_ids)
      r->allowed_mask[static_cast<size_t>(t) / 32] |= 1u << (static_cast<uint32_t>(t) % 32);
  }
  if (request.grammar || request.min_tokens > 0 || !request.allowed_token_ids.empty() || !request.bad_words.empty())
    r->token_mask.assign(mask_words, 0u);
  r->id = m.next_id++;
  // continuation: the output continues the prompt, so a first word keeps its leading space.
  if (m.tokenizer != nullptr)
    r->decoder.emplace(*m.tokenizer, /*skip_special=*/request.skip_special_tokens, /*continuation=*/true);
  r->stop_checker = StopChecker(request.stop, request.include_stop_str_in_output);
  r->seq.id = r->id;
  r->seq.tokens = request.prompt;
  r->seq.n_prompt = n_prompt;
  // The last prompt token is computed here: its logits give the first token, as in one engine.
  if (request.kv_import) r->seq.n_imported = std::min(request.kv_import->n_tokens, n_prompt - 1);
  if (request.kv_import && request.kv_import->ipc) m.ipc_imports.push_back(r->id);
  if (request.prompt_logprobs >= 0 || request.prompt_logits) {
    r->seq.reuse_prefix_cache = false;  // cached positions would have no logits
    // Every prompt position of a chunk is a logits row: bound the rows (n_vocab floats each, on
    // the host and on the device) a step holds.
    r->seq.max_chunk = kMaxPromptLogprobRowsPerStep;
  }
  r->req = std::move(request);
  if (r->req.beam.enabled()) m.start_beams(*r);
  r->arrival = Clock::now();
  r->prompt_hash = std::hash<std::string_view>{}(std::string_view(
      reinterpret_cast<const char*>(r->seq.tokens.data()), r->seq.tokens.size() * sizeof(int32_t)));
  RequestState& ref = *r;
  m.requests.emplace(ref.id, std::move(r));
  if (RequestState* parent = m.prompt_parent_for(ref)) {
    ref.parent = parent;
    parent->children.push_back(&ref);
  } else {
    m.scheduler.add(&ref.seq);
    m.unstarted_prompts[ref.prompt_hash] = ref.id;
  }
  return ref.id;
}

void Engine::abort_request(RequestId id) {
  Impl& m = *impl_;
  m.drain(m.pending);  // a request in flight ends once its pass is back (its outputs go first)
  const auto it = m.requests.find(id);
  if (it == m.requests.end()) return;
  if (it->second->group != nullptr && it->second->group->owner != it->second.get()) return;  // a beam's own sequence
  RequestOutput o;
  o.id = id;
  m.finish(*it->second, "abort", m.pending, &o);
  m.refresh_kv_stats();
}

RequestState* Engine::Impl::prompt_parent_for(const RequestState& r) {
  if (r.wants_prompt_rows() || r.req.kv_import) return nullptr;  // it needs rows of its own, or brings its K/V
  const auto it = unstarted_prompts.find(r.prompt_hash);
  if (it == unstarted_prompts.end()) return nullptr;
  const auto p = requests.find(it->second);
  if (p == requests.end() || p->second->seq.status != SeqStatus::Waiting || p->second->seq.n_cached_prompt >= 0 ||
      p->second->seq.tokens != r.seq.tokens) {
    unstarted_prompts.erase(it);  // started, finished or a hash collision
    return nullptr;
  }
  return p->second.get();
}

void Engine::Impl::release_children(RequestState& r) {
  for (RequestState* c : r.children) {
    c->parent = nullptr;
    scheduler.add(&c->seq);
  }
  r.children.clear();
}

void Engine::Impl::finish(RequestState& r, const std::string& reason, std::vector<RequestOutput>& outputs,
                          RequestOutput* o) {
  const auto now = Clock::now();
  release_children(r);
  if (r.parent != nullptr) {
    auto& siblings = r.parent->children;
    siblings.erase(std::remove(siblings.begin(), siblings.end(), &r), siblings.end());
    r.parent = nullptr;
  }
  if (const auto it = unstarted_prompts.find(r.prompt_hash); it != unstarted_prompts.end() && it->second == r.id)
    unstarted_prompts.erase(it);
  if (r.seq.n_draft > 0) {
    // Unverified drafts never reach the prefix cache (finish publishes computed full blocks).
    if (r.seq.status == SeqStatus::Running && r.seq.n_computed > 0)
      scheduler.truncate(&r.seq, static_cast<int64_t>(r.seq.tokens.size()) - r.seq.n_draft);
    drop_drafts(r);
  }
  if (drafter) drafter->release(r.id);
  o->finish_reason = reason;
  if (r.own_group) end_beams(r, o);  // the other beams end; a finished search's hypotheses and reason
  if (r.req.do_remote_decode && (reason == "stop" || reason == "length")) hold_kv(r, *o);
  scheduler.finish(&r.seq);
  r.finished = true;
  o->finished = true;
  RequestMetrics& mt = o->metrics;
  mt.n_prompt_tokens = r.seq.n_prompt;
  mt.n_cached_prompt_tokens = std::max<int64_t>(0, r.seq.n_cached_prompt);
  mt.n_output_tokens = r.seq.n_generated();
  if (r.own_group) {
    mt.n_output_tokens = 0;
    for (const BeamHypothesis& h : o->beams) mt.n_output_tokens += static_cast<int64_t>(h.tokens.size());
  }
  mt.n_preemptions = r.seq.n_preemptions;
  mt.e2e_s = seconds(r.arrival, now);
  if (mt.n_output_tokens > 0) mt.ttft_s = seconds(r.arrival, r.first_token);
  if (mt.n_output_tokens > 1) mt.tpot_s = seconds(r.first_token, now) / static_cast<double>(mt.n_output_tokens - 1);
  outputs.push_back(std::move(*o));
  requests.erase(r.id);  // r is gone from here on
}

void Engine::Impl::post_process(RequestState& r, std::span<const int32_t> tokens,
                                std::vector<RequestOutput>& outputs, std::vector<LogprobSummary> logprobs) {
  Sequence& s = r.seq;
  RequestOutput o;
  o.id = r.id;
  o.prompt_logprobs = std::move(r.pending_prompt_logprobs);
  r.pending_prompt_logprobs.clear();
  o.prompt_logits = std::move(r.pending_prompt_logits);
  r.pending_prompt_logits.clear();
  // The K/V of accepted drafts are computed; the sequence's count may run ahead of its tokens
  // until they are appended here.
  const int64_t n_computed = s.n_computed;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t token = tokens[i];
    s.tokens.push_back(token);
    if (s.n_generated() == 1) r.first_token = Clock::now();
    ++stats.n_generated_tokens;
    o.new_token_ids.push_back(token);
    if (!logprobs.empty()) o.logprobs.push_back(std::move(logprobs[i]));
    const auto& ids = r.req.stop_ids;
    const bool stop_token = std::find(ids.begin(), ids.end(), token) != ids.end();
    // A grammar that has ended stops the request as a stop id does (it has no drafts: see propose_drafts).
    const bool stop_id = stop_token || r.grammar_ended;
    // min_tokens: a stop string completed by an earlier token does not end the request.
    const bool may_stop = s.n_generated() >= r.req.min_tokens;
    bool stop_string = false;
    // A stop token's text is not part of the output unless include_stop_str_in_output (vLLM's
    // rule; EOS and end-of-turn tokens are special and decode to nothing unless
    // skip_special_tokens is false). It ends the request whatever its text: no stop-string check.
    std::string stop_token_text;
    if (r.decoder && stop_token && r.req.include_stop_str_in_output) stop_token_text = r.decoder->push(token);
    if (r.decoder && !stop_token) stop_string = r.stop_checker.push(r.decoder->push(token), o.text_delta, may_stop);
    const bool at_limit = (r.req.max_tokens > 0 && s.n_generated() >= r.req.max_tokens) ||
                          static_cast<int64_t>(s.tokens.size()) >= config.max_model_len;
    if (stop_id || stop_string || at_limit) {
      // Tokens after the one that stops are dropped, and so is the K/V computed for them.
      s.n_computed = std::min<int64_t>(n_computed, static_cast<int64_t>(s.tokens.size()));
      if (!stop_string && r.decoder)
        o.text_delta += r.stop_checker.flush(stop_token_text + r.decoder->flush(), may_stop && stop_token_text.empty());
      if (stop_token) o.stop_token = token;
      if (stop_string) o.stop_string = r.stop_checker.matched();
      finish(r, stop_id || stop_string ? "stop" : "length", outputs, &o);
      return;
    }
  }
  outputs.push_back(std::move(o));
}

void Engine::Impl::settle_drafts(RequestState& r, const Verification& v) {
  Sequence& s = r.seq;
  const int64_t n_draft = s.n_draft;
  const int64_t n_settled = static_cast<int64_t>(s.tokens.size()) - n_draft;
  ++stats.spec_num_drafts;
  stats.spec_num_draft_tokens += n_draft;
  stats.spec_num_accepted_tokens += v.n_accepted;
  for (int64_t i = 0; i < v.n_accepted; ++i) ++stats.spec_accepted_per_pos[static_cast<size_t>(i)];
  scheduler.truncate(&s, n_settled + v.n_accepted);
  s.n_draft = 0;
  s.tokens.resize(static_cast<size_t>(n_settled));
  r.draft_q.clear();
  drafter->on_verified(s.id, v.n_accepted, n_settled + static_cast<int64_t>(v.tokens.size()));
}

void Engine::Impl::propose_drafts() {
  const SpeculativeConfig& sc = config.speculative;
  const size_t n_running = scheduler.n_running();
  if (!drafter || n_running == 0) return;
  if (sc.disable_by_batch_size > 0 && n_running > static_cast<size_t>(sc.disable_by_batch_size)) return;
  // Decodes are not split across steps: keep 1 + k tokens of every running sequence in the budget.
  const int64_t k = std::min<int64_t>(sc.num_speculative_tokens,
                                      config.max_num_batched_tokens / static_cast<int64_t>(n_running) - 1);
  if (k <= 0) return;
  draft_requests.clear();
  draft_owners.clear();
  for (auto& [id, rp] : requests) {
    RequestState& r = *rp;
    const Sequence& s = r.seq;
    if (s.status != SeqStatus::Running || s.n_draft != 0 || !s.is_decode()) continue;
    // A grammar-constrained request samples under its token mask one token at a time: no drafts;
    // nor does one whose stop ids min_tokens still masks, nor one with allowed_token_ids or
    // bad_words (the mask is for one row); a beam's next token is the search's.
    if (r.masks_row() || r.group) continue;
    // Never more than the request may still emit: the drafts and the token after them count
    // toward max_tokens and max_model_len.
    int64_t room = std::min<int64_t>(k, config.max_model_len - static_cast<int64_t>(s.tokens.size()) - 1);
    if (r.req.max_tokens > 0) room = std::min(room, r.req.max_tokens - s.n_generated() - 1);
    if (room <= 0) continue;
    draft_requests.push_back({s.id, s.tokens, s.n_prompt, static_cast<int32_t>(room), &r.req.sampling});
    draft_owners.push_back(&r);
  }
  if (draft_requests.empty()) return;
  drafter->propose(draft_requests, drafts);
  const size_t n_vocab = static_cast<size_t>(model.hparams().n_vocab);
  for (size_t i = 0; i < draft_owners.size(); ++i) {
    RequestState& r = *draft_owners[i];
    Draft& d = drafts[i];
    if (d.ids.empty()) continue;
    KESTREL_ASSERT(d.ids.size() <= static_cast<size_t>(draft_requests[i].max_drafts) &&
                       (d.q.empty() || d.q.size() == d.ids.size() * n_vocab),
                   "Engine: the drafter's proposal does not fit its request");
    for (const int32_t id : d.ids)
      KESTREL_ASSERT(id >= 0 && static_cast<size_t>(id) < n_vocab, "Engine: draft token outside the vocabulary");
    r.seq.tokens.insert(r.seq.tokens.end(), d.ids.begin(), d.ids.end());
    r.seq.n_draft = static_cast<int64_t>(d.ids.size());
    r.draft_q = std::move(d.q);
  }
}

void Engine::Impl::build_batch(Pass& p) {
  const SchedulerOutput& out = p.out;
  StepBatch& batch = p.batch;
  std::vector<SampleRow>& sampling = p.sampling;
  batch.build(out, manager);
  sampling.clear();
  p.prompt_rows.clear();
  std::vector<int32_t>& rows = batch.logits_indices;
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledSeq& sc = out.scheduled[i];
    RequestState* r = requests.at(sc.seq->id).get();
    const int32_t n_rows = batch.n_logits_rows[i];
    if (n_rows == 0) continue;
    KESTREL_ASSERT(n_rows == 1 + sc.seq->n_draft, "Engine: a sequence's drafts without their logits rows");
    sampling.push_back({r, batch.first_logits_row[i] + n_rows - 1, sc.seq->n_draft});
  }
  // Children sample from their parent's last row, from a copy of it (the device sampler takes one
  // setting per row).
  const size_t n_parents = sampling.size();
  for (size_t i = 0; i < n_parents; ++i)
    for (RequestState* c : sampling[i].r->children) {
      sampling.push_back({c, static_cast<int32_t>(rows.size())});
      rows.push_back(rows[static_cast<size_t>(sampling[i].row)]);
    }
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledSeq& sc = out.scheduled[i];
    RequestState* r = requests.at(sc.seq->id).get();
    if (!r->wants_prompt_rows()) continue;
    // Row p's logits predict token p + 1: the prompt's tokens 1 .. n_prompt - 1 (the last prompt
    // position's row is the sampling row, for the first generated token).
    for (int64_t pos = sc.n_computed; pos < sc.n_computed + sc.n_new; ++pos)
      if (pos + 1 < sc.seq->n_prompt && pos + 1 >= r->next_prompt_target) {
        p.prompt_rows.push_back({r, pos + 1, static_cast<int32_t>(rows.size())});
        rows.push_back(batch.first_token[i] + static_cast<int32_t>(pos - sc.n_computed));
      }
  }
}

// The prompt rows (after the sampling rows in `logits`): their logprobs and raw logits into each
// request's pending lists; a row with a NaN, +inf or no finite logit marks its request
// (finish_pass ends it with an error).
void Engine::Impl::prompt_logprobs_from(const Pass& p, std::span<const float> logits) {
  const std::vector<PromptRow>& prompt_rows = p.prompt_rows;
  const size_t n_vocab = static_cast<size_t>(model.hparams().n_vocab);
  for (size_t i = 0; i < prompt_rows.size(); ++i) {
    RequestState& r = *prompt_rows[i].r;
    if (r.prompt_nan) continue;
    const auto row = logits.subspan(static_cast<size_t>(prompt_rows[i].row) * n_vocab, n_vocab);
    const float mx = *std::max_element(row.begin(), row.end());
    if (!std::isfinite(mx) || std::any_of(row.begin(), row.end(), [](float x) { return std::isnan(x); })) {
      r.prompt_nan = true;
      continue;
    }
    const int64_t target = prompt_rows[i].target;
    if (r.req.prompt_logprobs >= 0)
      r.pending_prompt_logprobs.push_back(
          compute_logprobs(row, r.seq.tokens[static_cast<size_t>(target)], r.req.prompt_logprobs));
    if (r.req.prompt_logits) r.pending_prompt_logits.insert(r.pending_prompt_logits.end(), row.begin(), row.end());
    r.next_prompt_target = target + 1;
  }
}

void Engine::Impl::measure_prefill(const SchedulerOutput& out, double s) {
  if (config.preemption_mode != PreemptionMode::Auto || manager.n_swap_blocks() == 0) return;
  // Prefill-dominated steps only: a decode token costs the pass's weight reads, not a prefill
  // token's arithmetic. Only passes submitted and collected in one step are timed.
  if (out.n_tokens == 0 || 2 * out.n_prefill_tokens < out.n_tokens) return;
  const double per_token = s / static_cast<double>(out.n_tokens);
  prefill_seconds_per_token =
      prefill_seconds_per_token == 0 ? per_token : 0.75 * prefill_seconds_per_token + 0.25 * per_token;
  const double link = runner->host_link_bytes_per_s();
  const double block_bytes = static_cast<double>(runner->kv_bytes_per_token()) * config.block_size;
  scheduler.set_preemption_costs(
      PreemptionCosts{link > 0 ? 2.0 * block_bytes / link : 0.0, link > 0 ? prefill_seconds_per_token : 0.0});
}

void Engine::Impl::collect(std::vector<RequestOutput>& outputs) {
  Pass p = std::move(passes.front());
  passes.pop_front();
  std::span<const float> logits;
  try {
    logits = runner->collect();
  } catch (...) {
    for (const ScheduledSeq& sc : p.out.scheduled) sc.seq->in_flight = false;
    throw;
  }
  if (passes.empty()) idle_since = Clock::now();
  finish_pass(p, logits, {}, outputs);
  spare_pass = std::move(p);
}

std::vector<RequestOutput> Engine::step() {
  Impl& m = *impl_;
  std::vector<RequestOutput> outputs = std::move(m.pending);
  m.pending.clear();
  m.expire_imports(outputs);
  // With pipelined passes (pipeline parallelism), each step submits a pass of sequences not in
  // flight and collects the oldest once depth passes are in flight, so a stage is busy with each.
  const int depth = m.pipeline_depth();
  if (depth == 1) m.drain(outputs);
  else if (m.passes.size() >= static_cast<size_t>(depth)) m.collect(outputs);
  m.propose_drafts();
  const SchedulerOutput out = m.scheduler.schedule(depth);
  m.stats.n_preemptions += static_cast<int64_t>(out.preempted.size());
  m.stats.n_swap_preemptions += out.n_swapped;
  // Block copies and K/V writes happen with no pass in flight (ModelRunner::submit); such a step's
  // pass is collected in the same step. The passes drained here hold none of this step's
  // sequences.
  const bool block_ops = !out.swap_out.empty() || !out.offload.empty() || !out.load.empty() || !out.copies.empty() ||
                         !out.swap_in.empty() || !out.imported.empty();
  if (block_ops) m.drain(outputs);
  // Before anything else: the swapped-out blocks are free, and this step's copies may take them.
  if (!out.swap_out.empty()) m.runner->swap_out(out.swap_out);
  // Evicted cached blocks to the host tier, before this step's copies and pass reuse them, and
  // the host tier's hits back, each into a block that may be one just evicted: one call, so a
  // backend with a copy stream per direction overlaps them (ModelRunner::swap_out_in).
  if (!out.offload.empty() || !out.load.empty()) m.runner->swap_out_in(out.offload, out.load);
  if (m.drafter) {
    for (Sequence* s : out.preempted) m.drafter->release(s->id);  // the scheduler dropped its drafts
    for (RequestState* r : m.draft_owners) {
      if (r->seq.n_draft == 0) continue;
      const bool ran = std::any_of(out.scheduled.begin(), out.scheduled.end(),
                                   [&](const ScheduledSeq& sc) { return sc.seq == &r->seq; });
      if (!ran) Impl::drop_drafts(*r);
    }
    m.draft_owners.clear();
  }
  m.refresh_kv_stats();
  if (out.empty()) {
    m.idle_since.reset();  // waiting for requests, not for the host
    if (!m.passes.empty()) m.collect(outputs);  // nothing else to run: wait for the oldest pass
    return outputs;
  }
  ++m.stats.n_steps;
  if (!out.copies.empty()) m.runner->copy_blocks(out.copies);
  if (!out.swap_in.empty()) m.runner->swap_in(out.swap_in);
  for (const SchedulerOutput::Import& im : out.imported) m.write_import(im);
  Impl::Pass p = std::move(m.spare_pass);  // its arrays' capacity from an earlier pass
  p.out = out;
  m.build_batch(p);
  m.stats.n_prompt_tokens_computed += out.n_prefill_tokens;
  if (!m.passes.empty()) ++m.stats.n_pipelined_passes;
  const ForwardBatch fb = p.batch.view();
  // Backends that sample on the device (CUDA) do so whenever every sampling request's chain is one
  // they implement (no logit bias, no penalties): the logits then never leave the device. The
  // uniform each sampler would have drawn goes with its row, so the token is the one the CPU
  // sampler would pick from the same logits.
  // A request that wants logprobs needs the logits on the host (the device sampler returns ids).
  // Prompt rows need the logits on the host too.
  // So does the first sample of a request that wants its prompt's raw logits (that row is the last).
  // Drafts are verified on the device when q is one-hot (accept_sampled_drafts): each of the
  // 1 + n_draft rows is sampled with the uniform the host verifier would draw there; a draft
  // model's sampled q needs p and q together, on the host (verify_drafts).
  bool on_device = m.runner->samples_on_device() && p.prompt_rows.empty() && m.passes.empty();
  for (size_t i = 0; on_device && i < p.sampling.size(); ++i) {
    const RequestState& r = *p.sampling[i].r;
    on_device = !r.group && r.sampler->device_compatible() && r.req.logprobs < 0 &&
                !(r.req.prompt_logits && r.seq.n_generated() == 0) &&
                (p.sampling[i].n_draft == 0 || (m.config.speculative_verify_on_device && r.draft_q.empty()));
  }
  p.on_device = on_device;
  p.start = Clock::now();
  if (on_device) {
    // One setting per logits row; every row is a sampling row here (no prompt rows). A grammar
    // row samples under its token mask, which depends only on the tokens accepted so far: the
    // runner has it computed (Impl::fill_token_masks) while the device runs the layers (grammar
    // requests get no drafts). A verified sequence's rows take the uniforms its next draws would
    // be; accept_sampled_drafts takes those its emitted tokens used.
    m.row_sampling.assign(p.batch.logits_indices.size(), RowSampling{});
    bool masked = false;
    for (const Impl::SampleRow& sr : p.sampling) {
      RequestState* r = sr.r;
      const SamplingParams& sp = r->sampler->params();
      if (sr.n_draft > 0) {
        m.draft_uniforms.resize(static_cast<size_t>(sr.n_draft + 1));
        r->sampler->peek_uniforms(m.draft_uniforms);
        for (int64_t j = 0; j <= sr.n_draft; ++j)
          m.row_sampling[static_cast<size_t>(sr.row - sr.n_draft + j)] =
              RowSampling{sp.temperature, sp.top_k, sp.top_p, sp.min_p, m.draft_uniforms[static_cast<size_t>(j)], 0};
        continue;
      }
      const bool row_masked = r->masks_row();
      m.row_sampling[static_cast<size_t>(sr.row)] =
          RowSampling{sp.temperature, sp.top_k, sp.top_p, sp.min_p, r->sampler->take_uniform(), row_masked ? 1 : 0};
      masked |= row_masked;
    }
    TokenMaskFill fill;
    if (masked)
      fill = [&m, &p](std::span<uint32_t> masks) {
        const auto t0 = Clock::now();
        m.fill_token_masks(p, masks);
        m.stats.mask_fill_seconds += seconds(t0, Clock::now());
      };
    m.pass_launching();
    const std::span<const int32_t> device_tokens = m.runner->forward_sample(fb, m.row_sampling, fill);
    m.idle_since = Clock::now();
    if (masked) m.stats.mask_wait_seconds = m.runner->mask_wait_seconds();
    p.timed = true;
    m.finish_pass(p, {}, device_tokens, outputs);
    m.spare_pass = std::move(p);
    return outputs;
  }
  m.pass_launching();
  m.runner->submit(fb);  // copies what it keeps of the batch: p's arrays may move
  for (const ScheduledSeq& sc : out.scheduled) sc.seq->in_flight = true;
  p.timed = depth == 1 || block_ops;
  m.passes.push_back(std::move(p));
  if (m.passes.back().timed) m.collect(outputs);
  return outputs;
}

void Engine::Impl::finish_pass(Pass& p, std::span<const float> logits, std::span<const int32_t> device_tokens,
                               std::vector<RequestOutput>& outputs) {
  Impl& m = *this;
  const SchedulerOutput& out = p.out;
  const bool on_device = p.on_device;
  for (const ScheduledSeq& sc : out.scheduled) sc.seq->in_flight = false;
  if (p.timed) m.measure_prefill(out, seconds(p.start, Clock::now()));
  if (!out.swap_in.empty() || !out.load.empty()) {
    // After the pass, which waited for the copies: reading their timing does not stall them.
    const ModelRunner::HostCopyTotals h2d = m.runner->host_to_device_totals();
    m.stats.host_to_device_bytes = h2d.bytes;
    m.stats.host_to_device_seconds = h2d.seconds;
  }
  m.scheduler.on_step_done(out);
  if (!m.stats.moe_layers.empty()) m.stats.expert_tokens = m.runner->expert_token_counts();
  m.prompt_logprobs_from(p, logits);
  std::vector<SampleRow>& sampling = p.sampling;
  // Children of a parent whose prompt is now computed share its blocks from here on; one that
  // finds no sequence slot computes the prompt itself later (mostly from the prefix cache).
  std::vector<bool> skip(sampling.size(), false);
  for (size_t i = 0; i < sampling.size(); ++i) {
    RequestState& c = *sampling[i].r;
    if (c.parent == nullptr) continue;
    RequestState& parent = *c.parent;
    c.parent = nullptr;
    if (!m.scheduler.fork(&parent.seq, &c.seq)) {
      m.scheduler.add(&c.seq);
      skip[i] = true;
    }
  }
  for (size_t i = 0; i < sampling.size(); ++i)
    if (sampling[i].r->seq.n_generated() == 0) sampling[i].r->children.clear();
  // Grammar rows sampled on the device under their masks: their matchers take the tokens in
  // parallel, off the serial loop below (an accept is ~0.5-4 us; a step may hold hundreds).
  if (on_device) m.accept_device_tokens(p, device_tokens, skip);

  const int64_t n_vocab = m.model.hparams().n_vocab;
  for (size_t i = 0; i < sampling.size(); ++i) {
    if (skip[i]) continue;
    RequestState& r = *sampling[i].r;
    const size_t row_index = static_cast<size_t>(sampling[i].row);
    // OpenAI semantics: presence/frequency penalties count generated tokens only. Non-finite
    // logits (corrupt weights, or extreme logits under a request's penalties) end this request
    // with an error, not the engine; the sampler finds them in the pass over the logits it makes
    // anyway (the device sampler marks a non-finite row with -1). Any other sampler error is this
    // request's too. Logprobs come from the raw logits on the host (logprobs.h).
    Verification v;  // the emitted tokens: one, or the accepted drafts and the token after them
    const int64_t n_draft = sampling[i].n_draft;
    try {
      if (r.prompt_nan) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
      if (!r.grammar_error.empty()) throw grammar::GrammarError("grammar", r.grammar_error);
      if (!r.import_error.empty()) {
        r.seq.n_computed = 0;  // its blocks hold no K/V: finish must not publish them to the prefix cache
        throw Error(r.import_error);
      }
      if (on_device && n_draft > 0) {
        const size_t first = row_index - static_cast<size_t>(n_draft);
        v = accept_sampled_drafts(*r.sampler, device_tokens.subspan(first, static_cast<size_t>(n_draft + 1)),
                                  std::span<const int32_t>(r.seq.tokens).last(static_cast<size_t>(n_draft)));
      } else if (on_device) {
        if (r.masks_row() && r.mask_empty) throw NoTokenAllowedError();  // the mask filled for the pass
        v.tokens.push_back(device_tokens[row_index]);
        if (v.tokens[0] < 0) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
      } else if (n_draft > 0) {
        const size_t nv = static_cast<size_t>(n_vocab);
        const auto rows = logits.subspan((row_index - static_cast<size_t>(n_draft)) * nv, static_cast<size_t>(n_draft + 1) * nv);
        v = verify_drafts(*r.sampler, rows, r.seq.tokens, n_draft, static_cast<size_t>(r.seq.n_prompt), r.draft_q,
                          r.req.logprobs);
      } else {
        auto row = logits.subspan(row_index * static_cast<size_t>(n_vocab), static_cast<size_t>(n_vocab));
        if (r.group) {  // a beam: the search picks its next token once every beam has its row
          m.take_beam_row(r, row);
          continue;
        }
        if (r.req.prompt_logits && r.seq.n_generated() == 0)
          r.pending_prompt_logits.insert(r.pending_prompt_logits.end(), row.begin(), row.end());
        // Grammar and min_tokens: blocked tokens get -inf before the chain (logprobs then see the
        // masked row).
        if (r.masks_row()) row = m.masked_logits(r, row);
        if (r.req.logprobs >= 0) {
          SampledToken st =
              r.sampler->sample_with_logprobs(row, r.seq.tokens, r.req.logprobs, static_cast<size_t>(r.seq.n_prompt));
          v.tokens.push_back(st.token);
          v.logprobs.push_back(std::move(st.logprobs));
        } else {
          v.tokens.push_back(r.sampler->sample(row, r.seq.tokens, static_cast<size_t>(r.seq.n_prompt)));
        }
      }
      if (r.matcher) {
        const int32_t token = v.tokens.front();
        const bool accepted_already = on_device && n_draft == 0;  // accept_device_tokens
        if (accepted_already ? m.grammar_accepted[i] != 1 : !r.matcher->accept_token(token))
          throw Error("grammar: sampled token " + std::to_string(token) + " is not one the grammar allows");
        if (!accepted_already) r.grammar_ended = r.matcher->is_terminated();
      }
    } catch (const Error& e) {
      RequestOutput o;
      o.id = r.id;
      o.error = std::string(e.what()) + " (position " +
                std::to_string(static_cast<int64_t>(r.seq.tokens.size()) - n_draft - 1) + ")";
      o.error_from_request = dynamic_cast<const NoTokenAllowedError*>(&e) != nullptr ||
                             dynamic_cast<const grammar::GrammarError*>(&e) != nullptr;
      m.finish(r, "error", outputs, &o);  // rolls back its drafts
      continue;
    }
    if (n_draft > 0) m.settle_drafts(r, v);
    m.post_process(r, v.tokens, outputs, std::move(v.logprobs));
  }
  // A prompt chunk with non-finite logits whose request did not sample this step ends here.
  std::vector<RequestId> nan_ids;
  for (const PromptRow& pr : p.prompt_rows)
    // (Requests that sampled may be gone by now: test membership before touching pr.r.)
    if (std::none_of(sampling.begin(), sampling.end(), [&](const SampleRow& sr) { return sr.r == pr.r; }) &&
        pr.r->prompt_nan)
      nan_ids.push_back(pr.r->id);
  for (const RequestId id : nan_ids) {
    const auto it = m.requests.find(id);
    if (it == m.requests.end()) continue;  // already ended (a repeated id)
    RequestOutput o;
    o.id = id;
    o.error = std::string(NonFiniteLogitsError(NonFiniteLogitsError::Source::Model).what()) + " (prompt)";
    m.finish(*it->second, "error", outputs, &o);
  }
  m.step_beams(outputs);
  m.refresh_kv_stats();
}

}  // namespace kestrel
