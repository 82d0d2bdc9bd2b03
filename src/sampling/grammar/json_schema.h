// JSON Schema (draft 7 vocabulary, plus prefixItems and $defs of 2020-12) to GBNF (grammar.h).
//
// The grammar accepts JSON text whose value the schema accepts, written compactly (or with any
// whitespace between tokens when any_whitespace is set, as xgrammar's option of that name in
// vLLM), with object properties in the schema's declaration order: properties first, in the order
// of "properties", then required names it does not list; additional properties, where allowed,
// may sit before, between or after them. Strings are written with the escapes a compact
// serialiser uses (\" \\ \b \f \n \r \t, \u00xx for other control characters); an enum or const
// value is written as its compact serialisation, an integral number also with a ".0"-style
// fraction.
//
// Supported: type (one or a list), enum, const, properties, required, additionalProperties
// (true, false or a schema; "absent" means true), items (a schema, or a list as draft 7's tuple
// form), prefixItems, additionalItems, minItems, maxItems, $ref to "#" and "#/..." JSON pointers
// (recursion included), $defs / definitions, anyOf, oneOf (see JsonSchemaOptions), allOf (merged
// where the keywords combine), minLength / maxLength, pattern, format (date, time, date-time,
// uuid, email), and for integers minimum / maximum / exclusiveMinimum / exclusiveMaximum (an exact
// digit-range grammar). Annotations (title, description, examples, default, $schema, $comment,
// readOnly, writeOnly, deprecated) are ignored. Anything else, and anything a grammar cannot
// express (uniqueItems, multipleOf, not, if/then/else, dependencies, patternProperties,
// propertyNames, min/maxProperties, contains, bounds on non-integer numbers, remote $ref, $id), is
// a GrammarError naming the keyword: never a looser grammar.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "sampling/grammar/grammar.h"

namespace kestrel::grammar {

struct JsonSchemaOptions {
  // Whitespace between JSON tokens: none (compact output) by default; any amount when set.
  bool any_whitespace = false;
  // oneOf is compiled as an alternation, which does not enforce that exactly one branch matches.
  // So by default a oneOf is compiled only when its branches are exclusive by construction: of
  // disjoint JSON types, or objects told apart by a property both require with disjoint
  // const / enum values (a discriminated union); any other oneOf is refused (keyword "oneOf").
  // When true, every oneOf is compiled as anyOf (looser: a value matching two branches passes).
  bool oneof_as_anyof = false;
  // Properties in byte order of their names instead of declaration order (the order of
  // serialisers that sort keys, e.g. Python's json.dumps(sort_keys=True)).
  bool sort_properties = false;
  // Integers (type integer, integral enum / const numbers) may also be written with a zero
  // fraction ("1.0", "-0.00"), which JSON Schema counts as the same integer. Off (the default),
  // they are written without one, as a model should write them.
  bool integral_fraction = false;
};

// GBNF text with a `root` rule. Errors: GrammarError naming the keyword at fault.
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema, const JsonSchemaOptions& opts = {});

// The grammar of any JSON value (OpenAI's response_format {"type": "json_object"} asks for an
// object: root_object).
std::string json_any_gbnf(bool root_object, bool any_whitespace);

}  // namespace kestrel::grammar
