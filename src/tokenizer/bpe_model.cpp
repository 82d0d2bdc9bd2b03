#include "tokenizer/bpe_model.h"

#include <queue>

#include "tokenizer/byte_level.h"

namespace kestrel {

BpeModel::BpeModel(std::shared_ptr<const Vocab> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, PreTokenizer pre,
                   BpeOptions options, int32_t unk_id)
    : vocab_(std::move(vocab)), pre_(std::move(pre)), options_(options), unk_id_(unk_id) {
  for (int b = 0; b < 256; ++b) {
    const std::optional<int32_t> id = vocab_->find(byte_level_char(static_cast<uint8_t>(b)));
    byte_ids_[b] = id ? *id : -1;
  }
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const std::optional<int32_t> ia = vocab_->find(a);
    const std::optional<int32_t> ib = vocab_->find(b);
    joined.assign(a).append(b);
    const std::optional<int32_t> iab = vocab_->find(joined);
    if (!ia || !ib || !iab) continue;
    merges_.emplace(pair_key(*ia, *ib), Merge{static_cast<int32_t>(rank), *iab});
  }
}

void BpeModel::encode(std::string_view text, std::vector<int32_t>* out, const std::atomic<bool>* cancel) const {
  std::string prefixed;
  if (options_.add_prefix_space && text.front() != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed.append(" ").append(text);
    text = prefixed;
  }
  std::vector<std::string_view> pieces;
  pre_.split(text, &pieces);
  uint32_t since_check = 0;
  for (std::string_view piece : pieces) {
    // Pieces are mostly a few bytes: the flag is read once per kCancelCheckEvery of them.
    since_check += 1;
    if (since_check >= kCancelCheckEvery) {
      since_check = 0;
      check_cancel(cancel);
    }
    encode_piece(piece, out, cancel);
  }
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>* out,
                            const std::atomic<bool>* cancel) const {
  if (options_.ignore_merges) {
    if (const std::optional<int32_t> id = vocab_->find(byte_level_encode(piece))) {
      out->push_back(*id);
      return;
    }
  }
  if (piece.size() == 1) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(piece[0])];
    if (id >= 0) {
      out->push_back(id);
    } else if (unk_id_ >= 0) {
      out->push_back(unk_id_);
    }
    return;
  }

  // One symbol per byte in a linked list; merged-away symbols get id -2.
  struct Symbol {
    int32_t id;  // -1: a byte the vocabulary lacks (never merges)
    int32_t prev;
    int32_t next;
  };
  const auto n = static_cast<int32_t>(piece.size());
  std::vector<Symbol> syms(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    syms[i] = {byte_ids_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};

  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
  };
  // Lowest rank first; among equal ranks (the same pair twice) the leftmost.
  auto lower_priority = [](const Candidate& a, const Candidate& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower_priority)> queue(lower_priority);
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || syms[l].id < 0 || syms[r].id < 0) return;
    auto it = merges_.find(pair_key(syms[l].id, syms[r].id));
    if (it != merges_.end()) queue.push({it->second.rank, l, r, syms[l].id, syms[r].id, it->second.id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) try_add(i, i + 1);

  // One piece may be megabytes long (a run of letters): its merges are where the time goes.
  uint32_t since_check = 0;
  while (!queue.empty()) {
    if (++since_check == kCancelCheckEvery) {
      since_check = 0;
      check_cancel(cancel);
    }
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = syms[c.left];
    // Stale when either side has changed since the candidate was queued.
    if (left.id != c.left_id || left.next != c.right || syms[c.right].id != c.right_id) continue;
    Symbol& right = syms[c.right];
    left.id = c.merged_id;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.left;
    right.id = -2;
    try_add(left.prev, c.left);
    try_add(c.left, left.next);
  }

  for (int32_t i = 0; i >= 0; i = syms[i].next) {
    if (syms[i].id >= 0) {
      out->push_back(syms[i].id);
    } else if (unk_id_ >= 0) {
      out->push_back(unk_id_);
    }
  }
}

std::string BpeModel::normal_token_bytes(const TokenData& token) const {
  return byte_level_decode(token.text);
}

}  // namespace kestrel
