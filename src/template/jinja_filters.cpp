// Jinja's builtin filters, as the Jinja2 documentation describes them (with Python's
// behaviour for the values), plus transformers' tojson (ensure_ascii=False, key order kept).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

#include "template/jinja_interp.h"
#include "template/jinja_parser.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

using FilterFn = Value (*)(Interp&, const Value&, CallArgs&);

// ---- helpers ----

std::string str_of(Interp& in, const Value& v) { return to_str(v, in.budget()); }

int64_t int_of(Interp& in, const Value& v, const char* what) {
  if (v.is_int() || v.is_bool()) return v.as_int();
  in.fail(std::string(what) + " must be an integer, not " + v.type_name());
}

bool bool_of(const Value* v, bool fallback) { return v != nullptr ? v->truthy() : fallback; }

size_t length_of(Interp& in, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return utf8_length(v.str());
    case Value::Kind::List:
      if (v.flavor() == SeqFlavor::Generator) in.fail("object of type 'generator' has no len()");
      return v.items().size();
    case Value::Kind::Dict: return v.dict_obj().items.size();
    default: in.fail("object of type '" + v.type_name() + "' has no len()");
  }
}

// Jinja's attribute paths for filters: "a.b.0" looks up a, then b, then index 0 (item first).
Value resolve_path(Interp& in, const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits && part.size() < 18) {
      v = in.get_item(v, Value(static_cast<int64_t>(std::stoll(part))));
    } else {
      v = in.get_item(v, Value(part));
    }
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

// Sort keys for case-insensitive comparison (strings lowered), as Jinja's ignore_case.
Value fold_case(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value(py_lower(v.str()));
  return v;
}

// -1, 0, 1 with a total order on NaN (after every number); errors for unorderable types.
int order(Interp& in, const Value& a, const Value& b) {
  const std::optional<int> c = compare(a, b, in.budget());
  if (!c) in.fail("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
  if (*c != 2) return *c;
  const bool a_nan = a.is_float() && std::isnan(a.as_double());
  const bool b_nan = b.is_float() && std::isnan(b.as_double());
  return a_nan == b_nan ? 0 : (a_nan ? 1 : -1);
}

// A stable merge sort that stays in bounds whatever the comparator answers (std::sort may not).
template <class T, class Less>
void merge_sort(std::vector<T>& v, Less less) {
  std::vector<T> buf(v.size());
  for (size_t width = 1; width < v.size(); width *= 2) {
    for (size_t lo = 0; lo < v.size(); lo += 2 * width) {
      const size_t mid = std::min(lo + width, v.size());
      const size_t hi = std::min(lo + 2 * width, v.size());
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) buf[k++] = less(v[j], v[i]) ? v[j++] : v[i++];
      while (i < mid) buf[k++] = v[i++];
      while (j < hi) buf[k++] = v[j++];
    }
    v.swap(buf);
  }
}

std::vector<std::string> split_attributes(const Value* attr, Interp& in) {
  std::vector<std::string> out;
  if (attr == nullptr || attr->is_none()) return out;
  if (attr->is_int()) return {std::to_string(attr->as_int())};
  const std::string s = str_of(in, *attr);
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    std::string part = py_strip(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start), std::nullopt, true, true);
    out.push_back(part);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Value key_of(Interp& in, const Value& item, const std::vector<std::string>& attrs, bool case_sensitive) {
  if (attrs.empty()) return fold_case(item, case_sensitive);
  if (attrs.size() == 1) return fold_case(resolve_path(in, item, attrs[0]), case_sensitive);
  std::vector<Value> parts;
  for (const std::string& a : attrs) parts.push_back(fold_case(resolve_path(in, item, a), case_sensitive));
  return Value::list(std::move(parts), true);
}

// ---- filters ----

Value f_abs(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "abs", args, {});
  in.require_defined(v);
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  if (v.is_number()) {
    if (v.as_int() == INT64_MIN) in.fail("integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  in.fail("bad operand type for abs(): '" + v.type_name() + "'");
}

Value f_attr(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "attr", args, {"name"});
  if (!a.has(0)) in.fail("attr() needs a name");
  if (v.is_dict() && !has_method(v, str_of(in, *a.get(0)))) return Value::undefined("'dict object' has no attribute '" + str_of(in, *a.get(0)) + "'");
  return in.get_attr(v, str_of(in, *a.get(0)));
}

Value f_batch(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "batch", args, {"linecount", "fill_with"});
  if (!a.has(0)) in.fail("batch() needs a linecount");
  const int64_t n = int_of(in, *a.get(0), "batch linecount");
  if (n <= 0) in.fail("batch linecount must be positive");
  std::vector<Value> out, cur;
  for (Value& item : in.iterate(v)) {
    cur.push_back(std::move(item));
    if (static_cast<int64_t>(cur.size()) == n) out.push_back(in.make_list(std::move(cur))), cur.clear();
  }
  if (!cur.empty()) {
    if (a.has(1)) {
      while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*a.get(1));
    }
    out.push_back(in.make_list(std::move(cur)));
  }
  return in.make_seq(std::move(out), SeqFlavor::Generator);
}

Value f_capitalize(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "capitalize", args, {});
  return in.make_string(py_capitalize(str_of(in, v)));
}

Value f_center(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "center", args, {"width"});
  const std::string s = str_of(in, v);
  const int64_t width = a.has(0) ? int_of(in, *a.get(0), "center width") : 80;
  const auto len = static_cast<int64_t>(utf8_length(s));
  if (width <= len) return Value(s);
  in.budget().check_bytes(static_cast<size_t>(width));
  const int64_t total = width - len;
  // Python's str.center puts the extra space on the left when the total is odd and width is odd.
  const int64_t left = total / 2 + (total & width & 1);
  return in.make_string(std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(total - left), ' '));
}

Value f_length(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "length", args, {});
  return Value(static_cast<int64_t>(length_of(in, v)));
}

Value f_default(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "default", args, {"default_value", "boolean"});
  const bool boolean = bool_of(a.get(1), false);
  if (v.is_undefined() || (boolean && !v.truthy())) return a.value_or(0, Value(""));
  return v;
}

Value f_dictsort(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "dictsort", args, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) in.fail("dictsort: you can only sort by either \"key\" or \"value\" of a mapping, got " + v.type_name());
  const bool cs = bool_of(a.get(0), false);
  const std::string by = a.has(1) ? str_of(in, *a.get(1)) : "key";
  if (by != "key" && by != "value") in.fail("dictsort: you can only sort by either \"key\" or \"value\"");
  const bool reverse = bool_of(a.get(2), false);
  std::vector<Value> pairs;
  for (const auto& [k, val] : v.dict_obj().items) pairs.push_back(Value::list({k, val}, true));
  const size_t idx = by == "key" ? 0 : 1;
  in.budget().charge(pairs.size() * 8);
  merge_sort(pairs, [&](const Value& x, const Value& y) {
    const int c = order(in, fold_case(x.items()[idx], cs), fold_case(y.items()[idx], cs));
    return reverse ? c > 0 : c < 0;
  });
  return in.make_list(std::move(pairs));
}

Value f_escape(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "escape", args, {});
  return in.make_string(html_escape(str_of(in, v)));
}

Value f_first(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "first", args, {});
  if (v.is_list()) return v.items().empty() ? Value::undefined("No first item, sequence was empty.") : v.items().front();
  if (v.is_string()) {
    if (v.str().empty()) return Value::undefined("No first item, sequence was empty.");
    size_t i = 0;
    utf8_next(v.str(), i);
    return Value(v.str().substr(0, i));
  }
  std::vector<Value> items = in.iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "last", args, {});
  std::vector<Value> items = v.is_list() ? v.items() : in.iterate(v);  // dicts: their last key
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

std::optional<double> parse_py_float(const std::string& text) {
  std::string s;
  for (char c : py_strip(text, std::nullopt, true, true)) {
    if (c != '_') s += c;
  }
  if (s.empty() || s.find_first_of("xXpP") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return d;
}

std::optional<int64_t> parse_py_int(const std::string& text, int base) {
  std::string s = py_strip(text, std::nullopt, true, true);
  bool neg = false;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (base == 0 || base == 16 || base == 8 || base == 2) {
    if (i + 1 < s.size() && s[i] == '0') {
      const char p = static_cast<char>(s[i + 1] | 0x20);
      const int prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
      if (prefixed != 0 && (base == 0 || base == prefixed)) {
        base = prefixed;
        i += 2;
      }
    }
    if (base == 0) base = 10;
  }
  if (base < 2 || base > 36) return std::nullopt;
  std::string digits;
  for (; i < s.size(); ++i) {
    if (s[i] == '_' && !digits.empty() && i + 1 < s.size() && s[i + 1] != '_') continue;
    digits += s[i];
  }
  if (digits.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(digits.c_str(), &end, base);
  if (end != digits.c_str() + digits.size() || errno != 0 || digits[0] == '-' || digits[0] == '+' || digits[0] == ' ') return std::nullopt;
  return neg ? -v : v;
}

Value f_float(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "float", args, {"default"});
  in.require_defined(v);
  if (v.is_number()) return Value(v.as_double());
  if (v.is_string()) {
    if (auto d = parse_py_float(v.str())) return Value(*d);
  }
  return a.value_or(0, Value(0.0));
}

Value f_int(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "int", args, {"default", "base"});
  in.require_defined(v);
  const Value fallback = a.value_or(0, Value(int64_t{0}));
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) {
    const double d = std::trunc(v.as_double());
    if (!(d >= -9.2e18 && d <= 9.2e18)) return fallback;
    return Value(static_cast<int64_t>(d));
  }
  if (v.is_string()) {
    const int base = a.has(1) ? static_cast<int>(int_of(in, *a.get(1), "int base")) : 10;
    if (auto i = parse_py_int(v.str(), base)) return Value(*i);
    if (auto d = parse_py_float(v.str())) {
      if (*d >= -9.2e18 && *d <= 9.2e18) return Value(static_cast<int64_t>(std::trunc(*d)));
    }
  }
  return fallback;
}

Value f_format(Interp& in, const Value& v, CallArgs& args) {
  const std::string fmt = str_of(in, v);
  if (!args.kw.empty()) {
    if (!args.pos.empty()) in.fail("format() takes either positional or keyword arguments, not both");
    std::vector<std::pair<Value, Value>> kw;
    for (auto& [k, val] : args.kw) kw.emplace_back(Value(k), val);
    return in.make_string(percent_format(in, fmt, Value::dict(std::move(kw))));
  }
  return in.make_string(percent_format(in, fmt, Value::list(args.pos, true)));
}

Value f_indent(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "indent", args, {"width", "first", "blank"});
  std::string pad = "    ";
  if (a.has(0)) {
    if (a.get(0)->is_string()) {
      pad = a.get(0)->str();
    } else {
      const int64_t w = int_of(in, *a.get(0), "indent width");
      in.budget().check_bytes(static_cast<size_t>(std::max<int64_t>(0, w)));
      pad = std::string(static_cast<size_t>(std::max<int64_t>(0, w)), ' ');
    }
  }
  const bool first = bool_of(a.get(1), false);
  const bool blank = bool_of(a.get(2), false);
  // Jinja appends a newline first, so a trailing newline yields one more (empty) line.
  const std::vector<std::string> lines = py_splitlines(str_of(in, v) + "\n");
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      out += '\n';
      if (blank || !lines[i].empty()) out += pad;
    }
    out += lines[i];
    in.budget().check_bytes(out.size());
  }
  if (first) out = pad + out;
  return in.make_string(std::move(out));
}

Value f_items(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "items", args, {});
  if (v.is_undefined()) return in.make_seq({}, SeqFlavor::Generator);
  if (!v.is_dict()) in.fail("Can only get item pairs from a mapping.");
  std::vector<Value> pairs;
  for (const auto& [k, val] : v.dict_obj().items) pairs.push_back(Value::list({k, val}, true));
  return in.make_seq(std::move(pairs), SeqFlavor::Generator);
}

Value f_join(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "join", args, {"d", "attribute"});
  const std::string sep = a.has(0) ? str_of(in, *a.get(0)) : "";
  const std::vector<std::string> attrs = split_attributes(a.get(1), in);
  std::string out;
  bool first = true;
  for (const Value& item : in.iterate(v)) {
    if (!first) out += sep;
    first = false;
    append_str(out, attrs.empty() ? item : resolve_path(in, item, attrs[0]), in.budget());
    in.budget().check_bytes(out.size());
  }
  return in.make_string(std::move(out));
}

Value f_list(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "list", args, {});
  return in.make_list(in.iterate(v));
}

Value f_lower(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "lower", args, {});
  return in.make_string(py_lower(str_of(in, v)));
}

Value f_upper(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "upper", args, {});
  return in.make_string(py_upper(str_of(in, v)));
}

Value f_map(Interp& in, const Value& v, CallArgs& args) {
  std::vector<Value> out;
  const std::vector<Value> items = in.iterate(v);
  const auto attr = std::find_if(args.kw.begin(), args.kw.end(), [](const auto& kv) { return kv.first == "attribute"; });
  if (attr != args.kw.end()) {
    const Value* dflt = nullptr;
    for (const auto& [k, val] : args.kw) {
      if (k == "default") dflt = &val;
      else if (k != "attribute") in.fail("map() got an unexpected keyword argument '" + k + "'");
    }
    const std::vector<std::string> path = split_attributes(&attr->second, in);
    for (const Value& item : items) {
      Value x = resolve_path(in, item, path.empty() ? "" : path[0]);
      if (x.is_undefined() && dflt != nullptr) x = *dflt;
      out.push_back(std::move(x));
    }
    return in.make_seq(std::move(out), SeqFlavor::Generator);
  }
  if (args.pos.empty()) in.fail("map() needs a filter name or attribute=");
  const std::string name = str_of(in, args.pos[0]);
  if (!is_known_filter(name)) in.fail("no filter named '" + name + "'");
  CallArgs rest;
  rest.pos.assign(args.pos.begin() + 1, args.pos.end());
  rest.kw = args.kw;
  for (const Value& item : items) {
    CallArgs each = rest;
    out.push_back(apply_filter(in, name, item, each));
  }
  return in.make_seq(std::move(out), SeqFlavor::Generator);
}

Value min_max(Interp& in, const Value& v, CallArgs& args, bool want_max) {
  ArgBinder a(in, want_max ? "max" : "min", args, {"case_sensitive", "attribute"});
  const bool cs = bool_of(a.get(0), false);
  const std::vector<std::string> attrs = split_attributes(a.get(1), in);
  const std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined(std::string("No aggregated item, sequence was empty."));
  size_t best = 0;
  Value best_key = key_of(in, items[0], attrs, cs);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key_of(in, items[i], attrs, cs);
    const int c = order(in, k, best_key);
    if (want_max ? c > 0 : c < 0) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

Value f_max(Interp& in, const Value& v, CallArgs& args) { return min_max(in, v, args, true); }
Value f_min(Interp& in, const Value& v, CallArgs& args) { return min_max(in, v, args, false); }

Value f_pprint(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "pprint", args, {});
  return in.make_string(to_repr(v, in.budget()));
}

// select / reject / selectattr / rejectattr
Value select_common(Interp& in, const Value& v, CallArgs& args, bool attr_mode, bool keep_if) {
  std::string attr;
  size_t next = 0;
  if (attr_mode) {
    if (args.pos.empty()) in.fail("selectattr/rejectattr need an attribute name");
    attr = str_of(in, args.pos[0]);
    next = 1;
  }
  std::string test;
  CallArgs test_args;
  if (args.pos.size() > next) {
    test = str_of(in, args.pos[next]);
    if (!is_known_test(test)) in.fail("no test named '" + test + "'");
    test_args.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(next + 1), args.pos.end());
  }
  test_args.kw = args.kw;
  std::vector<Value> out;
  for (const Value& item : in.iterate(v)) {
    const Value subject = attr_mode ? resolve_path(in, item, attr) : item;
    bool ok = false;
    if (test.empty()) {
      ok = subject.truthy();
    } else {
      CallArgs each = test_args;
      ok = apply_test(in, test, subject, each);
    }
    if (ok == keep_if) out.push_back(item);
  }
  return in.make_seq(std::move(out), SeqFlavor::Generator);
}

Value f_select(Interp& in, const Value& v, CallArgs& args) { return select_common(in, v, args, false, true); }
Value f_reject(Interp& in, const Value& v, CallArgs& args) { return select_common(in, v, args, false, false); }
Value f_selectattr(Interp& in, const Value& v, CallArgs& args) { return select_common(in, v, args, true, true); }
Value f_rejectattr(Interp& in, const Value& v, CallArgs& args) { return select_common(in, v, args, true, false); }

Value f_replace(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "replace", args, {"old", "new", "count"});
  if (!a.has(0) || !a.has(1)) in.fail("replace() needs old and new strings");
  const int64_t count = a.has(2) && !a.get(2)->is_none() ? int_of(in, *a.get(2), "replace count") : -1;
  const std::string s = str_of(in, v);
  std::string out;
  if (!py_replace(s, str_of(in, *a.get(0)), str_of(in, *a.get(1)), count, in.budget().max_bytes, out)) in.budget().fail_bytes();
  return in.make_string(std::move(out));
}

Value f_reverse(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "reverse", args, {});
  if (v.is_string()) {
    std::vector<std::string_view> chars = utf8_chars(v.str());
    std::string out;
    out.reserve(v.str().size());
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
    return in.make_string(std::move(out));
  }
  std::vector<Value> items = in.iterate(v);
  std::reverse(items.begin(), items.end());
  // reversed() of a sequence is an iterator; a generator cannot be reversed, so Jinja lists it.
  if (v.is_list() && v.flavor() == SeqFlavor::Generator) return in.make_list(std::move(items));
  return in.make_seq(std::move(items), SeqFlavor::Generator);
}

Value f_round(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "round", args, {"precision", "method"});
  in.require_defined(v);
  if (!v.is_number()) in.fail("round() needs a number, not " + v.type_name());
  const int64_t precision = a.has(0) ? int_of(in, *a.get(0), "round precision") : 0;
  const std::string method = a.has(1) ? str_of(in, *a.get(1)) : "common";
  if (method != "common" && method != "ceil" && method != "floor") in.fail("method must be common, ceil or floor");
  if (precision > 300 || precision < -300) in.fail("round precision out of range");
  if (method == "common") {
    if (!v.is_float()) {
      if (precision >= 0) return Value(v.as_int());
      const double p = std::pow(10.0, static_cast<double>(-precision));
      return Value(static_cast<int64_t>(std::nearbyint(static_cast<double>(v.as_int()) / p) * p));
    }
    const double x = v.as_double();
    if (!std::isfinite(x)) return v;
    if (precision >= 0) {
      // printf rounds the exact binary value half-to-even, as Python's round does.
      char buf[400];
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), x);
      return Value(std::strtod(buf, nullptr));
    }
    const double p = std::pow(10.0, static_cast<double>(-precision));
    return Value(std::nearbyint(x / p) * p);
  }
  const double p = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * p;
  return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / p);
}

Value f_safe(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "safe", args, {});
  return v.is_string() ? v : in.make_string(str_of(in, v));
}

Value f_sort(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "sort", args, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = bool_of(a.get(0), false);
  const bool cs = bool_of(a.get(1), false);
  const std::vector<std::string> attrs = split_attributes(a.get(2), in);
  std::vector<Value> items = in.iterate(v);
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  for (Value& item : items) {
    Value k = key_of(in, item, attrs, cs);
    keyed.emplace_back(std::move(k), std::move(item));
  }
  in.budget().charge(keyed.size() * 8);
  merge_sort(keyed, [&](const auto& x, const auto& y) {
    const int c = order(in, x.first, y.first);
    return reverse ? c > 0 : c < 0;
  });
  std::vector<Value> out;
  out.reserve(keyed.size());
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return in.make_list(std::move(out));
}

Value f_string(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "string", args, {});
  return v.is_string() ? v : in.make_string(str_of(in, v));
}

Value f_sum(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "sum", args, {"attribute", "start"});
  const std::vector<std::string> attrs = split_attributes(a.get(0), in);
  Value total = a.value_or(1, Value(int64_t{0}));
  for (const Value& item : in.iterate(v)) {
    const Value x = attrs.empty() ? item : resolve_path(in, item, attrs[0]);
    in.require_defined(x);
    if (!x.is_number() || !total.is_number()) in.fail("unsupported operand type(s) for +: '" + total.type_name() + "' and '" + x.type_name() + "'");
    if (!x.is_float() && !total.is_float()) {
      int64_t r = 0;
      if (__builtin_add_overflow(total.as_int(), x.as_int(), &r)) in.fail("integer overflow");
      total = Value(r);
    } else {
      total = Value(total.as_double() + x.as_double());
    }
  }
  return total;
}

Value f_title(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "title", args, {});
  return in.make_string(jinja_title(str_of(in, v)));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
Value f_tojson(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonFormat fmt;
  fmt.ensure_ascii = bool_of(a.get(0), false);
  if (a.has(1) && !a.get(1)->is_none()) {
    const Value& ind = *a.get(1);
    if (ind.is_string()) {
      fmt.indent = ind.str();
    } else {
      const int64_t n = int_of(in, ind, "tojson indent");
      if (n > 1024) in.fail("tojson indent too large");
      fmt.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, n)), ' ');
    }
    fmt.item_separator = ",";
  }
  if (a.has(2) && !a.get(2)->is_none()) {
    const Value& sep = *a.get(2);
    if (!sep.is_list() || sep.items().size() != 2 || !sep.items()[0].is_string() || !sep.items()[1].is_string()) {
      in.fail("tojson separators must be a pair of strings");
    }
    fmt.item_separator = sep.items()[0].str();
    fmt.key_separator = sep.items()[1].str();
  }
  fmt.sort_keys = bool_of(a.get(3), false);
  std::string out;
  append_json(out, v, fmt, in.budget());
  return in.make_string(std::move(out));
}

Value f_trim(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "trim", args, {"chars"});
  std::optional<std::string> chars;
  if (a.has(0) && !a.get(0)->is_none()) chars = str_of(in, *a.get(0));
  return in.make_string(py_strip(str_of(in, v), chars, true, true));
}

Value f_truncate(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "truncate", args, {"length", "killwords", "end", "leeway"});
  const std::string s = str_of(in, v);
  const int64_t length = a.has(0) ? int_of(in, *a.get(0), "truncate length") : 255;
  const bool killwords = bool_of(a.get(1), false);
  const std::string end = a.has(2) ? str_of(in, *a.get(2)) : "...";
  const int64_t leeway = a.has(3) && !a.get(3)->is_none() ? int_of(in, *a.get(3), "truncate leeway") : 5;
  const std::vector<std::string_view> chars = utf8_chars(s);
  const auto n = static_cast<int64_t>(chars.size());
  const auto end_len = static_cast<int64_t>(utf8_length(end));
  if (length < end_len) in.fail("expected length >= " + std::to_string(end_len) + ", got " + std::to_string(length));
  if (leeway < 0) in.fail("expected leeway >= 0, got " + std::to_string(leeway));
  if (n <= length + leeway) return v.is_string() ? v : Value(s);
  std::string head;
  for (int64_t i = 0; i < length - end_len && i < n; ++i) head += chars[static_cast<size_t>(i)];
  if (!killwords) {
    const size_t sp = head.rfind(' ');
    if (sp != std::string::npos) head = head.substr(0, sp);
  }
  return in.make_string(head + end);
}

Value f_unique(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "unique", args, {"case_sensitive", "attribute"});
  const bool cs = bool_of(a.get(0), false);
  const std::vector<std::string> attrs = split_attributes(a.get(1), in);
  std::vector<Value> out, seen;
  for (const Value& item : in.iterate(v)) {
    Value k = key_of(in, item, attrs, cs);
    bool dup = false;
    for (const Value& s : seen) {
      if (equals(s, k, in.budget())) {
        dup = true;
        break;
      }
    }
    if (dup) continue;
    seen.push_back(std::move(k));
    out.push_back(item);
  }
  return in.make_seq(std::move(out), SeqFlavor::Generator);
}

Value f_wordcount(Interp& in, const Value& v, CallArgs& args) {
  ArgBinder a(in, "wordcount", args, {});
  const std::string s = str_of(in, v);
  int64_t n = 0;
  bool in_word = false;
  for (size_t i = 0; i < s.size();) {
    const uint32_t cp = utf8_next(s, i);
    const bool w = cp == '_' || is_alnum_cp(cp);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value(n);
}

const std::unordered_map<std::string_view, FilterFn>& filters() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"abs", f_abs},         {"attr", f_attr},       {"batch", f_batch},         {"capitalize", f_capitalize},
      {"center", f_center},   {"count", f_length},    {"d", f_default},           {"default", f_default},
      {"dictsort", f_dictsort}, {"e", f_escape},      {"escape", f_escape},       {"first", f_first},
      {"float", f_float},     {"forceescape", f_escape}, {"format", f_format},    {"indent", f_indent},
      {"int", f_int},         {"items", f_items},     {"join", f_join},           {"last", f_last},
      {"length", f_length},   {"list", f_list},       {"lower", f_lower},         {"map", f_map},
      {"max", f_max},         {"min", f_min},         {"pprint", f_pprint},       {"reject", f_reject},
      {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse}, {"round", f_round},
      {"safe", f_safe},       {"select", f_select},   {"selectattr", f_selectattr}, {"sort", f_sort},
      {"string", f_string},   {"sum", f_sum},         {"title", f_title},         {"tojson", f_tojson},
      {"trim", f_trim},       {"truncate", f_truncate}, {"unique", f_unique},     {"upper", f_upper},
      {"wordcount", f_wordcount},
  };
  return table;
}

}  // namespace

bool is_known_filter(std::string_view name) { return filters().count(name) != 0; }

Value apply_filter(Interp& in, std::string_view name, const Value& v, CallArgs& args) {
  const auto it = filters().find(name);
  if (it == filters().end()) in.fail("no filter named '" + std::string(name) + "'");
  return it->second(in, v, args);
}


}  // namespace kestrel::jinja
