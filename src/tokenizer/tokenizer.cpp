#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/spm_model.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// Chat and base models mark the end of a turn with one of these; a model whose GGUF names only its
// EOS still has to stop at them.
constexpr std::string_view kEogTexts[] = {
    "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>", "<end_of_turn>", "<|end_of_text|>",
};

// Parses "<0xXX>" (a byte-fallback token) into its byte value.
std::optional<uint8_t> parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(t[3]);
  const int lo = hex(t[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

}  // namespace

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_spec(TokenizerSpec spec) {
  const auto n = static_cast<int32_t>(spec.tokens.size());
  if (n == 0) throw Error("tokenizer: empty vocabulary");
  auto check = [n](int32_t id, const char* what) {
    if (id >= n)
      throw Error(std::string("tokenizer: ") + what + " " + std::to_string(id) +
                  " is out of range (n_vocab " + std::to_string(n) + ")");
    return id < 0 ? -1 : id;
  };

  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->kind_ = spec.kind;
  t->bos_id_ = check(spec.bos_id, "bos id");
  t->eos_id_ = check(spec.eos_id, "eos id");
  t->unk_id_ = check(spec.unk_id, "unknown-token id");
  t->pad_id_ = check(spec.pad_id, "padding id");
  const int32_t eot = check(spec.eot_id, "eot id");
  const int32_t eom = check(spec.eom_id, "eom id");
  t->add_bos_ = spec.add_bos && t->bos_id_ >= 0;
  t->add_eos_ = spec.add_eos && t->eos_id_ >= 0;
  t->vocab_ = std::make_shared<const Vocab>(std::move(spec.tokens));

  if (spec.kind == TokenizerKind::SPM) {
    t->model_ = std::make_unique<SpmModel>(t->vocab_, t->unk_id_, spec.add_space_prefix);
  } else {
    BpeOptions opts;
    opts.ignore_merges = spec.ignore_merges;
    opts.add_prefix_space = spec.add_space_prefix;
    t->model_ =
        std::make_unique<BpeModel>(t->vocab_, spec.merges, PreTokenizer(spec.pre_patterns), opts, t->unk_id_);
  }

  const Vocab& v = *t->vocab_;
  t->pieces_.resize(static_cast<size_t>(n));
  t->added_by_byte_.resize(256);
  for (int32_t id = 0; id < n; ++id) {
    const TokenData& td = v.at(id);
    std::string& piece = t->pieces_[static_cast<size_t>(id)];
    switch (td.type) {
      case TokenType::NORMAL:
      case TokenType::UNDEFINED: piece = t->model_->normal_token_bytes(td); break;
      case TokenType::BYTE:
        if (std::optional<uint8_t> b = parse_byte_token(td.text)) {
          piece.assign(1, static_cast<char>(*b));
        } else {
          piece = td.text;
        }
        break;
      case TokenType::USER_DEFINED:
      case TokenType::CONTROL:
      case TokenType::UNKNOWN:
      case TokenType::UNUSED:
        // Added tokens are stored verbatim (not in the byte alphabet, no '▁').
        piece = td.text;
        break;
    }
    const bool cuttable =
        (td.type == TokenType::USER_DEFINED || td.type == TokenType::CONTROL || td.type == TokenType::UNKNOWN) &&
        !t->model_->handles_in_text(id);
    if (cuttable && !td.text.empty() && v.find(td.text) == id) {
      t->added_by_byte_[static_cast<uint8_t>(td.text[0])].push_back(
          {td.text, id, td.type != TokenType::USER_DEFINED});
    }
  }
  for (auto& bucket : t->added_by_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(), [](const AddedTokenText& a, const AddedTokenText& b) {
      return a.text.size() > b.text.size();
    });
  }

  for (int32_t id : {t->eos_id_, eot, eom}) {
    if (id >= 0) t->eog_ids_.insert(id);
  }
  for (std::string_view text : kEogTexts) {
    if (std::optional<int32_t> id = v.find(text)) {
      if (v.at(*id).type == TokenType::CONTROL || v.at(*id).type == TokenType::USER_DEFINED)
        t->eog_ids_.insert(*id);
    }
  }
  return t;
}

std::optional<Tokenizer::Cut> Tokenizer::find_added(std::string_view text, size_t from,
                                                    bool parse_special) const {
  for (size_t i = from; i < text.size(); ++i) {
    const auto& bucket = added_by_byte_[static_cast<uint8_t>(text[i])];
    for (const AddedTokenText& a : bucket) {
      if (a.special && !parse_special) continue;
      if (a.text.size() <= text.size() - i &&
          std::memcmp(text.data() + i, a.text.data(), a.text.size()) == 0) {
        return Cut{i, a.text.size(), a.id};
      }
    }
  }
  return std::nullopt;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special,
                                       const std::atomic<bool>* cancel) const {
  std::string clean;
  if (!utf8_is_valid(text)) {
    clean = utf8_sanitize(text);
    text = clean;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(bos_id_);
  size_t pos = 0;
  while (pos < text.size()) {
    const std::optional<Cut> cut = find_added(text, pos, parse_special);
    const size_t end = cut ? cut->start : text.size();
    check_cancel(cancel);
    if (end > pos) model_->encode(text.substr(pos, end - pos), &out, cancel);
    if (!cut) break;
    out.push_back(cut->id);
    pos = cut->start + cut->len;
  }
  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

void Tokenizer::check_id(int32_t id) const {
  if (!vocab_->contains(id)) {
    throw Error("tokenizer: token id " + std::to_string(id) + " is out of range [0, " +
                std::to_string(n_vocab()) + ")");
  }
}

bool Tokenizer::is_special(int32_t id) const {
  if (!vocab_->contains(id)) return false;
  const TokenType t = vocab_->at(id).type;
  return t == TokenType::CONTROL || t == TokenType::UNKNOWN || t == TokenType::UNUSED;
}

void Tokenizer::append_piece(int32_t id, bool skip_special, bool* at_start, std::string* out) const {
  // A model may have more embedding rows than its tokenizer has tokens (vocabularies padded to a
  // multiple of 64 or 128, e.g. Qwen2's 151,936 rows for 151,665 tokens): such an id has no text.
  if (id >= n_vocab()) return;
  check_id(id);
  const bool special = is_special(id);
  if (special && skip_special) return;
  const std::string& piece = pieces_[static_cast<size_t>(id)];
  if (special || !*at_start) {
    out->append(piece);
    return;
  }
  *at_start = false;
  if (model_->strips_leading_space() && !piece.empty() && piece[0] == ' ') {
    out->append(piece, 1);
  } else {
    out->append(piece);
  }
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special,
                              bool continuation) const {
  std::string raw;
  bool at_start = !continuation;
  for (int32_t id : ids) append_piece(id, skip_special, &at_start, &raw);
  if (utf8_is_valid(raw)) return raw;
  return utf8_sanitize(raw);
}

const TokenData& Tokenizer::token(int32_t id) const {
  check_id(id);
  return vocab_->at(id);
}

std::string Tokenizer::token_to_piece(int32_t id) const {
  check_id(id);
  return pieces_[static_cast<size_t>(id)];
}

}  // namespace kestrel
