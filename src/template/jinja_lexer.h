// The Jinja lexer: template text and the tokens inside {{ }} and {% %} tags, with Jinja's
// whitespace control ({%- -%} {{- -}} {#- -#}, {%+ +%}) and the settings transformers renders
// chat templates with: trim_blocks (the newline after a block or comment tag is dropped),
// lstrip_blocks (spaces and tabs before a block or comment tag at the start of a line are dropped),
// keep_trailing_newline off (one final newline of the template is dropped). Newlines are
// normalised to \n. Comments are dropped; {% raw %} blocks become text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::jinja {

enum class TokenType : uint8_t {
  Text,        // template data (text holds it)
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,        // identifier (text)
  String,      // string literal (text holds the decoded value)
  Int,         // integer literal (int_value)
  Float,       // float literal (float_value)
  Op,          // operator or punctuation (text)
  End,         // end of the template
};

struct Token {
  TokenType type;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0.0;
  size_t offset = 0;  // byte offset in the normalised source
};

// Maps byte offsets of the normalised source to 1-based line and column (columns count
// characters).
class SourceMap {
 public:
  explicit SourceMap(std::string_view source);
  void locate(size_t offset, int* line, int* column) const;

 private:
  std::vector<size_t> line_starts_;
  std::vector<uint32_t> chars_before_;  // [offset]: characters before that byte (columns in O(1))
};

struct LexResult {
  std::string source;  // normalised newlines, without the trailing newline
  std::vector<Token> tokens;
};

// Errors: TemplateError (Syntax) with line and column: unclosed tags, comments, strings and
// brackets, unexpected characters, malformed numbers.
LexResult lex(std::string_view source);

}  // namespace kestrel::jinja
