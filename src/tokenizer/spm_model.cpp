#include "tokenizer/spm_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <queue>

#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space


bool is_space_run(const TokenData& t) {
  return t.type == TokenType::USER_DEFINED && !t.text.empty() &&
         t.text.find_first_not_of(' ') == std::string::npos;
}

}  // namespace

SpmModel::SpmModel(std::shared_ptr<const Vocab> vocab, int32_t unk_id, bool add_space_prefix)
    : vocab_(std::move(vocab)), unk_id_(unk_id), add_space_prefix_(add_space_prefix) {
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    const std::optional<int32_t> id = vocab_->find(name);
    byte_ids_[b] = id && vocab_->at(*id).type == TokenType::BYTE ? *id : -1;
  }
  float top = -std::numeric_limits<float>::infinity();
  size_t longest = 0;
  for (int32_t id = 0; id < vocab_->size(); ++id) {
    const TokenData& t = vocab_->at(id);
    if (t.type == TokenType::NORMAL || t.type == TokenType::UNDEFINED) top = std::max(top, t.score);
    if (is_space_run(t)) longest = std::max(longest, t.text.size());
  }
  if (longest == 0) return;
  if (!std::isfinite(top)) top = 0.0f;
  space_run_ids_.assign(longest + 1, -1);
  space_run_scores_.assign(longest + 1, 0.0f);
  for (int32_t id = 0; id < vocab_->size(); ++id) {
    const TokenData& t = vocab_->at(id);
    const size_t n = t.text.size();
    if (!is_space_run(t) || space_run_ids_[n] >= 0 || vocab_->find(t.text) != id) continue;
    space_run_ids_[n] = id;
    space_run_scores_[n] = top + 1.0f + static_cast<float>(longest - n);
  }
}

bool SpmModel::handles_in_text(int32_t id) const {
  if (!vocab_->contains(id) || !is_space_run(vocab_->at(id))) return false;
  const size_t n = vocab_->at(id).text.size();
  return n < space_run_ids_.size() && space_run_ids_[n] == id;
}

std::optional<SpmModel::Piece> SpmModel::find_piece(std::string_view text) const {
  if (const std::optional<int32_t> id = vocab_->find(text)) {
    const TokenData& t = vocab_->at(*id);
    if (t.type == TokenType::NORMAL || t.type == TokenType::UNDEFINED ||
        (t.type == TokenType::USER_DEFINED && !is_space_run(t)))
      return Piece{*id, t.score};
  }
  // A run of n '▁' is the whitespace-run token of n spaces, when the vocabulary has one.
  const size_t n = text.size() / kSpace.size();
  if (n == 0 || n >= space_run_ids_.size() || space_run_ids_[n] < 0 || text.size() != n * kSpace.size())
    return std::nullopt;
  for (size_t i = 0; i < text.size(); i += kSpace.size())
    if (text.substr(i, kSpace.size()) != kSpace) return std::nullopt;
  return Piece{space_run_ids_[n], space_run_scores_[n]};
}

void SpmModel::encode(std::string_view text, std::vector<int32_t>* out, const std::atomic<bool>* cancel) const {
  std::string s;
  s.reserve(text.size() + 3 * 8);
  if (add_space_prefix_) s.append(kSpace);
  for (char c : text) {
    if (c == ' ') {
      s.append(kSpace);
    } else {
      s.push_back(c);
    }
  }

  // Symbols form a doubly linked list over s; a merged-away symbol keeps len 0.
  struct Symbol {
    uint32_t start;
    uint32_t len;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> syms;
  syms.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_char_len(static_cast<uint8_t>(s[i]));
    const auto idx = static_cast<int32_t>(syms.size());
    syms.push_back(
        {static_cast<uint32_t>(i), static_cast<uint32_t>(std::min(n, s.size() - i)), idx - 1, idx + 1});
    i += n;
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  struct Bigram {
    float score;
    int32_t left;
    uint32_t len;  // left.len + right.len when queued; a mismatch later means the pair is stale
  };
  // Highest score first; among equal scores the leftmost pair.
  auto lower_priority = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(lower_priority)> queue(lower_priority);
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t len = syms[l].len + syms[r].len;
    const std::optional<Piece> p = find_piece(std::string_view(s).substr(syms[l].start, len));
    if (p) queue.push({p->score, l, len});
  };
  for (size_t i = 1; i < syms.size(); ++i) try_add(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));

  uint32_t since_check = 0;
  while (!queue.empty()) {
    if (++since_check == kCancelCheckEvery) {
      since_check = 0;
      check_cancel(cancel);
    }
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& left = syms[bg.left];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = syms[left.next];
    if (left.len + right.len != bg.len) continue;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) syms[left.next].prev = bg.left;
    try_add(left.prev, bg.left);
    try_add(bg.left, left.next);
  }

  for (int32_t i = 0; i >= 0; i = syms[i].next) {
    const std::string_view piece = std::string_view(s).substr(syms[i].start, syms[i].len);
    if (const std::optional<Piece> p = find_piece(piece)) {
      out->push_back(p->id);
      continue;
    }
    for (char c : piece) {
      const int32_t b = byte_ids_[static_cast<uint8_t>(c)];
      if (b >= 0) {
        out->push_back(b);
      } else if (unk_id_ >= 0) {
        out->push_back(unk_id_);
        break;  // one unknown token stands for the whole character
      }
    }
  }
}

std::string SpmModel::normal_token_bytes(const TokenData& token) const {
  std::string out;
  out.reserve(token.text.size());
  std::string_view t = token.text;
  for (size_t i = 0; i < t.size();) {
    if (t.substr(i, kSpace.size()) == kSpace) {
      out.push_back(' ');
      i += kSpace.size();
    } else {
      out.push_back(t[i++]);
    }
  }
  return out;
}

}  // namespace kestrel
