// A tokenizer vocabulary: token text, score and type by id, and the reverse text -> id index.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kestrel {

// Values are GGUF's tokenizer.ggml.token_type codes (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  UNDEFINED = 0,
  NORMAL = 1,
  UNKNOWN = 2,
  CONTROL = 3,       // special tokens: BOS, EOS, <|im_start|>, ...; matched in text only with parse_special
  USER_DEFINED = 4,  // added tokens that are not special: always matched in text as a whole
  UNUSED = 5,
  BYTE = 6,  // SentencePiece byte fallback <0xXX>
};

struct TokenData {
  std::string text;  // as stored in the vocabulary (SPM: '▁' for space; byte-level BPE: GPT-2 alphabet)
  float score = 0.0f;
  TokenType type = TokenType::NORMAL;
};

class Vocab {
 public:
  Vocab() = default;
  // Builds the index. When two ids share a text, lookups return the lower id.
  explicit Vocab(std::vector<TokenData> tokens);

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  bool contains(int32_t id) const { return id >= 0 && id < size(); }
  const TokenData& at(int32_t id) const { return tokens_[static_cast<size_t>(id)]; }
  std::optional<int32_t> find(std::string_view text) const;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<TokenData> tokens_;
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> index_;
};

}  // namespace kestrel
