// Tokenizer: text <-> token ids for the models the engine runs.
//
// Two models: SentencePiece BPE (GGUF tokenizer.ggml.model "llama") and byte-level BPE ("gpt2";
// also Hugging Face BPE folders). Both share the handling of added tokens:
//   - encode() first cuts the text at added-token text, leftmost-longest match first (as Hugging Face
//     tokenizers does). USER_DEFINED tokens (non-special added tokens) are always cut out, except
//     SentencePiece's whitespace runs, which the model merges as pieces (spm_model.h); CONTROL and
//     UNKNOWN tokens (<s>, <|im_start|>, ...) only when parse_special is true. Each stretch of text in
//     between is encoded by the model on its own; for SentencePiece that means each stretch gets the
//     dummy-prefix space (llama.cpp and the original Llama tokenizer behave the same).
//   - Invalid UTF-8 in the input is replaced by U+FFFD (per maximal subpart) before anything else.
// Reference outputs: llama.cpp's tokenizer vectors (tests/golden/test_tokenizer_vectors.cpp), which
// are the Hugging Face tokenizers' ids.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tokenizer/vocab.h"

namespace kestrel {

class GgufFile;
class TokenizerModel;

// What Tokenizer::encode throws when its cancel flag is set: the caller gave the work up (a client
// that left, a server that stops). Not a kestrel::Error: the input was not at fault.
class EncodeCancelled : public std::exception {
 public:
  const char* what() const noexcept override { return "tokenizer: encoding cancelled"; }
};

enum class TokenizerKind {
  SPM,  // SentencePiece BPE with scores and byte fallback
  BPE,  // byte-level BPE with ranked merges and a regex pre-tokenizer
};

// A token to add on top of a vocabulary file (tokenizer.json added_tokens, added_tokens.json, or a
// caller's own list). `special` tokens become CONTROL (parsed only with parse_special), others
// USER_DEFINED (always parsed).
struct AddedToken {
  std::string text;
  int32_t id = -1;
  bool special = true;
};

// Everything a Tokenizer is built from; the loaders fill one from their files. Ids of -1 mean "none".
struct TokenizerSpec {
  TokenizerKind kind = TokenizerKind::BPE;
  std::vector<TokenData> tokens;                            // by id
  std::vector<std::pair<std::string, std::string>> merges;  // BPE: in rank order
  std::vector<std::string> pre_patterns;  // BPE: pre-tokenizer regexes (see pre_tokenizer.h)
  std::string pre_name;                   // for messages only
  bool ignore_merges = false;             // BPE
  bool add_space_prefix = false;          // SPM: dummy prefix; BPE: Hugging Face ByteLevel add_prefix_space
  bool add_bos = false;
  bool add_eos = false;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  int32_t eot_id = -1;
  int32_t eom_id = -1;
};

class Tokenizer {
 public:
  // From GGUF metadata: tokenizer.ggml.{model, pre, tokens, scores, token_type, merges,
  // bos/eos/unknown/padding/eot/eom_token_id, add_bos_token, add_eos_token, add_space_prefix}.
  // Defaults when a key is absent follow llama.cpp: "llama" adds BOS and the dummy prefix, has
  // <unk>=0, <s>=1, </s>=2; "gpt2" adds neither; a missing or "default" pre means the GPT-2 regex.
  // Throws kestrel::Error naming the key and value for an unknown model or pre-tokenizer, a
  // missing token list or merges, or arrays of mismatched length.
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& f);

  // From a Hugging Face tokenizer folder, in this order of preference: tokenizer.json (model.type
  // "BPE" with a ByteLevel pre-tokenizer); tokenizer.model (SentencePiece BPE, used also when
  // tokenizer.json is of a kind this loader does not read, as for Llama 2 / Mistral folders);
  // vocab.json / encoder.json plus merges.txt / vocab.bpe. added_tokens.json,
  // special_tokens_map.json and tokenizer_config.json add tokens, name BOS/EOS and set
  // add_bos_token / add_eos_token.
  // `pre` overrides the pre-tokenizer for folders without tokenizer.json (by default chosen from
  // tokenizer_config.json's tokenizer_class: Qwen2Tokenizer -> "qwen2", anything else -> "gpt-2").
  // NFC normalizers are accepted and skipped (input is taken as already NFC). Throws kestrel::Error
  // naming the file and field for a missing file, a non-BPE model or an unsupported
  // normalizer/pre-tokenizer.
  static std::unique_ptr<Tokenizer> from_hf_dir(const std::string& dir, std::string_view pre = {});

  // From a byte-level vocabulary file (JSON text -> id), a merges file ("left right" per line in
  // rank order, optional "#version" first line) and a pre-tokenizer name (PreTokenizer::from_name),
  // plus extra tokens. Throws kestrel::Error naming the file on I/O or format errors.
  static std::unique_ptr<Tokenizer> from_bpe_files(const std::string& vocab_path,
                                                   const std::string& merges_path, std::string_view pre,
                                                   std::span<const AddedToken> added = {});

  // From a SentencePiece model file (tokenizer.model, model_type BPE): pieces, scores, types,
  // unk/bos/eos/pad ids and add_dummy_prefix. Adds BOS, as Llama-style models do. Throws
  // kestrel::Error naming the file for I/O errors, malformed data or a non-BPE model type.
  static std::unique_ptr<Tokenizer> from_sentencepiece_model(const std::string& path);

  // Builds from parts. Throws kestrel::Error when the spec is inconsistent (ids out of range, a
  // pre-tokenizer regex that does not compile).
  static std::unique_ptr<Tokenizer> from_spec(TokenizerSpec spec);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text`. add_special adds BOS / EOS where the model asks for them (add_bos() /
  // add_eos()); parse_special turns special-token text such as "<|im_start|>" into its token.
  // Thread-safe (const, no shared mutable state). cancel: when given, a flag read while encoding
  // (every few thousand merge steps or pieces, so within milliseconds); once it is set, encode
  // throws EncodeCancelled. The ids do not depend on it.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special,
                              const std::atomic<bool>* cancel = nullptr) const;

  // Text of a token sequence, always valid UTF-8 (bytes that do not form UTF-8 become U+FFFD).
  // skip_special drops CONTROL/UNKNOWN/UNUSED tokens; otherwise they appear as their text.
  // SentencePiece with a dummy prefix: the leading space of the first piece that is not a special
  // token is dropped (as sentencepiece's decoder and llama2.c do), so decode(encode(x)) == x for
  // text without special tokens. continuation: the ids continue an earlier text (generated tokens
  // after a prompt), so no leading space is dropped. An id at or above n_vocab() (a model with
  // padded embedding rows) has no text. Throws kestrel::Error for a negative id.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false,
                     bool continuation = false) const;

  // The raw bytes of one token (may be part of a UTF-8 character). SPM: '▁' -> ' ', <0xXX> -> the
  // byte. Byte-level BPE: GPT-2 alphabet -> bytes. Added tokens: their text. Throws for a bad id.
  std::string token_to_piece(int32_t id) const;

  // Appends token `id`'s bytes to *out for sequence decoding. *at_start is true before the first
  // non-special piece and is cleared by it; it drives the SentencePiece leading-space rule above.
  // (Used by decode() and StreamDecoder.) Ids >= n_vocab() append nothing (see decode()).
  // Throws kestrel::Error for a negative id.
  void append_piece(int32_t id, bool skip_special, bool* at_start, std::string* out) const;

  TokenizerKind kind() const { return kind_; }
  int32_t n_vocab() const { return vocab_->size(); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t pad_id() const { return pad_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // End of generation: EOS, EOT, EOM and, when present, <|im_end|>, <|eot_id|>, <|endoftext|>,
  // <|end|>, <|eom_id|>, <end_of_turn>, <|end_of_text|>.
  bool is_eog(int32_t id) const { return eog_ids_.count(id) != 0; }
  // CONTROL, UNKNOWN or UNUSED token (what decode's skip_special drops).
  bool is_special(int32_t id) const;
  // The id of a token whose vocabulary text is exactly `text` (e.g. "<|im_start|>").
  std::optional<int32_t> token_id(std::string_view text) const { return vocab_->find(text); }
  // Vocabulary entry of `id`. Throws kestrel::Error for an id out of range.
  const TokenData& token(int32_t id) const;
  const Vocab& vocab() const { return *vocab_; }

 private:
  Tokenizer() = default;
  void check_id(int32_t id) const;

  // Added-token text in one place for the encoder's cut: candidates grouped by first byte,
  // longest first, so the scan tries each text position against few strings.
  struct AddedTokenText {
    std::string_view text;  // into the vocabulary
    int32_t id;
    bool special;
  };
  struct Cut {
    size_t start;
    size_t len;
    int32_t id;
  };
  std::optional<Cut> find_added(std::string_view text, size_t from, bool parse_special) const;

  TokenizerKind kind_ = TokenizerKind::BPE;
  std::shared_ptr<const Vocab> vocab_;
  std::unique_ptr<TokenizerModel> model_;
  std::vector<std::string> pieces_;                         // decoded bytes of every token
  std::vector<std::vector<AddedTokenText>> added_by_byte_;  // [256]
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t unk_id_ = -1;
  int32_t pad_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
  std::unordered_set<int32_t> eog_ids_;
};

}  // namespace kestrel
