#include "tokenizer/vocab.h"

namespace kestrel {

Vocab::Vocab(std::vector<TokenData> tokens) : tokens_(std::move(tokens)) {
  index_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].text.empty()) continue;  // placeholders for ids no file defines
    index_.emplace(tokens_[i].text, static_cast<int32_t>(i));
  }
}

std::optional<int32_t> Vocab::find(std::string_view text) const {
  auto it = index_.find(text);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

}  // namespace kestrel
