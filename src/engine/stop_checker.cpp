#include "engine/stop_checker.h"

#include <algorithm>

namespace kestrel {

StopChecker::StopChecker(std::vector<std::string> stops, bool include_in_output)
    : stops_(std::move(stops)), include_(include_in_output) {
  for (const std::string& s : stops_) hold_ = std::max(hold_, s.size() - 1);
}

bool StopChecker::push(std::string_view text, std::string& emit, bool may_stop) {
  if (stops_.empty()) {
    emit.append(text);
    return false;
  }
  const size_t before = held_.size();
  held_.append(text);
  if (may_stop) {
    // A match that ended in the held text before `text` came while matches did not count.
    size_t first = std::string::npos;
    const std::string* which = nullptr;
    for (const std::string& s : stops_) {
      const size_t at = held_.find(s, before >= s.size() ? before - s.size() + 1 : 0);
      if (at < first) {
        first = at;
        which = &s;
      }
    }
    if (which != nullptr) {
      matched_ = *which;
      // With include_, held_ up to `before` is out already: what is new ends with the match.
      if (include_) emit.append(held_, before, std::max(first + which->size(), before) - before);
      else emit.append(held_, 0, first);
      held_.clear();
      return true;
    }
  }
  if (include_) {
    // Released as it comes; the tail stays only for matches that start in it.
    emit.append(text);
    if (held_.size() > hold_) held_.erase(0, held_.size() - hold_);
    return false;
  }
  // Any match still to come starts in the last hold_ bytes; release the rest, at a character
  // boundary (never split a UTF-8 sequence between two deltas).
  size_t cut = held_.size() > hold_ ? held_.size() - hold_ : 0;
  while (cut > 0 && cut < held_.size() && (static_cast<unsigned char>(held_[cut]) & 0xC0) == 0x80) --cut;
  emit.append(held_, 0, cut);
  held_.erase(0, cut);
  return false;
}

std::string StopChecker::flush(std::string_view tail, bool may_stop) {
  std::string out;
  push(tail, out, may_stop);
  if (!include_) out += held_;  // with include_ the held text went out already
  held_.clear();
  return out;
}

}  // namespace kestrel
