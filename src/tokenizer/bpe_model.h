// Byte-level BPE (tokenizer.ggml.model "gpt2": GPT-2, Llama 3, Qwen2, SmolLM, DeepSeek, ...).
//
// Algorithm (GPT-2's encoder.py, Hugging Face tokenizers' BPE model): the pre-tokenizer splits the
// text into pieces; each piece's bytes become one symbol each (written in the GPT-2 byte alphabet,
// see byte_level.h); then, repeatedly, the adjacent pair with the lowest merge rank (its line in the
// merges list) is replaced by the merged token, leftmost first among equal ranks, until no adjacent
// pair has a merge. With ignore_merges (Llama 3), a piece that is already a whole vocabulary entry
// is emitted as that token without running the merges.
#pragma once

#include <array>
#include <memory>
#include <unordered_map>
#include <utility>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer_model.h"

namespace kestrel {

struct BpeOptions {
  bool ignore_merges = false;
  // Hugging Face ByteLevel add_prefix_space: a text that does not start with ' ' gets one.
  bool add_prefix_space = false;
};

class BpeModel final : public TokenizerModel {
 public:
  // `merges` holds the merge pairs in rank order (rank = index). A pair whose parts or result are
  // not in the vocabulary is ignored (it could never apply); a repeated pair keeps its first rank.
  BpeModel(std::shared_ptr<const Vocab> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
           PreTokenizer pre, BpeOptions options, int32_t unk_id);

  void encode(std::string_view text, std::vector<int32_t>* out,
              const std::atomic<bool>* cancel) const override;
  std::string normal_token_bytes(const TokenData& token) const override;

  size_t n_merges() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;  // the merged token
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void encode_piece(std::string_view piece, std::vector<int32_t>* out, const std::atomic<bool>* cancel) const;

  std::shared_ptr<const Vocab> vocab_;
  PreTokenizer pre_;
  BpeOptions options_;
  int32_t unk_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> merge
  std::array<int32_t, 256> byte_ids_{};         // token of each single byte, -1 when absent
};

}  // namespace kestrel
