#include "sampling/grammar/constraint.h"

#include "sampling/grammar/regex.h"

namespace kestrel::grammar {

Grammar compile_constraint(const Constraint& c) {
  switch (c.kind) {
    case ConstraintKind::GBNF: return Grammar::parse_gbnf(c.text);
    case ConstraintKind::REGEX: return Grammar::parse_gbnf("root ::= " + regex_to_gbnf(c.text) + "\n");
    case ConstraintKind::CHOICE: {
      if (c.choices.empty()) throw GrammarError("choice", "choice: the list of choices is empty");
      std::string body;
      for (const auto& s : c.choices) body += (body.empty() ? "" : " | ") + gbnf_literal(s);
      return Grammar::parse_gbnf("root ::= " + body + "\n");
    }
    case ConstraintKind::JSON_OBJECT: return Grammar::parse_gbnf(json_any_gbnf(true, c.any_whitespace));
    case ConstraintKind::JSON_SCHEMA: {
      nlohmann::ordered_json schema;
      try {
        schema = nlohmann::ordered_json::parse(c.text);
      } catch (const nlohmann::json::exception& e) {
        throw GrammarError("json", std::string("json schema: not JSON: ") + e.what());
      }
      JsonSchemaOptions o;
      o.any_whitespace = c.any_whitespace;
      try {
        return Grammar::parse_gbnf(json_schema_to_gbnf(schema, o));
      } catch (const LeftRecursionError&) {
        // The converter writes no left recursion of its own: a $ref cycle that consumes nothing
        // ({"$ref": "#"}, or $defs a -> b -> a) is the schema's.
        throw GrammarError("$ref", "json schema: a $ref cycle reaches the same schema again before any character "
                                   "(as {\"$ref\": \"#\"} does), so it describes no finite value");
      }
    }
  }
  throw GrammarError("kind", "unknown constraint kind");
}

std::shared_ptr<GrammarCache> GrammarCache::for_tokenizer(const Tokenizer& tok) {
  return std::make_shared<GrammarCache>(TokenVocab::from_tokenizer(tok));
}

std::shared_ptr<const CompiledGrammar> GrammarCache::get(const Constraint& c) {
  std::string key = std::to_string(static_cast<int>(c.kind)) + (c.any_whitespace ? "w" : "c") + c.text;
  for (const auto& s : c.choices) key += '\0' + s;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    it->second.last_use = ++clock_;
    return it->second.grammar;
  }
  auto g = std::make_shared<const CompiledGrammar>(compile_constraint(c), vocab_);
  if (entries_.size() >= capacity_) {
    auto oldest = entries_.begin();
    for (auto e = entries_.begin(); e != entries_.end(); ++e)
      if (e->second.last_use < oldest->second.last_use) oldest = e;
    entries_.erase(oldest);
  }
  entries_[key] = {g, ++clock_};
  return g;
}

}  // namespace kestrel::grammar
