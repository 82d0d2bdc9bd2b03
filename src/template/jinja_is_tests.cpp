// Jinja's builtin tests ("x is defined", "n is divisibleby 3"), as the Jinja2 documentation
// describes them, with Python's behaviour for the values. (Tests in Jinja's sense, not unit tests.)
#include <cmath>
#include <string>
#include <unordered_map>

#include "template/jinja_interp.h"
#include "template/jinja_parser.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

using TestFn = bool (*)(Interp&, const Value&, CallArgs&);

std::string str_of(Interp& in, const Value& v) { return to_str(v, in.budget()); }

const Value& test_arg(Interp& in, CallArgs& args, const char* name) {
  if (args.pos.size() != 1 || !args.kw.empty()) in.fail(std::string("test '") + name + "' takes one argument");
  return args.pos[0];
}

void no_args(Interp& in, CallArgs& args, const char* name) {
  if (!args.pos.empty() || !args.kw.empty()) in.fail(std::string("test '") + name + "' takes no arguments");
}

bool cmp_test(Interp& in, const Value& v, CallArgs& args, const char* name, int want_lo, int want_hi) {
  const Value& other = test_arg(in, args, name);
  in.require_defined(v);
  in.require_defined(other);
  const std::optional<int> c = compare(v, other, in.budget());
  if (!c) in.fail(std::string("'") + name + "' not supported between instances of '" + v.type_name() + "' and '" + other.type_name() + "'");
  return *c != 2 && *c >= want_lo && *c <= want_hi;
}

#define KESTREL_JINJA_TEST(fn_name, test_name, expr)             \
  bool fn_name(Interp& in, const Value& v, CallArgs& args) {     \
    no_args(in, args, test_name);                                 \
    (void)v;                                                      \
    return (expr);                                                \
  }

KESTREL_JINJA_TEST(t_boolean, "boolean", v.is_bool())
KESTREL_JINJA_TEST(t_callable, "callable", (v.is_object() && v.object().callable()) || v.is_undefined())
KESTREL_JINJA_TEST(t_defined, "defined", !v.is_undefined())
KESTREL_JINJA_TEST(t_undefined, "undefined", v.is_undefined())
KESTREL_JINJA_TEST(t_escaped, "escaped", false)
KESTREL_JINJA_TEST(t_false, "false", v.is_bool() && !v.as_bool())
KESTREL_JINJA_TEST(t_true, "true", v.is_bool() && v.as_bool())
KESTREL_JINJA_TEST(t_float, "float", v.is_float())
KESTREL_JINJA_TEST(t_integer, "integer", v.is_int())
KESTREL_JINJA_TEST(t_number, "number", v.is_number())
KESTREL_JINJA_TEST(t_string, "string", v.is_string())
KESTREL_JINJA_TEST(t_mapping, "mapping", v.is_dict())
KESTREL_JINJA_TEST(t_iterable, "iterable", v.is_string() || v.is_list() || v.is_dict() || v.is_undefined())
KESTREL_JINJA_TEST(t_sequence, "sequence", v.is_string() || v.is_indexable() || v.is_dict() || v.is_undefined())
KESTREL_JINJA_TEST(t_none, "none", v.is_none())
KESTREL_JINJA_TEST(t_filter, "filter", v.is_string() && is_known_filter(v.str()))
KESTREL_JINJA_TEST(t_test, "test", v.is_string() && is_known_test(v.str()))

#undef KESTREL_JINJA_TEST

// Jinja's lower/upper tests look at str(value).
bool t_lower(Interp& in, const Value& v, CallArgs& args) {
  no_args(in, args, "lower");
  const std::string s = str_of(in, v);
  bool cased = false;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    if (is_upper_cp(cp)) return false;
    cased = cased || is_lower_cp(cp);
  }
  return cased;
}

bool t_upper(Interp& in, const Value& v, CallArgs& args) {
  no_args(in, args, "upper");
  const std::string s = str_of(in, v);
  bool cased = false;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    if (is_lower_cp(cp)) return false;
    cased = cased || is_upper_cp(cp);
  }
  return cased;
}

// value % 2 as Python computes it (0 or 1; 1.5 for 3.5, which is neither odd nor even).
double mod2(Interp& in, const Value& v, const char* name) {
  in.require_defined(v);
  if (!v.is_number()) in.fail(std::string("test '") + name + "' needs a number, not " + v.type_name());
  if (!v.is_float()) return static_cast<double>(((v.as_int() % 2) + 2) % 2);
  double m = std::fmod(v.as_double(), 2.0);
  if (m < 0) m += 2.0;
  return m;
}

bool t_even(Interp& in, const Value& v, CallArgs& args) {
  no_args(in, args, "even");
  return mod2(in, v, "even") == 0.0;
}

bool t_odd(Interp& in, const Value& v, CallArgs& args) {
  no_args(in, args, "odd");
  return mod2(in, v, "odd") == 1.0;
}

bool t_divisibleby(Interp& in, const Value& v, CallArgs& args) {
  const Value& n = test_arg(in, args, "divisibleby");
  in.require_defined(v);
  if (!v.is_number() || !n.is_number()) in.fail("divisibleby needs numbers");
  if (n.as_double() == 0.0) in.fail("integer division or modulo by zero");
  if (!v.is_float() && !n.is_float()) return n.as_int() == -1 || v.as_int() % n.as_int() == 0;
  return std::fmod(v.as_double(), n.as_double()) == 0.0;
}

bool t_eq(Interp& in, const Value& v, CallArgs& args) { return equals(v, test_arg(in, args, "eq"), in.budget()); }
bool t_ne(Interp& in, const Value& v, CallArgs& args) { return !equals(v, test_arg(in, args, "ne"), in.budget()); }
bool t_lt(Interp& in, const Value& v, CallArgs& args) { return cmp_test(in, v, args, "<", -1, -1); }
bool t_le(Interp& in, const Value& v, CallArgs& args) { return cmp_test(in, v, args, "<=", -1, 0); }
bool t_gt(Interp& in, const Value& v, CallArgs& args) { return cmp_test(in, v, args, ">", 1, 1); }
bool t_ge(Interp& in, const Value& v, CallArgs& args) { return cmp_test(in, v, args, ">=", 0, 1); }

bool t_in(Interp& in, const Value& v, CallArgs& args) {
  const Value& seq = test_arg(in, args, "in");
  if (seq.is_string()) {
    if (!v.is_string()) in.fail("'in <string>' requires string as left operand, not " + v.type_name());
    return seq.str().find(v.str()) != std::string::npos;
  }
  if (seq.is_dict()) return seq.dict_obj().find(v) != nullptr;
  for (const Value& x : in.iterate(seq)) {
    if (equals(v, x, in.budget())) return true;
  }
  return false;
}

bool t_sameas(Interp& in, const Value& v, CallArgs& args) {
  const Value& other = test_arg(in, args, "sameas");
  if (v.kind() != other.kind()) return false;
  switch (v.kind()) {
    case Value::Kind::List: return &v.list_obj() == &other.list_obj();
    case Value::Kind::Dict: return &v.dict_obj() == &other.dict_obj();
    case Value::Kind::Object: return v.object_ptr() == other.object_ptr();
    case Value::Kind::Float: return false;  // a new float object each time in Python
    default: return equals(v, other, in.budget());
  }
}

const std::unordered_map<std::string_view, TestFn>& tests() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"boolean", t_boolean}, {"callable", t_callable}, {"defined", t_defined},   {"undefined", t_undefined},
      {"divisibleby", t_divisibleby}, {"eq", t_eq},     {"equalto", t_eq},        {"==", t_eq},
      {"ne", t_ne},           {"!=", t_ne},             {"escaped", t_escaped},   {"even", t_even},
      {"odd", t_odd},         {"false", t_false},       {"true", t_true},         {"filter", t_filter},
      {"test", t_test},       {"float", t_float},       {"integer", t_integer},   {"number", t_number},
      {"string", t_string},   {"mapping", t_mapping},   {"iterable", t_iterable}, {"sequence", t_sequence},
      {"none", t_none},       {"ge", t_ge},             {">=", t_ge},             {"gt", t_gt},
      {"greaterthan", t_gt},  {">", t_gt},              {"le", t_le},             {"<=", t_le},
      {"lt", t_lt},           {"lessthan", t_lt},       {"<", t_lt},              {"in", t_in},
      {"lower", t_lower},     {"upper", t_upper},       {"sameas", t_sameas},
  };
  return table;
}

}  // namespace

bool is_known_test(std::string_view name) { return tests().count(name) != 0; }

bool apply_test(Interp& in, std::string_view name, const Value& v, CallArgs& args) {
  const auto it = tests().find(name);
  if (it == tests().end()) in.fail("no test named '" + std::string(name) + "'");
  return it->second(in, v, args);
}

}  // namespace kestrel::jinja
