// JSON Schema to GBNF: each subschema becomes a rule; $ref targets are rules named once, so
// recursive schemas give recursive rules.
#include "sampling/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "sampling/grammar/int_range.h"
#include "sampling/grammar/regex.h"

namespace kestrel::grammar {

using Json = nlohmann::ordered_json;

namespace {

const std::set<std::string> kAnnotations = {"title",   "description", "examples",  "default",    "$schema",
                                            "$comment", "readOnly",   "writeOnly", "deprecated", "definitions",
                                            "$defs"};
const std::set<std::string> kSupported = {
    "type",      "enum",      "const",     "properties", "required", "additionalProperties", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "$ref", "anyOf", "oneOf", "allOf", "minLength",
    "maxLength", "pattern",   "format",    "minimum",    "maximum",  "exclusiveMinimum",     "exclusiveMaximum",
    "uniqueItems"};  // uniqueItems: only `false` (no constraint)
const std::vector<std::string> kAllTypes = {"null", "boolean", "object", "array", "number", "string"};

[[noreturn]] void unsupported(const std::string& keyword, const std::string& why) {
  throw GrammarError(keyword, "json schema: " + why);
}

std::string alts(const std::vector<std::string>& xs) {
  if (xs.size() == 1) return xs[0];
  std::string out = "(";
  for (size_t i = 0; i < xs.size(); ++i) out += (i ? " | " : "") + xs[i];
  return out + ")";
}

std::set<std::string> type_set(const Json& s) {
  std::set<std::string> out;
  auto add = [&](const Json& t) {
    if (!t.is_string()) unsupported("type", "\"type\" must be a string or a list of strings");
    std::string n = t.get<std::string>();
    static const std::set<std::string> known = {"null", "boolean", "object", "array", "number", "integer", "string"};
    if (!known.count(n)) unsupported("type", "unknown type \"" + n + "\"");
    out.insert(n);
  };
  if (s.is_array()) {
    if (s.empty()) unsupported("type", "an empty \"type\" list accepts no value");
    for (const auto& t : s) add(t);
  } else {
    add(s);
  }
  return out;
}

bool value_has_type(const Json& v, const std::string& t) {
  if (t == "null") return v.is_null();
  if (t == "boolean") return v.is_boolean();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
  return false;
}

// JSON text of a value as a GBNF expression; integral numbers also with a zero fraction when
// `fraction` is set.
std::string literal_of(const Json& v, bool fraction) {
  if (v.is_number()) {
    bool integral = v.is_number_integer() || (std::isfinite(v.get<double>()) && std::floor(v.get<double>()) == v.get<double>() &&
                                              std::fabs(v.get<double>()) < 9e15);
    if (integral) {
      int64_t i = v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>())
                                         : v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
      if (!fraction) return gbnf_literal(std::to_string(i));
      std::string body = i == 0 ? "\"-\"? \"0\"" : gbnf_literal(std::to_string(i));
      return "(" + body + " (\".\" \"0\"+)?)";
    }
  }
  return gbnf_literal(v.dump());
}

class Compiler {
 public:
  Compiler(const Json& root, const JsonSchemaOptions& o) : root_(root), opts_(o) {
    ws_ = o.any_whitespace ? " ws " : " ";
    frac_ = o.integral_fraction ? " (\".\" \"0\"+)?" : "";
  }

  std::string run() {
    std::string body = visit(root_, 0);
    std::string out = "root ::= " + body + "\n";
    out += "ws ::= [ \\t\\n\\r]*\n";
    out += "jchar ::= " + json_char_gbnf() + "\n";
    out += "jstring ::= \"\\\"\" jchar* \"\\\"\"\n";
    out += "jnumber ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n";
    out += "jinteger ::= \"-\"? (\"0\" | [1-9] [0-9]*)" + frac_ + "\n";
    out += "jvalue ::= jobject | jarray | jstring | jnumber | \"true\" | \"false\" | \"null\"\n";
    out += "jobject ::= \"{\"" + ws_ + "(jstring" + ws_ + "\":\"" + ws_ + "jvalue (" + ws_ + "\",\"" + ws_ +
           "jstring" + ws_ + "\":\"" + ws_ + "jvalue)*)?" + ws_ + "\"}\"\n";
    out += "jarray ::= \"[\"" + ws_ + "(jvalue (" + ws_ + "\",\"" + ws_ + "jvalue)*)?" + ws_ + "\"]\"\n";
    for (const auto& [name, rule] : rules_) out += name + " ::= " + rule + "\n";
    return out;
  }

 private:
  std::string new_rule(const std::string& body) {
    std::string name = "s" + std::to_string(rules_.size());
    rules_[name] = body;
    return name;
  }

  const Json& resolve(const std::string& ref) {
    if (ref.empty() || ref[0] != '#')
      unsupported("$ref", "only local references (\"#\" and \"#/...\") are supported, not \"" + ref + "\"");
    const Json* at = &root_;
    size_t pos = 1;
    if (ref.size() > 1 && ref[1] != '/') unsupported("$ref", "anchor references (\"" + ref + "\") are not supported");
    while (pos < ref.size()) {
      size_t next = ref.find('/', pos + 1);
      std::string tok = ref.substr(pos + 1, next == std::string::npos ? std::string::npos : next - pos - 1);
      std::string dec;  // JSON pointer (RFC 6901) and URI percent escapes
      for (size_t i = 0; i < tok.size(); ++i) {
        if (tok[i] == '~' && i + 1 < tok.size()) {
          dec += tok[i + 1] == '1' ? '/' : '~';
          ++i;
        } else if (tok[i] == '%' && i + 2 < tok.size()) {
          dec += static_cast<char>(std::stoi(tok.substr(i + 1, 2), nullptr, 16));
          i += 2;
        } else {
          dec += tok[i];
        }
      }
      if (at->is_object() && at->contains(dec)) {
        at = &(*at)[dec];
      } else if (at->is_array() && !dec.empty() && dec.find_first_not_of("0123456789") == std::string::npos &&
                 std::stoul(dec) < at->size()) {
        at = &(*at)[std::stoul(dec)];
      } else {
        unsupported("$ref", "reference \"" + ref + "\" does not resolve in this schema");
      }
      pos = next == std::string::npos ? ref.size() : next;
    }
    return *at;
  }

  std::string ref_rule(const std::string& ref) {
    auto it = refs_.find(ref);
    if (it != refs_.end()) return it->second;
    std::string name = "r" + std::to_string(refs_.size());
    refs_[ref] = name;
    rules_[name] = "";  // reserved: a recursive reference finds the name
    rules_[name] = visit(resolve(ref), 0);
    return name;
  }

  // A subschema with $ref replaced by its target (for merging).
  const Json& deref(const Json& s, int depth = 0) {
    if (s.is_object() && s.contains("$ref")) {
      if (depth > 32) unsupported("$ref", "reference chain too deep to merge");
      return deref(resolve(s["$ref"].get<std::string>()), depth + 1);
    }
    return s;
  }

  std::set<std::string> types_of(const Json& s0, int depth) {
    const Json& s = deref(s0);
    std::set<std::string> all(kAllTypes.begin(), kAllTypes.end());
    all.insert("integer");
    if (s.is_boolean()) return s.get<bool>() ? all : std::set<std::string>{};
    if (depth > 16) return all;
    std::set<std::string> t = s.contains("type") ? type_set(s["type"]) : all;
    if (t.count("number")) t.insert("integer");
    auto values = [&](const Json& vs) {
      std::set<std::string> out;
      for (const auto& v : vs)
        for (const auto& n : t)
          if (value_has_type(v, n)) out.insert(n == "integer" ? "number" : n);
      return out;
    };
    if (s.contains("const")) return values(Json::array({s["const"]}));
    if (s.contains("enum") && s["enum"].is_array()) return values(s["enum"]);
    if (t.count("integer") && !t.count("number")) t.insert("number");  // "1.0" is both
    return t;
  }

  // allOf: one schema with both sides' constraints, where the keywords combine.
  Json merge(Json a, const Json& b0) {
    const Json& b = deref(b0);
    if (b.is_boolean()) {
      if (!b.get<bool>()) unsupported("allOf", "allOf holds the schema false, which accepts nothing");
      return a;
    }
    for (const auto& [k, v] : b.items()) {
      if (kAnnotations.count(k)) continue;
      if (!a.contains(k)) {
        a[k] = v;
        continue;
      }
      Json& x = a[k];
      if (x == v) continue;
      if (k == "type") {
        std::set<std::string> p = type_set(x), q = type_set(v), r;
        for (const auto& t : p) {
          if (q.count(t)) r.insert(t);
          if (t == "number" && q.count("integer")) r.insert("integer");
          if (t == "integer" && q.count("number")) r.insert("integer");
        }
        if (r.empty()) unsupported("allOf", "allOf branches have no type in common");
        x = Json::array();
        for (const auto& t : r) x.push_back(t);
      } else if (k == "required") {
        std::vector<std::string> names = x.get<std::vector<std::string>>();
        for (const auto& n : v)
          if (std::find(names.begin(), names.end(), n.get<std::string>()) == names.end()) names.push_back(n);
        x = names;
      } else if (k == "properties") {
        if (a.contains("additionalProperties") || b.contains("additionalProperties"))
          unsupported("allOf", "allOf merging \"properties\" with \"additionalProperties\" is not supported");
        for (const auto& [pk, pv] : v.items())
          x[pk] = x.contains(pk) ? Json{{"allOf", Json::array({x[pk], pv})}} : pv;
      } else if (k == "minimum" || k == "minLength" || k == "minItems" || k == "exclusiveMinimum") {
        x = std::max(x.get<double>(), v.get<double>());
      } else if (k == "maximum" || k == "maxLength" || k == "maxItems" || k == "exclusiveMaximum") {
        x = std::min(x.get<double>(), v.get<double>());
      } else if (k == "allOf") {
        for (const auto& e : v) x.push_back(e);
      } else {
        unsupported("allOf", "allOf cannot combine two different \"" + k + "\" keywords");
      }
    }
    if (a.contains("additionalProperties") && b.contains("properties") && !a.contains("properties"))
      unsupported("allOf", "allOf merging \"properties\" with \"additionalProperties\" is not supported");
    if (b.contains("additionalProperties") && a.contains("properties") && !b.contains("properties"))
      unsupported("allOf", "allOf merging \"properties\" with \"additionalProperties\" is not supported");
    return a;
  }

  std::string visit(const Json& s, int depth) {
    if (depth > 64) unsupported("allOf", "schema nesting too deep");
    if (s.is_boolean()) {
      if (s.get<bool>()) return "jvalue";
      unsupported("false", "the schema false accepts no value");
    }
    if (!s.is_object()) unsupported("type", "a schema must be an object or a boolean");
    bool empty = true;
    for (const auto& [k, v] : s.items()) empty &= kAnnotations.count(k) > 0;
    if (empty) return "jvalue";
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) unsupported("$ref", "\"$ref\" must be a string");
      return ref_rule(s["$ref"].get<std::string>());  // draft 7: keywords beside $ref are ignored
    }
    for (const auto& [k, v] : s.items()) {
      if (kAnnotations.count(k)) continue;
      if (!kSupported.count(k)) unsupported(k, "keyword \"" + k + "\" is not supported");
      if (k == "uniqueItems" && !(v.is_boolean() && !v.get<bool>()))
        unsupported(k, "keyword \"uniqueItems\" is not supported (a grammar cannot check uniqueness)");
    }
    if (s.contains("allOf")) {
      Json rest = s;
      rest.erase("allOf");
      if (!s["allOf"].is_array() || s["allOf"].empty()) unsupported("allOf", "\"allOf\" must be a non-empty list");
      for (const auto& sub : s["allOf"]) rest = merge(rest, sub);
      return visit(rest, depth + 1);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      if (s.contains("anyOf") && s.contains("oneOf")) unsupported("oneOf", "anyOf together with oneOf is not supported");
      const Json& subs = s[key];
      if (!subs.is_array() || subs.empty()) unsupported(key, std::string("\"") + key + "\" must be a non-empty list");
      Json rest = s;
      rest.erase(key);
      bool plain = true;
      for (const auto& [k, v] : rest.items()) plain &= kAnnotations.count(k) > 0;
      std::vector<Json> branches;
      for (const auto& sub : subs) branches.push_back(plain ? sub : merge(rest, sub));
      if (std::string(key) == "oneOf" && !opts_.oneof_as_anyof) {
        std::vector<std::set<std::string>> ts;
        for (const auto& b : branches) ts.push_back(types_of(b, 0));
        for (size_t i = 0; i < ts.size(); ++i)
          for (size_t j = i + 1; j < ts.size(); ++j)
            for (const auto& t : ts[i])
              if (ts[j].count(t) && !(t == "object" && discriminated(branches[i], branches[j])))
                unsupported("oneOf", "oneOf branches " + std::to_string(i) + " and " + std::to_string(j) +
                                         " can both hold a " + t + ", and a grammar cannot enforce that only one matches");
      }
      std::vector<std::string> out;
      for (const auto& b : branches) {
        if (b.is_boolean() && !b.get<bool>()) continue;
        out.push_back(visit(b, depth + 1));
      }
      if (out.empty()) unsupported(key, std::string("every branch of \"") + key + "\" is false");
      return new_rule(alts(out));
    }
    std::set<std::string> types;
    if (s.contains("type")) {
      types = type_set(s["type"]);
    } else {
      types.insert(kAllTypes.begin(), kAllTypes.end());
    }
    if (types.count("number")) types.erase("integer");
    if (s.contains("enum") || s.contains("const")) return enum_rule(s, types);
    std::vector<std::string> out;
    for (const auto& t : types) out.push_back(type_rule(s, t));
    return new_rule(alts(out));
  }

  // True when no object can match both branches: some property is required by both and its
  // const / enum values in one are disjoint from the other's (a discriminated union, the usual
  // way a oneOf of objects is made exclusive).
  static bool discriminated(const Json& a, const Json& b) {
    auto required = [](const Json& s, const std::string& name) {
      if (!s.is_object() || !s.contains("required") || !s["required"].is_array()) return false;
      for (const auto& r : s["required"])
        if (r.is_string() && r.get<std::string>() == name) return true;
      return false;
    };
    auto values = [](const Json& s, const std::string& name, Json& out) {
      if (!s.contains("properties") || !s["properties"].is_object() || !s["properties"].contains(name)) return false;
      const Json& p = s["properties"][name];
      if (!p.is_object()) return false;
      if (p.contains("const")) {
        out = Json::array({p["const"]});
        return true;
      }
      if (p.contains("enum") && p["enum"].is_array()) {
        out = p["enum"];
        return true;
      }
      return false;
    };
    if (!a.is_object() || !a.contains("properties") || !a["properties"].is_object()) return false;
    for (const auto& [name, unused] : a["properties"].items()) {
      Json va, vb;
      if (!required(a, name) || !required(b, name) || !values(a, name, va) || !values(b, name, vb)) continue;
      bool disjoint = true;
      for (const auto& x : va)
        for (const auto& y : vb) disjoint &= !(x == y);
      if (disjoint) return true;
    }
    return false;
  }

  std::string enum_rule(const Json& s, const std::set<std::string>& types) {
    for (const auto& [k, v] : s.items())
      if (!kAnnotations.count(k) && k != "enum" && k != "const" && k != "type")
        unsupported(k, "\"" + k + "\" together with enum/const is not supported");
    Json values = Json::array();
    if (s.contains("const")) values.push_back(s["const"]);
    if (s.contains("enum")) {
      if (!s["enum"].is_array()) unsupported("enum", "\"enum\" must be a list");
      if (s.contains("const")) unsupported("enum", "enum together with const is not supported");
      values = s["enum"];
    }
    std::vector<std::string> out, texts;  // texts: the values whose grammar is their JSON text
    for (const auto& v : values) {
      bool ok = false;
      for (const auto& t : types) ok |= value_has_type(v, t) || (t == "number" && v.is_number());
      if (!ok) continue;
      if (opts_.any_whitespace && (v.is_object() || v.is_array()) && !v.empty())
        unsupported("enum", "object and array enum values with any_whitespace are not supported");
      std::string lit = literal_of(v, opts_.integral_fraction);
      if (lit == gbnf_literal(v.dump())) texts.push_back(v.dump());
      else out.push_back(std::move(lit));
    }
    if (texts.size() > kTrieMinValues) {
      out.push_back(prefix_tree_rule(std::move(texts)));
    } else {
      for (const auto& t : texts) out.push_back(gbnf_literal(t));
    }
    if (out.empty()) unsupported("enum", "no enum value has an allowed type");
    return new_rule(alts(out));
  }

  // Many enum values as one alternation would leave the matcher a stack per value alive after
  // their shared first bytes (100,000 values: ~2 GB and 15 s for the first mask), so above this
  // count they are compiled as a prefix tree: each rule's alternatives begin with distinct
  // characters, so at most one branch per character stays alive.
  static constexpr size_t kTrieMinValues = 64;

  // A rule matching exactly the given texts (valid UTF-8), as a prefix tree of rules: the texts
  // sorted, grouped by their next character, each group's common prefix one literal.
  std::string prefix_tree_rule(std::vector<std::string> texts) {
    std::sort(texts.begin(), texts.end());
    texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
    return prefix_tree_node(texts, 0, texts.size(), 0);
  }
  // texts[lo, hi) share their first `depth` bytes (a character boundary); the rule for the rest.
  std::string prefix_tree_node(const std::vector<std::string>& t, size_t lo, size_t hi, size_t depth) {
    const auto char_len = [](unsigned char lead) -> size_t {
      return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    };
    const bool ends = t[lo].size() == depth;  // sorted: the text that ends here comes first
    if (ends) ++lo;
    std::vector<std::string> branches;
    for (size_t i = lo; i < hi;) {
      const size_t n = std::min(char_len(static_cast<unsigned char>(t[i][depth])), t[i].size() - depth);
      size_t j = i + 1;
      while (j < hi && t[j].compare(depth, n, t[i], depth, n) == 0) ++j;
      if (j == i + 1) {
        branches.push_back(gbnf_literal(std::string_view(t[i]).substr(depth)));
      } else {
        // The group's common prefix (of its first and last text, sorted), cut back to a character.
        size_t common = depth + n;
        const std::string& a = t[i];
        const std::string& b = t[j - 1];
        while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
        while (common > depth + n && (static_cast<unsigned char>(a[common]) & 0xC0) == 0x80) --common;
        branches.push_back(gbnf_literal(std::string_view(a).substr(depth, common - depth)) + " " +
                           prefix_tree_node(t, i, j, common));
      }
      i = j;
    }
    if (branches.empty()) return "\"\"";
    const std::string body = alts(branches);
    return new_rule(ends ? "(" + body + ")?" : body);
  }

  static std::optional<double> num(const Json& s, const char* key) {
    if (!s.contains(key)) return std::nullopt;
    if (!s[key].is_number()) unsupported(key, std::string("\"") + key + "\" must be a number");
    return s[key].get<double>();
  }

  std::string type_rule(const Json& s, const std::string& t) {
    if (t == "null") return "\"null\"";
    if (t == "boolean") return "(\"true\" | \"false\")";
    if (t == "string") return string_rule(s);
    if (t == "number" || t == "integer") return number_rule(s, t == "integer");
    if (t == "array") return array_rule(s);
    return object_rule(s);
  }

  std::string string_rule(const Json& s) {
    auto min_len = num(s, "minLength"), max_len = num(s, "maxLength");
    if (s.contains("format")) {
      if (s.contains("pattern") || min_len || max_len)
        unsupported("format", "format together with pattern / minLength / maxLength is not supported");
      std::string f = s["format"].is_string() ? s["format"].get<std::string>() : "";
      // RFC 3339 full-date, only real calendar days (what Python's jsonschema format checker and
      // datetime.date accept): years 0001-9999, 30 days in April, June, September and November,
      // 28 in February, and February 29 in leap years (divisible by 4, centuries by 400).
      const std::string year = "([1-9] [0-9]{3} | \"0\" [1-9] [0-9]{2} | \"00\" [1-9] [0-9] | \"000\" [1-9])";
      const std::string leap_year =
          "([0-9]{2} (\"0\" [48] | [2468] [048] | [13579] [26]) | (\"0\" [48] | [2468] [048] | [13579] [26]) \"00\")";
      const std::string month_day =
          "((\"0\" [13578] | \"1\" [02]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01]) | "
          "(\"0\" [469] | \"11\") \"-\" (\"0\" [1-9] | [12] [0-9] | \"30\") | "
          "\"02-\" (\"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8]))";
      std::string date = "(" + year + " \"-\" " + month_day + " | " + leap_year + " \"-02-29\")";
      std::string time =
          "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" ([0-5] [0-9] | \"60\") (\".\" [0-9]+)? "
          "([zZ] | [-+] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])";
      std::string body;
      if (f == "date") body = date;
      else if (f == "time") body = time;
      else if (f == "date-time") body = date + " [tT] " + time;
      else if (f == "uuid") body = "[0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12}";
      else if (f == "email")
        body = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\-]+ (\".\" [a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\-]+)* \"@\" "
               "[a-zA-Z0-9] ([a-zA-Z0-9\\-]* [a-zA-Z0-9])? (\".\" [a-zA-Z0-9] ([a-zA-Z0-9\\-]* [a-zA-Z0-9])?)+";
      else unsupported("format", "format \"" + f + "\" is not supported (date, time, date-time, uuid, email are)");
      return "\"\\\"\" " + body + " \"\\\"\"";
    }
    if (s.contains("pattern")) {
      if (min_len || max_len) unsupported("pattern", "pattern together with minLength / maxLength is not supported");
      if (!s["pattern"].is_string()) unsupported("pattern", "\"pattern\" must be a string");
      RegexOptions ro;
      ro.json_string = true;
      ro.search = true;
      return "\"\\\"\" " + regex_to_gbnf(s["pattern"].get<std::string>(), ro) + " \"\\\"\"";
    }
    if (!min_len && !max_len) return "jstring";
    size_t lo = min_len ? static_cast<size_t>(std::max(0.0, std::ceil(*min_len))) : 0;
    if (max_len && *max_len < static_cast<double>(lo)) unsupported("maxLength", "maxLength is below minLength");
    if (lo > 10000 || (max_len && *max_len > 10000)) unsupported("maxLength", "string lengths above 10000 are not supported");
    std::string rep = "{" + std::to_string(lo) + "," + (max_len ? std::to_string(static_cast<size_t>(*max_len)) : "") + "}";
    return "\"\\\"\" jchar" + rep + " \"\\\"\"";
  }

  std::string number_rule(const Json& s, bool integer) {
    auto mn = num(s, "minimum"), mx = num(s, "maximum"), xmn = num(s, "exclusiveMinimum"), xmx = num(s, "exclusiveMaximum");
    if (!mn && !mx && !xmn && !xmx) return integer ? "jinteger" : "jnumber";
    if (!integer) {
      const char* k = mn ? "minimum" : mx ? "maximum" : xmn ? "exclusiveMinimum" : "exclusiveMaximum";
      unsupported(k, std::string("\"") + k + "\" on a non-integer number is not supported (only on type integer)");
    }
    std::optional<int64_t> lo, hi;
    auto in_range = [](double v, const char* k) {
      if (!(std::fabs(v) < 9e15)) unsupported(k, std::string("\"") + k + "\" beyond +-9e15 is not supported");
      return v;
    };
    if (mn) lo = static_cast<int64_t>(std::ceil(in_range(*mn, "minimum")));
    if (xmn) {
      int64_t v = static_cast<int64_t>(std::floor(in_range(*xmn, "exclusiveMinimum"))) + 1;
      lo = lo ? std::max(*lo, v) : v;
    }
    if (mx) hi = static_cast<int64_t>(std::floor(in_range(*mx, "maximum")));
    if (xmx) {
      int64_t v = static_cast<int64_t>(std::ceil(in_range(*xmx, "exclusiveMaximum"))) - 1;
      hi = hi ? std::min(*hi, v) : v;
    }
    if (lo && hi && *lo > *hi) unsupported("minimum", "no integer lies between the bounds");
    return "(" + int_range_gbnf(lo, hi) + frac_ + ")";
  }

  std::string array_rule(const Json& s) {
    std::vector<Json> tuple;
    std::optional<Json> rest = Json(true);
    if (s.contains("prefixItems")) {
      if (s.contains("items") && s["items"].is_array()) unsupported("items", "prefixItems with a list \"items\"");
      for (const auto& x : s["prefixItems"]) tuple.push_back(x);
      if (s.contains("items")) rest = s["items"];
    } else if (s.contains("items") && s["items"].is_array()) {
      for (const auto& x : s["items"]) tuple.push_back(x);
      if (s.contains("additionalItems")) rest = s["additionalItems"];
    } else if (s.contains("items")) {
      rest = s["items"];
    }
    if (rest->is_boolean() && !rest->get<bool>()) rest.reset();
    size_t k = tuple.size();
    auto mn = num(s, "minItems"), mx = num(s, "maxItems");
    size_t lo = mn ? static_cast<size_t>(std::max(0.0, std::ceil(*mn))) : 0;
    std::optional<size_t> hi;
    if (mx) hi = static_cast<size_t>(std::max(0.0, std::floor(*mx)));
    if (!rest) hi = hi ? std::min(*hi, k) : k;
    if (hi && *hi < lo) unsupported("minItems", "no array length satisfies minItems / maxItems and the items");
    if (lo > 1000 || (hi && *hi > 1000 && *hi != k)) unsupported("maxItems", "array lengths above 1000 are not supported");
    std::vector<std::string> elems;
    for (const auto& t : tuple) {
      if (t.is_boolean() && !t.get<bool>()) {  // no value fits: the array must end before it
        hi = hi ? std::min(*hi, elems.size()) : elems.size();
        break;
      }
      elems.push_back(visit(t, 0));
    }
    k = elems.size();
    if (hi && *hi < lo) unsupported("minItems", "no array length satisfies minItems and the items");
    std::string comma = ws_ + "\",\"" + ws_;
    // Items after the tuple: between max(0, lo - k) and hi - k of them.
    std::string tail;
    size_t m = lo > k ? lo - k : 0;
    bool open = !hi;
    size_t n = hi ? (*hi > k ? *hi - k : 0) : 0;
    if (rest && (open || n > 0)) {
      std::string r = visit(*rest, 0);
      auto rep = [&](size_t a, std::optional<size_t> b) {
        if (!b && a == 0) return std::string("*");
        return "{" + std::to_string(a) + "," + (b ? std::to_string(*b) : "") + "}";
      };
      if (k == 0) {
        std::string more = "(" + comma + r + ")" + rep(m > 0 ? m - 1 : 0, open ? std::nullopt : std::optional<size_t>(n - 1));
        tail = m > 0 ? r + " " + more : "(" + r + " " + more + ")?";
      } else {
        tail = "(" + comma + r + ")" + rep(m, open ? std::nullopt : std::optional<size_t>(n));
      }
    }
    // Tuple items, each optional once lo items are there.
    std::string body = tail;
    for (size_t i = k; i-- > 0;) {
      std::string item = (i ? comma : std::string(" ")) + elems[i] + (body.empty() ? "" : " " + body);
      body = i + 1 > lo ? "(" + item + ")?" : "(" + item + ")";
    }
    return new_rule("\"[\"" + ws_ + body + ws_ + "\"]\"");
  }

  std::string object_rule(const Json& s) {
    if (!s.contains("properties") && !s.contains("required") &&
        (!s.contains("additionalProperties") || s["additionalProperties"] == Json(true)))
      return "jobject";
    std::vector<std::pair<std::string, std::string>> members;  // key, value rule
    std::vector<bool> required;
    std::set<std::string> req;
    if (s.contains("required")) {
      if (!s["required"].is_array()) unsupported("required", "\"required\" must be a list of names");
      for (const auto& r : s["required"]) req.insert(r.get<std::string>());
    }
    std::set<std::string> known;
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) unsupported("properties", "\"properties\" must be an object");
      for (const auto& [k, v] : s["properties"].items()) {
        if (v.is_boolean() && !v.get<bool>()) {
          if (req.count(k)) unsupported("required", "required property \"" + k + "\" has the schema false");
          known.insert(k);  // never present
          continue;
        }
        members.emplace_back(k, visit(v, 0));
        required.push_back(req.count(k) > 0);
        known.insert(k);
      }
    }
    for (const auto& r : req)
      if (!known.count(r)) {
        members.emplace_back(r, "jvalue");
        required.push_back(true);
        known.insert(r);
      }
    if (opts_.sort_properties) {
      std::vector<size_t> order(members.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return members[a].first < members[b].first; });
      std::vector<std::pair<std::string, std::string>> m2;
      std::vector<bool> r2;
      for (size_t i : order) {
        m2.push_back(members[i]);
        r2.push_back(required[i]);
      }
      members = std::move(m2);
      required = std::move(r2);
    }
    std::optional<std::string> extra;
    const Json add = s.contains("additionalProperties") ? s["additionalProperties"] : Json(true);
    if (!(add.is_boolean() && !add.get<bool>())) {
      std::string value = visit(add, 0);
      extra = key_not_in(known) + ws_ + "\":\"" + ws_ + value;
    }
    std::string comma = ws_ + "\",\"" + ws_;
    // R(i, first): the members from index i on; `first` when none is written yet.
    size_t n = members.size();
    std::vector<std::string> names(2 * (n + 1));
    std::string base = "o" + std::to_string(rules_.size());
    for (size_t i = 0; i <= n; ++i)
      for (int f = 0; f < 2; ++f) names[2 * i + f] = base + "-" + std::to_string(i) + (f ? "f" : "");
    for (size_t i = n + 1; i-- > 0;) {
      for (int f = 0; f < 2; ++f) {
        std::string sep = f ? "" : comma;
        std::vector<std::string> a;
        if (i == n) {
          a.push_back("\"\"");
        } else {
          a.push_back(sep + " " + gbnf_literal(Json(members[i].first).dump()) + ws_ + "\":\"" + ws_ + members[i].second +
                      " " + names[2 * (i + 1)]);
          if (!required[i]) a.push_back(names[2 * (i + 1) + f]);
        }
        if (extra) a.push_back(sep + " " + *extra + " " + names[2 * i]);
        rules_[names[2 * i + f]] = alts(a);
      }
    }
    return new_rule("\"{\"" + ws_ + names[1] + ws_ + "\"}\"");
  }

  // A JSON string (with quotes) whose value is none of `keys`: a trie over the keys, leaving it
  // at the first character no key continues with. Escapes in such a key stand for '"', '\\' or a
  // control character, none of which the keys hold, so they always leave the trie.
  std::string key_not_in(const std::set<std::string>& keys) {
    if (keys.empty()) return "jstring";
    for (const auto& k : keys)
      for (unsigned char c : k)
        if (c == '"' || c == '\\' || c < 0x20)
          unsupported("additionalProperties", "additional properties beside property names with escapes are not supported");
    std::string base = "k" + std::to_string(rules_.size());
    std::string esc = "\"\\\\\" ([\"\\\\bfnrt] | \"u00\" [01] [0-9a-fA-F])";
    std::function<std::string(const std::string&)> node = [&](const std::string& prefix) -> std::string {
      std::set<std::string> next;  // next UTF-8 characters after prefix
      bool terminal = false;
      for (const auto& k : keys) {
        if (k.size() < prefix.size() || k.compare(0, prefix.size(), prefix) != 0) continue;
        if (k.size() == prefix.size()) {
          terminal = true;
          continue;
        }
        size_t len = 1;
        unsigned char lead = static_cast<unsigned char>(k[prefix.size()]);
        len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
        next.insert(k.substr(prefix.size(), len));
      }
      std::string name = base + "-" + std::to_string(counter_++);
      std::vector<std::string> a;
      if (!terminal) a.push_back("\"\\\"\"");
      std::string cls = "[^\"\\\\\\x00-\\x1F";
      for (const auto& c : next) cls += c == "-" || c == "]" || c == "^" || c == "[" ? "\\" + c : c;
      cls += "]";
      a.push_back(cls + " jchar* \"\\\"\"");
      a.push_back(esc + " jchar* \"\\\"\"");
      for (const auto& c : next) a.push_back(gbnf_literal(c) + " " + node(prefix + c));
      rules_[name] = alts(a);
      return name;
    };
    return "\"\\\"\" " + node("");
  }

  const Json& root_;
  JsonSchemaOptions opts_;
  std::string ws_;
  std::string frac_;  // after an integer: an optional zero fraction, or nothing
  std::map<std::string, std::string> rules_;
  std::map<std::string, std::string> refs_;
  size_t counter_ = 0;
};

}  // namespace

std::string json_schema_to_gbnf(const Json& schema, const JsonSchemaOptions& opts) { return Compiler(schema, opts).run(); }

std::string json_any_gbnf(bool root_object, bool any_whitespace) {
  JsonSchemaOptions o;
  o.any_whitespace = any_whitespace;
  return json_schema_to_gbnf(root_object ? Json{{"type", "object"}} : Json(true), o);
}

}  // namespace kestrel::grammar
