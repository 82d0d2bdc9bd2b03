// Loader for SentencePiece model files (tokenizer.model: a serialized sentencepiece.ModelProto).
//
// Only the fields a BPE tokenizer needs are read, from the protobuf wire format (varint keys
// field << 3 | wire type): ModelProto 1 = repeated SentencePiece {1 piece, 2 score (float),
// 3 type (enum, default NORMAL)}, 2 = TrainerSpec {3 model_type (1 UNIGRAM, 2 BPE, ...),
// 40 unk_id (default 0), 41 bos_id (1), 42 eos_id (2), 43 pad_id (-1)}, 3 = NormalizerSpec
// {3 add_dummy_prefix (default true)}. Field numbers: sentencepiece_model.proto.
#include <cstring>

#include "core/error.h"
#include "io/mapped_file.h"
#include "tokenizer/spec_loaders.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

namespace {

// Bounds-checked reader over one protobuf message.
class ProtoReader {
 public:
  ProtoReader(std::string_view data, const std::string& where) : data_(data), where_(where) {}

  bool done() const { return pos_ >= data_.size(); }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) fail("truncated varint");
      const auto b = static_cast<uint8_t>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("varint longer than 10 bytes");
  }

  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > data_.size() - pos_) fail("length-delimited field runs past the end");
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }

  float fixed32_float() {
    if (data_.size() - pos_ < 4) fail("truncated fixed32");
    float f;
    std::memcpy(&f, data_.data() + pos_, 4);  // protobuf fixed32 is little-endian, as are our hosts
    pos_ += 4;
    return f;
  }

  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1: advance(8); break;
      case 2: bytes(); break;
      case 5: advance(4); break;
      default: fail("unsupported wire type " + std::to_string(wire_type));
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(where_ + ": malformed SentencePiece model at byte " + std::to_string(pos_) + ": " + what);
  }

 private:
  void advance(size_t n) {
    if (data_.size() - pos_ < n) fail("truncated field");
    pos_ += n;
  }
  std::string_view data_;
  const std::string& where_;
  size_t pos_ = 0;
};

TokenData parse_piece(std::string_view msg, const std::string& where) {
  TokenData t;
  t.type = TokenType::NORMAL;
  ProtoReader r(msg, where);
  while (!r.done()) {
    const uint64_t key = r.varint();
    const auto field = key >> 3;
    const auto wire = static_cast<uint32_t>(key & 7);
    if (field == 1 && wire == 2) {
      t.text = std::string(r.bytes());
    } else if (field == 2 && wire == 5) {
      t.score = r.fixed32_float();
    } else if (field == 3 && wire == 0) {
      const uint64_t ty = r.varint();
      if (ty < 1 || ty > 6) r.fail("piece type " + std::to_string(ty));
      t.type = static_cast<TokenType>(ty);
    } else {
      r.skip(wire);
    }
  }
  return t;
}

}  // namespace

TokenizerSpec spm_spec_from_model_file(const std::string& path) {
  const std::string data = read_regular_file(path);

  TokenizerSpec spec;
  spec.kind = TokenizerKind::SPM;
  spec.pre_name = "sentencepiece";
  spec.add_space_prefix = true;
  spec.add_bos = true;
  int64_t model_type = 1;  // proto default: UNIGRAM
  int64_t unk = 0, bos = 1, eos = 2, pad = -1;

  ProtoReader r(data, path);
  while (!r.done()) {
    const uint64_t key = r.varint();
    const auto field = key >> 3;
    const auto wire = static_cast<uint32_t>(key & 7);
    if (field == 1 && wire == 2) {
      spec.tokens.push_back(parse_piece(r.bytes(), path));
    } else if (field == 2 && wire == 2) {
      ProtoReader t(r.bytes(), path);
      while (!t.done()) {
        const uint64_t k = t.varint();
        const auto w = static_cast<uint32_t>(k & 7);
        const auto fld = k >> 3;
        if (w != 0 || (fld != 3 && (fld < 40 || fld > 43))) {
          t.skip(w);
          continue;
        }
        // int32 fields are sign-extended to 64 bits on the wire.
        const auto v = static_cast<int64_t>(t.varint());
        if (fld == 3) model_type = v;
        if (fld == 40) unk = v;
        if (fld == 41) bos = v;
        if (fld == 42) eos = v;
        if (fld == 43) pad = v;
      }
    } else if (field == 3 && wire == 2) {
      ProtoReader n(r.bytes(), path);
      while (!n.done()) {
        const uint64_t k = n.varint();
        const auto w = static_cast<uint32_t>(k & 7);
        if ((k >> 3) == 3 && w == 0) {
          spec.add_space_prefix = n.varint() != 0;
        } else {
          n.skip(w);
        }
      }
    } else {
      r.skip(wire);
    }
  }
  if (model_type != 2) {
    const char* names[] = {"?", "UNIGRAM", "BPE", "WORD", "CHAR"};
    const std::string name =
        model_type >= 1 && model_type <= 4 ? names[model_type] : std::to_string(model_type);
    throw Error(path + ": SentencePiece model_type " + name + " is not supported (only BPE)");
  }
  if (spec.tokens.empty()) throw Error(path + ": SentencePiece model has no pieces");
  spec.unk_id = static_cast<int32_t>(unk);
  spec.bos_id = static_cast<int32_t>(bos);
  spec.eos_id = static_cast<int32_t>(eos);
  spec.pad_id = static_cast<int32_t>(pad);
  return spec;
}

std::unique_ptr<Tokenizer> Tokenizer::from_sentencepiece_model(const std::string& path) {
  return from_spec(spm_spec_from_model_file(path));
}

}  // namespace kestrel
