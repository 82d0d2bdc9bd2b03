// Regular expressions to GBNF (grammar.h).
//
// The common subset of ECMAScript / Python syntax: literals, `.`, classes with ranges and
// negation, the escapes \d \w \s \D \W \S \n \r \t \f \v \0 \xHH \uHHHH \u{H..}, groups ( ) (?: )
// (?<name> ), alternation, the quantifiers * + ? {m} {m,} {m,n} and their lazy forms (same
// language). The whole text must match (anchors are implicit; ^ at the start and $ at the end
// are accepted). Constructs a context-free grammar cannot express, or that change the language
// in ways not modelled here, are refused with a GrammarError naming them: lookahead and
// lookbehind, backreferences, word boundaries, possessive quantifiers, Unicode property escapes,
// inline flags, anchors inside the pattern.
#pragma once

#include <string>
#include <string_view>

#include "sampling/grammar/grammar.h"

namespace kestrel::grammar {

// json_string: the pattern describes a JSON string's decoded characters, and the grammar must
// match their JSON text: '"', '\\' and control characters become their escapes (\" \\ \n ... and
// \u00xx, as compact serialisers write them), and `.` excludes line terminators (ECMAScript).
struct RegexOptions {
  bool json_string = false;
  // JSON Schema `pattern` semantics: the pattern may match anywhere in the string unless
  // anchored with ^ / $ (ECMA-262 search). Otherwise (guided regex) it must match the whole text.
  bool search = false;
};

// A GBNF expression (no rule definition; parenthesised) for the pattern. Errors: GrammarError
// with keyword "regex" (syntax) or the construct's name ("lookahead", "backreference", ...).
std::string regex_to_gbnf(std::string_view pattern, const RegexOptions& opts = {});

// Expression for one JSON string character (an unescaped character or an escape sequence).
std::string json_char_gbnf();

}  // namespace kestrel::grammar
