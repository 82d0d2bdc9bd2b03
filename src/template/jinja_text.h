// UTF-8 and Python str helpers for the Jinja engine. Strings are UTF-8; a malformed byte counts
// as one character of its own (U+0080..U+00FF by value), so nothing here fails on bad input.
// Case mapping covers ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (not full Unicode).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::jinja {

// Decodes the character at s[i] and advances i past it.
uint32_t utf8_next(std::string_view s, size_t& i);
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_length(std::string_view s);
// The characters of s, each as a view into s.
std::vector<std::string_view> utf8_chars(std::string_view s);

bool is_py_space(uint32_t cp);  // str.isspace
bool is_cased(uint32_t cp);     // has an upper- or lowercase form in the table
bool is_upper_cp(uint32_t cp);
bool is_lower_cp(uint32_t cp);
bool is_alnum_cp(uint32_t cp);  // letters in the table, ASCII digits, and any code point >= U+0100 that is not a space
uint32_t to_upper_cp(uint32_t cp);
uint32_t to_lower_cp(uint32_t cp);

std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_title(std::string_view s);       // str.title()
std::string py_capitalize(std::string_view s);  // str.capitalize()
std::string jinja_title(std::string_view s);    // the title filter: words split at spaces - ( { [ <

// str.strip / lstrip / rstrip: whitespace when chars is nullopt, else any of chars' characters.
std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
// str.split(sep, maxsplit): runs of whitespace when sep is nullopt (no empty pieces). sep must not
// be empty (the caller reports that).
std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
// str.splitlines(keepends=False) for \n, \r\n, \r, \v, \f, \x1c-\x1e, U+0085, U+2028, U+2029.
std::vector<std::string> py_splitlines(std::string_view s);
// str.replace(old, new, count): count < 0 replaces all; an empty `old` inserts between characters.
// Stops and returns false when the result would exceed max_bytes.
bool py_replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count,
                size_t max_bytes, std::string& out);

// Python's repr of a str: single quotes unless the text has ' and no ", escapes for controls.
void append_py_string_repr(std::string& out, std::string_view s);
// HTML escaping as Jinja's escape filter: & < > " '.
std::string html_escape(std::string_view s);

}  // namespace kestrel::jinja
