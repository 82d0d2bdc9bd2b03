// Incremental detokenization for streaming output: token ids in, complete UTF-8 text out.
//
// A byte-level or byte-fallback token can end in the middle of a multibyte character (an emoji is
// often 2-4 tokens). push() returns only text that is complete, well-formed UTF-8 and keeps an
// unfinished character's bytes until a later token completes it; bytes that can never become a
// character are replaced by U+FFFD right away (one per maximal ill-formed subpart, see utf8.h).
// flush() returns what is left, with an unfinished tail replaced by U+FFFD.
// The concatenation of every push() and the final flush() equals Tokenizer::decode() of the same
// ids (including the SentencePiece leading-space rule).
#pragma once

#include <cstdint>
#include <string>

namespace kestrel {

class Tokenizer;

class StreamDecoder {
 public:
  // The tokenizer must outlive the decoder. continuation: the ids continue an earlier text (see
  // Tokenizer::decode), so the first piece keeps its leading space.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false, bool continuation = false);

  // New complete text after appending token `id`. An id at or above the tokenizer's n_vocab (a
  // model with padded embedding rows) adds no text. Throws kestrel::Error for a negative id.
  std::string push(int32_t id);
  // The held-back bytes (as U+FFFD when they do not form a character); resets to a fresh sequence.
  std::string flush();
  // Bytes held back waiting for the rest of a character (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  bool at_start_ = true;
  std::string pending_;
};

}  // namespace kestrel
