// Stop strings over streamed text (OpenAI `stop`): text is released only once no stop string can
// still begin in it, so a client never sees the start of a stop string that later completes.
// With include_in_output (vLLM's include_stop_str_in_output) the stop string is kept: text is
// released at once (vLLM holds nothing back then) and the output ends right after the match.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

class StopChecker {
 public:
  StopChecker() = default;
  // Empty strings are not allowed (the engine rejects them first).
  explicit StopChecker(std::vector<std::string> stops, bool include_in_output = false);

  // Adds newly decoded text (whole UTF-8 characters) and appends to `emit` the text that is now
  // final. Returns true when a stop string matched: `emit` then ends right before the earliest
  // match (right after it with include_in_output) and everything after it is dropped. Only a
  // match that ends in `text` counts, and only when may_stop: with may_stop false (vLLM's
  // min_tokens not reached yet) a match is ordinary text, while what could start a later match is
  // still held back (kept for the search alone with include_in_output).
  bool push(std::string_view text, std::string& emit, bool may_stop = true);
  // End of generation for another reason: the held-back text plus `tail` (cut at a stop string if
  // one completes in it and may_stop).
  std::string flush(std::string_view tail, bool may_stop = true);
  // The stop string that matched; empty before a match.
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  bool include_ = false;
  size_t hold_ = 0;    // longest stop string length - 1: bytes that may start a match
  // Decoded text not yet released, or with include_ the last hold_ bytes already released (a match
  // may start in them).
  std::string held_;
  std::string matched_;
};

}  // namespace kestrel
