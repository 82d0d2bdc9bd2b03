// A request's output constraint (what the API fields ask for) compiled to a grammar, and a cache
// of grammars bound to one tokenizer's vocabulary, shared by the requests that ask the same.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "sampling/grammar/grammar.h"
#include "sampling/grammar/json_schema.h"
#include "sampling/grammar/matcher.h"

namespace kestrel {
class Tokenizer;
}

namespace kestrel::grammar {

enum class ConstraintKind {
  JSON_SCHEMA,  // text: the schema's JSON text
  JSON_OBJECT,  // any JSON object (OpenAI response_format {"type": "json_object"})
  REGEX,        // text: the pattern (whole-output match)
  CHOICE,       // choices: one of the strings, exactly
  GBNF,         // text: GBNF grammar text
};

struct Constraint {
  ConstraintKind kind = ConstraintKind::GBNF;
  std::string text;
  std::vector<std::string> choices;
  bool any_whitespace = false;  // JSON kinds: whitespace between tokens allowed
};

// The grammar of a constraint. Errors: GrammarError naming the keyword or construct at fault
// (a JSON schema that is not JSON: keyword "json").
Grammar compile_constraint(const Constraint& c);

// Compiled grammars bound to one vocabulary, by constraint; at most `capacity` kept (the least
// recently used goes first). Their position masks (matcher.h) fill in as requests use them, so a
// schema sent again starts with its masks computed. Thread-safe.
class GrammarCache {
 public:
  explicit GrammarCache(std::shared_ptr<const TokenVocab> vocab, size_t capacity = 64)
      : vocab_(std::move(vocab)), capacity_(capacity) {}
  static std::shared_ptr<GrammarCache> for_tokenizer(const Tokenizer& tok);
  // Errors: as compile_constraint.
  std::shared_ptr<const CompiledGrammar> get(const Constraint& c);
  const std::shared_ptr<const TokenVocab>& vocab() const { return vocab_; }

 private:
  std::shared_ptr<const TokenVocab> vocab_;
  size_t capacity_;
  std::mutex mu_;
  struct Entry {
    std::shared_ptr<const CompiledGrammar> grammar;
    size_t last_use;
  };
  std::unordered_map<std::string, Entry> entries_;
  size_t clock_ = 0;
};

}  // namespace kestrel::grammar
