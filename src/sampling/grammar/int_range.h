// Exact grammars for decimal integers in a range (JSON Schema minimum / maximum on integers).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kestrel::grammar {

// A GBNF expression matching exactly the decimal forms (no leading zeros, "-" for negatives, no
// "-0") of the integers in [lo, hi]; an absent bound is unbounded. Requires lo <= hi when both
// are present.
std::string int_range_gbnf(std::optional<int64_t> lo, std::optional<int64_t> hi);

}  // namespace kestrel::grammar
