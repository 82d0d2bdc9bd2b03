// SentencePiece BPE (tokenizer.ggml.model "llama": Llama 1/2, Mistral v0.1, Phi-3, TinyLlama, ...).
//
// Algorithm (SentencePiece's bpe_model.cc, as used for Llama): the text gets a dummy-prefix space
// (when add_space_prefix), every ' ' becomes '▁' (U+2581), and the text starts as one symbol per
// UTF-8 character. Then, repeatedly, the adjacent pair whose concatenation is a vocabulary piece with
// the highest score is merged (leftmost pair on ties), until no adjacent pair forms a piece. A final
// symbol that is not a piece (a character outside the vocabulary) is spelled with its UTF-8 bytes as
// byte-fallback tokens <0xXX>, or as the unknown token when the vocabulary has no byte tokens.
// Only NORMAL and USER_DEFINED tokens take part: control, byte and unused pieces never come out of
// merging, as in SentencePiece.
//
// Runs of spaces (Gemma): a vocabulary may hold whitespace runs as USER_DEFINED tokens, which
// llama.cpp's converter stores spelled with real spaces ("  " for SentencePiece's "▁▁"). Hugging Face
// tokenizers treats these as ordinary pieces spelled with '▁' whose merges rank above every other
// merge, shorter runs first (Gemma lists them before all normal pieces), so a run longer than the
// longest token splits the way pairwise merging leaves it (40 spaces -> 16 + 24), and a literal '▁'
// in the text joins the run. This model does the same: such tokens are pieces under their '▁'
// spelling, scored above every normal piece (shorter runs higher); the Tokenizer does not cut them
// out of the text beforehand (handles_in_text).
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "tokenizer/tokenizer_model.h"

namespace kestrel {

class SpmModel final : public TokenizerModel {
 public:
  SpmModel(std::shared_ptr<const Vocab> vocab, int32_t unk_id, bool add_space_prefix);

  void encode(std::string_view text, std::vector<int32_t>* out,
              const std::atomic<bool>* cancel) const override;
  std::string normal_token_bytes(const TokenData& token) const override;
  bool strips_leading_space() const override { return add_space_prefix_; }
  bool handles_in_text(int32_t id) const override;

 private:
  struct Piece {
    int32_t id;
    float score;  // merge priority: higher merges first
  };
  std::optional<Piece> find_piece(std::string_view text) const;

  std::shared_ptr<const Vocab> vocab_;
  int32_t unk_id_;
  bool add_space_prefix_;
  std::array<int32_t, 256> byte_ids_{};  // id of <0xXX> for each byte, -1 when absent
  // Whitespace-run tokens by run length (index n: n spaces; -1 when absent) and their scores.
  std::vector<int32_t> space_run_ids_;
  std::vector<float> space_run_scores_;
};

}  // namespace kestrel
