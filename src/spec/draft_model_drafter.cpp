#include "spec/draft_model_drafter.h"

#include <xxhash.h>

#include <algorithm>
#include <string>

#include "backend/kv_geometry.h"
#include "core/error.h"
#include "memory/kv_planner.h"

namespace kestrel {

namespace {

constexpr int64_t kMaxDraftKvBytes = int64_t{2} << 30;  // the engine's CPU default pool cap

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t vocab_hash(const Tokenizer& t) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (int32_t id = 0; id < t.n_vocab(); ++id) {
    const TokenData& d = t.token(id);
    const uint32_t n = static_cast<uint32_t>(d.text.size());
    const uint8_t type = static_cast<uint8_t>(d.type);
    XXH3_64bits_update(st, &n, sizeof n);
    XXH3_64bits_update(st, d.text.data(), d.text.size());
    XXH3_64bits_update(st, &type, sizeof type);
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

// The first id whose token differs between the two tokenizers (n_vocab equal), for the message.
int32_t first_difference(const Tokenizer& a, const Tokenizer& b) {
  for (int32_t id = 0; id < a.n_vocab(); ++id)
    if (a.token(id).text != b.token(id).text || a.token(id).type != b.token(id).type) return id;
  return -1;
}

}  // namespace

double draft_uniform(uint64_t seed, int64_t position) {
  const uint64_t x = splitmix64(splitmix64(seed ^ 0x6472616674ull) ^ static_cast<uint64_t>(position));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

int32_t draft_kv_blocks(const ModelHparams& draft, const DrafterContext& c) {
  const int64_t len = std::min<int64_t>(c.max_model_len, draft.n_ctx_train);
  const int64_t per_seq = (len + c.block_size - 1) / c.block_size;
  const int64_t bytes_per_block = kv_bytes_per_token(kv_geometry(draft), c.kv_dtype) * c.block_size;
  const int64_t cap = std::max<int64_t>(per_seq, kMaxDraftKvBytes / std::max<int64_t>(1, bytes_per_block));
  return static_cast<int32_t>(std::min<int64_t>(per_seq * std::max(1, c.max_num_seqs), cap));
}

void check_draft_vocabulary(const LlamaModel& target, const Tokenizer* tt, const LlamaModel& draft, const Tokenizer* dt) {
  const std::string what = "speculative config: the draft model " + draft.path();
  const int64_t nt = target.hparams().n_vocab, nd = draft.hparams().n_vocab;
  if (nt != nd)
    throw Error(what + " has a vocabulary of " + std::to_string(nd) + " tokens but the target " + target.path() +
                " has " + std::to_string(nt) + "; a draft model must share the target's tokenizer");
  if (tt == nullptr || dt == nullptr) return;
  if (tt->n_vocab() != dt->n_vocab())
    throw Error(what + ": its tokenizer has " + std::to_string(dt->n_vocab()) + " tokens, the target's " +
                std::to_string(tt->n_vocab()) + "; a draft model must share the target's tokenizer");
  const std::pair<const char*, std::pair<int32_t, int32_t>> ids[] = {{"BOS", {tt->bos_id(), dt->bos_id()}},
                                                                    {"EOS", {tt->eos_id(), dt->eos_id()}},
                                                                    {"UNK", {tt->unk_id(), dt->unk_id()}}};
  for (const auto& [name, v] : ids)
    if (v.first != v.second)
      throw Error(what + ": its " + name + " id is " + std::to_string(v.second) + ", the target's " +
                  std::to_string(v.first) + "; a draft model must share the target's tokenizer");
  if (vocab_hash(*tt) != vocab_hash(*dt)) {
    const int32_t id = first_difference(*tt, *dt);
    throw Error(what + ": its vocabulary differs from the target's (token " + std::to_string(id) + " is '" +
                dt->token(id).text + "', the target's '" + tt->token(id).text +
                "'); a draft model must share the target's tokenizer");
  }
}

DraftModelDrafter::DraftModelDrafter(const DrafterContext& context, DraftModel draft)
    : ctx_(context), draft_(std::move(draft)) {
  if (!draft_.model || ctx_.target == nullptr) throw Error("speculative config: draft_model needs a loaded draft model");
  check_draft_vocabulary(*ctx_.target, ctx_.target_tokenizer, *draft_.model, draft_.tokenizer.get());
  const ModelHparams& hp = draft_.model->hparams();
  if (!draft_.runner) {
    RunnerOptions o;
    o.block_size = ctx_.block_size;
    o.n_kv_blocks = draft_kv_blocks(hp, ctx_);
    o.kv_dtype = ctx_.kv_dtype;
    o.n_threads = ctx_.n_threads;
    draft_.runner = make_cpu_model_runner(*draft_.model, o);
  }
  if (draft_.runner->block_size() != ctx_.block_size)
    throw Error("speculative config: the draft model's KV blocks hold " + std::to_string(draft_.runner->block_size()) +
                " tokens but the target's " + std::to_string(ctx_.block_size));
  kv_.emplace(KvManagerConfig{draft_.runner->n_kv_blocks(), ctx_.block_size, ctx_.enable_prefix_caching});
  max_len_ = std::min<int64_t>(ctx_.max_model_len, hp.n_ctx_train);
  n_vocab_ = static_cast<size_t>(hp.n_vocab);
}

DraftModelDrafter::~DraftModelDrafter() = default;

void DraftModelDrafter::release(SeqId id) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  if (kv_->has(id)) kv_->free(id, it->second.seq.tokens, it->second.seq.n_computed);
  seqs_.erase(it);
}

void DraftModelDrafter::on_verified(SeqId id, int64_t /*n_accepted*/, int64_t n_tokens) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Sequence& s = it->second.seq;
  // The sequence's tokens are the draft's up to the accepted drafts (n_tokens - 1 of them); the
  // token after them is the target's and not computed by the draft yet.
  const int64_t keep = std::min<int64_t>(s.n_computed, n_tokens - 1);
  if (kv_->has(id)) kv_->truncate(id, keep);
  s.n_computed = keep;
  s.tokens.resize(static_cast<size_t>(std::min<int64_t>(keep, static_cast<int64_t>(s.tokens.size()))));
}

bool DraftModelDrafter::reserve(SeqState& st, int64_t n_tokens, std::span<const DraftRequest> keep) {
  Sequence& s = st.seq;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (!kv_->has(s.id)) {
      if (kv_->can_allocate(s.tokens, n_tokens, ctx_.enable_prefix_caching)) {
        s.n_computed = kv_->allocate(s.id, s.tokens, n_tokens, ctx_.enable_prefix_caching);
        return true;
      }
    } else if (kv_->can_append(s.id, s.n_computed, n_tokens)) {
      kv_->append(s.id, s.tokens, s.n_computed, n_tokens, copies_);
      return true;
    }
    if (attempt > 0) break;
    // Free the draft KV of sequences not drafting now (preempted or over disable_by_batch_size);
    // they catch up from their tokens when they draft again.
    std::vector<SeqId> idle;
    for (const auto& entry : seqs_) {
      const SeqId id = entry.first;
      if (std::none_of(keep.begin(), keep.end(), [&](const DraftRequest& r) { return r.id == id; })) idle.push_back(id);
    }
    if (idle.empty()) break;
    for (const SeqId id : idle) release(id);
  }
  return false;
}

void DraftModelDrafter::run_pass(const SchedulerOutput& so, const std::vector<size_t>& index,
                                 std::span<const DraftRequest> requests, std::vector<Draft>& out) {
  if (!copies_.empty()) {
    draft_.runner->copy_blocks(copies_);
    copies_.clear();
  }
  batch_.build(so, *kv_);
  const ForwardBatch fb = batch_.view();
  // Greedy rows whose chain the device sampler runs take the argmax there; anything else reads
  // the logits on the host.
  bool on_device = draft_.runner->samples_on_device();
  for (size_t i = 0; on_device && i < so.scheduled.size(); ++i) {
    const SeqState& st = seqs_.at(so.scheduled[i].seq->id);
    on_device = st.greedy && st.sampler->device_compatible();
  }
  std::span<const float> logits;
  std::span<const int32_t> device_tokens;
  if (on_device) {
    row_sampling_.assign(batch_.logits_indices.size(), RowSampling{0.0f, 0, 1.0f, 0.0f, 0.0});
    device_tokens = draft_.runner->forward_sample(fb, row_sampling_);
  } else {
    logits = draft_.runner->forward(fb);
  }
  for (size_t i = 0; i < so.scheduled.size(); ++i) {
    const ScheduledSeq& sc = so.scheduled[i];
    SeqState& st = seqs_.at(sc.seq->id);
    st.seq.n_computed = sc.n_computed + sc.n_new;
    if (batch_.n_logits_rows[i] == 0) continue;
    const size_t row = static_cast<size_t>(batch_.first_logits_row[i]);
    const DraftRequest& rq = requests[index[i]];
    Draft& d = out[index[i]];
    const int64_t position = static_cast<int64_t>(st.seq.tokens.size());
    int32_t token = -1;
    try {
      if (on_device) {
        token = device_tokens[row];
        if (token < 0) throw NonFiniteLogitsError(NonFiniteLogitsError::Source::Model);
      } else {
        const auto lrow = logits.subspan(row * n_vocab_, n_vocab_);
        const size_t n_prompt = static_cast<size_t>(rq.n_prompt);
        if (st.greedy) {
          token = st.sampler->sample(lrow, st.seq.tokens, n_prompt);  // the argmax after bias and penalties
        } else {
          const auto q = st.sampler->distribution(lrow, st.seq.tokens, n_prompt);
          // Inverse CDF over the candidates in the chain's order (as Sampler draws).
          double total = 0.0;
          for (const TokenCandidate& c : q) total += c.prob;
          const double target = draft_uniform(st.seed, position) * total;
          double cum = 0.0;
          for (const TokenCandidate& c : q) {
            if (c.prob <= 0.0f) continue;
            cum += c.prob;
            token = c.id;
            if (target < cum) break;
          }
          const size_t at = d.q.size();
          d.q.resize(at + n_vocab_, 0.0f);
          for (const TokenCandidate& c : q) d.q[at + static_cast<size_t>(c.id)] = c.prob;
        }
      }
    } catch (const NonFiniteLogitsError&) {
      token = -1;  // the draft's logits are unusable here: no more drafts for this sequence (the target decides)
    }
    if (token < 0) continue;
    d.ids.push_back(token);
    st.seq.tokens.push_back(token);
  }
}

void DraftModelDrafter::propose(std::span<const DraftRequest> requests, std::vector<Draft>& out) {
  out.assign(requests.size(), Draft{});
  // Sync: each sequence's draft tokens become its tokens, the K/V of their common prefix kept.
  std::vector<size_t> active;
  std::vector<int32_t> want(requests.size(), 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const DraftRequest& rq = requests[i];
    const int64_t len = static_cast<int64_t>(rq.tokens.size());
    // The draft computes positions up to len + k - 2 (its last draft's K/V is never needed).
    const int64_t k = std::min<int64_t>(rq.max_drafts, max_len_ - len + 1);
    if (k <= 0 || len == 0) {
      release(rq.id);
      continue;
    }
    SeqState& st = seqs_[rq.id];
    if (!st.sampler) {
      SamplingParams p;
      p.temperature = 0.0f;
      if (rq.sampling != nullptr) p = *rq.sampling;
      st.sampler.emplace(p, static_cast<int32_t>(n_vocab_));
      st.greedy = p.temperature == 0.0f;
      st.seed = p.seed;
      st.seq.id = rq.id;
      st.seq.status = SeqStatus::Running;
    }
    Sequence& s = st.seq;
    int64_t keep = 0;
    const int64_t limit = std::min<int64_t>(s.n_computed, len - 1);
    while (keep < limit && s.tokens[static_cast<size_t>(keep)] == rq.tokens[static_cast<size_t>(keep)]) ++keep;
    if (kv_->has(rq.id) && keep < s.n_computed) kv_->truncate(rq.id, keep);
    s.n_computed = keep;
    s.tokens.assign(rq.tokens.begin(), rq.tokens.end());
    s.n_prompt = rq.n_prompt;
    if (!reserve(st, len, requests)) {
      release(rq.id);
      continue;
    }
    active.push_back(i);
    want[i] = static_cast<int32_t>(k);
  }
  // Catch-up: the uncomputed tokens in chunks under the token budget; the pass that reaches a
  // sequence's last token samples its draft 0.
  const int64_t budget = std::max<int64_t>(1, ctx_.max_num_batched_tokens);
  for (;;) {
    SchedulerOutput so;
    std::vector<size_t> index;
    int64_t left = budget;
    for (const size_t i : active) {
      Sequence& s = seqs_.at(requests[i].id).seq;
      const int64_t todo = s.n_uncomputed();
      if (todo <= 0 || !out[i].ids.empty()) continue;
      if (left <= 0) break;
      const int64_t n = std::min(todo, left);
      so.scheduled.push_back({&s, s.n_computed, n});
      index.push_back(i);
      left -= n;
    }
    if (so.scheduled.empty()) break;
    run_pass(so, index, requests, out);
    // A sequence whose last token ran without giving a draft (non-finite logits) stops here.
    for (const size_t i : index)
      if (seqs_.at(requests[i].id).seq.n_uncomputed() == 0 && out[i].ids.empty()) want[i] = 0;
  }
  // Decode: draft j + 1 from draft j, one token per sequence per pass.
  for (int32_t j = 1;; ++j) {
    SchedulerOutput so;
    std::vector<size_t> index;
    for (const size_t i : active) {
      if (static_cast<int32_t>(out[i].ids.size()) != j || want[i] <= j) continue;
      if (static_cast<int64_t>(so.scheduled.size()) >= budget) break;  // the rest stop at j drafts
      SeqState& st = seqs_.at(requests[i].id);
      if (!reserve(st, st.seq.n_computed + 1, requests)) continue;
      so.scheduled.push_back({&st.seq, st.seq.n_computed, 1});
      index.push_back(i);
    }
    if (so.scheduled.empty()) break;
    run_pass(so, index, requests, out);
  }
}

}  // namespace kestrel
