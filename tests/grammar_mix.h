// A batch of structured-output requests mixed with plain ones on stories260K (its 512-token
// SentencePiece vocabulary), for holding the engine's grammar paths to one another: a JSON Schema,
// a regex and a choice list, each greedy and seeded-sampled, beside unconstrained requests.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <ostream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "sampling/grammar/constraint.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::test {

inline const char* kMixSchema = R"({"type":"object","properties":{"name":{"type":"string","maxLength":6},
  "age":{"type":"integer","minimum":0,"maximum":99}},"required":["name","age"],"additionalProperties":false})";
inline const char* kMixRegex = "(Lily|Tom) is [0-9]{1,2} years old\\.";

// Requests: [schema, regex, choice, plain] x [greedy, temperature 1 top_k 40, temperature 0.8
// top_p 0.9 min_p 0.05], each with its own seed; max_tokens bounds every output.
inline std::vector<Request> mixed_grammar_requests(const Tokenizer& tok, grammar::GrammarCache& cache,
                                                   int64_t max_tokens) {
  std::vector<grammar::Constraint> cs(4);
  cs[0].kind = grammar::ConstraintKind::JSON_SCHEMA;
  cs[0].text = kMixSchema;
  cs[1].kind = grammar::ConstraintKind::REGEX;
  cs[1].text = kMixRegex;
  cs[2].kind = grammar::ConstraintKind::CHOICE;
  cs[2].choices = {"happy", "sad", "sleepy dog"};
  const std::vector<std::string> prompts = {"Once upon a time", "One day, a big dog", "Tim and his mom"};
  std::vector<Request> out;
  for (size_t c = 0; c < cs.size(); ++c)
    for (int s = 0; s < 3; ++s) {
      Request r;
      r.prompt = tok.encode(prompts[(c + static_cast<size_t>(s)) % prompts.size()], true, false);
      r.max_tokens = max_tokens;
      r.stop_ids = {tok.eos_id()};
      r.sampling.seed = 500 + out.size();
      if (s == 1) r.sampling.temperature = 1.0f, r.sampling.top_k = 40;
      if (s == 2) r.sampling.temperature = 0.8f, r.sampling.top_p = 0.9f, r.sampling.min_p = 0.05f;
      if (s == 0) r.sampling.temperature = 0.0f;
      if (c < 3) r.grammar = cache.get(cs[c]);
      out.push_back(std::move(r));
    }
  return out;
}

struct MixOutcome {
  std::vector<int32_t> ids;
  std::string finish_reason;
  bool operator==(const MixOutcome&) const = default;
};
inline std::ostream& operator<<(std::ostream& os, const MixOutcome& o) {
  os << o.finish_reason << " [";
  for (int32_t id : o.ids) os << ' ' << id;
  return os << " ]";
}

// Runs every request to the end in one engine; outcomes in request order.
inline std::vector<MixOutcome> run_requests(Engine& e, const std::vector<Request>& requests) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) index[e.add_request(requests[i])] = i;
  std::vector<MixOutcome> out(requests.size());
  while (e.has_unfinished())
    for (const RequestOutput& o : e.step()) {
      MixOutcome& m = out[index.at(o.id)];
      m.ids.insert(m.ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) m.finish_reason = o.finish_reason;
    }
  return out;
}

// Every constrained output that ended with "stop" satisfies its constraint, checked without the
// grammar engine (nlohmann::json, std::regex, the choice list); with room enough (require_stop)
// every constrained output must have ended so.
inline void expect_outputs_follow_their_constraints(const Tokenizer& tok, const std::vector<MixOutcome>& outs,
                                                    bool require_stop) {
  ASSERT_EQ(outs.size(), 12u);
  int n_stop = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const MixOutcome& o = outs[i];
    EXPECT_TRUE(o.finish_reason == "stop" || o.finish_reason == "length") << "request " << i << ": " << o;
    EXPECT_FALSE(o.ids.empty()) << "request " << i;
    if (i >= 9) continue;  // unconstrained
    std::vector<int32_t> ids;
    for (int32_t id : o.ids)
      if (id != tok.eos_id()) ids.push_back(id);
    const std::string text = tok.decode(ids, true, true);
    std::printf("request %zu (%s): %s\n", i, o.finish_reason.c_str(), text.c_str());
    n_stop += o.finish_reason == "stop";
    if (require_stop) EXPECT_EQ(o.finish_reason, "stop") << "request " << i << ": " << text;
    if (o.finish_reason != "stop") continue;
    if (i < 3) {
      nlohmann::json v;
      ASSERT_NO_THROW(v = nlohmann::json::parse(text)) << text;
      ASSERT_TRUE(v.is_object() && v.size() == 2 && v.contains("name") && v.contains("age")) << text;
      EXPECT_TRUE(v["name"].is_string() && v["name"].get<std::string>().size() <= 6 * 4) << text;
      EXPECT_TRUE(v["age"].is_number_integer() && v["age"].get<int64_t>() >= 0 && v["age"].get<int64_t>() <= 99) << text;
    } else if (i < 6) {
      EXPECT_TRUE(std::regex_match(text, std::regex(kMixRegex))) << text;
    } else {
      EXPECT_TRUE(text == "happy" || text == "sad" || text == "sleepy dog") << text;
    }
  }
  EXPECT_GE(n_stop, 6) << "too few constrained outputs ended to check them";
}

}  // namespace kestrel::test
