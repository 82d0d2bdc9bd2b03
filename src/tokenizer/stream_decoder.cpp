#include "tokenizer/stream_decoder.h"

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kestrel {

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special, bool continuation)
    : tokenizer_(tokenizer), skip_special_(skip_special), at_start_(!continuation) {}

std::string StreamDecoder::push(int32_t id) {
  tokenizer_.append_piece(id, skip_special_, &at_start_, &pending_);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const Utf8Step st = utf8_step(pending_, i);
    if (st.kind == Utf8Kind::INCOMPLETE) break;  // wait for the next token
    if (st.kind == Utf8Kind::VALID) {
      out.append(pending_, i, st.len);
    } else {
      out.append(kReplacementChar);
    }
    i += st.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_sanitize(pending_);
  pending_.clear();
  at_start_ = true;
  return out;
}

}  // namespace kestrel
