// Beam-search requests in the engine: one request owns up to beam_width sequences, one per live
// beam, which share their common prefix's KV blocks (KvManager::fork, copy-on-write): a beam
// continued by several candidates forks, one continued by none frees its blocks, and the prompt is
// computed once. The ranking is BeamSearch's (beam_search.h); this file only maps beams to
// sequences and keeps them in step.
//
// Lockstep: a beam whose logits row arrived keeps its best tokens (top_logprobs) and waits fully
// computed, which the scheduler skips (nothing left to run), until every live beam of its group
// has its row; a preempted beam recomputes its tokens and brings its row again (the same bits on
// the CPU). Each search step is made after the sampling loop, so no beam's tokens change while
// rows of the same step are still being read.
#include <algorithm>

#include "core/error.h"
#include "engine/engine_impl.h"

namespace kestrel {

using engine_detail::BeamGroup;
using engine_detail::Clock;
using engine_detail::RequestState;

void Engine::Impl::start_beams(RequestState& r) {
  const Request& q = r.req;
  q.beam.validate();
  if (q.logprobs >= 0) throw Error("beam search does not return per-token logprobs (each beam has its cumulative logprob)");
  if (q.prompt_logprobs >= 0 || q.prompt_logits) throw Error("beam search does not take prompt_logprobs or prompt_logits");
  if (!q.stop.empty()) throw Error("beam search does not take stop strings (stop ids end a beam)");
  if (q.grammar) throw Error("beam search does not take a grammar");
  if (q.min_tokens > 0) throw Error("beam search does not take min_tokens");
  if (!q.allowed_token_ids.empty() || !q.bad_words.empty())
    throw Error("beam search does not take allowed_token_ids or bad_words (beams rank the raw logits)");
  const int64_t room = config.max_model_len - r.seq.n_prompt;
  const int64_t max_new = q.max_tokens > 0 ? std::min(q.max_tokens, room) : room;
  r.own_group = std::make_unique<BeamGroup>(q.beam, q.stop_ids, max_new);
  r.group = r.own_group.get();
  r.group->owner = &r;
  r.group->slots = {&r};
  r.group->live = {&r};
}

void Engine::Impl::take_beam_row(RequestState& r, std::span<const float> row) {
  BeamGroup& g = *r.group;
  if (std::find(beam_groups_ready.begin(), beam_groups_ready.end(), g.owner->id) == beam_groups_ready.end())
    beam_groups_ready.push_back(g.owner->id);
  if (!top_logprobs(row, g.search.candidates_per_beam(), r.beam_row)) {
    g.error = std::string(NonFiniteLogitsError(NonFiniteLogitsError::Source::Model).what()) + " (position " +
              std::to_string(static_cast<int64_t>(r.seq.tokens.size()) - 1) + ")";
    return;
  }
  r.has_beam_row = true;
}

void Engine::Impl::step_beams(std::vector<RequestOutput>& outputs) {
  std::vector<RequestId> owners;
  owners.swap(beam_groups_ready);
  for (const RequestId id : owners) {
    const auto it = requests.find(id);
    if (it == requests.end()) continue;
    RequestState& owner = *it->second;
    BeamGroup& g = *owner.group;
    if (!g.error.empty()) {
      RequestOutput o;
      o.id = id;
      o.error = g.error;
      finish(owner, "error", outputs, &o);
      continue;
    }
    if (!std::all_of(g.live.begin(), g.live.end(), [](const RequestState* b) { return b->has_beam_row; })) {
      // A beam waiting for admission (preempted, or its fork found no sequence slot) must not wait
      // behind its own siblings: those with their rows step aside (park: blocks freed, full ones
      // kept in the prefix cache) until the group's step, which queues the continued ones again.
      const bool blocked = std::any_of(g.live.begin(), g.live.end(), [](const RequestState* b) {
        return !b->has_beam_row && b->seq.status == SeqStatus::Waiting;
      });
      if (blocked)
        for (RequestState* b : g.live)
          if (b->has_beam_row) scheduler.finish(&b->seq);
      continue;
    }
    std::vector<BeamRow> rows;
    rows.reserve(g.live.size());
    for (RequestState* b : g.live) {
      rows.push_back(std::move(b->beam_row));
      b->has_beam_row = false;
    }
    const std::vector<BeamSearch::Next> next = g.search.step(rows);
    if (owner.first_token == Clock::time_point{}) owner.first_token = Clock::now();
    if (g.search.done()) {
      RequestOutput o;
      o.id = id;
      finish(owner, "", outputs, &o);  // end_beams fills in the hypotheses and the reason
      continue;
    }
    stats.n_generated_tokens += static_cast<int64_t>(next.size());
    // Each continued beam's first candidate keeps its sequence; the beams not continued end, and
    // their slots take the further candidates as forks.
    std::vector<RequestState*> keeper(g.live.size(), nullptr);
    std::vector<RequestState*> live(next.size(), nullptr);
    for (size_t i = 0; i < next.size(); ++i) {
      const auto p = static_cast<size_t>(next[i].parent);
      if (keeper[p] == nullptr) keeper[p] = live[i] = g.live[p];
    }
    std::vector<RequestState*> spare;
    for (RequestState* s : g.slots)
      if (std::find(keeper.begin(), keeper.end(), s) == keeper.end()) {
        scheduler.finish(&s->seq);  // no-op for a slot already ended
        spare.push_back(s);
      }
    for (size_t i = 0; i < next.size(); ++i) {
      if (live[i] != nullptr) continue;
      RequestState& parent = *g.live[static_cast<size_t>(next[i].parent)];
      RequestState* child;
      if (!spare.empty()) {
        child = spare.back();
        spare.pop_back();
      } else {
        auto fresh = std::make_unique<RequestState>();
        fresh->id = next_id++;
        fresh->seq.id = fresh->id;
        fresh->group = &g;
        fresh->arrival = owner.arrival;
        child = fresh.get();
        g.slots.push_back(child);
        requests.emplace(child->id, std::move(fresh));
      }
      child->seq.n_draft = 0;
      if (parent.seq.status != SeqStatus::Running || !scheduler.fork(&parent.seq, &child->seq)) {
        // The parent was preempted or parked, or no sequence slot is free: the child computes its
        // tokens itself (mostly prefix-cache hits).
        child->seq.tokens = parent.seq.tokens;
        child->seq.n_prompt = parent.seq.n_prompt;
        scheduler.add(&child->seq);
      }
      live[i] = child;
    }
    for (size_t i = 0; i < next.size(); ++i) {
      Sequence& seq = live[i]->seq;
      seq.tokens.push_back(next[i].token);
      if (seq.status == SeqStatus::Finished) scheduler.add(&seq);  // a parked beam goes on
    }
    g.live = std::move(live);
  }
}

void Engine::Impl::end_beams(RequestState& owner, RequestOutput* o) {
  BeamGroup& g = *owner.group;
  for (RequestState* s : g.slots) {
    if (s == &owner) continue;
    scheduler.finish(&s->seq);
    if (drafter) drafter->release(s->id);
  }
  for (RequestState* s : g.slots)
    if (s != &owner) requests.erase(s->id);
  g.slots = {&owner};
  g.live.clear();
  if (!o->finish_reason.empty()) return;  // abort or error: no hypotheses
  o->beams = g.search.results();
  for (BeamHypothesis& h : o->beams) {
    if (tokenizer == nullptr) break;
    StreamDecoder d(*tokenizer, /*skip_special=*/owner.req.skip_special_tokens, /*continuation=*/true);
    // The stop id that ended a beam is not part of its text (as in post_process).
    const bool drop_stop = h.stopped && !h.tokens.empty() && !owner.req.include_stop_str_in_output;
    const size_t n_text = drop_stop ? h.tokens.size() - 1 : h.tokens.size();
    for (size_t i = 0; i < n_text; ++i) h.text += d.push(h.tokens[i]);
    h.text += d.flush();
  }
  o->finish_reason = !o->beams.empty() && o->beams.front().stopped ? "stop" : "length";
  if (!o->beams.empty()) {
    o->new_token_ids = o->beams.front().tokens;
    o->text_delta = o->beams.front().text;
  }
}

}  // namespace kestrel
