// Stop strings over streamed text (OpenAI `stop`): text is released only once no stop string can
// still begin in it, so a client never sees the start of a stop string that later completes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

class StopChecker {
 public:
  StopChecker() = default;
  // Empty strings are not allowed (the engine rejects them first).
  explicit StopChecker(std::vector<std::string> stops);

  // Adds newly decoded text (whole UTF-8 characters) and appends to `emit` the text that is now
  // final. Returns true when a stop string matched: `emit` then ends right before the earliest
  // match and everything after it is dropped.
  bool push(std::string_view text, std::string& emit);
  // End of generation for another reason: the held-back text plus `tail` (cut at a stop string if
  // one completes in it).
  std::string flush(std::string_view tail);

 private:
  std::vector<std::string> stops_;
  size_t hold_ = 0;    // longest stop string length - 1: bytes that may start a match
  std::string held_;   // decoded, not yet released
};

}  // namespace kestrel
