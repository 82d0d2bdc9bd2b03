// The tokenizer-model interface: what differs between SentencePiece BPE and byte-level BPE once the
// text has been split around added/special tokens.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "tokenizer/vocab.h"

namespace kestrel {

// Throws EncodeCancelled when *cancel is set, checked every kCancelCheckEvery steps of a loop.
inline void check_cancel(const std::atomic<bool>* cancel) {
  if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) throw EncodeCancelled();
}
inline constexpr uint32_t kCancelCheckEvery = 4096;

class TokenizerModel {
 public:
  virtual ~TokenizerModel() = default;

  // Appends the ids of `text` to *out. `text` is non-empty valid UTF-8 with no added-token text in
  // it (the Tokenizer has already split those out). cancel: see Tokenizer::encode.
  virtual void encode(std::string_view text, std::vector<int32_t>* out,
                      const std::atomic<bool>* cancel) const = 0;

  // The raw bytes a NORMAL token stands for in decoded text.
  virtual std::string normal_token_bytes(const TokenData& token) const = 0;

  // Whether decoding drops the space the encoder put in front of the text (SentencePiece's dummy
  // prefix).
  virtual bool strips_leading_space() const { return false; }

  // Whether the added token `id` is encoded by this model as part of ordinary text rather than cut
  // out of the text first by the Tokenizer (SentencePiece's whitespace runs, see spm_model.h).
  virtual bool handles_in_text(int32_t /*id*/) const { return false; }
};

}  // namespace kestrel
