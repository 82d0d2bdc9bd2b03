// Regex pre-tokenization for byte-level BPE: splits text into the pieces that BPE then encodes
// one by one (merges never cross a piece boundary).
//
// A pre-tokenizer is a sequence of regexes. Each regex is applied in turn to every piece produced by
// the previous one, and splits it into the matches AND the unmatched stretches between them, all in
// order (Hugging Face tokenizers' Split with behavior "Isolated"; llama.cpp's unicode_regex_split
// does the same). Each piece is matched on its own, so lookarounds and `$` see the piece's ends.
// Regexes use PCRE2 with PCRE2_UTF | PCRE2_UCP, JIT-compiled when the platform allows it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

class PreTokenizer {
 public:
  // No regex: the whole text is one piece.
  PreTokenizer() = default;
  // Compiles the patterns. Throws kestrel::Error naming the pattern, the offset and PCRE2's message
  // when one does not compile.
  explicit PreTokenizer(const std::vector<std::string>& patterns);

  // The pre-tokenizer of a tokenizer.ggml.pre name (llama.cpp's names: "gpt-2", "llama-bpe",
  // "qwen2", "smollm", "deepseek-llm", ...; "default" is the GPT-2 regex). *ignore_merges is set
  // for the Llama 3 family, whose Hugging Face tokenizer has "ignore_merges": true.
  // Throws kestrel::Error naming an unknown name.
  static PreTokenizer from_name(std::string_view name, bool* ignore_merges = nullptr);

  // The regexes of a named pre-tokenizer (empty when unknown).
  static std::vector<std::string> patterns_for(std::string_view name);
  // Every name patterns_for() knows, comma-separated (for error messages).
  static std::string known_names();
  // Whether the named pre-tokenizer's models use ignore_merges (the Llama 3 family).
  static bool ignores_merges(std::string_view name);
  // GPT-2's regex (also used by a Hugging Face ByteLevel pre-tokenizer with use_regex).
  static const std::string& gpt2_pattern();

  // Splits valid UTF-8 `text` into non-empty pieces (views into `text`) appended to *out.
  // Their concatenation is `text`.
  void split(std::string_view text, std::vector<std::string_view>* out) const;

  bool empty() const { return regexes_.empty(); }
  const std::vector<std::string>& patterns() const { return patterns_; }

 private:
  struct Regex;
  std::vector<std::string> patterns_;
  std::vector<std::shared_ptr<const Regex>> regexes_;  // shared: compiled code is immutable
};

}  // namespace kestrel
